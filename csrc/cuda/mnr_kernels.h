// Launchers of the CUDA tile kernels of the MNR loss (mnr_loss and
// mnr_loss_backward of registration.cpp), the device half of the `Tiles`
// policy of csrc/common/mnr_driver.h (csrc/cuda/mnr.cpp is the other half).
// Torch-free: plain C++ and CUDA runtime types, so the kernel file compiles
// without ATen, and the ATen binding (host compiler) only sees these
// declarations.
//
// A tile is one chunk of rows of one row kind: a contiguous [tile.rows,
// tile.cols] matrix of cosines in the accumulation type acc_t (float, or
// double for double inputs), whose row i is local row tile.g0 + i (MnrTile
// in nanfree/mnr_math.h). Every pointer is a device pointer to contiguous
// data. `scale` points to one acc_t value (the op's 0-d scale tensor, read on
// the device only: no host sync). `workspace` holds the partial results of
// rows split over several blocks: at least mnr_workspace_size(tile) acc_t
// values (nullptr when that is 0). Each launcher returns cudaGetLastError()
// after its last launch, and cudaSuccess without launching when there is
// nothing to compute.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime_api.h>

#include <cstdint>

#include "nanfree/mnr_math.h"

namespace nanfree {
namespace gpu {

// acc_t values of workspace that mnr_row_stats and mnr_row_grads need for `tile`.
template <typename acc_t>
int64_t mnr_workspace_size(const MnrTile& tile);

// lse[i] = the logsumexp of row i's logits (mnr_logit of each cosine with its
// mnr_column_kind) relative to its target logit (mnr_relative_lse); a Q row
// writes its target logit target[i] = mnr_target_logit(cos[i, g0 + i]) (its
// positive: doc g, column g), a P row reads it.
template <typename acc_t>
cudaError_t mnr_row_stats(const acc_t* cos, const MnrTile& tile, const acc_t* scale,
                          double hardness_strength, acc_t* lse, acc_t* target,
                          acc_t* workspace, cudaStream_t stream);

// In place, cos[i, j] <- scale * dlogit with dlogit = mnr_logit_grad of the
// entry, from row i's stats (kMnrStatsPerRow values from stats[3 i]:
// mnr_row_normalizer) and upstream[i]; scale_grad[i] = sum_j dlogit * cos[i, j]
// (the cosines before they are overwritten).
template <typename acc_t>
cudaError_t mnr_row_grads(acc_t* cos, const MnrTile& tile, const acc_t* scale,
                          double hardness_strength, const acc_t* stats, const acc_t* upstream,
                          bool per_direction, bool has_p_row, acc_t* scale_grad,
                          acc_t* workspace, cudaStream_t stream);

// loss[i] = mnr_row_loss of row i's stats [rows, kMnrStatsPerRow].
template <typename acc_t>
cudaError_t mnr_row_losses(const acc_t* stats, bool per_direction, bool has_p_row, int64_t rows,
                           acc_t* loss, cudaStream_t stream);

// out[i * cols + j] = in[i * in_stride + j] saturated to half_t's finite range
// (NaN stays NaN) and rounded to nearest: the half GEMM operand of a chunk of
// scale * dlogit. half_t is __half or __nv_bfloat16.
template <typename half_t>
cudaError_t mnr_saturate_cast(const float* in, int64_t rows, int64_t cols, int64_t in_stride,
                              half_t* out, cudaStream_t stream);

// Defined and instantiated in mnr_kernels.cu for these types.
#define NANFREE_MNR_LAUNCHERS(PREFIX, T)                                                         \
  PREFIX template int64_t mnr_workspace_size<T>(const MnrTile&);                                 \
  PREFIX template cudaError_t mnr_row_stats<T>(const T*, const MnrTile&, const T*, double, T*,   \
                                               T*, T*, cudaStream_t);                           \
  PREFIX template cudaError_t mnr_row_grads<T>(T*, const MnrTile&, const T*, double, const T*,   \
                                               const T*, bool, bool, T*, T*, cudaStream_t);     \
  PREFIX template cudaError_t mnr_row_losses<T>(const T*, bool, bool, int64_t, T*, cudaStream_t);
NANFREE_MNR_LAUNCHERS(extern, float)
NANFREE_MNR_LAUNCHERS(extern, double)
extern template cudaError_t mnr_saturate_cast<__half>(const float*, int64_t, int64_t, int64_t,
                                                      __half*, cudaStream_t);
extern template cudaError_t mnr_saturate_cast<__nv_bfloat16>(const float*, int64_t, int64_t,
                                                             int64_t, __nv_bfloat16*,
                                                             cudaStream_t);

}  // namespace gpu
}  // namespace nanfree
