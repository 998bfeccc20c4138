"""The server and the laptop shim fuzzed from their own OpenAPI documents (schemathesis over hypothesis): every
generated request, valid or not, gets an answer that is no server error (5xx) and, when it refuses, an OpenAI-shaped
error body; no request hangs (each is bounded by ``TIMEOUT_S``); both still answer ``/health`` afterwards.

The seed is fixed (``derandomize``) and the examples bounded (``EXAMPLES`` per operation and mode: requests the
document allows, and requests it refuses), so CI fuzzes the same
requests every run; ``DECODEBENCH_FUZZ_EXAMPLES`` raises the bound for a longer run. What was sent is counted by
operation and status (``SENT``), printed at the end of the module (``pytest -s``)."""

from __future__ import annotations

import collections
import os
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode

from serving import shim
from tests.test_serve import serving_engine

EXAMPLES = int(os.environ.get("DECODEBENCH_FUZZ_EXAMPLES", "25"))
TIMEOUT_S = 60  # a generated request the tiny engine cannot answer in this time is a hang
SENT: collections.Counter[tuple[str, str, int | str]] = collections.Counter()  # (app, operation, status) -> requests
FUZZED = settings(max_examples=EXAMPLES, derandomize=True, deadline=None, suppress_health_check=list(HealthCheck),
                  database=None)  # fmt: skip


@pytest.fixture(scope="module")
def served(cache_dir, tiny):
    """decodebench's server over a tiny ring engine, and the shim in front of it."""
    with serving_engine(cache_dir, "ring", "engine.backend=none") as state, shim.running(
        shim.create_shim(shim.Upstream(url=state["url"]))
    ) as through:
        state["shim"] = through
        yield state
    counts = "\n".join(f"  {app} {op} -> {status}: {n}" for (app, op, status), n in sorted(SENT.items(), key=str))
    print(f"\nfuzzed: {sum(SENT.values())} requests over {len({(a, o) for a, o, _ in SENT})} operations\n{counts}")


def answered(app: str, case: Any) -> None:
    """Sends ``case`` (bounded), counts it, and holds the answer to the contract: no 5xx; a refusal is OpenAI-shaped
    (``{"error": {"message": str, "type": str, ...}}``; HEAD answers carry no body)."""
    response = case.call(timeout=TIMEOUT_S)
    SENT[(app, case.operation.label, response.status_code)] += 1
    assert response.status_code < 500, f"{case.operation.label}: {response.status_code} {response.text[:500]}"
    if response.status_code >= 400 and case.method.upper() != "HEAD":  # a HEAD answer has no body to shape
        error = response.json().get("error")
        assert isinstance(error, dict) and isinstance(error.get("message"), str) and error.get("type"), response.text


def served_model(case: Any, model: str) -> Any:
    """A valid case names the model the server serves (a generated name is a 404 before any decode), so valid
    bodies reach the engine."""
    if isinstance(case.body, dict) and "model" in case.body:
        case.body["model"] = model
    return case


def fuzz(app: str, url: str, model: str) -> None:
    """Every operation of the OpenAPI document at ``url``, fuzzed with valid requests (as the document allows, naming
    the served ``model``) and invalid ones (as it refuses), ``EXAMPLES`` each; an operation no request can break
    (no parameter, no body) is fuzzed with valid ones only."""
    schema = schemathesis.openapi.from_url(f"{url}/openapi.json")
    for found in schema.get_all_operations():
        operation = found.ok()
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            cases = operation.as_strategy(generation_mode=mode)
            if mode == GenerationMode.POSITIVE:
                cases = cases.map(lambda case: served_model(case, model))

            @FUZZED
            @given(case=cases)
            def each(case: Any) -> None:
                answered(app, case)

            try:
                each()
            except Unsatisfiable:
                if mode == GenerationMode.POSITIVE:
                    raise
                SENT[(app, operation.label, "no invalid request")] += 0  # named in the counts, nothing sent


def test_every_generated_request_to_the_server_is_answered(served):
    fuzz("server", served["url"], served["served"].model_id)


def test_every_generated_request_through_the_shim_is_answered(served):
    fuzz("shim", served["shim"], served["served"].model_id)


def test_both_still_answer_health_after_the_fuzzing(served):
    for url in (served["url"], served["shim"]):
        assert httpx.get(f"{url}/health", timeout=10).json()["status"] == "ok"
    assert served["worker"].jobs.qsize() == 0  # nothing left queued behind a fuzzed request
