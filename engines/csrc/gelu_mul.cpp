// decodebench_act::gelu_mul: gelu_tanh(gate) * up for bf16 rows in one operator, on a CPU with AVX-512 BF16.
//
// The Rust engine's MLP and per-layer input called two eager operators here (engines/rust/src/model.rs: `mlp`, the
// per-layer gate): aten's bf16 gelu (tanh) and a mul, each a trip through the dispatcher and a tensor allocated, 70 a
// decode step on E2B; aten's gelu took 22.8 us over a row of 12,288 values with its caches warm (one thread, SLEEF's
// tanh). Here each value is rounded as the two eager operators round it: g = bf16(gelu_tanh(gate)), computed in
// float32, then bf16(g * up). gelu_tanh(x) = 0.5 x (1 + tanh(u)), u = sqrt(2/pi) (x + 0.044715 x^3), is computed as
// x / (1 + exp(-2u)) (the same function: 1 + tanh(u) = 2 / (1 + exp(-2u))), which keeps its relative precision where
// tanh(u) nears -1; exp from a degree-6 polynomial after the usual reduction by ln 2 (within 2 float32 ulps), so g
// differs from aten's only where the float32 value lies within a few ulps of a bf16 rounding boundary, or where aten's
// 1 + tanh(u) loses digits (x below about -3, where g is under 1e-3 of x). Rows are shared among threads in parts of
// kValuesPerThread values.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "rows.h"

namespace {

using namespace decodebench;

constexpr int64_t kValuesPerThread = 4096;  // values a thread takes at the least: a decode row of 12,288 on 2 threads

// exp(z) within 2 float32 ulps, z clamped to [-104, 104] first: beyond it exp's float32 value is 0 (a subnormal at the
// least) or infinite, which scalef gives from there, and an infinite z would leave a NaN in the reduction.
DB_TARGET inline __m512 exp_of(__m512 z) {
  z = _mm512_min_ps(_mm512_max_ps(z, _mm512_set1_ps(-104.0f)), _mm512_set1_ps(104.0f));
  const __m512 k = _mm512_roundscale_ps(_mm512_mul_ps(z, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  // r = z - k ln 2, ln 2 in two parts so that k * its high part is exact
  __m512 r = _mm512_fnmadd_ps(k, _mm512_set1_ps(0.693359375f), z);
  r = _mm512_fnmadd_ps(k, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.0f / 720);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, k);
}

// bf16(bf16(gelu_tanh(gate)) * up) for `valid` values (at most 16) at gate, up and y.
DB_TARGET inline void gelu_mul_tile(const c10::BFloat16* gate, const c10::BFloat16* up, c10::BFloat16* y,
                                    int64_t valid) {
  const __m512 x = widen(gate, valid);
  const __m512 inner = _mm512_fmadd_ps(_mm512_mul_ps(x, x), _mm512_set1_ps(0.044715f), _mm512_set1_ps(1.0f));
  const __m512 u = _mm512_mul_ps(_mm512_mul_ps(x, inner), _mm512_set1_ps(0.7978845608028654f));
  const __m512 tail = exp_of(_mm512_mul_ps(u, _mm512_set1_ps(-2.0f)));  // exp(-2u)
  const __m512 g = _mm512_div_ps(x, _mm512_add_ps(_mm512_set1_ps(1.0f), tail));
  store_tile(y, _mm512_mul_ps(rounded(g), widen(up, valid)), valid);
}

DB_TARGET void gelu_mul_range(const c10::BFloat16* gate, const c10::BFloat16* up, c10::BFloat16* y, int64_t first,
                              int64_t last) {
  for (int64_t i = first; i < last; i += kTile) gelu_mul_tile(gate + i, up + i, y + i, last - i);
}

at::Tensor gelu_mul(const at::Tensor& gate, const at::Tensor& up) {
  TORCH_CHECK(cpu_has_kernels(), "decodebench_act::gelu_mul needs ", kInstructionSets, "; this CPU lacks one");
  TORCH_CHECK(gate.scalar_type() == at::kBFloat16 && up.scalar_type() == at::kBFloat16 && gate.sizes() == up.sizes(),
              "gate and up: bfloat16 of one shape, got ", gate.sizes(), " ", gate.scalar_type(), " and ", up.sizes(),
              " ", up.scalar_type());
  const at::Tensor g = gate.contiguous(), u = up.contiguous();
  at::Tensor y = at::detail::empty_cpu(g.sizes(), g.options());
  const auto* gp = g.data_ptr<c10::BFloat16>();
  const auto* upp = u.data_ptr<c10::BFloat16>();
  auto* yp = y.data_ptr<c10::BFloat16>();
  const int64_t n = g.numel(), parts = (n + kValuesPerThread - 1) / kValuesPerThread;
  at::parallel_for(0, parts, 1, [&](int64_t first, int64_t last) {
    gelu_mul_range(gp, upp, yp, first * kValuesPerThread, std::min(n, last * kValuesPerThread));
  });
  return y;
}

}  // namespace

TORCH_LIBRARY(decodebench_act, m) { m.def("gelu_mul(Tensor gate, Tensor up) -> Tensor"); }

TORCH_LIBRARY_IMPL(decodebench_act, CPU, m) { m.impl("gelu_mul", &gelu_mul); }
