"""Experiment ``load``: the cell's engine behind decodebench's server, driven by AIPerf at several load levels.

The serve experiment is the Rust article's one-request-at-a-time method; this one asks what happens when
requests overlap. Served one request at a time (``serve.max_batch=1``), a request waits in the server's queue under
load: its TTFT grows by that wait, which the server's ``/metrics`` reports (``decodebench_queue_seconds``) beside the
client's figures; with ``serve.max_batch`` above 1 it joins the running batch instead (``serving.worker``).

Method, per level (``experiment.concurrency``: closed loop, that many requests always in flight;
``experiment.rate``: open loop, Poisson arrivals at that many requests a second), one AIPerf run
(``serving.aiperf``; its own environment, ``make setup``):

* ``warmup_requests`` requests first, once, not measured and not through AIPerf (the first compiles the
  engine's programs: prompts of the same lengths), then per level ``requests`` measured ones, each asking for
  exactly the run's ``max_new_tokens`` (``ignore_eos``; a level whose requests did not each get exactly that
  many tokens fails the cell).
* Prompts: ``synthetic`` (AIPerf's generator, ``prompt_tokens`` each, completions endpoint), ``recall``
  (the recall generator's prompt of at most ``prompt_tokens`` tokens, a new seed per request, chat), or a
  JSONL file (``{"text": ...}`` a line, chat); every text prompt is held to the fit rule first. Each level's
  prompts are its own (AIPerf's seed is ``seed`` plus the level's index; the recall prompts are drawn anew for the
  warm-up and for each level), so a server that keeps the prompts it has read (llama.cpp's, vLLM's prefix cache)
  reads every level's in full, as one that keeps none does: with one seed for all, llama.cpp's server took 60 of
  each 65-token prompt from its cache at the second and third levels. Each level records the prompt tokens the
  server said it took from a cache (``prompt_cache_read_tokens``), and with synthetic prompts (which share nothing
  but their first token) a check holds it to none.
* Per level: requests, errors, request throughput (req/s) and output tok/s over AIPerf's benchmark
  duration; TTFT, TPOT, ITL and E2EL mean / p50 / p90 / p99 (seconds; AIPerf's names in
  ``serving.aiperf``); goodput (requests a second meeting both SLOs, ``experiment.slo``); and the server's
  own count and mean of queue, read and decode seconds over the same requests (its ``/metrics`` read just
  before and just after the level: nothing else reaches the server in between). The server must count
  exactly the requests AIPerf completed. ``ttft_less_queue_s`` = mean TTFT - mean
  queue seconds: what a request costs once the engine takes it.

Before serving, the bare engine on the run's prompt (the decode experiment's pairs at the server's
``read_every``: ``bare_decode_tok_s``); per level ``engine_tok_s`` = (N-1) / the mean of the engine's own
decode seconds inside the server and ``engine_over_bare``, so a reader sees what the load (and AIPerf
beside it on the same cores) costs the engine itself.

An engine that an OpenAI-compatible server already serves (``engine=openai``: vLLM, SGLang, llama.cpp's server,
another machine's ``serve.py``) is loaded where it is served: AIPerf drives that endpoint, and the server's
own figures come only from a decodebench server (another names its metrics its own way: none, said so).

AIPerf runs on the same machine as the engine (its processes are the cell's children: their CPU is the
cell's own, not contention), on CPUs of its own unless told otherwise (``experiment.generator_cpus``,
``decodebench.placement``: by default the last core, the server, in-process or a peer's, and the bare figures on
the rest; recorded as ``outputs.placement``); its exports are kept beside the evidence
(``<evidence file>.aiperf/<level>/``).
"""

from __future__ import annotations

import gzip
import json
import shutil
import statistics
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from decodebench.config import ConfigError, ExperimentConfig, at_least, positive
from decodebench.evidence import AIPERF_EXPORTS, Record, samples, scalar
from decodebench.placement import AUTO, SHARED, Placement, applied, parse_cpus, place
from experiments import recall_prompts
from experiments.cell import Cell, MethodError
from experiments.common import Result
from experiments.serve import bare, check_fit, scrape, serve_while
from serving import aiperf

PROMPT_SOURCES = ("synthetic", "recall")  # or a path to a JSONL file
DEFAULT_PROMPT_TOKENS = 64
RECORDS_FILE = "profile_export.jsonl"  # AIPerf's per-request records, kept gzipped
TOOL_TIMEOUT_S = 3600.0
PEAK = "the highest AIPerf output token throughput over the levels"
FRESH_PROMPTS = "no prompt token of any level taken from the server's prompt cache"


@dataclass
class SloConfig:
    """Service-level objectives a request must meet to count toward goodput (DistServe's definition, as
    AIPerf computes it): time to first token and time per output token, seconds. The defaults: a reply
    that starts within 2 s and then comes at a reader's pace (10 tokens a second)."""

    ttft_s: float = 2.0
    tpot_s: float = 0.1


@dataclass
class LoadExperimentConfig(ExperimentConfig):
    """Load levels against the cell's engine behind decodebench's server (see the module docstring).

    ``concurrency``: closed-loop levels; ``rate``: open-loop Poisson levels (requests a second); one AIPerf
    run each, in this order. ``prompts``: ``synthetic``, ``recall`` or a JSONL path; ``prompt_tokens``: the
    synthetic prompts' length, or the recall prompts' largest (64 unless given; refused with a JSONL file, whose
    lines are sent as they are); ``seed``: AIPerf's (plus each level's index) and the recall prompts'.
    ``generator_cpus``: where AIPerf runs, the server on the other CPUs (``auto``, ``shared`` or a CPU list:
    ``decodebench.placement``).
    """

    concurrency: list[int] = field(default_factory=lambda: [1, 2, 4])
    rate: list[float] = field(default_factory=list)
    requests: int = 8
    warmup_requests: int = 2
    prompts: str = "synthetic"
    prompt_tokens: int | None = None  # synthetic and recall prompts: DEFAULT_PROMPT_TOKENS unless given
    seed: int = 0
    slo: SloConfig = field(default_factory=SloConfig)
    generator_cpus: str = AUTO

    def __post_init__(self) -> None:
        at_least("experiment.", self, 1, "requests", "warmup_requests")
        if self.generator_cpus not in (AUTO, SHARED):
            parse_cpus(str(self.generator_cpus))
        if self.prompt_tokens is not None and self.prompt_tokens < 1:
            raise ConfigError(f"experiment.prompt_tokens={self.prompt_tokens} must be at least 1")
        positive("experiment.slo.", self.slo, "ttft_s", "tpot_s")
        if not self.concurrency and not self.rate:
            raise ConfigError("experiment.concurrency and experiment.rate are both empty: no load level to run")
        for c in self.concurrency:
            if c < 1:
                raise ConfigError(f"experiment.concurrency holds {c}: each level is at least 1 request in flight")
        for r in self.rate:
            if r <= 0:
                raise ConfigError(f"experiment.rate holds {r}: each level is a positive request rate (req/s)")
        if self.prompts not in PROMPT_SOURCES and not self.prompts.endswith(".jsonl"):
            raise ConfigError(
                f"experiment.prompts={self.prompts!r}: one of {', '.join(PROMPT_SOURCES)} or a path to a .jsonl file"
            )
        if self.prompts not in PROMPT_SOURCES and self.prompt_tokens is not None:
            raise ConfigError(f"experiment.prompt_tokens={self.prompt_tokens} has no effect on the prompts of "
                              f"{self.prompts}: each line is sent as it is")  # fmt: skip

    @property
    def target_tokens(self) -> int:
        """The synthetic prompts' length, or the recall prompts' largest."""
        return DEFAULT_PROMPT_TOKENS if self.prompt_tokens is None else self.prompt_tokens

    def levels(self) -> list[aiperf.Level]:
        return [aiperf.Level("concurrency", c) for c in self.concurrency] + [aiperf.Level("rate", r) for r in self.rate]


def headline(record: Record) -> str:
    """The cell's one line: each level's request rate, output tok/s and median TTFT."""
    parts = [
        f"{level['level']}: {level['request_rate_req_s']:.2f} req/s, {level['output_tok_s']:.1f} tok/s, "
        f"TTFT p50 {level['ttft_s']['p50']:.3f} s"
        for level in record.outputs["levels"]
    ]
    synthetic = " (synthetic weights)" if record.model.get("synthetic") else ""
    return "load: " + "; ".join(parts) + synthetic


def text_prompts(cell: Cell, count: int) -> list[str] | None:
    """The texts every request of every level draws from (AIPerf cycles through them), each held to the
    fit rule; None for AIPerf's synthetic prompts."""
    exp = cell.cfg.experiment
    if exp.prompts == "synthetic":
        cell.require_fit(exp.target_tokens + 1)  # AIPerf's prompt, re-read by the server: one token either way
        return None
    if exp.prompts == "recall":
        template = recall_prompts.build(cell.opened.tokenizer, exp.target_tokens, exp.seed, cell.cfg.chat_template)
        texts = [recall_prompts.text(exp.seed + i, template.records)[0] for i in range(count)]
    else:
        path = Path(exp.prompts)
        try:
            lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        except (OSError, ValueError) as exc:
            raise ConfigError(f"experiment.prompts={exp.prompts}: {exc}") from exc
        texts = [line.get("text") if isinstance(line, dict) else None for line in lines]
        if not texts or not all(isinstance(t, str) and t for t in texts):
            raise ConfigError(f"experiment.prompts={exp.prompts}: each line must be a JSON object with a text field")
    for text in texts:
        cell.require_fit(len(cell.opened.encode(text)))
    return texts


def level_texts(texts: list[str] | None, exp: LoadExperimentConfig, index: int) -> list[str] | None:
    """The texts level ``index`` sends (-1: the warm-up): its own share of the recall prompts (``text_prompts``
    drew the warm-up's and every level's), or a JSONL file's lines at every level (the user's prompts as they are)."""
    if texts is None or exp.prompts != "recall":
        return texts
    first = exp.warmup_requests + index * exp.requests if index >= 0 else 0
    return texts[first : first + (exp.requests if index >= 0 else exp.warmup_requests)]


def fresh_prompts_check(levels: list[dict[str, Any]]) -> dict[str, Any]:
    """Synthetic prompts share nothing but their first token, and each level has its own: a server that says it
    took prompt tokens from a cache of its own read a prompt it had read before, which the method rules out."""
    cached = {lv["level"]: lv["prompt_cache_read_tokens"] for lv in levels if lv["prompt_cache_read_tokens"]}
    detail = ", ".join(f"{name}: {tokens:g} tokens" for name, tokens in cached.items()) or "none"
    return {"rule": FRESH_PROMPTS, "holds": not cached,
            "detail": f"taken from the cache: {detail}"}  # fmt: skip


def keep_exports(run_dir: Path, kept: Path) -> list[str]:
    """AIPerf's summary and its per-request records (gzipped) from ``run_dir`` into ``kept``."""
    kept.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(run_dir / aiperf.CLIENT_EXPORT, kept / aiperf.CLIENT_EXPORT)
    names = [aiperf.CLIENT_EXPORT]
    records = run_dir / RECORDS_FILE
    if records.exists():
        with records.open("rb") as src, gzip.open(kept / f"{RECORDS_FILE}.gz", "wb") as dst:
            shutil.copyfileobj(src, dst)
        names.append(f"{RECORDS_FILE}.gz")
    return names


def held_to_method(level: str, figures: dict[str, Any], n: int) -> None:
    """A level's figures (``serving.aiperf.read_level``) describe the method, or a MethodError says how
    not: at least one request completed, each with exactly ``n`` tokens, and the server's ``/metrics``
    counted exactly the requests AIPerf completed (the two sides describe the same requests)."""
    tokens, server = figures["output_tokens"], figures["server"]
    if figures["requests"] < 1:
        raise MethodError(f"AIPerf at {level} completed no request ({figures['errors']} errors)")
    if tokens.get("min") != n or tokens.get("max") != n:
        got = f"{tokens.get('min')}-{tokens.get('max')}"
        raise MethodError(f"at {level} requests got {got} tokens each, not exactly {n} (ignore_eos)")
    if server is not None and server["queue_s"]["count"] != figures["requests"]:
        raise MethodError(
            f"at {level} the server's /metrics counted {server['queue_s']['count']} requests taken by the engine where "
            f"AIPerf completed {figures['requests']}: the two sides do not describe the same requests"
        )


def server_figures(before: dict[str, float] | None, after: dict[str, float] | None) -> dict[str, Any] | None:
    """decodebench's own figures between two reads of its ``/metrics`` (``serve.scrape``): requests answered,
    queue seconds (count and sum) and the engine's mean read and decode seconds; None for a server that is not
    decodebench's (another names its metrics its own way) or that has no ``/metrics``."""
    if before is None or after is None or "decodebench_queue_seconds_count" not in after:
        return None

    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    def mean(name: str) -> float | None:
        count = delta(f"decodebench_{name}_seconds_count")
        return delta(f"decodebench_{name}_seconds_sum") / count if count else None

    return {"requests": int(delta("decodebench_requests_total")),
            "queue_s": {"count": int(delta("decodebench_queue_seconds_count")),
                        "sum": delta("decodebench_queue_seconds_sum")},
            "read_s_avg": mean("read"), "decode_s_avg": mean("decode")}  # fmt: skip


def metrics(url: str) -> dict[str, float] | None:
    """The server's ``/metrics``, or None where it has none."""
    try:
        return scrape(url)
    except (httpx.HTTPError, ValueError):
        return None


def warm_up(url: str, model: str, texts: list[str] | None, prompt_ids: list[int], n: int, count: int) -> None:
    """``count`` unmeasured requests of the levels' shapes (each text in turn, or token ids as long as a
    synthetic prompt is read), exactly ``n`` tokens each, so that no level pays a first compile."""
    from openai import OpenAI

    client = OpenAI(base_url=f"{url}/v1", api_key="decodebench", max_retries=0, timeout=TOOL_TIMEOUT_S)
    exact = {"ignore_eos": True}
    for i in range(count):
        if texts is None:
            client.completions.create(model=model, prompt=prompt_ids, max_tokens=n, extra_body=exact)
        else:
            turn = [{"role": "user", "content": texts[i % len(texts)]}]
            client.chat.completions.create(model=model, messages=turn, max_tokens=n, extra_body=exact)


def run_level(
    url: str, model: str, cell: Cell, level: aiperf.Level, work: aiperf.Workload, kept: Path, placement: Placement
) -> dict:
    """One AIPerf run at ``level`` on the generator's CPUs, the server's ``/metrics`` read just before and just after
    it; its record, held to the method's contracts."""
    before = metrics(url)
    with tempfile.TemporaryDirectory(prefix=f"aiperf-{level.name}-") as tmp:
        out = Path(tmp)
        command = aiperf.level_command(url, model, cell.opened.checkpoint.path.resolve(), level, work, out)
        done = subprocess.run(placement.command(command), capture_output=True, text=True, timeout=TOOL_TIMEOUT_S,
                              cwd=tmp, env=aiperf.environment(out))  # fmt: skip
        if done.returncode != 0:
            log = out / "logs" / "aiperf.log"
            text = (done.stdout + done.stderr + (log.read_text() if log.exists() else "")).strip()
            errors = [line for line in text.splitlines() if "ERROR" in line or "Error" in line]
            tail = "\n".join(errors or text.splitlines()[-15:])[-3000:]
            raise MethodError(f"AIPerf at {level.name} exited {done.returncode}:\n{tail}")
        after = metrics(url)
        try:
            figures = {**aiperf.read_level(out), "server": server_figures(before, after)}
        except aiperf.ToolError as exc:
            raise MethodError(f"AIPerf at {level.name}: {exc}") from exc
        files = keep_exports(out, kept / level.name)
    held_to_method(level.name, figures, work.output_tokens)
    server = figures["server"]
    queue = server["queue_s"]["sum"] / server["queue_s"]["count"] if server else None
    return {"level": level.name, "mode": level.mode, "value": level.value, **figures,
            "ttft_less_queue_s": figures["ttft_s"]["avg"] - queue if server else None, "files": files,
            "command": " ".join(command[1:])}  # fmt: skip


def run(cell: Cell, result: Result | None = None) -> Result:
    """The levels with the generator and the server placed (``experiment.generator_cpus``); this process's CPUs
    and threads as they were afterwards."""
    reason = aiperf.missing()
    if reason:
        raise MethodError(reason)
    placement = place(cell.cfg.experiment.generator_cpus)
    with applied(placement):
        return run_placed(cell, placement, result or Result())


def run_placed(cell: Cell, placement: Placement, result: Result) -> Result:
    cfg, exp = cell.cfg, cell.cfg.experiment
    texts = text_prompts(cell, exp.warmup_requests + exp.requests * len(exp.levels()))
    (ids,) = check_fit(cell, [cfg.prompt])
    cell.load()
    read_every = max(cfg.read_every, 1)
    with cell.engine.reading_every(read_every):
        _, warmup_s, base = bare(cell, ids)
    kept, kept_name = cell.beside(AIPERF_EXPORTS)

    tokens = exp.target_tokens  # the synthetic prompts' length: the warm-up reads as many

    def clients(url: str, model: str, _worker: Any) -> list[dict[str, Any]]:
        with tempfile.TemporaryDirectory(prefix="decodebench-load-") as tmp:
            synthetic = (ids * (tokens // len(ids) + 2))[: tokens + 1]  # read as long as AIPerf's prompt is
            warm_up(url, model, level_texts(texts, exp, -1), synthetic, cfg.max_new_tokens, exp.warmup_requests)
            records = []
            for index, level in enumerate(exp.levels()):
                input_file = None
                if texts is not None:
                    input_file = Path(tmp) / f"prompts-{level.name}.jsonl"
                    input_file.write_text("".join(json.dumps({"text": t}) + "\n"
                                                  for t in level_texts(texts, exp, index)))  # fmt: skip
                work = aiperf.Workload(exp.requests, cfg.max_new_tokens, tokens, input_file, exp.slo.ttft_s,
                                       exp.slo.tpot_s, exp.seed + index)  # fmt: skip
                records.append({**run_level(url, model, cell, level, work, kept, placement), "seed": work.seed})
            return records

    endpoint = cell.engine.endpoint()
    if endpoint is not None:  # a server already serves the engine: AIPerf loads it there
        levels, info = clients(*endpoint, None), cell.engine.describe()
    else:
        levels, served, _ = serve_while(cell, warmup_s, read_every, clients)
        info = served.info
    bare_rate = statistics.median(base.rates) if base.rates else None
    for level in levels:  # the engine's own decode rate inside the server, against the bare engine's
        decode_s = level["server"]["decode_s_avg"] if level["server"] else None
        level["engine_tok_s"] = (cfg.max_new_tokens - 1) / decode_s if decode_s else None
        level["engine_over_bare"] = level["engine_tok_s"] / bare_rate if level["engine_tok_s"] and bare_rate else None
    best = max(levels, key=lambda level: level["output_tok_s"])
    result.measurements.update(
        load_s=scalar(cell.load_s, "s"),
        peak_output_tok_s=scalar(best["output_tok_s"], "tok/s", level=best["level"], method=PEAK),
        max_new_tokens=scalar(cfg.max_new_tokens, "tok"),
    )
    if base.rates:
        result.measurements["bare_decode_tok_s"] = samples(
            base.rates, "tok/s", formula="(N-1)/(T_N-T_1)", read_every=read_every, prompt="the run's prompt"
        )
    result.outputs["checks"] = [base.check()]
    if exp.prompts == "synthetic":
        result.outputs["checks"].append(fresh_prompts_check(levels))
    result.outputs.update(
        levels=levels,
        read_every=read_every,
        prompts=exp.prompts,
        slo={"ttft_s": exp.slo.ttft_s, "tpot_s": exp.slo.tpot_s},
        exports=kept_name,
        engine_info=info,
        placement=placement.record(),
        tool=f"AIPerf (locks/aiperf.txt, its own environment .venv-aiperf), on this machine; {placement.how}",
    )
    result.timers.update(
        ttft_s="AIPerf: request sent to the first token's chunk (client)",
        tpot_s="AIPerf's inter_token_latency: (E2EL - TTFT) / (tokens - 1) per request",
        itl_s="AIPerf's inter_chunk_latency: gaps between consecutive chunks, read_every tokens a chunk",
        e2el_s="AIPerf's request_latency: request sent to the last chunk",
        queue_s="server: submit to the engine taking the request (decodebench_queue_seconds)",
        engine_tok_s="(N-1) / the level's mean decode_s, the engine's own timer inside the server",
        bare_decode_tok_s="(N-1)/(warm_n_s - warm_1_s) on the run's prompt before serving, at the server's read_every, "
                          "on the server's CPUs and threads (outputs.placement)",
    )
    return result
