"""Experiment ``parity``: each engine against Transformers' own Gemma 4 on the same checkpoint.

The reference is ``Gemma4ForCausalLM`` loaded by Transformers' own compressed-tensors path (the
``-ct-text`` twin), eager attention, dynamic cache, greedy.  For each prompt: top-5 ids at the
first generated position, KL(reference || engine) per position up to the first differing token
(after it the two condition on different text), greedy tokens equal N of N and the first
differing position.  Prompts: the run's prompt, and one longer than the ring's sliding buffer
(the window plus a piece) so that the ring wraps around; a prompt that does not fit the context,
or that the engine cannot hold, is recorded with the reason.
"""

from __future__ import annotations

import gc
from dataclasses import dataclass
from typing import Any

import torch

from decodebench.checkpoint import load_reference, resolve
from decodebench.config import ExperimentConfig, at_least
from decodebench.evidence import Record, scalar
from decodebench.layout import ring_slots
from engines.base import EngineLimit
from engines.generate import greedy_generate
from engines.steps import SteppedEngine
from experiments.cell import Cell, MethodError, expect_tokens
from experiments.common import Result, quiet


@dataclass
class ParityExperimentConfig(ExperimentConfig):
    """Engine against Transformers' own Gemma 4; KL bounds in nats (the float32 default is strict).

    ``all_tokens``: the verdict also needs every greedy token equal (float32). In bfloat16 two correct
    implementations round differently and part at a near tie, so ``experiment=parity-bf16`` holds the
    KL up to the first differing token to a stated bound and reports the tokens equal beside it.
    """

    kl_mean: float = 1.0e-6
    kl_max: float = 1.0e-5
    all_tokens: bool = True
    wrap_piece: int = 256  # long prompt: the ring's sliding slots at this piece (window + piece) + wrap_extra
    wrap_extra: int = 64

    def __post_init__(self) -> None:
        at_least("experiment.", self, 1, "wrap_piece")


def headline(record: Record) -> str:
    """The cell's one line: the parity verdict."""
    return f"parity {record.outputs['verdict']}"


LONG_SENTENCE = "The tide rolls over the reef, and the gulls count the waves until the evening light fades. "


def long_prompt(tokenizer: Any, tokens: int) -> list[int]:
    """BOS plus a fixed sentence repeated and cut to exactly ``tokens`` ids."""
    body = tokenizer.encode(LONG_SENTENCE, add_special_tokens=False)
    ids = [tokenizer.bos_token_id]
    while len(ids) < tokens:
        ids += body
    return ids[:tokens]


def kl_per_position(reference: torch.Tensor, engine: torch.Tensor) -> list[float]:
    """KL(reference || engine) in nats per row of [n, V] logits, computed in float64."""
    p = torch.log_softmax(reference.double(), dim=-1)
    q = torch.log_softmax(engine.double(), dim=-1)
    return (p.exp() * (p - q)).sum(-1).clamp_min(0).tolist()


def agreement(ref_ids: list[int], eng_ids: list[int]) -> tuple[int | None, int]:
    """The first position where the two greedy sequences differ (None: nowhere) and how many positions the KL
    covers: up to and including that one (after it the two condition on different text)."""
    first_diff = next((i for i, (a, b) in enumerate(zip(ref_ids, eng_ids, strict=True)) if a != b), None)
    return first_diff, len(ref_ids) if first_diff is None else first_diff + 1


def judged(first_diff: int | None, n: int, kl: list[float], bounds: Any) -> dict[str, Any]:
    """The fields every parity comparison shares: tokens equal, first difference, and the verdict of the
    tokens (when ``bounds.all_tokens``) and the KL's mean and maximum against the bounds."""
    tokens_ok = first_diff is None or not bounds.all_tokens
    passed = tokens_ok and max(kl) <= bounds.kl_max and sum(kl) / len(kl) <= bounds.kl_mean
    return {"tokens_equal": n if first_diff is None else first_diff, "max_new_tokens": n,
            "first_difference": first_diff, "verdict": "pass" if passed else "fail"}  # fmt: skip


def compare(
    ref_ids: list[int], ref_logits: torch.Tensor, eng_ids: list[int], eng_logits: torch.Tensor, bounds: Any
) -> dict[str, Any]:
    first_diff, upto = agreement(ref_ids, eng_ids)
    kl = kl_per_position(ref_logits[:upto], eng_logits[:upto])
    return {
        **judged(first_diff, len(ref_ids), kl, bounds),
        "kl_mean": sum(kl) / len(kl),
        "kl_max": max(kl),
        "kl_per_position": kl,
        "top5_reference": ref_logits[0].topk(5).indices.tolist(),
        "top5_engine": eng_logits[0].topk(5).indices.tolist(),
        "reference_ids": ref_ids,
        "engine_ids": eng_ids,
    }


def compare_top(
    ref_ids: list[int], ref_logits: torch.Tensor, eng_ids: list[int], tops: list[dict[int, float]], bounds: Any
) -> dict[str, Any]:
    """An engine that returns only its top-k log-probabilities (an endpoint): greedy tokens equal, and at each
    position up to the first differing token KL(reference || engine) restricted to the engine's k ids, both
    distributions renormalized over them (a lower bound on nothing: a figure of its own, so named)."""
    first_diff, upto = agreement(ref_ids, eng_ids)
    kl, top1 = [], 0
    for row, top in zip(ref_logits[:upto], tops[:upto], strict=True):
        ids = list(top)
        p = torch.log_softmax(row.double(), dim=-1)[ids]
        q = torch.tensor([top[i] for i in ids], dtype=torch.float64)
        p, q = p - torch.logsumexp(p, 0), q - torch.logsumexp(q, 0)
        kl.append(float((p.exp() * (p - q)).sum().clamp_min(0)))
        top1 += max(top, key=top.get) == int(row.argmax())
    return {
        **judged(first_diff, len(ref_ids), kl, bounds),
        "top1_same": top1,
        "topk": len(tops[0]),
        "topk_kl_mean": sum(kl) / len(kl),
        "topk_kl_max": max(kl),
        "topk_kl_per_position": kl,
        "reference_ids": ref_ids,
        "engine_ids": eng_ids,
        "definition": "KL(Transformers || engine) over the engine's top-k ids at each position, both renormalized "
        "over them, up to the first differing token",
    }


@dataclass(frozen=True)
class Reference:
    """Transformers' greedy tokens after a prompt, their logits [N, V], and the logits [L, V] of one forward
    over the whole sequence (prompt and those tokens, L of them): every position's distribution."""

    tokens: list[int]
    logits: torch.Tensor
    sequence_logits: torch.Tensor


REFERENCES: dict[tuple[Any, ...], Reference] = {}  # this process's reference outputs (see reference_outputs)


def reference_outputs(cell: Cell, prompts: dict[str, list[int]], n: int) -> dict[str, Reference]:
    """Greedy ids and logits of Transformers' own model for each prompt, and its logits at every position
    of prompt + those ids (one forward); the model is freed after.

    Computed once per process for the same checkpoint files (path, sizes and modification times), dtype,
    device, prompt and N: a parity sweep of several engines in one process loads the reference once.
    """
    cfg = cell.cfg
    ckpt = resolve(cfg.model, "bf16", cfg.cache_dir)
    files = tuple((f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in sorted(ckpt.path.glob("*.safetensors")))
    where = (str(ckpt.path), files, str(cfg.dtype), str(cell.device.torch_device), n)
    missing = {name: ids for name, ids in prompts.items() if (*where, tuple(ids)) not in REFERENCES}
    if missing:
        with quiet():
            model = load_reference(ckpt, cfg.dtype.torch, cell.device.torch_device)
            model.config._attn_implementation = "eager"
            for ids in missing.values():
                gen = expect_tokens(greedy_generate(model, ids, n, return_logits=True), n, "the reference")
                with torch.inference_mode():
                    sequence = model(torch.tensor([ids + gen.tokens], device=cell.device.torch_device))
                REFERENCES[(*where, tuple(ids))] = Reference(gen.tokens, gen.logits, sequence.logits[0].float().cpu())
        del model
        gc.collect()
    return {name: REFERENCES[(*where, tuple(ids))] for name, ids in prompts.items()}


def sequence_kl(engine: Any, ids: list[int], ref: Reference, result: Result) -> None:
    """The Colab article's definition (notebook 03: mean KL 0.001073 between JAX bf16 and PyTorch eager
    over 83 positions, the same top token at every one): every position of prompt + the reference's
    tokens, the engine teacher-forced (``SteppedEngine.teacher_forced``) against Transformers' one forward
    over the same sequence. Engines that cannot be teacher-forced say so."""
    if not isinstance(engine, SteppedEngine):
        result.outputs["sequence_kl"] = f"engine {engine.name} cannot be fed tokens step by step (teacher forcing)"
        return
    forced = engine.teacher_forced(ids + ref.tokens)
    kl = kl_per_position(ref.sequence_logits, forced)
    top1 = int((ref.sequence_logits.argmax(-1) == forced.argmax(-1)).sum())
    definition = "mean KL(Transformers || engine) over every position of prompt + generated, teacher-forced"
    result.measurements.update(
        parity_sequence_kl_mean=scalar(sum(kl) / len(kl), "nats", definition=definition, positions=len(kl)),
        parity_sequence_top1_same=scalar(top1, "positions", of=len(kl)),
    )


def top_parity(cell: Cell, name: str, ids: list[int], ref: Reference, result: Result) -> dict[str, Any]:
    """``compare_top`` for an engine that returns its top log-probabilities only; its measurements."""
    n, bounds = cell.cfg.max_new_tokens, cell.cfg.experiment
    tokens, tops = cell.engine.top_logprobs(ids, n)
    if len(tokens) != n or len(tops) != n:
        raise MethodError(f"engine {cell.engine.name} returned {len(tokens)} tokens and {len(tops)} positions of "
                          f"log-probabilities where {n} were asked")  # fmt: skip
    got = compare_top(ref.tokens, ref.logits, tokens, tops, bounds)
    prefix = "parity" if name == "prompt" else f"parity_{name}"
    topk = f"top-{got['topk']}: {got['definition']}"
    result.measurements.update(
        {
            f"{prefix}_tokens_equal": scalar(got["tokens_equal"], "tok", of=n),
            f"{prefix}_top1_same": scalar(got["top1_same"], "positions", of=len(got["topk_kl_per_position"])),
            f"{prefix}_topk_kl_mean": scalar(got["topk_kl_mean"], "nats", bound=bounds.kl_mean, definition=topk),
            f"{prefix}_topk_kl_max": scalar(got["topk_kl_max"], "nats", bound=bounds.kl_max, definition=topk),
            f"{prefix}_prompt_tokens": scalar(len(ids), "tok"),
        }
    )
    return {"status": "ok", "prompt_tokens": len(ids), **got}


def run(cell: Cell) -> Result:
    cfg, opened = cell.cfg, cell.opened
    if not opened.cls.returns_logits and not opened.cls.top_logprobs_k:  # nothing to compare the reference with
        raise EngineLimit(f"engine {opened.name} returns neither every logit of a position nor its top ones")
    n = cfg.max_new_tokens
    candidates = {"prompt": opened.encode(cfg.prompt)}
    window, piece = opened.checkpoint.config.sliding_window, cfg.experiment.wrap_piece
    candidates["long"] = long_prompt(opened.tokenizer, ring_slots(window, piece) + cfg.experiment.wrap_extra)
    prompts: dict[str, list[int]] = {}
    result = Result(timers={"parity": "not timed"})
    for name, ids in candidates.items():
        misfit = cell.misfit(len(ids))
        if misfit:
            result.outputs[name] = {"status": "skipped", "reason": misfit.reason, "prompt_tokens": len(ids)}
        else:
            prompts[name] = ids
    if not prompts:
        raise EngineLimit("no parity prompt fits: " + "; ".join(o["reason"] for o in result.outputs.values()))
    reference = reference_outputs(cell, prompts, n)
    cell.load()
    for name, ids in prompts.items():
        if not opened.cls.returns_logits:
            result.outputs[name] = top_parity(cell, name, ids, reference[name], result)
            continue
        gen = cell.call(ids, n, return_logits=True)
        ref = reference[name]
        got = compare(ref.tokens, ref.logits, gen.tokens, gen.logits, cfg.experiment)
        result.outputs[name] = {"status": "ok", "prompt_tokens": len(ids), **got}
        prefix = "parity" if name == "prompt" else f"parity_{name}"
        result.measurements.update(
            {
                f"{prefix}_tokens_equal": scalar(got["tokens_equal"], "tok", of=n),
                f"{prefix}_kl_mean": scalar(got["kl_mean"], "nats", bound=cfg.experiment.kl_mean),
                f"{prefix}_kl_max": scalar(got["kl_max"], "nats", bound=cfg.experiment.kl_max),
                f"{prefix}_first_token_kl": scalar(
                    got["kl_per_position"][0],
                    "nats",
                    definition="KL(Transformers || engine) of the first generated "
                    "token's distribution: the Rust article's parity figure (1.078e-05, Rust against Transformers)",
                ),
                f"{prefix}_prompt_tokens": scalar(len(ids), "tok"),
            }
        )
        if name == "prompt":
            sequence_kl(cell.engine, ids, ref, result)
    result.outputs["verdict"] = (
        "pass"
        if all(o.get("verdict", "pass") == "pass" for o in result.outputs.values() if isinstance(o, dict))
        else "fail"
    )
    return result
