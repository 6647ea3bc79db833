// nanfree._C.any_nonfinite: the per-op check of nanfree.debug.detect_anomaly
// for CPU tensors, in one call per op (nanfree/debug.py). A tensor's entries
// are read as integers: an entry is NaN or +-inf when its exponent bits are
// all ones (NaN when its magnitude bits are above infinity's), a test the
// compiler vectorizes (scan) and that no floating-point mode can change. The
// scan stops at the first block that holds one. Calls of many entries in all
// (nanfree.optim.FiniteGuard's gradients) are split over ATen's threads.
// nanfree._C.nonfinite_and_norm: the same scan with the gradients' total norm
// summed in float64 in the same pass (FiniteGuard's check and clipping norm).
#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <tuple>
#include <vector>

#include "debug_checks.h"
#include "python_module.h"

namespace nanfree {
namespace {

// Whether any of the n entries (bit patterns of type U, sign bit on top) is
// NaN or +-inf (check_inf), or NaN. (b & mask) + offset carries into the sign
// bit exactly when the exponent bits are all ones (mask: the exponent,
// offset: sign - exponent), or when the magnitude bits are above infinity's
// (mask: the magnitude, offset: sign - 1 - infinity); or-ing those and
// testing the sign bit once per block is integer arithmetic only, which
// the compiler vectorizes (comparisons per entry with an early exit it does
// not: 10x slower than a sum).
// The loop itself, inlined into each ISA's copy below (compiled there for
// that ISA's vectors).
template <typename U>
inline __attribute__((always_inline)) U carried_bits_portable(const U* bits, int64_t start,
                                                              int64_t end, U mask, U offset) {
  U carried = 0;
  for (int64_t i = start; i < end; ++i) carried |= static_cast<U>((bits[i] & mask) + offset);
  return carried;
}

#if defined(__x86_64__) && defined(__GNUC__)
// The CPU's vector extensions, read once: the ISA copies below run where present.
bool cpu_has_avx512() {
  static const bool has = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw");
  return has;
}
bool cpu_has_avx2() {
  static const bool has = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                          __builtin_cpu_supports("f16c");
  return has;
}

// The same loop compiled for AVX2 (this file is built for the baseline ISA,
// SSE2: a quarter of AVX2's width), taken when the CPU has it.
template <typename U>
__attribute__((target("avx2"))) U carried_bits_avx2(const U* bits, int64_t start, int64_t end,
                                                    U mask, U offset) {
  return carried_bits_portable(bits, start, end, mask, offset);
}

// And for AVX-512 (unrolled: the loop is bound by loads, not by the or
// chain): 64K float32 entries from cache in 3.2 against 4.1 us for AVX2.
template <typename U>
__attribute__((target("avx512f,avx512bw"), optimize("unroll-loops"))) U carried_bits_avx512(
    const U* bits, int64_t start, int64_t end, U mask, U offset) {
  return carried_bits_portable(bits, start, end, mask, offset);
}
#endif

template <typename U>
U carried_bits(const U* bits, int64_t start, int64_t end, U mask, U offset) {
#if defined(__x86_64__) && defined(__GNUC__)
  if (cpu_has_avx512()) return carried_bits_avx512(bits, start, end, mask, offset);
  if (cpu_has_avx2()) return carried_bits_avx2(bits, start, end, mask, offset);
#endif
  return carried_bits_portable(bits, start, end, mask, offset);
}

template <typename U>
bool scan(const void* data, int64_t start, int64_t end, U magnitude_mask, U infinity,
          bool check_inf, const std::atomic<bool>& stop) {
  constexpr int64_t kBlock = 4096;
  constexpr U kSign = static_cast<U>(U(1) << (8 * sizeof(U) - 1));
  const U mask = check_inf ? infinity : magnitude_mask;
  const U offset = check_inf ? static_cast<U>(kSign - infinity) : static_cast<U>(kSign - 1 - infinity);
  const U* bits = static_cast<const U*>(data);
  for (int64_t block = start; block < end; block += kBlock) {
    // Another thread found one: the answer is known.
    if (stop.load(std::memory_order_relaxed)) return false;
    const int64_t block_end = block + kBlock < end ? block + kBlock : end;
    if (carried_bits(bits, block, block_end, mask, offset) & kSign) return true;
  }
  return false;
}

// The real dtype whose entries a tensor of `type` is read as (a complex
// tensor's are its real and imaginary parts), or Undefined: not read.
at::ScalarType scanned_type(at::ScalarType type) {
  switch (type) {
    case at::kFloat:
    case at::kDouble:
    case at::kHalf:
    case at::kBFloat16:
      return type;
    case at::kComplexFloat:
      return at::kFloat;
    case at::kComplexDouble:
      return at::kDouble;
    case at::kComplexHalf:
      return at::kHalf;
    default:
      return at::ScalarType::Undefined;
  }
}

// Entries [start, end) of one tensor's data, read as `type` (a scanned_type).
bool scan_entries(at::ScalarType type, const void* data, int64_t start, int64_t end,
                  bool check_inf, const std::atomic<bool>& stop) {
  switch (type) {
    case at::kFloat:
      return scan<uint32_t>(data, start, end, 0x7fffffffu, 0x7f800000u, check_inf, stop);
    case at::kDouble:
      return scan<uint64_t>(data, start, end, 0x7fffffffffffffffull, 0x7ff0000000000000ull,
                            check_inf, stop);
    case at::kHalf:
      return scan<uint16_t>(data, start, end, 0x7fff, 0x7c00, check_inf, stop);
    default:  // kBFloat16
      return scan<uint16_t>(data, start, end, 0x7fff, 0x7f80, check_inf, stop);
  }
}

// Entries per task of ATen's threads: a call of fewer entries in all runs on
// the calling thread (starting a parallel region costs more than it saves).
// Outputs an op's threads just wrote lie half in the other core's cache: read
// on both threads, the benchmark MLP's step under detect_anomaly went from
// 1.51x to 1.38x eager (grains 2^12 to 2^14 alike; 2^16 left its 64K-entry
// weight gradients on one thread). FiniteGuard's 1.6M float32 gradients
// (6.3 MB, past the L2 cache): 222 us on one thread, 100-120 on two.
constexpr int64_t kParallelGrain = int64_t(1) << 14;

// Whether the scans read t: a contiguous CPU tensor of a scanned_type.
bool readable(const at::Tensor& t) {
  return t.layout() == at::kStrided && t.device().is_cpu() && t.is_contiguous() &&
         scanned_type(t.scalar_type()) != at::ScalarType::Undefined;
}

// The entries of the tensors a scan reads, joined end to end (a complex
// tensor's as its real and imaginary parts).
struct JoinedEntries {
  std::vector<const void*> data;
  std::vector<at::ScalarType> types;  // the real dtype each is read as
  std::vector<int64_t> ends;          // each tensor's end in the joined index
  int64_t total = 0;

  void add(const at::Tensor& t) {  // a readable one
    data.push_back(t.const_data_ptr());
    types.push_back(scanned_type(t.scalar_type()));
    total += t.numel() * (t.is_complex() ? 2 : 1);
    ends.push_back(total);
  }

  // piece(type, data, start, end) on each tensor's part of the joined range
  // [begin, end), in order, until one returns true (then true).
  template <typename Piece>
  bool any_piece(int64_t begin, int64_t end, const Piece& piece) const {
    size_t i = std::upper_bound(ends.begin(), ends.end(), begin) - ends.begin();
    for (; i < data.size() && begin < end; ++i) {
      const int64_t first = i == 0 ? 0 : ends[i - 1];
      const int64_t last = std::min(end, ends[i]);
      if (piece(types[i], data[i], begin - first, last - first)) return true;
      begin = last;
    }
    return false;
  }
};

}  // namespace

// debug_checks.h says what it returns.
int any_nonfinite(const std::vector<at::Tensor>& tensors, bool check_inf) {
  int result = 0;
  JoinedEntries joined;
  for (const at::Tensor& t : tensors) {
    if (!t.defined() || t.numel() == 0 || !(t.is_floating_point() || t.is_complex())) continue;
    if (!readable(t)) {
      result = -1;
      continue;
    }
    joined.add(t);
  }
  std::atomic<bool> found{false};
  at::parallel_for(0, joined.total, kParallelGrain, [&](int64_t begin, int64_t end) {
    const bool here = joined.any_piece(
        begin, end, [&](at::ScalarType type, const void* data, int64_t start, int64_t stop) {
          return scan_entries(type, data, start, stop, check_inf, found);
        });
    if (here) found.store(true, std::memory_order_relaxed);
  });
  return found.load() ? 1 : result;
}

namespace {

// FiniteGuard's clipping norm, in the pass of its check (nonfinite_and_norm):
// sums of |x| (P = 1) or x^2 (P = 2), or the largest |x| (P = 0, the inf
// norm), of entries [start, end) in float64, into eight independent
// accumulators (lanes the compiler vectorizes: no reassociation asked).
template <int P, typename T>
inline __attribute__((always_inline)) void power_sum_portable(const T* x, int64_t start,
                                                              int64_t end, double (&acc)[8]) {
  int64_t i = start;
  for (; i + 8 <= end; i += 8) {
    for (int k = 0; k < 8; ++k) {
      const double v = static_cast<double>(static_cast<float>(x[i + k]));
      if constexpr (P == 2) {
        acc[k] += v * v;
      } else if constexpr (P == 1) {
        acc[k] += std::fabs(v);
      } else {
        acc[k] = std::fabs(v) > acc[k] ? std::fabs(v) : acc[k];
      }
    }
  }
  for (; i < end; ++i) {
    const double v = static_cast<double>(static_cast<float>(x[i]));
    if constexpr (P == 2) {
      acc[0] += v * v;
    } else if constexpr (P == 1) {
      acc[0] += std::fabs(v);
    } else {
      acc[0] = std::fabs(v) > acc[0] ? std::fabs(v) : acc[0];
    }
  }
}

#if defined(__x86_64__) && defined(__GNUC__)
template <int P, typename T>
__attribute__((target("avx2,fma,f16c"))) void power_sum_avx2(const T* x, int64_t start,
                                                             int64_t end, double (&acc)[8]) {
  power_sum_portable<P>(x, start, end, acc);
}

template <int P, typename T>
__attribute__((target("avx512f,avx512bw,f16c"))) void power_sum_avx512(const T* x, int64_t start,
                                                                       int64_t end,
                                                                       double (&acc)[8]) {
  power_sum_portable<P>(x, start, end, acc);
}
#endif

template <int P, typename T>
void power_sum(const void* data, int64_t start, int64_t end, double (&acc)[8]) {
  const T* x = static_cast<const T*>(data);
#if defined(__x86_64__) && defined(__GNUC__)
  if (cpu_has_avx512()) return power_sum_avx512<P>(x, start, end, acc);
  if (cpu_has_avx2()) return power_sum_avx2<P>(x, start, end, acc);
#endif
  power_sum_portable<P>(x, start, end, acc);
}

template <int P>
void power_sum_of(at::ScalarType type, const void* data, int64_t start, int64_t end,
                  double (&acc)[8]) {
  switch (type) {
    case at::kFloat:
      return power_sum<P, float>(data, start, end, acc);
    case at::kHalf:
      return power_sum<P, c10::Half>(data, start, end, acc);
    default:  // kBFloat16
      return power_sum<P, c10::BFloat16>(data, start, end, acc);
  }
}

}  // namespace

// nonfinite_and_norm's contract is in the binding's docstring below.
std::tuple<int, double> nonfinite_and_norm(const std::vector<at::Tensor>& tensors,
                                           double norm_type) {
  // 2 and 1: sums of powers; 0: the largest magnitude (the inf norm).
  const int power = norm_type == 2.0                            ? 2
                    : norm_type == 1.0                          ? 1
                    : std::isinf(norm_type) && norm_type > 0    ? 0
                                                                : -1;
  if (power < 0) return {-1, 0.0};
  JoinedEntries joined;
  for (const at::Tensor& t : tensors) {
    if (!t.defined() || t.numel() == 0) continue;
    // float64 entries' powers may overflow float64 sums; a complex entry's |z| is
    // not the norm of its two parts but for the 2-norm: left to the caller.
    if (!(t.is_floating_point() || t.is_complex()) || !readable(t) ||
        scanned_type(t.scalar_type()) == at::kDouble || (t.is_complex() && power != 2)) {
      return {-1, 0.0};
    }
    joined.add(t);
  }
  const int64_t total = joined.total;
  // Chunks of the joined entries, each with its own partial: added in chunk
  // order, the norm is the same on any number of threads.
  const int64_t chunks = (total + kParallelGrain - 1) / kParallelGrain;
  std::vector<double> partial(chunks, 0.0);
  std::atomic<bool> found{false};
  at::parallel_for(0, chunks, 1, [&](int64_t chunk_begin, int64_t chunk_end) {
    for (int64_t c = chunk_begin; c < chunk_end; ++c) {
      const int64_t begin = c * kParallelGrain;
      const int64_t end = std::min(total, begin + kParallelGrain);
      double acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
      const bool here = joined.any_piece(
          begin, end, [&](at::ScalarType type, const void* data, int64_t start, int64_t stop) {
            if (scan_entries(type, data, start, stop, true, found)) return true;
            if (power == 2) {
              power_sum_of<2>(type, data, start, stop, acc);
            } else if (power == 1) {
              power_sum_of<1>(type, data, start, stop, acc);
            } else {
              power_sum_of<0>(type, data, start, stop, acc);
            }
            return false;
          });
      if (here) {
        found.store(true, std::memory_order_relaxed);
        return;
      }
      double sum = acc[0];
      for (int k = 1; k < 8; ++k) sum = power == 0 ? std::max(sum, acc[k]) : sum + acc[k];
      partial[c] = sum;
    }
  });
  if (found.load()) return {1, std::numeric_limits<double>::quiet_NaN()};
  double norm = 0.0;
  for (double v : partial) norm = power == 0 ? std::max(norm, v) : norm + v;
  return {0, power == 2 ? std::sqrt(norm) : norm};
}

void bind_debug_observer(pybind11::module_& m);

void bind_debug(pybind11::module_& m) {
  m.def("any_nonfinite", &any_nonfinite, pybind11::arg("tensors"), pybind11::arg("check_inf"),
        "1 if a tensor holds NaN (or +-inf with check_inf), 0 if none does, -1 if one is not "
        "a contiguous CPU float32/float64/float16/bfloat16 tensor or complex tensor of "
        "those (left to the caller); more than 16K entries in all are scanned on ATen's "
        "threads");
  m.def("nonfinite_and_norm", &nonfinite_and_norm, pybind11::arg("tensors"),
        pybind11::arg("norm_type"),
        "(found, norm) in one pass over the tensors (FiniteGuard's check and clipping "
        "norm): found 1 if a tensor holds NaN or +-inf (norm NaN then), else 0 and norm "
        "the total norm of order norm_type (1, 2 or inf) of all their entries, summed in "
        "float64 (no float32, float16 or bfloat16 entry's square can overflow there) in "
        "chunks added in order (the same value on any number of threads); found -1 (left "
        "to the caller) for another norm type or a tensor that is not a contiguous CPU "
        "float32/float16/bfloat16 tensor (complex ones of those for the 2-norm)");
  bind_debug_observer(m);
}

}  // namespace nanfree
