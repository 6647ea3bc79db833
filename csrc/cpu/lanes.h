// Lanes across an inner dimension, shared by the CPU kernels of the families
// that reduce a dimension other than the last (inner > 1 in the
// [outer, n, inner] layout of nanfree/layout.h): a task holds up to `width`
// consecutive reductions (o, i0 .. i0 + lanes - 1), its lanes, so that entry j
// of every lane is one contiguous load and the loops over j are vector
// operations across the lanes.
#pragma once

#include <algorithm>
#include <cstdint>

#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
#include <immintrin.h>
#endif

#include "cpu/vec.h"
#include "nanfree/layout.h"

namespace nanfree {
namespace cpu {

// The lanes of one task (TaskGrid::lanes): column j of lane l is
// base[j * stride + l]; the mask (when there is one) keeps it when
// mask[offsets[l] + j * mask_col_stride].
template <typename scalar_t>
struct Lanes {
  const scalar_t* base;
  int64_t stride;
  int64_t count;
  const bool* mask;
  int64_t mask_col_stride;
  const int64_t* mask_offsets;

  const scalar_t* column(int64_t j) const { return base + j * stride; }
  bool keep(int64_t j, int64_t l) const {
    return mask == nullptr || mask[mask_offsets[l] + j * mask_col_stride];
  }
};

// The mask row offset of each lane of the task starting at row `first_row`.
inline void fill_mask_offsets(const MaskView& mask, int64_t first_row, int64_t count,
                              int64_t* offsets) {
  if (mask.data == nullptr) return;
  for (int64_t l = 0; l < count; ++l) offsets[l] = mask_row_offset(mask, first_row + l);
}

// A task of a strided problem: a block of lanes of one o.
struct Task {
  int64_t o;
  int64_t i0;
  int64_t lanes;      // this block's lane count (the last block of an o may be short)
  int64_t offset;     // element offset of entry (o, 0, i0)
  int64_t first_row;  // reduction index o * inner + i0 of lane 0
};

// The tasks of a strided problem: blocks of `width` lanes, `blocks` per o.
struct TaskGrid {
  ReductionLayout shape;
  int64_t width;
  int64_t blocks;

  TaskGrid(const ReductionLayout& s, int64_t lanes_per_task)
      : shape(s), width(lanes_per_task), blocks((s.inner + width - 1) / width) {}
  int64_t count() const { return shape.outer * blocks; }
  // Tasks per parallel grain: about kGrainElements entries.
  int64_t grain() const {
    return std::max<int64_t>(1, kGrainElements / std::max<int64_t>(1, shape.n * width));
  }
  Task task(int64_t t) const {
    const int64_t o = t / blocks, i0 = (t % blocks) * width;
    return Task{o, i0, std::min(width, shape.inner - i0), entry_offset(shape, o, 0, i0),
                o * shape.inner + i0};
  }
  // The task's lanes of a tensor of the problem's shape starting at `data`.
  template <typename scalar_t>
  Lanes<scalar_t> lanes(const scalar_t* data, const Task& t, const MaskView& mask,
                        const int64_t* mask_offsets) const {
    return Lanes<scalar_t>{data + t.offset, shape.inner, t.lanes, mask.data, mask.col_stride,
                           mask_offsets};
  }
};

// Rows a lanes task asks for ahead of use: each of its rows is a few cache
// lines inner * sizeof apart, a stride the hardware prefetchers follow badly.
constexpr int64_t kPrefetchRows = 8;

// Asks for row j + kPrefetchRows of a lanes task (`bytes` of it from x_row).
template <typename scalar_t>
inline void prefetch_row(const scalar_t* x_row, int64_t bytes) {
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
  const char* p = reinterpret_cast<const char*>(x_row);
  for (int64_t b = 0; b < bytes; b += 64) _mm_prefetch(p + b, _MM_HINT_T0);
#else
  (void)x_row, (void)bytes;
#endif
}

}  // namespace cpu
}  // namespace nanfree
