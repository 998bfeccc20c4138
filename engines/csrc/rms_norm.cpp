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
//
// decodebench_norm::add_rms: a residual add after a norm, h + rms(x) (times its weight), then times `scale` where one
// is given (a layer's scalar), one operator where the Rust engine called three after each attention, MLP and per-layer
// input (`add_rms` in model.rs: the norm, an add, and after the per-layer input a mul), 105 a decode step on E2B. Each
// value is rounded as the eager operators round it: the norm's to bf16, then bf16(h + that), then bf16(sum * scale):
// the same bits.
//
// decodebench_norm::rms_rope: a q or k head's norm and then its rotary embedding, one operator where the Rust engine
// called eight more (narrow twice, neg, cat, mul, mul, add after the norm: `rope` in model.rs), on each query and key
// head of every layer. Each rotated value is rounded as eager rounds it in bf16: bf16(bf16(y * cos) + bf16(r * sin)),
// y the normed row rounded to bf16, r its rotated half (-y2, y1: negation is exact): the same bits as the eager
// operators.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <climits>
#include <cmath>
#include <optional>
#include <vector>

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

// -v with its sign bit flipped, as eager's neg writes it (0 - v would give +0 for +0, and a -0 sum its sign).
DB_TARGET inline __m512 negated(__m512 v) {
  return _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(v), _mm512_set1_epi32(INT32_MIN)));
}

// out = y * cos + rotate_half(y) * sin for one row of n values (n even), rotate_half(y) = (-y2, y1), each product and
// the sum rounded to bf16 as eager's three operators round them.
DB_TARGET void rotate_row(const c10::BFloat16* y, const c10::BFloat16* cos, const c10::BFloat16* sin, int64_t n,
                          c10::BFloat16* out) {
  const int64_t half = n / 2;
  for (int64_t d = 0; d < half; d += kTile) {
    const int64_t valid = half - d;
    const __m512 first = widen(y + d, valid), second = widen(y + half + d, valid);
    const __m512 lo = _mm512_add_ps(rounded(_mm512_mul_ps(first, widen(cos + d, valid))),
                                    rounded(_mm512_mul_ps(negated(second), widen(sin + d, valid))));
    const __m512 hi = _mm512_add_ps(rounded(_mm512_mul_ps(second, widen(cos + half + d, valid))),
                                    rounded(_mm512_mul_ps(first, widen(sin + half + d, valid))));
    store_tile(out + d, lo, valid);
    store_tile(out + half + d, hi, valid);
  }
}

// y = bf16(h + v) for one row of n values, then (scale given) bf16(y * scale), as eager's add and mul round.
DB_TARGET void add_row(const c10::BFloat16* h, const c10::BFloat16* v, int64_t n, std::optional<float> scale,
                       c10::BFloat16* y) {
  for (int64_t d = 0; d < n; d += kTile) {
    __m512 sum = _mm512_add_ps(widen(h + d, n - d), widen(v + d, n - d));
    if (scale.has_value()) sum = _mm512_mul_ps(rounded(sum), _mm512_set1_ps(*scale));
    store_tile(y + d, sum, n - d);
  }
}

// The weight's values (bf16 [n]), or null for none.
const c10::BFloat16* weight_of(const std::optional<at::Tensor>& weight, int64_t n, at::Tensor& held) {
  if (!weight.has_value()) return nullptr;
  TORCH_CHECK(weight->scalar_type() == at::kBFloat16 && weight->dim() == 1 && weight->size(0) == n,
              "weight: bfloat16 [", n, "], got ", weight->sizes());
  held = weight->contiguous();
  return held.data_ptr<c10::BFloat16>();
}

// fn(i, row_in, row_out) for each of x's rows of n values (x contiguous), shared among threads when there are many.
template <typename Fn>
at::Tensor each_row(const at::Tensor& rows, Fn&& fn) {
  const int64_t n = rows.size(-1);
  at::Tensor out = at::detail::empty_cpu(rows.sizes(), rows.options());
  const auto* xp = rows.data_ptr<c10::BFloat16>();
  auto* yp = out.data_ptr<c10::BFloat16>();
  const int64_t count = n == 0 ? 0 : rows.numel() / n;
  at::parallel_for(0, count, std::max<int64_t>(1, kValuesPerThread / std::max<int64_t>(n, 1)),
                   [&](int64_t first, int64_t last) {
                     for (int64_t i = first; i < last; ++i) fn(i, xp + i * n, yp + i * n);
                   });
  return out;
}

at::Tensor rms(const at::Tensor& x, const std::optional<at::Tensor>& weight, double eps) {
  TORCH_CHECK(cpu_has_kernels(), "decodebench_norm::rms needs ", kInstructionSets, "; this CPU lacks one");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && x.dim() >= 1, "x: bfloat16 [..., n]");
  const int64_t n = x.size(-1);
  at::Tensor held;
  const c10::BFloat16* w = weight_of(weight, n, held);
  const float eps_f = static_cast<float>(eps);
  return each_row(x.contiguous(), [&](int64_t, const c10::BFloat16* row, c10::BFloat16* y) {
    norm_row(row, w, n, eps_f, y);
  });
}

// h + rms(x) * weight (h and x [..., n] bf16), then times scale (bf16, one value) where given, each sum rounded once
// to bf16 before the scale.
at::Tensor add_rms(const at::Tensor& h, const at::Tensor& x, const std::optional<at::Tensor>& weight, double eps,
                   const std::optional<at::Tensor>& scale) {
  TORCH_CHECK(cpu_has_kernels(), "decodebench_norm::add_rms needs ", kInstructionSets, "; this CPU lacks one");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && x.dim() >= 1 && h.scalar_type() == at::kBFloat16 &&
                  h.sizes() == x.sizes(),
              "h and x: bfloat16 [..., n] of one shape, got ", h.sizes(), " and ", x.sizes());
  TORCH_CHECK(!scale.has_value() || (scale->scalar_type() == at::kBFloat16 && scale->numel() == 1),
              "scale: bfloat16, one value");
  const int64_t n = x.size(-1);
  at::Tensor held;
  const c10::BFloat16* w = weight_of(weight, n, held);
  const at::Tensor residual = h.contiguous();
  const auto* hp = residual.data_ptr<c10::BFloat16>();
  const std::optional<float> times =  // read where it lies: item() would be one more trip through the dispatcher
      scale.has_value() ? std::optional<float>(static_cast<float>(*scale->data_ptr<c10::BFloat16>())) : std::nullopt;
  const float eps_f = static_cast<float>(eps);
  return each_row(x.contiguous(), [&](int64_t i, const c10::BFloat16* row, c10::BFloat16* y) {
    thread_local std::vector<c10::BFloat16> normed;  // the normed row as eager's norm leaves it
    normed.resize(n);
    norm_row(row, w, n, eps_f, normed.data());
    add_row(hp + i * n, normed.data(), n, times, y);
  });
}

// x [batch, seq, heads, n]: each head's row normed, then rotated by its position's cos and sin ([1 or batch, seq, 1,
// n] bf16, as Transformers' rotary embedding gives them unsqueezed at the heads).
at::Tensor rms_rope(const at::Tensor& x, const std::optional<at::Tensor>& weight, double eps, const at::Tensor& cos,
                    const at::Tensor& sin) {
  TORCH_CHECK(cpu_has_kernels(), "decodebench_norm::rms_rope needs ", kInstructionSets, "; this CPU lacks one");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && x.dim() == 4 && x.size(3) % 2 == 0,
              "x: bfloat16 [batch, seq, heads, n], n even; got ", x.sizes());
  const int64_t batch = x.size(0), seq = x.size(1), heads = x.size(2), n = x.size(3);
  for (const at::Tensor* t : {&cos, &sin}) {
    TORCH_CHECK(t->scalar_type() == at::kBFloat16 && t->dim() == 4 && (t->size(0) == 1 || t->size(0) == batch) &&
                    t->size(1) == seq && t->size(2) == 1 && t->size(3) == n,
                "cos and sin: bfloat16 [1 or ", batch, ", ", seq, ", 1, ", n, "], got ", t->sizes());
  }
  TORCH_CHECK(cos.size(0) == sin.size(0), "cos and sin: one batch size, got ", cos.sizes(), " and ", sin.sizes());
  at::Tensor held;
  const c10::BFloat16* w = weight_of(weight, n, held);
  const at::Tensor c = cos.contiguous(), s = sin.contiguous();
  const auto* cp = c.data_ptr<c10::BFloat16>();
  const auto* sp = s.data_ptr<c10::BFloat16>();
  const int64_t angle_batch = c.size(0) == 1 ? 0 : seq;  // a row's angles: its batch's (or the one) then its position
  const float eps_f = static_cast<float>(eps);
  return each_row(x.contiguous(), [&](int64_t i, const c10::BFloat16* row, c10::BFloat16* y) {
    thread_local std::vector<c10::BFloat16> normed;  // the normed row as eager's norm leaves it, then rotated
    normed.resize(n);
    norm_row(row, w, n, eps_f, normed.data());
    const int64_t angles = (i / (seq * heads) * angle_batch + i / heads % seq) * n;
    rotate_row(normed.data(), cp + angles, sp + angles, n, y);
  });
}

}  // namespace

TORCH_LIBRARY(decodebench_norm, m) {
  m.def("rms(Tensor x, Tensor? weight, float eps) -> Tensor");
  m.def("rms_rope(Tensor x, Tensor? weight, float eps, Tensor cos, Tensor sin) -> Tensor");
  m.def("add_rms(Tensor h, Tensor x, Tensor? weight, float eps, Tensor? scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(decodebench_norm, CPU, m) {
  m.impl("rms", &rms);
  m.impl("rms_rope", &rms_rope);
  m.impl("add_rms", &add_rms);
}
