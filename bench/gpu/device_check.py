"""The device path of background copies on a real device (issue 34, part 1.1; `checkpoint/save/device_copy.py`).

    python bench/gpu/device_check.py --device cuda|cpu --json FILE [--mb 1024]

1. Correctness: a background job copies a live tensor; the training thread waits for the stage (on CUDA: queues
   the next work behind the copies, no host wait), then changes the tensor in place at once, as the optimizer
   step does; the copy must hold the values from before the change. Checked for fp32 and for a bf16 tensor copied
   to fp32, with a pinned host buffer on CUDA.
2. Figures: the time the training thread is held by `wait_for_snapshot` (a CUDA copy is only queued there), at the
   first job (the pinned buffer is allocated then) and at a second one (reused), against a plain synchronous copy
   into pageable memory (`tensor.cpu()`), and the copy's throughput.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def _sync(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


def check(device: str, mb: int) -> dict:
    import torch

    from hf_unified_ckpt.checkpoint.save.persist import Background
    from hf_unified_ckpt.checkpoint.save.snapshot import HostBuffers

    n = mb * 2**20 // 4
    out: dict = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "mb": mb}
    buffers = HostBuffers()
    background = Background("check", buffers.transfers)
    for dtype in (torch.float32, torch.bfloat16):
        live = torch.randn(n, device=device).to(dtype)
        expected = live.float().cpu().clone()
        name = str(dtype).split(".")[-1]
        equal = []
        for when in ("first", "reused"):  # the first job allocates the pinned buffer; a later save reuses it
            live.copy_(expected)
            _sync(device)
            held = time.perf_counter()
            background.start(lambda: buffers.copy(("w", dtype), live, torch.float32), lambda copy: copy.clone())
            background.wait_for_snapshot()
            held = time.perf_counter() - held
            live.mul_(-1)  # the optimizer step, queued at once
            equal.append(bool(torch.equal(background.wait(), expected)))
            out[f"{name}_{when}_training_thread_held_s"] = held
        out[f"{name}_copy_equal"] = all(equal)
        out[f"{name}_buffer_pinned"] = bool(buffers.copy(("w", dtype), live, torch.float32).is_pinned())
    if device == "cuda":  # page-locked in place, not from torch's power-of-two pinned allocator (the fallback)
        from hf_unified_ckpt.checkpoint.save.device_copy import _register, _unregister, registered_buffer

        out["registered_in_place"] = registered_buffer((7, 1001), torch.float32, _register, _unregister) is not None
    _sync(device)
    started = time.perf_counter()
    background.start(lambda: buffers.copy(("w", torch.float32), live, torch.float32), lambda copy: None)
    background.wait()
    out["background_copy_gb_per_s"] = n * 4 / 2**30 / (time.perf_counter() - started)
    plain = torch.randn(n, device=device)
    _sync(device)
    started = time.perf_counter()
    plain.cpu() if device == "cuda" else plain.clone()
    out["plain_sync_copy_s"] = time.perf_counter() - started
    out["ok"] = out.get("registered_in_place", True) and all(out[k] for k in out if k.endswith("_copy_equal")) \
        and all(out[k] == (device == "cuda") for k in out if k.endswith("_pinned"))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--mb", type=int, default=1024)
    parser.add_argument("--json", type=Path, required=True)
    a = parser.parse_args()
    result = check(a.device, a.mb)
    a.json.write_text(json.dumps(result, indent=1))
    print(json.dumps(result))
    sys.exit(0 if result["ok"] else 1)


if __name__ == "__main__":
    main()
