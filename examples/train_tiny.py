"""Train a tiny Llama-style model (built from a config, nothing downloaded) with the Hugging Face Trainer.

This is an ordinary Trainer script; the two lines marked `# <- hf_unified_ckpt` are all the plugin needs.

    python examples/train_tiny.py --config configs/tiny_llama.yaml [--any_training_arg value ...]
    torchrun --standalone --nproc_per_node 2 examples/train_tiny.py --config configs/tiny_llama.yaml \
        --ddp_backend gloo [--deepspeed configs/ds_zero2.json]
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import yaml
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import HfArgumentParser, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast, Trainer

from hf_unified_ckpt import UnifiedCheckpointArguments, attach  # <- hf_unified_ckpt (arguments class)

VOCAB, SEQ_LEN = 64, 24


@dataclass
class ScriptArguments:
    config: str | None = field(default=None, metadata={"help": "YAML file of defaults; command-line flags win."})
    losses_file: str | None = field(default=None, metadata={"help": "Write {step: loss} here (rank 0)."})


class CountingDataset(torch.utils.data.Dataset):
    """Arithmetic progressions modulo VOCAB: start + k * stride. Learnable by a tiny model in a few steps."""

    def __init__(self, n: int = 1024, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        start = torch.randint(0, VOCAB, (n, 1), generator=g)
        stride = torch.randint(1, 4, (n, 1), generator=g)
        self.data = (start + stride * torch.arange(SEQ_LEN)) % VOCAB

    def __len__(self):
        return len(self.data)

    def __getitem__(self, i):
        return {"input_ids": self.data[i], "labels": self.data[i].clone()}


def tokenizer() -> PreTrainedTokenizerFast:
    vocab = {f"t{i}": i for i in range(VOCAB)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0", pad_token="t0", eos_token="t63")


def tiny_llama() -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=48, intermediate_size=94, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         pad_token_id=0, eos_token_id=63, bos_token_id=None)
    return LlamaForCausalLM(config)


def parse(argv: list[str]):
    parser = HfArgumentParser((ScriptArguments, UnifiedCheckpointArguments))
    script, _ = parser.parse_known_args(argv)[0], None
    defaults = []
    if script.config:
        with open(script.config) as f:
            for key, value in (yaml.safe_load(f) or {}).items():
                defaults += [f"--{key}", str(value).lower() if isinstance(value, bool) else str(value)]
    return parser.parse_args_into_dataclasses(defaults + argv)


def main(argv: list[str]) -> None:
    script, args = parse(argv)
    if args.deepspeed:  # CPU demo: gloo does the collectives; skip JIT-compiling DeepSpeed's shared-memory op
        import deepspeed

        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    trainer = Trainer(model=tiny_llama(), args=args, train_dataset=CountingDataset(), processing_class=tokenizer())
    attach(trainer)  # <- hf_unified_ckpt (one line)
    resume = args.resume_from_checkpoint
    trainer.train(resume_from_checkpoint={"true": True, "false": None}.get(str(resume).lower(), resume))
    if script.losses_file and trainer.is_world_process_zero():
        losses = {h["step"]: h["loss"] for h in trainer.state.log_history if "loss" in h}
        with open(script.losses_file, "w") as f:
            json.dump(losses, f)
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
