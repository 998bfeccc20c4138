//! Gemma 4 text in Rust over ATen: the layers, the ring cache, the prompt read in pieces and the
//! greedy decode loop. The same design as decodebench's PyTorch `ring` engine (engines/ring.py):
//! full-attention layers keep one slot per position, sliding layers a ring of window + piece slots
//! with a record of the position each slot holds, KV-shared layers read their source layer.
use std::collections::HashMap;
use std::time::Instant;

use crate::aten::{AtenError, InferenceMode, Result, Tensor};
use crate::weights::{Linear, Table, Weights};

/// One decoder layer's geometry.
pub struct LayerSpec {
    pub sliding: bool,
    pub head_dim: i64,
    pub kv_heads: i64,
    /// The layer whose K/V this one reads (itself when it owns a cache).
    pub source: usize,
}

/// The model's shape and constants, read from the checkpoint's config by the Python side.
pub struct Config {
    pub layers: Vec<LayerSpec>,
    pub hidden: i64,
    pub ple_dim: i64,
    pub window: i64,
    pub piece: i64,
    pub context: i64,
    /// The ring geometry, computed once on the Python side (engines/ring.py: ring_slots, full_slots).
    pub ring_slots: i64,
    pub full_slots: i64,
    pub eps: f64,
    pub softcap: Option<f64>,
    pub embed_scale: f64,
    pub ple_embed_scale: f64,
    pub ple_projection_scale: f64,
    pub ple_input_scale: f64,
    pub rope_scaling_sliding: f64,
    pub rope_scaling_full: f64,
    /// A single row (a decode step) through ATen's matrix-vector kernel (engine.one_row=mv).
    pub one_row_mv: bool,
    /// A decode step's attention by the project's decodebench_attn::one_query (engine.decode_attention).
    pub one_query: bool,
    /// Each norm by the project's decodebench_norm::rms, one operator in place of nine, and a q or k head's norm and
    /// rotary embedding by decodebench_norm::rms_rope, one in place of seventeen (engines/norm_cpu.py).
    pub rms_norm: bool,
    /// Each token picked by the project's decodebench_pick::first_max, argmax to the bit (engines/greedy_cpu.py).
    pub first_max: bool,
    /// Each residual add after a norm by the project's decodebench_norm::add_rms, one operator in place of two or three.
    pub add_rms: bool,
    /// gelu_tanh(gate) * up by the project's decodebench_act::gelu_mul, one operator in place of two.
    pub gelu_mul: bool,
}

/// A layer's q, k and v products (k and v only where the layer owns a cache): one product whose outputs are q's,
/// k's and v's side by side where the Python side joined them (engines/joined.py), else one each.
enum Qkv {
    Apart(Linear, Option<(Linear, Linear)>),
    Joined(Linear),
}

/// An MLP's gate and up products: joined (gate's outputs, then up's) or one each.
enum GateUp {
    Apart(Linear, Linear),
    Joined(Linear),
}

struct Layer {
    input_norm: Tensor,
    post_attention_norm: Tensor,
    pre_ff_norm: Tensor,
    post_ff_norm: Tensor,
    post_ple_norm: Tensor,
    qkv: Qkv,
    q_norm: Tensor,
    k_norm: Option<Tensor>, // for layers that own a cache
    o_proj: Linear,
    gate_up: GateUp,
    down: Linear,
    ple_gate: Linear,
    ple_projection: Linear,
    scalar: Tensor,
}

/// K/V buffers of the cache-owning layers and the position records that mask them.
struct Ring {
    ring_slots: i64,
    full_slots: i64,
    k: HashMap<usize, Tensor>,
    v: HashMap<usize, Tensor>,
    ring_pos: Tensor,
    full_pos: Tensor,
}

/// The per-forward state every layer shares: query positions and the slots they write.
struct Step {
    positions: Tensor,
    ring_slot: Tensor,
    masks: [Tensor; 2], // [full, sliding]: which slots each query may see
    cos_sin: [(Tensor, Tensor); 2],
}

pub struct Model {
    pub cfg: Config,
    like: Tensor,
    embed: Table,
    ple_table: Table,
    ple_model_projection: Linear,
    ple_projection_norm: Tensor,
    final_norm: Tensor,
    lm_head: Linear,
    inv_freq: [Tensor; 2], // [full, sliding]
    layers: Vec<Layer>,
    ring: Ring,
    /// The last decode's phase seconds: (prompt read to the first token on the host, the rest).
    pub timers: (f64, f64),
    /// The rows each piece of the last prompt was read as.
    pub read_rows: Vec<i64>,
}

pub enum Finish {
    Length,
    Stop,
    Cancelled,
}

impl Finish {
    pub fn as_str(&self) -> &'static str {
        match self {
            Finish::Length => "length",
            Finish::Stop => "stop",
            Finish::Cancelled => "cancelled",
        }
    }
}

fn err(message: String) -> AtenError {
    AtenError(message)
}

impl Model {
    /// Builds the model from its weights (names as Transformers' Gemma4ForCausalLM has them, a linear or
    /// table given packed taken in place of its dense tensor); every weight is moved to the device of `like`.
    pub fn new(cfg: Config, mut weights: Weights, like: Tensor) -> Result<Model> {
        let embed = weights.table("model.embed_tokens.weight", &like)?;
        let lm_head = match (weights.linear("lm_head.weight", &like), &embed) {
            (Ok(w), _) => w,
            (Err(_), Table::Dense(t)) => Linear::Dense(t.narrow(0, 0, t.size(0))?), // tied
            (Err(e), _) => return Err(e), // a packed table is no linear: the caller packs lm_head too
        };
        let ple_table = weights.table("model.embed_tokens_per_layer.weight", &like)?;
        let ple_model_projection = weights.linear("model.per_layer_model_projection.weight", &like)?;
        let ple_projection_norm = weights.take("model.per_layer_projection_norm.weight", &like)?;
        let final_norm = weights.take("model.norm.weight", &like)?;
        let inv_freq = [weights.take("rope.full_attention.inv_freq", &like)?, weights.take("rope.sliding_attention.inv_freq", &like)?];
        let mut layers = Vec::new();
        for (i, spec) in cfg.layers.iter().enumerate() {
            let p = format!("model.layers.{i}.");
            let mut w = |name: &str| weights.take(&format!("{p}{name}"), &like);
            let (input_norm, post_attention_norm) = (w("input_layernorm.weight")?, w("post_attention_layernorm.weight")?);
            let (pre_ff_norm, post_ff_norm) = (w("pre_feedforward_layernorm.weight")?, w("post_feedforward_layernorm.weight")?);
            let (post_ple_norm, q_norm, scalar) = (w("post_per_layer_input_norm.weight")?, w("self_attn.q_norm.weight")?, w("layer_scalar")?);
            let k_norm = if spec.source == i { Some(w("self_attn.k_norm.weight")?) } else { None };
            let joined = |name: &str| weights.holds(&format!("{p}{name}.weight"));
            let (joined_qkv, joined_gate_up) = (joined("self_attn.qkv_proj"), joined("mlp.gate_up_proj"));
            let mut l = |name: &str| weights.linear(&format!("{p}{name}.weight"), &like);
            let qkv = match (joined_qkv, &k_norm) {
                (true, _) => Qkv::Joined(l("self_attn.qkv_proj")?),
                (false, Some(_)) => Qkv::Apart(l("self_attn.q_proj")?, Some((l("self_attn.k_proj")?, l("self_attn.v_proj")?))),
                (false, None) => Qkv::Apart(l("self_attn.q_proj")?, None),
            };
            let gate_up = match joined_gate_up {
                true => GateUp::Joined(l("mlp.gate_up_proj")?),
                false => GateUp::Apart(l("mlp.gate_proj")?, l("mlp.up_proj")?),
            };
            layers.push(Layer {
                input_norm,
                post_attention_norm,
                pre_ff_norm,
                post_ff_norm,
                post_ple_norm,
                qkv,
                q_norm,
                k_norm,
                o_proj: l("self_attn.o_proj")?,
                gate_up,
                down: l("mlp.down_proj")?,
                ple_gate: l("per_layer_input_gate")?,
                ple_projection: l("per_layer_projection")?,
                scalar,
            });
        }
        let (ring_slots, full_slots) = (cfg.ring_slots, cfg.full_slots);
        let (mut k, mut v) = (HashMap::new(), HashMap::new());
        for (i, spec) in cfg.layers.iter().enumerate() {
            if spec.source == i {
                let slots = if spec.sliding { ring_slots } else { full_slots };
                k.insert(i, Tensor::zeros(&[1, spec.kv_heads, slots, spec.head_dim], &like)?);
                v.insert(i, Tensor::zeros(&[1, spec.kv_heads, slots, spec.head_dim], &like)?);
            }
        }
        let ring = Ring {
            ring_slots,
            full_slots,
            k,
            v,
            ring_pos: Tensor::full_i64(ring_slots, -1, &like)?,
            full_pos: Tensor::full_i64(full_slots, -1, &like)?,
        };
        Ok(Model {
            cfg,
            like,
            embed,
            ple_table,
            ple_model_projection,
            ple_projection_norm,
            final_norm,
            lm_head,
            inv_freq,
            layers,
            ring,
            timers: (0.0, 0.0),
            read_rows: Vec::new(),
        })
    }

    pub fn layout(&self) -> (i64, i64, usize, usize, usize) {
        let owners: Vec<&LayerSpec> = self.cfg.layers.iter().enumerate().filter(|(i, s)| s.source == *i).map(|(_, s)| s).collect();
        let sliding = owners.iter().filter(|s| s.sliding).count();
        (self.ring.full_slots, self.ring.ring_slots, owners.len() - sliding, sliding, self.cfg.layers.len() - owners.len())
    }

    pub fn cache_bytes(&self) -> i64 {
        self.ring.k.values().chain(self.ring.v.values()).map(|t| t.nbytes()).sum()
    }

    /// The greedy token of logits [1, V], [1, 1].
    fn greedy(&self, logits: &Tensor) -> Result<Tensor> {
        if self.cfg.first_max {
            logits.first_max()
        } else {
            logits.argmax_last()
        }
    }

    fn rms(&self, x: &Tensor, weight: Option<&Tensor>) -> Result<Tensor> {
        if self.cfg.rms_norm {
            return x.rms_norm(weight, self.cfg.eps);
        }
        let xf = x.to_float()?;
        let normed = xf.mul(&xf.pow_scalar(2.0)?.mean_last()?.add_scalar(self.cfg.eps)?.pow_scalar(-0.5)?)?;
        let out = match weight {
            Some(w) => normed.mul(&w.to_float()?)?,
            None => normed,
        };
        out.to_like(x)
    }

    /// h + x normed (its weight), then times `scale` where given: the residual add after a norm, by
    /// decodebench_norm::add_rms where the config says so.
    fn add_rms(&self, h: &Tensor, x: &Tensor, weight: &Tensor, scale: Option<&Tensor>) -> Result<Tensor> {
        if self.cfg.add_rms {
            return h.add_rms(x, Some(weight), self.cfg.eps, scale);
        }
        let sum = h.add(&self.rms(x, Some(weight))?)?;
        match scale {
            Some(s) => sum.mul(s),
            None => Ok(sum),
        }
    }

    /// gelu_tanh(gate) * up, by decodebench_act::gelu_mul where the config says so.
    fn gelu_mul(&self, gate: &Tensor, up: &Tensor) -> Result<Tensor> {
        if self.cfg.gelu_mul {
            return gate.gelu_mul(up);
        }
        gate.gelu_tanh()?.mul(up)
    }

    /// A q or k head's norm (its weight) and then its rotary embedding, x [1, seq, heads, head_dim].
    fn rms_rope(&self, x: &Tensor, weight: &Tensor, cos_sin: &(Tensor, Tensor)) -> Result<Tensor> {
        if self.cfg.rms_norm {
            return x.rms_rope(Some(weight), self.cfg.eps, &cos_sin.0, &cos_sin.1);
        }
        let x = self.rms(x, Some(weight))?;
        let d = x.size(-1);
        let (x1, x2) = (x.narrow(-1, 0, d / 2)?, x.narrow(-1, d / 2, d / 2)?);
        let rotated = x2.neg()?.cat(&x1, -1)?;
        x.mul(&cos_sin.0)?.add(&rotated.mul(&cos_sin.1)?)
    }

    /// q, and k and v where the layer owns a cache, [1, seq, width] each: from one joined product, split, or one each.
    fn qkv(&self, i: usize, x: &Tensor) -> Result<(Tensor, Option<(Tensor, Tensor)>)> {
        let (spec, mv) = (&self.cfg.layers[i], self.cfg.one_row_mv);
        match &self.layers[i].qkv {
            Qkv::Apart(q, None) => Ok((x.linear(q, mv)?, None)),
            Qkv::Apart(q, Some((k, v))) => Ok((x.linear(q, mv)?, Some((x.linear(k, mv)?, x.linear(v, mv)?)))),
            Qkv::Joined(w) => {
                let all = x.linear(w, mv)?;
                let kv = spec.kv_heads * spec.head_dim;
                let q = all.size(-1) - 2 * kv;
                Ok((all.narrow(-1, 0, q)?, Some((all.narrow(-1, q, kv)?, all.narrow(-1, q + kv, kv)?))))
            }
        }
    }

    /// The MLP: down(gelu_tanh(gate(x)) * up(x)), gate and up from one joined product where the layer has it.
    fn mlp(&self, layer: &Layer, x: &Tensor) -> Result<Tensor> {
        let mv = self.cfg.one_row_mv;
        let (gate, up) = match &layer.gate_up {
            GateUp::Apart(gate, up) => (x.linear(gate, mv)?, x.linear(up, mv)?),
            GateUp::Joined(w) => {
                let both = x.linear(w, mv)?;
                let width = both.size(-1) / 2;
                (both.narrow(-1, 0, width)?, both.narrow(-1, width, width)?)
            }
        };
        self.gelu_mul(&gate, &up)?.linear(&layer.down, mv)
    }

    fn begin(&mut self, positions: Tensor, valid: &Tensor, hidden: &Tensor) -> Result<Step> {
        let ring_slot = positions.remainder(self.ring.ring_slots)?;
        let none = Tensor::full_i64(positions.numel(), -1, &self.like)?;
        let recorded = valid.where_(&positions, &none)?;
        self.ring.ring_pos.index_copy_(0, &ring_slot, &recorded)?;
        self.ring.full_pos.index_copy_(0, &positions, &recorded)?;
        let q = positions.unsqueeze(1)?;
        let mut masks = Vec::new();
        for (record, window) in [(&self.ring.full_pos, None), (&self.ring.ring_pos, Some(self.cfg.window))] {
            let k = record.unsqueeze(0)?;
            let mut keep = k.ge_scalar(0.0)?.logical_and(&k.le(&q)?)?;
            if let Some(w) = window {
                keep = keep.logical_and(&q.sub(&k)?.lt_scalar(w as f64)?)?;
            }
            masks.push(keep.unsqueeze(0)?.unsqueeze(0)?);
        }
        let sliding = masks.pop().unwrap();
        let full = masks.pop().unwrap();
        let mut cos_sin = Vec::new();
        for (inv, scaling) in [(&self.inv_freq[0], self.cfg.rope_scaling_full), (&self.inv_freq[1], self.cfg.rope_scaling_sliding)] {
            let freqs = positions.to_float()?.unsqueeze(1)?.mul(&inv.to_float()?.unsqueeze(0)?)?;
            let emb = freqs.cat(&freqs, -1)?;
            let cos = emb.cos()?.mul_scalar(scaling)?.to_like(hidden)?.unsqueeze(0)?.unsqueeze(2)?;
            let sin = emb.sin()?.mul_scalar(scaling)?.to_like(hidden)?.unsqueeze(0)?.unsqueeze(2)?;
            cos_sin.push((cos, sin));
        }
        let sliding_cs = cos_sin.pop().unwrap();
        let full_cs = cos_sin.pop().unwrap();
        Ok(Step { positions, ring_slot, masks: [full, sliding], cos_sin: [full_cs, sliding_cs] })
    }

    fn attention(&self, i: usize, x: &Tensor, step: &Step) -> Result<Tensor> {
        let (spec, layer) = (&self.cfg.layers[i], &self.layers[i]);
        let seq = x.size(1);
        let kind = if spec.sliding { 1 } else { 0 };
        let shape = [1, seq, -1, spec.head_dim];
        let mv = self.cfg.one_row_mv;
        let (q, kv) = self.qkv(i, x)?;
        let q = self.rms_rope(&q.reshape(&shape)?, &layer.q_norm, &step.cos_sin[kind])?;
        if let (Some((k, v)), Some(k_norm)) = (kv, &layer.k_norm) {
            let k = self.rms_rope(&k.reshape(&shape)?, k_norm, &step.cos_sin[kind])?;
            let v = self.rms(&v.reshape(&shape)?, None)?;
            let slots = if spec.sliding { &step.ring_slot } else { &step.positions };
            self.ring.k[&i].index_copy_(2, slots, &k.transpose(1, 2)?)?;
            self.ring.v[&i].index_copy_(2, slots, &v.transpose(1, 2)?)?;
        }
        // A decode step folds the query heads that share a K/V head into the query length: the same
        // products as grouped-query attention, one matrix product per K/V head (engines/ring.py).
        // Only for a decode step: a prompt piece keeps grouped-query attention (its mask would grow G times). With one
        // query position, q [1, 1, heads, D] is the folded [1, KV, groups, D] as it lies (query head h reads K/V head
        // h / groups), and the output [1, KV, groups, D] is [1, 1, heads x D].
        let (k, v) = (&self.ring.k[&spec.source], &self.ring.v[&spec.source]);
        let out = if seq == 1 {
            let groups = q.size(2) / spec.kv_heads;
            let folded = q.reshape(&[1, spec.kv_heads, groups, spec.head_dim])?;
            if self.cfg.one_query {  // the step's one mask row, seen by every query row: broadcast, not copied
                Tensor::one_query(&folded, k, v, &step.masks[kind].reshape(&[1, 1, -1])?.expand(&[1, groups, -1])?, 1.0)?
            } else {
                Tensor::sdpa(&folded, k, v, &step.masks[kind].repeat(&[1, 1, groups, 1])?, 1.0)?
            }
        } else {
            Tensor::sdpa(&q.transpose(1, 2)?, k, v, &step.masks[kind], 1.0)?.transpose(1, 2)?
        };
        out.reshape(&[1, seq, -1])?.linear(&layer.o_proj, mv)
    }

    /// One forward over `ids` at `positions` (padding rows have `valid` false); logits [1, V] of `row`.
    fn forward(&mut self, ids: &Tensor, positions: Tensor, valid: &Tensor, row: i64) -> Result<Tensor> {
        let _inference = InferenceMode::begin(); // no autograd work in any operator of the forward
        let seq = ids.numel();
        let (hidden, ple_dim, layers) = (self.cfg.hidden, self.cfg.ple_dim, self.cfg.layers.len() as i64);
        let mv = self.cfg.one_row_mv;
        let mut h = self.embed.rows(ids, &self.like)?.reshape(&[1, seq, hidden])?.mul_scalar(self.cfg.embed_scale)?;
        let tok = self.ple_table.rows(ids, &self.like)?.mul_scalar(self.cfg.ple_embed_scale)?.reshape(&[1, seq, layers, ple_dim])?;
        let ctx = h.linear(&self.ple_model_projection, mv)?.mul_scalar(self.cfg.ple_projection_scale)?.reshape(&[1, seq, layers, ple_dim])?;
        let ple = self.rms(&ctx, Some(&self.ple_projection_norm))?.add(&tok)?.mul_scalar(self.cfg.ple_input_scale)?;
        let step = self.begin(positions, valid, &h)?;
        for i in 0..self.layers.len() {
            let layer = &self.layers[i];
            let attn = self.attention(i, &self.rms(&h, Some(&layer.input_norm))?, &step)?;
            h = self.add_rms(&h, &attn, &layer.post_attention_norm, None)?;
            let x = self.rms(&h, Some(&layer.pre_ff_norm))?;
            let mlp = self.mlp(layer, &x)?;
            h = self.add_rms(&h, &mlp, &layer.post_ff_norm, None)?;
            let g = self.gelu_mul(&h.linear(&layer.ple_gate, mv)?, &ple.select(2, i as i64)?)?.linear(&layer.ple_projection, mv)?;
            h = self.add_rms(&h, &g, &layer.post_ple_norm, Some(&layer.scalar))?;
        }
        let last = self.rms(&h.narrow(1, row, 1)?, Some(&self.final_norm))?;
        let logits = last.linear(&self.lm_head, mv)?.reshape(&[1, -1])?;
        match self.cfg.softcap {
            Some(cap) => logits.div_scalar(cap)?.tanh()?.mul_scalar(cap),
            None => Ok(logits),
        }
    }

    /// Reads the prompt in pieces, each padded at its end to `piece` rows but the last, to `last_rows` (at least
    /// its tokens); returns the logits [1, V] at its last token.
    fn read_prompt(&mut self, ids: &[i64], last_rows: i64) -> Result<Tensor> {
        let piece = self.cfg.piece;
        let pieces = ids.chunks(piece as usize).count();
        let mut logits = None;
        self.read_rows.clear();
        for (k, chunk) in ids.chunks(piece as usize).enumerate() {
            let rows = if k + 1 == pieces { last_rows } else { piece };
            self.read_rows.push(rows);
            let offsets = Tensor::arange_i64(rows, &self.like)?;
            let mut padded = chunk.to_vec();
            padded.resize(rows as usize, 0);
            let tokens = Tensor::from_i64s(&padded, &self.like)?;
            let positions = offsets.add_i64(k as i64 * piece)?;
            let valid = offsets.lt_scalar(chunk.len() as f64)?;
            logits = Some(self.forward(&tokens, positions, &valid, chunk.len() as i64 - 1)?);
        }
        logits.ok_or_else(|| err("empty prompt".into()))
    }

    /// Greedy decode: at most `max_new` tokens, the prompt's last piece read as `last_rows` rows. Tokens
    /// stay on the device and are read to the host every `read_every` tokens, when `on_batch` gets them (it may return false to cancel); a token in
    /// `stop` ends the answer (checked at each read, the tokens after it dropped). `timers` gets the
    /// phase seconds: from the call's start until the first token is read back (the prompt read, a
    /// device wait), and from then until the last token is on the host.
    pub fn decode(
        &mut self,
        ids: &[i64],
        last_rows: i64,
        max_new: i64,
        stop: &[i64],
        read_every: i64,
        mut on_batch: impl FnMut(&[i64]) -> bool,
        mut keep_logits: Option<&mut Vec<Tensor>>,
    ) -> Result<(Vec<i64>, Finish)> {
        let start = Instant::now();
        self.ring.ring_pos.fill_(-1.0)?;
        self.ring.full_pos.fill_(-1.0)?;
        let mut logits = self.read_prompt(ids, last_rows)?;
        self.greedy(&logits)?.to_i64s()?; // waits for the device: the prompt read ends here
        let first = Instant::now();
        let valid = Tensor::full_i64(1, 1, &self.like)?.ge_scalar(1.0)?;
        let mut position = Tensor::full_i64(1, ids.len() as i64, &self.like)?;
        let (mut out, mut pending, mut made) = (Vec::new(), Vec::new(), 0);
        let finish = loop {
            let token = self.greedy(&logits)?.reshape(&[1])?;
            if let Some(kept) = keep_logits.as_deref_mut() {
                kept.push(logits);
            }
            made += 1;
            pending.push(token.reshape(&[1])?);
            if pending.len() as i64 >= read_every || made >= max_new {
                let mut batch = Vec::new();
                for t in pending.drain(..) {
                    batch.extend(t.to_i64s()?); // the read-back: waits for the device
                }
                let stop_at = batch.iter().position(|t| stop.contains(t));
                if let Some(s) = stop_at {
                    batch.truncate(s + 1);
                }
                out.extend_from_slice(&batch);
                let go_on = on_batch(&batch);
                if stop_at.is_some() {
                    break Finish::Stop;
                }
                if !go_on {
                    break Finish::Cancelled;
                }
                if made >= max_new {
                    break Finish::Length;
                }
            }
            logits = self.forward(&token, position.add_i64(0)?, &valid, 0)?;
            position = position.add_i64(1)?;
        };
        self.timers = (first.duration_since(start).as_secs_f64(), first.elapsed().as_secs_f64());
        Ok((out, finish))
    }
}
