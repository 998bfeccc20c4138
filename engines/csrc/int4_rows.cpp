// decodebench::int4_rows: y = x @ w.T for a W4A16 weight held 4-bit, on a CPU with AVX-512 BF16.
//
// The weight is packed once at load (engines/int4_cpu.py, `pack`) into tiles of 16 outputs. A tile holds, for
// every 8 inputs (a chunk), 64 bytes: 32 16-bit words, word 2*o+p (o the output in the tile, p = 0 or 1) holding
// four levels in its nibbles, nibble j the level + 8 of input 2*j+p of the chunk. Tiles follow one another, each
// chunk after chunk, so a thread streams its tiles' bytes once, front to back. The scales follow the same tiles:
// [tiles, groups, 16], in the checkpoint's own dtype (float16, bfloat16 or float32: converted exactly to float32).
//
// One chunk gives four vectors of 32 bf16 levels by a shift and a table lookup (vpermw reads the low five bits
// of each word: the table repeats after 16), each multiplied by a pair of x's inputs broadcast to the 16 lanes
// (vdpbf16ps: bf16 products, exact in float32, summed in float32). A lane is an output, so no horizontal sum is
// needed: at each group's end the four partial sums are added and scaled, at the tile's end rounded to bf16 once.
// Rows of x are taken four at a time over two tiles side by side (16 outputs by K inputs each, at most 56 KiB on
// E2B's shapes): the first four read them from memory, the rest from the core's cache.
//
// On a 2-core KVM Xeon with AMX this product is bound by its arithmetic: from the cores' L2 it reads 31-32 GB/s on
// both cores (`make bench-int4`, cache rows), below the machine's streaming read (35-37). There `vdpbf16ps zmm`
// issues once per ~2 core cycles (a float32 FMA twice a cycle; its ymm form issues no faster, for half the products),
// so the four a chunk are most of its ~14 cycles. Two other designs, timed on one core over one tile's chunks in L2
// (a microbenchmark, 1536 and 12288 inputs), did no better: levels to float32 by `vpermps` and float32 FMAs (eight a
// chunk), 9.0-10.0 TSC cycles a chunk against this one's 9.4-9.9; AMX (the unpacked group stored as a 16-row B tile,
// the row of x a 1-row A tile, `tdpbf16ps`, each group's sums stored and scaled, two blocks of groups in flight)
// 9.0-10.8: its unpack alone took 4.8-5.2 cycles a chunk and its tile work alone 5.2-5.7, and the two added up rather
// than overlapped.
#include <ATen/ATen.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include "rows.h"

namespace {

using namespace decodebench;

constexpr int64_t kChunk = 8;   // inputs in a chunk: 64 bytes of a tile
constexpr int64_t kWords = 32;  // 16-bit words in a chunk

// bf16 bits of level - 8 for the 16 levels, twice (vpermw indexes by five bits).
struct LevelTable {
  alignas(64) uint16_t bits[32];
  LevelTable() {
    for (int i = 0; i < 32; ++i) bits[i] = c10::BFloat16(static_cast<float>((i & 15) - 8)).x;
  }
};
const LevelTable kLevels;

template <typename Scale>
DB_TARGET inline __m512 load_scales(const Scale* s) {
  if constexpr (std::is_same_v<Scale, c10::Half>) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(s)));
  } else if constexpr (std::is_same_v<Scale, c10::BFloat16>) {
    __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(s)));
    return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
  } else {
    return _mm512_loadu_ps(s);
  }
}

constexpr int64_t kRows = 4;  // rows of x computed per pass over two tiles (eight would leave too few registers)

// `Rows` rows of x (each `in` apart) times `Tiles` adjacent tiles (each `tile_words` and `tile_scales` apart): 16
// outputs a tile of each row written to y (rows `ldy` apart), the first `valid` of the last tile's (a weight's last
// tile may be partial).
template <int Rows, int Tiles, Hint H, typename Scale>
DB_TARGET void tile_rows(const uint16_t* words, int64_t tile_words, const Scale* scales, int64_t tile_scales,
                         const c10::BFloat16* x, int64_t in, int64_t group, c10::BFloat16* y, int64_t ldy,
                         int64_t valid) {
  const __m512i table = _mm512_load_si512(kLevels.bits);
  const int64_t chunks = group / kChunk;
  // a group's sums are scaled and added up at its end: more than four parts a row would add as often as they multiply
  constexpr int Parts = std::min(4, kParts<Rows, Tiles>);
  constexpr int64_t ahead = kPrefetchBytes / sizeof(uint16_t);
  __m512 acc[Rows][Tiles];
  for (int r = 0; r < Rows; ++r)
    for (int t = 0; t < Tiles; ++t) acc[r][t] = _mm512_setzero_ps();
  for (int64_t k0 = 0; k0 < in; k0 += group, scales += kTile) {
    __m512 part[Rows][Tiles][Parts];
    for (int r = 0; r < Rows; ++r)
      for (int t = 0; t < Tiles; ++t)
        for (int j = 0; j < Parts; ++j) part[r][t][j] = _mm512_setzero_ps();
    for (int64_t c = 0; c < chunks; ++c, words += kWords) {
      __m512i packed[Tiles];
      for (int t = 0; t < Tiles; ++t) {
        prefetch<H>(words + t * tile_words + ahead);
        packed[t] = _mm512_loadu_si512(words + t * tile_words);
      }
      const int64_t k = k0 + c * kChunk;
#pragma GCC unroll 4
      for (int j = 0; j < 4; ++j) {
        __m512i w[Tiles];
        for (int t = 0; t < Tiles; ++t) w[t] = _mm512_permutexvar_epi16(_mm512_srli_epi16(packed[t], 4 * j), table);
#pragma GCC unroll 8
        for (int r = 0; r < Rows; ++r) {
          const __m512bh xs = (__m512bh)pair_of(x + r * in + k + 2 * j);
          for (int t = 0; t < Tiles; ++t)
            part[r][t][j % Parts] = _mm512_dpbf16_ps(part[r][t][j % Parts], (__m512bh)w[t], xs);
        }
      }
    }
    for (int t = 0; t < Tiles; ++t) {
      const __m512 s = load_scales(scales + t * tile_scales);
      for (int r = 0; r < Rows; ++r) {
        __m512 sum = part[r][t][0];
        for (int j = 1; j < Parts; ++j) sum = _mm512_add_ps(sum, part[r][t][j]);
        acc[r][t] = _mm512_fmadd_ps(sum, s, acc[r][t]);
      }
    }
  }
  for (int r = 0; r < Rows; ++r)
    for (int t = 0; t < Tiles; ++t) store_tile(y + r * ldy + t * kTile, acc[r][t], t == Tiles - 1 ? valid : kTile);
}

template <typename Scale>
void all_rows(const at::Tensor& x, const at::Tensor& words, const at::Tensor& scales, int64_t group, at::Tensor& y) {
  const int64_t rows = x.size(0), in = x.size(1), out = y.size(1), tiles = words.size(0);
  const auto* xp = x.data_ptr<c10::BFloat16>();
  const auto* wp = reinterpret_cast<const uint16_t*>(words.data_ptr<int16_t>());
  const auto* sp = scales.data_ptr<Scale>();
  auto* yp = y.data_ptr<c10::BFloat16>();
  const int64_t tile_words = in / kChunk * kWords, tile_scales = in / group * kTile;
  each_pass<kRows>(tiles, rows, out, [&]<int R, int T, Hint H>(int64_t u, int64_t r, int64_t valid) {
    tile_rows<R, T, H>(wp + u * tile_words, tile_words, sp + u * tile_scales, tile_scales, xp + r * in, in, group,
                    yp + r * out + u * kTile, out, valid);
  });
}

at::Tensor int4_rows(const at::Tensor& x, const at::Tensor& words, const at::Tensor& scales, int64_t group,
                     int64_t out_features) {
  TORCH_CHECK(cpu_has_kernels(), "decodebench::int4_rows needs AVX-512 F, BW, VL and BF16; this CPU lacks one");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16, "x: [rows, in] bfloat16, got ", x.sizes(), " ",
              x.scalar_type());
  TORCH_CHECK(group > 0 && group % kChunk == 0 && x.size(1) % group == 0, "group ", group,
              " must be a multiple of 8 dividing in_features ", x.size(1));
  const int64_t tiles = (out_features + kTile - 1) / kTile;
  TORCH_CHECK(words.scalar_type() == at::kShort && words.is_contiguous() &&
                  words.sizes() == at::IntArrayRef({tiles, x.size(1) / kChunk, kWords}),
              "words: [", tiles, ", ", x.size(1) / kChunk, ", 32] int16 contiguous, got ", words.sizes());
  TORCH_CHECK(scales.is_contiguous() && scales.sizes() == at::IntArrayRef({tiles, x.size(1) / group, kTile}),
              "scales: [", tiles, ", ", x.size(1) / group, ", 16] contiguous, got ", scales.sizes());
  const at::Tensor rows = x.contiguous();
  at::Tensor y = output_for(x, out_features);
  switch (scales.scalar_type()) {
    case at::kHalf: all_rows<c10::Half>(rows, words, scales, group, y); break;
    case at::kBFloat16: all_rows<c10::BFloat16>(rows, words, scales, group, y); break;
    case at::kFloat: all_rows<float>(rows, words, scales, group, y); break;
    default: TORCH_CHECK(false, "scales in float16, bfloat16 or float32, got ", scales.scalar_type());
  }
  return y;
}

bool supported() { return cpu_has_kernels(); }

}  // namespace

TORCH_LIBRARY(decodebench_int4, m) {
  m.def("int4_rows(Tensor x, Tensor words, Tensor scales, int group, int out_features) -> Tensor");
  m.def("supported() -> bool", &supported);
  m.def("threads() -> int", &threads_used);
  m.def("prefetch_hint() -> str", [] { return std::string(prefetch_hint_name()); });
}

TORCH_LIBRARY_IMPL(decodebench_int4, CPU, m) { m.impl("int4_rows", &int4_rows); }
