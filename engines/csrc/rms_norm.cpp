// decodebench_norm::rms: Gemma's RMS norm of bf16 rows in one operator, on a CPU with AVX-512 BF16.
//
// Eager PyTorch computes it in nine operators (engines/rust/src/model.rs: `rms`): x to float32, squared, the mean of
// the last dim, plus eps, to the power -0.5 (aten's rsqrt: 1 / sqrt), x times that, times the weight in float32, to
// bf16; each a trip through the dispatcher and a tensor allocated. The Rust engine, which calls ATen eagerly, does
// this eight times a layer; on E2B with int4 weights its profile gave norms and elementwise 14 % of a step and host
// dispatch 5 %. Here a row takes two passes: the sum of its squares (each square of a bf16 value exact in float32,
// summed in float32, 16 lanes then across), then each output as eager rounds it: (x * r) * w in float32, rounded once
// to bf16, r = 1 / sqrt(sum / n + eps). Only the order of the sum differs from aten's mean (its own vectorized
// order); every other operation is the same float32 operation. Rows are shared among threads when there are many
// (a prompt's piece); a decode step's few rows run on the calling thread.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <optional>

#include "rows.h"

namespace {

using namespace decodebench;

constexpr int64_t kValuesPerThread = 65536;  // values a thread takes at the least (parallel_for's grain, in rows)

// y = bf16((x * r) * w) (w absent: bf16(x * r)) for one row of n values, r from the row's mean square.
DB_TARGET void norm_row(const c10::BFloat16* x, const c10::BFloat16* w, int64_t n, float eps, c10::BFloat16* y) {
  __m512 squares = _mm512_setzero_ps();
  for (int64_t d = 0; d < n; d += kTile) {
    const __m512 v = widen(x + d, n - d);
    squares = _mm512_fmadd_ps(v, v, squares);  // a bf16 value's square is exact in float32: the fma rounds once
  }
  const float mean = _mm512_reduce_add_ps(squares) / static_cast<float>(n);
  const __m512 r = _mm512_set1_ps(1.0f / std::sqrt(mean + eps));
  for (int64_t d = 0; d < n; d += kTile) {
    __m512 out = _mm512_mul_ps(widen(x + d, n - d), r);
    if (w != nullptr) out = _mm512_mul_ps(out, widen(w + d, n - d));
    store_tile(y + d, out, n - d);
  }
}

at::Tensor rms(const at::Tensor& x, const std::optional<at::Tensor>& weight, double eps) {
  TORCH_CHECK(cpu_has_kernels(), "decodebench_norm::rms needs AVX-512 F, BW, VL and BF16; this CPU lacks one");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && x.dim() >= 1, "x: bfloat16 [..., n]");
  const int64_t n = x.size(-1);
  const at::Tensor rows = x.contiguous();
  const c10::BFloat16* w = nullptr;
  at::Tensor held;
  if (weight.has_value()) {
    TORCH_CHECK(weight->scalar_type() == at::kBFloat16 && weight->dim() == 1 && weight->size(0) == n,
                "weight: bfloat16 [", n, "], got ", weight->sizes());
    held = weight->contiguous();
    w = held.data_ptr<c10::BFloat16>();
  }
  at::Tensor out = at::detail::empty_cpu(rows.sizes(), rows.options());
  const auto* xp = rows.data_ptr<c10::BFloat16>();
  auto* yp = out.data_ptr<c10::BFloat16>();
  const int64_t count = n == 0 ? 0 : rows.numel() / n;
  const float eps_f = static_cast<float>(eps);
  at::parallel_for(0, count, std::max<int64_t>(1, kValuesPerThread / std::max<int64_t>(n, 1)),
                   [&](int64_t first, int64_t last) {
                     for (int64_t i = first; i < last; ++i) norm_row(xp + i * n, w, n, eps_f, yp + i * n);
                   });
  return out;
}

}  // namespace

TORCH_LIBRARY(decodebench_norm, m) { m.def("rms(Tensor x, Tensor? weight, float eps) -> Tensor"); }

TORCH_LIBRARY_IMPL(decodebench_norm, CPU, m) { m.impl("rms", &rms); }
