// Python entry points of the softmax family: nanfree.ops.softmax and friends
// call these (outside torch.compile) instead of torch.ops.nanfree.*, whose
// boxed Python call costs about a microsecond more per call, a third of a
// small tensor's whole call. They only handle what the op does not (the
// dtype= cast, keepdim) and call the op through the dispatcher, so autograd,
// autocast, fake tensors and every backend behave exactly as through
// torch.ops. The op checks every argument.
#include <ATen/ATen.h>
#include <c10/core/DispatchKeySet.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <pybind11/pybind11.h>
#include <torch/csrc/utils/pybind.h>

#include <optional>

#include "common/find_op.h"
#include "common/softmax_op.h"
#include "python_module.h"

namespace nanfree {
namespace {

template <SoftmaxKind kind>
at::Tensor distribution(const at::Tensor& input, int64_t dim, std::optional<at::ScalarType> dtype,
                        const std::optional<at::Tensor>& mask) {
  static const auto op = find_op<ForwardSignature>(forward_name(kind));
  if (!dtype.has_value()) return std::get<0>(op.call(input, dim, mask));
  // As torch: the input is cast to `dtype` first, and an explicit dtype is
  // kept under autocast (the fp32_set_opt_dtype policy leaves it alone).
  const c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
  return std::get<0>(op.call(input.to(*dtype), dim, mask));
}

at::Tensor logsumexp(const at::Tensor& input, int64_t dim, bool keepdim,
                     const std::optional<at::Tensor>& mask) {
  static const auto op = find_op<ForwardSignature>(forward_name(SoftmaxKind::LogSumExp));
  at::Tensor out = std::get<0>(op.call(input, dim, mask));
  // The op has checked dim; a 0-d input keeps its 0-d result.
  if (keepdim && input.dim() > 0) out = out.unsqueeze(dim < 0 ? dim + input.dim() : dim);
  return out;
}

}  // namespace

void bind_softmax(pybind11::module_& m) {
  namespace py = pybind11;
  // The GIL is released while the op runs, as torch's own bindings do.
  const auto release = py::call_guard<py::gil_scoped_release>();
  m.def("softmax", &distribution<SoftmaxKind::Softmax>, release);
  m.def("log_softmax", &distribution<SoftmaxKind::LogSoftmax>, release);
  m.def("logsumexp", &logsumexp, release);
}

}  // namespace nanfree
