// The CUDA execution model on the host, for testing nanfree's CUDA kernels
// without a GPU. This header is force-included (g++ -include) into every
// kernel file that tests/cuda_emulation/rewrite.py has rewritten (launches
// `k<<<g, b, smem, stream>>>(args)` become cuda_emulation::launch calls,
// `__shared__` declarations per-block storage, and each __global__ function
// announces itself and its __launch_bounds__ on entry). Everything else of the
// kernel source compiles unchanged with the host compiler.
//
// Each CUDA thread of a block runs as its own fiber (runtime.cpp), so
// __syncthreads and the warp collectives (__shfl*_sync, __syncwarp,
// __ballot_sync, __any_sync, __all_sync) are real scheduling points: a thread
// waits there until every thread the collective names has arrived. Blocks run
// one after another. Misuse (a divergent barrier, a collective whose mask
// names an exited lane, a deadlock, a launch past the device's limits) aborts
// with the kernel's file and line and the threads involved.
//
// half and bfloat16 come from CUDA's own headers: compiled by the host
// compiler, their conversions take the host paths, which round as the device
// does.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <bit>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <tuple>
#include <type_traits>
#include <utility>

namespace cuda_emulation {

// A place in the kernel source: where a thread waits, or where a launch is.
struct Site {
  const char* file;
  int line;
};

// What the running CUDA thread sees as threadIdx, blockIdx, blockDim and gridDim.
struct ThreadView {
  uint3 thread_idx;
  uint3 block_idx;
  dim3 block_dim;
  dim3 grid_dim;
};

// The view of the CUDA thread running on this OS thread (aborts outside a kernel).
const ThreadView& current();

// ---------------------------------------------------------------------------
// Block-level synchronization and warp collectives (runtime.cpp).

void syncthreads(Site site);

enum class Collective : int { ShuffleIndex, ShuffleUp, ShuffleDown, ShuffleXor, Ballot, Any, All, SyncWarp };

// The lanes of `mask` exchange 8-byte payloads; the result of the calling lane
// is returned. `arg` is the source lane, delta or xor mask, `width` the
// shuffle's segment (a power of two up to 32).
uint64_t warp_collective(Site site, Collective kind, unsigned mask, uint64_t payload, int arg,
                         int width);

template <typename T>
uint64_t to_payload(T value) {
  static_assert(std::is_trivially_copyable_v<T> && sizeof(T) <= 8,
                "a warp shuffle moves values of at most 8 bytes");
  uint64_t bits = 0;
  std::memcpy(&bits, &value, sizeof(T));
  return bits;
}

template <typename T>
T from_payload(uint64_t bits) {
  T value;
  std::memcpy(&value, &bits, sizeof(T));
  return value;
}

template <typename T>
T shuffle(Site site, Collective kind, unsigned mask, T value, int arg, int width) {
  return from_payload<T>(warp_collective(site, kind, mask, to_payload(value), arg, width));
}

// ---------------------------------------------------------------------------
// Shared memory: one arena per block, filled with 0xff bytes (NaN in every
// floating type) when the block starts, so a read before a write shows.

void* shared_storage(Site site, size_t bytes, size_t alignment);
void* dynamic_shared_storage(Site site, size_t alignment);

template <typename T, size_t kAlign = alignof(T)>
T& shared_variable(Site site) {
  constexpr size_t align = kAlign > alignof(T) ? kAlign : alignof(T);
  return *static_cast<T*>(shared_storage(site, sizeof(T), align));
}

template <typename T, size_t kAlign = alignof(T)>
T* dynamic_shared(Site site) {
  constexpr size_t align = kAlign > alignof(T) ? kAlign : alignof(T);
  return static_cast<T*>(dynamic_shared_storage(site, align));
}

// ---------------------------------------------------------------------------
// Kernels and launches.

// Called first by every thread of a __global__ function: its name (with
// template arguments), where it is, its __launch_bounds__ (0: none) and its
// parameter names (comma-separated, for the launch log).
void enter_kernel(const char* pretty_name, Site site, int max_threads, const char* params);

struct LaunchConfig {
  Site site;
  const char* callee;  // the launch's kernel expression, as written
  dim3 grid;
  dim3 block;
  size_t dynamic_shared_bytes;
};

inline LaunchConfig config(Site site, const char* callee, dim3 grid, dim3 block,
                           size_t dynamic_shared_bytes = 0, cudaStream_t /*stream*/ = nullptr) {
  return LaunchConfig{site, callee, grid, block, dynamic_shared_bytes};
}

// A type-erased call of the kernel with its arguments, run once per thread.
struct KernelCall {
  void (*run)(void* state);
  void* state;
};

// An argument of the launch as the launch log records it (integers and
// booleans only; the log names them after the kernel's parameters).
struct LoggedArgument {
  bool integral;
  long long value;
};

void run_grid(const LaunchConfig& config, KernelCall call, const LoggedArgument* arguments,
              int argument_count);

// Launches run so far in this process (tests check that bad input launches nothing).
long long launch_count();
// The most blocks of a launch since the last call (0 if none).
long long largest_grid();

template <typename T>
LoggedArgument log_argument(const T& value) {
  if constexpr (std::is_integral_v<T> || std::is_enum_v<T>) {
    return LoggedArgument{true, static_cast<long long>(value)};
  } else {
    return LoggedArgument{false, 0};
  }
}

template <typename... P, typename... A>
void launch(void (*kernel)(P...), const LaunchConfig& config, A&&... args) {
  static_assert(sizeof...(P) == sizeof...(A), "a kernel launch with the wrong number of arguments");
  struct State {
    void (*kernel)(P...);
    std::tuple<std::decay_t<P>...> params;
  };
  // Converted once, as the launch would; every thread gets its own copies.
  State state{kernel, std::tuple<std::decay_t<P>...>(std::forward<A>(args)...)};
  const KernelCall call{[](void* s) {
                          State& st = *static_cast<State*>(s);
                          std::apply(st.kernel, st.params);
                        },
                        &state};
  LoggedArgument logged[sizeof...(P) > 0 ? sizeof...(P) : 1] = {};
  std::apply(
      [&](const auto&... p) {
        int i = 0;
        ((logged[i++] = log_argument(p)), ...);
      },
      state.params);
  run_grid(config, call, logged, static_cast<int>(sizeof...(P)));
}

// Atomics: threads switch only at synchronization points, so a plain
// read-modify-write is atomic with respect to the other threads.
template <typename T, typename F>
T atomic_update(T* address, F new_value) {
  const T old = *address;
  *address = new_value(old);
  return old;
}

}  // namespace cuda_emulation

// ---------------------------------------------------------------------------
// The names kernel code uses.

#define NANFREE_CUDA_EMULATION_SITE (::cuda_emulation::Site{__FILE__, __LINE__})

#define threadIdx (::cuda_emulation::current().thread_idx)
#define blockIdx (::cuda_emulation::current().block_idx)
#define blockDim (::cuda_emulation::current().block_dim)
#define gridDim (::cuda_emulation::current().grid_dim)
#define warpSize 32

#undef __launch_bounds__
#define __launch_bounds__(...)

#define __syncthreads() ::cuda_emulation::syncthreads(NANFREE_CUDA_EMULATION_SITE)
#define __syncwarp(...) \
  ::cuda_emulation::syncwarp(NANFREE_CUDA_EMULATION_SITE __VA_OPT__(, ) __VA_ARGS__)
#define __shfl_sync(...) ::cuda_emulation::shfl_sync(NANFREE_CUDA_EMULATION_SITE, __VA_ARGS__)
#define __shfl_up_sync(...) ::cuda_emulation::shfl_up_sync(NANFREE_CUDA_EMULATION_SITE, __VA_ARGS__)
#define __shfl_down_sync(...) \
  ::cuda_emulation::shfl_down_sync(NANFREE_CUDA_EMULATION_SITE, __VA_ARGS__)
#define __shfl_xor_sync(...) ::cuda_emulation::shfl_xor_sync(NANFREE_CUDA_EMULATION_SITE, __VA_ARGS__)
#define __ballot_sync(...) ::cuda_emulation::ballot_sync(NANFREE_CUDA_EMULATION_SITE, __VA_ARGS__)
#define __any_sync(...) ::cuda_emulation::any_sync(NANFREE_CUDA_EMULATION_SITE, __VA_ARGS__)
#define __all_sync(...) ::cuda_emulation::all_sync(NANFREE_CUDA_EMULATION_SITE, __VA_ARGS__)

namespace cuda_emulation {

inline void syncwarp(Site site, unsigned mask = 0xffffffffu) {
  warp_collective(site, Collective::SyncWarp, mask, 0, 0, 32);
}
template <typename T>
T shfl_sync(Site site, unsigned mask, T value, int src_lane, int width = 32) {
  return shuffle(site, Collective::ShuffleIndex, mask, value, src_lane, width);
}
template <typename T>
T shfl_up_sync(Site site, unsigned mask, T value, unsigned delta, int width = 32) {
  return shuffle(site, Collective::ShuffleUp, mask, value, static_cast<int>(delta), width);
}
template <typename T>
T shfl_down_sync(Site site, unsigned mask, T value, unsigned delta, int width = 32) {
  return shuffle(site, Collective::ShuffleDown, mask, value, static_cast<int>(delta), width);
}
template <typename T>
T shfl_xor_sync(Site site, unsigned mask, T value, int lane_mask, int width = 32) {
  return shuffle(site, Collective::ShuffleXor, mask, value, lane_mask, width);
}
inline unsigned ballot_sync(Site site, unsigned mask, int predicate) {
  return static_cast<unsigned>(
      warp_collective(site, Collective::Ballot, mask, predicate != 0, 0, 32));
}
inline int any_sync(Site site, unsigned mask, int predicate) {
  return static_cast<int>(warp_collective(site, Collective::Any, mask, predicate != 0, 0, 32));
}
inline int all_sync(Site site, unsigned mask, int predicate) {
  return static_cast<int>(warp_collective(site, Collective::All, mask, predicate != 0, 0, 32));
}

}  // namespace cuda_emulation

// Device functions of CUDA's math library that have no host declaration. The
// fast intrinsics (__expf, ...) are emulated by the accurate functions.
inline float __expf(float x) { return ::expf(x); }
inline float __logf(float x) { return ::logf(x); }
inline float __fdividef(float a, float b) { return a / b; }
inline float __frcp_rn(float x) { return 1.0f / x; }
inline float __fmaf_rn(float a, float b, float c) { return ::fmaf(a, b, c); }
inline double __fma_rn(double a, double b, double c) { return ::fma(a, b, c); }
inline float __saturatef(float x) { return x != x ? 0.0f : x < 0.0f ? 0.0f : x > 1.0f ? 1.0f : x; }
inline float rsqrtf(float x) { return 1.0f / ::sqrtf(x); }
inline double rsqrt(double x) { return 1.0 / ::sqrt(x); }
inline int __float_as_int(float x) { return std::bit_cast<int>(x); }
inline unsigned __float_as_uint(float x) { return std::bit_cast<unsigned>(x); }
inline float __int_as_float(int x) { return std::bit_cast<float>(x); }
inline float __uint_as_float(unsigned x) { return std::bit_cast<float>(x); }
inline long long __double_as_longlong(double x) { return std::bit_cast<long long>(x); }
inline double __longlong_as_double(long long x) { return std::bit_cast<double>(x); }
template <typename T>
T __ldg(const T* p) {
  return *p;
}
template <typename T>
T atomicAdd(T* address, T value) {
  return ::cuda_emulation::atomic_update(address, [&](T old) { return old + value; });
}
template <typename T>
T atomicMax(T* address, T value) {
  return ::cuda_emulation::atomic_update(address, [&](T old) { return old < value ? value : old; });
}
template <typename T>
T atomicMin(T* address, T value) {
  return ::cuda_emulation::atomic_update(address, [&](T old) { return value < old ? value : old; });
}
template <typename T>
T atomicExch(T* address, T value) {
  return ::cuda_emulation::atomic_update(address, [&](T) { return value; });
}
template <typename T>
T atomicCAS(T* address, T compare, T value) {
  return ::cuda_emulation::atomic_update(address,
                                         [&](T old) { return old == compare ? value : old; });
}
