// Writing outputs larger than the last-level cache: huge pages and streaming
// stores (used by the cosine and GeM families' CPU kernels), and direct
// stores of a vector's leading entries in float16 / bfloat16.
//
// Huge pages. A tensor of tens of MB gets memory that the C library maps
// afresh for it (glibc maps every allocation of 32 MB or more on its own and
// unmaps it when freed), so the kernel that first writes it takes a page
// fault per 4 KB page: in a virtual machine that costs more than the writes
// themselves (about 1 GB/s, against 10-30 GB/s for a copy). Where the system
// grants huge pages on request (transparent_hugepage = madvise, the usual
// default; with "always" they are used anyway, with "never" the advice is
// ignored), asking for them before the first write makes it one fault per
// 2 MB. The memory, its owner (ATen's allocator) and its contents are the same.
//
// Streaming stores. An output that cannot stay in cache is written with
// non-temporal stores: they skip reading each line before writing it (a
// third of the traffic of a read-one-write-one kernel) and leave the inputs
// in cache. Only whole, aligned vectors are streamed; a task that streamed
// ends with a store fence, so the results are visible to every thread once
// at::parallel_for returns.
#pragma once

#include <ATen/ATen.h>
#include <ATen/OpMathType.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <type_traits>
#include <utility>

#if defined(__linux__)
#include <sys/mman.h>
#endif
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
#include <immintrin.h>
#endif

#include "cpu/vec.h"

namespace nanfree {
namespace cpu {

// The size from which an output counts as larger than the last-level cache
// (and as mapped afresh by glibc, see above).
constexpr std::size_t kLargeOutputBytes = std::size_t(32) << 20;

// Advises huge pages for the untouched memory of a freshly allocated CPU
// tensor of at least kLargeOutputBytes (smaller ones come from the C
// library's reused heap). Memory already in use (its first page on a 2 MB
// boundary resident) is left alone, so a recycled block of another allocator
// is not advised.
inline void prefer_huge_pages(const at::Tensor& fresh) {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  constexpr std::uintptr_t kHugePage = std::uintptr_t(1) << 21;
  const std::size_t bytes = fresh.nbytes();
  if (bytes < kLargeOutputBytes || !fresh.is_contiguous() || !fresh.device().is_cpu()) return;
  const auto begin = reinterpret_cast<std::uintptr_t>(fresh.data_ptr());
  const std::uintptr_t first = (begin + kHugePage - 1) & ~(kHugePage - 1);
  const std::uintptr_t last = (begin + bytes) & ~(kHugePage - 1);
  if (last <= first) return;
  unsigned char resident = 0;
  if (mincore(reinterpret_cast<void*>(first), 1, &resident) != 0 || (resident & 1)) return;
  madvise(reinterpret_cast<void*>(first), last - first, MADV_HUGEPAGE);  // advice: errors ignored
#else
  (void)fresh;
#endif
}

// Whether a kernel should stream its rows of d entries into `out`: the
// output is large, this build has streaming stores for the type, and every
// row starts on a 64-byte boundary and holds whole vectors, so that
// put_vec's full vectors are aligned.
template <typename scalar_t>
inline bool stream_rows(const at::Tensor& out, int64_t d) {
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
  constexpr int64_t lanes = Vec<at::opmath_type<scalar_t>>::size();
  const auto base = reinterpret_cast<std::uintptr_t>(out.const_data_ptr());
  return out.nbytes() >= kLargeOutputBytes && base % 64 == 0 &&
         (d * static_cast<int64_t>(sizeof(scalar_t))) % 64 == 0 && d % lanes == 0;
#else
  (void)out, (void)d;
  return false;
#endif
}

// A whole vector to an address aligned to its stored size, bypassing the cache.
template <typename scalar_t>
inline void stream_vec(const Vec<at::opmath_type<scalar_t>>& v, scalar_t* p) {
#if defined(CPU_CAPABILITY_AVX512)
  if constexpr (std::is_same_v<scalar_t, float>) {
    _mm512_stream_ps(p, v);
  } else if constexpr (std::is_same_v<scalar_t, double>) {
    _mm512_stream_pd(p, v);
  } else {  // 16 float16 / bfloat16 values: the low half of the converted vector
    _mm256_stream_si256(reinterpret_cast<__m256i*>(p), narrow_one<scalar_t>(v));
  }
#elif defined(CPU_CAPABILITY_AVX2)
  if constexpr (std::is_same_v<scalar_t, float>) {
    _mm256_stream_ps(p, v);
  } else if constexpr (std::is_same_v<scalar_t, double>) {
    _mm256_stream_pd(p, v);
  } else {  // 8 float16 / bfloat16 values
    const __m256i bits = narrow_pair<scalar_t>(v, v);
    _mm_stream_si128(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(bits));
  }
#else
  store_vec(v, p, Vec<at::opmath_type<scalar_t>>::size());
#endif
}

// A whole vector of stored values (float16 / bfloat16: two accumulation-type
// vectors' worth) to an address aligned to its size, bypassing the cache.
template <typename scalar_t>
inline void stream_stored_vec(const Vec<scalar_t>& v, scalar_t* p) {
#if defined(CPU_CAPABILITY_AVX512)
  _mm512_stream_si512(reinterpret_cast<__m512i*>(p), __m512i(v));
#elif defined(CPU_CAPABILITY_AVX2)
  _mm256_stream_si256(reinterpret_cast<__m256i*>(p), __m256i(v));
#else
  v.store(p);
#endif
}

// store_vec, streamed when `stream` (stream_rows) and the vector is whole.
template <typename scalar_t>
inline void put_vec(const Vec<at::opmath_type<scalar_t>>& v, scalar_t* p, int64_t count,
                    bool stream) {
  if (stream && count == Vec<at::opmath_type<scalar_t>>::size()) {
    stream_vec(v, p);
  } else {
    store_vec(v, p, count);
  }
}

// Writes a row of n stored values: value(j, count) is the accumulation-type
// vector of entries [j, j + count) (count is a whole vector but at the end).
// float16 / bfloat16 rows go two vectors at a time: one conversion and one
// whole store where a vector at a time would convert twice and store half.
template <typename scalar_t, typename Value>
inline void write_row(scalar_t* out, int64_t n, bool stream, Value value) {
  using acc_t = at::opmath_type<scalar_t>;
  constexpr int64_t w = Vec<acc_t>::size();
  int64_t j = 0;
  if constexpr (!std::is_same_v<scalar_t, acc_t>) {
    for (; j + 2 * w <= n; j += 2 * w) {
      const Vec<scalar_t> v = narrow_pair<scalar_t>(value(j, w), value(j + w, w));
      if (stream) {
        stream_stored_vec(v, out + j);
      } else {
        v.store(out + j);
      }
    }
  }
  for (; j < n; j += w) {
    const int64_t count = std::min<int64_t>(w, n - j);
    put_vec(value(j, count), out + j, count, stream);
  }
}

// write_row for two rows whose values come together: value(j, count) returns
// the pair of vectors of entries [j, j + count) of out1 and out2.
template <typename scalar_t, typename Values>
inline void write_rows(scalar_t* out1, scalar_t* out2, int64_t n, bool stream, Values values) {
  using acc_t = at::opmath_type<scalar_t>;
  constexpr int64_t w = Vec<acc_t>::size();
  int64_t j = 0;
  if constexpr (!std::is_same_v<scalar_t, acc_t>) {
    for (; j + 2 * w <= n; j += 2 * w) {
      const auto [a0, b0] = values(j, w);
      const auto [a1, b1] = values(j + w, w);
      const Vec<scalar_t> a = narrow_pair<scalar_t>(a0, a1);
      const Vec<scalar_t> b = narrow_pair<scalar_t>(b0, b1);
      if (stream) {
        stream_stored_vec(a, out1 + j);
        stream_stored_vec(b, out2 + j);
      } else {
        a.store(out1 + j);
        b.store(out2 + j);
      }
    }
  }
  for (; j < n; j += w) {
    const int64_t count = std::min<int64_t>(w, n - j);
    const auto [a, b] = values(j, count);
    put_vec(a, out1 + j, count, stream);
    put_vec(b, out2 + j, count, stream);
  }
}

// Orders a task's streaming stores before whatever follows it.
inline void end_streaming(bool stream) {
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
  if (stream) _mm_sfence();
#else
  (void)stream;
#endif
}

// store_vec of `count` entries, with one direct (masked) store of a
// float16 / bfloat16 vector where at::vec would copy through a buffer.
template <typename scalar_t>
inline void store_entries(const Vec<at::opmath_type<scalar_t>>& v, scalar_t* p, int64_t count) {
#if defined(CPU_CAPABILITY_AVX512)
  if constexpr (std::is_same_v<scalar_t, at::BFloat16> || std::is_same_v<scalar_t, at::Half>) {
    const __m256i bits = narrow_one<scalar_t>(v);
    if (count == Vec<float>::size()) {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), bits);
    } else {
      _mm256_mask_storeu_epi16(p, static_cast<__mmask16>((1u << count) - 1u), bits);
    }
    return;
  }
#endif
  store_vec(v, p, count);
}

// store_entries, streamed (cpu/large_output.h) when `stream` and the vector
// is whole (its address then aligned to its stored size).
template <typename scalar_t>
inline void put_entries(const Vec<at::opmath_type<scalar_t>>& v, scalar_t* p, int64_t count,
                        bool stream) {
  if (stream && count == Vec<at::opmath_type<scalar_t>>::size()) {
    stream_vec(v, p);
  } else {
    store_entries(v, p, count);
  }
}

}  // namespace cpu
}  // namespace nanfree
