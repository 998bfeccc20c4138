// What the project's CPU row kernels (int4_rows.cpp, bf16_rows.cpp) share: the instruction set they are compiled
// for, the check that this CPU has it, the tile of outputs a float32 vector holds, the prefetch, a pair of bf16 inputs
// broadcast to every lane (the second operand of vdpbf16ps), the store of a tile's sums, and the passes over tiles
// and rows that the threads share (each_pass).
#pragma once

#include <ATen/EmptyTensor.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <string>

namespace decodebench {

constexpr int64_t kTile = 16;  // outputs in a tile: one float32 lane each
// Bytes ahead of the ones being read that each 64 bytes ask the cache for (16 KiB). Timed on one core (the library
// was then built without OpenMP, see engines/cpu_kernels.py): the hardware prefetcher alone
// left a one-row int4 product over lm_head (226 MB) at 31-34 GB/s on a 2-core AMD EPYC whose streaming read is
// ~50 GB/s; 1, 4, 8, 16 and 32 KiB ahead (_MM_HINT_T0) gave 33, 40-45, 46-46.5, 44-46 and 46 GB/s there.
constexpr int64_t kPrefetchBytes = 16384;

// The cache level a prefetch asks for (`prefetch_hint`): the machine's, timed once on cold weights and set through
// `use_prefetch_hint` when the library is loaded (engines/prefetch.py), since no rule by vendor held. On the 2-core AMD
// EPYC (Zen 5) one bf16 row over 30 cold copies of a layer's MLP weights read 32-39 GB/s with T0 and 40-44 with NTA
// (the non-temporal hint: the weights are read once a step and should push nothing else out of the caches; lm_head
// 37-40 either way), the int4 product's layer shapes 10-15% faster. On a 2-core Xeon with AMX (streaming read 24-27
// GB/s) NTA starved both kernels: one row over lm_head (cold, two threads) read 11.0 GB/s (bf16) and 8.7 (int4) with
// NTA 16 KiB ahead, 22.9 and 12.4 with no software prefetch, 27.3 and 24.7 with T0 (T1 and T2 within 10% of T0; T0 8
// and 16 KiB ahead the best, 32 KiB 10-15% slower). On a 2-core AMD EPYC (Zen 4) the int4 product (three limbs) over
// cold copies of 12288 x 1536 read 36.2 GB/s with T0 and T1 and 28.5 with NTA, stream read 41 (27.3 and 23.8 at a read
// of 27), its bf16 product within 5% either way. Until it is set: NTA on AMD, T0 elsewhere.
enum class Hint { kNta, kT0 };

inline std::atomic<Hint>& chosen_hint() {
  static std::atomic<Hint> hint{[] {
    __builtin_cpu_init();
    return __builtin_cpu_is("amd") ? Hint::kNta : Hint::kT0;
  }()};
  return hint;
}

inline Hint prefetch_hint() { return chosen_hint().load(std::memory_order_relaxed); }

// Bytes ahead of the ones being read that a second prefetch asks L2 for, where the hint is T0 (64 KiB). On the 2-core
// KVM Xeon with the weights in 2 MiB pages (decodebench/pages.py; its streaming read 30-37 GB/s) one bf16 row over
// cold copies of E2B's shapes read 24-25 GB/s (2048 x 1536: 18-21) with T0 16 KiB ahead alone, and 25-31 (24-26)
// with T1 64 KiB ahead beside it, three rounds alternated; the int4 product, bound by its arithmetic there, 21-23
// either way. T1 alone 64 KiB ahead: 21-26; T0 4 KiB or T1 128 KiB beside it: no better.
constexpr int64_t kFarBytes = 65536;

// Asks the cache for the 64 bytes at p (kPrefetchBytes ahead of the read), with the hint H; with T0, L2 also for the
// 64 bytes kFarBytes ahead of the read.
template <Hint H>
inline void prefetch(const void* p) {
  const char* at = reinterpret_cast<const char*>(p);
  if constexpr (H == Hint::kNta) {
    _mm_prefetch(at, _MM_HINT_NTA);
  } else {
    _mm_prefetch(at, _MM_HINT_T0);
    _mm_prefetch(at + (kFarBytes - kPrefetchBytes), _MM_HINT_T1);
  }
}

// The instruction sets the kernels are compiled for (every CPU with AVX-512 BF16 so far also has VNNI, which the int4
// product's integer dot products need), and the check that this CPU has them.
#define DB_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16,avx512vnni")))
constexpr const char* kInstructionSets = "AVX-512 F, BW, VL, BF16 and VNNI";

inline bool cpu_has_kernels() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512bf16") &&
         __builtin_cpu_supports("avx512vnni");
}

// x[0] and x[1] in each of the 16 lanes.
DB_TARGET inline __m512i pair_of(const c10::BFloat16* x) {
  int32_t bits;
  std::memcpy(&bits, x, sizeof(bits));
  return _mm512_set1_epi32(bits);
}

// The first `valid` of a vector's 16 lanes.
inline __mmask16 first_lanes(int64_t valid) {
  return valid >= kTile ? __mmask16(0xFFFF) : __mmask16((1u << valid) - 1);
}

// The first `valid` of a tile's 16 float32 sums rounded once to bf16 and written to y.
DB_TARGET inline void store_tile(c10::BFloat16* y, __m512 sums, int64_t valid) {
  _mm256_mask_storeu_epi16(y, first_lanes(valid), (__m256i)_mm512_cvtneps_pbh(sums));
}

// 16 bf16 values at x (the first `valid`, the rest 0) widened exactly to float32.
DB_TARGET inline __m512 widen(const c10::BFloat16* x, int64_t valid = kTile) {
  const __m256i half = _mm256_maskz_loadu_epi16(first_lanes(valid), x);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16));
}

// v rounded to bf16 (as store_tile rounds) and widened back: what an eager bf16 operator's result holds.
DB_TARGET inline __m512 rounded(__m512 v) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(v)), 16));
}

// A product's [rows, out_features] output in x's dtype, allocated straight from the CPU allocator: at::empty is an
// operator, a trip through the dispatcher (and a profiler event) for each of a decode step's ~280 products.
inline at::Tensor output_for(const at::Tensor& x, int64_t out_features) {
  return at::detail::empty_cpu({x.size(0), out_features}, x.options());
}

// Independent sums each output lane of a pass over `Rows` rows and `Tiles` tiles keeps, so that some sixteen
// vdpbf16ps are always in flight.
template <int Rows, int Tiles>
constexpr int kParts = Rows * Tiles >= 16 ? 1 : (16 + Rows * Tiles - 1) / (Rows * Tiles);

// Tiles a pass of four rows or more reads side by side: each broadcast pair of a row's inputs then feeds two
// vdpbf16ps instead of one. With one tile and eight sums in flight, passes of four and eight rows stayed near 0.35-0.39
// TFLOP/s on one core of a 2-core AMD EPYC (Zen 5: two vdpbf16ps a cycle, ~0.53 TFLOP/s a core); two tiles and
// sixteen sums gave 0.45-0.5, that core's peak. A pass of fewer rows is bound by memory and reads one tile at a time
// (one stream a thread).
constexpr int64_t kTilesAtOnce = 2;

// fn.template operator()<T>(u) over the tiles [t, end) (at most kTilesAtOnce): all at once for passes of four rows
// or more, one by one (T = 1) for fewer.
template <int Rows, typename Fn>
inline void over_tiles(int64_t t, int64_t end, Fn&& fn) {
  if (Rows >= 4 && end - t == 2) {
    fn.template operator()<2>(t);
  } else {
    for (int64_t u = t; u < end; ++u) fn.template operator()<1>(u);
  }
}

// fn.template operator()<R>() for R = min(8, rows): the row count as a compile-time constant (callers pass at most
// the rows a pass takes).
template <typename Fn>
inline void with_rows(int64_t rows, Fn&& fn) {
  switch (rows >= 8 ? 8 : rows) {
    case 8: fn.template operator()<8>(); break;
    case 7: fn.template operator()<7>(); break;
    case 6: fn.template operator()<6>(); break;
    case 5: fn.template operator()<5>(); break;
    case 4: fn.template operator()<4>(); break;
    case 3: fn.template operator()<3>(); break;
    case 2: fn.template operator()<2>(); break;
    default: fn.template operator()<1>();
  }
}

// fn.template operator()<R, T, H>(u, r, valid) for every pass of a product with `out` outputs in `tiles` tiles over
// `rows` rows: R rows (at most MaxRows) from row r times T tiles from tile u, `valid` outputs of its last tile,
// prefetching with this CPU's hint H. The threads share the tiles kTilesAtOnce at a time, each taking every row over
// them.
template <int64_t MaxRows, typename Fn>
inline void each_pass(int64_t tiles, int64_t rows, int64_t out, Fn&& fn) {
  const int64_t blocks = (tiles + kTilesAtOnce - 1) / kTilesAtOnce;
  auto passes = [&]<Hint H>() {
    at::parallel_for(0, blocks, 1, [&](int64_t first, int64_t last) {
      for (int64_t b = first; b < last; ++b) {
        const int64_t t = b * kTilesAtOnce, end = std::min(tiles, t + kTilesAtOnce);
        for (int64_t r = 0; r < rows; r += MaxRows) {
          with_rows(std::min(MaxRows, rows - r), [&]<int R>() {
            over_tiles<R>(t, end, [&]<int T>(int64_t u) {
              fn.template operator()<R, T, H>(u, r, std::min(kTile, out - (u + T - 1) * kTile));
            });
          });
        }
      }
    });
  };
  if (prefetch_hint() == Hint::kNta) {
    passes.template operator()<Hint::kNta>();
  } else {
    passes.template operator()<Hint::kT0>();
  }
}

// The hint's name, for the evidence: "nta", or "t0+t1" (T0 kPrefetchBytes ahead, T1 kFarBytes ahead).
inline const char* prefetch_hint_name() { return prefetch_hint() == Hint::kNta ? "nta" : "t0+t1"; }

// Sets the hint every kernel of the library prefetches with from now on, by its name (`prefetch_hint_name`).
inline void use_prefetch_hint(const std::string& name) {
  TORCH_CHECK(name == "nta" || name == "t0+t1", "prefetch hint: nta or t0+t1, got ", name);
  chosen_hint().store(name == "nta" ? Hint::kNta : Hint::kT0, std::memory_order_relaxed);
}

// The threads each_pass's parallel_for runs on when it has 64 blocks to share: the library's check that it was built
// with OpenMP (without it, ATen's inline parallel_for runs every block on the calling thread, and the kernels read
// the weights with one core whatever torch's thread count).
inline int64_t threads_used() {
  std::atomic<uint64_t> seen{0};
  at::parallel_for(0, 64, 1, [&](int64_t, int64_t) { seen |= uint64_t(1) << (at::get_thread_num() % 64); });
  return __builtin_popcountll(seen.load());
}

}  // namespace decodebench
