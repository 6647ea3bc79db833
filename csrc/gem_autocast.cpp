// Autocast of the GeM ops, registered once for every backend. The composed
// expression gem replaces (clamp, pow, mean or avg_pool2d, pow) runs under
// CUDA autocast in float32 (pow is on its float32 list) and returns float32:
// so does gem. CPU autocast leaves that expression at the input's dtype, and
// leaves gem alone too (its fallthrough kernel runs it at the input's dtype).
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/library.h>

#include <optional>
#include <tuple>

#include "common/autocast.h"
#include "common/find_op.h"
#include "common/gem_op.h"

namespace nanfree {
namespace {

std::tuple<at::Tensor, at::Tensor> gem_in_float32(const at::Tensor& input,
                                                  const std::optional<at::Tensor>& p,
                                                  double p_value, double eps,
                                                  const std::optional<at::Tensor>& mask) {
  static const auto op = find_op<GemSignature>("nanfree::gem");
  const c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::DispatchKey::AutocastCUDA);
  return op.call(autocast_to_float(input), p, p_value, eps, mask);
}

}  // namespace

TORCH_LIBRARY_IMPL(nanfree, AutocastCUDA, m) {
  m.impl("gem", &gem_in_float32);
}

}  // namespace nanfree
