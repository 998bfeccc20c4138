"""The two MCP servers, driven by the official SDK's own stdio client: the rig's (serving/mcp_rig.py) in a dry
run (every gcloud command printed, none run) and against a fake gcloud on PATH (its output parsed), and the
demo's (serving/mcp_demo.py) through the shim to decodebench's server on model=tiny: the reply's footer
holds the server's own figures. Loopback only; every session and call is bounded."""

from __future__ import annotations

import json
import os
import re
import socket
import sys
import textwrap
from datetime import timedelta
from pathlib import Path
from typing import Any

import anyio
import pytest
from mcp import ClientSession, StdioServerParameters
from mcp.client.stdio import stdio_client

from scripts.tpu_vm import boot_stage
from serving import shim
from tests.conftest import REPO
from tests.test_shim import MODEL, local_server

CALL_S = timedelta(seconds=120)
SESSION_S = 240
ARTICLE_STAGES = ["python", "torch", "rust", "crate", "weights", "smoke", "unit", "serving"]
RIG_TOOLS = {"create_tpu_queued_resource", "describe_tpu_queued_resource", "delete_tpu_queued_resource",
             "get_rig_progress", "get_tpu_endpoint"}  # fmt: skip
DEMO_TOOLS = {"ask", "stream", "engine_info", "endpoint_status", "serving_metrics"}


def session(module: str, *args: str, env: dict[str, str] | None = None):
    """``python -m <module> args`` as a stdio MCP server (the SDK's client starts and stops it)."""
    params = StdioServerParameters(command=sys.executable, args=["-m", module, *args], cwd=str(REPO), env=env)
    return stdio_client(params)


def call(module: str, calls: list[tuple[str, dict[str, Any]]], *args: str, env: dict[str, str] | None = None,
         progress: list | None = None) -> tuple[set[str], list[Any]]:  # fmt: skip
    """Starts the server, lists its tools, makes the calls in order; the tool names and each result."""

    async def on_progress(done: float, total: float | None, message: str | None) -> None:
        progress.append((done, total, message))

    async def main() -> tuple[set[str], list[Any]]:
        with anyio.fail_after(SESSION_S):
            async with session(module, *args, env=env) as (read, write), ClientSession(read, write) as client:
                await client.initialize()
                names = {tool.name for tool in (await client.list_tools()).tools}
                results = [await client.call_tool(name, arguments, read_timeout_seconds=CALL_S,
                                                  progress_callback=on_progress if progress is not None else None)
                           for name, arguments in calls]  # fmt: skip
                return names, results

    return anyio.run(main)


def text(result: Any) -> str:
    return "".join(part.text for part in result.content if part.type == "text")


def guest_attributes(path: Path, current: str) -> None:
    """A boot's guest attributes as gcloud prints them (keys out of order: the reader orders by time)."""
    entries, since = [], 0.0
    for index, stage in enumerate(ARTICLE_STAGES):
        since += 10.0 + index
        record = {"status": "ok", "seconds": 10.0 + index, "since_boot_s": since, "versions": {"torch": "2.13.0"}}
        entries.append({"namespace": "decodebench", "key": stage, "value": boot_stage.line(record)})
    entries.append({"namespace": "decodebench", "key": "stage", "value": current})
    path.write_text(json.dumps(entries[::-1]))


def test_the_rig_server_prints_every_gcloud_command_in_a_dry_run(tmp_path):
    attributes = tmp_path / "guest-attributes.json"
    guest_attributes(attributes, "done")
    calls = [
        ("create_tpu_queued_resource", {"allow_from": "203.0.113.7/32"}),
        ("describe_tpu_queued_resource", {}),
        ("delete_tpu_queued_resource", {"project": "another-project", "name": "qr2"}),
        ("get_rig_progress", {}),
        ("get_tpu_endpoint", {"zone": "us-central1-a"}),
    ]
    names, (create, describe, delete, progress, endpoint) = call(
        "serving.mcp_rig", calls, "--dry-run", "--project", "my-project", "--repo", "https://example.org/d.git",
        "--guest-attributes-file", str(attributes),
    )  # fmt: skip
    assert names == RIG_TOOLS
    assert not any(r.isError for r in (create, describe, delete, progress, endpoint)), text(create)

    made = create.structuredContent
    assert made["ran"] is False and made["dry_run"] is True and "dry run" in made["message"]
    firewall, queued = made["commands"]
    assert firewall.startswith("gcloud compute firewall-rules create decodebench-serve-8000 --project my-project")
    assert "--allow tcp:8000" in firewall and "--source-ranges 203.0.113.7/32" in firewall
    assert queued.startswith("gcloud alpha compute tpus queued-resources create decodebench-v5e1")
    for part in ("--zone us-west4-a --project my-project", "--accelerator-type v5litepod-1",
                 "--provisioning-model flex-start", "--tags decodebench-serve",
                 f"startup-script={REPO / 'scripts' / 'tpu_vm' / 'startup.sh'}", "decodebench-engine=rust;",
                 "decodebench-model=e2b-emb4;", "decodebench-context=8192;", "decodebench-serve=1;",
                 "decodebench-serve-args=engine.mode=fuse;",
                 "decodebench-repo=https://example.org/d.git;"):  # fmt: skip
        assert part in queued, part
    assert "decodebench-sweep=" not in queued and "decodebench-bucket" not in queued  # unset: none
    assert any(c.startswith("gcloud compute tpus tpu-vm get-guest-attributes decodebench-v5e1") for c in made["then"])

    assert describe.structuredContent["commands"] == [
        "gcloud compute tpus queued-resources describe decodebench-v5e1 --zone us-west4-a --project my-project "
        "--format json"
    ]
    assert describe.structuredContent["state"] is None  # nothing ran, nothing described
    assert delete.structuredContent["commands"] == [
        "gcloud compute tpus queued-resources delete qr2 --zone us-west4-a --project another-project --force --quiet"
    ]
    boot = progress.structuredContent["boot"]
    assert [s["stage"] for s in boot["stages"]] == ARTICLE_STAGES and boot["current"] == "done"
    assert boot["stages"][-1]["seconds"] == 17.0 and boot["stages"][-1]["since_boot_s"] == 108.0
    assert progress.structuredContent["table"].splitlines()[0].startswith("STAGE: python ok 10.0s (at 10.0s)")
    assert endpoint.structuredContent["commands"][0].startswith(
        "gcloud compute tpus tpu-vm describe decodebench-v5e1 --zone us-central1-a --project my-project"
    )
    assert endpoint.structuredContent["endpoint"] is None


FAKE_GCLOUD = """\
#!/usr/bin/env bash
# A fake gcloud: logs its arguments, prints what the real one would for each command.
echo "$*" >>"{log}"
case "$*" in
  *"queued-resources create"*) echo "Create request issued for: [$6]" ;;
  *"queued-resources describe"*) echo '{{"name": "projects/p/locations/z/queuedResources/qr", "state": {{"state": "ACTIVE"}}}}' ;;
  *"queued-resources delete"*) echo "ERROR: (gcloud.compute.tpus.queued-resources.delete) NOT_FOUND: qr" >&2; exit 1 ;;
  *"get-guest-attributes"*) cat "{attributes}" ;;
  *"tpu-vm describe"*) echo "10.1.2.3" ;;
  *) echo "unexpected: $*" >&2; exit 2 ;;
esac
"""  # noqa: E501


def test_the_rig_server_runs_gcloud_and_reads_what_it_prints(tmp_path):
    attributes, log = tmp_path / "attributes.json", tmp_path / "gcloud.log"
    guest_attributes(attributes, "serving")
    fake = tmp_path / "bin" / "gcloud"
    fake.parent.mkdir()
    fake.write_text(textwrap.dedent(FAKE_GCLOUD.format(log=log, attributes=attributes)))
    fake.chmod(0o755)
    env = {"PATH": f"{fake.parent}{os.pathsep}{os.environ['PATH']}"}
    calls = [
        ("create_tpu_queued_resource", {"project": "p", "name": "qr", "model": "tiny", "sweep": "-m engine=ring",
                                        "repo": "https://example.org/d.git"}),
        ("describe_tpu_queued_resource", {"project": "p", "name": "qr"}),
        ("get_rig_progress", {"project": "p", "name": "qr"}),
        ("get_tpu_endpoint", {"project": "p", "name": "qr"}),
        ("delete_tpu_queued_resource", {"project": "p", "name": "qr"}),
        ("describe_tpu_queued_resource", {}),  # no project: neither the call nor the server names one
    ]
    _, (create, describe, progress, endpoint, delete, unnamed) = call("serving.mcp_rig", calls, env=env)
    assert create.structuredContent["ran"] is True and "creation initiated" in create.structuredContent["message"]
    assert create.structuredContent["output"] == "Create request issued for: [qr]"
    assert describe.structuredContent["state"] == "ACTIVE"
    boot = progress.structuredContent["boot"]
    assert [s["stage"] for s in boot["stages"]] == ARTICLE_STAGES and boot["current"] == "serving"
    assert endpoint.structuredContent["endpoint"] == "http://10.1.2.3:8000"
    assert delete.isError and "NOT_FOUND" in text(delete)
    assert unnamed.isError and "no cloud project" in text(unnamed)
    ran = log.read_text().splitlines()
    assert len(ran) == 5 and ran[0].startswith("alpha compute tpus queued-resources create qr --node-id qr")
    assert "decodebench-model=tiny;" in ran[0] and "decodebench-sweep=-m engine=ring;" in ran[0]


@pytest.fixture(scope="module")
def shimmed(cache_dir, tiny):
    with local_server(cache_dir) as state, shim.running(shim.create_shim(shim.Upstream(url=state["url"]))) as local:
        state["shim"] = local
        yield state


FOOTER = re.compile(
    r"^(?P<checkpoint>.+) · finish (?P<finish>stop|length) · (?P<prompt>\d+) prompt \+ (?P<completion>\d+) "
    r"completion tokens · prompt read (?P<read>[\d.]+) s · decode (?P<rate>[\d.]+) tok/s on the CPU · "
    r"(?P<round_trip>[\d.]+) s round trip from here"
)


def test_the_demo_server_answers_through_the_shim_with_the_servers_own_figures(shimmed):
    worker, shim_url = shimmed["worker"], shimmed["shim"]
    shimmed["paced"].pause_s = 0.0
    question = {"prompt": "What is a TPU? Two sentences.", "max_tokens": 24}
    progress: list = []
    calls = [("serving_metrics", {}), ("ask", question), ("stream", question), ("engine_info", {}),
             ("endpoint_status", {}), ("serving_metrics", {})]  # fmt: skip
    names, (before, ask, stream, info, status, after) = call("serving.mcp_demo", calls, "--base-url", shim_url,
                                                              progress=progress)  # fmt: skip
    assert names == DEMO_TOOLS
    asked, streamed = list(worker.records)[-2:]

    reply, _, foot = text(ask).partition("\n\n---\n")
    match = FOOTER.match(foot)
    assert match, foot
    key = shimmed["served"].info["checkpoint"]["key"]
    assert match["checkpoint"] == f"{MODEL} (synthetic {key})" and match["finish"] == asked.finish
    assert int(match["prompt"]) == asked.prompt_tokens and int(match["completion"]) == asked.completion_tokens
    assert match["read"] == f"{asked.read_s:.3f}" and match["rate"] == f"{asked.engine_tok_s:.1f}"
    assert float(match["round_trip"]) >= asked.decode_s

    streamed_reply, _, streamed_foot = text(stream).partition("\n\n---\n")
    assert streamed_reply == reply, "greedy: the stream says what ask said"
    match = FOOTER.match(streamed_foot)
    assert match and match["rate"] == f"{streamed.engine_tok_s:.1f}" and "first token" in streamed_foot
    assert progress and "".join(message for _, _, message in progress) == reply  # each chunk as it came

    assert info.structuredContent["engine"] == "ring" and "ring / tiny (synthetic" in info.structuredContent["summary"]
    assert text(status) == f"🟢 local {shim_url}/v1 → {shimmed['url']} - upstream /health: 200 - fixed"
    assert after.structuredContent["requests"] == before.structuredContent["requests"] + 2
    assert after.structuredContent["decode_seconds"]["count"] >= 2
    assert after.structuredContent["requests_by_finish"].get(asked.finish, 0) >= 1


def test_the_demo_server_says_when_nothing_answers():
    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    calls = [("endpoint_status", {}), ("ask", {"prompt": "hi"})]
    _, (status, ask) = call("serving.mcp_demo", calls, "--base-url", f"http://127.0.0.1:{port}")
    assert text(status).startswith(f"🔴 nothing answers at http://127.0.0.1:{port}")
    assert ask.isError
