"""The writer process of `executors.ProcessExecutor`: `python -m hf_unified_ckpt.checkpoint.save.writer_process FD RANK
WORLD_SIZE ADDRESS`.

It joins the writers of the other ranks in a gloo process group of their own (at ADDRESS; none alone), then runs
`saving.finish` for each job its trainer sends over the socket FD and answers `(True, Outcome)` or `(False, the
exception)`, until it receives None or the trainer is gone (end of file).
"""

from __future__ import annotations

import datetime
import multiprocessing
import os
import pickle
import sys
from multiprocessing.connection import Connection

from ... import dist
from ...errors import UnifiedCheckpointError
from .executors import AUTHKEY_ENV, unpack
from .persist import lower_priority
from .saving import finish_in_background

#: How long a collective of the writers waits for a peer before it fails where the job's own timeout is unknown (a
#: peer writer that died fails it sooner: its connection closes); else the job's (`dist.default_timeout`).
TIMEOUT = datetime.timedelta(minutes=30)


def serve(conn: Connection) -> None:
    """Answer jobs until None or the end of the connection. The buffers the jobs' tensors live in stay mapped from
    one job to the next (`executors.BufferShipping`)."""
    buffers: dict[int, object] = {}
    while True:
        try:
            message = conn.recv()
        except EOFError:
            return
        if message is None:
            return
        started, snapshot, fallback, new, live = message
        buffers = {number: new.get(number, buffers.get(number)) for number in live}
        if snapshot[0]:
            unpack(snapshot[1], buffers)
        try:
            answer = (True, finish_in_background(started, snapshot, fallback=fallback))
        except BaseException as e:  # sent back with its type
            answer = (False, _sendable(e))
        del started, snapshot, message, new  # the job's views go; the buffers stay mapped for the next job
        conn.send(answer)


def _sendable(e: BaseException) -> BaseException:
    """`e` if it pickles (its type kept across the process), else an `UnifiedCheckpointError` saying what it was."""
    try:
        pickle.dumps(e)
        return e
    except Exception:
        return UnifiedCheckpointError(f"the writer process failed: {type(e).__name__}: {e}")


def main(argv: list[str]) -> None:
    fd, rank, world_size, address = int(argv[0]), int(argv[1]), int(argv[2]), argv[3]
    timeout = datetime.timedelta(seconds=float(argv[4])) if len(argv) > 4 and argv[4] else TIMEOUT
    multiprocessing.current_process().authkey = bytes.fromhex(os.environ.pop(AUTHKEY_ENV))
    lower_priority()  # as the background thread does: the writes take idle cycles, not training's
    if world_size > 1:
        import torch.distributed

        torch.distributed.init_process_group("gloo", init_method=address, rank=rank, world_size=world_size,
                                             timeout=timeout)
    conn = Connection(fd)
    try:
        serve(conn)
    finally:
        dist.destroy_default_group()


if __name__ == "__main__":
    main(sys.argv[1:])
