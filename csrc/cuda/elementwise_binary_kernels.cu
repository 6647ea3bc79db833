// CUDA kernels of the elementwise family's binary ops (launchers declared in
// elementwise_binary_kernels.h): one grid-stride loop per op, order, partial
// and element type (and one per op and type writing both gradients) over flat arrays, 16-byte vector accesses when every
// pointer of a full-length operand allows them (a step-0 operand is one
// element, read once per vector), each element through binary_element of
// nanfree/elementwise_binary_math.h in the accumulation type; pow with a
// one-element exponent that pow_at_exponent knows (2, 3, 0.5, -0.5, -1, -2: a
// Python number) through that form (a * a for 2), as the CPU kernels.
#include <cstdint>
#include <type_traits>

#include "cuda/device_common.cuh"
#include "cuda/elementwise_flat.cuh"
#include "cuda/elementwise_binary_kernels.h"
#include "nanfree/elementwise_binary_math.h"

namespace nanfree {
namespace gpu {
namespace {

using namespace detail;

using elementwise_flat::kThreads;
using elementwise_flat::vector_aligned;

// kVec entries of an operand from position i: a vector, or its one element
// in every entry (step 0).
template <int kVec, typename scalar_t, typename acc_t>
__device__ __forceinline__ void load_operand(const scalar_t* p, int64_t step, int64_t i,
                                             acc_t (&out)[kVec]) {
  if (step == 0) {
    const acc_t v = to_acc(p[0]);
#pragma unroll
    for (int k = 0; k < kVec; ++k) out[k] = v;
  } else {
    load_acc<kVec>(p + i, out);
  }
}

// One element of op's order and partial; for pow where the exponent is e for
// every element (kOther: not known), pow_at_exponent's form, as the CPU kernels.
template <BinaryOp op, PowExponent e, int order, int partial, typename T>
__device__ __forceinline__ T element_at(T g, T a, T b, T bound) {
  if constexpr (op == BinaryOp::kPow) {
    return pow_element_at_exponent<e, order, partial>(g, a, b, bound);
  } else {
    return binary_element<op, order, partial>(g, a, b, bound);
  }
}

// f(std::integral_constant<PowExponent, e>): e the kind of pow's one-element
// exponent b[0] where `known` (pow with a form of its own for the order and
// partial in play) and b has one element, else kOther. Every thread reads the
// same b[0], so the kind is the same grid-wide: no divergence.
template <bool known, typename scalar_t, typename F>
__device__ __forceinline__ void with_exponent_of(const scalar_t* b, int64_t b_step, F&& f) {
  if constexpr (known) {
    if (b_step == 0) {
      with_pow_exponent(pow_exponent_kind(static_cast<double>(to_acc(b[0]))), f);
      return;
    }
  }
  f(std::integral_constant<PowExponent, PowExponent::kOther>{});
}

// Elements [0, n) in chunks of kVec (the caller makes n a multiple of kVec for
// kVec > 1 and passes the tail to a kVec = 1 launch), with pow's exponent kind e.
template <BinaryOp op, PowExponent e, int order, int partial, int kVec, typename scalar_t>
__device__ __forceinline__ void binary_loop(const scalar_t* __restrict__ grad,
                                            const scalar_t* __restrict__ a, int64_t a_step,
                                            const scalar_t* __restrict__ b, int64_t b_step,
                                            int64_t n, scalar_t* __restrict__ out) {
  using acc_t = acc_of_t<scalar_t>;
  const acc_t bound = largest_finite<scalar_t>();
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x * kVec;
  for (int64_t i = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) * kVec; i < n;
       i += stride) {
    acc_t as[kVec], bs[kVec], gs[kVec], ys[kVec];
    load_operand<kVec>(a, a_step, i, as);
    load_operand<kVec>(b, b_step, i, bs);
    if constexpr (order > 0) {
      load_acc<kVec>(grad + i, gs);
    } else {
#pragma unroll
      for (int k = 0; k < kVec; ++k) gs[k] = acc_t(0);
    }
#pragma unroll
    for (int k = 0; k < kVec; ++k) {
      ys[k] = element_at<op, e, order, partial>(gs[k], as[k], bs[k], bound);
    }
    store_acc<kVec>(out + i, ys);
  }
}

template <BinaryOp op, int order, int partial, int kVec, typename scalar_t>
__global__ void __launch_bounds__(kThreads)
    binary_kernel(const scalar_t* __restrict__ grad, const scalar_t* __restrict__ a,
                  int64_t a_step, const scalar_t* __restrict__ b, int64_t b_step, int64_t n,
                  scalar_t* __restrict__ out) {
  // pow_element_at_exponent's own forms: the value, d/da and d2/da2 (partial 0).
  with_exponent_of<op == BinaryOp::kPow && partial == 0>(b, b_step, [&](auto e) {
    binary_loop<op, decltype(e)::value, order, partial, kVec>(grad, a, a_step, b, b_step, n, out);
  });
}

// Both gradients of elements [0, n) in chunks of kVec (as binary_loop).
template <BinaryOp op, PowExponent e, int kVec, typename scalar_t>
__device__ __forceinline__ void gradients_loop(const scalar_t* __restrict__ grad,
                                               const scalar_t* __restrict__ a, int64_t a_step,
                                               const scalar_t* __restrict__ b, int64_t b_step,
                                               int64_t n, scalar_t* __restrict__ grad_a,
                                               scalar_t* __restrict__ grad_b) {
  using acc_t = acc_of_t<scalar_t>;
  const acc_t bound = largest_finite<scalar_t>();
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x * kVec;
  for (int64_t i = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) * kVec; i < n;
       i += stride) {
    acc_t as[kVec], bs[kVec], gs[kVec], ga[kVec], gb[kVec];
    load_operand<kVec>(a, a_step, i, as);
    load_operand<kVec>(b, b_step, i, bs);
    load_acc<kVec>(grad + i, gs);
#pragma unroll
    for (int k = 0; k < kVec; ++k) {
      // binary_gradients' two order-1 elements, d/da at pow's known exponent.
      ga[k] = element_at<op, e, 1, 0>(gs[k], as[k], bs[k], bound);
      gb[k] = element_at<op, e, 1, 1>(gs[k], as[k], bs[k], bound);
    }
    store_acc<kVec>(grad_a + i, ga);
    store_acc<kVec>(grad_b + i, gb);
  }
}

template <BinaryOp op, int kVec, typename scalar_t>
__global__ void __launch_bounds__(kThreads)
    gradients_kernel(const scalar_t* __restrict__ grad, const scalar_t* __restrict__ a,
                     int64_t a_step, const scalar_t* __restrict__ b, int64_t b_step, int64_t n,
                     scalar_t* __restrict__ grad_a, scalar_t* __restrict__ grad_b) {
  with_exponent_of<op == BinaryOp::kPow>(b, b_step, [&](auto e) {  // d/da's own form
    gradients_loop<op, decltype(e)::value, kVec>(grad, a, a_step, b, b_step, n, grad_a, grad_b);
  });
}

}  // namespace

template <BinaryOp op, typename scalar_t>
cudaError_t binary_gradients_elementwise(const scalar_t* grad, const scalar_t* a,
                                         int64_t a_step, const scalar_t* b, int64_t b_step,
                                         int64_t n, scalar_t* grad_a, scalar_t* grad_b,
                                         cudaStream_t stream) {
  if (n <= 0) return cudaSuccess;
  constexpr int kVec = vec_width<scalar_t>();
  const bool vec = vector_aligned(a, a_step) && vector_aligned(b, b_step) &&
                   vector_aligned(grad) && vector_aligned(grad_a) && vector_aligned(grad_b);
  const int64_t body = vec ? n / kVec * kVec : 0;
  if (body > 0) {
    const cudaError_t error =
        elementwise_flat::launch(gradients_kernel<op, kVec, scalar_t>, body / kVec, stream, grad, a,
                                 a_step, b, b_step, body, grad_a, grad_b);
    if (error != cudaSuccess || body == n) return error;
  }
  return elementwise_flat::launch(gradients_kernel<op, 1, scalar_t>, n - body, stream, grad + body,
                                  a + body * a_step, a_step, b + body * b_step, b_step, n - body,
                                  grad_a + body, grad_b + body);
}

template <BinaryOp op, int order, int partial, typename scalar_t>
cudaError_t binary_elementwise(const scalar_t* grad, const scalar_t* a, int64_t a_step,
                               const scalar_t* b, int64_t b_step, int64_t n, scalar_t* out,
                               cudaStream_t stream) {
  if (n <= 0) return cudaSuccess;
  constexpr int kVec = vec_width<scalar_t>();
  const bool vec = vector_aligned(a, a_step) && vector_aligned(b, b_step) &&
                   vector_aligned(out, 1) && (order == 0 || vector_aligned(grad, 1));
  const int64_t body = vec ? n / kVec * kVec : 0;
  if (body > 0) {
    const cudaError_t error =
        elementwise_flat::launch(binary_kernel<op, order, partial, kVec, scalar_t>, body / kVec,
                                 stream, grad, a, a_step, b, b_step, body, out);
    if (error != cudaSuccess || body == n) return error;
  }
  // The elements after the last whole vector (all of them when a pointer is not aligned).
  return elementwise_flat::launch(binary_kernel<op, order, partial, 1, scalar_t>, n - body,
                                  stream, order > 0 ? grad + body : grad, a + body * a_step, a_step,
                                  b + body * b_step, b_step, n - body, out + body);
}

NANFREE_BINARY_LAUNCHERS(, float)
NANFREE_BINARY_LAUNCHERS(, double)
NANFREE_BINARY_LAUNCHERS(, __half)
NANFREE_BINARY_LAUNCHERS(, __nv_bfloat16)

}  // namespace gpu
}  // namespace nanfree
