"""The articles' rows, runnable by name: ``way=<article>/<row>`` sets what the article ran, and a cell
that changes what its way sets is refused by name."""

from __future__ import annotations

import pytest

from decodebench.config import ConfigError
from runner import WAYS, check_way, run_cell, typed_config, way_checks, way_settings
from scripts.ways import select
from tests.conftest import REPO, make_cfg, opened

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


def test_a_way_whose_engine_the_command_line_changed_names_the_way_not_only_a_setting(cell_cfg):
    """nb04/generate sets engine.loader, a setting ring lacks: the error names the way, the engine and settings it
    sets, and the change, not only "engine ring has no setting engine.loader"."""
    record = run_cell(cell_cfg("way=nb04/generate", "engine=ring"))
    reason = record["reason"]
    assert record["status"] == "failed"
    assert "way=nb04/generate (conf/way/nb04/generate.yaml) sets engine=generate with engine.loader=" in reason
    assert "the command line changed the engine to ring, which has no setting engine.loader" in reason


def test_a_way_cell_records_its_way(cell_cfg, tiny):
    record = run_cell(cell_cfg("way=nb04/compiled-4bit-table", "engine.backend=eager", "repeats=1"))
    assert record["status"] == "ok", record["reason"]
    assert record["config"]["way"] == "nb04/compiled-4bit-table" and record["engine"]["kept_4bit"] == [
        "embed_tokens_per_layer"
    ]
    assert record["measurements"]["max_new_tokens"]["value"] == 64


def test_generate_through_transformers_loading_writes_the_same_tokens(cell_cfg, tiny, cache_dir):
    """decodebench's loader, Transformers' default (linears packed until the first forward: notebook 02's
    "compressed") and Transformers' dequantize-at-load (notebook 02's "eager"): the same tokens."""
    loaders = ("decodebench", "transformers", "transformers_dense")
    records = [run_cell(cell_cfg("experiment=decode", "max_new_tokens=6", "repeats=1", f"engine.loader={loader}"))
               for loader in loaders]  # fmt: skip
    assert [r["status"] for r in records] == ["ok"] * 3
    assert [r["engine"]["loader"] for r in records] == list(loaders)
    assert records[0]["outputs"]["generated_ids"] == records[1]["outputs"]["generated_ids"]
    assert records[0]["outputs"]["generated_ids"] == records[2]["outputs"]["generated_ids"]
    for loader, stored in (("transformers", {"weight_packed", "weight_scale"}), ("transformers_dense", {"weight"})):
        model = opened(f"cache_dir={cache_dir}", f"engine.loader={loader}").load().model  # before any forward
        held = {name for name, _ in model.model.layers[0].mlp.gate_proj.named_parameters()}
        assert stored <= held and ("weight" in held) == (loader == "transformers_dense"), (loader, held)


def test_a_ways_parity_check_keeps_its_engine_settings_context_and_n():
    run = typed_config(make_cfg("way=nb02/buffer", "experiment=parity-bf16"))
    check_way(run)  # the way's experiment replaced by its check: accepted
    assert run.experiment.name == "parity" and run.engine.compile and (run.context, run.max_new_tokens) == (256, 32)
    with pytest.raises(ConfigError, match=r"engine.compile=False \(the way sets True\)"):
        check_way(typed_config(make_cfg("way=nb02/buffer", "experiment=parity-bf16", "engine.compile=false")))


@pytest.mark.parametrize(
    ("settings", "named"),
    [(("engine.compile=true", "engine.backend=none"), "engine.compile=true with engine.backend=none"),
     (("engine.backend=eager",), "engine.backend=eager has no effect without engine.compile=true")],
)  # fmt: skip
def test_a_static_backend_that_would_not_take_effect_is_refused_by_name(settings, named):
    with pytest.raises(ConfigError, match=named):
        typed_config(make_cfg("engine=static", *settings))


def test_reproduce_checks_each_distinct_engine_setting_once():
    checks = way_checks(ALL_WAYS)
    assert checks == select("checks", ALL_WAYS) and len(checks) < len(ALL_WAYS)
    # generate with Transformers' default loading: notebook 02's "compressed", 03's torch_eager, 04's generate
    assert "nb02/compressed" in checks and "nb03/torch_eager" not in checks and "nb04/generate" not in checks
    assert "nb02/eager" in checks  # unpacked at load: another setting
    assert "nb02/buffer" in checks and "nb03/torch_buffer" not in checks  # one static-compiled setting
    assert [w for w in checks if w.startswith("nb05/")] == ["nb05/recall-131k"]  # one ring setting, four ways
    for way in ALL_WAYS:  # every way is covered by a check of its engine and settings
        engine = {k: v for k, v in way_settings(way).items() if k.startswith("engine.")}
        assert any(engine == {k: v for k, v in way_settings(c).items() if k.startswith("engine.")} for c in checks)


def test_reproduce_copies_only_the_ways_the_noise_floor_reads():
    """The A/A copies measure decode rates' noise (reports.noise); a recall or serve way runs once."""
    noise, once = select("noise", ALL_WAYS), select("once", ALL_WAYS)
    assert sorted(noise + once) == ALL_WAYS
    assert {way_settings(w)["experiment.name"] for w in noise} == {"decode"}
    assert {way_settings(w)["experiment.name"] for w in once} == {"recall", "serve"}
    assert "nb05/recall-131k" in once and "nb05/ring-131k" in noise
    assert select("once", ["nb04/compiled"]) == []  # nothing to run: the step is left out
    makefile = (REPO / "Makefile").read_text()
    assert "scripts.ways $$step" in makefile and 'noise) $(REPRODUCE) $(NOISE) "way=$$ways"' in makefile
    assert 'once) $(REPRODUCE) "way=$$ways"' in makefile


def test_reproduce_leaves_out_the_ways_skip_names_and_refuses_a_pattern_that_names_none():
    long_context = [w for w in ALL_WAYS if w.startswith("nb05/")]
    kept = select("noise", ALL_WAYS, ["nb05/*"]) + select("once", ALL_WAYS, ["nb05/*"])
    assert sorted(kept) == sorted(set(ALL_WAYS) - set(long_context)) and len(long_context) == 4
    assert "nb05/recall-131k" not in select("checks", ALL_WAYS, ["nb05/*"])  # no ring way left to check
    assert select("noise", ALL_WAYS, ["nb04/compiled", "nb04/jax-*"]) == [
        w for w in select("noise", ALL_WAYS) if w not in ("nb04/compiled", "nb04/jax-bf16")
    ]
    with pytest.raises(ValueError, match=r"SKIP=nb06/\* matches no way"):
        select("noise", ALL_WAYS, ["nb05/*", "nb06/*"])
    makefile = (REPO / "Makefile").read_text()
    assert '--skip "$(SKIP)"' in makefile


def test_the_buffer_ways_check_runs_generate_compiling_its_forward_with_the_wrappers_on(cell_cfg, tiny):
    """Notebook 02's "buffer": generate over a static cache compiles its own forward (Transformers' CompileConfig,
    here with the eager backend); its parity check is a cell of the way."""
    record = run_cell(cell_cfg("way=nb02/buffer", "experiment=parity-bf16", "engine.backend=eager"))
    assert record["status"] == "ok", record["reason"]
    assert record["outputs"]["verdict"] == "pass" and record["config"]["way"] == "nb02/buffer"
    engine = record["engine"]
    assert engine["compile"] is True and engine["loader"] == "transformers"
    assert engine["graphs"] > 1 and engine["graph_breaks"] > 0  # the wrappers cut the program (article, Step 7)
    assert engine["inductor"] == {}  # another backend: no TorchInductor options


def test_the_buffer_ways_forward_compiles_with_the_default_mode_and_eager_rounding(cache_dir, tiny):
    """torch.compile takes a mode or options, not both: TorchInductor gets reduce-overhead's options and rounds bf16
    intermediates as eager does (INDUCTOR_DEFAULTS), as the stepping engines' compiles do."""
    import torch

    opening = opened(f"cache_dir={cache_dir}", "way=nb02/buffer")
    try:
        config = opening.load().compile_config()
    finally:
        opening.close()
    assert config.backend == "inductor" and config.mode is None
    # what torch.compile makes of Transformers' CompileConfig, through torch's own mode handling (it refuses a mode
    # with options), against what it makes of the default mode alone: the same, and eager's rounding on top
    compile_with = torch._TorchCompileInductorWrapper
    default_mode = compile_with("reduce-overhead", None, config.dynamic).config
    assert compile_with(config.mode, config.options, config.dynamic).config == {
        **default_mode, "emulate_precision_casts": True
    }


def test_the_first_token_kl_is_the_rust_articles_definition(cell_cfg, tiny, cache_dir):
    """KL(Transformers || engine) over the first generated token's distribution, recomputed here from both
    models' own first-token logits with torch's kl_div."""
    import torch

    from decodebench.checkpoint import load_reference, resolve
    from tests.conftest import opened

    record = run_cell(cell_cfg("engine=ring", "engine.backend=none", "experiment=parity"))
    assert record["status"] == "ok", record["reason"]
    ring = opened(f"cache_dir={cache_dir}", "engine=ring", "engine.backend=none", "experiment=parity")
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
    extra = ("engine.backend=none",) if engine == "ring" else ()
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
