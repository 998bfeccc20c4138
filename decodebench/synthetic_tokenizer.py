"""A SentencePiece-style BPE tokenizer with byte fallback trained here, shaped like Gemma 4's (special ids, chat
template, EOS set, ``tokenizer.json`` layout).

Deterministic from a seed: the corpus is generated, the trainer is single-pass BPE, and the vocabulary
is padded with ``<unused_N>`` tokens up to the model's vocabulary size so every id the model can
emit decodes.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

SPECIAL_TOKENS = ["<pad>", "<eos>", "<bos>", "<unk>", "<|turn>", "<turn|>"]  # ids 0..5
TURN_END = "<turn|>"
# Gemma 4's turn format: <bos><|turn>user\n...<turn|>\n<|turn>model\n
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "<|turn>{{ role }}\n{{ message['content'] | trim }}<turn|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|turn>model\n{% endif %}"
)
_SEED_SENTENCES = [
    "Write a short paragraph about the ocean.",
    "The ocean covers most of the planet and holds waves, tides, currents and deep blue water.",
    "Record 0412: code 583091. What is the code of record 0103? Answer with the six digits.",
    "What is a TPU? Two sentences.",
    "Each record has a six-digit code.",
    "Record 0001: code 123456.",
    "What is the code of record 0001? Answer with the six digits only.",
]


def _corpus(seed: int, lines: int = 6000) -> list[str]:
    rng = random.Random(seed)
    onsets = [
        "b",
        "c",
        "d",
        "f",
        "g",
        "h",
        "k",
        "l",
        "m",
        "n",
        "p",
        "r",
        "s",
        "t",
        "v",
        "w",
        "th",
        "st",
        "tr",
    ]
    vowels = ["a", "e", "i", "o", "u", "ea", "ou", "ai"]
    words = ["".join(rng.choice(onsets) + rng.choice(vowels) for _ in range(rng.randint(1, 3))) for _ in range(3000)]
    words += " ".join(_SEED_SENTENCES).replace(".", " ").replace("?", " ").replace(":", " ").split()
    text = list(_SEED_SENTENCES) * 50
    for _ in range(lines):
        sentence = " ".join(rng.choice(words) for _ in range(rng.randint(4, 14)))
        if rng.random() < 0.3:
            sentence += f" {rng.randint(0, 999999):06d}"
        text.append(sentence.capitalize() + rng.choice([".", "?", "!", ","]))
    return text


SPACE = "\u2581"  # SentencePiece's word marker: a space is this character inside every token
BYTE_TOKENS = [f"<0x{b:02X}>" for b in range(256)]  # byte fallback: any byte no token spells


def build_tokenizer(out_dir: Path, *, vocab_size: int, bpe_vocab: int, seed: int) -> dict[str, int]:
    """Trains, pads to ``vocab_size`` and saves with its chat template; returns the special ids.

    Shaped as Gemma's ``tokenizer.json`` is: SentencePiece-style BPE (a space is ``▁`` inside tokens, digits one
    each, merges never across a word's start), byte fallback (``<0x00>``..``<0xFF>`` right after the special
    tokens), the decoder a ``Sequence`` (``▁`` back to a space, bytes fused), no BOS added: so peers' converters
    and tokenizers (llama.cpp's, vLLM's) take it as they take the real checkpoint's."""
    bpe_vocab = min(bpe_vocab, vocab_size)
    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.normalizer = normalizers.Replace(" ", SPACE)
    tok.pre_tokenizer = pre_tokenizers.Sequence(  # for training only: pieces start at a word, digits one each
        [pre_tokenizers.Split(SPACE, behavior="merged_with_next"), pre_tokenizers.Digits(individual_digits=True)]
    )
    trainer = trainers.BpeTrainer(vocab_size=bpe_vocab, special_tokens=SPECIAL_TOKENS + BYTE_TOKENS,
                                  show_progress=False)  # fmt: skip
    tok.train_from_iterator(_corpus(seed), trainer=trainer)
    spec = json.loads(tok.to_str())
    spec["pre_tokenizer"] = None  # as Gemma's: the learnt merges alone keep words and digits apart
    spec["decoder"] = {"type": "Sequence", "decoders": [
        {"type": "Replace", "pattern": {"String": SPACE}, "content": " "},
        {"type": "ByteFallback"}, {"type": "Fuse"}]}  # fmt: skip
    byte_ids = {t: i for t, i in spec["model"]["vocab"].items() if t in BYTE_TOKENS}
    spec["added_tokens"] = [a for a in spec["added_tokens"] if a["content"] not in byte_ids]  # plain byte tokens
    vocab: dict[str, int] = spec["model"]["vocab"]
    for i in range(len(vocab), vocab_size):
        vocab[f"<unused_{i}>"] = i
    tok = Tokenizer.from_str(json.dumps(spec))
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<bos>",
        eos_token="<eos>",
        pad_token="<pad>",
        unk_token="<unk>",
        additional_special_tokens=["<|turn>", TURN_END],
        chat_template=CHAT_TEMPLATE,
    )
    fast.save_pretrained(out_dir)
    ids = {name: tok.token_to_id(name) for name in SPECIAL_TOKENS}
    assert ids["<pad>"] == 0 and ids["<eos>"] == 1 and ids["<bos>"] == 2, ids
    return ids
