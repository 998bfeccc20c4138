// decodebench_attn::one_query: a decode step's attention on a CPU with AVX-512 BF16, one K/V head at a time.
//
// A decode step has one query position, so each K/V head meets the few query heads that read it (folded into rows:
// engines/ring.py, grouped_attention) and the slots of its cache. aten's CPU flash attention does this in 52-97 us
// a layer on E2B's shapes at 256-768 slots, and makes about sixteen tensor operators (transposes, allocations) per
// call, each a trip through the dispatcher. Here a row takes two passes over the slots it may see: a score per slot
// (q . k: bf16 products exact in float32, vdpbf16ps, summed in float32, times the scale) and the largest, then
// exp(score - largest) times the slot's V summed in float32. The threads share each head's slots in parts (each K and
// V row read from memory once, for all the head's query rows), joined by their largest scores as flash-decoding does,
// divided once by the sum of the weights and rounded to bf16 once. A row that may see no slot gets zeros (a decode
// step always sees its own). On a 2-core AMD EPYC (Zen 5), 8 query rows: 19-44 us at 256-768 slots of 256 (aten's
// flash attention 36-88), 20 ms at 131,584 slots of 512 (43 ms): each K and V byte read once, at 14 GB/s.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <cmath>
#include <limits>
#include <vector>

#include "rows.h"

namespace {

using namespace decodebench;

constexpr int64_t kDotWidth = 32;  // bf16 inputs a vdpbf16ps reads from each side
constexpr int64_t kAddWidth = 16;  // float32 outputs a vector holds

// a . b over `dim` bf16 inputs (a multiple of kDotWidth).
DB_TARGET inline float dot(const c10::BFloat16* a, const c10::BFloat16* b, int64_t dim) {
  __m512 sum = _mm512_setzero_ps();
  for (int64_t d = 0; d < dim; d += kDotWidth) {
    sum = _mm512_dpbf16_ps(sum, (__m512bh)_mm512_loadu_si512(a + d), (__m512bh)_mm512_loadu_si512(b + d));
  }
  return _mm512_reduce_add_ps(sum);
}

// acc[0:dim] += weight * v[0:dim], v widened from bf16 (exactly) to float32; dim a multiple of kAddWidth.
DB_TARGET inline void add_weighted(float* acc, float weight, const c10::BFloat16* v, int64_t dim) {
  const __m512 w = _mm512_set1_ps(weight);
  for (int64_t d = 0; d < dim; d += kAddWidth) {
    const __m256i half = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(v + d));
    const __m512 wide = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16));
    _mm512_storeu_ps(acc + d, _mm512_fmadd_ps(w, wide, _mm512_loadu_ps(acc + d)));
  }
}

// What one part of the slots gives each query row: the largest score it saw, the sum of exp(score - largest) and
// those weights times V (float32, dim_v a row).
struct Partial {
  std::vector<float> largest, total, acc;
  Partial(int64_t rows, int64_t dim_v)
      : largest(rows, -std::numeric_limits<float>::infinity()), total(rows, 0.0f), acc(rows * dim_v, 0.0f) {}
};

// The `rows` query rows of one K/V head over slots [first, last): each K and V row is read from memory once and
// serves every query row from the core's cache.
DB_TARGET void attend_part(const c10::BFloat16* q, int64_t q_step, const c10::BFloat16* k, int64_t k_step,
                           const c10::BFloat16* v, int64_t v_step, const bool* keep, int64_t slots, int64_t rows,
                           int64_t first, int64_t last, int64_t dim_k, int64_t dim_v, float scale, Partial& part) {
  std::vector<float> scores(rows * (last - first));
  for (int64_t s = first; s < last; ++s) {
    for (int64_t r = 0; r < rows; ++r) {
      if (keep[r * slots + s]) {
        const float score = scale * dot(q + r * q_step, k + s * k_step, dim_k);
        scores[r * (last - first) + s - first] = score;
        part.largest[r] = std::max(part.largest[r], score);
      }
    }
  }
  for (int64_t s = first; s < last; ++s) {
    for (int64_t r = 0; r < rows; ++r) {
      if (keep[r * slots + s]) {
        const float weight = std::exp(scores[r * (last - first) + s - first] - part.largest[r]);
        part.total[r] += weight;
        add_weighted(part.acc.data() + r * dim_v, weight, v + s * v_step, dim_v);
      }
    }
  }
}

constexpr int64_t kMinPart = 64;  // slots a part holds at the least (a thread's share of a short cache is one part)

at::Tensor one_query(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& keep,
                     double scale) {
  TORCH_CHECK(cpu_has_kernels(), "decodebench_attn::one_query needs AVX-512 F, BW, VL and BF16; this CPU lacks one");
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4, "q [B, KV, rows, D], k and v [B, KV, slots, D]");
  for (const at::Tensor* t : {&q, &k, &v}) {
    TORCH_CHECK(t->scalar_type() == at::kBFloat16 && t->stride(3) == 1, "q, k and v: bfloat16, last dim contiguous");
  }
  const int64_t batch = q.size(0), heads = q.size(1), rows = q.size(2), slots = k.size(2);
  const int64_t dim_k = q.size(3), dim_v = v.size(3);
  TORCH_CHECK(k.size(0) == batch && v.size(0) == batch && k.size(1) == heads && v.size(1) == heads &&
                  v.size(2) == slots && k.size(3) == dim_k,
              "k and v must match q's batch and K/V heads and each other's slots; got q ", q.sizes(), ", k ",
              k.sizes(), ", v ", v.sizes());
  TORCH_CHECK(dim_k % kDotWidth == 0 && dim_v % kAddWidth == 0, "head dims must be multiples of ", kDotWidth,
              " (q, k) and ", kAddWidth, " (v), got ", dim_k, " and ", dim_v);
  TORCH_CHECK(keep.scalar_type() == at::kBool && keep.sizes() == at::IntArrayRef({batch, rows, slots}),
              "keep: [", batch, ", ", rows, ", ", slots, "] bool, got ", keep.sizes());
  const at::Tensor visible = keep.contiguous();
  at::Tensor out = at::detail::empty_cpu({batch, heads, rows, dim_v}, q.options());
  const auto* qp = q.data_ptr<c10::BFloat16>();
  const auto* kp = k.data_ptr<c10::BFloat16>();
  const auto* vp = v.data_ptr<c10::BFloat16>();
  const bool* keep_p = visible.data_ptr<bool>();
  auto* op = out.data_ptr<c10::BFloat16>();
  const float scale_f = static_cast<float>(scale);
  // Each K/V head's slots in parts, every thread a part at a time; the parts of a head are then joined.
  const int64_t parts = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), slots / kMinPart));
  const int64_t part_slots = (slots + parts - 1) / parts;
  std::vector<Partial> partials(batch * heads * parts, Partial(rows, dim_v));
  at::parallel_for(0, batch * heads * parts, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t b = i / (heads * parts), h = i / parts % heads, p = i % parts;
      attend_part(qp + b * q.stride(0) + h * q.stride(1), q.stride(2), kp + b * k.stride(0) + h * k.stride(1),
                  k.stride(2), vp + b * v.stride(0) + h * v.stride(1), v.stride(2), keep_p + b * rows * slots, slots,
                  rows, p * part_slots, std::min(slots, (p + 1) * part_slots), dim_k, dim_v, scale_f, partials[i]);
    }
  });
  std::vector<float> acc(dim_v);
  for (int64_t bh = 0; bh < batch * heads; ++bh) {
    for (int64_t r = 0; r < rows; ++r) {
      float largest = -std::numeric_limits<float>::infinity(), total = 0.0f;
      for (int64_t p = 0; p < parts; ++p) largest = std::max(largest, partials[bh * parts + p].largest[r]);
      std::fill(acc.begin(), acc.end(), 0.0f);
      for (int64_t p = 0; p < parts; ++p) {
        const Partial& part = partials[bh * parts + p];
        if (part.total[r] == 0.0f) continue;  // a part with no visible slot
        const float factor = std::exp(part.largest[r] - largest);
        total += part.total[r] * factor;
        for (int64_t d = 0; d < dim_v; ++d) acc[d] += part.acc[r * dim_v + d] * factor;
      }
      const float inverse = total > 0.0f ? 1.0f / total : 0.0f;
      c10::BFloat16* y = op + (bh * rows + r) * dim_v;
      for (int64_t d = 0; d < dim_v; ++d) y[d] = c10::BFloat16(acc[d] * inverse);
    }
  }
  return out;
}

}  // namespace

TORCH_LIBRARY(decodebench_attn, m) {
  m.def("one_query(Tensor q, Tensor k, Tensor v, Tensor keep, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(decodebench_attn, CPU, m) { m.impl("one_query", &one_query); }
