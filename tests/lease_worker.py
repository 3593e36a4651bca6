"""A job for the output_dir lease tests, in a process of its own.

    python tests/lease_worker.py hold ROOT READY [SECONDS]   take the lease of ROOT (as `train()` does), touch READY,
                                                              hold it SECONDS (forever by default), then give it back
    python tests/lease_worker.py train OUTPUT_DIR READY GO   build a Trainer, touch READY, wait for GO to exist, then
                                                              train 4 steps saving each; prints RAN or REFUSED <message>
"""

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def _wait_for(path: str) -> None:
    while not os.path.exists(path):
        time.sleep(0.005)


def hold(root: str, ready: str, seconds: float | None) -> None:
    from hf_unified_ckpt.checkpoint.lease import take_lease
    from hf_unified_ckpt.options import LeaseOptions

    lease = take_lease(root, LeaseOptions(timeout=60.0, wait=0.0))
    open(ready, "w").close()
    time.sleep(seconds if seconds is not None else 10**6)
    lease.release()


def train(output_dir: str, ready: str, go: str) -> None:
    from _runs import make_trainer, pin_threads
    from hf_unified_ckpt.errors import OutputDirInUseError

    pin_threads()
    trainer = make_trainer(output_dir, max_steps=4, save_steps=1, save_total_limit=2,
                           unified_checkpoint_lease_wait=0.0)
    open(ready, "w").close()
    _wait_for(go)
    try:
        trainer.train()
    except OutputDirInUseError as e:
        print("REFUSED", str(e).replace("\n", " "), flush=True)
        return
    print("RAN", flush=True)


if __name__ == "__main__":
    if sys.argv[1] == "hold":
        hold(sys.argv[2], sys.argv[3], float(sys.argv[4]) if len(sys.argv) > 4 else None)
    else:
        train(*sys.argv[2:5])
