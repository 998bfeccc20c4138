"""The Rust engine's bindings and shim (engines/rust/), built by `make setup` against this torch."""

from __future__ import annotations

import importlib
import os
import sys
import threading
import time

import pytest
import torch

from engines.rust_engine import RustEngine
from tests.conftest import opened

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
