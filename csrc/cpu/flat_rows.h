// Blocks of short contiguous rows as whole vectors (AVX-512), shared by the CPU
// kernels whose rows can be shorter than a vector or two (softmax, GeM).
//
// A block of W = Vec<acc_t>::size() rows of n entries is W n consecutive
// entries, n vectors: lane l of vector k holds entry W k + l, of row
// (W k + l) / n. A table of those rows lets vector k take its lanes' per-row
// values with one permute (per_row: lane r of `rows` is row r's value), so the
// block is processed as full vectors without branches, whatever rows a vector
// spans. The other way round, the block's columns (lane r holding row r's
// entry j: a transpose in registers, or a gather per column) make a per-row
// reduction a vertical one across n vectors, without a horizontal reduction per
// row.
#pragma once

#include <cstdint>
#include <type_traits>
#include <vector>

#if defined(CPU_CAPABILITY_AVX512)
#include <immintrin.h>
#endif

#include "cpu/vec.h"

namespace nanfree {
namespace cpu {

#if defined(CPU_CAPABILITY_AVX512)
template <typename acc_t>
struct FlatRows {
  static_assert(std::is_same_v<acc_t, float> || std::is_same_v<acc_t, double>);
  static constexpr int64_t W = Vec<acc_t>::size();
  static constexpr int64_t kGatheredColumns = 4;
  // permutexvar takes 32-bit indices for float lanes, 64-bit ones for double.
  using index_t = std::conditional_t<std::is_same_v<acc_t, float>, int32_t, int64_t>;

  int64_t n;
  std::vector<index_t> row_of;  // W per vector, n vectors
  alignas(64) int32_t row_start[W];  // r n: where the block's row r starts

  explicit FlatRows(int64_t n_) : n(n_), row_of(W * n_) {
    for (int64_t i = 0; i < W * n; ++i) row_of[i] = static_cast<index_t>(i / n);
    for (int64_t r = 0; r < W; ++r) row_start[r] = static_cast<int32_t>(r * n);
  }

  // Lane l: row (W k + l) / n's value in `rows`.
  Vec<acc_t> per_row(int64_t k, const Vec<acc_t>& rows) const {
    const __m512i index = _mm512_loadu_si512(row_of.data() + W * k);
    if constexpr (std::is_same_v<acc_t, float>) {
      return Vec<float>(_mm512_permutexvar_ps(index, rows));
    } else {
      return Vec<double>(_mm512_permutexvar_pd(index, rows));
    }
  }

  // columns[j], j < n: lane r holds block[r n + j], entry j of the block's row
  // r (n <= W). float: the W rows loaded and transposed in registers (ATen's
  // transpose_block, about 50 shuffles for the block: a gather per column cost
  // several times that on the AMD Zen 4 this was measured on); double: a gather
  // per column.
  void columns(const acc_t* block, Vec<acc_t>* out) const {
    if constexpr (std::is_same_v<acc_t, float>) {
      if (n > kGatheredColumns) {
        at::vec::VectorizedN<float, 16> rows;
        const __mmask16 first_n = static_cast<__mmask16>((1u << n) - 1);
        for (int64_t r = 0; r < W; ++r) rows[r] = _mm512_maskz_loadu_ps(first_n, block + r * n);
        at::vec::transpose_block(rows, W, static_cast<int>(n));
        for (int64_t j = 0; j < n; ++j) out[j] = rows[j];
        return;
      }
    }
    for (int64_t j = 0; j < n; ++j) out[j] = column(block, j);
  }

  // Lane r: block[r n + j], entry j of the block's row r.
  Vec<acc_t> column(const acc_t* block, int64_t j) const {
    if constexpr (std::is_same_v<acc_t, float>) {
      const __m512i index = _mm512_add_epi32(_mm512_load_si512(row_start),
                                             _mm512_set1_epi32(static_cast<int32_t>(j)));
      return Vec<float>(_mm512_i32gather_ps(index, block, sizeof(float)));
    } else {
      const __m256i index =
          _mm256_add_epi32(_mm256_load_si256(reinterpret_cast<const __m256i*>(row_start)),
                           _mm256_set1_epi32(static_cast<int32_t>(j)));
      return Vec<double>(_mm512_i32gather_pd(index, block, sizeof(double)));
    }
  }
};
#endif

}  // namespace cpu
}  // namespace nanfree
