// The ATen operations decodebench's Rust model uses, as extern "C" functions over owned handles.
// Every entry point catches C++ exceptions: it returns null (or -1) and leaves the message for
// `db_last_error`, so no exception ever unwinds into Rust.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/InferenceMode.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/version.h>

#include <exception>
#include <string>

using at::Tensor;
using T = Tensor*;

namespace {
thread_local std::string last_error;

template <class F>
T guarded(F&& f) noexcept {
  try {
    return new Tensor(f());
  } catch (const std::exception& e) {
    last_error = e.what();
  } catch (...) {
    last_error = "unknown C++ exception";
  }
  return nullptr;
}

template <class F>
int status(F&& f) noexcept {
  try {
    f();
    return 0;
  } catch (const std::exception& e) {
    last_error = e.what();
  } catch (...) {
    last_error = "unknown C++ exception";
  }
  return -1;
}

at::IntArrayRef dims(const int64_t* d, int64_t n) { return at::IntArrayRef(d, static_cast<size_t>(n)); }

// The project's CPU kernels (engines/csrc/), found by name in ATen's dispatcher, where the library the Python side
// loads (engines/cpu_kernels.py) registered them: the operators the PyTorch engines call. Their weights are packed
// once at load on the Python side (engines/int4_cpu.py, engines/bf16_cpu.py: `pack`).
using Int4Rows = Tensor(const Tensor&, const Tensor&, const Tensor&, int64_t, int64_t, int64_t);
using Bf16Rows = Tensor(const Tensor&, const Tensor&, int64_t);
using OneQuery = Tensor(const Tensor&, const Tensor&, const Tensor&, const Tensor&, double);
using RmsNorm = Tensor(const Tensor&, const std::optional<Tensor>&, double);
using RmsRope = Tensor(const Tensor&, const std::optional<Tensor>&, double, const Tensor&, const Tensor&);
using FirstMax = Tensor(const Tensor&);
using AddRms = Tensor(const Tensor&, const Tensor&, const std::optional<Tensor>&, double, const std::optional<Tensor>&);
using GeluMul = Tensor(const Tensor&, const Tensor&);

template <class Signature>
c10::TypedOperatorHandle<Signature> kernel(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Signature>();
}

// x [..., in] times a weight with `out` outputs, through `rows` [n, in] -> [n, out]: x's leading dimensions kept.
template <class F>
Tensor by_rows(const Tensor& x, int64_t out, F&& rows) {
  auto sizes = x.sizes().vec();
  sizes.back() = out;
  return rows(x.reshape({-1, x.size(-1)})).view(sizes);
}
}  // namespace

extern "C" {
const char* db_last_error() { return last_error.c_str(); }
const char* db_torch_version() { return TORCH_VERSION; }
void db_free(T t) { delete t; }

// Python crossings (GIL held). Both directions share storage.
T db_from_python(PyObject* o) {
  if (!THPVariable_Check(o)) {
    last_error = "expected a torch.Tensor";
    return nullptr;
  }
  return guarded([&] { return THPVariable_Unpack(o); });
}
PyObject* db_to_python(T t) { return THPVariable_Wrap(*t); }

// c10::InferenceMode on the calling thread until db_inference_mode_end gets the guard back (on that thread, guards
// ended in the reverse order they began): every operator skips autograd's dispatch and bookkeeping (version counters,
// view records) and makes inference tensors. Nothing here throws but the allocation (noexcept: that ends the process).
void* db_inference_mode() noexcept { return new c10::InferenceMode(); }
void db_inference_mode_end(void* guard) { delete static_cast<c10::InferenceMode*>(guard); }

// Arithmetic
// one_row_mv: a single row (a decode step) goes through at::mv, ATen's matrix-vector kernel, instead of
// at::linear (oneDNN's matrix product on a CPU): the same products, the weights read faster (engines/one_row.py).
T db_linear(T x, T w, int one_row_mv) {
  return guarded([&] {
    if (one_row_mv && x->numel() == x->size(-1)) {
      auto sizes = x->sizes().vec();
      sizes.back() = w->size(0);
      return at::mv(*w, x->reshape({-1})).view(sizes);
    }
    return at::linear(*x, *w);
  });
}

// x @ w.T for a weight held 4-bit: decodebench_int4::int4_rows (engines/csrc/int4_rows.cpp).
T db_int4_linear(T x, T words, T scales, int64_t group, int64_t out, int64_t limbs) {
  return guarded([&] {
    static const auto op = kernel<Int4Rows>("decodebench_int4::int4_rows");
    return by_rows(*x, out, [&](const Tensor& rows) { return op.call(rows, *words, *scales, group, out, limbs); });
  });
}

// x @ w.T for a bf16 weight packed in tiles of 16 outputs: decodebench_bf16::bf16_rows (engines/csrc/bf16_rows.cpp).
T db_bf16_rows(T x, T packed, int64_t out) {
  return guarded([&] {
    static const auto op = kernel<Bf16Rows>("decodebench_bf16::bf16_rows");
    return by_rows(*x, out, [&](const Tensor& rows) { return op.call(rows, *packed, out); });
  });
}

T db_add(T a, T b) { return guarded([&] { return at::add(*a, *b); }); }
T db_sub(T a, T b) { return guarded([&] { return at::sub(*a, *b); }); }
T db_mul(T a, T b) { return guarded([&] { return at::mul(*a, *b); }); }
T db_mul_scalar(T a, double s) { return guarded([&] { return at::mul(*a, s); }); }
T db_add_scalar(T a, double s) { return guarded([&] { return at::add(*a, s); }); }
T db_add_i64(T a, int64_t s) { return guarded([&] { return at::add(*a, s); }); }
T db_div_scalar(T a, double s) { return guarded([&] { return at::div(*a, s); }); }
T db_to_device_of(T a, T like) { return guarded([&] { return a->to(like->device()); }); }
T db_pow_scalar(T a, double e) { return guarded([&] { return at::pow(*a, e); }); }
T db_mean_last(T a) { return guarded([&] { return a->mean(-1, true); }); }
T db_neg(T a) { return guarded([&] { return at::neg(*a); }); }
T db_tanh(T a) { return guarded([&] { return at::tanh(*a); }); }
T db_gelu_tanh(T a) { return guarded([&] { return at::gelu(*a, "tanh"); }); }
T db_cos(T a) { return guarded([&] { return at::cos(*a); }); }
T db_sin(T a) { return guarded([&] { return at::sin(*a); }); }
T db_remainder(T a, int64_t m) { return guarded([&] { return at::remainder(*a, m); }); }
T db_argmax_last(T a) { return guarded([&] { return a->argmax(-1, true); }); }

// Types and shapes
T db_to_float(T a) { return guarded([&] { return a->to(at::kFloat); }); }
T db_to_like(T a, T like) { return guarded([&] { return a->to(like->scalar_type()); }); }
T db_reshape(T a, const int64_t* d, int64_t n) { return guarded([&] { return a->reshape(dims(d, n)); }); }
T db_repeat(T a, const int64_t* d, int64_t n) { return guarded([&] { return a->repeat(dims(d, n)); }); }
T db_expand(T a, const int64_t* d, int64_t n) { return guarded([&] { return a->expand(dims(d, n)); }); }
T db_transpose(T a, int64_t d0, int64_t d1) { return guarded([&] { return a->transpose(d0, d1); }); }
T db_narrow(T a, int64_t dim, int64_t start, int64_t len) { return guarded([&] { return a->narrow(dim, start, len); }); }
T db_select(T a, int64_t dim, int64_t index) { return guarded([&] { return a->select(dim, index); }); }
T db_unsqueeze(T a, int64_t dim) { return guarded([&] { return a->unsqueeze(dim); }); }
T db_cat2(T a, T b, int64_t dim) { return guarded([&] { return at::cat({*a, *b}, dim); }); }

// Indexing
T db_index_select(T t, int64_t dim, T idx) { return guarded([&] { return at::index_select(*t, dim, *idx); }); }
// Rows `ids` of a table held 4-bit as the checkpoint stores it: int32 words [rows, cols/8] of level + 8, low nibble
// first, and one scale per `group` columns; unpacked in float32 (level times scale, exact) and rounded once to the
// dtype of `like`, as engines/int4.py's Int4Embedding does.
T db_int4_lookup(T packed, T scale, T ids, int64_t group, int64_t cols, T like) {
  return guarded([&] {
    const int64_t n = ids->numel();
    auto words = packed->index_select(0, *ids).unsqueeze(-1);
    auto shifts = at::arange(0, 32, 4, words.options());
    auto levels = words.bitwise_right_shift(shifts).bitwise_and(15).to(at::kFloat).sub(8);
    auto scales = scale->index_select(0, *ids).to(at::kFloat).unsqueeze(-1);
    return levels.view({n, -1, group}).mul(scales).view({n, cols}).to(like->scalar_type());
  });
}

// Rows `ids` of a bf16 weight packed for bf16_rows ([tiles, in/2, 16, 2]): a table tied to that weight, held once
// (engines/bf16_cpu.py, `row_of`).
T db_packed_rows(T packed, T ids) {
  return guarded([&] {
    using at::indexing::Slice;
    auto picked = packed->index({ids->div(16, "floor"), Slice(), ids->remainder(16)});  // [n, in/2, 2]
    return picked.reshape({ids->numel(), -1});
  });
}
int db_index_copy_(T t, int64_t dim, T idx, T src) { return status([&] { t->index_copy_(dim, *idx, *src); }); }
int db_fill_(T t, double v) { return status([&] { t->fill_(v); }); }

// Comparisons and masks
T db_ge_scalar(T a, double s) { return guarded([&] { return at::ge(*a, s); }); }
T db_le(T a, T b) { return guarded([&] { return at::le(*a, *b); }); }
T db_lt_scalar(T a, double s) { return guarded([&] { return at::lt(*a, s); }); }
T db_logical_and(T a, T b) { return guarded([&] { return at::logical_and(*a, *b); }); }
T db_where(T c, T a, T b) { return guarded([&] { return at::where(*c, *a, *b); }); }

// Factories, on the device and with the dtype of `like` unless the name says int64
T db_arange_i64(int64_t n, T like) { return guarded([&] { return at::arange(n, like->options().dtype(at::kLong)); }); }
T db_full_i64(int64_t n, int64_t v, T like) { return guarded([&] { return at::full({n}, v, like->options().dtype(at::kLong)); }); }
T db_zeros(const int64_t* d, int64_t n, T like) { return guarded([&] { return at::zeros(dims(d, n), like->options()); }); }
T db_from_i64s(const int64_t* data, int64_t n, T like) {
  return guarded([&] {
    auto host = at::from_blob(const_cast<int64_t*>(data), {n}, at::TensorOptions().dtype(at::kLong)).clone();
    return host.to(like->device());
  });
}
// Reads an int64 tensor to the host (waits for the device): the only way tokens leave it.
int db_to_i64s(T t, int64_t* out, int64_t n) {
  return status([&] {
    auto host = t->to(at::kCPU).to(at::kLong).contiguous().reshape({-1});
    if (host.numel() != n) throw std::runtime_error("db_to_i64s: wrong length");
    std::memcpy(out, host.data_ptr<int64_t>(), n * sizeof(int64_t));
  });
}
int64_t db_numel(T t) { return t->numel(); }
int64_t db_nbytes(T t) { return static_cast<int64_t>(t->nbytes()); }
int64_t db_size(T t, int64_t dim) { return t->size(dim); }

// Attention: softmax(q k^T * scale + mask) v, query heads grouped over the key/value heads.
// A decode step's attention: decodebench_attn::one_query (engines/csrc/one_query.cpp).
T db_one_query(T q, T k, T v, T keep, double scale) {
  return guarded([&] {
    static const auto op = kernel<OneQuery>("decodebench_attn::one_query");
    return op.call(*q, *k, *v, *keep, scale);
  });
}

// Gemma's RMS norm of bf16 rows (weight null: none) in one operator: decodebench_norm::rms (engines/csrc/rms_norm.cpp).
T db_rms(T x, T weight, double eps) {
  return guarded([&] {
    static const auto op = kernel<RmsNorm>("decodebench_norm::rms");
    return op.call(*x, weight ? std::optional<Tensor>(*weight) : std::nullopt, eps);
  });
}

// A q or k head's norm and then its rotary embedding in one operator: decodebench_norm::rms_rope (the same file).
T db_rms_rope(T x, T weight, double eps, T cos, T sin) {
  return guarded([&] {
    static const auto op = kernel<RmsRope>("decodebench_norm::rms_rope");
    return op.call(*x, weight ? std::optional<Tensor>(*weight) : std::nullopt, eps, *cos, *sin);
  });
}

// h + rms(x) (times weight), then times scale where given, in one operator: decodebench_norm::add_rms (the same file).
T db_add_rms(T h, T x, T weight, double eps, T scale) {
  return guarded([&] {
    static const auto op = kernel<AddRms>("decodebench_norm::add_rms");
    return op.call(*h, *x, weight ? std::optional<Tensor>(*weight) : std::nullopt, eps,
                   scale ? std::optional<Tensor>(*scale) : std::nullopt);
  });
}

// gelu_tanh(gate) * up in one operator: decodebench_act::gelu_mul (engines/csrc/gelu_mul.cpp).
T db_gelu_mul(T gate, T up) {
  return guarded([&] {
    static const auto op = kernel<GeluMul>("decodebench_act::gelu_mul");
    return op.call(*gate, *up);
  });
}

// The index of the first largest value along the last dim, kept as a dim of 1, as argmax(-1, true) gives it:
// decodebench_pick::first_max (engines/csrc/first_max.cpp), which reads a row with every thread and 16 values a vector.
T db_first_max(T x) {
  return guarded([&] {
    static const auto op = kernel<FirstMax>("decodebench_pick::first_max");
    return by_rows(*x, 1, [&](const Tensor& rows) { return op.call(rows); });
  });
}

T db_sdpa(T q, T k, T v, T mask, double scale) {
  return guarded([&] {
    return at::scaled_dot_product_attention(*q, *k, *v, *mask, 0.0, false, scale, /*enable_gqa=*/true);
  });
}
}
