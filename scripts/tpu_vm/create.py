"""``python -m scripts.tpu_vm.create --project P --bucket gs://B/decodebench [--yes]``: the ``gcloud``
commands for a v5e-1 queued resource whose startup script (``startup.sh``) runs a sweep on boot.

Printed by default, run with ``--yes``. The VM checks out ``--ref`` of ``--repo`` (default: this
checkout's ``origin`` and commit), runs ``--sweep`` (run.py's arguments) and copies its evidence to
``--bucket``/runs; the last commands printed read its progress (guest attributes) and bring the evidence
home (``make collect``).
"""

from __future__ import annotations

import argparse
import shlex
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
DEFAULT_SWEEP = "-m engine=generate,static,compiled,ring,rust model=e2b-synthetic max_new_tokens=16 repeats=1"


def git(*args: str) -> str:
    done = subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True)
    return done.stdout.strip()


def commands(args: argparse.Namespace) -> list[list[str]]:
    """The create command, then the ones that watch the boot and fetch its evidence."""
    zone = ["--zone", args.zone, "--project", args.project]
    metadata = {
        "decodebench-repo": args.repo,
        "decodebench-ref": args.ref,
        "decodebench-sweep": args.sweep,
        "decodebench-sweep-name": args.sweep_name,
        "decodebench-bucket": args.bucket,
    }
    create = [
        "gcloud", "alpha", "compute", "tpus", "queued-resources", "create", args.name,
        "--node-id", args.name, *zone,
        "--accelerator-type", "v5litepod-1", "--runtime-version", args.runtime_version,
        "--provisioning-model", "flex-start", "--max-run-duration", args.max_run_duration,
        "--metadata-from-file", f"startup-script={HERE / 'startup.sh'},decodebench-boot-stage={HERE / 'boot_stage.py'}",
        # '^;^' makes ';' the separator, so a sweep's commas stay inside its value
        "--metadata", "^;^" + ";".join(f"{k}={v}" for k, v in metadata.items()),
    ]  # fmt: skip
    progress = ["gcloud", "compute", "tpus", "tpu-vm", "get-guest-attributes", args.name, *zone,
                "--query-path", "decodebench/"]  # fmt: skip
    fetch = ["gsutil", "-m", "rsync", "-r", f"{args.bucket}/runs", f"evidence/incoming/{args.sweep_name}"]
    collect = ["make", "collect", f"FROM=evidence/incoming/{args.sweep_name}"]
    delete = ["gcloud", "compute", "tpus", "queued-resources", "delete", args.name, *zone, "--force", "--quiet"]
    return [create, progress, fetch, collect, delete]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--project", required=True)
    parser.add_argument("--bucket", required=True, help="gs:// folder the VM copies its evidence to")
    parser.add_argument("--zone", default="us-west4-a")
    parser.add_argument("--name", default="decodebench-v5e1")
    parser.add_argument("--repo", default=git("remote", "get-url", "origin") or None)
    parser.add_argument("--ref", default=git("rev-parse", "HEAD"))
    parser.add_argument("--sweep", default=DEFAULT_SWEEP, help="run.py's arguments for the sweep")
    parser.add_argument("--sweep-name", default="tpu-v5e-1-boot")
    parser.add_argument("--runtime-version", default="v2-alpha-tpuv5-lite")
    parser.add_argument("--max-run-duration", default="2h")
    parser.add_argument("--yes", action="store_true", help="run the create command (else only print)")
    args = parser.parse_args(argv)
    if not args.repo:
        parser.error("--repo: this checkout has no 'origin' remote; give the git URL the VM clones")
    if not args.bucket.startswith("gs://"):
        parser.error(f"--bucket={args.bucket!r} must be a gs:// folder")
    create, *after = commands(args)
    print(shlex.join(create))
    if args.yes:
        done = subprocess.run(create)
        if done.returncode != 0:
            return done.returncode
    print("# then: the boot's stages, as it writes them (no SSH); its evidence; the queued resource deleted")
    for command in after:
        print(shlex.join(command))
    return 0


if __name__ == "__main__":
    sys.exit(main())
