"""A job for the output_dir lease tests, in a process of its own.

    python tests/support/workers/lease_worker.py hold ROOT READY [SECONDS]   take the lease of ROOT (as `train()` does), touch READY,
                                                              hold it SECONDS (forever by default), then give it back
    python tests/support/workers/lease_worker.py train ROOT RACES            RACES times: build a Trainer on ROOT/race-I, touch
                                                              ROOT/ready-I-<pid>, wait for ROOT/go-I, train 4 steps
                                                              saving each; prints RACE I RAN or RACE I REFUSED <message>
"""

import os
import sys
import time

sys.path.insert(0, os.path.abspath(os.path.join(__file__, "..", "..", "..")))  # tests/: `import support.x`


def _wait_for(path: str) -> None:
    while not os.path.exists(path):
        time.sleep(0.005)


def hold(root: str, ready: str, seconds: float | None) -> None:
    from hf_unified_ckpt.checkpoint.folder.lease import take_lease
    from hf_unified_ckpt.options import LeaseOptions

    lease = take_lease(root, LeaseOptions(timeout=60.0, wait=0.0))
    open(ready, "w").close()
    time.sleep(seconds if seconds is not None else 10**6)
    lease.release()


def train(root: str, races: int) -> None:
    """Race `races` times: build a Trainer on ROOT/race-I, touch ROOT/ready-I-<pid>, wait for ROOT/go-I, train."""
    from support.env import pin_threads
    from support.trainers import make_trainer
    from hf_unified_ckpt.errors import OutputDirInUseError

    pin_threads()
    for race in range(races):
        trainer = make_trainer(os.path.join(root, f"race-{race}"), max_steps=4, save_steps=1, save_total_limit=2,
                               unified_checkpoint_lease_wait=0.0)
        open(os.path.join(root, f"ready-{race}-{os.getpid()}"), "w").close()
        _wait_for(os.path.join(root, f"go-{race}"))
        try:
            trainer.train()
            print(f"RACE {race} RAN", flush=True)
        except OutputDirInUseError as e:
            print(f"RACE {race} REFUSED", str(e).replace("\n", " "), flush=True)


if __name__ == "__main__":
    if sys.argv[1] == "hold":
        hold(sys.argv[2], sys.argv[3], float(sys.argv[4]) if len(sys.argv) > 4 else None)
    else:
        train(sys.argv[2], int(sys.argv[3]))
