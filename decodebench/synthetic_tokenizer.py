"""A byte-level BPE tokenizer trained here, shaped like Gemma 4's (special ids, chat template, EOS set).

Deterministic from a seed: the corpus is generated, the trainer is single-pass BPE, and the vocabulary
is padded with ``<unused_N>`` tokens up to the model's vocabulary size so every id the model can
emit decodes.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
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


def build_tokenizer(out_dir: Path, *, vocab_size: int, bpe_vocab: int, seed: int) -> dict[str, int]:
    """Trains, pads to ``vocab_size`` and saves with its chat template; returns the special ids."""
    bpe_vocab = min(bpe_vocab, vocab_size)
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=bpe_vocab,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(seed), trainer=trainer)
    spec = json.loads(tok.to_str())
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
