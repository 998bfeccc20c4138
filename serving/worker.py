"""One thread owns the engine: requests queue to it and it decodes them one at a time, or, with
``serve.max_batch`` above 1 and an engine whose rows join a running batch (``joins``), several together
(``BatchWorker``: continuous batching).

The HTTP side (``serving.server``) never calls the engine. It submits a ``Job`` and reads the
job's events (token batches, then the ``Finished`` record) from an asyncio queue that this worker
fills with ``loop.call_soon_threadsafe``, so the event loop never waits on the model. The worker is
no thread of its own: ``serve_until`` runs on whichever thread built the engine (the Rust engine is
unsendable: PyO3 refuses every other thread), the server's main thread or a benchmark cell's.

Streaming and cancelling go through the engines' one hook, ``generate(on_tokens=...)``: each batch
of tokens read to the host (every ``read_every`` tokens) is cut after the token that ends the reply
(the job's ``StopRule``: an EOS id, a stop string) and handed to the job; the hook returns False, and
the decode stops after that batch, once the reply ended (``finish="stop"``) or the client has gone
(``finish="cancelled"``, counted as a cancel). Only a job with stop strings decodes text here (on
this thread, between batches, inside the engine's ``decode_s``); any other is cut on its ids alone.

Timers: ``read_s`` and ``decode_s`` are the engine's own (``engines.base``; None for an engine that
cannot split a call); ``queue_s`` is from ``submit`` to the engine taking the job, wall clock.
Log-probabilities, when a job asks for them, come from the logits ``generate`` returns (and, for an
echoed prompt, from ``Engine.prompt_logits``), computed after the call: outside its timers.
"""

from __future__ import annotations

import asyncio
import itertools
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from typing import Any
from uuid import uuid4

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from decodebench.config import ConfigError, PromptRead
from engines.base import Engine, Generation
from serving.text import Scores, StopRule, TextStream

SECONDS_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


class Metrics:
    """The server's Prometheus metrics, in a registry of its own (one per app)."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter(
            "decodebench_requests", "Requests the engine finished, by endpoint and finish reason",
            ["endpoint", "finish"], registry=r,
        )  # fmt: skip
        self.rejected = Counter("decodebench_rejected", "Requests answered with an error, by HTTP status", ["status"],
                                registry=r)  # fmt: skip
        self.cancels = Counter("decodebench_cancels", "Decodes cancelled because the client went away", registry=r)
        self.prompt_tokens = Counter("decodebench_prompt_tokens", "Prompt tokens read", registry=r)
        self.completion_tokens = Counter("decodebench_completion_tokens", "Tokens sent to clients", registry=r)
        self.in_flight = Gauge("decodebench_in_flight", "Requests accepted and not finished (queued or decoding)",
                               registry=r)  # fmt: skip
        self.queue_depth = Gauge("decodebench_queue_depth", "Requests waiting for the engine", registry=r)
        self.read_seconds = Histogram("decodebench_read_seconds", "Prompt read seconds, the engine's own timer",
                                      buckets=SECONDS_BUCKETS, registry=r)  # fmt: skip
        self.decode_seconds = Histogram("decodebench_decode_seconds", "Decode seconds, the engine's own timer",
                                        buckets=SECONDS_BUCKETS, registry=r)  # fmt: skip
        self.queue_seconds = Histogram("decodebench_queue_seconds", "Seconds a request waited for the engine",
                                       buckets=SECONDS_BUCKETS, registry=r)  # fmt: skip
        self.batch_rows = Gauge("decodebench_batch_rows", "Requests decoding together in the engine's step now",
                                registry=r)  # fmt: skip


@dataclass
class Job:
    """One prompt for the engine: its ids, the token budget, where the reply ends (``rule``), how many
    alternatives per position its log-probabilities carry (``logprobs``; None: none asked), whether the
    prompt is scored too (``score_prompt``, an echo), whether its client reads tokens as they come
    (``stream``; else its tokens go to the event loop once, at the end), and where its events go."""

    prompt_ids: list[int]
    max_tokens: int
    endpoint: str
    loop: asyncio.AbstractEventLoop
    rule: StopRule
    logprobs: int | None = None
    score_prompt: bool = False
    stream: bool = True
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancel: threading.Event = field(default_factory=threading.Event)
    id: str = field(default_factory=lambda: uuid4().hex[:24])
    submitted: float = 0.0

    def send(self, event: list[int] | Finished) -> None:
        """From the engine's thread to the job's event loop, without waiting."""
        self.loop.call_soon_threadsafe(self.events.put_nowait, event)


@dataclass
class Finished:
    """The server's own record of one request (the last event of its job).

    ``completion_tokens``: tokens sent to the client, the one that ended the reply (an EOS, the end of a
    stop string) included; ``engine_tokens``: tokens the engine made in ``decode_s`` (more when a batch
    ran past the end or a cancel); ``scores`` and ``prompt_scores`` (the prompt's tokens after its
    first): log-probabilities when the job asked for them and the decode was not cancelled.
    """

    id: str
    endpoint: str
    prompt_tokens: int
    completion_tokens: int
    engine_tokens: int
    finish: str  # stop, length, cancelled, error
    read_s: float | None
    decode_s: float | None
    queue_s: float
    started: float  # perf_counter when the engine took the job
    ended: float
    thread: str
    read_every: int
    error: str | None = None
    scores: Scores | None = None
    prompt_scores: Scores | None = None

    @property
    def engine_tok_s(self) -> float | None:
        """(engine tokens - 1) / decode_s: the first token comes from the prompt read."""
        if not self.decode_s or self.engine_tokens < 2:
            return None
        return (self.engine_tokens - 1) / self.decode_s

    def extension(self) -> dict[str, Any]:
        """The ``decodebench`` field of a response: the engine's own timers for this request."""
        keys = ("finish", "read_s", "decode_s", "engine_tokens", "queue_s", "read_every", "thread")
        return {**{k: getattr(self, k) for k in keys}, "engine_tok_s": self.engine_tok_s}

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "engine_tok_s": self.engine_tok_s}


class EngineWorker:
    """Owns one loaded engine; ``serve_until`` decodes queued jobs, one at a time, on the calling thread."""

    def __init__(self, engine: Engine, metrics: Metrics, read_every: int, keep: int = 256) -> None:
        self.engine, self.metrics, self.read_every = engine, metrics, read_every
        self.jobs: queue.Queue[Job] = queue.Queue()
        self.records: deque[Finished] = deque(maxlen=keep)
        self.busy = False
        self.owner: str | None = None

    def submit(self, job: Job) -> None:
        """Called from the event loop: queues the job (never waits)."""
        job.submitted = time.perf_counter()
        self.metrics.in_flight.inc()
        self.metrics.queue_depth.inc()
        self.jobs.put(job)

    def serve_until(self, done: Callable[[], bool], poll_s: float = 0.05) -> None:
        """Takes jobs in order until ``done()``; must run on the thread that built the engine."""
        self.owner = threading.current_thread().name
        while not done():
            try:
                job = self.jobs.get(timeout=poll_s)
            except queue.Empty:
                continue
            self.metrics.queue_depth.dec()
            self.alone(job)

    def alone(self, job: Job) -> None:
        """One job decoded on its own (``decode``), its record to the metrics and to its client."""
        self.busy = True
        try:
            record = self.decode(job)
        finally:
            self.busy = False
        self.account(record)
        job.send(record)

    def decode(self, job: Job) -> Finished:
        """The job through ``generate`` with the streaming hook; a failure becomes ``finish="error"``."""
        started = time.perf_counter()
        sent: list[int] = []
        finish = "cancelled" if job.cancel.is_set() else "length"
        ends = self.ending(job)

        def on_tokens(batch: list[int]) -> bool:
            nonlocal finish
            if job.cancel.is_set():
                finish = "cancelled"
                return False
            stop = next((i for i, t in enumerate(batch) if ends(t)), None)
            kept = batch if stop is None else batch[: stop + 1]
            sent.extend(kept)
            if job.stream:  # a client that waits for the whole reply wakes the event loop once, not per batch
                job.send(kept)
            if stop is not None:
                finish = "stop"
                return False
            return True

        read_s = decode_s = None
        made, error, scores = 0, None, {}
        if finish != "cancelled":  # a client that left while queued costs no decode
            try:
                with self.engine.reading_every(self.read_every):
                    gen = self.engine.generate(job.prompt_ids, job.max_tokens, on_tokens=on_tokens,
                                               return_logits=job.logprobs is not None)  # fmt: skip
                read_s, decode_s, made = gen.read_s, gen.decode_s, len(gen.tokens)
                if not job.stream and sent:
                    job.send(sent)
                if finish != "cancelled":
                    scores = self.score(job, gen, sent)
            except Exception as exc:  # the server keeps serving; the client gets the reason
                finish, error = "error", f"{type(exc).__name__}: {exc}"
        return Finished(
            id=job.id,
            endpoint=job.endpoint,
            prompt_tokens=len(job.prompt_ids),
            completion_tokens=len(sent),
            engine_tokens=made,
            finish=finish,
            read_s=read_s,
            decode_s=decode_s,
            queue_s=started - job.submitted,
            started=started,
            ended=time.perf_counter(),
            thread=threading.current_thread().name,
            read_every=self.read_every,
            error=error,
            **scores,
        )

    def ending(self, job: Job) -> Callable[[int], bool]:
        """Whether each next token ends the job's reply: its stop rule over the text when it has stop
        strings (decoded here), else over the ids alone (no text decoded on the engine's thread)."""
        if job.rule.stops:
            return TextStream(self.engine.tokenizer, job.rule).push
        count = itertools.count(1)
        return lambda token: job.rule.at_eos(token, next(count))

    def score(self, job: Job, gen: Generation, sent: list[int]) -> dict[str, Scores]:
        """The ``Finished`` fields the job asked for: the sent tokens' scores from the call's logits, and
        the prompt's from its logits at every position (row i predicts token i + 1)."""
        if job.logprobs is None:
            return {}
        scores = {"scores": Scores.of(gen.logits[: len(sent)], sent, job.logprobs)}
        if job.score_prompt:
            ids = job.prompt_ids
            scores["prompt_scores"] = Scores.of(self.engine.prompt_logits(ids)[:-1], ids[1:], job.logprobs)
        return scores

    def account(self, record: Finished) -> None:
        """The record into the metrics and the recent-records list."""
        m = self.metrics
        m.requests.labels(record.endpoint, record.finish).inc()
        if record.finish == "cancelled":
            m.cancels.inc()
        m.prompt_tokens.inc(record.prompt_tokens)
        m.completion_tokens.inc(record.completion_tokens)
        m.queue_seconds.observe(record.queue_s)
        if record.read_s is not None:
            m.read_seconds.observe(record.read_s)
        if record.decode_s is not None:
            m.decode_seconds.observe(record.decode_s)
        self.records.append(record)
        m.in_flight.dec()

    def idle(self) -> bool:
        """Nothing decoding and nothing queued."""
        return not self.busy and self.jobs.empty()

    def free_rows(self) -> int:
        """Jobs the engine would take at once (1 when idle: one at a time)."""
        return 0 if self.busy else 1


@dataclass
class Row:
    """A job decoding in a row of the batch: its timers so far, the tokens sent, the engine's own count."""

    job: Job
    started: float  # perf_counter when a row took the job
    read_s: float  # its prompt read, to its first token on the host
    first: float  # perf_counter at its first token
    ends: Callable[[int], bool]
    sent: list[int] = field(default_factory=list)
    made: int = 0
    finish: str | None = None


@dataclass
class Reading:
    """A job whose prompt is being read into a free row, a piece at a time (``Engine.admitting``)."""

    job: Job
    index: int  # the row it will take
    started: float  # perf_counter when the read began
    pieces: Iterator[Any]


class BatchWorker(EngineWorker):
    """Continuous batching over an engine that ``joins``: up to ``rows`` jobs decode together, one step making a
    token for each (a step runs the fewest rows that hold the busy ones; every such program compiled at start).
    A queued job joins at the next step: its prompt is read alone into a free row, between steps (``prompt_read``:
    ``whole``, all of it while the other rows wait; ``pieces``, one ``engine.piece`` between each two steps, so they
    wait a piece a step and the joining job waits for their steps), its first token sent at once; each step's tokens
    are read to the host and each row's end checked there (its stop rule, its budget, its client gone), a finished
    row freed for the next job. One prompt is read at a time. One client's cancel ends its row (or its read) only.
    A job that asks for log-probabilities needs its call's logits: it waits until the rows are empty and decodes alone
    (``EngineWorker.decode``).

    Timers per job: ``queue_s`` from submit to a row taking it (its read beginning); ``read_s`` its prompt read, other
    rows' steps between its pieces included; ``decode_s`` from its first token to its last on the host, other jobs'
    prompt reads in between included (what its client waited)."""

    def __init__(
        self, engine: Engine, metrics: Metrics, rows: int, prompt_read: PromptRead = PromptRead.whole, keep: int = 256
    ) -> None:
        super().__init__(engine, metrics, 1, keep)
        self.rows: list[Row | None] = [None] * rows
        self.prompt_read = prompt_read
        self.reading: Reading | None = None
        self.peak_rows = 0  # the most rows busy at once so far
        engine.open_rows(rows, warm=True)

    def free_rows(self) -> int:
        return self.rows.count(None)

    def serve_until(self, done: Callable[[], bool], poll_s: float = 0.05) -> None:
        """Admits queued jobs into free rows and steps the busy ones until ``done()``; on the engine's thread."""
        self.owner = threading.current_thread().name
        held: Job | None = None  # a job decoded alone once the rows are empty
        while not done():
            if held is not None and not any(self.rows) and self.reading is None:
                self.alone(held)
                held = None
            while held is None and self.reading is None and None in self.rows:
                try:
                    job = self.jobs.get(timeout=poll_s) if not any(self.rows) else self.jobs.get_nowait()
                except queue.Empty:
                    break
                self.metrics.queue_depth.dec()
                if job.logprobs is not None:
                    held = job
                else:
                    self.admit(job)
            if self.reading is not None:
                self.read_piece()
            if any(self.rows):
                self.step()
            self.busy = any(self.rows) or self.reading is not None
            self.metrics.batch_rows.set(len(self.rows) - self.free_rows())

    def admit(self, job: Job) -> None:
        """The job's prompt read into a free row: all of it now, or (``prompt_read=pieces``) a piece before each
        step from this one on (``serve_until``)."""
        index, started = self.rows.index(None), time.perf_counter()
        if job.cancel.is_set():  # a client that left while queued costs no prompt read
            self.close(Row(job, started, 0.0, started, self.ending(job), finish="cancelled"), index)
            return
        self.reading = Reading(job, index, started, self.engine.admitting(index, job.prompt_ids))
        while self.prompt_read == PromptRead.whole and self.reading is not None:
            self.read_piece()

    def read_piece(self) -> None:
        """The next piece of the prompt being read; after its last, the job takes its row and its first token is
        handed over (a client gone by then ends the row there, ``take``). A client gone between pieces, or a failed
        read, ends the read and the job."""
        reading = self.reading
        job, index, started = reading.job, reading.index, reading.started
        try:
            first = None if job.cancel.is_set() else next(reading.pieces)
        except Exception as exc:
            self.reading = None
            self.close(Row(job, started, 0.0, started, self.ending(job), finish="error"), index, str(exc))
            return
        if first is None and job.cancel.is_set():  # gone before its last piece: the row was never its
            self.reading = None
            self.close(Row(job, started, 0.0, started, self.ending(job), finish="cancelled"), index)
            return
        if first is None:
            return
        self.reading, now = None, time.perf_counter()
        self.rows[index] = row = Row(job, started, now - started, now, self.ending(job))
        self.peak_rows = max(self.peak_rows, len(self.rows) - self.free_rows())
        self.take(index, row, int(first.item()))

    def step(self) -> None:
        """One step of every row; each busy row's token to its job."""
        try:
            tokens = self.engine.step_rows().view(-1).tolist()
        except Exception as exc:  # every row's client gets the reason; the server keeps serving
            for index, row in enumerate(self.rows):
                if row is not None:
                    row.finish = "error"
                    self.close(row, index, f"{type(exc).__name__}: {exc}")
            return
        for index, row in enumerate(self.rows):
            if row is not None:
                self.take(index, row, tokens[index])

    def take(self, index: int, row: Row, token: int) -> None:
        """A row's next token: sent unless its client left; the row closed when the token ends the reply or the
        budget is spent."""
        row.made += 1
        job = row.job
        if job.cancel.is_set():
            row.finish = "cancelled"
        else:
            row.sent.append(token)
            if job.stream:
                job.send([token])
            if row.ends(token):
                row.finish = "stop"
            elif len(row.sent) >= job.max_tokens:
                row.finish = "length"
        if row.finish is not None:
            self.close(row, index)

    def close(self, row: Row, index: int, error: str | None = None) -> None:
        """The row's record to its job and the metrics; the row freed."""
        job, now = row.job, time.perf_counter()
        if self.rows[index] is row:
            self.rows[index] = None
            self.engine.release(index)
        if not job.stream and row.sent:
            job.send(row.sent)
        record = Finished(
            id=job.id,
            endpoint=job.endpoint,
            prompt_tokens=len(job.prompt_ids),
            completion_tokens=len(row.sent),
            engine_tokens=row.made,
            finish=row.finish or "error",
            read_s=row.read_s if row.made else None,
            decode_s=now - row.first if row.made else None,
            queue_s=row.started - job.submitted,
            started=row.started,
            ended=now,
            thread=threading.current_thread().name,
            read_every=1,
            error=error,
        )
        self.account(record)
        job.send(record)


def make_worker(
    engine: Engine, metrics: Metrics, read_every: int, max_batch: int, prompt_read: PromptRead = PromptRead.whole
) -> EngineWorker:
    """The server's worker: one job at a time (``max_batch`` 1), or up to ``max_batch`` decoding together for an
    engine whose rows join a running batch (``serve.max_batch``; refused by name for one whose do not), a joining
    prompt read as ``prompt_read`` says."""
    if max_batch <= 1:
        return EngineWorker(engine, metrics, read_every)
    if not engine.joins:
        raise ConfigError(f"serve.max_batch={max_batch}: engine {engine.name} takes no request into a running batch "
                          "(serve.max_batch=1); the ring does")  # fmt: skip
    return BatchWorker(engine, metrics, max_batch, prompt_read)
