"""The server's own defaults for an engine's settings: what a served chat wants, where the engine's defaults are
an article's layout.

A ring read for a served chat: a short prompt read at its own length (``engine.last_piece=exact``), every
forward attending over the filled full-attention slots only: on e2b-synthetic the first token of a 21-token
prompt in 0.44 s instead of 3.02 s. Where programs may change shape (a CPU or a GPU), the filled slots rounded up
to whole pieces in one program that TorchDynamo makes dynamic, prompt lengths and slot counts alike
(``engine.attend=exact``: a new prompt length compiles nothing once two have been seen); on a TPU, whose programs
have fixed shapes, power-of-two buckets (``engine.attend=filled``). The article's two programs stay one setting
away (``engine.last_piece=padded engine.attend=cache``), and a named way (``way=...``) is served as the article
ran it.
"""

from __future__ import annotations

from typing import Any


def fast(device_kind: str) -> dict[str, str]:
    """The served chat's settings on a device of this kind."""
    return {"last_piece": "exact", "attend": "filled" if device_kind == "tpu" else "exact"}


def serving_settings(engine_cfg: Any, given: list[str], way: str | None, device_kind: str) -> dict[str, str]:
    """``engine.<key>: value`` for each of ``fast``'s settings the engine has and neither the command line
    (``given``, Hydra's overrides) nor a way sets."""
    if way:
        return {}
    named = {g.split("=", 1)[0].lstrip("+~") for g in given}
    return {f"engine.{k}": v for k, v in fast(device_kind).items() if k in engine_cfg and f"engine.{k}" not in named}
