// ATen element types -> the CUDA types the torch-free launchers take (same
// bits), and typed device pointers of a tensor. Shared by the CUDA
// registrations of every family (csrc/cuda/<family>.cpp).
#pragma once

#include <ATen/ATen.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace nanfree {

template <typename scalar_t>
struct DeviceType {
  using type = scalar_t;
};
template <>
struct DeviceType<at::Half> {
  using type = __half;
};
template <>
struct DeviceType<at::BFloat16> {
  using type = __nv_bfloat16;
};
static_assert(sizeof(at::Half) == sizeof(__half) && alignof(at::Half) == alignof(__half));
static_assert(sizeof(at::BFloat16) == sizeof(__nv_bfloat16) &&
              alignof(at::BFloat16) == alignof(__nv_bfloat16));

template <typename scalar_t>
using device_t = typename DeviceType<scalar_t>::type;

template <typename scalar_t>
const device_t<scalar_t>* device_ptr(const at::Tensor& t) {
  return reinterpret_cast<const device_t<scalar_t>*>(t.const_data_ptr<scalar_t>());
}

template <typename scalar_t>
device_t<scalar_t>* mutable_device_ptr(at::Tensor& t) {
  return reinterpret_cast<device_t<scalar_t>*>(t.mutable_data_ptr<scalar_t>());
}

}  // namespace nanfree
