"""Test helper: run a recipe script unchanged with FSDP really applied on CPU, and check it was.

    torchrun --standalone --nproc_per_node 2 tests/support/workers/recipe_runner.py examples/recipes/dpo.py --config ... \
        --fsdp "full_shard auto_wrap" --fsdp_config '{...}'
    accelerate launch --config_file configs/accelerate/fsdp2.yaml tests/support/workers/recipe_runner.py examples/recipes/sft.py ...

accelerate applies FSDP only on GPUs and silently trains with DDP on CPU (DESIGN.md section 5). This runner enters
the test-only shim `support.env.fsdp_on_cpu()` (FSDP kept as configured, device cpu), wraps `transformers.Trainer.train`
in this process only so that, when training ends and before the recipe leaves the process group, every rank asserts
that the model really is sharded (`support.states.assert_sharded`: DTensor parameters, fewer local elements than the model
has), and then runs the recipe as `__main__` with the remaining arguments. Rank 0 prints RUNNER_CHECK_LINE once the
check passed, so a test can tell the check ran.
"""

from __future__ import annotations

import os
import runpy
import sys

sys.path.insert(0, os.path.abspath(os.path.join(__file__, "..", "..", "..")))  # tests/: `import support.x`

from support.env import freeze_imports, fsdp_on_cpu  # noqa: E402
from support.states import assert_sharded  # noqa: E402

RUNNER_CHECK_LINE = "recipe_runner: FSDP sharded the model"


def main(script: str, argv: list[str]) -> None:
    import transformers

    original = transformers.Trainer.train
    checked = []

    def train(self, *args, **kwargs):
        result = original(self, *args, **kwargs)
        assert self.is_fsdp_enabled, "the Trainer did not run FSDP"
        assert_sharded(self)  # collective-free: every rank checks its own parameters
        checked.append(f"{RUNNER_CHECK_LINE} ({type(self).__name__}, "
                       f"{sum(1 for _ in self.model_wrapped.parameters())} DTensor parameters)")
        return result

    transformers.Trainer.train = train
    freeze_imports()
    sys.argv = [script, *argv]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))  # as `python script.py` would
    with fsdp_on_cpu():
        runpy.run_path(script, run_name="__main__")
    assert checked, "the recipe never called Trainer.train"
    if os.environ.get("RANK", "0") == "0":
        print(checked[0], flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
