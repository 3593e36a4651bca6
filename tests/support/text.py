"""Text for the trainers that take it (TRL's SFT and DPO): a word-level tokenizer built locally (no download) over
`WORDS`, and random sentences of those words."""

from __future__ import annotations

import random

from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

WORDS = [f"w{i}" for i in range(90)]


def local_tokenizer() -> PreTrainedTokenizerFast:
    vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2, **{w: i + 3 for i, w in enumerate(WORDS)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")


def texts(n: int, seed: int = 0) -> list[str]:
    """`n` sentences of 12 random words (the same for the same seed)."""
    r = random.Random(seed)
    return [" ".join(r.choice(WORDS) for _ in range(12)) for _ in range(n)]
