"""Tiny stand-ins so the recipes run anywhere in seconds with nothing downloaded: a Llama-style model built from a
config, a word-level tokenizer built in memory, and three small datasets (plain text for pre-training,
prompt/completion for SFT, prompt/chosen/rejected for DPO).

The recipes use these only when no `model_name_or_path` / `dataset_name` is given; with them, the recipes load a
real model, tokenizer and dataset instead. Every sequence here has a fixed number of words (one token each), so
nothing is padded and the loss is the same whatever the per-device batch and the number of processes.
"""

from __future__ import annotations

import random

VOCAB_WORDS = 60
SPECIAL = ["<pad>", "<eos>", "<unk>"]


def words(tokens) -> str:
    return " ".join(f"w{t % VOCAB_WORDS}" for t in tokens)


def tokenizer():
    """A word-level tokenizer: `w0 ... w59` plus `<pad>`, `<eos>`, `<unk>` (no chat template: the datasets below are
    plain text, which SFTTrainer and DPOTrainer take as they are)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {**{s: i for i, s in enumerate(SPECIAL)}, **{f"w{i}": i + len(SPECIAL) for i in range(VOCAB_WORDS)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")


def llama_config():
    """A 2-layer Llama with hidden size 32 (about 20k parameters), untied embeddings, no dropout."""
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=len(SPECIAL) + VOCAB_WORDS, hidden_size=32, intermediate_size=64,
                       num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                       pad_token_id=0, eos_token_id=1, bos_token_id=None, tie_word_embeddings=False)


def llama(seed: int = 0):
    """The tiny Llama with weights drawn from `seed`: the same call gives the same model (e.g. a LoRA adapter's base
    model, or DPO's reference model)."""
    import torch
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(llama_config())


def _progression(r: random.Random, n: int) -> list[int]:
    start, stride = r.randrange(VOCAB_WORDS), r.randrange(1, 4)
    return [start + k * stride for k in range(n)]


def pretrain_dataset(n: int = 256, seed: int = 0):
    """`{"text"}`: lines of arithmetic progressions of words (learnable by the tiny model in a few steps)."""
    from datasets import Dataset

    r = random.Random(seed)
    return Dataset.from_dict({"text": [words(_progression(r, 20)) for _ in range(n)]})


def sft_dataset(n: int = 128, seed: int = 0):
    """`{"prompt", "completion"}`: the first 6 words of a progression, then its next 6 (after a space: SFTTrainer joins
    prompt and completion as they are)."""
    from datasets import Dataset

    r = random.Random(seed)
    rows = [_progression(r, 12) for _ in range(n)]
    return Dataset.from_dict({"prompt": [words(t[:6]) for t in rows], "completion": [" " + words(t[6:]) for t in rows]})


def dpo_dataset(n: int = 128, seed: int = 0):
    """`{"prompt", "chosen", "rejected"}`: a progression's start; its continuation is chosen, a shuffled one
    rejected (after a space: DPOTrainer joins prompt and answer as they are)."""
    from datasets import Dataset

    r = random.Random(seed)
    prompts, chosen, rejected = [], [], []
    for _ in range(n):
        t = _progression(r, 12)
        bad = t[6:]
        r.shuffle(bad)
        prompts.append(words(t[:6]))
        chosen.append(" " + words(t[6:]))
        rejected.append(" " + words(bad))
    return Dataset.from_dict({"prompt": prompts, "chosen": chosen, "rejected": rejected})
