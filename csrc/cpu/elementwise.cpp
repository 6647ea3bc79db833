// CPU kernels of the elementwise family: the unary ops <op>, <op>_backward
// and <op>_out of csrc/registration.cpp, one TensorIterator loop per op and
// order that applies nanfree/elementwise_math.h to each element. Contiguous
// runs go through the header's functions instantiated with ATen's vectors
// (float16 and bfloat16 widened to float), other runs element by element with
// the scalar instantiation. TensorIterator gives the output torch's layout
// (the input's strides when dense, channels-last kept; <op>_out writes in
// `out`'s) and splits the work over threads.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/TensorIterator.h>
#include <torch/library.h>

#include <cstdint>
#include <cstdlib>
#include <limits>
#include <memory>
#include <string>
#include <tuple>
#include <type_traits>

#include "cpu/vec_math.h"  // before the headers: their vector primitives
#include "cpu/vec.h"

// MKL's vector math functions (VML), weakly linked: nullptr where the torch this
// extension links has no MKL. ATen's own float log, acos and asin call them; here
// they give the value of acos and asin at the op's domain clamp (about 1 ulp;
// on Intel's CPUs several times faster than Sleef's AVX-512 functions, elsewhere
// slower: vml_enabled below), and
// of log and log1p in float64 and where float has no AVX-512. Float log and
// log1p on AVX-512 go through the vector loop instead: vec_double_math.h's
// (float32 results; faster than VML and correctly rounded) and, for log with
// bfloat16 and float16 results, vec_float_math.h's log (float arithmetic). The length is
// passed as 64-bit, right for MKL's LP64 and ILP64 interfaces for lengths below 2^31 (a chunk of kVmlChunk here). The mode is
// ATen's: high accuracy (VML_HA), subnormals kept (VML_FTZDAZ_OFF: a float
// input of 1e-45 is not 0), no error handling (VML_ERRMODE_IGNORE: log(0) and
// the like set no status; without it they are slower and serialize threads).
extern "C" {
void vmsLn(int64_t n, const float* a, float* r, int64_t mode) __attribute__((weak));
void vmdLn(int64_t n, const double* a, double* r, int64_t mode) __attribute__((weak));
void vmsAcos(int64_t n, const float* a, float* r, int64_t mode) __attribute__((weak));
void vmdAcos(int64_t n, const double* a, double* r, int64_t mode) __attribute__((weak));
void vmsAsin(int64_t n, const float* a, float* r, int64_t mode) __attribute__((weak));
void vmdAsin(int64_t n, const double* a, double* r, int64_t mode) __attribute__((weak));
}

#include "common/elementwise_op.h"
#include "nanfree/elementwise_math.h"

namespace nanfree {
namespace {

using cpu::Vec;

template <typename T>
using VmlFunction = void (*)(int64_t, const T*, T*, int64_t);

constexpr int64_t kVmlMode = 0x2 | 0x140000 | 0x100;  // VML_HA | VML_FTZDAZ_OFF | VML_ERRMODE_IGNORE

// Whether the values take VML where this file would call it (NANFREE_CPU_VML=auto|0|1,
// read once; auto: on Intel's CPUs). On an AMD EPYC with AVX-512, VML's float acos took
// 3.4 ms for 4M values against 1.2 ms for ATen's Sleef vectors (2 threads); on the Intel
// Xeons this file was first measured on, VML was the faster. 0 and 1 let the tests run
// both paths on one machine.
bool vml_enabled() {
  static const bool enabled = [] {
    const char* value = std::getenv("NANFREE_CPU_VML");
    const std::string choice = value == nullptr ? "auto" : value;
    TORCH_CHECK(choice == "auto" || choice == "0" || choice == "1",
                "NANFREE_CPU_VML must be auto, 0 or 1, not '", choice, "'");
    if (choice != "auto") return choice == "1";
    __builtin_cpu_init();
    return __builtin_cpu_is("intel") != 0;
  }();
  return enabled;
}

// The VML function of the op's value (log1p's through ln), or nullptr.
template <UnaryOp op, typename T>
VmlFunction<T> vml_function() {
  constexpr bool is_float = std::is_same_v<T, float>;
  if (!vml_enabled()) return nullptr;  // ATen's Sleef vectors (the header's functions)
#if defined(CPU_CAPABILITY_AVX512)
  constexpr bool own_log = is_float;  // vec_double_math.h's and vec_float_math.h's: faster, within an ulp
#else
  constexpr bool own_log = false;
#endif
  if constexpr ((op == UnaryOp::kLog || op == UnaryOp::kLog1p) && !own_log) {
    if constexpr (is_float) return &vmsLn; else return &vmdLn;
  } else if constexpr (op == UnaryOp::kAcos) {
    if constexpr (is_float) return &vmsAcos; else return &vmdAcos;
  } else if constexpr (op == UnaryOp::kAsin) {
    if constexpr (is_float) return &vmsAsin; else return &vmdAsin;
  }
  return nullptr;  // sqrt (one vector instruction already); log and log1p of own_log
}

// log1p(d) from u = 1 + d (rounded) and ln(u): ln(u) - ((u - 1) - d) / u
// corrects u's rounding to first order (within about one ulp of d's log1p).
template <typename V>
V log1p_from_log(const V& d, const V& u, const V& ln_u, const V& inf) {
  const V corrected = ln_u - ((u - V(1)) - d) / u;
  // u == 1: |d| below half an ulp of 1, where log1p(d) = d; u == 0 (d = -1) and
  // u == inf: ln(u) = -inf or inf is the value, where the correction would be
  // 0 / 0 or inf - inf (NaN). A NaN d fails all three and stays NaN.
  return nf_where(u == V(1), d, nf_where((u == V(0)) | (u == inf), ln_u, corrected));
}

constexpr int64_t kVmlChunk = 8192;

// out = <op>(x) for a contiguous run of n through VML: the header's domain
// clamp into a chunk of acc_t, VML in place, log1p's correction, the store.
template <UnaryOp op, typename scalar_t, typename acc_t>
void unary_values_vml(const scalar_t* x, scalar_t* out, int64_t n, VmlFunction<acc_t> vml) {
  using V = Vec<acc_t>;
  const int64_t size = std::min(kVmlChunk, n);
  const std::unique_ptr<acc_t[]> domain_buffer(new acc_t[size]), values_buffer(new acc_t[size]);
  acc_t* domain = domain_buffer.get();
  acc_t* values = values_buffer.get();
  const V inf(std::numeric_limits<acc_t>::infinity());
  constexpr bool is_log = op == UnaryOp::kLog || op == UnaryOp::kLog1p;
  for (int64_t j = 0; j < n; j += kVmlChunk) {
    const int64_t chunk = std::min(kVmlChunk, n - j);
    for (int64_t k = 0; k < chunk; k += V::size()) {
      const int64_t count = std::min<int64_t>(V::size(), chunk - k);
      const V d = unary_domain<op>(cpu::load_vec(x + j + k, count));
      d.store(domain + k, count);
      const V arg = op == UnaryOp::kLog1p ? d + V(1) : d;
      // VML takes a slow path for a block holding a special case: log's argument 0
      // (the domain's edge, where the value is log(0) = -inf, put back below) goes in as 1.
      (is_log ? nf_where(arg == V(0), V(1), arg) : arg).store(values + k, count);
    }
    vml(chunk, values, values, kVmlMode);
    for (int64_t k = 0; k < chunk; k += V::size()) {
      const int64_t count = std::min<int64_t>(V::size(), chunk - k);
      V y = V::loadu(values + k, count);
      if constexpr (is_log) {
        const V d = V::loadu(domain + k, count);
        const V arg = op == UnaryOp::kLog1p ? d + V(1) : d;
        y = nf_where(arg == V(0), -inf, y);  // log(0), the value at the domain's edge
        if constexpr (op == UnaryOp::kLog1p) y = log1p_from_log(d, arg, y, inf);
      }
      cpu::store_vec<scalar_t>(y, out + j + k, count);
    }
  }
}

// unary_element for results stored as scalar_t. log's value for bfloat16 and
// float16 results on AVX-512: the header's log_value (the log of the domain
// clamp) with vec_float_math.h's float-arithmetic log, accurate far beyond
// their rounding, at 0.65x the time of the correctly rounded one.
template <UnaryOp op, int order, typename scalar_t, typename acc_t>
Vec<acc_t> stored_element(const Vec<acc_t>& g, const Vec<acc_t>& x, const Vec<acc_t>& bound) {
#if defined(CPU_CAPABILITY_AVX512)
  if constexpr (op == UnaryOp::kLog && order == 0 && !std::is_same_v<scalar_t, acc_t>) {
    return cpu::log_narrow_vec(unary_domain<op>(x));
  }
#endif
  return unary_element<op, order>(g, x, bound);
}

// Runs the op over iter: operands (out, x) for order 0, (out, grad, x) else.
template <UnaryOp op, int order, typename scalar_t>
void unary_loop(at::TensorIteratorBase& iter) {
  using acc_t = at::opmath_type<scalar_t>;
  using V = Vec<acc_t>;
  constexpr int kTensors = order == 0 ? 2 : 3;
  constexpr int64_t kSize = static_cast<int64_t>(sizeof(scalar_t));
  const acc_t bound = static_cast<acc_t>(largest_finite(iter.dtype(0)));
  const V bound_vec(bound);
  // The values' C library function from VML (nullptr: the header's vector functions).
  const VmlFunction<acc_t> vml = order == 0 ? vml_function<op, acc_t>() : nullptr;
  iter.for_each([&](char** data, const int64_t* strides, int64_t n0, int64_t n1) {
    bool contiguous = true;
    for (int t = 0; t < kTensors; ++t) contiguous = contiguous && strides[t] == kSize;
    for (int64_t i1 = 0; i1 < n1; ++i1) {
      char* ptr[kTensors];
      for (int t = 0; t < kTensors; ++t) ptr[t] = data[t] + i1 * strides[kTensors + t];
      auto* out = reinterpret_cast<scalar_t*>(ptr[0]);
      const auto* x = reinterpret_cast<const scalar_t*>(ptr[kTensors - 1]);
      const auto* g = reinterpret_cast<const scalar_t*>(ptr[1]);  // read for order > 0 only
      if constexpr (order == 0) {
        if (contiguous && vml != nullptr) {
          unary_values_vml<op>(x, out, n0, vml);
          continue;
        }
      }
      if (contiguous) {
        int64_t j = 0;
        if constexpr (!std::is_same_v<scalar_t, acc_t>) {
          // float16 / bfloat16: one stored vector is two float vectors.
          using S = Vec<scalar_t>;
          for (; j + S::size() <= n0; j += S::size()) {
            auto [x0, x1] = at::vec::convert_to_float<scalar_t>(S::loadu(x + j));
            V g0(acc_t(0)), g1(acc_t(0));
            if constexpr (order > 0) std::tie(g0, g1) = at::vec::convert_to_float<scalar_t>(S::loadu(g + j));
            cpu::narrow_pair<scalar_t>(stored_element<op, order, scalar_t>(g0, x0, bound_vec),
                                       stored_element<op, order, scalar_t>(g1, x1, bound_vec))
                .store(out + j);
          }
        }
        for (; j < n0; j += V::size()) {
          const int64_t count = std::min<int64_t>(V::size(), n0 - j);
          const V xv = cpu::load_vec(x + j, count);
          const V gv = order == 0 ? V(acc_t(0)) : cpu::load_vec(g + j, count);
          cpu::store_vec<scalar_t>(stored_element<op, order, scalar_t>(gv, xv, bound_vec), out + j, count);
        }
      } else {
        for (int64_t j = 0; j < n0; ++j) {
          const acc_t xs = *reinterpret_cast<const scalar_t*>(ptr[kTensors - 1] + j * strides[kTensors - 1]);
          const acc_t gs = order == 0 ? acc_t(0)
                                      : acc_t(*reinterpret_cast<const scalar_t*>(ptr[1] + j * strides[1]));
          *reinterpret_cast<scalar_t*>(ptr[0] + j * strides[0]) =
              static_cast<scalar_t>(unary_element<op, order>(gs, xs, bound));
        }
      }
    }
  });
}

template <UnaryOp op, int order>
void run_unary(at::TensorIteratorBase& iter) {
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, iter.dtype(0),
                                  "nanfree_elementwise_unary_cpu",
                                  [&] { unary_loop<op, order, scalar_t>(iter); });
}

template <UnaryOp op>
struct CpuUnaryKernels {
  static at::Tensor forward(const at::Tensor& input) {
    const at::Tensor x = unary_operand(op, input);
    const at::Tensor undefined_output;  // allocated by the iterator, in torch's layout
    at::TensorIterator iter =
        at::TensorIteratorConfig().add_output(undefined_output).add_const_input(x).build();
    run_unary<op, 0>(iter);
    return iter.output();
  }

  // Into `out`, of any strides (the iterator refuses one that overlaps itself,
  // as torch's out= does); computed first where it overlaps the input partly.
  static void forward_out(const at::Tensor& input, const at::Tensor& out) {
    const at::Tensor x = unary_operand(op, input);
    check_out(unary_op_name(op), out, x.sizes(), x.scalar_type(), x);
    if (overlaps_partly(out, x)) {
      out.copy_(forward(input));
      return;
    }
    at::TensorIterator iter = at::TensorIteratorConfig().add_output(out).add_const_input(x).build();
    run_unary<op, 0>(iter);
  }

  static at::Tensor backward(const at::Tensor& grad, const at::Tensor& input, int64_t order) {
    check_unary_backward(op, grad, input, order);
    const at::Tensor undefined_output;
    at::TensorIterator iter = at::TensorIteratorConfig()
                                  .add_output(undefined_output)
                                  .add_const_input(grad)
                                  .add_const_input(input)
                                  .build();
    if (order == 1) {
      run_unary<op, 1>(iter);
    } else {
      run_unary<op, 2>(iter);
    }
    return iter.output();
  }
};

}  // namespace

TORCH_LIBRARY_IMPL(nanfree, CPU, m) {
  register_unary_kernels<CpuUnaryKernels>(m);
  register_unary_out_kernels<CpuUnaryKernels>(m);
}

}  // namespace nanfree
