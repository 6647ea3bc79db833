// Element types shared by the CUDA kernels of every op family and their
// launchers' declarations (csrc/cuda/<family>_kernels.h): torch-free, and
// free of device code, so the host-compiled registrations include it too.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace nanfree {
namespace gpu {

// Accumulation type: fp16/bf16/float accumulate in float, double in double.
template <typename scalar_t>
struct AccOf {
  using type = float;
};
template <>
struct AccOf<double> {
  using type = double;
};
template <typename scalar_t>
using acc_of_t = typename AccOf<scalar_t>::type;

}  // namespace gpu
}  // namespace nanfree
