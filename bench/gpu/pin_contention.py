"""How much making pinned host buffers in a background thread holds up a training thread (issue 59, GPU only).

    python bench/gpu/pin_contention.py --json FILE [--gb 11.4] [--variants inside,outside,...]

A training thread runs GPU steps (bf16 matmuls, a host sync per step, a small host allocation and a pageable
upload, as a Trainer step does) while another thread makes host buffers the sizes of a 953M Llama's weights and
AdamW moments (fp32; `--gb` scales them), as `snapshot.HostBuffers.warm_up` does after the first optimizer step.
Per way of making them: the seconds the preparation took, and the training time lost during it (the steps' time
beyond the idle step time). The ways:

- `inside`: an anonymous map page-locked with `cudaHostRegister` at once, its pages faulted in by the driver (the
  library before 2026-11-28: an H200 step held 3.9 s while 11.4 GB were made);
- `outside`: the library now (`device_copy.registered_buffer`): the pages faulted in by the thread itself, then
  locked;
- `outside_thp`: the same with transparent huge pages asked for first (`MADV_HUGEPAGE`);
- `chunked`: faulted in, then locked 64 MiB at a time (several registrations per buffer: measured, not used);
- `torch_pinned`: `torch.empty(pin_memory=True)` (`cudaHostAlloc` through torch's caching allocator).
"""

from __future__ import annotations

import argparse
import json
import mmap
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from hf_unified_ckpt.checkpoint.save import device_copy  # noqa: E402
from hf_unified_ckpt.checkpoint.save.persist import lower_priority  # noqa: E402

CHUNK = 64 * 2**20


def llama_sizes(scale: float) -> list[int]:
    """Byte sizes of the fp32 buffers of the 953M Llama of bench_gpu.py (weights, exp_avg, exp_avg_sq), scaled."""
    hidden, inter, layers, vocab = 2048, 5632, 16, 32000
    per_layer = [hidden * hidden] * 4 + [hidden * inter] * 3 + [hidden] * 2
    numels = [vocab * hidden] * 2 + per_layer * layers + [hidden]
    return [max(PAGE_BYTES, int(n * 4 * scale)) for n in numels for _ in range(3)]


PAGE_BYTES = mmap.PAGESIZE


def _mapped(nbytes: int):
    memory = mmap.mmap(-1, nbytes)
    return memory, torch.frombuffer(memory, dtype=torch.uint8)


def make(variant: str, nbytes: int, held: list) -> None:
    cudart = torch.cuda.cudart()
    if variant == "torch_pinned":
        held.append((torch.empty(nbytes, dtype=torch.uint8, pin_memory=True), []))
        return
    if variant == "outside":
        buffer = device_copy.registered_buffer((nbytes,), torch.uint8, device_copy._register, lambda address: None)
        held.append((buffer, [buffer.untyped_storage().data_ptr()]))  # unlocked by `release`, not a finalizer
        return
    memory, region = _mapped(nbytes)
    if variant == "outside_thp":
        memory.madvise(mmap.MADV_HUGEPAGE)
    if variant in ("outside_thp", "chunked"):
        region.numpy()[::PAGE_BYTES] = 0
    if variant == "chunked":
        addresses = []
        for start in range(0, nbytes, CHUNK):
            length = min(CHUNK, nbytes - start)
            assert int(cudart.cudaHostRegister(region.data_ptr() + start, length, 1)) == 0
            addresses.append(region.data_ptr() + start)
        held.append((region, addresses))
        return
    assert int(cudart.cudaHostRegister(region.data_ptr(), nbytes, 1)) == 0
    held.append((region, [region.data_ptr()]))


def prepare(variant: str, sizes: list[int], held: list) -> None:
    lower_priority()
    for nbytes in sizes:
        make(variant, nbytes, held)


def release(held: list) -> None:
    """Unlock what was locked, then free the buffers."""
    cudart = torch.cuda.cudart()
    for _, addresses in held:
        for address in addresses:
            cudart.cudaHostUnregister(address)
    held.clear()
    torch.cuda.synchronize()


class Steps:
    """The training thread: GPU steps until told to stop, each step's time recorded."""

    def __init__(self):
        self.a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
        self.batch = torch.randint(0, 32000, (8, 1024))
        self.times: list[float] = []
        self.stop = threading.Event()

    def step(self) -> None:
        x = self.a
        for _ in range(24):
            x = torch.tanh(x @ self.a)
        tokens = self.batch.to("cuda")  # a pageable upload, as the data collator's batch
        small = torch.zeros(65536)  # a host allocation, as Python does every step
        float((x.float().mean() + tokens.float().mean() + small.sum()).item())

    def run(self) -> None:
        while not self.stop.is_set():
            started = time.perf_counter()
            self.step()
            self.times.append(time.perf_counter() - started)


def measure(variant: str, sizes: list[int], idle_step: float) -> dict:
    steps, held = Steps(), []
    trainer = threading.Thread(target=steps.run)
    trainer.start()
    time.sleep(20 * idle_step)
    before = len(steps.times)
    started = time.perf_counter()
    preparing = threading.Thread(target=prepare, args=(variant, sizes, held))  # as HostBuffers.warm_up: nice 19
    preparing.start()
    preparing.join()
    prep_s = time.perf_counter() - started
    during = len(steps.times) - before
    time.sleep(10 * idle_step)
    steps.stop.set()
    trainer.join()
    times = steps.times[before:before + during + 1]
    lost = sum(t - idle_step for t in times)
    out = {"prep_s": round(prep_s, 3), "gb_per_s": round(sum(sizes) / prep_s / 1e9, 2), "steps_during": len(times),
           "training_lost_s": round(lost, 3), "lost_over_prep": round(lost / prep_s, 3),
           "max_step_s": round(max(times), 3)}
    out["pinned"] = bool(held[0][0].is_pinned())
    release(held)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", required=True)
    parser.add_argument("--gb", type=float, default=11.4)
    parser.add_argument("--variants", default="inside,outside,outside_thp,chunked,torch_pinned")
    args = parser.parse_args()
    sizes = llama_sizes(1.0)
    sizes = llama_sizes(args.gb * 1e9 / sum(sizes))
    probe = Steps()
    for _ in range(5):
        probe.step()
    torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(20):
        probe.step()
    idle = (time.perf_counter() - started) / 20
    thp = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    result = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "buffers": len(sizes),
              "gb": round(sum(sizes) / 1e9, 2), "idle_step_s": round(idle, 4),
              "transparent_hugepage": thp.read_text().strip() if thp.exists() else None, "variants": {}}
    for variant in args.variants.split(","):
        result["variants"][variant] = measure(variant, sizes, idle)
        print(variant, result["variants"][variant], flush=True)
        Path(args.json).write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
