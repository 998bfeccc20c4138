// decodebench_bf16::bf16_rows: y = x @ w.T for a bf16 weight, on a CPU with AVX-512 BF16.
//
// The weight is packed once at load (engines/bf16_cpu.py, `pack`) into tiles of 16 outputs: for every pair of
// inputs (2k, 2k+1), 64 bytes holding w[o, 2k] and w[o, 2k+1] for o = 0..15, side by side. Tiles follow one
// another, so a thread streams its tiles' bytes once, front to back, and one load gives vdpbf16ps a whole operand:
// multiplied by the pair x[2k], x[2k+1] broadcast to the 16 lanes, it adds both products to each output's float32
// sum. A lane is an output, so no horizontal sum is needed; each output is rounded to bf16 once, at the end.
// Rows of x are taken eight at a time over two tiles side by side (16 outputs by K inputs each, 48-192 KiB on E2B's
// shapes): the first eight read them from memory, the rest from the core's cache.
#include <ATen/ATen.h>
#include <torch/library.h>

#include "rows.h"

namespace {

using namespace decodebench;

constexpr int64_t kPairWords = 32;  // bf16 values in a pair of inputs of a tile (64 bytes)

constexpr int64_t kRows = 8;  // rows of x computed per pass over two tiles

// `Rows` rows of x (each `in` apart) times `Tiles` adjacent tiles (each `tile_words` apart): 16 outputs a tile of
// each row written to y (rows `ldy` apart), the first `valid` of the last tile's (a weight's last tile may be partial).
template <int Rows, int Tiles, Hint H>
DB_TARGET void tile_rows(const c10::BFloat16* w, int64_t tile_words, const c10::BFloat16* x, int64_t in, c10::BFloat16* y,
                         int64_t ldy, int64_t valid) {
  constexpr int Parts = kParts<Rows, Tiles>;
  constexpr int64_t ahead = kPrefetchBytes / sizeof(c10::BFloat16);
  __m512 part[Rows][Tiles][Parts];
  for (int r = 0; r < Rows; ++r)
    for (int t = 0; t < Tiles; ++t)
      for (int j = 0; j < Parts; ++j) part[r][t][j] = _mm512_setzero_ps();
  for (int64_t k = 0; k < in; k += 8, w += 4 * kPairWords) {  // four pairs, 256 bytes of each tile, an iteration
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) {
      __m512i pairs[Tiles];
      for (int t = 0; t < Tiles; ++t) {
        const c10::BFloat16* at = w + t * tile_words + j * kPairWords;
        prefetch<H>(at + ahead);
        pairs[t] = _mm512_loadu_si512(at);
      }
#pragma GCC unroll 8
      for (int r = 0; r < Rows; ++r) {
        const __m512bh xs = (__m512bh)pair_of(x + r * in + k + 2 * j);
        for (int t = 0; t < Tiles; ++t)
          part[r][t][j % Parts] = _mm512_dpbf16_ps(part[r][t][j % Parts], (__m512bh)pairs[t], xs);
      }
    }
  }
  for (int r = 0; r < Rows; ++r)
    for (int t = 0; t < Tiles; ++t) {
      __m512 sum = part[r][t][0];
      for (int j = 1; j < Parts; ++j) sum = _mm512_add_ps(sum, part[r][t][j]);
      store_tile(y + r * ldy + t * kTile, sum, t == Tiles - 1 ? valid : kTile);
    }
}

at::Tensor bf16_rows(const at::Tensor& x, const at::Tensor& packed, int64_t out_features) {
  TORCH_CHECK(cpu_has_kernels(), "decodebench_bf16::bf16_rows needs ", kInstructionSets, "; this CPU lacks one");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16, "x: [rows, in] bfloat16, got ", x.sizes(), " ",
              x.scalar_type());
  const int64_t in = x.size(1), tiles = (out_features + kTile - 1) / kTile;
  TORCH_CHECK(in % 8 == 0, "in_features ", in, " must be a multiple of 8");
  TORCH_CHECK(packed.scalar_type() == at::kBFloat16 && packed.is_contiguous() &&
                  packed.sizes() == at::IntArrayRef({tiles, in / 2, kTile, 2}),
              "packed: [", tiles, ", ", in / 2, ", 16, 2] bfloat16 contiguous, got ", packed.sizes());
  const at::Tensor rows = x.contiguous();
  at::Tensor y = output_for(x, out_features);
  const auto* xp = rows.data_ptr<c10::BFloat16>();
  const auto* wp = packed.data_ptr<c10::BFloat16>();
  auto* yp = y.data_ptr<c10::BFloat16>();
  const int64_t n = rows.size(0), tile_words = in * kTile;
  each_pass<kRows>(tiles, n, out_features, [&]<int R, int T, Hint H>(int64_t u, int64_t r, int64_t valid) {
    tile_rows<R, T, H>(wp + u * tile_words, tile_words, xp + r * in, in, yp + r * out_features + u * kTile, out_features,
                    valid);
  });
  return y;
}

}  // namespace

TORCH_LIBRARY(decodebench_bf16, m) { m.def("bf16_rows(Tensor x, Tensor packed, int out_features) -> Tensor"); }

TORCH_LIBRARY_IMPL(decodebench_bf16, CPU, m) { m.impl("bf16_rows", &bf16_rows); }
