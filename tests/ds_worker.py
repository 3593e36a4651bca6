"""Single-process real DeepSpeed (ZeRO-2, CPU, gloo) Trainer run.   python tests/ds_worker.py OUT_DIR MODE

MODE "legacy": plain Trainer + DeepSpeed (unified_checkpoint=False) saving checkpoint-2 the native way.
MODE "unified": unified_checkpoint=True under DeepSpeed (expected to be refused in this version)."""

import os
import socket
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                  MASTER_PORT=str(_free_port()))

import deepspeed  # noqa: E402

deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False  # no JIT compile of the shm allreduce op

from _runs import freeze_imports, train  # noqa: E402

DS_CONFIG = {"zero_optimization": {"stage": 2}, "train_micro_batch_size_per_gpu": "auto",
             "train_batch_size": "auto", "gradient_accumulation_steps": "auto", "gradient_clipping": "auto"}

if __name__ == "__main__":
    out, mode = sys.argv[1], sys.argv[2]
    freeze_imports()
    train(out, max_steps=2, save_steps=2, deepspeed=DS_CONFIG, unified_checkpoint=(mode == "unified"),
          attach=(mode == "unified"))
    print("DS-RUN-DONE", flush=True)
