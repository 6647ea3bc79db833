// The finiteness scan of nanfree.debug (debug_checks.cpp), shared by its
// Python entry point and the region's op observer (debug_observer.cpp).
#pragma once

#include <ATen/ATen.h>

#include <vector>

namespace nanfree {

// 1: some tensor holds NaN (or +-inf with check_inf); 0: none does; -1: a
// tensor the scan does not read (not a contiguous CPU tensor of float32,
// float64, float16 or bfloat16, or complex of those: their real and
// imaginary parts), which the caller checks its own way. Empty
// and non-floating tensors hold nothing to report. Calls of many entries in
// all run on ATen's threads.
int any_nonfinite(const std::vector<at::Tensor>& tensors, bool check_inf);

}  // namespace nanfree
