// The scheduler of the CUDA emulation (see include/cuda_emulation.h): runs a
// grid block after block, each block's threads as fibers, checks launches
// against the limits of an sm_90 device (an H100), and aborts with the
// kernel's file and line on misuse.
//
// Environment:
// - NANFREE_CUDA_SCHEDULE: the order in which runnable threads of a block run
//   between synchronization points.
//     lockstep (default)   threads in index order, round robin: every thread
//                          reaches the next synchronization point before any
//                          thread goes past it.
//     first-warp-ahead     the lowest runnable thread always: warp 0 runs as
//                          far as it can (through its shuffles, up to a
//                          barrier) before warp 1 starts.
//     last-warp-ahead      the same with the warps in reverse order.
//     random[:seed]        a random runnable thread each time.
// - NANFREE_CUDA_EMULATION_LOG: a file to which every launch appends one JSON
//   line (launch site, kernel, grid, block, integer arguments by name); the
//   coverage report (tests/cuda_emulation/coverage.py) reads it.
// - NANFREE_CUDA_EMULATION: the variant, whose launch limits
//   (csrc/cuda/launch_limits.h) variant_limit gives:
//     plain          the cosine family's warp-per-row kernels from 1 row.
//     grid_capped    at most 3 blocks per launch (every grid-stride loop
//                    iterates), MNR chunks of 1024 cosines (the driver's
//                    chunk loop runs), the warp-per-row kernels from 64 rows
//                    (fewer take the group kernels).
//     sanitized      the GPU's limits.
#include <fcntl.h>
#include <unistd.h>

#include <atomic>
#include <cstdarg>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "cuda/launch_limits.h"
#include "cuda_emulation.h"
#include "fiber.h"

#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/asan_interface.h>
#define NANFREE_EMULATION_POISON(p, n) ASAN_POISON_MEMORY_REGION(p, n)
#define NANFREE_EMULATION_UNPOISON(p, n) ASAN_UNPOISON_MEMORY_REGION(p, n)
#else
#define NANFREE_EMULATION_POISON(p, n) ((void)(p), (void)(n))
#define NANFREE_EMULATION_UNPOISON(p, n) ((void)(p), (void)(n))
#endif

namespace cuda_emulation {
namespace {

// The limits of an sm_90 device (H100), as cudaGetDeviceProperties reports them.
constexpr unsigned kMaxThreadsPerBlock = 1024;
constexpr unsigned kMaxBlockDim[3] = {1024, 1024, 64};
constexpr unsigned kMaxGridDim[3] = {2147483647u, 65535, 65535};
// Static plus dynamic shared memory of a block without the opt-in attribute
// (cudaFuncAttributeMaxDynamicSharedMemorySize), which no kernel sets.
constexpr size_t kSharedBytesPerBlock = 48 << 10;
constexpr int kWarpSize = 32;
constexpr uint64_t kPoison = ~uint64_t(0);  // NaN in every floating type, -1 in every integer
// Gaps between shared allocations (filled with the poison): an index with the
// wrong stride reads NaN rather than a neighbour's data.
constexpr size_t kSharedGap = 64;
constexpr size_t kArenaBytes = 2 * kSharedBytesPerBlock + 64 * kSharedGap;

enum class Schedule { Lockstep, FirstWarpAhead, LastWarpAhead, Random };

enum class State : uint8_t { Runnable, Barrier, Collective, Exited };

const char* collective_name(Collective kind) {
  switch (kind) {
    case Collective::ShuffleIndex: return "__shfl_sync";
    case Collective::ShuffleUp: return "__shfl_up_sync";
    case Collective::ShuffleDown: return "__shfl_down_sync";
    case Collective::ShuffleXor: return "__shfl_xor_sync";
    case Collective::Ballot: return "__ballot_sync";
    case Collective::Any: return "__any_sync";
    case Collective::All: return "__all_sync";
    case Collective::SyncWarp: return "__syncwarp";
  }
  return "?";
}

bool same_site(Site a, Site b) {
  return a.line == b.line && (a.file == b.file || std::strcmp(a.file, b.file) == 0);
}

struct Thread {
  Fiber fiber;
  ThreadView view;
  int linear = 0;
  State state = State::Runnable;
  Site site{"", 0};  // where it waits
  // The collective it waits in.
  Collective kind = Collective::SyncWarp;
  unsigned mask = 0;
  uint64_t payload = 0;
  int arg = 0;
  int width = kWarpSize;
  uint64_t result = 0;
};

struct Warp {
  uint32_t exists = 0;         // lanes that are threads of the block
  uint32_t runnable = 0;
  uint32_t at_collective = 0;
  uint32_t exited = 0;
};

struct SharedAllocation {
  Site site;
  size_t offset;
  size_t bytes;
};

struct Launch {
  LaunchConfig config;
  const LoggedArgument* arguments = nullptr;
  int argument_count = 0;
  const char* kernel = nullptr;  // __PRETTY_FUNCTION__ of the kernel, once a thread entered it
  Site kernel_site{"", 0};
  const char* parameters = nullptr;
  unsigned threads_per_block = 0;
  KernelCall call{};
};

Schedule schedule_from_environment(uint64_t* seed) {
  *seed = 0x9E3779B97F4A7C15ull;
  const char* value = std::getenv("NANFREE_CUDA_SCHEDULE");
  if (value == nullptr || *value == '\0' || std::strcmp(value, "lockstep") == 0) return Schedule::Lockstep;
  if (std::strcmp(value, "first-warp-ahead") == 0) return Schedule::FirstWarpAhead;
  if (std::strcmp(value, "last-warp-ahead") == 0) return Schedule::LastWarpAhead;
  if (std::strncmp(value, "random", 6) == 0 && (value[6] == '\0' || value[6] == ':')) {
    if (value[6] == ':') *seed ^= std::strtoull(value + 7, nullptr, 10) * 0xBF58476D1CE4E5B9ull;
    return Schedule::Random;
  }
  std::fprintf(stderr,
               "cuda emulation: NANFREE_CUDA_SCHEDULE=%s is not one of lockstep, "
               "first-warp-ahead, last-warp-ahead, random[:seed]\n",
               value);
  std::abort();
}

class Block;

// Per OS thread: the block being run and the running CUDA thread.
thread_local Block* running_block = nullptr;
thread_local Thread* running_thread = nullptr;
thread_local Launch* running_launch = nullptr;

class Block {
 public:
  Block() : arena_(new unsigned char[kArenaBytes + 256]) {
    base_ = reinterpret_cast<unsigned char*>((reinterpret_cast<uintptr_t>(arena_.get()) + 255) &
                                             ~uintptr_t(255));
    std::memset(base_, 0xff, kArenaBytes);
    NANFREE_EMULATION_POISON(base_, kArenaBytes);
    next_offset_ = kArenaBytes;
    uint64_t seed;
    schedule_ = schedule_from_environment(&seed);
    rng_ = seed;
  }

  void run(Launch& launch, uint3 block_idx) {
    launch_ = &launch;
    const dim3 b = launch.config.block;
    const int n = static_cast<int>(b.x * b.y * b.z);
    if (static_cast<int>(threads_.size()) < n) {
      threads_.reserve(n);
      while (static_cast<int>(threads_.size()) < n) threads_.push_back(std::make_unique<Thread>());
    }
    count_ = n;
    warps_.assign((n + kWarpSize - 1) / kWarpSize, Warp{});
    for (int i = 0; i < n; ++i) {
      Thread& t = *threads_[i];
      t.linear = i;
      t.state = State::Runnable;
      t.view.thread_idx = uint3{static_cast<unsigned>(i) % b.x, (static_cast<unsigned>(i) / b.x) % b.y,
                                static_cast<unsigned>(i) / (b.x * b.y)};
      t.view.block_idx = block_idx;
      t.view.block_dim = b;
      t.view.grid_dim = launch.config.grid;
      t.fiber.prepare(&Block::thread_main, &t);
      warps_[i / kWarpSize].exists |= 1u << (i % kWarpSize);
    }
    for (Warp& w : warps_) w.runnable = w.exists;
    live_ = n;
    at_barrier_ = 0;
    cursor_ = -1;
    reset_shared();

    running_block = this;
    for (;;) {
      const int next = pick();
      if (next < 0) {
        if (live_ == 0) break;
        report_stuck();
      }
      cursor_ = next;
      running_thread = threads_[next].get();
      running_thread->fiber.switch_from(scheduler_);
      running_thread = nullptr;
    }
    running_block = nullptr;
  }

  // --- called by the running CUDA thread ----------------------------------

  void syncthreads(Site site) {
    Thread& t = *running_thread;
    t.state = State::Barrier;
    t.site = site;
    clear_runnable(t.linear);
    ++at_barrier_;
    if (at_barrier_ == live_) release_barrier();
    yield();
  }

  uint64_t collective(Site site, Collective kind, unsigned mask, uint64_t payload, int arg,
                      int width) {
    Thread& t = *running_thread;
    const int lane = t.linear % kWarpSize;
    Warp& w = warps_[t.linear / kWarpSize];
    t.site = site;
    t.kind = kind;
    if (!(mask & (1u << lane)))
      fail_collective(t, "its mask 0x%08x does not name the calling lane %d", mask, lane);
    if (mask & ~w.exists)
      fail_collective(t, "its mask 0x%08x names lanes 0x%08x that are not threads of the block "
                      "(the block has %d threads)", mask, mask & ~w.exists, count_);
    if (mask & w.exited)
      fail_collective(t, "its mask 0x%08x names lanes 0x%08x that have exited", mask,
                      mask & w.exited);
    if (kind != Collective::SyncWarp && kind != Collective::Ballot && kind != Collective::Any &&
        kind != Collective::All && (width < 1 || width > kWarpSize || (width & (width - 1)) != 0))
      fail_collective(t, "its width %d is not a power of two up to 32", width);
    t.state = State::Collective;
    t.mask = mask;
    t.payload = payload;
    t.arg = arg;
    t.width = width;
    w.at_collective |= 1u << lane;
    clear_runnable(t.linear);
    // Only this lane's arrival changed: only its collective can be complete now.
    if (collective_ready(t.linear / kWarpSize, t)) complete_collective(t.linear / kWarpSize, t);
    yield();
    return t.result;
  }

  void* shared(Site site, size_t bytes, size_t alignment, bool dynamic) {
    for (const SharedAllocation& a : shared_) {
      if (same_site(a.site, site)) return base_ + a.offset;
    }
    size_t offset;
    if (dynamic) {
      // Dynamic shared memory starts the arena (all declarations alias it).
      if (alignment > 256)
        fail("extern __shared__ array aligned to %zu bytes, beyond the arena's 256", alignment);
      bytes = launch_->config.dynamic_shared_bytes;
      offset = 0;
    } else {
      offset = (next_offset_ + alignment - 1) / alignment * alignment;
      static_bytes_ += bytes;
      if (static_bytes_ + launch_->config.dynamic_shared_bytes > kSharedBytesPerBlock)
        fail("__shared__ declaration at %s:%d brings the block's shared memory to %zu static + "
             "%zu dynamic bytes, over the %zu of a block",
             site.file, site.line, static_bytes_, launch_->config.dynamic_shared_bytes,
             kSharedBytesPerBlock);
      if (offset + bytes + kSharedGap > kArenaBytes) fail("shared memory arena exhausted");
      next_offset_ = offset + bytes + kSharedGap;
    }
    NANFREE_EMULATION_UNPOISON(base_ + offset, bytes);
    shared_.push_back(SharedAllocation{site, offset, bytes});
    return base_ + offset;
  }

  [[noreturn]] void fail(const char* format, ...) __attribute__((format(printf, 2, 3))) {
    va_list args;
    va_start(args, format);
    std::fprintf(stderr, "\ncuda emulation: ");
    std::vfprintf(stderr, format, args);
    va_end(args);
    std::fprintf(stderr, "\n");
    describe_launch();
    std::fflush(stderr);
    std::abort();
  }

 private:
  static void thread_main(void* arg) {
    Fiber::entered();
    Thread& t = *static_cast<Thread*>(arg);
    running_launch->call.run(running_launch->call.state);
    running_block->thread_exited(t);
  }

  void thread_exited(Thread& t) {
    t.state = State::Exited;
    t.site = Site{"", 0};
    clear_runnable(t.linear);
    const int lane = t.linear % kWarpSize;
    Warp& w = warps_[t.linear / kWarpSize];
    w.exited |= 1u << lane;
    --live_;
    // A lane waiting in a collective whose mask names this lane would wait forever.
    for (uint32_t waiting = w.at_collective; waiting != 0; waiting &= waiting - 1) {
      const int other = (t.linear / kWarpSize) * kWarpSize + __builtin_ctz(waiting);
      const Thread& o = *threads_[other];
      if (o.mask & (1u << lane))
        fail("thread %s exited while lane %d waits in %s at %s:%d with mask 0x%08x, which names it",
             thread_name(t.linear).c_str(), other % kWarpSize, collective_name(o.kind), o.site.file,
             o.site.line, o.mask);
    }
    if (live_ > 0 && at_barrier_ == live_) release_barrier();
    scheduler_.switch_from(t.fiber);
    std::abort();  // an exited thread is never resumed
  }

  void yield() { scheduler_.switch_from(running_thread->fiber); }

  void set_runnable(int i) {
    warps_[i / kWarpSize].runnable |= 1u << (i % kWarpSize);
  }
  void clear_runnable(int i) { warps_[i / kWarpSize].runnable &= ~(1u << (i % kWarpSize)); }

  void release_barrier() {
    // Every live thread waits at a barrier: the same one, or the block diverged.
    const Thread* first = nullptr;
    for (int i = 0; i < count_; ++i) {
      const Thread& t = *threads_[i];
      if (t.state != State::Barrier) continue;
      if (first == nullptr) {
        first = &t;
      } else if (!same_site(first->site, t.site)) {
        fail("divergent __syncthreads: the live threads wait at different barriers\n%s",
             waiting_threads().c_str());
      }
    }
    for (int i = 0; i < count_; ++i) {
      Thread& t = *threads_[i];
      if (t.state == State::Barrier) {
        t.state = State::Runnable;
        set_runnable(i);
      }
    }
    at_barrier_ = 0;
  }

  // Lane o waits in the same collective as t: the same call, mask and width.
  static bool same_collective(const Thread& o, const Thread& t) {
    return o.mask == t.mask && o.kind == t.kind && o.width == t.width && same_site(o.site, t.site);
  }

  // Every lane of t's mask waits in t's collective. (A lane of the mask that
  // waits in another collective comes later, once that one completes.)
  bool collective_ready(int warp, const Thread& t) const {
    const Warp& w = warps_[warp];
    if ((w.at_collective & t.mask) != t.mask) return false;
    for (uint32_t m = t.mask; m != 0; m &= m - 1) {
      if (!same_collective(*threads_[warp * kWarpSize + __builtin_ctz(m)], t)) return false;
    }
    return true;
  }

  void complete_collective(int warp, const Thread& caller) {
    Warp& w = warps_[warp];
    const unsigned mask = caller.mask;
    // A lane waiting at the same call with another mask that names these
    // lanes: they executed it with a mask that differs from its own.
    for (uint32_t m = w.at_collective & ~mask; m != 0; m &= m - 1) {
      const Thread& o = *threads_[warp * kWarpSize + __builtin_ctz(m)];
      if (same_site(o.site, caller.site) && (o.mask & mask) != 0)
        fail("lanes of warp %d meet in different warp collectives: lane %d in %s at %s:%d "
             "(mask 0x%08x, width %d), lane %d in %s at %s:%d (mask 0x%08x, width %d)",
             warp, caller.linear % kWarpSize, collective_name(caller.kind), caller.site.file,
             caller.site.line, caller.mask, caller.width, o.linear % kWarpSize,
             collective_name(o.kind), o.site.file, o.site.line, o.mask, o.width);
    }
    uint64_t ballot = 0;
    for (uint32_t m = mask; m != 0; m &= m - 1) {
      const int lane = __builtin_ctz(m);
      if (threads_[warp * kWarpSize + lane]->payload != 0) ballot |= uint64_t(1) << lane;
    }
    for (uint32_t m = mask; m != 0; m &= m - 1) {
      const int lane = __builtin_ctz(m);
      Thread& t = *threads_[warp * kWarpSize + lane];
      switch (t.kind) {
        case Collective::SyncWarp: t.result = 0; break;
        case Collective::Ballot: t.result = ballot; break;
        case Collective::Any: t.result = ballot != 0; break;
        case Collective::All: t.result = ballot == mask; break;
        default: t.result = shuffle_result(warp, lane, t, mask); break;
      }
      t.state = State::Runnable;
    }
    w.at_collective &= ~mask;
    w.runnable |= mask;
  }

  uint64_t shuffle_result(int warp, int lane, const Thread& t, unsigned mask) const {
    const int width = t.width;
    const int segment = lane / width * width;
    int source;
    switch (t.kind) {
      case Collective::ShuffleIndex:
        source = segment + ((t.arg % width) + width) % width;
        break;
      case Collective::ShuffleUp:
        // Lanes below delta in their segment keep their own value.
        source = (lane - segment) < t.arg ? lane : lane - t.arg;
        break;
      case Collective::ShuffleDown:
        source = (lane - segment) + t.arg >= width ? lane : lane + t.arg;
        break;
      case Collective::ShuffleXor:
        source = lane ^ t.arg;
        // A later segment is out of reach: the lane keeps its own value.
        if (source >= segment + width || source >= kWarpSize) source = lane;
        break;
      default:
        source = lane;
    }
    // A lane outside the mask has no defined value: the poison shows it.
    if (source < 0 || source >= kWarpSize || !(mask & (1u << source))) return kPoison;
    return threads_[warp * kWarpSize + source]->payload;
  }

  int pick() {
    const int warps = static_cast<int>(warps_.size());
    switch (schedule_) {
      case Schedule::FirstWarpAhead:
        for (int w = 0; w < warps; ++w)
          if (warps_[w].runnable) return w * kWarpSize + __builtin_ctz(warps_[w].runnable);
        return -1;
      case Schedule::LastWarpAhead:
        for (int w = warps - 1; w >= 0; --w)
          if (warps_[w].runnable) return w * kWarpSize + __builtin_ctz(warps_[w].runnable);
        return -1;
      case Schedule::Random: {
        int total = 0;
        for (const Warp& w : warps_) total += __builtin_popcount(w.runnable);
        if (total == 0) return -1;
        rng_ ^= rng_ << 13;
        rng_ ^= rng_ >> 7;
        rng_ ^= rng_ << 17;
        int k = static_cast<int>(rng_ % static_cast<uint64_t>(total));
        for (int w = 0; w < warps; ++w) {
          const int c = __builtin_popcount(warps_[w].runnable);
          if (k < c) {
            uint32_t m = warps_[w].runnable;
            for (; k > 0; --k) m &= m - 1;
            return w * kWarpSize + __builtin_ctz(m);
          }
          k -= c;
        }
        return -1;
      }
      case Schedule::Lockstep:
      default: {
        // The next runnable thread after the cursor, cyclically.
        const int start = cursor_ + 1;
        const int sw = start / kWarpSize;
        for (int step = 0; step <= warps; ++step) {
          const int w = (sw + step) % warps;
          uint32_t m = warps_[w].runnable;
          if (step == 0 && start % kWarpSize != 0 && sw < warps)
            m &= ~((1u << (start % kWarpSize)) - 1);
          if (m) return w * kWarpSize + __builtin_ctz(m);
        }
        return -1;
      }
    }
  }

  [[noreturn]] void report_stuck() {
    fail("deadlock: no thread of the block can run (%d live)\n%s", live_,
         waiting_threads().c_str());
  }

  // Waiting threads grouped by where they wait, as ranges of thread indices.
  std::string waiting_threads() const {
    std::string out;
    int i = 0;
    while (i < count_) {
      const Thread& t = *threads_[i];
      if (t.state != State::Barrier && t.state != State::Collective) {
        ++i;
        continue;
      }
      int j = i + 1;
      while (j < count_) {
        const Thread& u = *threads_[j];
        if (u.state != t.state || !same_site(u.site, t.site) ||
            (t.state == State::Collective && (u.mask != t.mask || u.kind != t.kind)))
          break;
        ++j;
      }
      char line[512];
      if (t.state == State::Barrier) {
        std::snprintf(line, sizeof line, "  threads %d..%d wait in __syncthreads at %s:%d\n", i,
                      j - 1, t.site.file, t.site.line);
      } else {
        uint32_t missing = 0;
        for (int lane = 0; lane < kWarpSize; ++lane) {
          const int other = i / kWarpSize * kWarpSize + lane;
          if ((t.mask & (1u << lane)) &&
              (other >= count_ || threads_[other]->state != State::Collective ||
               !same_collective(*threads_[other], t)))
            missing |= 1u << lane;
        }
        std::snprintf(line, sizeof line,
                      "  threads %d..%d (warp %d, lanes %d..%d) wait in %s at %s:%d with mask "
                      "0x%08x; lanes 0x%08x of the mask have not arrived\n",
                      i, j - 1, i / kWarpSize, i % kWarpSize, (j - 1) % kWarpSize,
                      collective_name(t.kind), t.site.file, t.site.line, t.mask, missing);
      }
      out += line;
      i = j;
    }
    int exited = 0;
    for (const Warp& w : warps_) exited += __builtin_popcount(w.exited);
    if (exited) out += "  " + std::to_string(exited) + " threads have exited\n";
    return out;
  }

  std::string thread_name(int i) const {
    const Thread& t = *threads_[i];
    char name[96];
    std::snprintf(name, sizeof name, "%d (threadIdx %u,%u,%u; warp %d lane %d)", i,
                  t.view.thread_idx.x, t.view.thread_idx.y, t.view.thread_idx.z, i / kWarpSize,
                  i % kWarpSize);
    return name;
  }

  template <typename... A>
  [[noreturn]] void fail_collective(const Thread& t, const char* format, A... args) {
    char what[512];
    std::snprintf(what, sizeof what, format, args...);
    fail("%s at %s:%d by thread %s: %s", collective_name(t.kind), t.site.file, t.site.line,
         thread_name(t.linear).c_str(), what);
  }

  void describe_launch() const {
    if (launch_ == nullptr) return;
    const LaunchConfig& c = launch_->config;
    std::fprintf(stderr, "  kernel: %s\n  defined at %s:%d\n", launch_->kernel ? launch_->kernel : "?",
                 launch_->kernel_site.file, launch_->kernel_site.line);
    std::fprintf(stderr,
                 "  launched at %s:%d as %s<<<(%u,%u,%u), (%u,%u,%u), %zu>>>\n",
                 c.site.file, c.site.line, c.callee, c.grid.x, c.grid.y, c.grid.z, c.block.x,
                 c.block.y, c.block.z, c.dynamic_shared_bytes);
    if (running_block == this && !threads_.empty()) {
      const uint3 b = threads_[0]->view.block_idx;
      std::fprintf(stderr, "  in block (%u,%u,%u)\n", b.x, b.y, b.z);
    }
    if (running_thread != nullptr)
      std::fprintf(stderr, "  running thread %s\n", thread_name(running_thread->linear).c_str());
  }

  void reset_shared() {
    // Every byte the last block could reach is poisoned again, for reads
    // (0xff) and for AddressSanitizer (the rest of the arena still is).
    const size_t dirty = next_offset_ + kSharedGap < kArenaBytes ? next_offset_ + kSharedGap
                                                                  : kArenaBytes;
    NANFREE_EMULATION_UNPOISON(base_, dirty);
    std::memset(base_, 0xff, dirty);
    NANFREE_EMULATION_POISON(base_, dirty);
    shared_.clear();
    static_bytes_ = 0;
    const size_t dynamic = launch_->config.dynamic_shared_bytes;
    next_offset_ = (dynamic + kSharedGap + 255) / 256 * 256;
  }

  std::unique_ptr<unsigned char[]> arena_;
  unsigned char* base_;
  std::vector<SharedAllocation> shared_;
  size_t static_bytes_ = 0;
  size_t next_offset_ = 0;

  Launch* launch_ = nullptr;
  Fiber scheduler_;  // the OS thread's own context
  std::vector<std::unique_ptr<Thread>> threads_;
  std::vector<Warp> warps_;
  int count_ = 0;
  int live_ = 0;
  int at_barrier_ = 0;
  int cursor_ = -1;
  Schedule schedule_;
  uint64_t rng_;
};

thread_local std::unique_ptr<Block> block_runner;
std::atomic<long long> launches{0};
std::atomic<long long> largest_grid_blocks{0};

[[noreturn]] void fail_launch(const LaunchConfig& c, const char* format, ...)
    __attribute__((format(printf, 2, 3)));
void fail_launch(const LaunchConfig& c, const char* format, ...) {
  va_list args;
  va_start(args, format);
  std::fprintf(stderr, "\ncuda emulation: invalid launch at %s:%d of %s: ", c.site.file, c.site.line,
               c.callee);
  std::vfprintf(stderr, format, args);
  va_end(args);
  std::fprintf(stderr, "\n");
  std::fflush(stderr);
  std::abort();
}

void validate(const LaunchConfig& c) {
  const unsigned block[3] = {c.block.x, c.block.y, c.block.z};
  const unsigned grid[3] = {c.grid.x, c.grid.y, c.grid.z};
  for (int i = 0; i < 3; ++i) {
    if (block[i] == 0 || block[i] > kMaxBlockDim[i])
      fail_launch(c, "block dimension %c = %u (the device allows 1..%u)", "xyz"[i], block[i],
                  kMaxBlockDim[i]);
    if (grid[i] == 0 || grid[i] > kMaxGridDim[i])
      fail_launch(c, "grid dimension %c = %u (the device allows 1..%u)", "xyz"[i], grid[i],
                  kMaxGridDim[i]);
  }
  const uint64_t threads = uint64_t(block[0]) * block[1] * block[2];
  if (threads > kMaxThreadsPerBlock)
    fail_launch(c, "%llu threads per block (the device allows %u)",
                static_cast<unsigned long long>(threads), kMaxThreadsPerBlock);
  if (c.dynamic_shared_bytes > kSharedBytesPerBlock)
    fail_launch(c, "%zu bytes of dynamic shared memory (a block gets %zu without opting in)",
                c.dynamic_shared_bytes, kSharedBytesPerBlock);
}

// The launch log (NANFREE_CUDA_EMULATION_LOG): one JSON line per launch.
int log_descriptor() {
  static const int fd = [] {
    const char* path = std::getenv("NANFREE_CUDA_EMULATION_LOG");
    if (path == nullptr || *path == '\0') return -1;
    const int d = open(path, O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
    if (d < 0) {
      std::fprintf(stderr, "cuda emulation: cannot open NANFREE_CUDA_EMULATION_LOG=%s\n", path);
      std::abort();
    }
    return d;
  }();
  return fd;
}

void json_string(std::string& out, const char* s) {
  out += '"';
  for (; s != nullptr && *s; ++s) {
    const char c = *s;
    if (c == '"' || c == '\\') {
      out += '\\';
      out += c;
    } else if (static_cast<unsigned char>(c) < 0x20) {
      out += ' ';
    } else {
      out += c;
    }
  }
  out += '"';
}

void log_launch(const Launch& launch) {
  const int fd = log_descriptor();
  if (fd < 0) return;
  const LaunchConfig& c = launch.config;
  std::string line = "{\"site\":";
  json_string(line, (std::string(c.site.file) + ":" + std::to_string(c.site.line)).c_str());
  line += ",\"callee\":";
  json_string(line, c.callee);
  line += ",\"kernel\":";
  json_string(line, launch.kernel);
  line += ",\"kernel_site\":";
  json_string(line, (std::string(launch.kernel_site.file) + ":" +
                     std::to_string(launch.kernel_site.line)).c_str());
  char dims[160];
  std::snprintf(dims, sizeof dims, ",\"grid\":[%u,%u,%u],\"block\":[%u,%u,%u],\"dynamic_shared\":%zu",
                c.grid.x, c.grid.y, c.grid.z, c.block.x, c.block.y, c.block.z,
                c.dynamic_shared_bytes);
  line += dims;
  line += ",\"args\":{";
  // Parameter names from the kernel's signature, in order.
  const char* p = launch.parameters ? launch.parameters : "";
  bool first = true;
  for (int i = 0; i < launch.argument_count; ++i) {
    const char* end = std::strchr(p, ',');
    const std::string name = end ? std::string(p, end) : std::string(p);
    p = end ? end + 1 : p + std::strlen(p);
    if (!launch.arguments[i].integral) continue;
    if (!first) line += ',';
    first = false;
    json_string(line, name.empty() ? ("arg" + std::to_string(i)).c_str() : name.c_str());
    line += ':' + std::to_string(launch.arguments[i].value);
  }
  line += "}}\n";
  const ssize_t written = write(fd, line.data(), line.size());
  (void)written;
}

}  // namespace

int64_t variant_limit(const char* name, int64_t gpu_value) {
  struct Limit {
    const char* variant;
    const char* name;
    int64_t value;
  };
  static constexpr Limit kLimits[] = {
      {"plain", "kWarpRowsMin", 1},
      {"grid_capped", "kMaxBlocks", 3},
      {"grid_capped", "kChunkEntries", 1024},
      {"grid_capped", "kWarpRowsMin", 64},
  };
  static constexpr const char* kVariants[] = {"plain", "grid_capped", "sanitized"};
  const char* variant = std::getenv("NANFREE_CUDA_EMULATION");
  bool known = false;
  for (const char* v : kVariants) known = known || (variant != nullptr && std::strcmp(variant, v) == 0);
  if (!known) {
    // nanfree loads an emulated build only for a variant it knows (nanfree/_backends.py).
    std::fprintf(stderr, "cuda emulation: NANFREE_CUDA_EMULATION=%s is not one of plain, grid_capped, sanitized\n",
                 variant == nullptr ? "(unset)" : variant);
    std::abort();
  }
  for (const Limit& limit : kLimits) {
    if (std::strcmp(limit.variant, variant) == 0 && std::strcmp(limit.name, name) == 0) return limit.value;
  }
  return gpu_value;
}

const ThreadView& current() {
  if (running_thread == nullptr) {
    std::fprintf(stderr, "cuda emulation: threadIdx/blockIdx read outside a kernel\n");
    std::abort();
  }
  return running_thread->view;
}

void syncthreads(Site site) {
  if (running_block == nullptr || running_thread == nullptr) {
    std::fprintf(stderr, "cuda emulation: __syncthreads at %s:%d outside a kernel\n", site.file,
                 site.line);
    std::abort();
  }
  running_block->syncthreads(site);
}

uint64_t warp_collective(Site site, Collective kind, unsigned mask, uint64_t payload, int arg,
                         int width) {
  if (running_block == nullptr || running_thread == nullptr) {
    std::fprintf(stderr, "cuda emulation: %s at %s:%d outside a kernel\n", collective_name(kind),
                 site.file, site.line);
    std::abort();
  }
  return running_block->collective(site, kind, mask, payload, arg, width);
}

void* shared_storage(Site site, size_t bytes, size_t alignment) {
  return running_block->shared(site, bytes, alignment, false);
}

void* dynamic_shared_storage(Site site, size_t alignment) {
  return running_block->shared(site, 0, alignment, true);
}

void enter_kernel(const char* pretty_name, Site site, int max_threads, const char* params) {
  Launch& launch = *running_launch;
  if (launch.kernel != nullptr) return;  // the first thread of the launch did it
  launch.kernel = pretty_name;
  launch.kernel_site = site;
  launch.parameters = params;
  if (max_threads > 0 && launch.threads_per_block > static_cast<unsigned>(max_threads))
    running_block->fail("launch of %u threads per block past the kernel's __launch_bounds__(%d)",
                        launch.threads_per_block, max_threads);
  log_launch(launch);
}

long long launch_count() { return launches.load(); }

long long largest_grid() { return largest_grid_blocks.exchange(0); }

void run_grid(const LaunchConfig& config, KernelCall call, const LoggedArgument* arguments,
              int argument_count) {
  validate(config);
  ++launches;
  const long long blocks = static_cast<long long>(config.grid.x) * config.grid.y * config.grid.z;
  long long largest = largest_grid_blocks.load();
  while (blocks > largest && !largest_grid_blocks.compare_exchange_weak(largest, blocks)) {
  }
  if (running_launch != nullptr) {
    std::fprintf(stderr, "cuda emulation: a kernel launch at %s:%d from inside a kernel\n",
                 config.site.file, config.site.line);
    std::abort();
  }
  Launch launch;
  launch.config = config;
  launch.call = call;
  launch.arguments = arguments;
  launch.argument_count = argument_count;
  launch.threads_per_block = config.block.x * config.block.y * config.block.z;
  if (!block_runner) block_runner = std::make_unique<Block>();
  running_launch = &launch;
  for (unsigned z = 0; z < config.grid.z; ++z)
    for (unsigned y = 0; y < config.grid.y; ++y)
      for (unsigned x = 0; x < config.grid.x; ++x) block_runner->run(launch, uint3{x, y, z});
  running_launch = nullptr;
}

}  // namespace cuda_emulation

// The CUDA runtime calls of the kernel files. Launches run synchronously and
// abort on error, so there is never an error to report.
extern "C" {
cudaError_t CUDARTAPI cudaGetLastError(void) { return cudaSuccess; }
cudaError_t CUDARTAPI cudaPeekAtLastError(void) { return cudaSuccess; }
const char* CUDARTAPI cudaGetErrorString(cudaError_t error) {
  switch (error) {
    case cudaSuccess: return "no error (emulated CUDA)";
    case cudaErrorInvalidValue: return "invalid argument (emulated CUDA)";
    default: return "error (emulated CUDA)";
  }
}
}
