"""The server soaked (issue 46, item 3): the short run of ``python -m serving.soak`` (``make soak`` is the long one)
against ``serve.py`` on model=tiny with a queue of 4 and 64 clients, and the contract's judge on figures that break
it."""

from __future__ import annotations

import collections
import json
import subprocess
import sys

from serving import soak
from tests.conftest import REPO

REQUESTS, CLIENTS, TOKENS = 400, 64, 4


def test_a_short_soak_answers_every_request_exactly_and_leaks_nothing(cache_dir, tiny):
    proc = subprocess.run(
        [sys.executable, "-m", "serving.soak", "--requests", str(REQUESTS), "--clients", str(CLIENTS), "--tokens",
         str(TOKENS), "engine=ring", "model=tiny", "engine.backend=none", "device=cpu", f"cache_dir={cache_dir}",
         "serve.max_queue=4"],
        cwd=REPO, capture_output=True, text=True, timeout=1200,
    )  # fmt: skip
    assert proc.stdout, proc.stderr[-3000:]
    summary = json.loads(proc.stdout)
    assert proc.returncode == 0 and summary["holds"], summary["broken"]
    seen = collections.Counter()
    for name, n in summary["outcomes"].items():
        seen[name.split()[0]] += n
    assert seen == {kind: REQUESTS // len(soak.KINDS) for kind in soak.KINDS}  # every request answered, by kind
    assert summary["outcomes"]["bad bad"] == REQUESTS // len(soak.KINDS)
    assert sum(n for name, n in summary["outcomes"].items() if name.endswith("refused")) > 0  # the queue filled


def test_the_judge_names_a_leak_a_lost_descriptor_and_counters_that_disagree():
    outcomes = collections.Counter({("whole", "ok"): 3, ("streamed", "refused"): 2, ("bad", "bad"): 1,
                                    ("whole", "2 tokens, not 4"): 1})  # fmt: skip
    before = {"decodebench_requests_total{endpoint=text,finish=length}": 0.0,
              "decodebench_rejected_total{status=429}": 0.0, "decodebench_rejected_total{status=400}": 0.0}  # fmt: skip
    after = {"decodebench_requests_total{endpoint=text,finish=length}": 2.0,
             "decodebench_requests_total{endpoint=chat,finish=cancelled}": 1.0,
             "decodebench_rejected_total{status=429}": 1.0, "decodebench_rejected_total{status=400}": 1.0}  # fmt: skip
    broken = soak.judge(outcomes, before, after, (100, 106), (7, 8), 0.05)
    assert broken == [
        "1 whole requests: 2 tokens, not 4",
        "429 refusals: the server counted 1, the clients 2",
        "resident memory grew 6.0% (from 100 to 106 B), more than 5%",
        "open file descriptors 7 before, 8 after",
    ]
    assert soak.judge(collections.Counter({("whole", "ok"): 3, ("bad", "bad"): 1}), before,
                      {**after, "decodebench_rejected_total{status=429}": 0.0}, (100, 104), (7, 7), 0.05) == []
