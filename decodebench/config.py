"""Typed configuration for one benchmark cell: the core's part, registered with Hydra's ConfigStore.

Every group (engine, model, device, experiment, hardware) is a dataclass. Choices with a fixed set of
values are Enums, so OmegaConf rejects a bad value when the config is composed, naming the valid ones.
Each engine's and experiment's config class lives beside its class (``engines/``, ``experiments/``)
and registers itself; this module holds the run, the model, the device, the hardware and the bases.
A run is handed to engines and experiments as typed objects (``OmegaConf.to_object``), and each
object checks what types cannot (ranges, shape rules) in its own ``__post_init__``, before any model
is loaded: a bad value is a ``ConfigError`` naming the value and the rule.
"""

from __future__ import annotations

import re
import socket
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

import torch
from hydra.core.config_store import ConfigStore
from omegaconf import MISSING

DEFAULT_PROMPT = "Write a short paragraph about the ocean."


class ConfigError(ValueError):
    """A configuration that cannot run, with the numbers that make it so."""


def at_least(prefix: str, obj: Any, minimum: float, *names: str, why: str = "") -> None:
    """Each named field of ``obj`` is at least ``minimum``, or a ConfigError names ``prefix.field=value``."""
    for name in names:
        value = getattr(obj, name)
        if value < minimum:
            raise ConfigError(f"{prefix}{name}={value} must be at least {minimum}{why}")


def positive(prefix: str, obj: Any, *names: str, why: str = "") -> None:
    """Each named field of ``obj`` is above zero (None: unknown, allowed), or a ConfigError names it."""
    for name in names:
        value = getattr(obj, name)
        if value is not None and value <= 0:
            raise ConfigError(f"{prefix}{name}={value} must be positive{why}")


class DType(StrEnum):
    """The dtype a run computes in."""

    bfloat16 = "bfloat16"
    float16 = "float16"
    float32 = "float32"

    @property
    def torch(self) -> torch.dtype:
        return getattr(torch, self.value)


class DeviceKind(StrEnum):
    """``auto`` picks tpu, then cuda, then cpu."""

    auto = "auto"
    tpu = "tpu"
    cuda = "cuda"
    cpu = "cpu"


class Tables(StrEnum):
    """Which twin engines read: bf16 vocabulary tables (``-ct-text``) or int4 ones (``-emb4``)."""

    bf16 = "bf16"
    int4 = "int4"


class ModelSource(StrEnum):
    """A checkpoint the project builds, or a real one from the hub or a local path."""

    synthetic = "synthetic"
    hub = "hub"


@dataclass
class EngineConfig:
    """Base of every engine's typed config; ``name`` selects the engine class."""

    name: str = MISSING


@dataclass
class ExperimentConfig:
    """Base of every experiment's typed config; ``name`` selects the experiment."""

    name: str = MISSING


@dataclass
class ModelConfig:
    """A checkpoint: a synthetic one the project builds, or a real one from the hub or a path.

    Shape fields describe the synthetic model (they are the Gemma 4 text-config fields of the same
    name); for a hub or local checkpoint the checkpoint's own ``config.json`` decides the shape.
    ``full_attention_every=k`` makes every k-th layer (k-1, 2k-1, ...) full attention.
    """

    name: str = MISSING
    source: ModelSource = ModelSource.synthetic
    hub_id: str | None = None  # the W4A16 `-ct-text` repack
    emb4_hub_id: str | None = None  # its `-emb4` twin (vocabulary tables int4)
    path: str | None = None  # local copy of hub_id; wins over hub_id
    emb4_path: str | None = None  # local copy of emb4_hub_id
    tables: Tables = Tables.bf16  # which twin engines read by default
    seed: int = 0
    vocab_size: int = 4096
    hidden_size: int = 128
    intermediate_size: int = 256
    num_hidden_layers: int = 6
    num_attention_heads: int = 4
    num_key_value_heads: int = 1
    head_dim: int = 32
    global_head_dim: int = 64
    full_attention_every: int = 3
    sliding_window: int = 128
    num_kv_shared_layers: int = 2
    use_double_wide_mlp: bool = True
    hidden_size_per_layer_input: int = 32
    max_position_embeddings: int = 131072
    final_logit_softcapping: float = 30.0
    rms_norm_eps: float = 1e-6
    tokenizer_vocab: int = 3000  # BPE merges learnt for the synthetic tokenizer; the rest is filler

    def __post_init__(self) -> None:
        if self.source == ModelSource.synthetic:
            validate_synthetic_shape(self)


@dataclass
class DeviceConfig:
    """``kind=auto`` picks tpu, then cuda, then cpu; a named kind must exist or the run fails."""

    kind: DeviceKind = DeviceKind.auto


class PromptRead(StrEnum):
    """How the server's continuous batching reads a joining request's prompt: in one pass between two steps (the
    running rows wait for all of it), or one ``engine.piece`` of it between each two steps (they wait a piece)."""

    whole = "whole"
    pieces = "pieces"


@dataclass
class ServeConfig:
    """Where ``serve.py`` listens and what its server admits (not measured settings: the serve experiment
    always takes a free loopback port). Binds the loopback address unless told otherwise.

    ``max_body_bytes``: the largest request body read (more: a 413); a whole 131,328-token context sent
    as token ids is about 1 MB of JSON. ``max_queue``: requests (one per prompt) waiting for the engine
    beside those it decodes (more: a 429 with Retry-After). ``max_batch``: requests decoded together (continuous
    batching: a request joins at the next step and leaves at its end; an engine that batches, the ring); 1: one at
    a time. ``prompt_read``: how a joining request's prompt is read (``PromptRead``; with ``max_batch`` above 1).
    """

    host: str = "127.0.0.1"
    port: int = 8000
    max_body_bytes: int = 4 * 1024 * 1024
    max_queue: int = 64
    max_batch: int = 1
    prompt_read: PromptRead = PromptRead.whole

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"serve.port={self.port} must be 0 (a free port) to 65535")
        at_least("serve.", self, 1, "max_body_bytes", "max_queue", "max_batch")
        if self.prompt_read != PromptRead.whole and self.max_batch == 1:
            raise ConfigError(f"serve.prompt_read={self.prompt_read} has no effect with serve.max_batch=1: a request "
                              "served alone is read in one pass, nothing runs beside it")  # fmt: skip


@dataclass
class HardwareConfig:
    """Facts about the machine that derived figures need, each with its source.

    ``memory_bandwidth_gb_s`` null means: measure it on this machine (CPU) and record it as evidence.
    """

    name: str = MISSING
    description: str = ""
    price_usd_per_hour: float | None = None
    price_source: str = ""
    memory_gb: float | None = None
    memory_bandwidth_gb_s: float | None = None
    peak_bf16_tflops: float | None = None
    source: str = ""

    def __post_init__(self) -> None:
        positive("hardware.", self, *HARDWARE_NUMBERS, why=" (or null: unknown)")


@dataclass
class RunConfig:
    """One benchmark cell.  ``context`` is the cache length in tokens."""

    engine: EngineConfig = MISSING
    model: ModelConfig = MISSING
    device: DeviceConfig = MISSING
    experiment: ExperimentConfig = MISSING
    hardware: HardwareConfig = MISSING
    serve: ServeConfig = field(default_factory=ServeConfig)
    context: int = 256
    max_new_tokens: int = 64
    read_every: int = 0  # stepping engines: read tokens to the host every k tokens; 1 = streaming, 0 = at the end
    repeats: int = 5  # timed pairs per cell: enough for a median's 95% interval to leave out the extremes
    replica: int = 0  # an A/A copy of a cell: a sweep measures its own noise with replica=0,1 as its first axis
    seed: int = 0
    dtype: DType = DType.bfloat16
    prompt: str = DEFAULT_PROMPT
    chat_template: bool = True
    way: str | None = None  # the article's way this cell reproduces (conf/way/<article>/<row>.yaml sets it)
    sweep: str = "${now:%Y-%m-%d}"
    # null: evidence_dir/<sweep>/<cell>.json; a name, or auto (this machine's host name, read where the
    # cell runs): evidence_dir/<sweep>/<host>/<cell>.json, so machines sharing a folder or bucket never collide
    host: str | None = None
    resume: bool = False
    evidence_dir: str = "evidence/runs"
    cache_dir: str = ".cache"

    def __post_init__(self) -> None:
        validate_sweep(str(self.sweep))
        host_folder(self.host)
        at_least("", self, 2, "max_new_tokens", why=" (decode rate needs N-1 > 0)")
        at_least("", self, 1, "repeats")
        at_least("", self, 0, "replica")
        positive("", self, "context")
        if self.read_every < 0:
            raise ConfigError(f"read_every={self.read_every} must be 0 (read at the end) or a positive token count")


SWEEP_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
# The ModelConfig fields that decide a synthetic model's shape (decodebench.synthetic builds from them).
SHAPE_FIELDS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "global_head_dim",
    "full_attention_every",
    "sliding_window",
    "num_kv_shared_layers",
    "use_double_wide_mlp",
    "hidden_size_per_layer_input",
    "max_position_embeddings",
    "final_logit_softcapping",
    "rms_norm_eps",
    "tokenizer_vocab",
)
NOT_COUNTS = ("num_kv_shared_layers", "use_double_wide_mlp", "final_logit_softcapping", "rms_norm_eps")
POSITIVE_SHAPE_FIELDS = tuple(f for f in SHAPE_FIELDS if f not in NOT_COUNTS)
HARDWARE_NUMBERS = ("price_usd_per_hour", "memory_gb", "memory_bandwidth_gb_s", "peak_bf16_tflops")


def validate_folder(key: str, name: str, where: str) -> None:
    """``name`` (the value of ``key``) is one folder name, never a path."""
    if not SWEEP_NAME.fullmatch(name) or ".." in name:
        raise ConfigError(
            f"{key}={name!r} is not a folder name: use letters, digits, '.', '_' and '-' "
            f"(no '/', no '..', not starting with '.'); evidence goes to {where}"
        )


def validate_sweep(sweep: str) -> None:
    """A sweep name is one folder name under ``evidence_dir``, never a path."""
    validate_folder("sweep", sweep, "evidence_dir/<sweep>/")


def host_folder(host: str | None) -> str | None:
    """The folder a cell's evidence goes into below its sweep: none (``host`` null), this machine's
    host name (``auto``, read where the cell runs) or the name given."""
    if host is None:
        return None
    name = socket.gethostname() if host == "auto" else host
    validate_folder("host", name, "evidence_dir/<sweep>/<host>/")
    return name


def validate_synthetic_shape(model: Any) -> None:
    """The rules a synthetic Gemma 4 shape must follow before it is built, each named with its value."""
    for name in POSITIVE_SHAPE_FIELDS:
        if getattr(model, name) < 1:
            raise ConfigError(f"model.{name}={getattr(model, name)} must be at least 1")
    if model.num_attention_heads % model.num_key_value_heads:
        raise ConfigError(
            f"model.num_attention_heads={model.num_attention_heads} must be a multiple of "
            f"model.num_key_value_heads={model.num_key_value_heads} (grouped-query attention)"
        )
    for name in ("head_dim", "global_head_dim"):
        if getattr(model, name) % 2:
            raise ConfigError(f"model.{name}={getattr(model, name)} must be even (RoPE rotates pairs)")
    layers, shared, every = model.num_hidden_layers, model.num_kv_shared_layers, model.full_attention_every
    kinds = ["full" if (i + 1) % every == 0 else "sliding" for i in range(layers)]
    if not 0 <= shared < layers or not set(kinds[layers - shared :]) <= set(kinds[: layers - shared]):
        raise ConfigError(
            f"model.num_kv_shared_layers={shared} must leave, among the first num_hidden_layers - "
            f"num_kv_shared_layers layers, one of each attention type the shared layers use (their K/V "
            f"source); with num_hidden_layers={layers} and full_attention_every={every} the layers are {kinds}"
        )


def register_configs(cs: ConfigStore) -> None:
    """The core's structured configs: the run, the model and hardware schemas, and the device group."""
    cs.store(name="run_schema", node=RunConfig)
    cs.store(group="schema", name="model", node=ModelConfig)
    cs.store(group="schema", name="hardware", node=HardwareConfig)
    for kind in DeviceKind:
        cs.store(group="device", name=kind.value, node=DeviceConfig(kind=kind))
