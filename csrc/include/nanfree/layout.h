// The reduction layout shared by the families that reduce one dimension of a
// tensor (softmax, GeM), torch-free for the CPU and CUDA kernels; its Python
// twin is nanfree/_ops/layout.py.
#pragma once

#include <cstdint>

#include "nanfree/numerics.h"

namespace nanfree {

// A contiguous tensor viewed as [outer, n, inner], reduced over n: entry
// (o, j, i) is at element offset (o * n + j) * inner + i. Reducing over the
// last dimension is inner == 1. The problem has outer * inner reductions (one
// per (o, i), numbered r = o * inner + i, the other dimensions in row-major
// order); reduction r holds the n entries (o, 0, i) .. (o, n - 1, i), inner
// apart. (The softmax family calls a reduction a row, n its columns.)
struct ReductionLayout {
  int64_t outer;
  int64_t n;
  int64_t inner;

  NF_HOST_DEVICE int64_t reductions() const { return outer * inner; }
};

// Element offset of entry (o, j, i).
NF_HOST_DEVICE int64_t entry_offset(const ReductionLayout& s, int64_t o, int64_t j, int64_t i) {
  return (o * s.n + j) * s.inner + i;
}

// A boolean mask read with the problem's layout: reduction r = o * inner + i
// starts at mask_row_offset(mask, r), entry j adds j * col_stride. r is split
// row-major over up to three dimensions (sizes, strides; 0 strides broadcast).
// A mask of the input's shape with the reduced dimension moved last collapses
// its other dimensions into these three (softmax: any broadcast of a mask);
// a mask of the [outer, n, inner] view itself has sizes {1, outer, inner},
// strides {0, outer stride, inner stride} and col_stride its n stride (GeM),
// and mask_offset(mask, o, i) reads it without a division. data == nullptr
// means no mask.
struct MaskView {
  const bool* data;
  int64_t sizes[3];
  int64_t strides[3];
  int64_t col_stride;
};

NF_HOST_DEVICE int64_t mask_row_offset(const MaskView& mask, int64_t row) {
  const int64_t i2 = row % mask.sizes[2];
  row /= mask.sizes[2];
  const int64_t i1 = row % mask.sizes[1];
  const int64_t i0 = row / mask.sizes[1];
  return i0 * mask.strides[0] + i1 * mask.strides[1] + i2 * mask.strides[2];
}

// The offset of reduction (o, i) in a mask view of the [outer, n, inner] view
// itself (sizes {1, outer, inner}).
NF_HOST_DEVICE int64_t mask_offset(const MaskView& mask, int64_t o, int64_t i) {
  return o * mask.strides[1] + i * mask.strides[2];
}

}  // namespace nanfree
