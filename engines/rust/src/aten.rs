//! Owned ATen tensors with PyTorch's method names, over the C++ shim in `csrc/aten.cpp`.
use std::ffi::CStr;
use std::os::raw::{c_char, c_int, c_void};

type Raw = *mut c_void;

extern "C" {
    fn db_last_error() -> *const c_char;
    fn db_torch_version() -> *const c_char;
    fn db_free(t: Raw);
    pub fn db_from_python(o: *mut pyo3::ffi::PyObject) -> Raw;
    pub fn db_to_python(t: Raw) -> *mut pyo3::ffi::PyObject;
    fn db_linear(x: Raw, w: Raw, one_row_mv: c_int) -> Raw;
    fn db_int4_linear(x: Raw, words: Raw, scales: Raw, group: i64, out: i64, limbs: i64) -> Raw;
    fn db_bf16_rows(x: Raw, packed: Raw, out: i64) -> Raw;
    fn db_packed_rows(packed: Raw, ids: Raw) -> Raw;
    fn db_int4_lookup(packed: Raw, scale: Raw, ids: Raw, group: i64, cols: i64, like: Raw) -> Raw;
    fn db_add(a: Raw, b: Raw) -> Raw;
    fn db_sub(a: Raw, b: Raw) -> Raw;
    fn db_mul(a: Raw, b: Raw) -> Raw;
    fn db_mul_scalar(a: Raw, s: f64) -> Raw;
    fn db_add_scalar(a: Raw, s: f64) -> Raw;
    fn db_add_i64(a: Raw, s: i64) -> Raw;
    fn db_div_scalar(a: Raw, s: f64) -> Raw;
    fn db_to_device_of(a: Raw, like: Raw) -> Raw;
    fn db_pow_scalar(a: Raw, e: f64) -> Raw;
    fn db_mean_last(a: Raw) -> Raw;
    fn db_neg(a: Raw) -> Raw;
    fn db_tanh(a: Raw) -> Raw;
    fn db_gelu_tanh(a: Raw) -> Raw;
    fn db_cos(a: Raw) -> Raw;
    fn db_sin(a: Raw) -> Raw;
    fn db_remainder(a: Raw, m: i64) -> Raw;
    fn db_argmax_last(a: Raw) -> Raw;
    fn db_to_float(a: Raw) -> Raw;
    fn db_to_like(a: Raw, like: Raw) -> Raw;
    fn db_reshape(a: Raw, d: *const i64, n: i64) -> Raw;
    fn db_repeat(a: Raw, d: *const i64, n: i64) -> Raw;
    fn db_expand(a: Raw, d: *const i64, n: i64) -> Raw;
    fn db_transpose(a: Raw, d0: i64, d1: i64) -> Raw;
    fn db_narrow(a: Raw, dim: i64, start: i64, len: i64) -> Raw;
    fn db_select(a: Raw, dim: i64, index: i64) -> Raw;
    fn db_unsqueeze(a: Raw, dim: i64) -> Raw;
    fn db_cat2(a: Raw, b: Raw, dim: i64) -> Raw;
    fn db_index_select(t: Raw, dim: i64, idx: Raw) -> Raw;
    fn db_index_copy_(t: Raw, dim: i64, idx: Raw, src: Raw) -> c_int;
    fn db_fill_(t: Raw, v: f64) -> c_int;
    fn db_ge_scalar(a: Raw, s: f64) -> Raw;
    fn db_le(a: Raw, b: Raw) -> Raw;
    fn db_lt_scalar(a: Raw, s: f64) -> Raw;
    fn db_logical_and(a: Raw, b: Raw) -> Raw;
    fn db_where(c: Raw, a: Raw, b: Raw) -> Raw;
    fn db_arange_i64(n: i64, like: Raw) -> Raw;
    fn db_full_i64(n: i64, v: i64, like: Raw) -> Raw;
    fn db_zeros(d: *const i64, n: i64, like: Raw) -> Raw;
    fn db_from_i64s(data: *const i64, n: i64, like: Raw) -> Raw;
    fn db_to_i64s(t: Raw, out: *mut i64, n: i64) -> c_int;
    fn db_numel(t: Raw) -> i64;
    fn db_nbytes(t: Raw) -> i64;
    fn db_size(t: Raw, dim: i64) -> i64;
    fn db_sdpa(q: Raw, k: Raw, v: Raw, mask: Raw, scale: f64) -> Raw;
    fn db_one_query(q: Raw, k: Raw, v: Raw, keep: Raw, scale: f64) -> Raw;
    fn db_rms(x: Raw, weight: Raw, eps: f64) -> Raw;
    fn db_first_max(x: Raw) -> Raw;
    fn db_rms_rope(x: Raw, weight: Raw, eps: f64, cos: Raw, sin: Raw) -> Raw;
    fn db_add_rms(h: Raw, x: Raw, weight: Raw, eps: f64, scale: Raw) -> Raw;
    fn db_gelu_mul(gate: Raw, up: Raw) -> Raw;
    fn db_inference_mode() -> Raw;
    fn db_inference_mode_end(guard: Raw);
}

/// An error raised by ATen, with its message.
#[derive(Debug, Clone)]
pub struct AtenError(pub String);
pub type Result<T> = std::result::Result<T, AtenError>;

fn last_error() -> AtenError {
    AtenError(unsafe { CStr::from_ptr(db_last_error()) }.to_string_lossy().into_owned())
}

pub fn torch_version() -> String {
    unsafe { CStr::from_ptr(db_torch_version()) }.to_string_lossy().into_owned()
}

/// ATen's inference mode (`c10::InferenceMode`) on the calling thread while this lives: the operators run without
/// autograd's dispatch and bookkeeping, and the tensors they make are inference tensors. Bound to its thread (a raw
/// pointer is neither `Send` nor `Sync`); guards end in the reverse order they began, as scopes end.
pub struct InferenceMode(Raw);

impl InferenceMode {
    pub fn begin() -> InferenceMode {
        InferenceMode(unsafe { db_inference_mode() })
    }
}

impl Drop for InferenceMode {
    fn drop(&mut self) {
        unsafe { db_inference_mode_end(self.0) }
    }
}

/// An owned `at::Tensor` handle.
pub struct Tensor(Raw);

// The handle is only ever used by the engine's one thread; `Send` lets the GIL be released around it.
unsafe impl Send for Tensor {}
unsafe impl Sync for Tensor {}

impl Drop for Tensor {
    fn drop(&mut self) {
        unsafe { db_free(self.0) }
    }
}

fn wrap(p: Raw) -> Result<Tensor> {
    if p.is_null() {
        Err(last_error())
    } else {
        Ok(Tensor(p))
    }
}

fn check(code: c_int) -> Result<()> {
    if code == 0 {
        Ok(())
    } else {
        Err(last_error())
    }
}

impl Tensor {
    pub fn raw(&self) -> Raw {
        self.0
    }
    /// # Safety
    /// `p` must be a handle returned by the shim, owned by nobody else.
    pub unsafe fn from_raw(p: Raw) -> Result<Tensor> {
        wrap(p)
    }
    /// `x @ w.T`; with `one_row_mv`, a single row through ATen's matrix-vector kernel.
    pub fn dense_linear(&self, w: &Tensor, one_row_mv: bool) -> Result<Tensor> {
        wrap(unsafe { db_linear(self.0, w.0, one_row_mv as c_int) })
    }
    /// `x @ w.T` for a weight packed for `decodebench_int4::int4_rows` with `out` outputs, `group` inputs a scale,
    /// x held in `limbs` limbs.
    pub fn int4_linear(&self, words: &Tensor, scales: &Tensor, group: i64, out: i64, limbs: i64) -> Result<Tensor> {
        wrap(unsafe { db_int4_linear(self.0, words.0, scales.0, group, out, limbs) })
    }
    /// `x @ w.T` for a bf16 weight packed for `decodebench_bf16::bf16_rows` with `out` outputs.
    pub fn bf16_rows(&self, packed: &Tensor, out: i64) -> Result<Tensor> {
        wrap(unsafe { db_bf16_rows(self.0, packed.0, out) })
    }
    /// Rows `ids` of a bf16 weight packed for `bf16_rows`, [n, in].
    pub fn packed_rows(packed: &Tensor, ids: &Tensor) -> Result<Tensor> {
        wrap(unsafe { db_packed_rows(packed.0, ids.0) })
    }
    /// Rows `ids` of a 4-bit table (the checkpoint's words and scales), [n, cols] in the dtype of `like`.
    pub fn int4_lookup(packed: &Tensor, scale: &Tensor, ids: &Tensor, group: i64, cols: i64, like: &Tensor) -> Result<Tensor> {
        wrap(unsafe { db_int4_lookup(packed.0, scale.0, ids.0, group, cols, like.0) })
    }
    pub fn add(&self, b: &Tensor) -> Result<Tensor> { wrap(unsafe { db_add(self.0, b.0) }) }
    pub fn sub(&self, b: &Tensor) -> Result<Tensor> { wrap(unsafe { db_sub(self.0, b.0) }) }
    pub fn mul(&self, b: &Tensor) -> Result<Tensor> { wrap(unsafe { db_mul(self.0, b.0) }) }
    pub fn mul_scalar(&self, s: f64) -> Result<Tensor> { wrap(unsafe { db_mul_scalar(self.0, s) }) }
    pub fn add_scalar(&self, s: f64) -> Result<Tensor> { wrap(unsafe { db_add_scalar(self.0, s) }) }
    pub fn add_i64(&self, s: i64) -> Result<Tensor> { wrap(unsafe { db_add_i64(self.0, s) }) }
    pub fn div_scalar(&self, s: f64) -> Result<Tensor> { wrap(unsafe { db_div_scalar(self.0, s) }) }
    pub fn to_device_of(&self, like: &Tensor) -> Result<Tensor> { wrap(unsafe { db_to_device_of(self.0, like.0) }) }
    pub fn pow_scalar(&self, e: f64) -> Result<Tensor> { wrap(unsafe { db_pow_scalar(self.0, e) }) }
    pub fn mean_last(&self) -> Result<Tensor> { wrap(unsafe { db_mean_last(self.0) }) }
    pub fn neg(&self) -> Result<Tensor> { wrap(unsafe { db_neg(self.0) }) }
    pub fn tanh(&self) -> Result<Tensor> { wrap(unsafe { db_tanh(self.0) }) }
    pub fn gelu_tanh(&self) -> Result<Tensor> { wrap(unsafe { db_gelu_tanh(self.0) }) }
    pub fn cos(&self) -> Result<Tensor> { wrap(unsafe { db_cos(self.0) }) }
    pub fn sin(&self) -> Result<Tensor> { wrap(unsafe { db_sin(self.0) }) }
    pub fn remainder(&self, m: i64) -> Result<Tensor> { wrap(unsafe { db_remainder(self.0, m) }) }
    pub fn argmax_last(&self) -> Result<Tensor> { wrap(unsafe { db_argmax_last(self.0) }) }
    pub fn to_float(&self) -> Result<Tensor> { wrap(unsafe { db_to_float(self.0) }) }
    pub fn to_like(&self, like: &Tensor) -> Result<Tensor> { wrap(unsafe { db_to_like(self.0, like.0) }) }
    pub fn reshape(&self, d: &[i64]) -> Result<Tensor> { wrap(unsafe { db_reshape(self.0, d.as_ptr(), d.len() as i64) }) }
    pub fn repeat(&self, d: &[i64]) -> Result<Tensor> { wrap(unsafe { db_repeat(self.0, d.as_ptr(), d.len() as i64) }) }
    /// A view with dims of size 1 broadcast to `d` (-1 keeps a dim), no copy.
    pub fn expand(&self, d: &[i64]) -> Result<Tensor> { wrap(unsafe { db_expand(self.0, d.as_ptr(), d.len() as i64) }) }
    pub fn transpose(&self, d0: i64, d1: i64) -> Result<Tensor> { wrap(unsafe { db_transpose(self.0, d0, d1) }) }
    pub fn narrow(&self, dim: i64, start: i64, len: i64) -> Result<Tensor> { wrap(unsafe { db_narrow(self.0, dim, start, len) }) }
    pub fn select(&self, dim: i64, index: i64) -> Result<Tensor> { wrap(unsafe { db_select(self.0, dim, index) }) }
    pub fn unsqueeze(&self, dim: i64) -> Result<Tensor> { wrap(unsafe { db_unsqueeze(self.0, dim) }) }
    pub fn cat(&self, b: &Tensor, dim: i64) -> Result<Tensor> { wrap(unsafe { db_cat2(self.0, b.0, dim) }) }
    pub fn index_select(&self, dim: i64, idx: &Tensor) -> Result<Tensor> { wrap(unsafe { db_index_select(self.0, dim, idx.0) }) }
    pub fn index_copy_(&self, dim: i64, idx: &Tensor, src: &Tensor) -> Result<()> {
        check(unsafe { db_index_copy_(self.0, dim, idx.0, src.0) })
    }
    pub fn fill_(&self, v: f64) -> Result<()> { check(unsafe { db_fill_(self.0, v) }) }
    pub fn ge_scalar(&self, s: f64) -> Result<Tensor> { wrap(unsafe { db_ge_scalar(self.0, s) }) }
    pub fn le(&self, b: &Tensor) -> Result<Tensor> { wrap(unsafe { db_le(self.0, b.0) }) }
    pub fn lt_scalar(&self, s: f64) -> Result<Tensor> { wrap(unsafe { db_lt_scalar(self.0, s) }) }
    pub fn logical_and(&self, b: &Tensor) -> Result<Tensor> { wrap(unsafe { db_logical_and(self.0, b.0) }) }
    pub fn where_(&self, a: &Tensor, b: &Tensor) -> Result<Tensor> { wrap(unsafe { db_where(self.0, a.0, b.0) }) }
    pub fn arange_i64(n: i64, like: &Tensor) -> Result<Tensor> { wrap(unsafe { db_arange_i64(n, like.0) }) }
    pub fn full_i64(n: i64, v: i64, like: &Tensor) -> Result<Tensor> { wrap(unsafe { db_full_i64(n, v, like.0) }) }
    pub fn zeros(d: &[i64], like: &Tensor) -> Result<Tensor> { wrap(unsafe { db_zeros(d.as_ptr(), d.len() as i64, like.0) }) }
    pub fn from_i64s(data: &[i64], like: &Tensor) -> Result<Tensor> {
        wrap(unsafe { db_from_i64s(data.as_ptr(), data.len() as i64, like.0) })
    }
    /// Reads an integer tensor to the host; waits for the device.
    pub fn to_i64s(&self) -> Result<Vec<i64>> {
        let n = self.numel();
        let mut out = vec![0i64; n as usize];
        check(unsafe { db_to_i64s(self.0, out.as_mut_ptr(), n) })?;
        Ok(out)
    }
    pub fn numel(&self) -> i64 { unsafe { db_numel(self.0) } }
    pub fn nbytes(&self) -> i64 { unsafe { db_nbytes(self.0) } }
    pub fn size(&self, dim: i64) -> i64 { unsafe { db_size(self.0, dim) } }
    pub fn sdpa(q: &Tensor, k: &Tensor, v: &Tensor, mask: &Tensor, scale: f64) -> Result<Tensor> {
        wrap(unsafe { db_sdpa(q.0, k.0, v.0, mask.0, scale) })
    }
    /// q [B, KV, rows, D], k and v [B, KV, slots, D], keep [B, rows, slots]: decodebench_attn::one_query.
    pub fn one_query(q: &Tensor, k: &Tensor, v: &Tensor, keep: &Tensor, scale: f64) -> Result<Tensor> {
        wrap(unsafe { db_one_query(q.0, k.0, v.0, keep.0, scale) })
    }
    /// The index of the first largest value along the last dim (a dim of 1 kept), as `argmax_last` gives it, by the
    /// project's decodebench_pick::first_max.
    pub fn first_max(&self) -> Result<Tensor> {
        wrap(unsafe { db_first_max(self.0) })
    }
    /// x [..., n] bf16 over the root of its mean square plus eps, times `weight` [n] where given, in float32,
    /// rounded once: decodebench_norm::rms.
    pub fn rms_norm(&self, weight: Option<&Tensor>, eps: f64) -> Result<Tensor> {
        wrap(unsafe { db_rms(self.0, weight.map_or(std::ptr::null_mut(), |w| w.0), eps) })
    }
    /// x [B, S, heads, n] bf16 normed as `rms_norm` does, then rotated by `cos` and `sin` [1 or B, S, 1, n] (Gemma's
    /// rotary embedding, each product and sum rounded to bf16 as eager's operators round them):
    /// decodebench_norm::rms_rope.
    pub fn rms_rope(&self, weight: Option<&Tensor>, eps: f64, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
        wrap(unsafe { db_rms_rope(self.0, weight.map_or(std::ptr::null_mut(), |w| w.0), eps, cos.0, sin.0) })
    }
    /// self + `x` normed as `rms_norm` does (self and x [..., n] bf16), then times `scale` (bf16, one value) where
    /// given, each rounded to bf16 as eager's operators round them: decodebench_norm::add_rms.
    pub fn add_rms(&self, x: &Tensor, weight: Option<&Tensor>, eps: f64, scale: Option<&Tensor>) -> Result<Tensor> {
        let (w, s) = (weight.map_or(std::ptr::null_mut(), |w| w.0), scale.map_or(std::ptr::null_mut(), |s| s.0));
        wrap(unsafe { db_add_rms(self.0, x.0, w, eps, s) })
    }
    /// gelu_tanh(self) * `up` (bf16, one shape), rounded where eager's two operators round: decodebench_act::gelu_mul.
    pub fn gelu_mul(&self, up: &Tensor) -> Result<Tensor> {
        wrap(unsafe { db_gelu_mul(self.0, up.0) })
    }
}
