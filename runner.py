"""The cell runner, above the core package, the engines and the experiments: runs one cell end to
end and writes its evidence, whatever happens; summarises a multirun from its sweep folder."""

from __future__ import annotations

import signal
import sys
import threading
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import fields
from pathlib import Path
from typing import Any

from hydra.core.config_store import ConfigStore
from hydra.core.hydra_config import HydraConfig
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.experimental.callback import Callback
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from decodebench import evidence, hardware, pages
from decodebench.checkpoint import CheckpointError
from decodebench.config import ConfigError, RunConfig, host_folder, validate_sweep
from decodebench.config import register_configs as register_core
from decodebench.device import DeviceHeld, DeviceUnavailable, resolve_device, tpu_present
from decodebench.environment import Contention, capture
from decodebench.files import cannot_write, disk_of
from engines import ENGINES, cpu_kernels, engine_class, takers
from engines import register_configs as register_engines
from engines.base import EngineLimit
from engines.open import open_engine
from experiments import EXPERIMENTS
from experiments import register_configs as register_experiments
from experiments.cell import Cell, MethodError
from experiments.common import Result

SERVING_EXPERIMENTS = ("serve", "load")  # the experiments that put the engine behind the server (serve.max_batch)
EXPECTED = (ConfigError, DeviceUnavailable, CheckpointError, MethodError)


class Stopped(BaseException):
    """SIGTERM, raised in a cell's main thread so that the cell writes its evidence before the process ends.
    A BaseException, as KeyboardInterrupt is, so that no ``except Exception`` on the way swallows it."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


@contextmanager
def stop_raises() -> Iterator[None]:
    """While a cell runs in the main thread, SIGTERM raises ``Stopped`` instead of ending the process at once
    (Python's default, which leaves no evidence); the handler before it is restored after. A process that
    ignores SIGTERM keeps ignoring it."""
    main = threading.current_thread() is threading.main_thread()  # only the main thread may set a handler
    if not main or signal.getsignal(signal.SIGTERM) == signal.SIG_IGN:
        yield
        return

    def _raise(signum: int, _frame: Any) -> None:
        raise Stopped(signum)

    previous = signal.signal(signal.SIGTERM, _raise)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def register_configs() -> None:
    """Every structured config Hydra composes a cell from: core, engines, experiments."""
    cs = ConfigStore.instance()
    register_core(cs)
    register_engines(cs)
    register_experiments(cs)


def typed_config(cfg: DictConfig) -> RunConfig:
    """The composed config as typed objects (``OmegaConf.to_object``), each checking itself in its
    ``__post_init__``. A key the engine's or experiment's config class does not declare (given once
    beside a sweep of engines, or mistyped) is refused by name, never silently dropped."""
    for group, takes in (("engine", takers), ("experiment", None)):
        node = cfg[group]
        declared = {f.name for f in fields(OmegaConf.get_type(node))}
        unknown = sorted(set(node.keys()) - declared)
        if unknown:
            refuse_way_change(cfg, group, unknown)
            settings = ", ".join(f"{group}.{key}" for key in unknown)
            who = "; ".join(f"{group}.{key} is a setting of {', '.join(takes(key)) or 'no engine'}"
                            for key in unknown) if takes else ""  # fmt: skip
            raise ConfigError(
                f"{group} {node.name} has no setting {settings} (its settings: "
                f"{', '.join(sorted(declared - {'name'})) or 'none'}){'; ' + who if who else ''}"
            )
    return OmegaConf.to_object(cfg)


WAYS = Path(__file__).resolve().parent / "conf" / "way"


def way_settings(way: str) -> dict[str, Any]:
    """What ``conf/way/<way>.yaml`` sets, as dotted keys: the engine and experiment it selects and each value."""
    spec = OmegaConf.load(WAYS / f"{way}.yaml")
    settings = {}
    for entry in spec.pop("defaults", []):
        for key, value in (entry.items() if isinstance(entry, DictConfig) else []):
            settings[f"{key.removeprefix('override /')}.name"] = value
    flat = OmegaConf.to_container(spec)
    for key, value in flat.items():
        for sub, inner in (value.items() if isinstance(value, dict) else [(None, value)]):
            settings[f"{key}.{sub}" if sub else key] = inner
    return settings


def refuse_way_change(cfg: DictConfig, group: str, unknown: list[str]) -> None:
    """A way selects its ``group`` (``engine=generate``) and sets that choice's settings; when the command line
    chose another (``engine=ring``), which lacks some of them (``unknown``), the way and the change are the cause,
    and the error names them (not only the settings the other choice lacks). Nothing to say otherwise."""
    way = cfg.get("way")
    settings = way_settings(way) if way and (WAYS / f"{way}.yaml").is_file() else {}
    chosen = settings.get(f"{group}.name")
    if chosen is None or chosen == cfg[group].name:
        return
    own = ", ".join(f"{k}={v}" for k, v in settings.items() if k.startswith(f"{group}.") and k != f"{group}.name")
    lacks = ", ".join(f"{group}.{key}" for key in unknown)
    raise ConfigError(
        f"way={way} (conf/way/{way}.yaml) sets {group}={chosen}{' with ' + own if own else ''}, and the "
        f"command line changed the {group} to {cfg[group].name}, which has no setting {lacks}: drop way= to run "
        f"{group}={cfg[group].name}, or drop {group}={cfg[group].name} to run the way"
    )


def way_checks(ways: list[str]) -> list[str]:
    """One way for each distinct engine and engine settings among ``ways`` (the first, in the order given): the
    ways whose parity checks cover them all (a check covers every cell of its engine, settings, model and dtype)."""
    first: dict[str, str] = {}
    for way in ways:
        engine = {k: v for k, v in way_settings(way).items() if k.startswith("engine.")}
        first.setdefault(repr(sorted(engine.items())), way)
    return list(first.values())


def check_way(run: RunConfig) -> None:
    """A cell named for an article's way runs that way: every value the way sets must still hold (a command
    line may add settings the way leaves open, such as the model, never change one it sets). The one change
    allowed is the way's parity check: ``experiment=parity`` or ``parity-bf16`` in place of the way's experiment
    and its settings (its engine, settings, context and N kept)."""
    if run.way is None:
        return
    check = run.experiment.name == "parity"
    changed = []
    for key, value in way_settings(run.way).items():
        if check and key.startswith("experiment."):
            continue
        have: Any = run
        for part in key.split("."):
            have = getattr(have, part)
        if str(have) != str(value):
            changed.append(f"{key}={have} (the way sets {value})")
    if changed:
        raise ConfigError(f"way={run.way} is not run as the article ran it: {'; '.join(changed)}; "
                          "drop way= or the override")  # fmt: skip


def validate_sweep_engines(engines: list[str], device_kind: str, launcher: str) -> None:
    """A sweep that mixes JAX and PyTorch engines on a TPU cannot run its cells in one process (the
    first framework to open the chip keeps it): it needs a fresh process per cell."""
    frameworks = {name: ENGINES[name].framework for name in engines if name in ENGINES}
    others = sorted(name for name, framework in frameworks.items() if framework != "torch")
    torch_engines = sorted(name for name, framework in frameworks.items() if framework == "torch")
    if device_kind == "tpu" and launcher == "basic" and others and torch_engines:
        raise ConfigError(
            f"engine={','.join(engines)} on a TPU mixes JAX ({', '.join(others)}) with PyTorch engines "
            f"({', '.join(torch_engines)}): the first framework to open the chip holds it for the whole process, "
            "so these cells cannot share one; add hydra/launcher=isolated (a fresh process per cell)"
        )


def evidence_path(cfg: DictConfig, config: dict[str, Any]) -> Path:
    """``evidence_dir/<sweep>/<cell>.json``, or ``evidence_dir/<sweep>/<host>/<cell>.json`` with ``host`` set;
    the cell is named by the axes its experiment uses. Raises ConfigError when the sweep or host is not a
    folder name."""
    validate_sweep(str(cfg.sweep))
    sweep_dir = Path(cfg.evidence_dir) / str(cfg.sweep)
    host = host_folder(cfg.host)
    experiment = EXPERIMENTS.get(cfg.experiment.name)
    uses = {"engine": experiment.engine, "model": experiment.model} if experiment else {}
    return (sweep_dir / host if host else sweep_dir) / f"{evidence.cell_name(config, **uses)}.json"


def sweep_dir(path: Path, cfg: DictConfig) -> Path:
    """The sweep folder an evidence path lies in (above its host folder, if any)."""
    return path.parent.parent if cfg.host else path.parent


def new_record(cfg: DictConfig, config: dict[str, Any], path: Path) -> evidence.Record:
    """A cell's record before it runs: what is to run, and on which machine (status failed until it ends)."""
    experiment = EXPERIMENTS.get(cfg.experiment.name)
    reads_model = experiment is None or experiment.model
    return evidence.Record(
        cell=path.stem,
        sweep=str(cfg.sweep),
        config=config,
        config_hash=evidence.config_hash(config),
        environment=capture(None),
        model={"synthetic": cfg.model.source == "synthetic", "kind": str(cfg.model.source)}
        if reads_model
        else {"synthetic": False, "kind": "none"},
    )


def resumed(cfg: DictConfig, path: Path) -> bool:
    """With ``resume=true``: True (and says so) when some machine already finished this cell ok."""
    if cfg.resume and evidence.cell_ok(sweep_dir(path, cfg), path.stem):
        print(f"[resumed] {path}: already ok", flush=True)
        return True
    return False


def write(record: evidence.Record, path: Path) -> dict[str, Any]:
    """Validates and writes a cell's evidence, and prints its one line."""
    data = record.to_json()
    evidence.validate(data)
    evidence.write_atomic(path, data)
    stream = sys.stdout if record.status != "failed" else sys.stderr
    print(f"[{record.status}] {path}: {_headline(record)}", file=stream, flush=True)
    return data


def run_cell(cfg: DictConfig) -> dict[str, Any] | None:
    """Runs the cell and writes its evidence file; returns the record (None when resumed past)."""
    config = OmegaConf.to_container(cfg, resolve=True, enum_to_str=True)
    try:
        path = evidence_path(cfg, config)
    except ConfigError as exc:  # no safe folder to write this cell's evidence into
        print(f"[failed] nothing written: {exc}", file=sys.stderr, flush=True)
        return {"status": "failed", "reason": str(exc)}
    if resumed(cfg, path):
        return None
    record = new_record(cfg, config, path)
    try:
        with stop_raises():
            measure(cfg, record, path)
    except (EngineLimit, DeviceHeld) as exc:  # cannot run here: skipped, with the reason
        record.status, record.reason = "skipped", str(exc)
    except EXPECTED as exc:
        record.status, record.reason, record.traceback = "failed", str(exc), traceback.format_exc()
    except Exception as exc:  # a crash is evidence too; the sweep goes on
        record.status, record.reason = "failed", f"{type(exc).__name__}: {exc}"
        record.traceback = traceback.format_exc()
    except (KeyboardInterrupt, Stopped) as exc:  # asked to end: failed evidence, then the process ends as asked
        asked = exc.args[0] if isinstance(exc, Stopped) else "SIGINT (Ctrl-C)"
        record.status, record.reason = "failed", f"stopped by {asked} while the cell ran (its traceback says where)"
        record.traceback = traceback.format_exc()
        write(record, path)
        if isinstance(exc, Stopped):  # the signal again, to the handler before the cell's (the default ends the
            signal.raise_signal(exc.signum)  # process, its exit status naming the signal; a launcher's runs)
        raise
    try:
        return write(record, path)
    except OSError as exc:  # the disk full (or gone) at the last step: say where; earlier files stand, the sweep
        # goes on
        reason = f"its evidence could not be written: {exc.strerror or exc} on {disk_of(path)}"
        print(f"[failed] {path}: the cell ended {record.status}, but {reason}", file=sys.stderr, flush=True)
        return {"status": "failed", "reason": reason}


def measure(cfg: DictConfig, record: evidence.Record, path: Path) -> None:
    """The cell's experiment, what it gives kept in ``record``: the typed run, its device, the environment and
    the machine, the engine opened through the factory and closed whatever happens, the contention while it ran."""
    run = typed_config(cfg)
    check_way(run)
    if run.serve.max_batch != 1 and run.experiment.name not in SERVING_EXPERIMENTS:
        raise ConfigError(f"serve.max_batch={run.serve.max_batch} has no effect with experiment={run.experiment.name}: "
                          f"it sets the server of {' and '.join(SERVING_EXPERIMENTS)} (experiment.batch batches "
                          "decode)")
    experiment = EXPERIMENTS.get(run.experiment.name)
    if experiment is None:  # only reachable by overriding experiment.name
        raise ConfigError(f"unknown experiment {run.experiment.name!r}; valid: {', '.join(sorted(EXPERIMENTS))}")
    engine_cls = engine_class(run.engine.name) if experiment.engine else None
    device = resolve_device(run.device.kind, engine_cls.framework if engine_cls else "torch")
    record.environment = capture(device)
    reads = cpu_kernels.reads(device)  # the project's stream read beside torch's, where its kernels run
    record.hardware = hardware.resolve(run.hardware, device, run.cache_dir, str(run.sweep), reads)
    around = {"before": hardware.read_now(device, reads)} if record.hardware["bandwidth_source"] == "measured" else None
    between = (lambda: hardware.read_now(device, reads)["value"]) if around and device.peak_resets else None
    contention = Contention(own_processes=engine_cls.local_processes(run.engine) if engine_cls else None)
    try:
        if engine_cls is None:
            keep(record, experiment.run(Cell(run, device, None, path, read_bandwidth=between)))
        else:
            opened = open_engine(run, device)
            record.model = {**record.model, **opened.checkpoint.provenance}
            try:
                result = experiment.run(Cell(run, device, opened, path, read_bandwidth=between))
            finally:
                if opened.engine is not None:
                    record.engine = opened.engine.describe()
                    record.environment["memory_pages"] = pages.facts()  # again, loaded: the huge pages its weights hold
                opened.close()
            keep(record, result)
    finally:
        record.environment["contention"] = contention.measure()
    if around is not None:  # the read before and after this cell, beside the sweep's (reports/verdicts.py)
        record.hardware["bandwidth_at_cell"] = {**around, "after": hardware.read_now(device, reads), "unit": "GB/s"}


def keep(record: evidence.Record, result: Result) -> None:
    """An experiment's result into its ok record (with the provenance of a checkpoint it read itself)."""
    record.status = "ok"
    record.model = {**record.model, **result.model}
    record.measurements, record.samples = result.measurements, result.samples
    record.outputs, record.timers = result.outputs, result.timers


def _headline(record: evidence.Record) -> str:
    """The cell's one line: the reason, or what its experiment says of itself."""
    if record.status != "ok":
        return str(record.reason).splitlines()[0]
    return EXPERIMENTS[record.config["experiment"]["name"]].headline(record)


def is_multirun() -> bool:
    return HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN


def summarise(folder: Path) -> str:
    """A sweep folder's cells (host folders included) counted by status, then every cell that is not ok
    with its reason."""
    counts: dict[str, int] = {}
    lines = []
    for path in evidence.evidence_files(folder):
        try:
            record = evidence.read(path)
        except (OSError, ValueError) as exc:
            record = {"status": "unreadable", "reason": str(exc)}
        if record.get("kind") == evidence.BOOT:
            continue
        counts[record["status"]] = counts.get(record["status"], 0) + 1
        if record["status"] != "ok":
            lines.append(f"  {record['status']:8s} {path}: {str(record['reason']).splitlines()[0]}")
    total = ", ".join(f"{n} {status}" for status, n in sorted(counts.items())) or "no cells"
    return "\n".join([f"sweep {folder}: {total}", *lines])


def swept_engines(config: DictConfig) -> list[str]:
    """The engines a multirun's command line sweeps over (the composed one when ``engine`` is not swept)."""
    engines = [str(config.engine.name)]
    for override in OverridesParser.create().parse_overrides(list(config.hydra.overrides.task)):
        if override.key_or_group == "engine":
            engines = (
                [str(v) for v in override.sweep_string_iterator()]
                if override.is_sweep_override()
                else [str(override.value())]
            )
    return engines


def refuse_unwritable(config: DictConfig) -> None:
    """Ends the run (exit 2) before any cell runs when its sweep folder cannot take a file: no cell could keep
    its evidence, so none is measured."""
    try:
        validate_sweep(str(config.sweep))
    except ConfigError:
        return  # no folder to try: each cell says so, and writes nothing
    folder = Path(config.evidence_dir) / str(config.sweep)
    if (why := cannot_write(folder)) is not None:
        print(f"[refused] nothing run: the evidence folder {why}; every cell writes its evidence there "
              "(set evidence_dir= to a folder that can be written)", file=sys.stderr, flush=True)  # fmt: skip
        raise SystemExit(2)


class SweepSummary(Callback):
    """Before a run or a multirun: refuses one whose evidence folder cannot be written, or a sweep whose cells
    cannot share a process under the chosen launcher.
    After it: the sweep folder's counts and every cell that is not ok, so a failure in the middle is not
    lost in the log."""

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        refuse_unwritable(config)

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        refuse_unwritable(config)
        kind = str(config.device.kind)
        if kind == "auto":
            kind = "tpu" if tpu_present() else "other"
        try:
            validate_sweep_engines(swept_engines(config), kind, config.hydra.runtime.choices["hydra/launcher"])
        except ConfigError as exc:  # Hydra turns a callback's exception into a warning: stop here instead
            print(f"[refused] {exc}", file=sys.stderr, flush=True)
            raise SystemExit(2) from exc

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        print("\n" + summarise(Path(config.evidence_dir) / str(config.sweep)), flush=True)
