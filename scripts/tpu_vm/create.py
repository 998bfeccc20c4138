"""``python -m scripts.tpu_vm.create [create|describe|delete|stages|endpoint] --project P [...]``: the ``gcloud``
commands for a v5e-1 queued resource whose startup script (``startup.sh``) boots into decodebench's
OpenAI-compatible server (and, when asked, runs a sweep), and the commands that read its boot stages, find
its address and delete it.

Printed by default (or with ``--dry-run``, which says so), run with ``--yes``. ``create`` (the default)
passes the startup script and the boot-evidence writer in the instance metadata with the settings the VM
reads: ``--engine``, ``--model``, ``--context`` and ``--serve-args`` for ``serve.py`` (``--no-serve``: no
server), ``--sweep`` (run.py's arguments; empty: no sweep), ``--bucket`` (where the evidence goes; empty:
it stays on the VM), ``--repo`` and ``--ref`` (default: this checkout's ``origin`` and commit).
``--allow-from CIDR`` adds the firewall rule that lets that range reach the server's port (the VM carries
the rule's network tag). ``stages`` reads the VM's guest attributes (``decodebench/<stage>``, no SSH) as
a table; ``--guest-attributes-file`` reads them from a file in ``gcloud --format json``'s shape instead (the
dry-run boot writes one). ``--json`` prints one JSON document (the rig's MCP server reads it).
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
ACTIONS = ("create", "describe", "delete", "stages", "endpoint")
NAMESPACE = "decodebench"
SERVE_TAG = "decodebench-serve"
GCLOUD_TIMEOUT_S = 600  # one gcloud call; creating a queued resource returns once it is queued
# One stage's guest attribute, as boot_stage.line writes it: "ok 12.3s (at 45.6s) python=3.12.3 ..."
STAGE_LINE = re.compile(r"^(?P<status>\w+) (?P<seconds>[\d.]+)s \(at (?P<since>[\d.]+)s\)")


def git(*args: str) -> str:
    done = subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True)
    return done.stdout.strip()


def serve_args_for(engine: str) -> str:
    """The Rust article's SERVE_DEFER_AND_FUSE=1, where the engine has the setting (rust, static)."""
    return "engine.mode=fuse" if engine in ("rust", "static") else ""


def where(args: argparse.Namespace) -> list[str]:
    return ["--zone", args.zone, "--project", args.project]


def create_commands(args: argparse.Namespace) -> list[list[str]]:
    """The firewall rule (with ``--allow-from``), then the queued resource."""
    metadata = {
        "decodebench-repo": args.repo,
        "decodebench-ref": args.ref,
        "decodebench-serve": "0" if args.no_serve else "1",
        "decodebench-engine": args.engine,
        "decodebench-model": args.model,
        "decodebench-context": str(args.context),
        "decodebench-serve-args": args.serve_args,
        "decodebench-port": str(args.port),
        "decodebench-sweep": args.sweep,
        "decodebench-sweep-name": args.sweep_name,
        "decodebench-bucket": args.bucket,
    }
    firewall = []
    if args.allow_from:
        firewall = [["gcloud", "compute", "firewall-rules", "create", f"{SERVE_TAG}-{args.port}",
                     "--project", args.project, "--network", "default", "--direction", "INGRESS",
                     "--allow", f"tcp:{args.port}", "--target-tags", SERVE_TAG,
                     "--source-ranges", args.allow_from]]  # fmt: skip
    create = [
        "gcloud", "alpha", "compute", "tpus", "queued-resources", "create", args.name,
        "--node-id", args.name, *where(args),
        "--accelerator-type", "v5litepod-1", "--runtime-version", args.runtime_version,
        "--provisioning-model", "flex-start", "--max-run-duration", args.max_run_duration,
        "--tags", SERVE_TAG,
        "--metadata-from-file", f"startup-script={HERE / 'startup.sh'},decodebench-boot-stage={HERE / 'boot_stage.py'}",
        # '^;^' makes ';' the separator, so a sweep's commas stay inside its value
        "--metadata", "^;^" + ";".join(f"{k}={v}" for k, v in metadata.items() if v),  # unset: the VM's default
    ]  # fmt: skip
    return [*firewall, create]


def describe_command(args: argparse.Namespace) -> list[str]:
    return ["gcloud", "compute", "tpus", "queued-resources", "describe", args.name, *where(args), "--format", "json"]


def delete_command(args: argparse.Namespace) -> list[str]:
    return ["gcloud", "compute", "tpus", "queued-resources", "delete", args.name, *where(args), "--force", "--quiet"]


def stages_command(args: argparse.Namespace) -> list[str]:
    """The VM's guest attributes under decodebench/ (each stage's line, and ``stage``: the one running)."""
    return ["gcloud", "compute", "tpus", "tpu-vm", "get-guest-attributes", args.name, *where(args),
            "--query-path", f"{NAMESPACE}/", "--format", "json"]  # fmt: skip


def endpoint_command(args: argparse.Namespace) -> list[str]:
    """The VM's external IP (the node is named as its queued resource)."""
    return ["gcloud", "compute", "tpus", "tpu-vm", "describe", args.name, *where(args),
            "--format", "value(networkEndpoints[0].accessConfig.externalIp)"]  # fmt: skip


def after_create(args: argparse.Namespace) -> list[list[str]]:
    """What to run once it is created: watch the boot, find the server, fetch the evidence, delete it."""
    after = [stages_command(args), endpoint_command(args)]
    if args.bucket:
        incoming = f"evidence/incoming/{args.sweep_name}"
        after += [
            ["gsutil", "-m", "rsync", "-r", f"{args.bucket}/runs", incoming],
            ["make", "collect", f"FROM={incoming}"],
        ]
    return [*after, delete_command(args)]


def boot_stages(attributes: list[dict[str, Any]]) -> dict[str, Any]:
    """``gcloud ... get-guest-attributes --format json`` (a list of namespace/key/value) as the boot so
    far: the stage running now (``done`` at the end) and each finished stage in the order it ended."""
    ours = {a["key"]: a.get("value", "") for a in attributes if a.get("namespace", NAMESPACE) == NAMESPACE}
    stages = []
    for key, value in ours.items():
        match = STAGE_LINE.match(value)
        if key == "stage" or not match:
            continue
        stages.append({"stage": key, "status": match["status"], "seconds": float(match["seconds"]),
                       "since_boot_s": float(match["since"]), "line": value})  # fmt: skip
    stages.sort(key=lambda s: s["since_boot_s"])
    return {"current": ours.get("stage"), "stages": stages}


def stages_table(boot: dict[str, Any]) -> str:
    rows = [f"{s['stage']:<12} {s['status']:<7} {s['seconds']:>8.1f} s  (at {s['since_boot_s']:.1f} s)"
            for s in boot["stages"]]  # fmt: skip
    return "\n".join([*rows, f"now: {boot['current'] or 'not started'}"])


def run(command: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(command, capture_output=True, text=True, timeout=GCLOUD_TIMEOUT_S)


def act(args: argparse.Namespace) -> dict[str, Any]:
    """The action's commands, run (``--yes``) or not; what they printed; ``stages`` and ``endpoint`` parsed."""
    commands = {"create": create_commands, "describe": lambda a: [describe_command(a)],
                "delete": lambda a: [delete_command(a)], "stages": lambda a: [stages_command(a)],
                "endpoint": lambda a: [endpoint_command(a)]}[args.action](args)  # fmt: skip
    out: dict[str, Any] = {"action": args.action, "name": args.name, "zone": args.zone, "project": args.project,
                           "commands": [shlex.join(c) for c in commands], "ran": False, "returncode": None,
                           "output": None}  # fmt: skip
    if args.action == "create":
        out["then"] = [shlex.join(c) for c in after_create(args)]
    parsed = {"stages": "boot", "describe": "resource", "endpoint": "endpoint"}.get(args.action)
    if parsed:
        out[parsed] = None  # until a command's output (or the attributes file) says
    stdout = None
    if args.action == "stages" and args.guest_attributes_file:
        stdout = Path(args.guest_attributes_file).read_text()
        out["output"] = f"read from {args.guest_attributes_file}"
    elif args.yes:
        out["ran"] = True
        for command in commands:
            done = run(command)
            out["returncode"], out["output"] = done.returncode, (done.stdout + done.stderr).strip()
            if done.returncode != 0 and "firewall-rules" in command and "already exists" in out["output"]:
                out["returncode"] = 0  # kept from an earlier VM as it is (delete it to change its range)
            elif done.returncode != 0:
                return out
            stdout = done.stdout
    if stdout is not None and args.action == "stages":
        out["boot"] = boot_stages(json.loads(stdout or "[]"))
    if stdout is not None and args.action == "describe":
        out["resource"] = json.loads(stdout or "{}")
    if stdout is not None and args.action == "endpoint":
        ip = stdout.strip()
        out["endpoint"] = f"http://{ip}:{args.port}" if ip else None
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("action", nargs="?", default="create", choices=ACTIONS)
    parser.add_argument("--project", required=True)
    parser.add_argument("--zone", default="us-west4-a")
    parser.add_argument("--name", default="decodebench-v5e1", help="the queued resource and its node")
    parser.add_argument("--bucket", default="", help="gs:// folder the VM copies its evidence to (default: none)")
    parser.add_argument("--repo", default=git("remote", "get-url", "origin") or None)
    parser.add_argument("--ref", default=git("rev-parse", "HEAD"))
    parser.add_argument("--engine", default="rust", help="serve.py's engine= (default: the Rust article's)")
    parser.add_argument("--model", default="e2b-emb4", help="serve.py's model= (the -emb4 twin, as the article)")
    parser.add_argument("--context", type=int, default=8192, help="serve.py's context= (the article's 8,192)")
    parser.add_argument("--serve-args", default=None, help="more serve.py overrides (default: engine.mode=fuse "
                        "for rust and static, the article's SERVE_DEFER_AND_FUSE=1)")  # fmt: skip
    parser.add_argument("--port", type=int, default=8000, help="the server's port on the VM")
    parser.add_argument("--no-serve", action="store_true", help="boot without the server (a sweep instead)")
    parser.add_argument("--sweep", default="", help="run.py's arguments for a sweep on boot (default: none)")
    parser.add_argument("--sweep-name", default="tpu-v5e-1-boot")
    parser.add_argument("--allow-from", default="", help="CIDR allowed to reach the server (a firewall rule)")
    parser.add_argument("--runtime-version", default="v2-alpha-tpuv5-lite")
    parser.add_argument("--max-run-duration", default="2h")
    parser.add_argument("--guest-attributes-file", default="", help="stages: read this file, not the VM")
    parser.add_argument("--json", action="store_true", help="one JSON document on stdout")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--yes", action="store_true", help="run the commands (else only print)")
    mode.add_argument("--dry-run", action="store_true", help="print the commands, run nothing (the default)")
    args = parser.parse_args(argv)
    if args.serve_args is None:
        args.serve_args = serve_args_for(args.engine)
    if args.action == "create":
        if not args.repo:
            parser.error("--repo: this checkout has no 'origin' remote; give the git URL the VM clones")
        if args.bucket and not args.bucket.startswith("gs://"):
            parser.error(f"--bucket={args.bucket!r} must be a gs:// folder")
        if args.no_serve and not args.sweep:
            parser.error("--no-serve without --sweep: the VM would boot into nothing")
    out = act(args)
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        print("# dry run: printed, not run" if not args.yes else f"# ran ({args.action})")
        print("\n".join(out["commands"]))
        if out["output"]:
            print(out["output"])
        if out.get("boot"):
            print(stages_table(out["boot"]))
        if out.get("endpoint"):
            print(out["endpoint"])
        if "then" in out and out["returncode"] in (None, 0):
            print("# then: the boot's stages as it writes them (no SSH); the server's address; the queued "
                  "resource deleted")  # fmt: skip
            print("\n".join(out["then"]))
    return out["returncode"] or 0


if __name__ == "__main__":
    sys.exit(main())
