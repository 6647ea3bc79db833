// Shared internals of the elementwise family's CUDA kernels
// (elementwise_kernels.cu, elementwise_binary_kernels.cu): the launch of a
// flat grid-stride kernel and the alignment test of its vector accesses.
#pragma once

#include <cstdint>

#include "cuda/device_common.cuh"

namespace nanfree {
namespace gpu {
namespace elementwise_flat {

constexpr int kThreads = 256;

// Whether p allows 16-byte vector accesses: null (not read), read at one
// element (step 0), or 16-byte aligned.
template <typename scalar_t>
bool vector_aligned(const scalar_t* p, int64_t step = 1) {
  return p == nullptr || step == 0 || reinterpret_cast<uintptr_t>(p) % 16 == 0;
}

// kernel<<<enough blocks of kThreads for `work` threads, at most kMaxBlocks>>>(args).
template <typename... Params, typename... Args>
cudaError_t launch(void (*kernel)(Params...), int64_t work, cudaStream_t stream, Args... args) {
  const int64_t blocks = detail::ceil_div(work, kThreads);
  kernel<<<static_cast<unsigned>(blocks < detail::kMaxBlocks ? blocks : detail::kMaxBlocks), kThreads,
           0, stream>>>(static_cast<Params>(args)...);
  return cudaGetLastError();
}

}  // namespace elementwise_flat
}  // namespace gpu
}  // namespace nanfree
