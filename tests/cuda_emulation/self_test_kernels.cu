// Kernels that test the CUDA emulation itself (tests/test_cuda_emulation.py),
// built into the emulated extensions only, next to nanfree's kernels, and
// rewritten the same way. The misuse kernels break a rule of the CUDA
// execution model on purpose: the emulation must abort on each.
#include <cuda_runtime.h>

#include <cstdint>
#include <string_view>

#include "self_test_kernels.h"

namespace cuda_emulation_test {
namespace {

// One warp: row k of `out` ([kShuffleCases, 32]) is what each lane received in case k.
__global__ void __launch_bounds__(32) shuffles_kernel(const float* values, const int* predicate,
                                                      float* out, unsigned* votes) {
  const int lane = threadIdx.x;
  const float v = values[lane];
  out[0 * 32 + lane] = __shfl_xor_sync(0xffffffffu, v, 1);
  out[1 * 32 + lane] = __shfl_xor_sync(0xffffffffu, v, 16);
  out[2 * 32 + lane] = __shfl_xor_sync(0xffffffffu, v, 4, 8);
  out[3 * 32 + lane] = __shfl_down_sync(0xffffffffu, v, 1);
  out[4 * 32 + lane] = __shfl_down_sync(0xffffffffu, v, 2, 8);
  out[5 * 32 + lane] = __shfl_up_sync(0xffffffffu, v, 3);
  out[6 * 32 + lane] = __shfl_up_sync(0xffffffffu, v, 1, 4);
  out[7 * 32 + lane] = __shfl_sync(0xffffffffu, v, 5);
  out[8 * 32 + lane] = __shfl_sync(0xffffffffu, v, lane + 3, 16);
  // Half the warp (the even lanes) in a collective of its own; lane ^ 2 stays even.
  float half = -1.0f;
  if (lane % 2 == 0) half = __shfl_xor_sync(0x55555555u, v, 2);
  out[9 * 32 + lane] = half;
  // A source lane outside the mask has no value: the emulation's poison (NaN).
  float outside = -1.0f;
  if (lane < 16) outside = __shfl_xor_sync(0x0000ffffu, v, 16, 32);
  out[10 * 32 + lane] = outside;
  const int p = predicate[lane];
  const unsigned ballot = __ballot_sync(0xffffffffu, p);
  const int any = __any_sync(0xffffffffu, p);
  const int all = __all_sync(0xffffffffu, p);
  __syncwarp();
  if (lane == 0) {
    votes[0] = ballot;
    votes[1] = static_cast<unsigned>(any);
    votes[2] = static_cast<unsigned>(all);
  }
}

// What a thread reads from shared memory before anyone wrote it, and after.
__global__ void shared_poison_kernel(float* out) {
  __shared__ float cells[64];
  __shared__ double wide[4];
  out[threadIdx.x] = cells[threadIdx.x];
  __syncthreads();
  cells[threadIdx.x] = static_cast<float>(threadIdx.x);
  __syncthreads();
  out[64 + threadIdx.x] = cells[63 - threadIdx.x];
  if (threadIdx.x == 0) out[128] = static_cast<float>(wide[0]);
}

// A block-wide sum through shared memory, over a grid of blocks: each block's
// threads see the block's own storage, poisoned anew for each block.
__global__ void block_sums_kernel(const float* in, float* out) {
  extern __shared__ float dynamic[];
  __shared__ float total;
  if (threadIdx.x == 0) total = 0.0f;
  dynamic[threadIdx.x] = in[blockIdx.x * blockDim.x + threadIdx.x];
  __syncthreads();
  if (threadIdx.x == 0) {
    for (unsigned i = 0; i < blockDim.x; ++i) total += dynamic[i];
  }
  __syncthreads();
  out[blockIdx.x * blockDim.x + threadIdx.x] = total;
}

// Three-dimensional blocks and grids: each thread writes its indices.
__global__ void indices_kernel(int* out) {
  const unsigned block = (blockIdx.z * gridDim.y + blockIdx.y) * gridDim.x + blockIdx.x;
  const unsigned thread = (threadIdx.z * blockDim.y + threadIdx.y) * blockDim.x + threadIdx.x;
  int* o = out + 6 * (block * blockDim.x * blockDim.y * blockDim.z + thread);
  o[0] = threadIdx.x;
  o[1] = threadIdx.y;
  o[2] = threadIdx.z;
  o[3] = blockIdx.x;
  o[4] = blockIdx.y;
  o[5] = blockIdx.z;
}

// Every thread of two blocks updates the same counters: the atomics must count each update.
__global__ void atomics_kernel(int* counters, float* sum) {
  const int t = static_cast<int>(blockIdx.x * blockDim.x + threadIdx.x);
  atomicAdd(&counters[0], 1);
  atomicMax(&counters[1], t);
  atomicMin(&counters[2], t);
  // An increment by compare-and-swap, retried until no other thread intervened.
  int seen = counters[3];
  int assumed;
  do {
    assumed = seen;
    seen = atomicCAS(&counters[3], assumed, assumed + 1);
  } while (seen != assumed);
  atomicExch(&counters[4], 7);
  atomicAdd(sum, 0.5f);
}

// --- misuse ------------------------------------------------------------------

__global__ void divergent_barrier_kernel(int* out) {
  if (threadIdx.x < 32) {
    __syncthreads();
  } else {
    __syncthreads();
  }
  out[threadIdx.x] = 1;
}

__global__ void exited_lane_kernel(float* out) {
  if (threadIdx.x == 7) return;
  out[threadIdx.x] = __shfl_xor_sync(0xffffffffu, 1.0f, 1);
}

__global__ void missing_lanes_kernel(float* out) {
  // The block has 16 threads: lanes 16..31 of the full mask do not exist.
  out[threadIdx.x] = __shfl_xor_sync(0xffffffffu, 1.0f, 1);
}

__global__ void deadlock_kernel(float* out) {
  // Warp 0 waits for a lane that waits at a barrier the others never reach.
  if (threadIdx.x == 3) {
    __syncthreads();
  } else if (threadIdx.x < 32) {
    out[threadIdx.x] = __shfl_xor_sync(0xffffffffu, 1.0f, 1);
  }
}

__global__ void mismatched_masks_kernel(float* out) {
  const unsigned mask = threadIdx.x < 16 ? 0x0000ffffu : 0xffffffffu;
  out[threadIdx.x] = __shfl_xor_sync(mask, 1.0f, 1);
}

__global__ void __launch_bounds__(64) bounded_kernel(float* out) { out[threadIdx.x] = 0.0f; }

__global__ void big_shared_kernel(float* out) {
  __shared__ float big[16384];  // 64 KB
  big[threadIdx.x] = 0.0f;
  out[threadIdx.x] = big[threadIdx.x];
}

__global__ void noop_kernel(float* out) { out[0] = 0.0f; }

}  // namespace

void shuffles(const float* values, const int* predicate, float* out, unsigned* votes) {
  shuffles_kernel<<<1, 32>>>(values, predicate, out, votes);
}

void shared_poison(float* out) { shared_poison_kernel<<<1, 64>>>(out); }

void block_sums(const float* in, float* out, int blocks, int threads) {
  block_sums_kernel<<<blocks, threads, threads * sizeof(float)>>>(in, out);
}

void indices(int* out, dim3 grid, dim3 block) { indices_kernel<<<grid, block>>>(out); }

void atomics(int* counters, float* sum) { atomics_kernel<<<2, 64>>>(counters, sum); }

bool misuse(const char* name, void* out) {
  const std::string_view n(name);
  float* f = static_cast<float*>(out);
  if (n == "divergent_barrier") {
    divergent_barrier_kernel<<<1, 64>>>(static_cast<int*>(out));
  } else if (n == "exited_lane") {
    exited_lane_kernel<<<1, 32>>>(f);
  } else if (n == "missing_lanes") {
    missing_lanes_kernel<<<1, 16>>>(f);
  } else if (n == "deadlock") {
    deadlock_kernel<<<1, 64>>>(f);
  } else if (n == "mismatched_masks") {
    mismatched_masks_kernel<<<1, 32>>>(f);
  } else if (n == "launch_bounds") {
    bounded_kernel<<<1, 128>>>(f);
  } else if (n == "too_many_threads") {
    noop_kernel<<<1, 2048>>>(f);
  } else if (n == "grid_too_large") {
    noop_kernel<<<dim3(1, 70000), 32>>>(f);
  } else if (n == "too_much_shared") {
    big_shared_kernel<<<1, 32>>>(f);
  } else if (n == "too_much_dynamic_shared") {
    noop_kernel<<<1, 32, 64 << 10>>>(f);
  } else {
    return false;
  }
  return true;
}

}  // namespace cuda_emulation_test
