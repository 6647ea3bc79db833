// Autocast of nanfree's ops, shared by every op family. Each family registers,
// at an Autocast<Device> dispatch key, a kernel that casts its floating inputs
// as autocast casts those of the torch op it replaces, then calls the op again
// with that key excluded. One registration serves every backend: the
// autocast keys sit above autograd and the device kernels.
#pragma once

#include <ATen/ATen.h>
#include <ATen/autocast_mode.h>

#include <optional>
#include <vector>

namespace nanfree {

// What autocast's float32 policy does to one argument: float16 / bfloat16
// (any floating dtype but float64) becomes float32; float64, integer and bool
// tensors are left alone. Only tensors of the autocast key's own device type
// reach this kernel.
inline at::Tensor autocast_to_float(const at::Tensor& t) {
  if (!t.defined() || !at::isFloatingType(t.scalar_type()) || t.scalar_type() == at::kDouble ||
      t.scalar_type() == at::kFloat) {
    return t;
  }
  return t.to(at::kFloat);
}

inline std::vector<at::Tensor> autocast_to_float(at::TensorList ts) {
  std::vector<at::Tensor> out;
  out.reserve(ts.size());
  for (const at::Tensor& t : ts) out.push_back(autocast_to_float(t));
  return out;
}

inline std::optional<at::Tensor> autocast_to_float(const std::optional<at::Tensor>& t) {
  if (!t.has_value()) return t;
  return autocast_to_float(*t);
}

// What autocast's lower-precision policy (matmul, mm) does to one argument:
// a floating tensor other than float64 becomes the autocast dtype of `device`.
inline at::Tensor autocast_to_lower_precision(const at::Tensor& t, c10::DeviceType device) {
  const at::ScalarType lower = at::autocast::get_autocast_dtype(device);
  if (!t.defined() || !at::isFloatingType(t.scalar_type()) || t.scalar_type() == at::kDouble ||
      t.scalar_type() == lower) {
    return t;
  }
  return t.to(lower);
}

}  // namespace nanfree
