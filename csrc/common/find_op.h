// Typed handles of registered operators, for calling them through the
// dispatcher from C++ (autograd, autocast, the Python entry points, and one op
// calling another: the MNR loss normalizes its rows with the normalize op),
// and the C++ signatures of every op's schema (csrc/registration.cpp), once.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>

#include <cstdint>
#include <optional>
#include <string>
#include <tuple>

namespace nanfree {

template <typename Signature>
c10::TypedOperatorHandle<Signature> find_op(const std::string& name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name.c_str(), "").typed<Signature>();
}

using OptionalTensor = std::optional<at::Tensor>;

// softmax, log_softmax, logsumexp; softmax_backward; log_softmax_backward, logsumexp_backward.
using SoftmaxForwardSignature = std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, int64_t,
                                                                   const OptionalTensor&);
using SoftmaxBackwardSignature = at::Tensor(const at::Tensor&, const at::Tensor&,
                                            const at::Tensor&, int64_t);
using SoftmaxMaskedBackwardSignature = at::Tensor(const at::Tensor&, const at::Tensor&,
                                                  const at::Tensor&, int64_t,
                                                  const OptionalTensor&);

// normalize, normalize_backward, cosine_similarity, cosine_similarity_backward, cos_sim_matrix.
using NormalizeSignature = std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, double);
using NormalizeBackwardSignature = at::Tensor(const at::Tensor&, const at::Tensor&,
                                              const at::Tensor&);
using CosineSignature = std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&,
                                                           double);
using CosineBackwardSignature = std::tuple<at::Tensor, at::Tensor>(
    const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&);
using CosSimMatrixSignature = at::Tensor(const at::Tensor&, const at::Tensor&);

// gem, gem_backward.
using GemSignature = std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const OptionalTensor&,
                                                        double, double, const OptionalTensor&);
using GemBackwardSignature = std::tuple<at::Tensor, at::Tensor>(
    const at::Tensor&, const at::Tensor&, const OptionalTensor&, double, const at::Tensor&, double,
    const OptionalTensor&, bool);

// mnr_loss, mnr_loss_backward.
using MnrLossSignature = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>(
    const at::Tensor&, at::TensorList, const OptionalTensor&, double, int64_t, int64_t, int64_t,
    int64_t, bool, int64_t, double, int64_t, bool);
using MnrLossBackwardSignature = std::tuple<at::Tensor, at::Tensor, at::Tensor>(
    const at::Tensor&, const at::Tensor&, at::TensorList, const OptionalTensor&, double,
    const at::Tensor&, int64_t, int64_t, int64_t, int64_t, bool, int64_t, double, int64_t);

// pointwise_loss and pointwise_loss_sum; pointwise_loss_backward; cross_entropy; cross_entropy_backward.
using PointwiseLossSignature = at::Tensor(const at::Tensor&, const at::Tensor&, const OptionalTensor&,
                                          const OptionalTensor&, int64_t, double, double);
using PointwiseLossBackwardSignature = at::Tensor(const at::Tensor&, const at::Tensor&,
                                                  const at::Tensor&, const OptionalTensor&,
                                                  const OptionalTensor&, int64_t, double, double,
                                                  int64_t);
using CrossEntropySignature = std::tuple<at::Tensor, at::Tensor>(
    const at::Tensor&, const at::Tensor&, const OptionalTensor&, const OptionalTensor&, int64_t,
    double);
using CrossEntropyBackwardSignature = std::tuple<at::Tensor, at::Tensor>(
    const at::Tensor&, const at::Tensor&, const at::Tensor&, const OptionalTensor&,
    const OptionalTensor&, int64_t, double, const at::Tensor&, bool);

}  // namespace nanfree
