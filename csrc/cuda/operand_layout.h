// How the CUDA registrations of the elementwise families (elementwise
// binary ops, pointwise losses) hand an operand to their torch-free kernels,
// which read flat arrays: against an output `out` that is dense (as
// at::empty_like and TensorIterator allocate it), an operand is read either
// in out's layout, element i at position i, or as one element read for every
// position (step 0).
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <utility>

namespace nanfree {

// t (out's shape, or broadcast to it) in out's layout: t itself when it has
// out's strides, otherwise a copy (broadcast) into a tensor laid out as out.
inline at::Tensor in_layout_of(const at::Tensor& t, const at::Tensor& out) {
  if (t.sizes() == out.sizes() && t.strides() == out.strides()) return t;
  at::Tensor copy = at::empty_like(out);
  copy.copy_(t.expand(out.sizes()));
  return copy;
}

// (tensor, step) of an operand against out: step 0 for one element or one
// element broadcast (every stride 0: a scalar, a 0-d exponent, a reduction's
// upstream gradient expanded by autograd), read in place; otherwise step 1
// and the operand in out's layout.
inline std::pair<at::Tensor, int64_t> flat_operand(const at::Tensor& t, const at::Tensor& out) {
  bool one_element = true;
  for (int64_t d = 0; d < t.dim(); ++d) one_element = one_element && (t.size(d) == 1 || t.stride(d) == 0);
  if (one_element) return {t, 0};
  return {in_layout_of(t, out), 1};
}

}  // namespace nanfree
