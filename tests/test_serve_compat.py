"""The server as any OpenAI client drives it, field by field, through the official ``openai`` client:
content parts, the developer role, every completions prompt form, stop strings (whole and streamed),
ignore_eos and min_tokens, log-probabilities against the engine's own logits, echo, the model routes,
every refused or ignored field, and the robustness rows (a non-streamed client that leaves, the body
limit, the bounded queue, SIGTERM)."""

from __future__ import annotations

import dataclasses
import json
import signal
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import openai
import pytest
import torch

from decodebench.config import ServeConfig
from decodebench.prompts import chat_ids, text_ids
from engines.rust_engine import RustEngine
from serving.listen import running
from serving.server import create_app
from serving.text import StopRule, TextStream
from tests.conftest import served_line, spawn_serve, stop
from tests.test_serve import MODEL, chat, metrics, serving_engine, wait_until

PROMPT = "The ocean is"


@pytest.fixture(scope="module")
def server(cache_dir, tiny):
    """A ring engine (backend none) served as in tests/test_serve.py."""
    with serving_engine(cache_dir, "ring", "engine.backend=none") as state:
        yield state


@pytest.fixture
def client(server):
    return connect(server["url"], server)


def connect(url: str, server: dict[str, Any], timeout: float = 120) -> openai.OpenAI:
    server["paced"].pause_s = 0.0
    return openai.OpenAI(base_url=f"{url}/v1", api_key="test", max_retries=0, timeout=timeout)


def bare(server: dict[str, Any], ids: list[int], n: int) -> Any:
    """The engine's own call, from the test thread while the worker idles: tokens and logits [n, vocab]."""
    assert server["worker"].idle()
    return server["opened"].engine.generate(ids, n, return_logits=True)


def decode(server: dict[str, Any], ids: list[int]) -> str:
    return server["served"].tokenizer.decode(ids, skip_special_tokens=True)


@contextmanager
def another_app(server: dict[str, Any], **changes: Any) -> Iterator[str]:
    """A second app over the same worker: ``settings`` (a ServeConfig), the ``opened`` engine's description
    or ``Served`` fields changed."""
    settings, opened = changes.pop("settings", None), changes.pop("opened", server["opened"])
    served = dataclasses.replace(server["served"], **changes)
    with running(create_app(served, server["worker"], opened, settings)) as url:
        yield url


def ext(response: Any) -> dict[str, Any]:
    return response.model_extra["decodebench"]


def refused(call: Any, param: str, *words: str, status: type[openai.APIStatusError] = openai.BadRequestError) -> Any:
    """``call`` is refused with an OpenAI-shaped error naming ``param`` (and saying ``words``)."""
    with pytest.raises(status) as caught:
        call()
    error = caught.value
    assert error.param == param and error.type
    assert param.split("[")[0] in error.message and all(w in error.message for w in words), error.message
    return error


# 1. compatibility, field by field


def test_content_parts_are_joined_and_other_parts_refused_by_type(server, client):
    whole = client.chat.completions.create(model=MODEL, messages=chat("Hello there"), max_tokens=3)
    parts = [{"type": "text", "text": "Hello"}, {"type": "text", "text": " there"}]
    split = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": parts}], max_tokens=3)
    assert split.usage.prompt_tokens == whole.usage.prompt_tokens, "the parts read as the one string"
    assert split.choices[0].message.content == whole.choices[0].message.content
    for part in ({"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
                 {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}):  # fmt: skip
        content = [{"type": "text", "text": "What is this?"}, part]
        error = refused(
            lambda c=content: client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": c}], max_tokens=3
            ),
            "messages[0].content",
            part["type"],
        )
        assert error.code == "unsupported_value" and "part [1]" in error.message


def test_the_developer_role_reads_as_system_and_says_so(server, client):
    turns = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    system = client.chat.completions.create(model=MODEL, messages=turns, max_tokens=3)
    developer = client.chat.completions.create(model=MODEL, messages=[{**turns[0], "role": "developer"}, turns[1]],
                                               max_tokens=3)  # fmt: skip
    ids = chat_ids(server["served"].tokenizer, turns)
    assert developer.usage.prompt_tokens == system.usage.prompt_tokens == len(ids)
    assert developer.choices[0].message.content == system.choices[0].message.content
    assert "developer" in ext(developer)["notes"] and "developer" not in ext(system)["notes"]


def test_every_completions_prompt_form_gives_one_choice_per_prompt_in_order(server, client):
    tokenizer = server["served"].tokenizer
    second = "Why"
    one = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3)
    two = client.completions.create(model=MODEL, prompt=second, max_tokens=3)
    ids = text_ids(tokenizer, PROMPT)
    as_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=3)
    assert as_ids.choices[0].text == one.choices[0].text and as_ids.usage.prompt_tokens == len(ids)
    for prompt in ([PROMPT, second], [ids, text_ids(tokenizer, second)]):
        both = client.completions.create(model=MODEL, prompt=prompt, max_tokens=3)
        assert [c.index for c in both.choices] == [0, 1]
        assert [c.text for c in both.choices] == [one.choices[0].text, two.choices[0].text]
        assert both.usage.prompt_tokens == one.usage.prompt_tokens + two.usage.prompt_tokens
        assert [r["engine_tokens"] for r in ext(both)["prompts"]] == [3, 3]
    pieces = list(client.completions.create(model=MODEL, prompt=[PROMPT, second], max_tokens=3, stream=True))
    texts = ["".join(p.choices[0].text for p in pieces if p.choices and p.choices[0].index == i) for i in (0, 1)]
    assert texts == [one.choices[0].text, two.choices[0].text]
    refused(lambda: client.completions.create(model=MODEL, prompt=[[2, 99_999]], max_tokens=3), "prompt[0]", "99999")


def test_stop_strings_cut_the_text_before_them_whole_and_streamed(server, client):
    ids = text_ids(server["served"].tokenizer, PROMPT)
    tokens = bare(server, ids, 8).tokens
    text = decode(server, tokens)
    stop = text[len(decode(server, tokens[:3])) - 2 :][:3]  # ends inside the third token or later
    at = text.index(stop)
    ends = next(k for k in range(1, 9) if stop in decode(server, tokens[:k]))  # the token that completes it
    for stops in (stop, [stop, "never-written"], ["never-written", stop]):
        whole = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, stop=stops)
        assert whole.choices[0].text == text[:at] and whole.choices[0].finish_reason == "stop"
        assert whole.usage.completion_tokens == ends
        pieces = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, stop=stops, stream=True))
        assert "".join(p.choices[0].text for p in pieces) == text[:at], "nothing of the stop string streams out"
        assert pieces[-1].choices[0].finish_reason == "stop"
    chat_ids_ = chat_ids(server["served"].tokenizer, chat("Hello there"))
    reply = decode(server, bare(server, chat_ids_, 6).tokens)
    cut = client.chat.completions.create(model=MODEL, messages=chat("Hello there"), max_tokens=6, stop=reply[3:6])
    assert cut.choices[0].message.content == reply[: reply.index(reply[3:6])]
    assert cut.choices[0].finish_reason == "stop"
    refused(lambda: client.completions.create(model=MODEL, prompt=PROMPT, stop=list("abcde")), "stop", "4")


def test_min_tokens_looks_for_stop_strings_only_after_them(server, client):
    ids = text_ids(server["served"].tokenizer, PROMPT)
    tokens = bare(server, ids, 8).tokens
    text = decode(server, tokens)
    stop = decode(server, tokens[:1])[-2:]  # written by the first token
    floor = len(decode(server, tokens[:3]))
    later = text.find(stop, floor)
    whole = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, stop=stop, extra_body={"min_tokens": 3})
    assert whole.choices[0].text == (text if later < 0 else text[:later])
    assert whole.choices[0].finish_reason == ("length" if later < 0 else "stop")
    assert client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, stop=stop).usage.completion_tokens == 1
    refused(
        lambda: client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, extra_body={"min_tokens": 3}),
        "min_tokens",
    )


def test_ignore_eos_and_min_tokens_take_effect_at_an_eos_id(server):
    """The tiny model never writes its own EOS ids: the app is told that a token it writes third is EOS."""
    ids = text_ids(server["served"].tokenizer, PROMPT)
    tokens = bare(server, ids, 8).tokens
    eos = tokens[2]
    first = tokens.index(eos)
    with another_app(server, eos_ids=[eos]) as url:
        client = connect(url, server)
        plain = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8)
        assert plain.choices[0].finish_reason == "stop" and plain.usage.completion_tokens == first + 1
        assert plain.choices[0].text == decode(server, tokens[:first])
        kept = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, extra_body={"ignore_eos": True})
        assert kept.choices[0].finish_reason == "length" and kept.usage.completion_tokens == 8
        assert kept.choices[0].text == decode(server, [t for t in tokens if t != eos]), "EOS writes no text"
        held = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, extra_body={"min_tokens": first + 1})
        after = next((i for i, t in enumerate(tokens) if t == eos and i > first), None)
        assert held.usage.completion_tokens == (8 if after is None else after + 1)
        assert held.choices[0].finish_reason == ("length" if after is None else "stop")
        for body, text, count in (
            ({"ignore_eos": True}, kept.choices[0].text, 8),
            ({}, plain.choices[0].text, first + 1),
        ):
            pieces = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, stream=True,
                                                    extra_body=body))  # fmt: skip
            assert "".join(p.choices[0].text for p in pieces) == text
            assert sum(p.model_extra["decodebench"].get("tokens", 0) for p in pieces) == count


def expected_scores(logits: torch.Tensor, tokens: list[int], k: int) -> tuple[list[float], list[list[float]]]:
    """From the engine's logits: each token's log-probability as logit - logsumexp(logits), and the k best
    log-probabilities at each position (sorted, not top-k: ties need not pick the same ids)."""
    wide = logits.double()
    norm = wide - torch.logsumexp(wide, dim=-1, keepdim=True)
    chosen = [float(norm[i, t]) for i, t in enumerate(tokens)]
    return chosen, [torch.sort(norm[i], descending=True).values[:k].tolist() for i in range(len(tokens))]


def flat(rows: Any) -> list[float]:
    return [value for row in rows for value in row]


def test_chat_logprobs_are_the_engines_own_in_openais_shape(server, client):
    tokenizer = server["served"].tokenizer
    gen = bare(server, chat_ids(tokenizer, chat("Hello there")), 5)
    chosen, best = expected_scores(gen.logits, gen.tokens, 3)
    reply = client.chat.completions.create(model=MODEL, messages=chat("Hello there"), max_tokens=5, logprobs=True,
                                           top_logprobs=3)  # fmt: skip
    content = reply.choices[0].logprobs.content
    assert [c.logprob for c in content] == pytest.approx(chosen, abs=1e-9)
    assert bytes(b for c in content for b in c.bytes).decode() == reply.choices[0].message.content
    assert all(bytes(c.bytes) == c.token.encode() for c in content if "\ufffd" not in c.token)
    for entry, values in zip(content, best, strict=True):
        assert [e.logprob for e in entry.top_logprobs] == pytest.approx(values, abs=1e-9)
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob), "greedy: the chosen token is a best one"
    plain = client.chat.completions.create(model=MODEL, messages=chat("Hello there"), max_tokens=5, logprobs=True)
    assert [c.top_logprobs for c in plain.choices[0].logprobs.content] == [[]] * 5
    chunks = list(client.chat.completions.create(model=MODEL, messages=chat("Hello there"), max_tokens=5,
                                                 logprobs=True, top_logprobs=3, stream=True))  # fmt: skip
    streamed = [c for chunk in chunks if chunk.choices and chunk.choices[0].logprobs
                for c in chunk.choices[0].logprobs.content]  # fmt: skip
    assert [c.logprob for c in streamed] == [c.logprob for c in content], "a stream carries them on its last chunk"
    refused(lambda: client.chat.completions.create(model=MODEL, messages=chat("Hi"), logprobs=True, top_logprobs=6),
            "top_logprobs", "5")  # fmt: skip
    refused(lambda: client.chat.completions.create(model=MODEL, messages=chat("Hi"), top_logprobs=2), "top_logprobs",
            "logprobs")  # fmt: skip


def test_completion_logprobs_carry_tokens_offsets_and_top_alternatives(server, client):
    tokenizer = server["served"].tokenizer
    gen = bare(server, text_ids(tokenizer, PROMPT), 5)
    chosen, best = expected_scores(gen.logits, gen.tokens, 2)
    done = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, logprobs=2)
    lp, text = done.choices[0].logprobs, done.choices[0].text
    assert lp.token_logprobs == pytest.approx(chosen, abs=1e-9)
    assert flat(sorted(d.values(), reverse=True) for d in lp.top_logprobs) == pytest.approx(flat(best), abs=1e-9)
    assert lp.text_offset == [len(decode(server, gen.tokens[:i])) for i in range(5)]
    assert "".join(lp.tokens) == text and lp.text_offset[0] == 0
    refused(lambda: client.completions.create(model=MODEL, prompt=PROMPT, logprobs=6), "logprobs", "5")


def check_echo(server: dict[str, Any], client: openai.OpenAI) -> None:
    """Echo with logprobs against the engine's own calls: each prompt token from a call on its prefix (a
    prompt read, another program than the server's pass over the prompt: bf16 rounding apart), the reply's
    from the call on the whole prompt."""
    tokenizer = server["served"].tokenizer
    ids = text_ids(tokenizer, PROMPT)
    prefixes = [expected_scores(bare(server, ids[:j], 1).logits[:1], [ids[j]], 2) for j in range(1, len(ids))]
    gen = bare(server, ids, 3)
    chosen, best = expected_scores(gen.logits, gen.tokens, 2)
    done = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, echo=True, logprobs=2)
    lp, text = done.choices[0].logprobs, done.choices[0].text
    assert text == PROMPT + decode(server, gen.tokens)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None, "nothing predicts the first token"
    assert lp.token_logprobs[1 : len(ids)] == pytest.approx([p[0][0] for p in prefixes], abs=2e-2)
    assert flat(sorted(d.values(), reverse=True) for d in lp.top_logprobs[1 : len(ids)]) == pytest.approx(
        flat(p[1][0] for p in prefixes), abs=2e-2
    )
    assert lp.token_logprobs[len(ids) :] == pytest.approx(chosen, abs=1e-9)
    tops = flat(sorted(d.values(), reverse=True) for d in lp.top_logprobs[len(ids) :])
    assert tops == pytest.approx(flat(best), abs=1e-9)
    assert len(lp.tokens) == len(lp.text_offset) == len(ids) + 3
    assert lp.text_offset[len(ids)] == len(PROMPT) and "".join(lp.tokens[1:]) == text


def test_echo_returns_the_prompt_and_its_logprobs_teacher_forced_or_in_one_forward(server, client, cache_dir):
    alone = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3)
    assert client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, echo=True).choices[0].text == (
        PROMPT + alone.choices[0].text
    )
    check_echo(server, client)  # ring: teacher-forced, a decode step per prompt token
    with serving_engine(cache_dir, "generate") as generate:  # one forward over the prompt
        check_echo(generate, connect(generate["url"], generate))


def test_an_engine_that_cannot_read_a_prompts_logits_refuses_echo_with_logprobs_by_name(server):
    with another_app(server, opened=dataclasses.replace(server["opened"], cls=RustEngine)) as url:
        client = connect(url, server)
        error = refused(lambda: client.completions.create(model=MODEL, prompt=PROMPT, echo=True, logprobs=1), "echo",
                        "rust", "ring", "generate")  # fmt: skip
        assert error.code == "unsupported_value"
        assert client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, echo=True).choices[0].text


def test_a_model_by_id_and_unknown_routes_answer_openai_shaped(server, client):
    assert client.models.retrieve(MODEL).id == MODEL
    before = metrics(server["url"]).get("decodebench_rejected_total", 0)
    refused(lambda: client.models.retrieve("gpt-4"), "model", "gpt-4", status=openai.NotFoundError)
    with pytest.raises(openai.NotFoundError) as caught:
        client.get("/nowhere", cast_to=object)
    assert caught.value.code == "not_found" and "/v1/nowhere" in caught.value.message
    with pytest.raises(openai.APIStatusError) as caught:
        client.delete("/models", cast_to=object)
    assert caught.value.status_code == 405 and caught.value.code == "method_not_allowed"
    assert metrics(server["url"])["decodebench_rejected_total"] == before + 3


CHAT_REFUSED = [
    ("temperature", 0.7, "greedy"),
    ("top_p", 0.9, "greedy"),
    ("n", 2, "one reply"),
    ("response_format", {"type": "json_object"}, "text"),
    ("tools", [{"type": "function", "function": {"name": "f", "parameters": {}}}], "tools"),
    ("tool_choice", "auto", "tools"),
    ("functions", [{"name": "f", "parameters": {}}], "tools"),
    ("logit_bias", {"50": 5}, "argmax"),
    ("presence_penalty", 0.5, "penalty"),
    ("frequency_penalty", -0.5, "penalty"),
    ("max_completion_tokens", 7, "max_tokens"),  # beside max_tokens=3: two budgets
    ("audio", {"voice": "alloy", "format": "wav"}, "unrecognized"),
    ("reasoning_effort", "low", "unrecognized"),
    ("banana", 1, "unrecognized"),
]
COMPLETION_REFUSED = [("best_of", 2, "one reply"), ("suffix", "end.", "fill-in-the-middle"), ("n", 3, "one reply"),
                      ("temperature", 1.0, "greedy")]  # fmt: skip


@pytest.mark.parametrize("field, value, why", CHAT_REFUSED, ids=[row[0] + "-chat" for row in CHAT_REFUSED])
def test_a_chat_field_that_cannot_take_effect_is_refused_by_name(server, client, field, value, why):
    before = metrics(server["url"]).get("decodebench_rejected_total", 0)
    error = refused(lambda: client.chat.completions.create(model=MODEL, messages=chat("Hi"), max_tokens=3,
                                                           extra_body={field: value}), field, why)  # fmt: skip
    assert error.code in ("unsupported_value", "unrecognized_field")
    assert metrics(server["url"])["decodebench_rejected_total"] == before + 1


@pytest.mark.parametrize("field, value, why", COMPLETION_REFUSED, ids=[row[0] for row in COMPLETION_REFUSED])
def test_a_completions_field_that_cannot_take_effect_is_refused_by_name(client, field, value, why):
    refused(lambda: client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, extra_body={field: value}),
            field, why)  # fmt: skip


def test_harmless_fields_are_accepted_and_listed_as_ignored(client):
    plain = client.chat.completions.create(model=MODEL, messages=chat("Hi"), max_tokens=3)
    assert ext(plain)["ignored"] == [] and ext(plain)["notes"] == {}
    noted = client.chat.completions.create(
        model=MODEL, messages=chat("Hi"), max_tokens=3, max_completion_tokens=3, user="u1", metadata={"k": "v"},
        store=False, parallel_tool_calls=False, seed=7, stream_options={"include_usage": True}, temperature=0,
        top_p=1, n=1, presence_penalty=0, frequency_penalty=0, response_format={"type": "text"},
    )  # fmt: skip
    assert noted.choices[0].message.content == plain.choices[0].message.content
    assert sorted(ext(noted)["ignored"]) == ["metadata", "parallel_tool_calls", "seed", "store", "stream_options",
                                             "user"]  # fmt: skip
    assert "deterministic" in ext(noted)["notes"]["seed"]
    other_seed = client.chat.completions.create(model=MODEL, messages=chat("Hi"), max_tokens=3, seed=8)
    assert other_seed.choices[0].message.content == plain.choices[0].message.content
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, stream=True, user="u",
                                            stream_options={"include_usage": True}))  # fmt: skip
    assert chunks[-1].usage.completion_tokens == 2, "stream_options takes effect on a stream"
    last = [c.model_extra["decodebench"] for c in chunks if c.choices and c.choices[0].finish_reason]
    assert [x["ignored"] for x in last] == [["user"]]


def test_log_probabilities_name_tokens_by_id_when_asked(client):
    by_id = {"return_tokens_as_token_ids": True, "return_token_ids": True}
    named = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, logprobs=2, extra_body=by_id)
    choice = named.choices[0]
    assert choice.logprobs.tokens == [f"token_id:{t}" for t in choice.model_extra["token_ids"]]
    assert all(len(row) == 2 and all(k.startswith("token_id:") for k in row) for row in choice.logprobs.top_logprobs)
    assert ext(named)["ignored"] == []
    unnamed = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3,
                                        extra_body={"return_tokens_as_token_ids": True})  # fmt: skip
    assert ext(unnamed)["ignored"] == ["return_tokens_as_token_ids"], "no log-probabilities to name tokens in"


ASKED = 8  # tokens the load generators' bodies ask for
GUIDELLM_STREAM = {"include_usage": True, "continuous_usage_stats": True}  # vLLM's: usage on every chunk


def guidellm_chat(stream: bool) -> dict[str, Any]:
    """GuideLLM 0.8.1's chat body, written against vLLM's API (both budgets, ``stop: null``, ``ignore_eos``)."""
    body = {"model": MODEL, "messages": chat(PROMPT), "stream": stream, "max_completion_tokens": ASKED,
            "max_tokens": ASKED, "stop": None, "ignore_eos": True}  # fmt: skip
    return {**body, "stream_options": GUIDELLM_STREAM} if stream else body


def aiperf_body(endpoint: str) -> dict[str, Any]:
    """AIPerf 0.13's streamed body as serving/aiperf.py runs it (``--extra-inputs ignore_eos:true``): chat turns
    ask with ``max_completion_tokens``, completions prompts with ``max_tokens``; usage once, at the end."""
    asked = {"messages": chat(PROMPT), "max_completion_tokens": ASKED} if endpoint == "chat/completions" else {
        "prompt": PROMPT, "max_tokens": ASKED}  # fmt: skip
    return {**asked, "model": MODEL, "stream": True, "ignore_eos": True, "stream_options": {"include_usage": True}}


def posted(url: str, endpoint: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    """``body`` sent as it is (200 asserted): the response, or a stream's chunks (``[DONE]`` asserted last)."""
    with httpx.stream("POST", f"{url}/v1/{endpoint}", json=body, timeout=120) as response:
        assert response.status_code == 200, response.read()
        if not body["stream"]:
            return [json.loads(response.read())]
        events = [line.removeprefix("data: ") for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(event) for event in events[:-1]]


@contextmanager
def eos_written_second(server: dict[str, Any]) -> Iterator[str]:
    """An app told that the second token the model writes, to the chat and to the completions prompt, is EOS: a
    reply that still has every token asked took ``ignore_eos``."""
    tokenizer = server["served"].tokenizer
    prompts = (chat_ids(tokenizer, chat(PROMPT)), text_ids(tokenizer, PROMPT))
    with another_app(server, eos_ids=[bare(server, ids, 2).tokens[1] for ids in prompts]) as url:
        server["paced"].pause_s = 0.0
        yield url


def test_guidellms_chat_bodies_get_the_tokens_asked_and_usage_on_every_chunk(server):
    prompt_tokens = len(chat_ids(server["served"].tokenizer, chat(PROMPT)))
    with eos_written_second(server) as url:
        (whole,) = posted(url, "chat/completions", guidellm_chat(stream=False))
        assert whole["usage"] == {"prompt_tokens": prompt_tokens, "completion_tokens": ASKED,
                                  "total_tokens": prompt_tokens + ASKED}  # fmt: skip
        assert whole["choices"][0]["finish_reason"] == "length" and whole["decodebench"]["ignored"] == []
        (ended,) = posted(url, "chat/completions", {**guidellm_chat(stream=False), "ignore_eos": False})
        assert ended["usage"]["completion_tokens"] < ASKED, "without ignore_eos the EOS ends the reply"
        chunks = posted(url, "chat/completions", guidellm_chat(stream=True))
        sent = 0
        for chunk in chunks[:-1]:  # the last: usage alone (include_usage)
            sent += chunk.get("decodebench", {}).get("tokens", 0)
            assert chunk["usage"] == {"prompt_tokens": prompt_tokens, "completion_tokens": sent,
                                      "total_tokens": prompt_tokens + sent}  # fmt: skip
        assert sent == ASKED and chunks[-1]["usage"] == whole["usage"] and chunks[-1]["choices"] == []
        assert chunks[-2]["choices"][0]["finish_reason"] == "length" and chunks[-2]["decodebench"]["ignored"] == []
        assert "".join(c["choices"][0]["delta"]["content"] for c in chunks[:-1]) == whole["choices"][0]["message"][
            "content"]  # fmt: skip
        alone = posted(url, "chat/completions", {**guidellm_chat(stream=True),
                                                 "stream_options": {"continuous_usage_stats": True}})  # fmt: skip
        assert not any("usage" in chunk for chunk in alone), "vLLM's rule: usage on every chunk needs include_usage"
        assert alone[-1]["decodebench"]["ignored"] == ["stream_options.continuous_usage_stats"]


@pytest.mark.parametrize("endpoint", ["chat/completions", "completions"])
def test_aiperfs_bodies_get_the_tokens_asked_and_usage_at_the_end(server, endpoint):
    with eos_written_second(server) as url:
        chunks = posted(url, endpoint, aiperf_body(endpoint))
    assert sum(chunk.get("decodebench", {}).get("tokens", 0) for chunk in chunks) == ASKED
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == ASKED
    assert not any("usage" in chunk for chunk in chunks[:-1]), "usage once, at the end, without continuous_usage_stats"
    assert chunks[-2]["choices"][0]["finish_reason"] == "length" and chunks[-2]["decodebench"]["ignored"] == []


def test_text_stream_holds_back_what_could_start_a_stop_string(server):
    tokenizer = server["served"].tokenizer
    ids = tokenizer.encode("the ocean is deep and blue", add_special_tokens=False)
    stream = TextStream(tokenizer, StopRule(frozenset(), ("deep end",)))
    seen = [stream.feed([t]) for t in ids]
    joined = "".join(seen)
    assert joined + stream.visible(final=True) == "the ocean is deep and blue" and stream.cut is None
    shown_by_deep = "".join(seen[: next(i for i in range(len(ids)) if "deep" in decode(server, ids[: i + 1])) + 1])
    assert shown_by_deep == "the ocean is ", "'deep' could start 'deep end': held back until it cannot"
    assert stream.offsets == [len(decode(server, ids[:i])) for i in range(len(ids))]


# 2. robustness


def test_a_non_streamed_client_that_leaves_is_cancelled_at_once(server, monkeypatch):
    url, worker = server["url"], server["worker"]
    cancelled: list[float] = []
    submit = worker.submit

    def watched(job: Any) -> None:
        threading.Thread(target=lambda: job.cancel.wait(60) and cancelled.append(time.perf_counter()),
                         daemon=True).start()  # fmt: skip
        submit(job)

    monkeypatch.setattr(worker, "submit", watched)
    client = connect(url, server, timeout=0.5)
    server["paced"].pause_s = 0.05
    for _ in range(3):  # a watcher that polled at an interval would be late at random: three tries
        before = metrics(url)["decodebench_cancels_total"]
        with pytest.raises(openai.APITimeoutError):
            client.chat.completions.create(model=MODEL, messages=chat("Tell me a story"), max_tokens=200)
        dropped = time.perf_counter()
        wait_until(lambda b=before: metrics(url)["decodebench_cancels_total"] == b + 1 and worker.idle())
        assert cancelled[-1] - dropped < 0.1, f"cancelled {cancelled[-1] - dropped:.3f} s after the client left"
        assert worker.records[-1].finish == "cancelled" and worker.records[-1].engine_tokens < 200


def test_a_body_over_the_limit_is_a_413_and_a_full_queue_a_429_with_retry_after(server):
    worker = server["worker"]
    with another_app(server, settings=ServeConfig(max_body_bytes=2048, max_queue=1)) as url:
        client = connect(url, server)
        with pytest.raises(openai.APIStatusError) as caught:
            client.chat.completions.create(model=MODEL, messages=chat("word " * 500), max_tokens=3)
        assert caught.value.status_code == 413 and caught.value.code == "request_too_large"
        assert "max_body_bytes=2048" in caught.value.message
        assert client.chat.completions.create(model=MODEL, messages=chat("Hi"), max_tokens=2).usage

        server["paced"].pause_s = 0.1
        done: list[Any] = []
        asks = [threading.Thread(target=lambda: done.append(client.completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=4))) for _ in range(2)]  # fmt: skip
        asks[0].start()
        wait_until(lambda: worker.busy)
        asks[1].start()
        wait_until(lambda: worker.jobs.qsize() == 1)
        with pytest.raises(openai.RateLimitError) as caught:
            client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4)
        assert caught.value.code == "queue_full" and int(caught.value.response.headers["retry-after"]) >= 1
        for ask in asks:
            ask.join(60)
        assert len(done) == 2
        two = client.completions.create(model=MODEL, prompt=[PROMPT, PROMPT], max_tokens=1)
        assert len(two.choices) == 2, "an idle engine takes one prompt at once: one waits"
        asks[0] = threading.Thread(target=lambda: client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4))
        asks[0].start()
        wait_until(lambda: worker.busy)
        with pytest.raises(openai.RateLimitError):
            client.completions.create(model=MODEL, prompt=[PROMPT, PROMPT], max_tokens=1)
        asks[0].join(60)


def test_sigterm_stops_the_cli_as_ctrl_c_does_and_serve_settings_apply(cache_dir, tiny):
    proc, lines = spawn_serve("engine=generate", f"cache_dir={cache_dir}", "device=cpu", "serve.port=0",  # compiles
                              "max_new_tokens=4", "serve.max_body_bytes=1000")  # nothing  # fmt: skip
    try:
        url = served_line(lines).split(" at ")[1].split("/v1")[0]
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="test", max_retries=0, timeout=60)
        with pytest.raises(openai.APIStatusError) as caught:
            client.completions.create(model=MODEL, prompt="word " * 300, max_tokens=2)
        assert caught.value.status_code == 413 and "max_body_bytes=1000" in caught.value.message
    finally:
        assert stop(proc, signal.SIGTERM) == 0
    time.sleep(0.5)  # the reader thread's last lines
    rest = list(lines.queue)
    assert any("decodebench: stopped" in line for line in rest), rest
