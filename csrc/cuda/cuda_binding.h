// What the CUDA registrations (csrc/cuda/<family>.cpp) take from the CUDA
// runtime through ATen: the current stream, the check of a launcher's
// cudaError_t, the dispatch key they register at, and the GEMMs of fp16 /
// bf16 operands with a float32 result that only CUDA has.
//
// The emulated build (NANFREE_CUDA_EMULATION, test-only: tests/cuda_emulation)
// compiles the same registrations with the host compiler and runs the kernels
// on CPU tensors through an emulation of the CUDA execution model: there the
// kernels register at the CPU key, there is no stream (launches run
// synchronously), the device guards of the registrations are no-ops on CPU
// tensors, and the GEMMs are the CPU's.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <cuda_runtime_api.h>
#include <torch/version.h>

#if defined(NANFREE_CUDA_EMULATION)

#define NANFREE_CUDA_DISPATCH_KEY CPU
#define NANFREE_CUDA_CHECK(expr)                                                         \
  do {                                                                                   \
    const cudaError_t nanfree_cuda_status = (expr);                                      \
    TORCH_CHECK(nanfree_cuda_status == cudaSuccess, "nanfree (emulated CUDA): ",          \
                cudaGetErrorString(nanfree_cuda_status));                                 \
  } while (0)

// aten::mm.dtype and aten::addmm.dtype_out have CUDA kernels only: the CPU
// GEMM multiplies the operands converted to float32 (the same exact products,
// summed in float32).
#define NANFREE_MM_FLOAT32 1
#define NANFREE_ADDMM_FLOAT32 1

namespace nanfree {
inline cudaStream_t current_cuda_stream() { return nullptr; }
inline at::Tensor mm_float32(const at::Tensor& a, const at::Tensor& b) {
  return at::mm(a.to(at::kFloat), b.to(at::kFloat));
}
inline void addmm_float32(at::Tensor& out, const at::Tensor& a, const at::Tensor& b) {
  out.addmm_(a.to(at::kFloat), b.to(at::kFloat));
}
}  // namespace nanfree

#else

#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>

#define NANFREE_CUDA_DISPATCH_KEY CUDA
#define NANFREE_CUDA_CHECK(expr) C10_CUDA_CHECK(expr)

// aten::mm.dtype (float32 output of fp16 / bf16 operands) exists from torch 2.8.
#define NANFREE_MM_FLOAT32 \
  (TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 8))
// aten::addmm.dtype_out accepts a float32 `self` (the accumulator itself) with
// half operands since pytorch#167931 (late 2025; 2.11 is a safe bound); before,
// `self` had to have the operands' dtype, so the product is added separately.
#define NANFREE_ADDMM_FLOAT32 \
  (TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 11))

namespace nanfree {
inline cudaStream_t current_cuda_stream() { return c10::cuda::getCurrentCUDAStream(); }
#if NANFREE_MM_FLOAT32
inline at::Tensor mm_float32(const at::Tensor& a, const at::Tensor& b) {
  return at::mm(a, b, at::kFloat);
}
#endif
#if NANFREE_ADDMM_FLOAT32
inline void addmm_float32(at::Tensor& out, const at::Tensor& a, const at::Tensor& b) {
  at::addmm_out(out, out, a, b, at::kFloat);
}
#endif
}  // namespace nanfree

#endif
