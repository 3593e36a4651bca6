"""torchrun worker: run the Trainer runs listed in a JSON spec, one after another in this launch.

    torchrun --standalone --nproc_per_node N tests/support/workers/dist_worker.py spec.json

The spec is {"runs": [...], "deterministic": bool}; each run is {"output_dir", "model", "optim", "resume", "overrides", "result"}; rank 0 saves the run's record
(losses, final weights, optimizer state) with torch.save to "result".
"""

import json
import os
import sys

sys.path.insert(0, os.path.abspath(os.path.join(__file__, "..", "..", "..")))  # tests/: `import support.x`

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from support.env import free_process_group_users, freeze_imports  # noqa: E402
from support.specs import run_spec  # noqa: E402


def run_parity(run: dict, world: int) -> dict:
    """A native-parity scenario (`parity.py`): natively, then with the plugin, in `run["output_dir"]`."""
    from support.parity import run_pair

    return run_pair(run["parity"], run["output_dir"], world)


def main(spec_path: str) -> None:
    with open(spec_path) as f:
        spec = json.load(f)
    world = int(os.environ["WORLD_SIZE"])
    if spec.get("deterministic"):  # deterministic kernels where the device has them (CUDA: bench/gpu/resume_check.py)
        torch.use_deterministic_algorithms(True, warn_only=True)
    freeze_imports()
    for run in spec["runs"]:
        result = run_parity(run, world) if run.get("parity") else run_spec(run, world)
        if dist.get_rank() == 0 and run.get("result"):
            torch.save(result, run["result"])
    free_process_group_users()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
