// decodebench_read::stream: every byte of a tensor read once, front to back, 64 bytes a load, by torch's threads (each
// one contiguous part, as the products share their tiles) asking the cache ahead as the products do (rows.h,
// `prefetch`): the streaming read a CPU roofline divides by, beside torch's reductions (decodebench/device.py,
// measure_bandwidth). torch's sum and amax ask for nothing ahead: on the 2-core KVM Xeon with AMX (model 207) they
// read 22.4-22.7 GB/s over 1,040 MiB where bf16_rows, one row over a weight of the same bytes, read 27.1-28.4 (ten
// rounds alternated, 1.21-1.27x a round): a roofline over torch's figure put the dense ways above 100 %.
//
// Returns the XOR of the tensor's 64-bit words (a last partial word zero-padded), so that no load can be left out.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <atomic>
#include <cstring>

#include "rows.h"

namespace {

using namespace decodebench;

constexpr int64_t kLine = 64;               // bytes a load reads
constexpr int64_t kBlockLines = 1024;       // lines the threads share at a time (64 KiB)
constexpr int kSums = 4;                    // independent XORs in flight

// The XOR of the 64-bit words of `lines` lines from p, prefetching with hint H.
template <Hint H>
DB_TARGET uint64_t xor_lines(const char* p, int64_t lines) {
  __m512i sum[kSums];
  for (auto& s : sum) s = _mm512_setzero_si512();
  for (int64_t i = 0; i < lines; ++i) {
    const char* at = p + i * kLine;
    prefetch<H>(at + kPrefetchBytes);
    sum[i % kSums] = _mm512_xor_si512(sum[i % kSums], _mm512_loadu_si512(at));
  }
  alignas(64) uint64_t words[8];
  _mm512_store_si512(words, _mm512_xor_si512(_mm512_xor_si512(sum[0], sum[1]), _mm512_xor_si512(sum[2], sum[3])));
  uint64_t folded = 0;
  for (uint64_t w : words) folded ^= w;
  return folded;
}

template <Hint H>
uint64_t xor_all_lines(const char* p, int64_t lines) {
  std::atomic<uint64_t> folded{0};
  const int64_t blocks = (lines + kBlockLines - 1) / kBlockLines;
  at::parallel_for(0, blocks, 1, [&](int64_t first, int64_t last) {
    const int64_t begin = first * kBlockLines, end = std::min(lines, last * kBlockLines);
    folded ^= xor_lines<H>(p + begin * kLine, end - begin);
  });
  return folded.load();
}

at::Tensor stream(const at::Tensor& x) {
  TORCH_CHECK(cpu_has_kernels(), "decodebench_read::stream needs ", kInstructionSets, "; this CPU lacks one");
  TORCH_CHECK(x.is_contiguous(), "x: a contiguous tensor, got strides ", x.strides());
  const auto* p = static_cast<const char*>(x.data_ptr());
  const int64_t bytes = x.nbytes(), lines = bytes / kLine;
  uint64_t folded = prefetch_hint() == Hint::kNta ? xor_all_lines<Hint::kNta>(p, lines)
                                                  : xor_all_lines<Hint::kT0>(p, lines);
  uint64_t tail[kLine / 8] = {};  // the bytes after the last whole line, zero-padded to whole words
  if (bytes > lines * kLine) std::memcpy(tail, p + lines * kLine, bytes - lines * kLine);
  for (uint64_t w : tail) folded ^= w;
  int64_t value;
  std::memcpy(&value, &folded, sizeof(value));
  return at::scalar_tensor(value, at::kLong);
}

}  // namespace

TORCH_LIBRARY(decodebench_read, m) { m.def("stream(Tensor x) -> Tensor"); }

TORCH_LIBRARY_IMPL(decodebench_read, CPU, m) { m.impl("stream", &stream); }
