// Launch limits that the emulated CUDA builds change per variant
// (tests/cuda_emulation), so that the suite's small problems take the paths a
// GPU takes only on large ones: every grid-stride loop iterating, the MNR
// driver's chunk loop, the cosine family's warp-per-row kernels.
//
// NANFREE_CUDA_LIMIT(name, gpu_value) declares `name`: a constant of
// gpu_value in the CUDA build; in an emulated build the value of this
// process's variant (NANFREE_CUDA_EMULATION), read once when the library
// loads, so that one build serves every variant of the same compiler flags.
#pragma once

#include <cstdint>

#if defined(NANFREE_CUDA_EMULATION)
namespace cuda_emulation {
// The variant's value of the limit `name`, or gpu_value where the variant keeps
// the GPU's (tests/cuda_emulation/runtime.cpp).
int64_t variant_limit(const char* name, int64_t gpu_value);
}  // namespace cuda_emulation
#define NANFREE_CUDA_LIMIT(name, gpu_value) \
  inline const int64_t name = ::cuda_emulation::variant_limit(#name, gpu_value)
#else
#define NANFREE_CUDA_LIMIT(name, gpu_value) constexpr int64_t name = gpu_value
#endif
