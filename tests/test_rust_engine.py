"""The Rust engine's bindings and shim (engines/rust/), built by `make setup` against this torch."""

from __future__ import annotations

import importlib
import os
import sys
import threading
import time

import pytest
import torch
from torch import nn
from transformers.models.gemma4.modeling_gemma4 import Gemma4ForCausalLM

from decodebench.checkpoint import open_checkpoint
from decodebench.config import ConfigError
from decodebench.device import Device
from engines import bf16_cpu, greedy_cpu, int4, int4_cpu, norm_cpu
from engines.rust_engine import RustEngine, int4_unsupported
from runner import run_cell, typed_config
from tests.conftest import opened
from tests.test_engines import parity
from tests.test_int4 import ROWS, packed_weight, runs_here

if os.environ.get("CI"):  # CI builds the crate in `make setup`: a missing module is a failure there
    import decodebench_rs
else:
    decodebench_rs = pytest.importorskip("decodebench_rs", reason="the rust engine is not built (make setup)")


@pytest.fixture(scope="module")
def engine(tiny, cache_dir):
    eng = opened(f"cache_dir={cache_dir}", "engine=rust", "dtype=float32", "context=1024").load()
    assert isinstance(eng, RustEngine)
    return eng


PROMPT = [2, 4, 90, 88, 356, 204, 60, 5, 204, 4]


def test_module_surface_and_build():
    assert {"BUILD", "Engine", "shim_op", "torch_version"} <= set(dir(decodebench_rs))
    build = decodebench_rs.BUILD
    assert build["torch"] == torch.__version__ and torch.__version__.startswith(decodebench_rs.torch_version())
    assert build["rustc"].startswith("rustc ") and build["crate"] == "0.1.0"
    assert build["python"] == sys.version.split()[0]


def test_another_torch_version_refuses_to_import(monkeypatch):
    monkeypatch.setattr(torch, "__version__", "0.0.1")
    monkeypatch.delitem(sys.modules, "decodebench_rs")
    with pytest.raises(ImportError, match=r"built against torch .* but torch 0\.0\.1"):
        importlib.import_module("decodebench_rs")


def test_bad_input_is_value_error(engine):
    native = engine.native
    with pytest.raises(ValueError, match="empty"):
        native.decode([], 4)
    with pytest.raises(ValueError, match="max_new=0"):
        native.decode(PROMPT, 0)
    with pytest.raises(ValueError, match="does not fit the cache of 1024"):
        native.decode(PROMPT * 100, 100)


def test_cancel_and_length(engine):
    tokens, finish, _ = engine.native.decode(PROMPT, 6)
    assert finish == "length" and len(tokens) == 6
    seen = []
    tokens, finish, _ = engine.native.decode(
        PROMPT, 12, read_every=2, on_tokens=lambda b: seen.append(b) or len(seen) < 2
    )
    assert finish == "cancelled" and seen == [tokens[:2], tokens[2:4]] and len(tokens) == 4


def test_decode_stops_and_streams(engine):
    full, _, _ = engine.native.decode(PROMPT, 10)
    batches = []
    streamed, finish, _ = engine.native.decode(PROMPT, 10, read_every=1, on_tokens=lambda b: batches.append(b) or True)
    assert streamed == full and batches == [[t] for t in full] and finish == "length"
    stop = full[3]
    tokens, finish, _ = engine.native.decode(PROMPT, 10, stop=[stop], read_every=4)
    assert finish == "stop" and tokens == full[: full.index(stop) + 1]


def test_callback_exception_propagates(engine):
    def boom(batch):
        raise KeyError("from the callback")

    with pytest.raises(KeyError, match="from the callback"):
        engine.native.decode(PROMPT, 4, read_every=1, on_tokens=boom)


def test_gil_released_during_decode(engine):
    counter = {"n": 0, "stop": False}

    def spin():
        while not counter["stop"]:
            counter["n"] += 1

    thread = threading.Thread(target=spin)
    thread.start()
    time.sleep(0.05)
    before = counter["n"]
    engine.native.decode(PROMPT * 20, 60)
    during = counter["n"] - before
    counter["stop"] = True
    thread.join()
    assert during > 1000, f"the other thread made {during} steps while Rust decoded"


def test_unsendable(engine):
    errors = []

    def call():
        try:
            engine.native.decode(PROMPT, 2)
        except BaseException as exc:  # PyO3's PanicException derives from BaseException
            errors.append(exc)

    thread = threading.Thread(target=call)
    thread.start()
    thread.join()
    assert len(errors) == 1
    assert "unsendable" in str(errors[0]) and "thread" in str(errors[0])


@pytest.mark.parametrize(
    ("name", "tensors", "scalars", "expected"),
    [
        ("linear", [torch.randn(3, 8), torch.randn(5, 8)], [], lambda a, b: torch.nn.functional.linear(a, b)),
        ("linear_mv", [torch.randn(1, 1, 8), torch.randn(5, 8)], [], lambda a, b: torch.mv(b, a[0, 0]).view(1, 1, 5)),
        ("linear_mv", [torch.randn(3, 8), torch.randn(5, 8)], [], lambda a, b: torch.nn.functional.linear(a, b)),
        ("gelu_tanh", [torch.randn(4, 6)], [], lambda a: torch.nn.functional.gelu(a, approximate="tanh")),
        ("div_scalar", [torch.randn(4)], [30.0], lambda a: a / 30.0),
        ("pow_scalar", [torch.rand(4) + 0.1], [-0.5], lambda a: torch.pow(a, -0.5)),
        ("mean_last", [torch.randn(2, 7)], [], lambda a: a.mean(-1, keepdim=True)),
        ("index_select", [torch.randn(9, 4), torch.tensor([3, 0, 8])], [0], lambda a, i: a[i]),
        ("argmax_last", [torch.randn(2, 11)], [], lambda a: a.argmax(-1, keepdim=True)),
        ("cat", [torch.randn(2, 3), torch.randn(2, 5)], [1], lambda a, b: torch.cat([a, b], 1)),
        ("narrow", [torch.randn(4, 10)], [1, 2, 5], lambda a: a[:, 2:7]),
        ("remainder", [torch.arange(20)], [7], lambda a: a % 7),
    ],
)
def test_shim_functions_match_torch(name, tensors, scalars, expected):
    assert torch.equal(decodebench_rs.shim_op(name, tensors, scalars), expected(*tensors))


def test_shim_attention_matches_torch():
    q, k, v = torch.randn(1, 4, 5, 8), torch.randn(1, 1, 9, 8), torch.randn(1, 1, 9, 8)
    mask = torch.rand(1, 1, 5, 9) > 0.3
    mask[..., 0] = True
    expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=1.0, enable_gqa=True)
    torch.testing.assert_close(decodebench_rs.shim_op("sdpa", [q, k, v, mask], [1.0]), expected)
    with pytest.raises(RuntimeError):
        decodebench_rs.shim_op("linear", [torch.randn(3, 8), torch.randn(5, 7)], [])


@pytest.mark.parametrize("limbs", [3, 2])
def test_shim_int4_product_is_the_python_engines_operator(limbs):
    """The shim's int4 product is ``decodebench_int4::int4_rows`` itself (found in ATen's dispatcher): the same bits
    as the operator called from Python with the same limbs, on a 3-D input and an output count that leaves the last
    tile partial, and within bf16 rounding of the float64 product over the dequantized weight."""
    runs_here(ROWS)
    weight, dense = packed_weight(72, 256, 64)
    layer = int4.Int4Linear(weight, torch.bfloat16, torch.device("cpu"), kernel=ROWS, limbs=limbs)
    x = torch.randn(1, 3, 256).to(torch.bfloat16)
    got = decodebench_rs.shim_op("int4_linear", [x, layer.words, layer.scales], [64, 72, limbs])
    assert got.shape == (1, 3, 72) and torch.equal(got, layer(x))
    exact = x.double() @ dense.double().T
    torch.testing.assert_close(got.double(), exact, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("group", [32, 64])
def test_shim_int4_lookup_is_the_int4_embedding(group):
    """Rows of a 4-bit table, unpacked by the shim, equal those ``Int4Embedding`` gives (scale 1) in the bits."""
    table, dense = packed_weight(40, 128, group)
    lookup = int4.Int4Embedding(table, 1.0, torch.bfloat16, torch.device("cpu"))
    ids = torch.tensor([7, 0, 39, 7])
    got = decodebench_rs.shim_op("int4_lookup", [table.packed, table.scale, ids, torch.zeros(1, dtype=torch.bfloat16)],
                                 [group, 128])  # fmt: skip
    assert torch.equal(got, lookup(ids)) and torch.equal(got, dense[ids].to(torch.bfloat16))


def test_shim_norm_is_the_python_engines_operator():
    """The shim's norm is ``decodebench_norm::rms`` itself (found in ATen's dispatcher), with a weight and without; its
    rotation, residual add (with a layer's scalar and without) and ``gelu_tanh(gate) * up`` the Python engines' too."""
    if reason := norm_cpu.unsupported("cpu", torch.bfloat16):
        pytest.skip(f"{norm_cpu.OP}: {reason}")
    x, weight = torch.randn(2, 3, 40).to(torch.bfloat16), torch.randn(40).to(torch.bfloat16)
    assert torch.equal(decodebench_rs.shim_op("rms_norm", [x, weight], [1e-6]), norm_cpu.rms(x, weight, 1e-6))
    assert torch.equal(decodebench_rs.shim_op("rms_norm", [x], [1e-6]), norm_cpu.rms(x, None, 1e-6))
    heads = x.reshape(2, 3, 2, 20)
    cos, sin = torch.randn(2, 3, 1, 20).to(torch.bfloat16), torch.randn(2, 3, 1, 20).to(torch.bfloat16)
    assert torch.equal(
        decodebench_rs.shim_op("rms_rope", [heads, weight[:20], cos, sin], [1e-6]),
        norm_cpu.rms_rope(heads, weight[:20], 1e-6, cos, sin),
    )
    h, scale = torch.randn(2, 3, 40).to(torch.bfloat16), torch.tensor([0.5], dtype=torch.bfloat16)
    for scaled in ([], [scale]):
        assert torch.equal(decodebench_rs.shim_op("add_rms", [h, x, weight, *scaled], [1e-6]),
                           norm_cpu.add_rms(h, x, weight, 1e-6, *scaled or [None]))  # fmt: skip
    assert torch.equal(decodebench_rs.shim_op("gelu_mul", [h, x], []), norm_cpu.gelu_mul(h, x))


def test_shim_first_max_is_the_python_engines_operator():
    """The shim's greedy pick is ``decodebench_pick::first_max`` itself: argmax's index, the leading dims kept."""
    if greedy_cpu.choose("cpu", torch.bfloat16) != greedy_cpu.OP:
        pytest.skip(f"{greedy_cpu.OP}: the project's CPU kernels do not run here")
    logits = (torch.randn(2, 1, 70000) * 4).round().to(torch.bfloat16)
    got = decodebench_rs.shim_op("first_max", [logits], [])
    assert torch.equal(got, logits.argmax(-1, keepdim=True))
    assert torch.equal(got, decodebench_rs.shim_op("argmax_last", [logits], []))


def joined_in(model: nn.Module) -> int:
    """The linears engines.joined makes of a Gemma 4 model: q, k and v of each layer that holds its own K/V, gate and
    up of every MLP."""
    layers = model.model.layers
    return sum(not layer.self_attn.is_kv_shared_layer for layer in layers) + len(layers)


def joined_parts(model: nn.Module) -> int:
    """The linears the joined ones replace: three for each q, k and v, two for each gate and up."""
    layers = model.model.layers
    return 3 * sum(not layer.self_attn.is_kv_shared_layer for layer in layers) + 2 * len(layers)


@pytest.mark.parametrize("weights", ["int4", "dense"])
def test_joined_products_give_the_rust_model_the_bits_of_its_products_apart(cache_dir, tiny, monkeypatch, weights):
    """q, k, v and gate, up joined (the Rust layer splits one product's outputs) or left apart (what the Rust model
    reads where they cannot be joined): the same logits, bit for bit, prompt and decode steps (int4_rows and bf16_rows
    compute each output as its own product does)."""
    if weights == "int4":
        runs_here(ROWS)
        overrides = ("engine.weights=int4",)
    elif reason := bf16_cpu.unsupported(torch.bfloat16):
        pytest.skip(f"{bf16_cpu.OP}: {reason}")
    else:
        overrides = ("engine.one_row=rows",)
    logits, counted = {}, {}
    for join in (True, False):
        if not join:
            monkeypatch.setattr("engines.rust_engine.join_layers", lambda model: 0)
        handle = opened(f"cache_dir={cache_dir}", "engine=rust", "dtype=bfloat16", "context=1024", *overrides)
        try:
            engine = handle.load()
            described = engine.describe()
            assert described["joined_linears"] == (joined_in(engine.model) if join else 0)
            # int4: no linear is dense; dense: none is 4-bit
            assert described["settings_without_effect"] == ["one_row" if weights == "int4" else "int4_limbs"]
            counted[join] = described["product_bytes"]
            logits[join] = engine.generate(PROMPT, 6, return_logits=True).logits
        finally:
            handle.close()
    assert torch.equal(logits[True], logits[False])
    assert counted[True] == counted[False]  # joined products read the bytes their parts read, no more


@pytest.mark.parametrize("limbs", [3, 2])
def test_int4_rust_writes_the_reference_tokens_with_every_linear_4bit(cell_cfg, tiny, limbs):
    """``engine.weights=int4``: the ``-emb4`` twin, every linear (lm_head included) multiplied by ``int4_rows`` from
    Rust, x held in three limbs or two, the tables looked up 4-bit; the tokens are Transformers' at bf16."""
    runs_here(ROWS)
    record = run_cell(cell_cfg("engine=rust", "engine.weights=int4", f"engine.int4_limbs={limbs}",
                               "experiment=parity-bf16", "max_new_tokens=16"))  # fmt: skip
    assert record["status"] == "ok", record["reason"]
    assert record["config"]["engine"]["int4_limbs"] == limbs
    engine = record["engine"]
    skeleton = Gemma4ForCausalLM(open_checkpoint(tiny.emb4).config)
    assert engine["int4_kernel"] == ROWS and engine["weights"] == "int4"
    assert engine["int4_exactness"] == f"{limbs} limbs: {int4_cpu.LIMBS[limbs]}"
    assert engine["settings_without_effect"] == ["one_row"]
    kernels = not norm_cpu.unsupported("cpu", torch.bfloat16)
    assert (engine["norm"], engine["rope"]) == ((norm_cpu.OP, norm_cpu.ROPE) if kernels else (norm_cpu.EAGER,) * 2)
    assert engine["int4_linears"] == sum(isinstance(m, nn.Linear) for m in skeleton.modules())
    assert engine["joined_linears"] == joined_in(skeleton)
    out = record["outputs"]["prompt"]
    assert record["outputs"]["verdict"] == "pass"
    if limbs == 3:  # two limbs moved a near-tie of tiny's random weights at the 16th token (KL mean 4.7e-5), in bounds
        assert out["first_difference"] is None and out["tokens_equal"] == 16


def test_int4_rust_is_refused_or_skipped_by_name(cell_cfg, tiny):
    with pytest.raises(ConfigError, match="one_row=mv has no effect with engine.weights=int4"):
        typed_config(cell_cfg("engine=rust", "engine.weights=int4", "engine.one_row=mv"))
    record = run_cell(cell_cfg("engine=rust", "engine.weights=int4", "dtype=float32"))
    assert record["status"] == "skipped" and "computes bf16 activations" in record["reason"]
    run = typed_config(cell_cfg("engine=rust", "engine.weights=int4"))
    gpu = Device(kind="cuda", name="a GPU", torch_device=torch.device("cpu"))
    assert "a CPU kernel; this device is cuda" in int4_unsupported(gpu, run)


def test_shim_bf16_product_and_tied_rows_are_the_python_engines():
    """``bf16_rows`` from the shim is the operator the PyTorch engines call (the same bits, leading dimensions kept,
    a partial last tile), and a tied table's rows read back from the packed weight are the weight's own rows."""
    if reason := bf16_cpu.unsupported(torch.bfloat16):
        pytest.skip(f"{bf16_cpu.OP}: {reason}")
    weight = torch.randn(40, 64).to(torch.bfloat16)
    packed = bf16_cpu.pack(weight)
    x = torch.randn(1, 3, 64).to(torch.bfloat16)
    got = decodebench_rs.shim_op("bf16_rows", [x, packed], [40])
    assert got.shape == (1, 3, 40) and torch.equal(got[0], bf16_cpu.rows(x[0], packed, 40))
    torch.testing.assert_close(got.double(), x.double() @ weight.double().T, rtol=1e-2, atol=1e-2)
    ids = torch.tensor([39, 0, 17, 17])
    assert torch.equal(decodebench_rs.shim_op("packed_rows", [packed, ids], []), weight[ids])


def test_rows_rust_writes_the_reference_tokens_with_every_linear_packed(cell_cfg, tiny):
    """``engine.one_row=rows``: every dense linear (lm_head, tied to the token table, included) multiplied by
    ``bf16_rows`` from Rust, the tied table read from the packed weight; the tokens are Transformers' at bf16."""
    if reason := bf16_cpu.unsupported(torch.bfloat16):
        pytest.skip(f"{bf16_cpu.OP}: {reason}")
    record = run_cell(cell_cfg("engine=rust", "engine.one_row=rows", "experiment=parity-bf16", "max_new_tokens=16"))
    assert record["status"] == "ok", record["reason"]
    skeleton = Gemma4ForCausalLM(open_checkpoint(tiny.w4a16).config)
    linears, joined = sum(isinstance(m, nn.Linear) for m in skeleton.modules()), joined_in(skeleton)
    assert record["engine"]["joined_linears"] == joined
    assert record["engine"]["row_linears"] == linears - joined_parts(skeleton) + joined
    out = record["outputs"]["prompt"]
    assert out["first_difference"] is None and out["tokens_equal"] == 16 and record["outputs"]["verdict"] == "pass"


@pytest.mark.parametrize("last_piece", ["bucketed", "exact"])
def test_a_short_last_piece_writes_the_same_tokens(cell_cfg, tiny, last_piece):
    """``engine.last_piece``: a prompt whose last piece is read as fewer rows than a piece (a 200-token wrap prompt
    in pieces of 32: its last piece holds 8 tokens) writes Transformers' tokens, in the short and long prompts."""
    record = parity(cell_cfg, "rust", f"engine.last_piece={last_piece}", "engine.piece=32", "experiment.wrap_piece=32",
                    "experiment.wrap_extra=40")  # fmt: skip
    assert record["engine"]["last_piece"] == last_piece
    assert ("8" if last_piece == "exact" else "16") in record["engine"]["piece_lengths"]
    for name in ("prompt", "long"):
        out = record["outputs"][name]
        assert out["first_difference"] is None and out["kl_max"] < 1e-6, name


def test_forward_runs_in_inference_mode(engine):
    """A forward's operators run under ATen's inference mode (no autograd dispatch or bookkeeping): the one token's
    logits a decode returns are an inference tensor, and the thread's mode is as it was once the decode returns."""
    assert not torch.is_inference_mode_enabled()
    _, _, logits = engine.native.decode(PROMPT, 1, return_logits=True)
    assert logits.is_inference()
    assert not torch.is_inference_mode_enabled()


def test_last_rows_reads_fewer_rows_and_the_same_tokens(engine):
    """The same tokens and logits for a 10-token prompt read as its 10 rows, 16, or a whole piece of 256; a count
    below the last piece's tokens or above a piece is a ValueError."""
    whole = engine.native.decode(PROMPT, 5, return_logits=True)
    assert engine.native.read_rows == [256]
    for rows in (len(PROMPT), 16):
        tokens, finish, logits = engine.native.decode(PROMPT, 5, return_logits=True, last_rows=rows)
        assert engine.native.read_rows == [rows] and tokens == whole[0] and finish == whole[1]
        torch.testing.assert_close(logits, whole[2], rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="last_rows=9: the last piece holds 10 tokens"):
        engine.native.decode(PROMPT, 2, last_rows=9)
    with pytest.raises(ValueError, match="last_rows=257"):
        engine.native.decode(PROMPT, 2, last_rows=257)
