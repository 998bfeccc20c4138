// decodebench_int4::int4_rows: y = x @ w.T for a W4A16 weight held 4-bit, on a CPU with AVX-512 BF16 and VNNI.
//
// The weight is packed once at load (engines/int4_cpu.py, `pack`) into tiles of 16 outputs. A tile holds, for
// every 8 inputs (a chunk), 64 bytes: 32 16-bit words, word 2*o+p (o the output in the tile, p = 0 or 1) holding
// four levels in its nibbles, nibble j the level + 8 of input 2*j+p of the chunk. Tiles follow one another, each
// chunk after chunk, so a thread streams its tiles' bytes once, front to back. The scales follow the same tiles:
// [tiles, groups, 16], in the checkpoint's own dtype (float16, bfloat16 or float32: converted exactly to float32).
//
// The products are integer ones. Each row of x is first written as fixed point, block by block (a block: the
// checkpoint's group, or the largest part of it of a multiple of 8 inputs and at most 64): the block's inputs times
// 2^(F - E), E the exponent of its largest (-127 where that is subnormal or zero), rounded to an integer of F + 2 bits
// with its sign, held as L 7-bit limbs (the top one signed; F = 7 L - 1). An input within 2^(F - 7) of its block's
// largest keeps every bit; a smaller one is rounded at 2^-(F + 1) of that largest (the bf16 output is rounded at 2^-9
// of itself). The caller picks L (`limbs`): 3 (F = 20: every input within 2^13 exact, the rest rounded at 2^-21) or 2
// (F = 13: within 2^6 exact, the rest rounded at 2^-14), whose products are two thirds of the work.
// Dword lane o of a chunk's 64 bytes holds in its bytes' low nibbles the levels + 8 of output o's inputs 0, 4, 1, 5
// and in their high nibbles those of inputs 2, 6, 3, 7: a mask and a shift give two vectors of 16 x 4 unsigned
// bytes, and vpdpbusd multiplies each by the four matching bytes of a limb broadcast to every lane, adding the four
// products to the lane's int32 sum. At a block's end the limbs' sums are put together (the +8 taken off by the
// block's input sum), exactly in int32, turned to float32 times 2^(E - F); at a group's end the group's sum is
// scaled; at the tile's end rounded to bf16 once.
// A lane is an output, so no horizontal sum is needed. Rows of x are taken four at a time over two tiles side by
// side (16 outputs by K inputs each, at most 56 KiB on E2B's shapes): the first four read them from memory, the rest
// from the core's cache. A block with an input that is not finite makes the row's outputs NaN.
//
// Why integers: on a 2-core KVM Xeon with AMX `vdpbf16ps zmm` issues once per ~2.2 core cycles and shares its
// ports with the unpacking, so the bf16 form of this product (levels to bf16 by a table lookup, four vdpbf16ps a
// chunk) took ~15 core cycles a chunk and read 31-32 GB/s from the cores' L2 on both cores, below the machine's
// streaming read (35-37): bound by its arithmetic. vpdpbusd issues twice a cycle there for twice the products; a
// chunk's three unpacking operations and six vpdpbusd took 3.8 cycles in a loop of them alone (one core, a
// microbenchmark). Levels to float32 with float32 FMAs (9.0-10.0 TSC cycles a chunk against the bf16 form's 9.4-9.9)
// and AMX (9.0-10.8: its unpack alone 4.8-5.2, its tile work 5.2-5.7, adding up) did no better than the bf16 form.
// One row over cold copies in 2 MiB pages, both cores, the two forms alternated in one process (streaming read
// 35-37 GB/s): this form 30-33 GB/s on 12288 x 1536, 24576 x 1536 and 1536 x 12288, the bf16 form 26-29; 25.0
// against 23.8 on 2048 x 1536, where a call's fixed costs weigh more (writing a row of 1536 inputs in fixed point
// takes about 0.5 us).
#include <ATen/ATen.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <cmath>
#include <limits>
#include <vector>

#include "rows.h"

namespace {

using namespace decodebench;

constexpr int64_t kChunk = 8;   // inputs in a chunk: 64 bytes of a tile
constexpr int64_t kWords = 32;  // 16-bit words in a chunk
constexpr int64_t kBlockMax = 64;  // inputs in a block at most: its int32 sums cannot overflow (|sum| < 8 * 64 * 2^21)
constexpr int kLimbBits = 7;       // bits of a limb below the top one (whose eighth is the sign)

// Bits of the fixed point below the exponent of a block's largest input, for `Limbs` 7-bit limbs: the largest
// (below 2^(E + 1)) times 2^(F - E) fits the top limb's signed byte.
constexpr int fraction_of(int limbs) { return kLimbBits * limbs - 1; }

// The inputs a block of a group of `group` holds: the group, or its largest part of a multiple of kChunk up to
// kBlockMax.
int64_t block_of(int64_t group) {
  int64_t block = kChunk;
  for (int64_t b = kChunk; b <= std::min(group, kBlockMax); b += kChunk)
    if (group % b == 0) block = b;
  return block;
}

// A row of x as the kernel reads it: for each chunk, `Limbs` x 8 bytes (each limb's four bytes matching the low
// nibbles of a dword lane's bytes, inputs 0, 4, 1, 5 of the chunk, then the four matching the high nibbles, inputs
// 2, 6, 3, 7); for each block, 8 times the sum of its fixed-point inputs and the float32 2^(E - F) one of them is.
template <int Limbs>
struct FixedRows {
  int64_t chunks = 0, blocks = 0;
  std::vector<int8_t> limbs;     // [rows, chunks, Limbs, 8]
  std::vector<int32_t> offsets;  // [rows, blocks]: 8 * sum of the block's fixed-point inputs
  std::vector<float> units;      // [rows, blocks]: 2^(E - F), or NaN where an input is not finite

  const int8_t* limbs_of(int64_t r) const { return limbs.data() + r * chunks * Limbs * kChunk; }
  const int32_t* offsets_of(int64_t r) const { return offsets.data() + r * blocks; }
  const float* units_of(int64_t r) const { return units.data() + r * blocks; }
};

// 16 fixed-point inputs (two chunks) in the order of a limb's bytes: lane p of a chunk takes its input
// 0, 4, 1, 5, 2, 6, 3, 7 (p = 0..7).
DB_TARGET inline __m512i byte_order(__m512i fixed) {
  return _mm512_permutexvar_epi32(_mm512_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7, 8, 12, 9, 13, 10, 14, 11, 15), fixed);
}

// The 8 bytes of each of the `chunks` (1 or 2) chunks in `bytes` written to `to` and `to` + `stride`.
DB_TARGET inline void store_limb(int8_t* to, __m128i bytes, int64_t chunks, int64_t stride) {
  _mm_storel_epi64(reinterpret_cast<__m128i*>(to), bytes);
  if (chunks == 2) _mm_storel_epi64(reinterpret_cast<__m128i*>(to + stride), _mm_unpackhi_epi64(bytes, bytes));
}

// 2^e as a float32, for e from -149 to 127 (below -126 a subnormal one).
inline float power_of_two(int e) {
  const uint32_t bits = e >= -126 ? static_cast<uint32_t>(e + 127) << 23 : uint32_t(1) << (e + 149);
  float value;
  std::memcpy(&value, &bits, sizeof(value));
  return value;
}

// x [rows, in] bf16 in fixed point, `block` inputs a block, into `f` (kept by the calling thread, reused call to call).
template <int Limbs>
DB_TARGET void to_fixed(const at::Tensor& x, int64_t block, FixedRows<Limbs>& f) {
  constexpr int kFraction = fraction_of(Limbs);
  const int64_t rows = x.size(0), in = x.size(1);
  f.chunks = in / kChunk;
  f.blocks = in / block;
  f.limbs.resize(rows * f.chunks * Limbs * kChunk);
  f.offsets.resize(rows * f.blocks);
  f.units.resize(rows * f.blocks);
  const auto* xp = x.data_ptr<c10::BFloat16>();
  const __m512i exponent_bits = _mm512_set1_epi32(0x7F800000);  // all ones: an infinity or a NaN
  const __m512i seven = _mm512_set1_epi32(127);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t b = 0; b < f.blocks; ++b) {
      const c10::BFloat16* v = xp + r * in + b * block;
      __m512 largest = _mm512_setzero_ps();
      __mmask16 not_finite = 0;
      for (int64_t i = 0; i < block; i += kTile) {
        const __m512 value = widen(v + i, block - i);
        const __m512i bits = _mm512_and_si512(_mm512_castps_si512(value), exponent_bits);
        not_finite |= _mm512_cmpeq_epi32_mask(bits, exponent_bits);
        largest = _mm512_max_ps(largest, _mm512_abs_ps(value));
      }
      // E from the largest's exponent bits (-127 where it is subnormal or zero: its inputs then fit in 2^(E - F) too)
      const int exponent = (_mm512_reduce_max_epi32(_mm512_castps_si512(largest)) >> 23) - 127;
      f.units[r * f.blocks + b] =
          not_finite ? std::numeric_limits<float>::quiet_NaN() : power_of_two(exponent - kFraction);
      // 2^(F - E) in two factors (it reaches 2^147), each exact: a power of 2 times a bf16 value
      const __m512 half_way = _mm512_set1_ps(power_of_two((kFraction - exponent) / 2));
      const __m512 rest = _mm512_set1_ps(power_of_two(kFraction - exponent - (kFraction - exponent) / 2));
      __m512i sum = _mm512_setzero_si512();
      for (int64_t i = 0; i < block; i += kTile) {
        const __m512 scaled = _mm512_mul_ps(_mm512_mul_ps(widen(v + i, block - i), half_way), rest);
        const __m512i fixed = byte_order(_mm512_cvtps_epi32(scaled));
        sum = _mm512_add_epi32(sum, fixed);
        const int64_t chunks = std::min<int64_t>(2, (block - i) / kChunk);
        int8_t* to = f.limbs.data() + ((r * f.chunks + (b * block + i) / kChunk) * Limbs) * kChunk;
        constexpr int64_t stride = Limbs * kChunk;
        constexpr int top = kLimbBits * (Limbs - 1);
        store_limb(to, _mm512_cvtepi32_epi8(_mm512_srai_epi32(fixed, top)), chunks, stride);  // signed, -128..127
        for (int l = 1; l < Limbs; ++l) {
          const __m512i limb = _mm512_and_si512(_mm512_srli_epi32(fixed, top - kLimbBits * l), seven);
          store_limb(to + l * kChunk, _mm512_cvtepi32_epi8(limb), chunks, stride);
        }
      }
      f.offsets[r * f.blocks + b] = 8 * _mm512_reduce_add_epi32(sum);
    }
  }
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

// sum += the unsigned bytes of `levels` times the four signed bytes at `four` (a limb's, broadcast to every lane),
// four products to a lane. Written as the instruction with its broadcast folded in: GCC 12 compiled the intrinsic over
// a separate broadcast and copied every sum to another register and back around it (12 register copies a chunk at one
// row and one tile); this form read one step's int4 products 3 % faster (25.3 against 24.5 GB/s, a scratch script
// calling E2B's 212 products in sequence, two threads, the best of five rounds of the two forms alternated in one
// process).
DB_TARGET inline void add_products(__m512i& sum, __m512i levels, const int8_t* four) {
  __asm__("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(sum) : "v"(levels), "m"(*reinterpret_cast<const int32_t*>(four)));
}

constexpr int64_t kRows = 4;  // rows of x computed per pass over two tiles

// `Rows` rows of x (fixed point, `x`) times `Tiles` adjacent tiles (each `tile_words` and `tile_scales` apart): 16
// outputs a tile of each row written to y (rows `ldy` apart), the first `valid` of the last tile's (a weight's last
// tile may be partial).
template <int Rows, int Tiles, Hint H, int Limbs, typename Scale>
DB_TARGET void tile_rows(const uint16_t* words, int64_t tile_words, const Scale* scales, int64_t tile_scales,
                         const FixedRows<Limbs>& x, int64_t row, int64_t group, int64_t block, c10::BFloat16* y,
                         int64_t ldy, int64_t valid) {
  const __m512i low = _mm512_set1_epi8(0x0F);
  // the low- and high-nibble products keep their own sums where too few rows and tiles keep vpdpbusd busy
  constexpr int Halves = Rows * Tiles <= 2 ? 2 : 1;
  constexpr int64_t ahead = kPrefetchBytes / sizeof(uint16_t);
  const int8_t* limbs[Rows];
  const int32_t* offsets[Rows];
  const float* units[Rows];
  for (int r = 0; r < Rows; ++r) {
    limbs[r] = x.limbs_of(row + r);
    offsets[r] = x.offsets_of(row + r);
    units[r] = x.units_of(row + r);
  }
  __m512 acc[Rows][Tiles];
  for (int r = 0; r < Rows; ++r)
    for (int t = 0; t < Tiles; ++t) acc[r][t] = _mm512_setzero_ps();
  const int64_t chunks = block / kChunk;
  for (int64_t k0 = 0, b = 0; k0 < x.chunks * kChunk; k0 += group, scales += kTile) {
    __m512 in_group[Rows][Tiles];
    for (int r = 0; r < Rows; ++r)
      for (int t = 0; t < Tiles; ++t) in_group[r][t] = _mm512_setzero_ps();
    for (int64_t k = k0; k < k0 + group; k += block, ++b) {
      __m512i sums[Rows][Tiles][Limbs][Halves];
      for (int r = 0; r < Rows; ++r)
        for (int t = 0; t < Tiles; ++t)
          for (int l = 0; l < Limbs; ++l)
            for (int h = 0; h < Halves; ++h) sums[r][t][l][h] = _mm512_setzero_si512();
      for (int64_t c = k / kChunk; c < k / kChunk + chunks; ++c, words += kWords) {
        __m512i nibbles[Tiles][2];
        for (int t = 0; t < Tiles; ++t) {
          prefetch<H>(words + t * tile_words + ahead);
          const __m512i packed = _mm512_loadu_si512(words + t * tile_words);
          nibbles[t][0] = _mm512_and_si512(packed, low);
          nibbles[t][1] = _mm512_and_si512(_mm512_srli_epi16(packed, 4), low);
        }
        for (int r = 0; r < Rows; ++r) {
          const int8_t* limb = limbs[r] + c * Limbs * kChunk;
          for (int l = 0; l < Limbs; ++l)
            for (int n = 0; n < 2; ++n) {
              for (int t = 0; t < Tiles; ++t)
                add_products(sums[r][t][l][n % Halves], nibbles[t][n], limb + l * kChunk + 4 * n);
            }
        }
      }
      for (int r = 0; r < Rows; ++r) {
        const __m512i offset = _mm512_set1_epi32(offsets[r][b]);
        const __m512 unit = _mm512_set1_ps(units[r][b]);
        for (int t = 0; t < Tiles; ++t) {
          // ((top * 2^7 + next) * 2^7 + ...) - 8 * sum: exact in int32 (wrapping on the way, not at the end)
          __m512i total = _mm512_setzero_si512();
          for (int l = 0; l < Limbs; ++l) {
            __m512i limb_sum = sums[r][t][l][0];
            if constexpr (Halves == 2) limb_sum = _mm512_add_epi32(limb_sum, sums[r][t][l][1]);
            total = _mm512_add_epi32(_mm512_slli_epi32(total, kLimbBits), limb_sum);
          }
          total = _mm512_sub_epi32(total, offset);
          in_group[r][t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(total), unit, in_group[r][t]);
        }
      }
    }
    for (int t = 0; t < Tiles; ++t) {
      const __m512 s = load_scales(scales + t * tile_scales);
      for (int r = 0; r < Rows; ++r) acc[r][t] = _mm512_fmadd_ps(in_group[r][t], s, acc[r][t]);
    }
  }
  for (int r = 0; r < Rows; ++r)
    for (int t = 0; t < Tiles; ++t) store_tile(y + r * ldy + t * kTile, acc[r][t], t == Tiles - 1 ? valid : kTile);
}

template <int Limbs, typename Scale>
void all_rows(const at::Tensor& x, const at::Tensor& words, const at::Tensor& scales, int64_t group, at::Tensor& y) {
  const int64_t rows = x.size(0), in = x.size(1), out = y.size(1), tiles = words.size(0);
  const int64_t block = block_of(group);
  // the calling thread's, reused call to call; the threads of each_pass read it through this reference (a lambda
  // that named the thread_local itself would read its own thread's)
  static thread_local FixedRows<Limbs> kept;
  to_fixed(x, block, kept);
  const FixedRows<Limbs>& fixed = kept;
  const auto* wp = reinterpret_cast<const uint16_t*>(words.data_ptr<int16_t>());
  const auto* sp = scales.data_ptr<Scale>();
  auto* yp = y.data_ptr<c10::BFloat16>();
  const int64_t tile_words = in / kChunk * kWords, tile_scales = in / group * kTile;
  each_pass<kRows>(tiles, rows, out, [&]<int R, int T, Hint H>(int64_t u, int64_t r, int64_t valid) {
    tile_rows<R, T, H>(wp + u * tile_words, tile_words, sp + u * tile_scales, tile_scales, fixed, r, group, block,
                       yp + r * out + u * kTile, out, valid);
  });
}

template <typename Scale>
void all_rows_in(int64_t limbs, const at::Tensor& x, const at::Tensor& words, const at::Tensor& scales, int64_t group,
                 at::Tensor& y) {
  if (limbs == 2) {
    all_rows<2, Scale>(x, words, scales, group, y);
  } else {
    all_rows<3, Scale>(x, words, scales, group, y);
  }
}

at::Tensor int4_rows(const at::Tensor& x, const at::Tensor& words, const at::Tensor& scales, int64_t group,
                     int64_t out_features, int64_t limbs) {
  TORCH_CHECK(cpu_has_kernels(), "decodebench_int4::int4_rows needs ", kInstructionSets, "; this CPU lacks one");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16, "x: [rows, in] bfloat16, got ", x.sizes(), " ",
              x.scalar_type());
  TORCH_CHECK(group > 0 && group % kChunk == 0 && x.size(1) % group == 0, "group ", group,
              " must be a multiple of 8 dividing in_features ", x.size(1));
  TORCH_CHECK(limbs == 2 || limbs == 3, "limbs: 2 or 3 (7-bit limbs of each input's fixed point), got ", limbs);
  const int64_t tiles = (out_features + kTile - 1) / kTile;
  TORCH_CHECK(words.scalar_type() == at::kShort && words.is_contiguous() &&
                  words.sizes() == at::IntArrayRef({tiles, x.size(1) / kChunk, kWords}),
              "words: [", tiles, ", ", x.size(1) / kChunk, ", 32] int16 contiguous, got ", words.sizes());
  TORCH_CHECK(scales.is_contiguous() && scales.sizes() == at::IntArrayRef({tiles, x.size(1) / group, kTile}),
              "scales: [", tiles, ", ", x.size(1) / group, ", 16] contiguous, got ", scales.sizes());
  const at::Tensor rows = x.contiguous();
  at::Tensor y = output_for(x, out_features);
  switch (scales.scalar_type()) {
    case at::kHalf: all_rows_in<c10::Half>(limbs, rows, words, scales, group, y); break;
    case at::kBFloat16: all_rows_in<c10::BFloat16>(limbs, rows, words, scales, group, y); break;
    case at::kFloat: all_rows_in<float>(limbs, rows, words, scales, group, y); break;
    default: TORCH_CHECK(false, "scales in float16, bfloat16 or float32, got ", scales.scalar_type());
  }
  return y;
}

bool supported() { return cpu_has_kernels(); }

}  // namespace

TORCH_LIBRARY(decodebench_int4, m) {
  m.def("int4_rows(Tensor x, Tensor words, Tensor scales, int group, int out_features, int limbs) -> Tensor");
  m.def("supported() -> bool", &supported);
  m.def("threads() -> int", &threads_used);
  m.def("prefetch_hint() -> str", [] { return std::string(prefetch_hint_name()); });
  m.def("use_prefetch_hint(str hint) -> ()", &use_prefetch_hint);
}

TORCH_LIBRARY_IMPL(decodebench_int4, CPU, m) { m.impl("int4_rows", &int4_rows); }
