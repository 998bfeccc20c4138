// decodebench_attn::one_query: a decode step's attention on a CPU with AVX-512 BF16, one K/V head at a time.
//
// A decode step has one query position, so each K/V head meets the few query heads that read it (folded into rows:
// engines/ring.py, grouped_attention) and the slots of its cache. aten's CPU flash attention does this in 52-97 us
// a layer on E2B's shapes at 256-768 slots, and makes about sixteen tensor operators (transposes, allocations) per
// call, each a trip through the dispatcher. Here the rows take two passes over the slots, eight rows at a time: a
// score per slot (q . k: bf16 products exact in float32, vdpbf16ps, summed in float32, times the scale; each K row
// loaded once for the eight rows) and each row's largest, then exp(score - largest) times the slot's V summed in
// float32 (each V row widened once for the eight rows, the sums held in registers). The threads share each head's
// span of slots some row may see in parts (each K and V row read from memory once, for all the head's query rows;
// a weight below exp(-87) is 0, never a subnormal), joined by their largest
// scores as flash-decoding does, divided once by the sum of the weights and rounded to bf16 once. A row that may
// see no slot gets zeros (a decode step always sees its own). The rows' flags (keep) may be one row's, broadcast:
// a decode step's mask is the same for every query row.
// On the 2-core Intel Xeon (AMX), 8 query rows, two threads: 30 us at 256 slots of 256, 67-71 at 768, 49-50 at 300
// of 512, 36-37 ms at 131,584 of 512; one row at a time (every K and V row loaded, and V widened, once per row) it
// took 55-60, 146-155, 98-102 us and 41-50 ms, giving the same bits (timed alone, K and V in the caches; in a
// decode step, where each layer's K and V come from memory, the int4 ring's profile gave its attention 2.8 ms a
// token before and 2.9 after). On a 2-core AMD EPYC (Zen 5) one row at a time
// took 19-44 us at 256-768 slots of 256 (aten's flash attention 36-88), 20 ms at 131,584 slots of 512 (43 ms).

#include <ATen/ATen.h>
#include <torch/library.h>

#include <cmath>
#include <limits>
#include <memory>
#include <vector>

#include "rows.h"

namespace {

using namespace decodebench;

constexpr int64_t kDotWidth = 32;  // bf16 inputs a vdpbf16ps reads from each side
constexpr int64_t kAddWidth = 16;  // float32 outputs a vector holds

// What one part of the slots gives each query row: the largest score it saw, the sum of exp(score - largest) and
// those weights times V (float32, dim_v a row).
struct Partial {
  std::vector<float> largest, total, acc;
  Partial(int64_t rows, int64_t dim_v)
      : largest(rows, -std::numeric_limits<float>::infinity()), total(rows, 0.0f), acc(rows * dim_v, 0.0f) {}
};

// scores[r * n + i] = scale * (q row r . k slot first + i) for R query rows, each sum in float32 (vdpbf16ps); slots
// no row may see (seen[i] false) are skipped. Each K row is loaded once for the R rows, whose R sums are
// independent, so R vdpbf16ps are in flight instead of one dependent chain per (row, slot).
template <int R>
DB_TARGET void scores_of(const c10::BFloat16* q, int64_t q_step, const c10::BFloat16* k, int64_t k_step,
                         const bool* seen, int64_t first, int64_t n, int64_t dim_k, float scale, float* scores) {
  for (int64_t i = 0; i < n; ++i) {
    if (!seen[i]) continue;
    const c10::BFloat16* key = k + (first + i) * k_step;
    __m512 sum[R];
    for (int r = 0; r < R; ++r) sum[r] = _mm512_setzero_ps();
    for (int64_t d = 0; d < dim_k; d += kDotWidth) {
      const __m512bh kd = (__m512bh)_mm512_loadu_si512(key + d);
      for (int r = 0; r < R; ++r) {
        sum[r] = _mm512_dpbf16_ps(sum[r], (__m512bh)_mm512_loadu_si512(q + r * q_step + d), kd);
      }
    }
    for (int r = 0; r < R; ++r) scores[r * n + i] = scale * _mm512_reduce_add_ps(sum[r]);
  }
}

// A weight exp(score - largest) below exp(-87) (1.6e-38, just above float32's least normal) is taken as 0: never a
// subnormal, whose every product with a V row costs a microcode assist on x86 (on the 2-core Xeon of family 6 model
// 207, one_query over 320 of 1024 slots of 512 took 520-760 us with them, 117 with the CPU flushing them to zero). Its
// share of a row's sum, whose largest weight is 1, is below float32's resolution.
constexpr float kLeastExponent = -87.0f;

constexpr int64_t kSlotBlock = 64;  // V rows add_weighted takes at a time: 64 KiB at 512 dims, kept in L2 across columns

// acc[r * dim_v + d] += weights[r * n + i] * (V slot first + i)[d] for R rows, slot after slot (the order of each
// float32 sum), over C x 16 columns at a time held in registers: each V row is widened once for the R rows. The slots
// go kSlotBlock at a time, every column of a block before the next block: a long cache is read from memory once.
template <int R, int C>
DB_TARGET void add_weighted(const float* weights, const c10::BFloat16* v, int64_t v_step, const bool* seen,
                            int64_t first, int64_t n, int64_t dim_v, float* acc) {
  for (int64_t block = 0; block < n; block += kSlotBlock) {
    const int64_t end = std::min(n, block + kSlotBlock);
    for (int64_t d = 0; d < dim_v; d += C * kAddWidth) {
      __m512 sum[R][C];
      for (int r = 0; r < R; ++r) {
        for (int c = 0; c < C; ++c) sum[r][c] = _mm512_loadu_ps(acc + r * dim_v + d + c * kAddWidth);
      }
      for (int64_t i = block; i < end; ++i) {
        if (!seen[i]) continue;
        __m512 wide[C];
        for (int c = 0; c < C; ++c) wide[c] = widen(v + (first + i) * v_step + d + c * kAddWidth);
        for (int r = 0; r < R; ++r) {
          const __m512 w = _mm512_set1_ps(weights[r * n + i]);
          for (int c = 0; c < C; ++c) sum[r][c] = _mm512_fmadd_ps(w, wide[c], sum[r][c]);
        }
      }
      for (int r = 0; r < R; ++r) {
        for (int c = 0; c < C; ++c) _mm512_storeu_ps(acc + r * dim_v + d + c * kAddWidth, sum[r][c]);
      }
    }
  }
}

// The `rows` query rows of one K/V head over slots [first, last), eight rows at a time: each K and V row is read from
// memory once and serves every query row from the core's cache. A row's weight for a slot it may not see is 0 (the
// slot is seen by another row, so its V is finite: the sums keep their value); a slot no row sees is never read.
DB_TARGET void attend_part(const c10::BFloat16* q, int64_t q_step, const c10::BFloat16* k, int64_t k_step,
                           const c10::BFloat16* v, int64_t v_step, const bool* keep, int64_t keep_step, int64_t rows,
                           int64_t first, int64_t last, int64_t dim_k, int64_t dim_v, float scale, Partial& part) {
  const int64_t n = last - first;
  std::unique_ptr<bool[]> seen(new bool[n]());
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t i = 0; i < n; ++i) seen[i] = seen[i] || keep[r * keep_step + first + i];
  }
  std::vector<float> scores(std::min<int64_t>(rows, 8) * n);
  for (int64_t r0 = 0; r0 < rows; r0 += 8) {
    with_rows(std::min<int64_t>(8, rows - r0), [&]<int R>() {
      scores_of<R>(q + r0 * q_step, q_step, k, k_step, seen.get(), first, n, dim_k, scale, scores.data());
      for (int r = 0; r < R; ++r) {  // each row's largest score it may see, then its weights
        const bool* visible = keep + (r0 + r) * keep_step + first;
        float* row = scores.data() + r * n;
        float& largest = part.largest[r0 + r];
        for (int64_t i = 0; i < n; ++i) {
          if (visible[i]) largest = std::max(largest, row[i]);
        }
        float& total = part.total[r0 + r];
        for (int64_t i = 0; i < n; ++i) {
          const float below = row[i] - largest;
          row[i] = visible[i] && below > kLeastExponent ? std::exp(below) : 0.0f;
          total += row[i];
        }
      }
      float* acc = part.acc.data() + r0 * dim_v;
      if (dim_v % (2 * kAddWidth) == 0) {
        add_weighted<R, 2>(scores.data(), v, v_step, seen.get(), first, n, dim_v, acc);
      } else {
        add_weighted<R, 1>(scores.data(), v, v_step, seen.get(), first, n, dim_v, acc);
      }
    });
  }
}

constexpr int64_t kMinPart = 64;  // slots a part holds at the least (a thread's share of a short cache is one part)

at::Tensor one_query(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& keep,
                     double scale) {
  TORCH_CHECK(cpu_has_kernels(), "decodebench_attn::one_query needs ", kInstructionSets, "; this CPU lacks one");
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
  // Each row's flags contiguous; the rows may be one row's, broadcast (stride 0: a decode step's mask, the same for
  // every query row, expanded without a copy).
  const at::Tensor visible = keep.stride(2) == 1 ? keep : keep.contiguous();
  at::Tensor out = at::detail::empty_cpu({batch, heads, rows, dim_v}, q.options());
  const auto* qp = q.data_ptr<c10::BFloat16>();
  const auto* kp = k.data_ptr<c10::BFloat16>();
  const auto* vp = v.data_ptr<c10::BFloat16>();
  const bool* keep_p = visible.data_ptr<bool>();
  auto* op = out.data_ptr<c10::BFloat16>();
  const float scale_f = static_cast<float>(scale);
  // The span of slots some row may see, [first_seen, end_seen): the parts share it, not the whole cache (a decode
  // step early in its cache sees the first slots only: parts of the whole cache gave them all to one thread).
  int64_t first_seen = slots, end_seen = 0;
  const int64_t keep_rows = visible.stride(1) == 0 ? 1 : rows;  // a broadcast row is read once
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t r = 0; r < keep_rows; ++r) {
      const bool* flags = keep_p + b * visible.stride(0) + r * visible.stride(1);
      for (int64_t i = 0; i < slots; ++i) {
        if (!flags[i]) continue;
        first_seen = std::min(first_seen, i);
        end_seen = std::max(end_seen, i + 1);
      }
    }
  }
  const int64_t span = std::max<int64_t>(0, end_seen - first_seen);
  // Each K/V head's span in parts, every thread a part at a time; the parts of a head are then joined.
  const int64_t parts = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), span / kMinPart));
  const int64_t part_slots = (span + parts - 1) / parts;
  std::vector<Partial> partials(batch * heads * parts, Partial(rows, dim_v));
  at::parallel_for(0, batch * heads * parts, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t b = i / (heads * parts), h = i / parts % heads, p = i % parts;
      attend_part(qp + b * q.stride(0) + h * q.stride(1), q.stride(2), kp + b * k.stride(0) + h * k.stride(1),
                  k.stride(2), vp + b * v.stride(0) + h * v.stride(1), v.stride(2), keep_p + b * visible.stride(0),
                  visible.stride(1), rows, first_seen + p * part_slots, first_seen + std::min(span, (p + 1) * part_slots),
                  dim_k, dim_v, scale_f, partials[i]);
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
        const float below = part.largest[r] - largest;
        if (part.total[r] == 0.0f || below <= kLeastExponent) continue;  // no visible slot, or a share below resolution
        const float factor = std::exp(below);
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
