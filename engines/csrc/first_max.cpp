// decodebench_pick::first_max: the greedy token of each row of logits, torch.argmax(x, -1, keepdim=True) to the bit,
// on a CPU with AVX-512.
//
// aten's argmax over one row reduces it on one thread, a value at a time: over E2B's 262,144 bf16 logits it took
// ~850 us a call on the 2-core KVM Xeon with AMX, a call before every token, where a sweep of the same values as
// vectors takes tens (aten's max of them: ~18 us). Here each thread takes one contiguous part of the row (the part
// of the logits its own core just wrote, where the logits come from the tiled products), 16 values a vector widened
// exactly to float32; lane j keeps the largest value it has seen and the index of its first sighting (a later value
// replaces it only when greater); the lanes' and then the parts' winners are the largest value at its smallest index.
// So ties go to the first index, -0 equals +0, and -inf is a value like another, as in aten. A NaN is the maximum
// there: a part that holds one answers with its first NaN, and the first part with a NaN wins.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <limits>
#include <vector>

#include "rows.h"

namespace {

using namespace decodebench;

constexpr int64_t kPart = 65536;  // values a thread takes at the least

struct Best {
  float value;
  int64_t index;
  bool nan;
};

// 16 values of x from i (the first `valid`) as float32, exactly.
template <typename Scalar>
DB_TARGET inline __m512 load_values(const Scalar* x, int64_t valid) {
  if constexpr (std::is_same_v<Scalar, float>) {
    return _mm512_maskz_loadu_ps(first_lanes(valid), x);
  } else {
    return widen(x, valid);
  }
}

// The first largest of x[begin, end) (or its first NaN), begin < end.
template <typename Scalar>
DB_TARGET Best first_max_of(const Scalar* x, int64_t begin, int64_t end) {
  __m512 best = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  __m512i at = _mm512_set1_epi32(-1);
  __m512i index = _mm512_add_epi32(_mm512_set1_epi32(static_cast<int32_t>(begin)),
                                   _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
  const __m512i step = _mm512_set1_epi32(kTile);
  for (int64_t i = begin; i < end; i += kTile, index = _mm512_add_epi32(index, step)) {
    const int64_t valid = std::min(kTile, end - i);
    const __m512 v = load_values(x + i, valid);
    const __mmask16 lanes = first_lanes(valid);
    const __mmask16 nan = _mm512_mask_cmp_ps_mask(lanes, v, v, _CMP_UNORD_Q);
    if (nan) return {std::numeric_limits<float>::quiet_NaN(), i + __builtin_ctz(nan), true};
    // -inf never replaces the starting -inf: a lane that saw only -inf keeps index -1 and is taken below
    const __mmask16 greater = _mm512_mask_cmp_ps_mask(lanes, v, best, _CMP_GT_OQ);
    best = _mm512_mask_mov_ps(best, greater, v);
    at = _mm512_mask_mov_epi32(at, greater, index);
  }
  const float value = _mm512_reduce_max_ps(best);
  if (value == -std::numeric_limits<float>::infinity()) return {value, begin, false};  // every value -inf
  alignas(64) int32_t indices[kTile];
  alignas(64) float values[kTile];
  _mm512_store_epi32(indices, at);
  _mm512_store_ps(values, best);
  int64_t first = end;
  for (int j = 0; j < kTile; ++j)
    if (values[j] == value && indices[j] < first) first = indices[j];
  return {value, first, false};
}

template <typename Scalar>
void first_max_rows(const at::Tensor& x, at::Tensor& out) {
  const int64_t rows = x.size(0), n = x.size(1);
  const auto* xp = x.data_ptr<Scalar>();
  auto* op = out.data_ptr<int64_t>();
  const int64_t parts = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), n / kPart));
  const int64_t per = (n + parts - 1) / parts;  // at least kPart: every part holds values
  for (int64_t r = 0; r < rows; ++r) {
    std::vector<Best> found(parts);
    at::parallel_for(0, parts, 1, [&](int64_t first, int64_t last) {
      for (int64_t p = first; p < last; ++p)
        found[p] = first_max_of(xp + r * n, p * per, std::min(n, (p + 1) * per));
    });
    Best winner = found[0];
    for (int64_t p = 1; p < parts && !winner.nan; ++p)
      if (found[p].nan || found[p].value > winner.value) winner = found[p];
    op[r] = winner.index;
  }
}

at::Tensor first_max(const at::Tensor& x) {
  TORCH_CHECK(cpu_has_kernels(), "decodebench_pick::first_max needs ", kInstructionSets, "; this CPU lacks one");
  TORCH_CHECK(x.dim() == 2 && x.size(1) > 0, "x: [rows, n] with n > 0, got ", x.sizes());
  TORCH_CHECK(x.size(1) <= std::numeric_limits<int32_t>::max(), "n must fit in int32, got ", x.size(1));
  const at::Tensor rows = x.contiguous();
  at::Tensor out = at::detail::empty_cpu({x.size(0), 1}, x.options().dtype(at::kLong));
  switch (x.scalar_type()) {
    case at::kBFloat16: first_max_rows<c10::BFloat16>(rows, out); break;
    case at::kFloat: first_max_rows<float>(rows, out); break;
    default: TORCH_CHECK(false, "x in bfloat16 or float32, got ", x.scalar_type());
  }
  return out;
}

}  // namespace

TORCH_LIBRARY(decodebench_pick, m) { m.def("first_max(Tensor x) -> Tensor"); }

TORCH_LIBRARY_IMPL(decodebench_pick, CPU, m) { m.impl("first_max", &first_max); }
