// CUDA registration of the MNR loss (mnr_loss, mnr_loss_backward): the chunked
// driver of csrc/common/mnr_driver.h with cuBLAS GEMMs through ATen and the
// tile kernels of mnr_kernels.cu (torch-free, behind mnr_kernels.h). The
// scale tensor stays on the device (the kernels read it), so nothing here
// waits for the GPU.
//
// Precision of the GEMMs. float and double operands are multiplied in their
// own dtype (at::mm: cuBLAS sgemm / dgemm; TF32 only if the user allowed it
// for float matmuls, as for any torch matmul). fp16 and bf16 operands stay in
// their dtype, for the tensor cores, and the GEMMs return float32
// (aten::mm.dtype, aten::addmm.dtype_out: products summed in float32): the
// cosines are those of the half embeddings up to float32 rounding. The gradient GEMMs take the chunk of scale * dlogit (float32) cast
// to the operands' dtype, saturated to its finite range (an inf there would
// meet a 0 embedding entry: NaN), as torch's own half backward holds the
// gradient of its logits; the sums stay float32. With a torch older than
// 2.8 (no mm.dtype), half operands are converted to float32 up front.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <c10/core/DeviceGuard.h>
#include <torch/library.h>

#include <optional>
#include <tuple>

#include "common/mnr_driver.h"
#include "common/mnr_op.h"
#include "cuda/aten_device_types.h"
#include "cuda/cuda_binding.h"
#include "cuda/launch_limits.h"
#include "cuda/mnr_kernels.h"
#include "nanfree/mnr_math.h"

namespace nanfree {
namespace {

bool is_half(at::ScalarType t) { return t == at::kHalf || t == at::kBFloat16; }

#if NANFREE_MM_FLOAT32
// The fp16 / bf16 GEMM operand of a contiguous float32 matrix `a` (a chunk of
// scale * dlogit): saturated and cast by mnr_saturate_cast.
at::Tensor half_operand(const at::Tensor& a, at::ScalarType dtype) {
  TORCH_INTERNAL_ASSERT(a.dim() == 2 && a.scalar_type() == at::kFloat && a.is_contiguous());
  at::Tensor dst = at::empty(a.sizes(), a.options().dtype(dtype));
  const cudaStream_t stream = current_cuda_stream();
  AT_DISPATCH_REDUCED_FLOATING_TYPES(dtype, "nanfree_mnr_half_operand_cuda", [&] {
    NANFREE_CUDA_CHECK(gpu::mnr_saturate_cast(a.const_data_ptr<float>(), a.size(0), a.size(1),
                                              a.size(1), mutable_device_ptr<scalar_t>(dst),
                                              stream));
  });
  return dst;
}
#endif

// The tile kernels' workspace (mnr_workspace_size), or an undefined tensor.
template <typename acc_t>
at::Tensor workspace(const MnrTile& tile, const at::Tensor& like) {
  const int64_t size = gpu::mnr_workspace_size<acc_t>(tile);
  return size > 0 ? at::empty({size}, like.options()) : at::Tensor();
}

template <typename acc_t>
acc_t* workspace_ptr(at::Tensor& ws) {
  return ws.defined() ? ws.mutable_data_ptr<acc_t>() : nullptr;
}

struct CudaMnrTiles {
  // 64M cosines per chunk (256 MB of float): e.g. 1024 rows against 65536
  // columns. The chunk's rows are the inner dimension of the column-gradient
  // GEMMs (out [cols, d] += chunk^T [cols, n] @ rows [n, d]), which read and
  // write their float32 accumulator once per chunk: 2 n flops per 8 bytes,
  // so n must be about 1000 before the tensor cores (about 300 flops per byte
  // of H100 bandwidth) rather than that traffic set the pace.
  // The emulated grid_capped variant takes 1024: chunks of a few rows, so that
  // the tests' small problems run in several chunks (streamed query gradients
  // included).
  static NANFREE_CUDA_LIMIT(kChunkEntries, int64_t(1) << 26);
  // Rows per chunk from kChunkEntries alone (the memory bound of the GPU path).
  static constexpr int64_t kMinChunkRows = 1;

  static at::Tensor operand(const at::Tensor& matrix) {
#if NANFREE_MM_FLOAT32
    return matrix.contiguous();
#else
    return matrix.to(acc_dtype(matrix.scalar_type())).contiguous();
#endif
  }

  // A new tensor per chunk (no scratch kept: the caching allocator hands the
  // previous chunk's memory back without mapping it anew).
  static at::Tensor scores(const at::Tensor& rows, const at::Tensor& columns,
                           at::Tensor& /*buffer*/) {
#if NANFREE_MM_FLOAT32
    if (is_half(rows.scalar_type())) return mm_float32(rows, columns.t());
#endif
    return at::mm(rows, columns.t());
  }

  // The chunk's scale * dlogit as the half GEMMs' operand (cast once for the
  // chunk's three GEMMs), or as it is for float and double GEMMs.
  static at::Tensor gradient_operand(const at::Tensor& grads, at::ScalarType operand) {
#if NANFREE_MM_FLOAT32
    if (is_half(operand)) return half_operand(grads, operand);
#endif
    return grads;
  }

  // out = beta * out + a @ b (beta 0: out not read, zeroed here: a fill is
  // cheap next to the product on a GPU); a a gradient_operand matrix (or a
  // transposed column slice of it), b an operand matrix.
  static void accumulate(at::Tensor out, const at::Tensor& a, const at::Tensor& b, float beta) {
    if (beta == 0.0f) out.zero_();
    if (!is_half(b.scalar_type())) {
      out.addmm_(a, b);
      return;
    }
#if NANFREE_MM_FLOAT32
#if NANFREE_ADDMM_FLOAT32
    addmm_float32(out, a, b);
#else
    out.add_(mm_float32(a, b));
#endif
#else
    TORCH_INTERNAL_ASSERT(false, "half operands are float32 (operand) without aten::mm.dtype");
#endif
  }

  // The stats and the gradients of a chunk stay two kernels (row_stats, row_grads).
  static constexpr bool kFusedRowPass = false;

  static void row_stats(const at::Tensor& cos, const MnrTile& tile, const at::Tensor& scale,
                        double hardness_strength, at::Tensor lse, at::Tensor target) {
    TORCH_INTERNAL_ASSERT(cos.is_contiguous() && cos.size(0) == tile.rows &&
                          cos.size(1) == tile.cols);
    const cudaStream_t stream = current_cuda_stream();
    AT_DISPATCH_FLOATING_TYPES(cos.scalar_type(), "nanfree_mnr_row_stats_cuda", [&] {
      at::Tensor ws = workspace<scalar_t>(tile, cos);
      NANFREE_CUDA_CHECK(gpu::mnr_row_stats(cos.const_data_ptr<scalar_t>(), tile,
                                            scale.const_data_ptr<scalar_t>(), hardness_strength,
                                            lse.mutable_data_ptr<scalar_t>(),
                                            target.mutable_data_ptr<scalar_t>(),
                                            workspace_ptr<scalar_t>(ws), stream));
    });
  }

  static void row_grads(at::Tensor cos, const MnrTile& tile, const at::Tensor& scale,
                        double hardness_strength, const at::Tensor& stats,
                        const at::Tensor& upstream, bool per_direction, bool has_p_row,
                        at::Tensor scale_grad) {
    TORCH_INTERNAL_ASSERT(cos.is_contiguous() && stats.is_contiguous() &&
                          upstream.is_contiguous());
    const cudaStream_t stream = current_cuda_stream();
    AT_DISPATCH_FLOATING_TYPES(cos.scalar_type(), "nanfree_mnr_row_grads_cuda", [&] {
      at::Tensor ws = workspace<scalar_t>(tile, cos);
      NANFREE_CUDA_CHECK(gpu::mnr_row_grads(
          cos.mutable_data_ptr<scalar_t>(), tile, scale.const_data_ptr<scalar_t>(),
          hardness_strength, stats.const_data_ptr<scalar_t>(), upstream.const_data_ptr<scalar_t>(),
          per_direction, has_p_row, scale_grad.mutable_data_ptr<scalar_t>(),
          workspace_ptr<scalar_t>(ws), stream));
    });
  }

  static void row_losses(const at::Tensor& stats, bool per_direction, bool has_p_row,
                         at::Tensor loss) {
    const cudaStream_t stream = current_cuda_stream();
    AT_DISPATCH_FLOATING_TYPES(stats.scalar_type(), "nanfree_mnr_row_losses_cuda", [&] {
      NANFREE_CUDA_CHECK(gpu::mnr_row_losses(stats.const_data_ptr<scalar_t>(), per_direction,
                                             has_p_row, loss.numel(),
                                             loss.mutable_data_ptr<scalar_t>(), stream));
    });
  }
};

}  // namespace

TORCH_LIBRARY_IMPL(nanfree, NANFREE_CUDA_DISPATCH_KEY, m) {
  m.impl("mnr_loss", &mnr_loss_kernel<CudaMnrTiles>);
  m.impl("mnr_loss_backward", &mnr_loss_backward_kernel<CudaMnrTiles>);
}

}  // namespace nanfree
