//! PyO3 bindings: every crossing between Python and the Rust model is in this file.
//!
//! * Token ids cross as lists, never as tensors; weights cross once, at construction.
//! * `decode` releases the GIL; the callback takes it back once per batch of `read_every` tokens;
//!   a false return cancels (finish "cancelled"); an exception in it is raised from `decode`.
//! * `Engine` is unsendable: PyO3 refuses calls from any thread but the one that built it.
//! * Errors a caller can cause are ValueError, checked here before the model's own checks.
mod aten;
mod model;
mod weights;

use std::collections::HashMap;

use pyo3::exceptions::{PyRuntimeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList};
use pyo3::AsPyPointer;

use aten::Tensor;
use model::{Config, LayerSpec, Model};
use weights::{Linear, Table, Weights};

fn tensor(obj: &PyAny) -> PyResult<Tensor> {
    unsafe { Tensor::from_raw(aten::db_from_python(obj.as_ptr())) }.map_err(|e| PyValueError::new_err(e.0))
}

fn to_python(py: Python<'_>, t: &Tensor) -> PyResult<PyObject> {
    let obj = unsafe { aten::db_to_python(t.raw()) };
    if obj.is_null() {
        return Err(PyErr::take(py).unwrap_or_else(|| PyRuntimeError::new_err("could not wrap a tensor")));
    }
    Ok(unsafe { PyObject::from_owned_ptr(py, obj) })
}

fn get<'a, T: FromPyObject<'a>>(d: &'a PyDict, key: &str) -> PyResult<T> {
    d.get_item(key).ok_or_else(|| PyValueError::new_err(format!("config lacks {key}")))?.extract()
}

fn config(d: &PyDict) -> PyResult<Config> {
    let sliding: Vec<bool> = get(d, "sliding")?;
    let head_dims: Vec<i64> = get(d, "head_dims")?;
    let kv_heads: Vec<i64> = get(d, "kv_heads")?;
    let sources: Vec<usize> = get(d, "sources")?;
    let layers = (0..sliding.len())
        .map(|i| LayerSpec { sliding: sliding[i], head_dim: head_dims[i], kv_heads: kv_heads[i], source: sources[i] })
        .collect();
    Ok(Config {
        layers,
        hidden: get(d, "hidden")?,
        ple_dim: get(d, "ple_dim")?,
        window: get(d, "window")?,
        piece: get(d, "piece")?,
        context: get(d, "context")?,
        ring_slots: get(d, "ring_slots")?,
        full_slots: get(d, "full_slots")?,
        eps: get(d, "eps")?,
        softcap: get(d, "softcap")?,
        embed_scale: get(d, "embed_scale")?,
        ple_embed_scale: get(d, "ple_embed_scale")?,
        ple_projection_scale: get(d, "ple_projection_scale")?,
        ple_input_scale: get(d, "ple_input_scale")?,
        rope_scaling_sliding: get(d, "rope_scaling_sliding")?,
        rope_scaling_full: get(d, "rope_scaling_full")?,
        one_row_mv: get(d, "one_row_mv")?,
        one_query: get(d, "one_query")?,
        rms_norm: get(d, "rms_norm")?,
        first_max: get(d, "first_max")?,
        add_rms: get(d, "add_rms")?,
        gelu_mul: get(d, "gelu_mul")?,
    })
}

fn packed_linear(value: &PyAny) -> PyResult<Linear> {
    match value.get_item(0)?.extract::<&str>()? {
        "int4" => {
            let (_, words, scales, group, out, limbs): (&str, &PyAny, &PyAny, i64, i64, i64) = value.extract()?;
            Ok(Linear::Int4 { words: tensor(words)?, scales: tensor(scales)?, group, out, limbs })
        }
        "rows" => {
            let (_, packed, out): (&str, &PyAny, i64) = value.extract()?;
            Ok(Linear::Rows { packed: tensor(packed)?, out })
        }
        kind => Err(PyValueError::new_err(format!("a packed linear is int4 or rows, not {kind}"))),
    }
}

fn packed_table(value: &PyAny) -> PyResult<Table> {
    match value.get_item(0)?.extract::<&str>()? {
        "int4" => {
            let (_, packed, scale, group, cols): (&str, &PyAny, &PyAny, i64, i64) = value.extract()?;
            Ok(Table::Int4 { packed: tensor(packed)?, scale: tensor(scale)?, group, cols })
        }
        "rows" => {
            let (_, packed): (&str, &PyAny) = value.extract()?;
            Ok(Table::Rows { packed: tensor(packed)? })
        }
        kind => Err(PyValueError::new_err(format!("a packed table is int4 or rows, not {kind}"))),
    }
}

/// Gemma 4 with a ring cache, built once from the checkpoint's weights.
#[pyclass(unsendable)]
struct Engine {
    model: Model,
}

#[pymethods]
impl Engine {
    /// `config`: shape and constants; `weights`: name -> tensor (Transformers' names); `like`: a
    /// tensor on the device (and of the dtype) the model runs on. `linears` and `tables`: name -> a weight
    /// packed by the Python side, in place of its dense tensor: a linear `("int4", words, scales, group,
    /// out_features, limbs)` for `decodebench_int4::int4_rows` or `("rows", packed, out_features)` for
    /// `decodebench_bf16::bf16_rows`; a table `("int4", words, scales, group, columns)` as the checkpoint
    /// stores it or `("rows", packed)`, tied to a `rows` linear.
    #[new]
    #[args(linears = "None", tables = "None")]
    fn new(config_dict: &PyDict, weights: &PyDict, like: &PyAny, linears: Option<&PyDict>,
           tables: Option<&PyDict>) -> PyResult<Self> {
        let cfg = config(config_dict)?;
        let mut store = Weights { dense: HashMap::new(), linears: HashMap::new(), tables: HashMap::new() };
        for (name, value) in weights.iter() {
            store.dense.insert(name.extract::<String>()?, tensor(value)?);
        }
        for (name, value) in linears.map(|d| d.iter()).into_iter().flatten() {
            store.linears.insert(name.extract()?, packed_linear(value)?);
        }
        for (name, value) in tables.map(|d| d.iter()).into_iter().flatten() {
            store.tables.insert(name.extract()?, packed_table(value)?);
        }
        let model = Model::new(cfg, store, tensor(like)?).map_err(|e| PyValueError::new_err(e.0))?;
        Ok(Engine { model })
    }

    /// Greedy tokens after `ids`; returns (tokens, finish, logits [n, V] or None). `last_rows`: the rows
    /// the prompt's last piece is read as, from its own tokens to a whole piece (0: a whole piece).
    #[args(stop = "Vec::new()", read_every = "0", on_tokens = "None", return_logits = "false", last_rows = "0")]
    fn decode(
        &mut self,
        py: Python<'_>,
        ids: Vec<i64>,
        max_new: i64,
        stop: Vec<i64>,
        read_every: i64,
        on_tokens: Option<PyObject>,
        return_logits: bool,
        last_rows: i64,
    ) -> PyResult<(Vec<i64>, String, Option<PyObject>)> {
        if ids.is_empty() {
            return Err(PyValueError::new_err("the prompt is empty"));
        }
        if max_new < 1 {
            return Err(PyValueError::new_err(format!("max_new={max_new} must be at least 1")));
        }
        let piece = self.model.cfg.piece;
        let last_tokens = (ids.len() as i64 - 1) % piece + 1;
        let last_rows = if last_rows == 0 { piece } else { last_rows };
        if last_rows < last_tokens || last_rows > piece {
            return Err(PyValueError::new_err(format!(
                "last_rows={last_rows}: the last piece holds {last_tokens} tokens and a piece {piece} rows"
            )));
        }
        let slots = self.model.cfg.full_slots;
        let padded = (ids.len() as i64 + self.model.cfg.piece - 1) / self.model.cfg.piece * self.model.cfg.piece;
        if ids.len() as i64 + max_new > self.model.cfg.context || padded > slots {
            return Err(PyValueError::new_err(format!(
                "prompt of {} tokens plus max_new={max_new} does not fit the cache of {} tokens",
                ids.len(),
                self.model.cfg.context
            )));
        }
        let read_every = if read_every < 1 { max_new } else { read_every };
        let mut failure: Option<PyErr> = None;
        let mut kept = Vec::new();
        let model = &mut self.model;
        let result = py.allow_threads(|| {
            model.decode(
                &ids,
                last_rows,
                max_new,
                &stop,
                read_every,
                |batch| match &on_tokens {
                    None => true,
                    Some(callback) => Python::with_gil(|py| {
                        let list = PyList::new(py, batch);
                        match callback.call1(py, (list,)).and_then(|r| r.is_true(py)) {
                            Ok(go_on) => go_on,
                            Err(e) => {
                                failure = Some(e);
                                false
                            }
                        }
                    }),
                },
                if return_logits { Some(&mut kept) } else { None },
            )
        });
        if let Some(e) = failure {
            return Err(e);
        }
        let (tokens, finish) = result.map_err(|e| PyRuntimeError::new_err(e.0))?;
        let logits = if return_logits {
            let mut all = kept.remove(0);
            for t in kept.iter() {
                all = all.cat(t, 0).map_err(|e| PyRuntimeError::new_err(e.0))?;
            }
            Some(to_python(py, &all)?)
        } else {
            None
        };
        Ok((tokens, finish.as_str().to_string(), logits))
    }

    /// The cache layout: full slots, ring slots, full layers, sliding layers, shared layers.
    #[getter]
    fn layout(&self, py: Python<'_>) -> PyResult<PyObject> {
        let (full_slots, ring_slots, full, sliding, shared) = self.model.layout();
        let d = PyDict::new(py);
        d.set_item("full_slots", full_slots)?;
        d.set_item("ring_slots", ring_slots)?;
        d.set_item("full_layers", full)?;
        d.set_item("sliding_layers", sliding)?;
        d.set_item("shared_layers", shared)?;
        Ok(d.into())
    }

    /// The last decode's phase seconds: `read_s` (the prompt read, up to the first token on the
    /// host) and `decode_s` (from then until the last token on the host).
    #[getter]
    fn timers(&self, py: Python<'_>) -> PyResult<PyObject> {
        let d = PyDict::new(py);
        d.set_item("read_s", self.model.timers.0)?;
        d.set_item("decode_s", self.model.timers.1)?;
        Ok(d.into())
    }

    /// The rows each piece of the last prompt was read as.
    #[getter]
    fn read_rows(&self) -> Vec<i64> {
        self.model.read_rows.clone()
    }

    /// Bytes held by the K/V buffers, from their shapes.
    #[getter]
    fn cache_bytes(&self) -> i64 {
        self.model.cache_bytes()
    }
}

/// One shim operation on tensors and scalars, for testing the shim against torch itself.
#[pyfunction]
fn shim_op(py: Python<'_>, name: &str, tensors: Vec<&PyAny>, scalars: Vec<f64>) -> PyResult<PyObject> {
    let t: Vec<Tensor> = tensors.into_iter().map(tensor).collect::<PyResult<_>>()?;
    let s = |i: usize| scalars.get(i).copied().ok_or_else(|| PyValueError::new_err(format!("{name}: scalar {i} missing")));
    let out = match name {
        "linear" => t[0].dense_linear(&t[1], false),
        "linear_mv" => t[0].dense_linear(&t[1], true),
        "int4_linear" => t[0].int4_linear(&t[1], &t[2], s(0)? as i64, s(1)? as i64, s(2)? as i64),
        "int4_lookup" => Tensor::int4_lookup(&t[0], &t[1], &t[2], s(0)? as i64, s(1)? as i64, &t[3]),
        "bf16_rows" => t[0].bf16_rows(&t[1], s(0)? as i64),
        "packed_rows" => Tensor::packed_rows(&t[0], &t[1]),
        "mul" => t[0].mul(&t[1]),
        "add" => t[0].add(&t[1]),
        "div_scalar" => t[0].div_scalar(s(0)?),
        "pow_scalar" => t[0].pow_scalar(s(0)?),
        "mean_last" => t[0].mean_last(),
        "gelu_tanh" => t[0].gelu_tanh(),
        "tanh" => t[0].tanh(),
        "index_select" => t[0].index_select(s(0)? as i64, &t[1]),
        "argmax_last" => t[0].argmax_last(),
        "first_max" => t[0].first_max(),
        "cat" => t[0].cat(&t[1], s(0)? as i64),
        "narrow" => t[0].narrow(s(0)? as i64, s(1)? as i64, s(2)? as i64),
        "remainder" => t[0].remainder(s(0)? as i64),
        "where" => t[0].where_(&t[1], &t[2]),
        "sdpa" => Tensor::sdpa(&t[0], &t[1], &t[2], &t[3], s(0)?),
        "rms_norm" => t[0].rms_norm(t.get(1), s(0)?),
        "rms_rope" => t[0].rms_rope(Some(&t[1]), s(0)?, &t[2], &t[3]),
        "add_rms" => t[0].add_rms(&t[1], Some(&t[2]), s(0)?, t.get(3)),
        "gelu_mul" => t[0].gelu_mul(&t[1]),
        _ => return Err(PyValueError::new_err(format!("no shim operation {name}"))),
    };
    to_python(py, &out.map_err(|e| PyRuntimeError::new_err(e.0))?)
}

/// The torch version the shim was compiled against.
#[pyfunction]
fn torch_version() -> String {
    aten::torch_version()
}

#[pymodule]
fn _native(py: Python<'_>, m: &PyModule) -> PyResult<()> {
    m.add_class::<Engine>()?;
    m.add_function(wrap_pyfunction!(torch_version, m)?)?;
    m.add_function(wrap_pyfunction!(shim_op, m)?)?;
    let build = PyDict::new(py);
    build.set_item("torch", env!("DECODEBENCH_RS_TORCH"))?;
    build.set_item("rustc", env!("DECODEBENCH_RS_RUSTC"))?;
    build.set_item("python", env!("DECODEBENCH_RS_PYTHON"))?;
    build.set_item("crate", env!("CARGO_PKG_VERSION"))?;
    m.add("BUILD", build)?;
    Ok(())
}
