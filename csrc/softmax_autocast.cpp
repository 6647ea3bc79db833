// Autocast of the softmax family, registered once for every backend. CUDA
// autocast computes torch.softmax and torch.log_softmax (policy
// fp32_set_opt_dtype) and torch.logsumexp (policy fp32) in float32 and
// returns float32; so do these ops. CPU autocast leaves all three alone (its
// fallthrough kernel runs them at the input's dtype), and so it leaves ours.
// nanfree.ops.softmax(..., dtype=...) excludes autocast itself, as torch's
// fp32_set_opt_dtype does when a dtype is given.
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/library.h>

#include "common/autocast.h"
#include "common/find_op.h"
#include "common/softmax_op.h"

namespace nanfree {
namespace {

template <SoftmaxKind kind, c10::DispatchKey autocast_key>
std::tuple<at::Tensor, at::Tensor> forward_in_float32(const at::Tensor& input, int64_t dim,
                                                      const std::optional<at::Tensor>& mask) {
  static const auto op = find_op<ForwardSignature>(forward_name(kind));
  const c10::impl::ExcludeDispatchKeyGuard no_autocast(autocast_key);
  return op.call(autocast_to_float(input), dim, mask);
}

}  // namespace

TORCH_LIBRARY_IMPL(nanfree, AutocastCUDA, m) {
  constexpr auto key = c10::DispatchKey::AutocastCUDA;
  m.impl("softmax", &forward_in_float32<SoftmaxKind::Softmax, key>);
  m.impl("log_softmax", &forward_in_float32<SoftmaxKind::LogSoftmax, key>);
  m.impl("logsumexp", &forward_in_float32<SoftmaxKind::LogSumExp, key>);
}

}  // namespace nanfree
