"""Typed configuration for one benchmark cell, registered with Hydra's ConfigStore.

Every group (engine, model, device, experiment, hardware) is a dataclass. Choices with a fixed set
of values are Enums, so OmegaConf rejects a bad value when the config is composed, naming the valid
ones. Engines and experiments register their own configs (``engines.register_configs``,
``experiments.register_configs``); devices are stored here; models and hardware are YAML files of
facts under ``conf/``. ``validate`` checks what types cannot (ranges, shape rules) before any model
is loaded.
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


class StaticMode(StrEnum):
    """How ``static`` runs: strict eager, or TorchTPU's defer-and-fuse (TPU only)."""

    eager = "eager"
    fuse = "fuse"


class Attend(StrEnum):
    """Which slots the ring's full-attention layers read: every slot of the cache (the article's two
    programs), or the filled ones rounded up to a bucket (a program per bucket)."""

    cache = "cache"
    filled = "filled"


class LastPiece(StrEnum):
    """How the ring reads a prompt's last, partly filled piece: padded to a whole piece (the article's
    two programs), padded only to a power of two of at least 16 tokens (a program per length), or
    read at its exact length (a program per distinct length: what a short prompt costs exactly)."""

    padded = "padded"
    bucketed = "bucketed"
    exact = "exact"


class Weights(StrEnum):
    """How the W4A16 linears are held while they compute: dequantized at load, or 4-bit (engines/int4.py)."""

    dense = "dense"
    int4 = "int4"


class StepMatmul(StrEnum):
    """How the JAX engine's decode step multiplies a token by a weight: ``dot`` (XLA's dot in the run's
    dtype), ``upcast`` (XLA's dot in float32), ``reduce`` (a float32 multiply-and-sum), ``auto``:
    ``reduce`` on a CPU (XLA:CPU's bf16 dot takes a slow path), ``dot`` elsewhere."""

    auto = "auto"
    dot = "dot"
    upcast = "upcast"
    reduce = "reduce"


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
class GenerateEngineConfig(EngineConfig):
    """Hugging Face ``generate``: greedy, eager, dynamic cache."""


@dataclass
class FuseEngineConfig(EngineConfig):
    """``generate`` under TorchTPU's defer-and-fuse eager mode (TPU only)."""


@dataclass
class StaticEngineConfig(EngineConfig):
    """``generate`` over Transformers' StaticCache; ``mode=fuse`` runs it under defer-and-fuse (TPU only)."""

    mode: StaticMode = StaticMode.eager


@dataclass
class SteppingEngineConfig(EngineConfig):
    """What every compiled-step engine shares.

    ``backend``: auto (tpu on a TPU, inductor elsewhere), any torch.compile backend name, or none.
    """

    backend: str = "auto"
    fullgraph: bool = False
    weights: Weights = Weights.dense


@dataclass
class CompiledEngineConfig(SteppingEngineConfig):
    """One compiled decode step over a StaticCache (article 003, Steps 7-8).

    ``remove_wrappers=false``: the model is loaded through Transformers' own compressed-tensors path
    and compressed-tensors' module wrappers are left on (the article's "wrappers on" row, Step 8).
    """

    remove_wrappers: bool = True


@dataclass
class Table4EngineConfig(CompiledEngineConfig):
    """``compiled`` with the per-layer embedding table kept 4-bit (read from the -emb4 twin)."""


@dataclass
class RingEngineConfig(SteppingEngineConfig):
    """Ring KV cache (article 003, Step 10): prompts read in ``piece``-token pieces, two programs.

    ``attend=filled``: full-attention layers read only the slots up to the current position, rounded
    up to ``piece`` times a power of two (one compiled program per bucket used). ``last_piece=bucketed``:
    a short prompt costs about its length, not a whole piece. The defaults are the article's ring.
    """

    piece: int = 256
    attend: Attend = Attend.cache
    last_piece: LastPiece = LastPiece.padded


@dataclass
class RustEngineConfig(EngineConfig):
    """Gemma 4 in Rust over ATen (engines/rust/), with the ring cache's layout and pieces."""

    piece: int = 256


@dataclass
class JaxEngineConfig(EngineConfig):
    """Gemma 4 in ``jax.numpy`` under ``jax.jit`` (engines/jax_model.py): the ring cache's layout and
    pieces, two programs; ``weights=int4`` keeps every packed linear 4-bit, unpacked inside the step."""

    piece: int = 256
    weights: Weights = Weights.dense
    step_matmul: StepMatmul = StepMatmul.auto


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


@dataclass
class DeviceConfig:
    """``kind=auto`` picks tpu, then cuda, then cpu; a named kind must exist or the run fails."""

    kind: DeviceKind = DeviceKind.auto


@dataclass
class ExperimentConfig:
    name: str = MISSING


@dataclass
class DecodeExperimentConfig(ExperimentConfig):
    """The articles' method: warm 1-token and N-token calls, decode tok/s = (N-1)/(T_N - T_1)."""


@dataclass
class RecallExperimentConfig(ExperimentConfig):
    """Numbered records fill the context; the model is asked for one code (experiments/recall_prompts).

    ``repeats``: timed reads of each recall prompt (a long prompt's read already spans many pieces).
    """

    repeats: int = 1


@dataclass
class DefaultExperimentConfig(RecallExperimentConfig):
    """decode (with memory), then the recall prompts that fit the context."""


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


@dataclass
class ModesExperimentConfig(ExperimentConfig):
    """The device's execution modes on a stack of matrix multiplies; no model (article 003, Step 2 and its Tip).

    The stack is ``layers`` products of square matrices whose side is chosen so that one step does
    ``gflop`` GFLOP (the article's 275), divided by ``cpu_work_divisor`` on a CPU. ``steps``: timed warm
    steps per mode (median). The compile-count probe runs a row-wise function of width ``probe_width``
    at each of ``lengths`` rows, raw and padded up to a multiple of ``bucket``. The host-read probe runs
    ``read_steps`` steps with one ``.item()`` after each, and without. ``backend``: as ``engine.backend``.
    """

    gflop: float = 275.0
    layers: int = 16
    cpu_work_divisor: int = 512
    steps: int = 10
    lengths: list[int] = field(default_factory=lambda: [37, 64, 100, 200])
    bucket: int = 128
    probe_width: int = 512
    read_steps: int = 20
    backend: str = "auto"


@dataclass
class DiagnoseExperimentConfig(ExperimentConfig):
    """The article's claims about loading the repack through Transformers (article 003, Steps 3, 6, 7, 12).

    ``backend``: what compiles the step whose first graph break is reported; TorchDynamo finds graph
    breaks while it traces, before any backend runs, so ``eager`` finds the same break at a fraction
    of the cost (``auto``: the device's own backend). ``cache_slots``: the StaticCache length asked
    for in the Step 12 check (the article's 4,352).
    """

    backend: str = "eager"
    cache_slots: int = 4352


SERVE_PROMPTS = [
    "Write a short paragraph about the ocean.",
    "What is a TPU? Two sentences.",
    "Name three uses of a ring buffer.",
    "Explain greedy decoding in one sentence.",
    "Write a haiku about memory bandwidth.",
    "List four planets and one fact about each.",
    "Why does a key-value cache speed up decoding?",
    "Describe a lighthouse at night.",
]


@dataclass
class ServeExperimentConfig(ExperimentConfig):
    """The Rust article's served measurements through decodebench's OpenAI-compatible server.

    (a) ``requests`` non-streamed requests one at a time with the run's prompt at ``max_tokens``;
    (b) each of ``prompts`` streamed once (time to first token, inter-token latency, client tok/s);
    (c) a stream dropped after ``cancel_after`` chunks must move the cancel counter by one and leave
    the engine idle within ``idle_timeout_s`` seconds, else the cell fails. ``screenshot``: a picture of
    the chat page beside the evidence when a headless chromium is installed.
    """

    requests: int = 5
    max_tokens: int = 100
    prompts: list[str] = field(default_factory=lambda: list(SERVE_PROMPTS))
    cancel_after: int = 10
    idle_timeout_s: float = 30.0
    screenshot: bool = True


@dataclass
class ServeConfig:
    """Where ``python -m decodebench.serve`` listens (not a measured setting: the serve experiment
    always takes a free loopback port). Binds the loopback address unless told otherwise."""

    host: str = "127.0.0.1"
    port: int = 8000


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
    repeats: int = 2
    seed: int = 0
    dtype: DType = DType.bfloat16
    prompt: str = DEFAULT_PROMPT
    chat_template: bool = True
    sweep: str = "${now:%Y-%m-%d}"
    # null: evidence_dir/<sweep>/<cell>.json; a name, or auto (this machine's host name, read where the
    # cell runs): evidence_dir/<sweep>/<host>/<cell>.json, so machines sharing a folder or bucket never collide
    host: str | None = None
    resume: bool = False
    evidence_dir: str = "evidence/runs"
    cache_dir: str = ".cache"


class ConfigError(ValueError):
    """A configuration that cannot run, with the numbers that make it so."""


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


# JAX and PyTorch each hold a TPU for their process: cells of both frameworks need a process each.
OWN_PROCESS_ENGINES = ("jax",)


def validate_sweep_engines(engines: list[str], device_kind: str, launcher: str) -> None:
    """A sweep that mixes JAX and PyTorch engines on a TPU cannot run its cells in one process (the
    first framework to open the chip keeps it): it needs a fresh process per cell."""
    jax = sorted(set(engines) & set(OWN_PROCESS_ENGINES))
    torch_engines = sorted(set(engines) - set(OWN_PROCESS_ENGINES))
    if device_kind == "tpu" and launcher == "basic" and jax and torch_engines:
        raise ConfigError(
            f"engine={','.join(engines)} on a TPU mixes JAX ({', '.join(jax)}) with PyTorch engines "
            f"({', '.join(torch_engines)}): the first framework to open the chip holds it for the whole process, "
            "so these cells cannot share one; add hydra/launcher=isolated (a fresh process per cell)"
        )


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


def validate(cfg: Any) -> None:
    """Checks that need no model: raises ConfigError with every offending value named."""
    validate_sweep(str(cfg.sweep))
    host_folder(cfg.host)
    for name in HARDWARE_NUMBERS:
        value = getattr(cfg.hardware, name, None)
        if value is not None and value <= 0:
            raise ConfigError(f"hardware.{name}={value} must be positive (or null: unknown)")
    if cfg.model.source == "synthetic":
        validate_synthetic_shape(cfg.model)
    if getattr(cfg.experiment, "repeats", 1) < 1:
        raise ConfigError(f"experiment.repeats={cfg.experiment.repeats} must be at least 1")
    if cfg.max_new_tokens < 2:
        raise ConfigError(f"max_new_tokens={cfg.max_new_tokens} must be at least 2 (decode rate needs N-1 > 0)")
    if cfg.repeats < 1:
        raise ConfigError(f"repeats={cfg.repeats} must be at least 1")
    if cfg.context < 1:
        raise ConfigError(f"context={cfg.context} must be positive")
    if cfg.read_every < 0:
        raise ConfigError(f"read_every={cfg.read_every} must be 0 (read at the end) or a positive token count")
    if getattr(cfg.engine, "piece", 1) < 1:
        raise ConfigError(f"engine.piece={cfg.engine.piece} must be positive (prompt tokens read per piece)")
    if getattr(cfg.engine, "remove_wrappers", True) is False and (
        cfg.engine.name == "table4" or cfg.engine.weights == Weights.int4
    ):
        raise ConfigError(
            "engine.remove_wrappers=false loads through Transformers' compressed-tensors path, which unpacks "
            f"every weight to the run's dtype: it cannot keep weights 4-bit (engine={cfg.engine.name}, "
            f"engine.weights={cfg.engine.weights}); use engine=compiled engine.weights=dense"
        )
    validate_experiment(cfg.experiment)


def validate_experiment(experiment: Any) -> None:
    """Counts and sizes an experiment's config must keep positive (each named with its value)."""
    for name in ("layers", "cpu_work_divisor", "steps", "bucket", "probe_width", "read_steps", "cache_slots",
                 "requests", "max_tokens"):  # fmt: skip
        if getattr(experiment, name, 1) < 1:
            raise ConfigError(f"experiment.{name}={getattr(experiment, name)} must be at least 1")
    if getattr(experiment, "gflop", 1) <= 0:
        raise ConfigError(f"experiment.gflop={experiment.gflop} must be positive")
    if getattr(experiment, "cancel_after", 2) < 2:
        raise ConfigError(f"experiment.cancel_after={experiment.cancel_after} must be at least 2 chunks")
    if getattr(experiment, "idle_timeout_s", 1) <= 0:
        raise ConfigError(f"experiment.idle_timeout_s={experiment.idle_timeout_s} must be positive")
    if not list(getattr(experiment, "prompts", ["x"])):
        raise ConfigError("experiment.prompts is empty: the streamed part needs one prompt or more")
    lengths = list(getattr(experiment, "lengths", [1]))
    if not lengths or min(lengths) < 1:
        raise ConfigError(f"experiment.lengths={lengths} must be one or more positive row counts")


def register_configs(cs: ConfigStore) -> None:
    """The core's structured configs: the run, the model and hardware schemas, and the device group."""
    cs.store(name="run_schema", node=RunConfig)
    cs.store(group="schema", name="model", node=ModelConfig)
    cs.store(group="schema", name="hardware", node=HardwareConfig)
    for kind in DeviceKind:
        cs.store(group="device", name=kind.value, node=DeviceConfig(kind=kind))
