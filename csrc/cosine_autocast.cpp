// Autocast of the cosine family, registered once for every backend. CUDA
// autocast computes F.cosine_similarity (fp32 policy) and F.normalize (its
// norm is on the fp32 list) in float32 and returns float32; so do normalize
// and cosine_similarity here. cos_sim's GEMM follows torch.mm, which both CUDA
// and CPU autocast run in their lower-precision dtype: sentence-transformers'
// cos_sim (F.normalize, then mm) returns that dtype under autocast, and so
// does cos_sim_matrix. CPU autocast leaves normalize and cosine_similarity
// alone (its fallthrough kernel runs them at the input's dtype), as it leaves
// torch's.
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/library.h>

#include <tuple>

#include "common/autocast.h"
#include "common/cosine_op.h"
#include "common/find_op.h"

namespace nanfree {
namespace {

std::tuple<at::Tensor, at::Tensor> normalize_in_float32(const at::Tensor& input, double eps) {
  static const auto op = find_op<NormalizeSignature>("nanfree::normalize");
  const c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::DispatchKey::AutocastCUDA);
  return op.call(autocast_to_float(input), eps);
}

std::tuple<at::Tensor, at::Tensor> cosine_in_float32(const at::Tensor& x1, const at::Tensor& x2,
                                                     double eps) {
  static const auto op = find_op<CosineSignature>("nanfree::cosine_similarity");
  const c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::DispatchKey::AutocastCUDA);
  return op.call(autocast_to_float(x1), autocast_to_float(x2), eps);
}

template <c10::DispatchKey autocast_key, c10::DeviceType device>
at::Tensor cos_sim_matrix_in_lower_precision(const at::Tensor& a, const at::Tensor& b) {
  static const auto op = find_op<CosSimMatrixSignature>("nanfree::cos_sim_matrix");
  const c10::impl::ExcludeDispatchKeyGuard no_autocast(autocast_key);
  return op.call(autocast_to_lower_precision(a, device), autocast_to_lower_precision(b, device));
}

}  // namespace

TORCH_LIBRARY_IMPL(nanfree, AutocastCUDA, m) {
  m.impl("normalize", &normalize_in_float32);
  m.impl("cosine_similarity", &cosine_in_float32);
  m.impl("cos_sim_matrix",
         &cos_sim_matrix_in_lower_precision<c10::DispatchKey::AutocastCUDA, c10::DeviceType::CUDA>);
}

TORCH_LIBRARY_IMPL(nanfree, AutocastCPU, m) {
  m.impl("cos_sim_matrix",
         &cos_sim_matrix_in_lower_precision<c10::DispatchKey::AutocastCPU, c10::DeviceType::CPU>);
}

}  // namespace nanfree
