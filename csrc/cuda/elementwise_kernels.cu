// CUDA kernels of the elementwise family (launchers declared in
// elementwise_kernels.h): one grid-stride loop per op, order and element type
// over flat arrays, 16-byte vector accesses when every pointer allows them,
// each element through unary_element of nanfree/elementwise_math.h in the
// accumulation type (float; double for double).
#include <cstdint>

#include "cuda/device_common.cuh"
#include "cuda/elementwise_flat.cuh"
#include "cuda/elementwise_kernels.h"
#include "nanfree/elementwise_math.h"

namespace nanfree {
namespace gpu {
namespace {

using namespace detail;

using elementwise_flat::kThreads;
using elementwise_flat::vector_aligned;

// Elements [0, n) in chunks of kVec (the caller makes n a multiple of kVec for
// kVec > 1 and passes the tail to a kVec = 1 launch).
template <UnaryOp op, int order, int kVec, typename scalar_t>
__global__ void __launch_bounds__(kThreads)
    unary_kernel(const scalar_t* __restrict__ grad, const scalar_t* __restrict__ x, int64_t n,
                 scalar_t* __restrict__ out) {
  using acc_t = acc_of_t<scalar_t>;
  const acc_t bound = largest_finite<scalar_t>();
  const int64_t step = static_cast<int64_t>(gridDim.x) * blockDim.x * kVec;
  for (int64_t i = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) * kVec; i < n;
       i += step) {
    acc_t xs[kVec], gs[kVec], ys[kVec];
    load_acc<kVec>(x + i, xs);
    if constexpr (order > 0) {
      load_acc<kVec>(grad + i, gs);
    } else {
#pragma unroll
      for (int k = 0; k < kVec; ++k) gs[k] = acc_t(0);
    }
#pragma unroll
    for (int k = 0; k < kVec; ++k) ys[k] = unary_element<op, order>(gs[k], xs[k], bound);
    store_acc<kVec>(out + i, ys);
  }
}

}  // namespace

template <UnaryOp op, int order, typename scalar_t>
cudaError_t unary_elementwise(const scalar_t* grad, const scalar_t* x, int64_t n, scalar_t* out,
                              cudaStream_t stream) {
  if (n <= 0) return cudaSuccess;
  constexpr int kVec = vec_width<scalar_t>();
  const bool vec = vector_aligned(x) && vector_aligned(out) && (order == 0 || vector_aligned(grad));
  const int64_t body = vec ? n / kVec * kVec : 0;
  if (body > 0) {
    const cudaError_t error =
        elementwise_flat::launch(unary_kernel<op, order, kVec, scalar_t>, body / kVec, stream, grad,
                                 x, body, out);
    if (error != cudaSuccess || body == n) return error;
  }
  // The elements after the last whole vector (all of them when a pointer is not aligned).
  return elementwise_flat::launch(unary_kernel<op, order, 1, scalar_t>, n - body, stream,
                                  order > 0 ? grad + body : grad, x + body, n - body, out + body);
}

NANFREE_UNARY_LAUNCHERS(, float)
NANFREE_UNARY_LAUNCHERS(, double)
NANFREE_UNARY_LAUNCHERS(, __half)
NANFREE_UNARY_LAUNCHERS(, __nv_bfloat16)

}  // namespace gpu
}  // namespace nanfree
