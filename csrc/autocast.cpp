// Autocast of every nanfree op, in one table, registered once for every
// backend: at an Autocast<Device> dispatch key, a kernel casts the op's
// floating inputs as autocast casts those of the torch op it replaces (the
// policies of csrc/common/autocast.h), then calls the op again with that key
// excluded. The autocast keys sit above autograd and the device kernels, so
// one registration serves every backend. An op without an entry here is left
// alone by autocast (the device's fallthrough kernel runs it at its inputs'
// dtypes), as torch leaves the ops it replaces on that device.
//
// | op                                  | CUDA autocast           | CPU autocast           |
// |-------------------------------------|-------------------------|------------------------|
// | softmax, log_softmax (fp32_set_opt_dtype), logsumexp (fp32) | float32 | left alone   |
// | normalize (its norm: fp32), cosine_similarity (fp32) | float32 | left alone            |
// | cos_sim_matrix (torch.mm: lower precision)  | autocast dtype   | autocast dtype          |
// | gem (pow is on the fp32 list)       | float32                 | left alone             |
// | mnr_loss, mnr_loss_backward (cross_entropy: fp32) | float32   | float32                |
// | log, log1p, acos, asin, pow (fp32)  | float32                 | left alone             |
// | atan2 (promote)                     | float32 if an input is  | left alone             |
// | sqrt, xlogy, xlog1py, div_no_nan    | left alone              | left alone             |
// | losses (pointwise_loss, cross_entropy): in nanfree/_ops/losses.py | float32 | float32  |
//
// The losses family casts in Python (autocast_to_float32): every loss of
// torch's runs in float32 under autocast, and binary_cross_entropy is refused
// under CUDA autocast, which a cast policy cannot express.
// nanfree.ops.softmax(..., dtype=...) excludes autocast itself, as torch's
// fp32_set_opt_dtype does when a dtype is given. sentence-transformers'
// cos_sim (F.normalize, then mm) returns the lower-precision dtype under
// autocast, and so does cos_sim_matrix. The MNR loss is computed in float32
// from float32 embeddings, as the composed loss's cross_entropy is, and no
// GEMM inside its kernels is lowered by autocast.
#include <ATen/autocast_mode.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/library.h>

#include <optional>
#include <tuple>

#include "common/autocast.h"
#include "common/find_op.h"
#include "common/softmax_op.h"  // forward_name

namespace nanfree {
namespace {

template <SoftmaxKind kind, c10::DispatchKey key>
std::tuple<at::Tensor, at::Tensor> softmax_in_float32(const at::Tensor& input, int64_t dim,
                                                      const std::optional<at::Tensor>& mask) {
  static const auto op = find_op<SoftmaxForwardSignature>(forward_name(kind));
  const c10::impl::ExcludeDispatchKeyGuard no_autocast(key);
  return op.call(autocast_to_float(input), dim, mask);
}

template <c10::DispatchKey key>
std::tuple<at::Tensor, at::Tensor> normalize_in_float32(const at::Tensor& input, double eps) {
  static const auto op = find_op<NormalizeSignature>("nanfree::normalize");
  const c10::impl::ExcludeDispatchKeyGuard no_autocast(key);
  return op.call(autocast_to_float(input), eps);
}

template <c10::DispatchKey key>
std::tuple<at::Tensor, at::Tensor> cosine_in_float32(const at::Tensor& x1, const at::Tensor& x2,
                                                     double eps) {
  static const auto op = find_op<CosineSignature>("nanfree::cosine_similarity");
  const c10::impl::ExcludeDispatchKeyGuard no_autocast(key);
  return op.call(autocast_to_float(x1), autocast_to_float(x2), eps);
}

template <c10::DispatchKey key, c10::DeviceType device>
at::Tensor cos_sim_matrix_in_lower_precision(const at::Tensor& a, const at::Tensor& b) {
  static const auto op = find_op<CosSimMatrixSignature>("nanfree::cos_sim_matrix");
  const c10::impl::ExcludeDispatchKeyGuard no_autocast(key);
  return op.call(autocast_to_lower_precision(a, device), autocast_to_lower_precision(b, device));
}

template <c10::DispatchKey key>
std::tuple<at::Tensor, at::Tensor> gem_in_float32(const at::Tensor& input,
                                                  const std::optional<at::Tensor>& p,
                                                  double p_value, double eps,
                                                  const std::optional<at::Tensor>& mask) {
  static const auto op = find_op<GemSignature>("nanfree::gem");
  const c10::impl::ExcludeDispatchKeyGuard no_autocast(key);
  return op.call(autocast_to_float(input), p, p_value, eps, mask);
}

template <c10::DispatchKey key>
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> mnr_loss_in_float32(
    const at::Tensor& queries, at::TensorList docs, const std::optional<at::Tensor>& scale,
    double scale_value, int64_t offset, int64_t rows, int64_t owned_blocks, int64_t directions,
    bool per_direction, int64_t hardness_mode, double hardness_strength, int64_t reduction,
    bool grad) {
  static const auto op = find_op<MnrLossSignature>("nanfree::mnr_loss");
  const c10::impl::ExcludeDispatchKeyGuard no_autocast(key);
  return op.call(autocast_to_float(queries), autocast_to_float(docs), autocast_to_float(scale),
                 scale_value, offset, rows, owned_blocks, directions, per_direction,
                 hardness_mode, hardness_strength, reduction, grad);
}

template <c10::DispatchKey key>
std::tuple<at::Tensor, at::Tensor, at::Tensor> mnr_loss_backward_in_float32(
    const at::Tensor& grad_loss, const at::Tensor& queries, at::TensorList docs,
    const std::optional<at::Tensor>& scale, double scale_value, const at::Tensor& stats,
    int64_t offset, int64_t rows, int64_t owned_blocks, int64_t directions, bool per_direction,
    int64_t hardness_mode, double hardness_strength, int64_t reduction) {
  static const auto op = find_op<MnrLossBackwardSignature>("nanfree::mnr_loss_backward");
  const c10::impl::ExcludeDispatchKeyGuard no_autocast(key);
  return op.call(autocast_to_float(grad_loss), autocast_to_float(queries),
                 autocast_to_float(docs), autocast_to_float(scale), scale_value,
                 autocast_to_float(stats), offset, rows, owned_blocks, directions, per_direction,
                 hardness_mode, hardness_strength, reduction);
}

// The elementwise unary op `name` in float32 (torch's fp32 policy for log, log1p,
// acos, asin on CUDA).
template <c10::DispatchKey key, const char* name>
at::Tensor elementwise_unary_in_float32(const at::Tensor& input) {
  static const auto op = find_op<at::Tensor(const at::Tensor&)>(name);
  const c10::impl::ExcludeDispatchKeyGuard no_autocast(key);
  return op.call(autocast_to_float(input));
}

using ElementwiseBinarySignature = at::Tensor(const at::Tensor&, const at::Tensor&);

template <c10::DispatchKey key>
at::Tensor pow_in_float32(const at::Tensor& input, const at::Tensor& exponent) {
  static const auto op = find_op<ElementwiseBinarySignature>("nanfree::pow");
  const c10::impl::ExcludeDispatchKeyGuard no_autocast(key);
  return op.call(autocast_to_float(input), autocast_to_float(exponent));
}

// atan2 under torch's promote policy, through torch's own promote_type and
// cached_cast: the autocast-eligible inputs (floating, on the device, not
// float64) go to float32 if one is float32, else stay at the autocast dtype;
// an eligible input of another lower precision (bfloat16 under float16
// autocast) is refused as torch.atan2 refuses it. The op's own type promotion
// follows.
template <c10::DispatchKey key>
at::Tensor atan2_promoted(const at::Tensor& input, const at::Tensor& other) {
  static const auto op = find_op<ElementwiseBinarySignature>("nanfree::atan2");
  const c10::impl::ExcludeDispatchKeyGuard no_autocast(key);
  constexpr auto device = c10::DeviceType::CUDA;
  const at::ScalarType type = at::autocast::promote_type(
      at::autocast::get_lower_precision_fp_from_device_type(device), device, input, other);
  return op.call(at::autocast::cached_cast(type, input, device),
                 at::autocast::cached_cast(type, other, device));
}

constexpr char kLogName[] = "nanfree::log";
constexpr char kLog1pName[] = "nanfree::log1p";
constexpr char kAcosName[] = "nanfree::acos";
constexpr char kAsinName[] = "nanfree::asin";

}  // namespace

TORCH_LIBRARY_IMPL(nanfree, AutocastCUDA, m) {
  constexpr auto key = c10::DispatchKey::AutocastCUDA;
  m.impl("softmax", &softmax_in_float32<SoftmaxKind::Softmax, key>);
  m.impl("log_softmax", &softmax_in_float32<SoftmaxKind::LogSoftmax, key>);
  m.impl("logsumexp", &softmax_in_float32<SoftmaxKind::LogSumExp, key>);
  m.impl("normalize", &normalize_in_float32<key>);
  m.impl("cosine_similarity", &cosine_in_float32<key>);
  m.impl("cos_sim_matrix", &cos_sim_matrix_in_lower_precision<key, c10::DeviceType::CUDA>);
  m.impl("gem", &gem_in_float32<key>);
  m.impl("mnr_loss", &mnr_loss_in_float32<key>);
  m.impl("mnr_loss_backward", &mnr_loss_backward_in_float32<key>);
  m.impl("log", &elementwise_unary_in_float32<key, kLogName>);
  m.impl("log1p", &elementwise_unary_in_float32<key, kLog1pName>);
  m.impl("acos", &elementwise_unary_in_float32<key, kAcosName>);
  m.impl("asin", &elementwise_unary_in_float32<key, kAsinName>);
  m.impl("pow", &pow_in_float32<key>);
  m.impl("atan2", &atan2_promoted<key>);
}

TORCH_LIBRARY_IMPL(nanfree, AutocastCPU, m) {
  constexpr auto key = c10::DispatchKey::AutocastCPU;
  m.impl("cos_sim_matrix", &cos_sim_matrix_in_lower_precision<key, c10::DeviceType::CPU>);
  m.impl("mnr_loss", &mnr_loss_in_float32<key>);
  m.impl("mnr_loss_backward", &mnr_loss_backward_in_float32<key>);
}

}  // namespace nanfree
