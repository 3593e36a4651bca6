"""Pre-train a causal language model from its config (random weights) with the Hugging Face Trainer, saving unified
checkpoints that resume on any engine and number of processes and load with `from_pretrained`.

Without `model_name_or_path` / `dataset_name` it pre-trains a tiny Llama on tiny text (examples/recipes/tiny.py);
with them, a model with that config and tokenizer (a Hub name or a local folder) on that dataset's `text` column.

Launch from the repository root (any flag overrides the YAML; CPU shown, on GPUs drop `use_cpu` / `ddp_backend`):

    torchrun --standalone --nproc_per_node 2 examples/recipes/pretrain.py --config configs/recipes/pretrain.yaml
    torchrun --standalone --nproc_per_node 2 examples/recipes/pretrain.py --config configs/recipes/pretrain.yaml \
        --deepspeed configs/ds_zero3.json
    deepspeed --num_gpus 2 examples/recipes/pretrain.py --config configs/recipes/pretrain.yaml \
        --deepspeed configs/ds_zero3.json       # on CPU too: --num_gpus is the number of processes there
    accelerate launch --config_file configs/accelerate/ddp.yaml examples/recipes/pretrain.py \
        --config configs/recipes/pretrain.yaml                 # or deepspeed_zero3.yaml, fsdp2.yaml
    python examples/recipes/pretrain.py --config configs/recipes/pretrain.yaml      # one process

Resume (newest complete checkpoint of output_dir, or a path) on any engine and number of processes; keep the
global batch (per_device_train_batch_size x processes x gradient_accumulation_steps) when the number changes:

    python examples/recipes/pretrain.py --config configs/recipes/pretrain.yaml --per_device_train_batch_size 8 \
        --resume_from_checkpoint output/pretrain/checkpoint-3

Load the result: `AutoModelForCausalLM.from_pretrained("output/pretrain/checkpoint-6")`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import chain

from transformers import (AutoConfig, AutoModelForCausalLM, AutoTokenizer, DataCollatorForLanguageModeling, Trainer,
                          set_seed)
from trl import ModelConfig, ScriptArguments, TrlParser

import tiny
from common import end_processes, prepare_deepspeed_on_cpu, resume_value
from hf_unified_ckpt import UnifiedCheckpointArguments, UnifiedCheckpointCallback


@dataclass
class PretrainScriptArguments(ScriptArguments):
    block_size: int = field(default=16, metadata={"help": "Tokens per training sequence (texts are concatenated, "
                                                          "then cut into blocks of this length)."})


def main(script_args: PretrainScriptArguments, training_args: UnifiedCheckpointArguments, model_args: ModelConfig):
    prepare_deepspeed_on_cpu(training_args)  # no-op without DeepSpeed or on GPUs
    if model_args.model_name_or_path:
        config = AutoConfig.from_pretrained(model_args.model_name_or_path, revision=model_args.model_revision)
        tokenizer = AutoTokenizer.from_pretrained(model_args.model_name_or_path, revision=model_args.model_revision)
    else:
        config, tokenizer = tiny.llama_config(), tiny.tokenizer()

    if script_args.dataset_name:
        from datasets import load_dataset

        raw = load_dataset(script_args.dataset_name, name=script_args.dataset_config)[script_args.dataset_train_split]
    else:
        raw = tiny.pretrain_dataset()
    block = script_args.block_size

    def tokenize(batch):
        return tokenizer([text + tokenizer.eos_token for text in batch["text"]], add_special_tokens=False)

    def group(batch):  # concatenate, cut into blocks of `block` tokens (the remainder is dropped)
        ids = list(chain.from_iterable(batch["input_ids"]))
        ids = ids[: len(ids) // block * block]
        return {"input_ids": [ids[i: i + block] for i in range(0, len(ids), block)]}

    with training_args.main_process_first(desc="tokenize and group"):
        dataset = raw.map(tokenize, batched=True, remove_columns=raw.column_names)
        dataset = dataset.map(group, batched=True, remove_columns=dataset.column_names)

    # Random initial weights, built once the processes are connected (ZeRO-3 partitions the model as it is built).
    set_seed(training_args.seed)
    model = AutoModelForCausalLM.from_config(config, attn_implementation=model_args.attn_implementation)

    trainer = Trainer(model=model, args=training_args, train_dataset=dataset, processing_class=tokenizer,
                      data_collator=DataCollatorForLanguageModeling(tokenizer, mlm=False),
                      callbacks=[UnifiedCheckpointCallback()])  # <- hf_unified_ckpt
    trainer.train(resume_from_checkpoint=resume_value(training_args.resume_from_checkpoint))


if __name__ == "__main__":
    parser = TrlParser((PretrainScriptArguments, UnifiedCheckpointArguments, ModelConfig))
    main(*parser.parse_args_and_config())
    end_processes()  # after main() returned: its Trainer and model are freed first
