// The emulation's self-test kernels as operators of the emulated extensions
// (torch.ops.nanfree_cuda_emulation.*), for tests/test_cuda_emulation.py.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <string>
#include <tuple>
#include <vector>

#include "cuda/launch_limits.h"
#include "cuda_emulation.h"
#include "self_test_kernels.h"

namespace {

std::tuple<at::Tensor, at::Tensor> shuffles(const at::Tensor& values, const at::Tensor& predicate) {
  TORCH_CHECK(values.numel() == 32 && predicate.numel() == 32, "one value per lane");
  const at::Tensor v = values.to(at::kFloat).contiguous();
  const at::Tensor p = predicate.to(at::kInt).contiguous();
  at::Tensor out = at::empty({cuda_emulation_test::kShuffleCases, 32}, v.options());
  at::Tensor votes = at::empty({3}, p.options());
  cuda_emulation_test::shuffles(v.const_data_ptr<float>(), p.const_data_ptr<int>(),
                                out.mutable_data_ptr<float>(),
                                reinterpret_cast<unsigned*>(votes.mutable_data_ptr<int>()));
  return {out, votes};
}

at::Tensor shared_poison() {
  at::Tensor out = at::empty({129}, at::kFloat);
  cuda_emulation_test::shared_poison(out.mutable_data_ptr<float>());
  return out;
}

at::Tensor block_sums(const at::Tensor& input, int64_t blocks, int64_t threads) {
  const at::Tensor in = input.to(at::kFloat).contiguous();
  TORCH_CHECK(in.numel() == blocks * threads, "one value per thread");
  at::Tensor out = at::empty_like(in);
  cuda_emulation_test::block_sums(in.const_data_ptr<float>(), out.mutable_data_ptr<float>(),
                                  static_cast<int>(blocks), static_cast<int>(threads));
  return out;
}

at::Tensor indices(at::IntArrayRef grid, at::IntArrayRef block) {
  TORCH_CHECK(grid.size() == 3 && block.size() == 3, "three dimensions each");
  const int64_t n = grid[0] * grid[1] * grid[2] * block[0] * block[1] * block[2];
  at::Tensor out = at::empty({n, 6}, at::kInt);
  cuda_emulation_test::indices(
      out.mutable_data_ptr<int>(),
      dim3(static_cast<unsigned>(grid[0]), static_cast<unsigned>(grid[1]),
           static_cast<unsigned>(grid[2])),
      dim3(static_cast<unsigned>(block[0]), static_cast<unsigned>(block[1]),
           static_cast<unsigned>(block[2])));
  return out;
}

void misuse(const std::string& name) {
  std::vector<float> out(1 << 12);
  TORCH_CHECK(cuda_emulation_test::misuse(name.c_str(), out.data()), "no misuse case ", name);
}

std::tuple<at::Tensor, at::Tensor> atomics(const at::Tensor& counters, const at::Tensor& sum) {
  at::Tensor c = counters.to(at::kInt).contiguous().clone();
  at::Tensor s = sum.to(at::kFloat).contiguous().clone();
  TORCH_CHECK(c.numel() == 5 && s.numel() == 1, "5 counters and one sum");
  cuda_emulation_test::atomics(c.mutable_data_ptr<int>(), s.mutable_data_ptr<float>());
  return {c, s};
}

int64_t launches() { return cuda_emulation::launch_count(); }

int64_t largest_grid() { return cuda_emulation::largest_grid(); }

// -1 where the variant keeps the GPU's value.
int64_t launch_limit(const std::string& name) { return cuda_emulation::variant_limit(name.c_str(), -1); }

}  // namespace

TORCH_LIBRARY(nanfree_cuda_emulation, m) {
  m.def("launches() -> int", &launches);
  m.def("largest_grid() -> int", &largest_grid);
  m.def("launch_limit(str name) -> int", &launch_limit);
  m.def("atomics(Tensor counters, Tensor sum) -> (Tensor, Tensor)", &atomics);
  m.def("shuffles(Tensor values, Tensor predicate) -> (Tensor, Tensor)", &shuffles);
  m.def("shared_poison() -> Tensor", &shared_poison);
  m.def("block_sums(Tensor input, int blocks, int threads) -> Tensor", &block_sums);
  m.def("indices(int[] grid, int[] block) -> Tensor", &indices);
  m.def("misuse(str name) -> ()", &misuse);
}
