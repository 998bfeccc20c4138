"""What a request may say, field by field, as OpenAI's reference names the fields (pydantic models).

Every field a client sends is one of four kinds, and nothing is dropped silently:

* taken, as OpenAI documents it: ``model``, ``messages`` (text content, or a list of text parts,
  joined), ``prompt`` (a string, strings, token ids, lists of token ids), ``max_tokens``,
  ``max_completion_tokens``, ``stream``, ``stream_options.include_usage``, ``stop``, ``logprobs``,
  ``top_logprobs``, ``echo``; and vLLM's ``ignore_eos``, ``min_tokens``,
  ``stream_options.continuous_usage_stats`` (with ``include_usage``: every streamed chunk carries ``usage``,
  the prompt's tokens and the reply's so far, as load generators such as GuideLLM ask) and
  ``return_token_ids`` (each choice, and each streamed chunk, carries the ``token_ids`` it holds: how
  ``engine=openai`` reads tokens),
  ``return_tokens_as_token_ids`` (log-probabilities name each token ``token_id:<id>``, not by its text, so
  two ids with the same text stay apart: how ``engine=openai``'s parity reads them);
* accepted only at a value that describes what this server does (greedy decoding, one reply, plain
  text): ``temperature`` 0, ``top_p`` 1, ``n`` 1, ``best_of`` 1, penalties 0, ``response_format``
  text, no ``tools``, ``tool_choice`` "none", ...; any other value is refused by name, with why;
* accepted without effect and listed in the response's ``decodebench.ignored``: ``return_tokens_as_token_ids``
  without log-probabilities, ``user``,
  ``metadata``, ``store``, ``parallel_tool_calls`` (no tools can be given), ``seed`` (greedy decoding
  is deterministic), ``stream_options`` on a request that does not stream, ``continuous_usage_stats``
  without ``include_usage`` (vLLM's rule: no usage is asked for);
* anything else is refused by name as unrecognized (``extra="forbid"``), never ignored.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any, ClassVar, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    ValidationInfo,
    field_validator,
)
from pydantic_core import PydanticCustomError

MAX_LOGPROBS = 5  # most alternatives a position's top_logprobs (chat) or logprobs (completions) may ask for
MAX_STOPS = 4
SEED_NOTE = "greedy decoding is deterministic: the same request gives the same tokens whatever the seed"


def only(allowed: Callable[[Any], bool], why: str) -> AfterValidator:
    """A field accepted at the values ``allowed`` keeps (and null); any other is refused with ``why``
    (error type ``unsupported``)."""

    def check(value: Any) -> Any:
        if value is not None and not allowed(value):
            raise PydanticCustomError("unsupported", why)
        return value

    return AfterValidator(check)


Temperature = Annotated[float | None, only(lambda v: v == 0, "only 0 (or null): decoding is greedy")]
TopP = Annotated[float | None, only(lambda v: v == 1, "only 1 (or null): greedy decoding reads the whole vocabulary")]
One = Annotated[int | None, only(lambda v: v == 1, "only 1 (or null): greedy decoding writes one reply per prompt")]
Penalty = Annotated[float | None, only(lambda v: v == 0, "only 0 (or null): the engines apply no penalty")]
LogitBias = Annotated[dict[str, float] | None, only(lambda v: not v, "not supported: tokens are the logits' argmax")]
Tools = Annotated[list[Any] | None, only(lambda v: not v, "not supported: this server calls no tools")]
ToolChoice = Annotated[str | dict[str, Any] | None, only(lambda v: v == "none", 'only "none": no tools are called')]
TEXT_FORMAT = {"type": "text"}
ResponseFormat = Annotated[dict[str, Any] | None, only(lambda v: v == TEXT_FORMAT, 'only {"type": "text"}: plain text')]
NonEmpty = Annotated[str, Field(min_length=1)]


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    include_usage: bool | None = None
    continuous_usage_stats: bool | None = None  # vLLM's: usage on every chunk (with include_usage)


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["text"]
    text: str


def content_kind(value: Any) -> str:
    return "parts" if isinstance(value, list) else "text"


class Message(BaseModel):
    """One turn: ``content`` a string or a list of text parts (read joined, nothing between them)."""

    model_config = ConfigDict(extra="forbid", strict=True)
    role: Literal["system", "developer", "user", "assistant"]
    content: Annotated[Annotated[str, Tag("text")] | Annotated[list[TextPart], Tag("parts")],
                       Discriminator(content_kind)]  # fmt: skip

    @field_validator("content", mode="before")
    @classmethod
    def text_parts_only(cls, value: Any) -> Any:
        """A part of another type (image_url, input_audio, file, ...) is refused by its type."""
        for i, part in enumerate(value if isinstance(value, list) else []):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            if kind != "text":
                why = f"part [{i}] is of type {kind!r}: only text parts are read (the model reads text)"
                raise PydanticCustomError("unsupported", why)
        return value

    @property
    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class Common(BaseModel):
    """The fields both endpoints take; ``IGNORED``: those accepted without effect."""

    model_config = ConfigDict(extra="forbid", strict=True)
    IGNORED: ClassVar[tuple[str, ...]] = ("seed", "user")

    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: list[NonEmpty] | None = Field(default=None, max_length=MAX_STOPS)
    ignore_eos: bool = False
    min_tokens: int = Field(default=0, ge=0)
    return_token_ids: bool = False
    return_tokens_as_token_ids: bool = False
    seed: int | None = None
    user: str | None = None
    temperature: Temperature = None
    top_p: TopP = None
    n: One = None
    presence_penalty: Penalty = None
    frequency_penalty: Penalty = None
    logit_bias: LogitBias = None

    @field_validator("stop", mode="before")
    @classmethod
    def stops(cls, value: Any) -> Any:
        return [value] if isinstance(value, str) else value

    @property
    def budget(self) -> int | None:
        """The tokens asked for (None: what the cache holds after the prompt)."""
        return self.max_tokens

    def ignored(self) -> list[str]:
        """The fields this request set that have no effect here."""
        names = [name for name in self.IGNORED if getattr(self, name) is not None]
        names += ["stream_options"] if self.stream_options is not None and not self.stream else []
        alone = self.stream and self.stream_options and self.stream_options.continuous_usage_stats
        names += ["stream_options.continuous_usage_stats"] if alone and not self.include_usage else []
        unnamed = self.return_tokens_as_token_ids and self.top_k is None  # no log-probabilities to name tokens in
        return names + (["return_tokens_as_token_ids"] if unnamed else [])

    def notes(self) -> dict[str, str]:
        """Why a field had the effect it had, where a client could expect another."""
        return {"seed": SEED_NOTE} if self.seed is not None else {}

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        """Usage on every streamed chunk (vLLM's ``continuous_usage_stats``, which needs ``include_usage``)."""
        return self.include_usage and bool(self.stream_options.continuous_usage_stats)


class ChatRequest(Common):
    IGNORED: ClassVar[tuple[str, ...]] = (*Common.IGNORED, "metadata", "store", "parallel_tool_calls")

    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    metadata: dict[str, str] | None = None
    store: bool | None = None
    parallel_tool_calls: bool | None = None
    response_format: ResponseFormat = None
    tools: Tools = None
    functions: Tools = None
    tool_choice: ToolChoice = None
    function_call: ToolChoice = None

    @field_validator("max_completion_tokens")
    @classmethod
    def one_budget(cls, value: int | None, info: ValidationInfo) -> int | None:
        given = info.data.get("max_tokens")
        if value is not None and given is not None and given != value:
            raise PydanticCustomError("unsupported", f"{value} differs from max_tokens={given}: give one of them")
        return value

    @field_validator("top_logprobs")
    @classmethod
    def with_logprobs(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value is not None and not info.data.get("logprobs"):
            raise PydanticCustomError("unsupported", "needs logprobs: true")
        return value

    @property
    def budget(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    @property
    def top_k(self) -> int | None:
        """Alternatives per position when log-probabilities are asked for (None: not asked)."""
        return (self.top_logprobs or 0) if self.logprobs else None


def prompt_kind(value: Any) -> str:
    return "ids" if isinstance(value, list) else "text"


TokenIds = Annotated[list[int], Field(min_length=1)]
Prompt = Annotated[Annotated[NonEmpty, Tag("text")] | Annotated[TokenIds, Tag("ids")], Discriminator(prompt_kind)]


class CompletionRequest(Common):
    prompt: list[Prompt] = Field(min_length=1)
    echo: bool = False
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    best_of: One = None
    suffix: Annotated[str | None, only(lambda v: not v, "not supported: no fill-in-the-middle")] = None

    @field_validator("prompt", mode="before")
    @classmethod
    def prompts(cls, value: Any) -> Any:
        """One prompt (a string, or a list of token ids) or a list of them."""
        one = isinstance(value, str) or (isinstance(value, list) and bool(value) and isinstance(value[0], int))
        return [value] if one else value

    @property
    def top_k(self) -> int | None:
        return self.logprobs


def where(loc: tuple[Any, ...]) -> str:
    """A validation error's place as OpenAI's ``param`` writes it: ``messages[0].content``."""
    out = ""
    for part in loc[1:] if loc[:1] == ("body",) else loc:
        out += f"[{part}]" if isinstance(part, int) else f".{part}" if out else str(part)
    return out
