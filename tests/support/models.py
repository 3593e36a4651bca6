"""The tiny test models and their data. Sizes are deliberately odd (vocab 97, hidden 30, intermediate 46) so
nothing divides evenly by 2 or 3 ranks. The global batch (6) is kept constant across world sizes 1, 2 and 3.
"""

from __future__ import annotations

import os

import torch
from torch.utils.data import Dataset


GLOBAL_BATCH = 6


SEQ_LEN = 16


VOCAB = 97


class TokenDataset(Dataset):
    """Fixed-length random token sequences (no padding, so per-rank token counts are equal)."""

    def __init__(self, n: int = 96, seed: int = 1234):
        g = torch.Generator().manual_seed(seed)
        self.data = torch.randint(0, VOCAB, (n, SEQ_LEN), generator=g)

    def __len__(self):
        return len(self.data)

    def __getitem__(self, i):
        return {"input_ids": self.data[i], "labels": self.data[i].clone(), "attention_mask": torch.ones(SEQ_LEN, dtype=torch.long)}


def build_model(kind: str = "llama", seed: int = 0):
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    if kind == "llama":
        config = LlamaConfig(vocab_size=VOCAB, hidden_size=30, intermediate_size=46, num_hidden_layers=2,
                             num_attention_heads=3, num_key_value_heads=1, max_position_embeddings=64,
                             tie_word_embeddings=False)
        return LlamaForCausalLM(config)
    if kind == "gpt2":  # tied embeddings
        config = GPT2Config(vocab_size=VOCAB, n_embd=30, n_layer=2, n_head=3, n_positions=64,
                            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, tie_word_embeddings=True)
        return GPT2LMHeadModel(config)
    if kind == "llama_s3":  # embeddings of 12 MB: each of 2 ranks holds more than S3's 5 MiB smallest part of them
        return LlamaForCausalLM(LlamaConfig(vocab_size=6007, hidden_size=512, intermediate_size=343,
                                            num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=1,
                                            max_position_embeddings=64, tie_word_embeddings=False))
    if kind in TP_LLAMA:  # heads tensor parallelism can split, widths it cannot split evenly
        return LlamaForCausalLM(LlamaConfig(**TP_LLAMA[kind]))
    if kind in MOE:
        return _moe_model(kind)
    if kind == "hrm_text":  # saves fused gate_up_proj / gqkv_proj, holds them split: a concatenation when saved
        from transformers import HrmTextConfig, HrmTextForCausalLM

        return HrmTextForCausalLM(HrmTextConfig(vocab_size=VOCAB, hidden_size=24, intermediate_size=46,
                                                num_hidden_layers=2, num_attention_heads=3, head_dim=8,
                                                max_position_embeddings=64))
    if kind == "lora_moe":  # adapters on attention and on the fused experts (PEFT's target_parameters)
        from peft import LoraConfig, get_peft_model

        base = build_model("qwen3_moe", seed)
        return get_peft_model(base, LoraConfig(r=3, lora_alpha=6, target_modules=["q_proj", "v_proj"],
                                               target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
                                               lora_dropout=0.0))
    if kind == "lora":
        from peft import LoraConfig, get_peft_model

        base = build_model("llama", seed)
        return get_peft_model(base, LoraConfig(r=3, lora_alpha=6, target_modules=["q_proj", "v_proj"], lora_dropout=0.0))
    raise ValueError(kind)


#: Mixture-of-Experts models (transformers 5 fuses their experts at run time; save_pretrained writes them per expert):
#: hidden and expert widths that are multiples of 8 (the grouped expert kernels need 16-byte strides, in bf16 too;
#: DESIGN.md section 5), 5 experts (3 + 2 rows at 2 ranks; every ZeRO partition boundary cuts an expert), vocab 97. `qwen3_moe_square`: experts of
#: intermediate size = hidden size (conversions that decide a transposition by comparing shapes; transformers
#: #47031). `deepseek_v3`: a dense first layer, routed + shared experts, MLA attention, a persistent bias buffer.
MOE = {
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(
        intermediate_size=46, moe_intermediate_size=8, num_experts=5, num_experts_per_tok=2, head_dim=10)),
    "qwen3_moe_square": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(
        intermediate_size=46, moe_intermediate_size=32, hidden_size=32, num_experts=5, num_experts_per_tok=2,
        head_dim=8)),
    "qwen3_moe_tied": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(  # lm_head is the embedding
        intermediate_size=46, moe_intermediate_size=8, num_experts=5, num_experts_per_tok=2, head_dim=10,
        tie_word_embeddings=True)),
    "qwen3_moe_ep": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(  # 4 experts: expert parallelism splits evenly
        intermediate_size=46, moe_intermediate_size=8, num_experts=4, num_experts_per_tok=2, head_dim=10)),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(
        intermediate_size=8, num_local_experts=5, num_experts_per_tok=2, head_dim=10)),
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM", dict(
        intermediate_size=46, moe_intermediate_size=8, n_routed_experts=5, num_experts_per_tok=2,
        n_shared_experts=1, first_k_dense_replace=1, n_group=1, topk_group=1, kv_lora_rank=8, q_lora_rank=12,
        qk_rope_head_dim=4, qk_nope_head_dim=6, v_head_dim=10, rope_interleave=False)),
}


def _moe_model(kind: str):
    import transformers

    config_cls, model_cls, fields = MOE[kind]
    base = dict(vocab_size=VOCAB, hidden_size=24, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=1,
                max_position_embeddings=64, tie_word_embeddings=False)
    config = getattr(transformers, config_cls)(**{**base, **fields})
    return getattr(transformers, model_cls)(config)


#: Llamas that transformers' tensor-parallel plan can shard at 2 ranks (it splits attention by heads: 4 heads, 2 KV
#: heads), with rows that still split unevenly (vocab 97: 49/48; intermediate 37: 19/18); one with tied embeddings.
TP_LLAMA = {kind: dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=37, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=tied)
            for kind, tied in (("llama_tp", False), ("llama_tp_tied", True))}


def tp_model(kind: str, tp_size: int, fsdp_size: int, workdir, dtype: str | None = None):
    """The `kind` model loaded as tensor-parallel users load it: `from_pretrained` with a `DistributedConfig`, which
    shards it at load time (DTensor parameters on a (fsdp, tp) mesh; FSDP2 applied by transformers when
    fsdp_size > 1), from the seeded weights rank 0 writes first."""
    from transformers import AutoModelForCausalLM
    from transformers.distributed import DistributedConfig

    import torch.distributed as dist

    if not dist.is_initialized():  # transformers writes from rank 0 only once there is a process group
        dist.init_process_group("gloo")
    folder = os.path.join(str(workdir), f"pretrained-{kind}")
    if dist.get_rank() == 0 and not os.path.isfile(os.path.join(folder, "config.json")):
        build_model(kind).save_pretrained(folder)
    dist.barrier()
    config = DistributedConfig(tp_size=tp_size, fsdp_size=fsdp_size) if tp_size else \
        DistributedConfig(ep_size=fsdp_size, fsdp_size=fsdp_size)  # tp_size 0: expert parallelism over fsdp_size
    return AutoModelForCausalLM.from_pretrained(folder, dtype=getattr(torch, dtype or "float32"),
                                                distributed_config=config)


def pretrained_model(kind: str, workdir):
    """The `kind` model loaded as users load one: `from_pretrained` of the files `save_pretrained` wrote (rank 0
    writes them once; for a Mixture-of-Experts model, per expert), under whatever DeepSpeed config is active."""
    from transformers import AutoModelForCausalLM

    import torch.distributed as dist

    folder = os.path.join(str(workdir), f"pretrained-{kind}")
    if (not dist.is_initialized() or dist.get_rank() == 0) and not os.path.isfile(os.path.join(folder, "config.json")):
        build_model(kind).save_pretrained(folder)
    if dist.is_initialized():
        dist.barrier()
    from transformers.integrations import is_deepspeed_zero3_enabled

    if is_deepspeed_zero3_enabled():  # zero.Init partitions at load: DeepSpeed's process group first (DESIGN.md 5)
        import deepspeed

        deepspeed.init_distributed("gloo")
    return AutoModelForCausalLM.from_pretrained(folder)


#: The decoder layer class of each test model: one FSDP unit each.
LAYER_CLASS = {"llama": "LlamaDecoderLayer", "lora": "LlamaDecoderLayer", "gpt2": "GPT2Block",
               "llama_tp": "LlamaDecoderLayer", "llama_tp_tied": "LlamaDecoderLayer", "llama_s3": "LlamaDecoderLayer",
               "qwen3_moe": "Qwen3MoeDecoderLayer", "qwen3_moe_square": "Qwen3MoeDecoderLayer",
               "mixtral": "MixtralDecoderLayer", "deepseek_v3": "DeepseekV3DecoderLayer",
               "lora_moe": "Qwen3MoeDecoderLayer", "qwen3_moe_pretrained": "Qwen3MoeDecoderLayer",
               "qwen3_moe_tied": "Qwen3MoeDecoderLayer"}
