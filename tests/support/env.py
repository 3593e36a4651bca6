"""The process the runs compute in: thread counts, the imported stack frozen out of the garbage collector,
accelerate's and DeepSpeed's process-wide state reset between runs, FSDP and tensor parallelism on CPU.
"""

from __future__ import annotations

import contextlib
import os

import torch


#: Intra-op threads of every run (DESIGN.md section 5: thread counts change float rounding by about one ulp), so
#: runs compared bit-exactly compute alike whatever the machine or the caller's environment sets.
THREADS = 1


def pin_threads() -> None:
    """Compute with `THREADS` intra-op threads in this process and in the processes it starts (accelerate sets
    its own count when OMP_NUM_THREADS is unset)."""
    os.environ["OMP_NUM_THREADS"] = str(THREADS)
    torch.set_num_threads(THREADS)


def freeze_imports() -> None:
    """Import the training stack, then move every object alive now to the garbage collector's permanent generation
    (`gc.freeze`): the Trainer, accelerate and DeepSpeed call `gc.collect()` several times per run, and each call
    otherwise walks the ~440,000 objects of the imported modules (0.2 s each). Test harness only: objects created
    later are collected as usual."""
    import gc

    import accelerate  # noqa: F401
    import deepspeed  # noqa: F401
    import peft  # noqa: F401
    import transformers.trainer  # noqa: F401

    gc.collect()
    gc.freeze()


def free_process_group_users() -> None:
    """Collect the finished runs' Trainers and models before the process group is destroyed. They sit in reference
    cycles, so without this they are freed at interpreter exit, and an FSDP2 model keeps the process group and its
    last gloo work objects (holding tensors) alive until then: their C++ destructors running during finalization
    abort the process now and then ("terminate called without an active exception", SIGABRT, pytorch#179291),
    seen in 3 of about 45 CI runs, always in a launch with FSDP2 runs. Measured in such a launch: 33 modules and the
    Trainer still alive after the runs, none after this."""
    import gc

    gc.collect()


@contextlib.contextmanager
def scoped_environ(values: dict):
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def reset_accelerate_state() -> None:
    """Prepare this process for another Trainer run: several runs share one process (DESIGN.md section 5), and
    every run computes with `THREADS` threads. Every run a test makes starts here."""
    from accelerate.state import AcceleratorState

    pin_threads()

    AcceleratorState._reset_state(reset_partial_state=False)
    for var in ("ACCELERATE_USE_DEEPSPEED", "ACCELERATE_USE_FSDP"):
        os.environ.pop(var, None)
    try:
        from transformers.integrations.deepspeed import unset_hf_deepspeed_config
    except ImportError:
        return
    unset_hf_deepspeed_config()
    _reset_deepspeed_autotp()


def _reset_deepspeed_autotp() -> None:
    """DeepSpeed AutoTP records its first `tp_model_init` (size, dtype, group) for the whole process and refuses a
    later run that differs (a bf16 run after an fp32 one): forgotten here, as a new process would. Its model- and
    data-parallel groups stay for the process too, so a launch runs its DeepSpeed runs without AutoTP first."""
    import sys

    init_utils = sys.modules.get("deepspeed.runtime.tensor_parallel.init_utils")
    if init_utils is not None:
        init_utils._TP_MODEL_INIT_ARGS = None


def fp16_on_cpu() -> None:
    """Test-only: DeepSpeed's CPU accelerator reports fp16 unsupported where the CPU lacks AVX512-FP16/AMX-FP16
    ("Type fp16 is not supported on your device"); the fp16 optimizer itself runs on CPU. Lifted for this process
    so fp16 code paths run as on a GPU."""
    from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator

    CPU_Accelerator.is_fp16_supported = lambda self: True


def disable_deepspeed_jit() -> None:
    """Skip DeepSpeed's JIT compile of its shared-memory allreduce op (DESIGN.md section 5)."""
    import deepspeed

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False


class fsdp_on_cpu:
    """Test-only shim: accelerate applies FSDP only on GPU device types and silently wraps the model in DDP on
    CPU. While active, an AcceleratorState built with an FSDP plugin keeps it (distributed type FSDP, device
    cpu). Tests that use it assert the parameters really are sharded, so a silent fallback fails them."""

    def __enter__(self):
        from accelerate.state import AcceleratorState, PartialState
        from accelerate.utils import DistributedType

        self._original = original = AcceleratorState.__init__

        def init(state, *args, fsdp_plugin=None, **kwargs):
            original(state, *args, fsdp_plugin=fsdp_plugin, **kwargs)
            if fsdp_plugin is not None and state.distributed_type != DistributedType.FSDP:
                state.distributed_type = DistributedType.FSDP
                PartialState._shared_state["distributed_type"] = DistributedType.FSDP
                PartialState._shared_state["device"] = state.device = torch.device("cpu")
                if state._mixed_precision != "no":
                    fsdp_plugin.set_mixed_precision(state._mixed_precision)
                state.fsdp_plugin = fsdp_plugin

        AcceleratorState.__init__ = init
        return self

    def __exit__(self, *exc):
        from accelerate.state import AcceleratorState

        AcceleratorState.__init__ = self._original


class tp_on_cpu:
    """Test-only shim: the Trainer turns a tensor-parallel model (`model.tp_size > 1`) into an accelerate
    `ParallelismConfig`, which accelerate (1.15) accepts only for FSDP2, DeepSpeed or GPU-like devices and refuses
    on CPU (`ParallelismConfig._validate_accelerator`: "... but got DistributedType.MULTI_CPU"). While active, that
    one check passes for MULTI_CPU when TP is enabled (its size check is kept); accelerate then leaves the model
    unwrapped, as on GPUs. Tests that use it assert the model really is tensor-parallel (`assert_tensor_parallel`)."""

    def __enter__(self):
        from accelerate.parallelism_config import ParallelismConfig
        from accelerate.utils import DistributedType

        self._original = original = ParallelismConfig._validate_accelerator

        def validate(config, accelerator):
            if accelerator.distributed_type == DistributedType.MULTI_CPU and config.tp_enabled:
                if config.total_size != accelerator.num_processes:
                    raise ValueError(f"ParallelismConfig total_size ({config.total_size}) != num_processes "
                                     f"({accelerator.num_processes})")
                return None
            return original(config, accelerator)

        ParallelismConfig._validate_accelerator = validate
        return self

    def __exit__(self, *exc):
        from accelerate.parallelism_config import ParallelismConfig

        ParallelismConfig._validate_accelerator = self._original
