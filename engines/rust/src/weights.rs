//! The model's weights as the Rust model holds them: a linear's and a vocabulary table's dense, 4-bit
//! (`engine.weights=int4`: multiplied by the project's `decodebench_int4::int4_rows`, looked up row by row) or
//! packed for the project's bf16 kernel (`engine.one_row=rows`: `decodebench_bf16::bf16_rows`), and the store they
//! are taken from at construction, each moved to the model's device (that of `like`).
use std::collections::HashMap;

use crate::aten::{AtenError, Result, Tensor};

/// A linear's weight, [out, in].
pub enum Linear {
    Dense(Tensor),
    /// Packed for `int4_rows` (engines/int4_cpu.py, `pack`): `group` inputs a scale, `out` outputs, x held in
    /// `limbs` 7-bit limbs (engines/int4_cpu.py, `LIMBS`).
    Int4 { words: Tensor, scales: Tensor, group: i64, out: i64, limbs: i64 },
    /// Packed for `bf16_rows` (engines/bf16_cpu.py, `pack`), `out` outputs.
    Rows { packed: Tensor, out: i64 },
}

/// A table read by row, [rows, cols].
pub enum Table {
    Dense(Tensor),
    /// As the checkpoint stores it: int32 words [rows, cols/8] and one scale per `group` columns.
    Int4 { packed: Tensor, scale: Tensor, group: i64, cols: i64 },
    /// A table tied to a linear packed for `bf16_rows`: its rows read from that packed weight (held once).
    Rows { packed: Tensor },
}

impl Tensor {
    /// `x @ w.T`; with `one_row_mv`, a dense weight's single row through ATen's matrix-vector kernel.
    pub fn linear(&self, w: &Linear, one_row_mv: bool) -> Result<Tensor> {
        match w {
            Linear::Dense(t) => self.dense_linear(t, one_row_mv),
            Linear::Int4 { words, scales, group, out, limbs } => self.int4_linear(words, scales, *group, *out, *limbs),
            Linear::Rows { packed, out } => self.bf16_rows(packed, *out),
        }
    }
}

impl Linear {
    fn to_device_of(self, like: &Tensor) -> Result<Linear> {
        Ok(match self {
            Linear::Dense(t) => Linear::Dense(t.to_device_of(like)?),
            Linear::Int4 { words, scales, group, out, limbs } => {
                let (words, scales) = (words.to_device_of(like)?, scales.to_device_of(like)?);
                Linear::Int4 { words, scales, group, out, limbs }
            }
            Linear::Rows { packed, out } => Linear::Rows { packed: packed.to_device_of(like)?, out },
        })
    }
}

impl Table {
    /// Rows `ids`, [n, cols] in the dtype of `like` (a dense table's own).
    pub fn rows(&self, ids: &Tensor, like: &Tensor) -> Result<Tensor> {
        match self {
            Table::Dense(t) => t.index_select(0, ids),
            Table::Int4 { packed, scale, group, cols } => Tensor::int4_lookup(packed, scale, ids, *group, *cols, like),
            Table::Rows { packed } => Tensor::packed_rows(packed, ids),
        }
    }

    fn to_device_of(self, like: &Tensor) -> Result<Table> {
        Ok(match self {
            Table::Dense(t) => Table::Dense(t.to_device_of(like)?),
            Table::Int4 { packed, scale, group, cols } => {
                Table::Int4 { packed: packed.to_device_of(like)?, scale: scale.to_device_of(like)?, group, cols }
            }
            Table::Rows { packed } => Table::Rows { packed: packed.to_device_of(like)? },
        })
    }
}

/// The weights by Transformers' names, taken once each by the model's constructor.
pub struct Weights {
    pub dense: HashMap<String, Tensor>,
    pub linears: HashMap<String, Linear>,
    pub tables: HashMap<String, Table>,
}

impl Weights {
    /// A dense tensor, on the device of `like`.
    pub fn take(&mut self, name: &str, like: &Tensor) -> Result<Tensor> {
        let t = self.dense.remove(name).ok_or_else(|| AtenError(format!("missing weight {name}")))?;
        t.to_device_of(like)
    }

    /// A linear's weight: the one given packed (4-bit, or for `bf16_rows`), else the dense tensor.
    pub fn linear(&mut self, name: &str, like: &Tensor) -> Result<Linear> {
        match self.linears.remove(name) {
            Some(w) => w.to_device_of(like),
            None => Ok(Linear::Dense(self.take(name, like)?)),
        }
    }

    /// Whether a linear or tensor of this name is held (a joined linear, where the Python side joined one).
    pub fn holds(&self, name: &str) -> bool {
        self.linears.contains_key(name) || self.dense.contains_key(name)
    }

    /// A table's weight: the one given packed (4-bit, or tied to a `bf16_rows` linear), else the dense tensor.
    pub fn table(&mut self, name: &str, like: &Tensor) -> Result<Table> {
        match self.tables.remove(name) {
            Some(w) => w.to_device_of(like),
            None => Ok(Table::Dense(self.take(name, like)?)),
        }
    }
}
