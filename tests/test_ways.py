"""The articles' rows, runnable by name: ``way=<article>/<row>`` sets what the article ran, and a cell
that changes what its way sets is refused by name."""

from __future__ import annotations

import pytest

from runner import WAYS, check_way, run_cell, typed_config, way_settings
from tests.conftest import REPO, make_cfg

ALL_WAYS = sorted(p.relative_to(WAYS).with_suffix("").as_posix() for p in WAYS.rglob("*.yaml"))


def test_every_notebook_and_the_rust_article_have_ways():
    assert {w.split("/")[0] for w in ALL_WAYS} == {"nb02", "nb03", "nb04", "nb05", "rust"}
    assert "reproduce:" in (REPO / "Makefile").read_text()


@pytest.mark.parametrize("way", ALL_WAYS)
def test_a_way_composes_to_what_its_file_says(way):
    run = typed_config(make_cfg(f"way={way}"))
    check_way(run)
    text = (WAYS / f"{way}.yaml").read_text()
    assert f"override /engine: {run.engine.name}\n" in text and f"override /experiment: {run.experiment.name}\n" in text
    assert run.way == way and f"max_new_tokens: {run.max_new_tokens}\n" in text
    assert way_settings(way)["engine.name"] == run.engine.name


def test_a_way_run_otherwise_is_refused_by_name(cell_cfg):
    record = run_cell(cell_cfg("way=nb04/compiled", "engine=ring"))
    assert record["status"] == "failed"
    assert "way=nb04/compiled is not run as the article ran it: engine.name=ring (the way sets compiled)" in record[
        "reason"
    ]


def test_a_way_cell_records_its_way(cell_cfg, tiny):
    record = run_cell(cell_cfg("way=nb04/compiled-4bit-table", "engine.backend=eager", "repeats=1"))
    assert record["status"] == "ok", record["reason"]
    assert record["config"]["way"] == "nb04/compiled-4bit-table" and record["engine"]["kept_4bit"] == [
        "embed_tokens_per_layer"
    ]
    assert record["measurements"]["max_new_tokens"]["value"] == 64


def test_generate_through_transformers_loading_writes_the_same_tokens(cell_cfg, tiny):
    ours, theirs = (run_cell(cell_cfg("experiment=decode", "max_new_tokens=6", "repeats=1", f"engine.loader={loader}"))
                    for loader in ("decodebench", "transformers"))  # fmt: skip
    assert ours["status"] == theirs["status"] == "ok"
    assert theirs["engine"]["loader"] == "transformers" and ours["engine"]["loader"] == "decodebench"
    assert ours["outputs"]["generated_ids"] == theirs["outputs"]["generated_ids"]


def test_the_first_token_kl_is_the_rust_articles_definition(cell_cfg, tiny, cache_dir):
    """KL(Transformers || engine) over the first generated token's distribution, recomputed here from both
    models' own first-token logits with torch's kl_div."""
    import torch

    from decodebench.checkpoint import load_reference, resolve
    from tests.conftest import opened

    record = run_cell(cell_cfg("engine=ring", "engine.backend=eager", "experiment=parity"))
    assert record["status"] == "ok", record["reason"]
    ring = opened(f"cache_dir={cache_dir}", "engine=ring", "engine.backend=eager", "experiment=parity")
    ids = ring.encode(record["config"]["prompt"])
    engine_logits = ring.load().generate(ids, 1, return_logits=True).logits[0].double()
    bf16_twin = resolve(ring.ctx.model_cfg, "bf16", ring.ctx.cache_dir)  # the reference reads -ct-text
    reference = load_reference(bf16_twin, torch.float32, torch.device("cpu"))
    with torch.inference_mode():
        reference_logits = reference(torch.tensor([ids])).logits[0, -1].double()
    expected = torch.nn.functional.kl_div(
        engine_logits.log_softmax(-1), reference_logits.log_softmax(-1), log_target=True, reduction="sum"
    )
    got = record["measurements"]["parity_first_token_kl"]
    assert got["value"] == pytest.approx(max(float(expected), 0.0), abs=1e-12) and got["unit"] == "nats"


@pytest.mark.parametrize("engine", ["ring", "jax"])
def test_the_sequence_kl_is_the_colab_articles_definition(cell_cfg, tiny, engine):
    """Every position of prompt + generated: the teacher-forced engine agrees with Transformers' one forward
    (float32: KL at rounding level, the same top token everywhere), over prompt tokens + N positions."""
    if engine == "jax":
        pytest.importorskip("jax")
    extra = ("engine.backend=eager",) if engine == "ring" else ()
    record = run_cell(cell_cfg(f"engine={engine}", *extra, "experiment=parity"))
    assert record["status"] == "ok", record["reason"]
    m = record["measurements"]
    positions = m["parity_prompt_tokens"]["value"] + record["config"]["max_new_tokens"]
    assert m["parity_sequence_kl_mean"]["positions"] == positions == m["parity_sequence_top1_same"]["of"]
    assert m["parity_sequence_top1_same"]["value"] == positions
    assert m["parity_sequence_kl_mean"]["value"] < 1e-6


def test_an_engine_that_cannot_be_teacher_forced_says_so(cell_cfg, tiny):
    record = run_cell(cell_cfg("engine=generate", "experiment=parity"))
    assert record["status"] == "ok" and "parity_sequence_kl_mean" not in record["measurements"]
    assert "cannot be fed tokens step by step" in record["outputs"]["sequence_kl"]
