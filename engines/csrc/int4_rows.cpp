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
// Rows of x are taken four at a time over a tile; a tile (16 outputs by K inputs, at most 56 KiB on E2B's shapes)
// is read from memory by the first four rows and from the cache by the rest.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <immintrin.h>

#include <cstdint>
#include <cstring>

namespace {

constexpr int64_t kTile = 16;   // outputs in a tile: one float32 lane each
constexpr int64_t kChunk = 8;   // inputs in a chunk: 64 bytes of a tile
constexpr int64_t kWords = 32;  // 16-bit words in a chunk
constexpr int kRows = 4;        // rows of x computed per pass over a tile
// Words ahead of the chunk being read that each chunk asks the cache for (16 KiB). The hardware prefetcher alone
// left a one-row product over lm_head (226 MB) at 31-34 GB/s on a 2-core AMD EPYC whose streaming read is ~50 GB/s;
// 1, 4, 8, 16 and 32 KiB ahead gave 33, 40-45, 46-46.5, 44-46 and 46 GB/s there.
constexpr int64_t kPrefetch = 8192;

#define DB_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))

// bf16 bits of level - 8 for the 16 levels, twice (vpermw indexes by five bits).
struct LevelTable {
  alignas(64) uint16_t bits[32];
  LevelTable() {
    for (int i = 0; i < 32; ++i) bits[i] = c10::BFloat16(static_cast<float>((i & 15) - 8)).x;
  }
};
const LevelTable kLevels;

bool cpu_has_kernel() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512bf16");
}

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

DB_TARGET inline __m512i pair_of(const c10::BFloat16* x) {
  int32_t bits;
  std::memcpy(&bits, x, sizeof(bits));
  return _mm512_set1_epi32(bits);
}

// `rows` rows of x (each `ldx` apart) times one tile: 16 outputs of each row written to y (`ldy` apart),
// the first `valid` of them (a model's last tile may be partial).
template <int Rows, typename Scale>
DB_TARGET void tile_rows(const uint16_t* words, const Scale* scales, const c10::BFloat16* x, int64_t ldx, int64_t in,
                         int64_t group, c10::BFloat16* y, int64_t ldy, int64_t valid) {
  const __m512i table = _mm512_load_si512(kLevels.bits);
  const int64_t chunks = group / kChunk;
  __m512 acc[Rows];
  for (int r = 0; r < Rows; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t k0 = 0; k0 < in; k0 += group, scales += kTile) {
    __m512 part[Rows][4];
    for (int r = 0; r < Rows; ++r)
      for (int j = 0; j < 4; ++j) part[r][j] = _mm512_setzero_ps();
    for (int64_t c = 0; c < chunks; ++c, words += kWords) {
      _mm_prefetch(reinterpret_cast<const char*>(words + kPrefetch), _MM_HINT_T0);
      const __m512i packed = _mm512_loadu_si512(words);
      const int64_t k = k0 + c * kChunk;
#pragma GCC unroll 4
      for (int j = 0; j < 4; ++j) {
        const __m512i w = _mm512_permutexvar_epi16(_mm512_srli_epi16(packed, 4 * j), table);
#pragma GCC unroll 4
        for (int r = 0; r < Rows; ++r)
          part[r][j] = _mm512_dpbf16_ps(part[r][j], (__m512bh)w, (__m512bh)pair_of(x + r * ldx + k + 2 * j));
      }
    }
    const __m512 s = load_scales(scales);
    for (int r = 0; r < Rows; ++r) {
      const __m512 sum = _mm512_add_ps(_mm512_add_ps(part[r][0], part[r][1]), _mm512_add_ps(part[r][2], part[r][3]));
      acc[r] = _mm512_fmadd_ps(sum, s, acc[r]);
    }
  }
  const __mmask16 lanes = valid >= kTile ? __mmask16(0xFFFF) : __mmask16((1u << valid) - 1);
  for (int r = 0; r < Rows; ++r)
    _mm256_mask_storeu_epi16(y + r * ldy, lanes, (__m256i)_mm512_cvtneps_pbh(acc[r]));
}

template <typename Scale>
void all_rows(const at::Tensor& x, const at::Tensor& words, const at::Tensor& scales, int64_t group, at::Tensor& y) {
  const int64_t rows = x.size(0), in = x.size(1), out = y.size(1), tiles = words.size(0);
  const auto* xp = x.data_ptr<c10::BFloat16>();
  const auto* wp = reinterpret_cast<const uint16_t*>(words.data_ptr<int16_t>());
  const auto* sp = scales.data_ptr<Scale>();
  auto* yp = y.data_ptr<c10::BFloat16>();
  const int64_t tile_words = in / kChunk * kWords, tile_scales = in / group * kTile;
  at::parallel_for(0, tiles, 1, [&](int64_t first, int64_t last) {
    for (int64_t t = first; t < last; ++t) {
      const int64_t valid = std::min(kTile, out - t * kTile);
      for (int64_t r = 0; r < rows; r += kRows) {
        const uint16_t* w = wp + t * tile_words;
        const Scale* s = sp + t * tile_scales;
        const c10::BFloat16* xr = xp + r * in;
        c10::BFloat16* yr = yp + r * out + t * kTile;
        switch (std::min<int64_t>(kRows, rows - r)) {
          case 4: tile_rows<4>(w, s, xr, in, in, group, yr, out, valid); break;
          case 3: tile_rows<3>(w, s, xr, in, in, group, yr, out, valid); break;
          case 2: tile_rows<2>(w, s, xr, in, in, group, yr, out, valid); break;
          default: tile_rows<1>(w, s, xr, in, in, group, yr, out, valid);
        }
      }
    }
  });
}

at::Tensor int4_rows(const at::Tensor& x, const at::Tensor& words, const at::Tensor& scales, int64_t group,
                     int64_t out_features) {
  TORCH_CHECK(cpu_has_kernel(), "decodebench::int4_rows needs AVX-512 F, BW, VL and BF16; this CPU lacks one");
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
  at::Tensor y = at::empty({x.size(0), out_features}, x.options());
  switch (scales.scalar_type()) {
    case at::kHalf: all_rows<c10::Half>(rows, words, scales, group, y); break;
    case at::kBFloat16: all_rows<c10::BFloat16>(rows, words, scales, group, y); break;
    case at::kFloat: all_rows<float>(rows, words, scales, group, y); break;
    default: TORCH_CHECK(false, "scales in float16, bfloat16 or float32, got ", scales.scalar_type());
  }
  return y;
}

bool supported() { return cpu_has_kernel(); }

}  // namespace

TORCH_LIBRARY(decodebench_int4, m) {
  m.def("int4_rows(Tensor x, Tensor words, Tensor scales, int group, int out_features) -> Tensor");
  m.def("supported() -> bool", &supported);
}

TORCH_LIBRARY_IMPL(decodebench_int4, CPU, m) { m.impl("int4_rows", &int4_rows); }
