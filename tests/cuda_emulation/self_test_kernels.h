// Launchers of the emulation's self-test kernels (self_test_kernels.cu);
// pointers are host memory, since the emulation runs kernels on the CPU.
#pragma once

#include <cuda_runtime_api.h>

namespace cuda_emulation_test {

// Rows of the shuffles kernel's output: one per case, in this order.
constexpr int kShuffleCases = 11;

void shuffles(const float* values, const int* predicate, float* out, unsigned* votes);
void shared_poison(float* out);
void block_sums(const float* in, float* out, int blocks, int threads);
void indices(int* out, dim3 grid, dim3 block);
// counters (5 ints) and sum are read and updated by 2 blocks of 64 threads.
void atomics(int* counters, float* sum);
// Launches the misuse kernel of that name (the emulation aborts); false if there is none.
bool misuse(const char* name, void* out);

}  // namespace cuda_emulation_test
