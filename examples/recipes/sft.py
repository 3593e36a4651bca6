"""Supervised fine-tuning (full or LoRA) with TRL's SFTTrainer, saving unified checkpoints that resume on any engine
and number of processes and load with `from_pretrained` (LoRA: `PeftModel.from_pretrained`).

Without `model_name_or_path` / `dataset_name` it fine-tunes a tiny Llama on tiny prompt/completion pairs
(examples/recipes/tiny.py); with them, that model (a Hub name or a local folder) on that dataset (any format
SFTTrainer takes: text, prompt/completion, messages). LoRA: `use_peft: true` with `lora_r`, `lora_alpha`,
`lora_target_modules` (configs/recipes/sft_lora.yaml).

Launch from the repository root (any flag overrides the YAML; CPU shown, on GPUs drop `use_cpu`):

    torchrun --standalone --nproc_per_node 2 examples/recipes/sft.py --config configs/recipes/sft.yaml
    torchrun --standalone --nproc_per_node 2 examples/recipes/sft.py --config configs/recipes/sft_lora.yaml \
        --deepspeed configs/ds_zero3.json
    deepspeed --num_gpus 2 examples/recipes/sft.py --config configs/recipes/sft.yaml --deepspeed configs/ds_zero2.json
    accelerate launch --config_file configs/accelerate/fsdp2.yaml examples/recipes/sft.py \
        --config configs/recipes/sft.yaml                      # or ddp.yaml, deepspeed_zero3.yaml
    python examples/recipes/sft.py --config configs/recipes/sft_lora.yaml                    # one process

Resume (newest complete checkpoint of output_dir, or a path) on any engine and number of processes; keep the
global batch (per_device_train_batch_size x processes x gradient_accumulation_steps) when the number changes:

    python examples/recipes/sft.py --config configs/recipes/sft.yaml --per_device_train_batch_size 8 \
        --resume_from_checkpoint output/sft/checkpoint-3
"""

from __future__ import annotations

from transformers import AutoModelForCausalLM, AutoTokenizer
from trl import ModelConfig, ScriptArguments, SFTTrainer, TrlParser, get_peft_config

import tiny
from common import end_processes, prepare_deepspeed_on_cpu, resume_value
from hf_unified_ckpt import UnifiedCheckpointCallback
from hf_unified_ckpt.trl_configs import UnifiedSFTConfig


def main(script_args: ScriptArguments, training_args: UnifiedSFTConfig, model_args: ModelConfig):
    prepare_deepspeed_on_cpu(training_args)  # no-op without DeepSpeed or on GPUs
    if model_args.model_name_or_path:
        model = AutoModelForCausalLM.from_pretrained(
            model_args.model_name_or_path, revision=model_args.model_revision, dtype=model_args.dtype,
            attn_implementation=model_args.attn_implementation)
        tokenizer = AutoTokenizer.from_pretrained(model_args.model_name_or_path, revision=model_args.model_revision)
    else:
        model, tokenizer = tiny.llama(), tiny.tokenizer()

    if script_args.dataset_name:
        from datasets import load_dataset

        dataset = load_dataset(script_args.dataset_name, name=script_args.dataset_config)
        train_dataset = dataset[script_args.dataset_train_split]
        eval_dataset = dataset[script_args.dataset_test_split] if training_args.eval_strategy != "no" else None
    else:
        train_dataset, eval_dataset = tiny.sft_dataset(), None

    trainer = SFTTrainer(model=model, args=training_args, train_dataset=train_dataset, eval_dataset=eval_dataset,
                         processing_class=tokenizer, peft_config=get_peft_config(model_args),  # None: full
                         callbacks=[UnifiedCheckpointCallback()])  # <- hf_unified_ckpt
    trainer.train(resume_from_checkpoint=resume_value(training_args.resume_from_checkpoint))


if __name__ == "__main__":
    parser = TrlParser((ScriptArguments, UnifiedSFTConfig, ModelConfig))
    main(*parser.parse_args_and_config())
    end_processes()  # after main() returned: its Trainer and model are freed first
