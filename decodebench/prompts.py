"""Text into the token ids the model reads: the one prompt encoder for cells, the server and its clients."""

from __future__ import annotations

from typing import Any

from transformers import PreTrainedTokenizerBase


def chat_ids(tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, Any]]) -> list[int]:
    """A conversation through the checkpoint's chat template (which adds BOS), ready for the model's turn."""
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    return list(ids["input_ids"] if isinstance(ids, dict) else ids)


def text_ids(tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
    """Plain text as a completion reads it: BOS, then the text's own tokens."""
    return [tokenizer.bos_token_id, *tokenizer.encode(text, add_special_tokens=False)]


def prompt_ids(tokenizer: PreTrainedTokenizerBase, text: str, chat_template: bool) -> list[int]:
    """A run's prompt: one user turn through the chat template, or BOS + text."""
    return chat_ids(tokenizer, [{"role": "user", "content": text}]) if chat_template else text_ids(tokenizer, text)


def template_names(tokenizer: PreTrainedTokenizerBase, role: str) -> bool:
    """Whether the checkpoint's chat template names ``role`` in its source (a template that names no
    developer role would write one as an unknown turn the model never saw)."""
    return role in str(tokenizer.chat_template or "")
