// The reduction layout of nanfree/layout.h on the ATen side, shared by the
// bindings of the families that reduce one dimension (softmax, GeM): `dim`
// checks, the [outer, n, inner] view of a tensor, and masks as MaskView (its
// Python twin: nanfree/_ops/layout.py).
#pragma once

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <optional>
#include <vector>

#include "common/checks.h"
#include "nanfree/layout.h"

namespace nanfree {

// `dim` wrapped into [0, rank) (a 0-d tensor counts as one dimension); IndexError otherwise.
inline int64_t wrap_dim(const char* op, const at::Tensor& input, int64_t dim) {
  return wrap_dim(op, dim, std::max<int64_t>(input.dim(), 1), input.dim());
}

// Whether a tensor of shape `from` broadcasts to `to` without growing it.
inline bool broadcasts_to(at::IntArrayRef from, at::IntArrayRef to) {
  if (from.size() > to.size()) return false;
  const size_t lead = to.size() - from.size();
  for (size_t d = 0; d < from.size(); ++d) {
    if (from[d] != 1 && from[d] != to[lead + d]) return false;
  }
  return true;
}

// The mask as a bool tensor of the input's shape (an expanded view when it
// broadcasts; integer masks become `mask != 0`). TypeError for a float or
// complex mask, ValueError for one on another device or of a shape that does
// not broadcast to the input's.
inline at::Tensor broadcast_mask(const char* op, const at::Tensor& input, const at::Tensor& mask) {
  const at::ScalarType type = mask.scalar_type();
  TORCH_CHECK_TYPE(type == at::kBool || at::isIntegralType(type, /*includeBool=*/false), "nanfree.",
                   op, ": `mask` must be bool or integer (nonzero = keep), got ", type);
  check_same_device(op, "mask", input, mask);
  TORCH_CHECK_VALUE(broadcasts_to(mask.sizes(), input.sizes()), "nanfree.", op,
                    ": `mask` of shape ", mask.sizes(), " does not broadcast to the input's shape ",
                    input.sizes());
  const at::Tensor keep = type == at::kBool ? mask : mask.ne(0);
  return keep.expand(input.sizes());
}

// The [outer, n, inner] view of a contiguous tensor reduced over `dim`; a
// 0-d tensor is one reduction of one entry.
inline ReductionLayout reduction_layout(const at::Tensor& input, int64_t dim) {
  if (input.dim() == 0) return ReductionLayout{1, 1, 1};
  const auto sizes = input.sizes();
  return ReductionLayout{c10::multiply_integers(sizes.begin(), sizes.begin() + dim), sizes[dim],
                         c10::multiply_integers(sizes.begin() + dim + 1, sizes.end())};
}

// Describes a bool mask of the input's shape (any strides, 0 for broadcast)
// as a MaskView: the reduced dimension moved last (a view), the other
// dimensions collapsed to at most three, or else materialized. `storage`
// keeps whatever `data` points into alive.
inline MaskView make_mask_view(const std::optional<at::Tensor>& mask, int64_t dim,
                               at::Tensor& storage) {
  MaskView view{nullptr, {1, 1, 1}, {0, 0, 0}, 0};
  if (!mask.has_value()) return view;
  storage = mask->dim() == 0 ? *mask : mask->movedim(dim, -1);
  for (int attempt = 0; attempt < 2; ++attempt) {
    const int64_t ndim = storage.dim();
    view.col_stride = ndim == 0 ? 0 : storage.stride(-1);
    std::vector<int64_t> sizes, strides;
    for (int64_t d = 0; d + 1 < ndim; ++d) {
      if (storage.size(d) == 1) continue;
      if (!sizes.empty() && strides.back() == storage.stride(d) * storage.size(d)) {
        sizes.back() *= storage.size(d);
        strides.back() = storage.stride(d);
      } else {
        sizes.push_back(storage.size(d));
        strides.push_back(storage.stride(d));
      }
    }
    if (sizes.size() <= 3) {
      const size_t pad = 3 - sizes.size();
      for (size_t i = 0; i < 3; ++i) {
        view.sizes[i] = i < pad ? 1 : sizes[i - pad];
        view.strides[i] = i < pad ? 0 : strides[i - pad];
      }
      view.data = storage.const_data_ptr<bool>();
      return view;
    }
    storage = storage.contiguous();
  }
  TORCH_INTERNAL_ASSERT(false, "a contiguous mask always collapses");
  return view;
}

// The MaskView of a bool mask of a [outer, n, inner] tensor's own shape (any
// strides): sizes {1, outer, inner}, read by mask_offset(mask, o, i) without a
// division. data == nullptr for an undefined tensor (no mask).
inline MaskView layout_mask_view(const at::Tensor& mask) {
  if (!mask.defined()) return MaskView{nullptr, {1, 1, 1}, {0, 0, 0}, 0};
  return MaskView{mask.const_data_ptr<bool>(),
                  {1, mask.size(0), mask.size(2)},
                  {0, mask.stride(0), mask.stride(2)},
                  mask.stride(1)};
}

}  // namespace nanfree
