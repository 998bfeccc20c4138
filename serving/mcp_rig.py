"""``python -m serving.mcp_rig [--dry-run] [--project P] [--zone Z] [--name N]``: the rig's MCP server (stdio,
the official ``mcp`` SDK's FastMCP), as the Rust article's: from Claude Code, create a v5e-1 queued resource
whose startup script boots into decodebench's server, read its boot stages as the VM writes them (guest
attributes, no SSH), find its address, describe it and delete it.

Every tool runs ``python -m scripts.tpu_vm.create <action> --json`` in this checkout (a process, not an
import: ``serving`` sits below ``scripts``) and returns what it says: the ``gcloud`` commands, whether they
ran, and their parsed output. ``--dry-run`` prints the commands instead of running them (nothing reaches a
cloud); ``--guest-attributes-file`` makes the progress tool read a file in ``gcloud --format json``'s shape
(the dry-run boot writes one) instead of the VM. ``--project``, ``--zone`` and ``--name`` are the defaults
each tool's own arguments override; ``--repo`` the git URL the VM clones (default: this checkout's
``origin``).

Register it with Claude Code: ``claude mcp add decodebench-rig -- .venv/bin/python -m serving.mcp_rig
--project <gcp-project-id>``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import anyio.to_thread
from mcp.server.fastmcp import FastMCP

REPO = Path(__file__).resolve().parents[1]
CREATE = [sys.executable, "-m", "scripts.tpu_vm.create"]
TIMEOUT_S = 900.0  # one create.py run: gcloud returns once the resource is queued


class Rig:
    """The defaults and the mode every tool shares."""

    def __init__(self, dry_run: bool, project: str | None, zone: str, name: str, repo: str = "",
                 guest_attributes_file: str = "") -> None:  # fmt: skip
        self.dry_run, self.project, self.zone, self.name = dry_run, project, zone, name
        self.repo, self.guest_attributes_file = repo, guest_attributes_file

    def argv(self, action: str, project: str | None, zone: str | None, name: str | None, *extra: str) -> list[str]:
        project = project or self.project
        if not project:
            raise ValueError("no cloud project: give project=, or start the rig server with --project")
        return [*CREATE, action, "--json", "--project", project, "--zone", zone or self.zone, "--name",
                name or self.name, *extra, "--dry-run" if self.dry_run else "--yes"]  # fmt: skip

    async def run(self, argv: list[str]) -> dict[str, Any]:
        done = await anyio.to_thread.run_sync(
            lambda: subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=TIMEOUT_S)
        )
        try:
            out = json.loads(done.stdout)
        except ValueError:
            raise RuntimeError(f"scripts/tpu_vm/create.py failed (status {done.returncode}): "
                               f"{(done.stderr or done.stdout).strip()[-2000:]}") from None  # fmt: skip
        if out.get("returncode"):
            raise RuntimeError(f"{out['commands'][-1]} failed (status {out['returncode']}): {out['output']}")
        out["dry_run"] = self.dry_run
        return out


def build(rig: Rig) -> FastMCP:
    mcp = FastMCP("decodebench-rig", instructions="A Cloud TPU v5e-1 that boots into decodebench's OpenAI server"
                  + (" (dry run: commands are printed, not run)" if rig.dry_run else ""))  # fmt: skip

    @mcp.tool()
    async def create_tpu_queued_resource(
        project: str | None = None, zone: str | None = None, name: str | None = None, engine: str = "rust",
        model: str = "e2b-emb4", context: int = 8192, serve: bool = True, sweep: str = "", bucket: str = "",
        allow_from: str = "", repo: str = "",
    ) -> dict[str, Any]:  # fmt: skip
        """Create a flex-start v5e-1 queued resource whose startup script boots into serve.py with this engine,
        model and context (and/or runs a sweep: run.py's arguments). allow_from: a CIDR let through the
        firewall to the server's port; repo: the git URL the VM clones (default: this checkout's origin).
        Returns the commands, whether they ran, and the ones to run next."""
        extra = ["--engine", engine, "--model", model, "--context", str(context)]
        extra += [] if serve else ["--no-serve"]
        pairs = (("--sweep", sweep), ("--bucket", bucket), ("--allow-from", allow_from), ("--repo", repo or rig.repo))
        for flag, value in pairs:
            extra += [flag, value] if value else []
        out = await rig.run(rig.argv("create", project, zone, name, *extra))
        verb = "printed, not run (dry run)" if rig.dry_run else "creation initiated"
        out["message"] = (f"🚀 queued resource {out['name']} in {out['zone']}: {verb}, serving {model} with "
                          f"engine={engine}, context {context}")  # fmt: skip
        return out

    @mcp.tool()
    async def describe_tpu_queued_resource(
        project: str | None = None, zone: str | None = None, name: str | None = None
    ) -> dict[str, Any]:
        """The queued resource as gcloud describes it, with its state (WAITING_FOR_RESOURCES, ACTIVE, ...)."""
        out = await rig.run(rig.argv("describe", project, zone, name))
        out["state"] = ((out.get("resource") or {}).get("state") or {}).get("state")
        return out

    @mcp.tool()
    async def delete_tpu_queued_resource(
        project: str | None = None, zone: str | None = None, name: str | None = None
    ) -> dict[str, Any]:
        """Delete the queued resource and its TPU VM (--force)."""
        return await rig.run(rig.argv("delete", project, zone, name))

    @mcp.tool()
    async def get_rig_progress(
        project: str | None = None, zone: str | None = None, name: str | None = None
    ) -> dict[str, Any]:
        """The VM's boot so far, from its guest attributes (no SSH): the stage running now and each finished
        stage with its status, seconds and seconds since boot."""
        extra = ["--guest-attributes-file", rig.guest_attributes_file] if rig.guest_attributes_file else []
        out = await rig.run(rig.argv("stages", project, zone, name, *extra))
        boot = out.get("boot")
        if boot:
            rows = [f"STAGE: {s['stage']} {s['line']}" for s in boot["stages"]]
            out["table"] = "\n".join([*rows, f"now: {boot['current']}"])
        return out

    @mcp.tool()
    async def get_tpu_endpoint(
        project: str | None = None, zone: str | None = None, name: str | None = None
    ) -> dict[str, Any]:
        """The VM's server address (its external IP, port 8000): what the shim looks up."""
        return await rig.run(rig.argv("endpoint", project, zone, name))

    return mcp


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="print the gcloud commands, run none")
    parser.add_argument("--project", default=None)
    parser.add_argument("--zone", default="us-west4-a")
    parser.add_argument("--name", default="decodebench-v5e1")
    parser.add_argument("--repo", default="", help="the git URL the VM clones (default: this checkout's origin)")
    parser.add_argument("--guest-attributes-file", default="", help="progress: read this file, not the VM")
    args = parser.parse_args(argv)
    build(Rig(args.dry_run, args.project, args.zone, args.name, args.repo, args.guest_attributes_file)).run("stdio")


if __name__ == "__main__":
    main()
