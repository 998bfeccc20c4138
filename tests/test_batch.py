"""Batched decode (issue 44): the ring decodes several sequences in one step, each at its own position, and each
writes the tokens it writes alone; the decode experiment's ``experiment.batch`` measures it as a method; the report
counts a batched step's weights once for its sequences."""

from __future__ import annotations

import pytest

from decodebench.checkpoint import layers_of_config, shape_of_config
from reports import arithmetic, method
from runner import run_cell
from tests.conftest import e2b_text_config, opened
from tests.test_like_for_like import key

N = 40


@pytest.fixture(scope="module")
def ring(cache_dir, tiny):
    """A tiny ring in float32 with 32-token pieces: its sliding ring holds 160 slots (window 128 + a piece)."""
    engine = opened(f"cache_dir={cache_dir}", "engine=ring", "engine.piece=32", "context=512", "dtype=float32",
                    "engine.backend=none")  # fmt: skip
    engine.load()
    yield engine.engine
    engine.close()


def prompts(lengths: list[int]) -> list[list[int]]:
    """Prompts of the given lengths, each its own ids (BOS, then a pattern that differs by sequence)."""
    return [[2] + [(7 * k + 13 * i) % 200 + 10 for k in range(length - 1)] for i, length in enumerate(lengths)]


def test_each_sequence_of_a_ragged_batch_writes_its_tokens_alone(ring):
    # 5 tokens (one short piece), 50 (two pieces), 150 + 40 new ones: past the 160-slot sliding ring, so it wraps
    batch = prompts([5, 50, 150])
    alone = [ring.generate(ids, N).tokens for ids in batch]
    together = ring.generate_batch(batch, N)
    assert [g.tokens for g in together] == alone
    assert all(g.decode_s > 0 and g.read_s > 0 for g in together)
    # a batch of another size, and the same batch again: its ring is rebuilt or reused, never stale
    assert [g.tokens for g in ring.generate_batch(batch[:2], N)] == alone[:2]
    assert [g.tokens for g in ring.generate_batch(batch, N)] == alone
    assert ring.generate(batch[2], N).tokens == alone[2]  # the one-sequence ring is the engine's again


@pytest.mark.parametrize("name", ["compiled", "table4"])
def test_the_static_cache_ways_batch_a_ragged_batch_each_sequence_as_alone(cache_dir, tiny, name):
    """compiled and table4 read each prompt alone and step a batch StaticCache whose shorter prompts are left-padded
    (masked): each sequence writes its tokens alone, through TorchDynamo (eager backend: the padding a step input)."""
    engine = opened(f"cache_dir={cache_dir}", f"engine={name}", "context=256", "dtype=float32", "engine.backend=eager")
    engine.load()
    try:
        built = engine.engine
        batch = prompts([5, 50, 70])  # the longest + N stays inside tiny's 128-slot sliding window, as the engine needs
        alone = [built.generate(ids, N).tokens for ids in batch]
        assert len({tuple(a) for a in alone}) == 3
        together = built.generate_batch(batch, N)
        assert [g.tokens for g in together] == alone
        assert all(g.decode_s > 0 and g.read_s > 0 for g in together)
        assert [g.tokens for g in built.generate_batch(batch[1:], N)] == alone[1:]  # a batch of another size
        assert [g.tokens for g in built.generate_batch(batch[::-1], N)] == alone[::-1]  # the longest first
        assert built.generate(batch[0], N).tokens == alone[0]  # the one-sequence cache is the engine's again
    finally:
        engine.close()


def test_a_step_runs_the_fewest_rows_that_hold_every_busy_one(ring):
    """Of 4 rows, a step runs the first 1, 2 or 4, whichever hold every busy row, and a row's tokens are its own
    whichever: row 0 decodes alone, then beside row 2 (4 rows stepped), then beside row 1 (2 rows)."""
    first, third, second = prompts([5, 50, 12])
    alone = ring.generate(first, 7).tokens
    seen: list[int] = []
    layer = ring.model.model.layers[0].mlp
    hook = layer.register_forward_hook(lambda _m, args, _out: seen.append(args[0].shape[0]))

    def step() -> tuple[int, int]:
        """Row 0's next token, and the rows the step ran."""
        seen.clear()
        return int(ring.step_rows()[0, 0]), seen[0]

    try:
        ring.open_rows(4)
        made = [int(ring.admit(0, first))]
        stepped = [step(), step()]
        ring.admit(2, third)
        stepped += [step(), step()]
        ring.release(2)
        ring.admit(1, second)
        stepped += [step(), step()]
    finally:
        hook.remove()
    assert [rows for _, rows in stepped] == [1, 1, 4, 4, 2, 2]
    assert made + [token for token, _ in stepped] == alone


def test_the_decode_experiment_measures_a_batch_as_a_method(cell_cfg, tiny):
    record = run_cell(cell_cfg("engine=ring", "engine.backend=none", "experiment=decode", "experiment.batch=3",
                               "max_new_tokens=8"))  # fmt: skip
    assert record["status"] == "ok", record["reason"]
    m = record["measurements"]
    per_sequence, total = m["decode_tok_s_per_sequence"]["values"], m["decode_tok_s"]["values"]
    assert total == pytest.approx([3 * r for r in per_sequence])  # every sequence's tokens a second
    t1, tn = m["warm_1_s"]["values"], m["warm_n_s"]["values"]
    # a pair whose T_N is not above its T_1 (noise over 7 of tiny's steps, on a busy machine) gives no rate and is
    # named by its check; every other pair's rate is (N-1)/(T_N - T_1)
    kept = [(a, b) for a, b in zip(t1, tn, strict=True) if b > a]
    assert per_sequence == pytest.approx([7 / (b - a) for a, b in kept])
    rules = {c["rule"]: c["holds"] for c in record["outputs"]["checks"]}
    assert rules["T_N > T_1 in every pair (N=8)"] is (len(kept) == len(t1))
    assert rules["each sequence of the batch writes the tokens it writes alone"] is True
    assert len(set(record["outputs"]["batch_prompt_tokens"])) == 3  # prompts of their own lengths


def test_an_engine_that_cannot_batch_is_skipped_naming_the_setting(cell_cfg, tiny):
    record = run_cell(cell_cfg("engine=generate", "experiment=decode", "experiment.batch=2"))
    assert record["status"] == "skipped" and "experiment.batch=2" in record["reason"]


def test_a_batch_is_its_own_method_and_published_figures_are_one_request():
    published = key()  # a published key names no batch: the articles ran one request at a time
    assert method.differences({**published, "batch": 4}, published) == ["batch: measured 4, published 1"]
    assert method.differences(published, published) == []  # evidence without a batch decoded one sequence


def test_a_batched_step_reads_its_weights_once_for_its_sequences():
    config = e2b_text_config()
    shape, layers = shape_of_config(config), layers_of_config(config)
    one, kv, parts = arithmetic.bytes_per_token(shape, layers, 2, 100)
    four, kv4, parts4 = arithmetic.bytes_per_token(shape, layers, 2, 100, batch=4)
    assert parts4 == parts and kv4 == kv  # a step reads the same; a token's share of the weights is a quarter
    assert four == pytest.approx((parts["linears"] + parts["lm_head"]) / 4 + parts["embedding rows"])
    assert one == pytest.approx(parts["linears"] + parts["lm_head"] + parts["embedding rows"])
