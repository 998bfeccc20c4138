"""The generate engine writes what plain Transformers writes on the same checkpoint."""

from __future__ import annotations

import torch

from decodebench.checkpoint import load_reference, open_checkpoint
from decodebench.device import resolve_device
from decodebench.prompts import prompt_ids
from engines.generate import GenerateEngine
from experiments.common import answer
from tests.conftest import make_cfg, opened


def test_generate_matches_plain_transformers(tiny, cache_dir):
    cfg = make_cfg(f"cache_dir={cache_dir}", "dtype=float32")
    device = resolve_device("cpu")
    engine = opened(f"cache_dir={cache_dir}", "dtype=float32").load()
    assert isinstance(engine, GenerateEngine)
    ids = prompt_ids(engine.tokenizer, cfg.prompt, chat_template=True)
    assert ids[0] == engine.tokenizer.bos_token_id
    ours = engine.generate(ids, 24, return_logits=True)

    reference = load_reference(open_checkpoint(tiny.w4a16), torch.float32, device.torch_device)
    out = reference.generate(
        torch.tensor([ids]),
        max_new_tokens=24,
        do_sample=False,
        output_logits=True,
        return_dict_in_generate=True,
        eos_token_id=None,
        generation_config=None,
    )
    theirs = out.sequences[0, len(ids) :].tolist()
    assert len(ours.tokens) == 24
    assert ours.tokens[: len(theirs)] == theirs
    assert len(set(ours.tokens)) > 1, "a synthetic model that repeats one token makes parity meaningless"
    ref_logits = torch.cat([step.float() for step in out.logits])
    torch.testing.assert_close(ours.logits[: len(theirs)], ref_logits, rtol=1e-4, atol=1e-4)


def test_answer_ends_at_eos():
    class Tok:
        def decode(self, ids, skip_special_tokens=True):
            return " ".join(map(str, ids))

    got = answer([5, 6, 1, 7], eos_ids=[1, 106], tokenizer=Tok())
    assert got["answer_ids"] == [5, 6] and got["finish_reason"] == "stop" and got["text"] == "5 6"
    assert answer([5, 6], eos_ids=[1], tokenizer=Tok())["finish_reason"] == "length"
