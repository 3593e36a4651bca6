"""The tests' launcher of multi-rank runs: what `torchrun --standalone --nproc_per_node N tests/support/workers/dist_worker.py spec`
does for a worker, without each worker importing the training stack again.

    python tests/support/fork_launch.py N spec.json          # one launch
    python tests/support/fork_launch.py --serve SOCKET PID   # a server of launches for process PID (support.launches.torchrun's)

Every worker of a torchrun launch imports torch, transformers' Trainer, accelerate, DeepSpeed and PEFT: about 6.5 s
per process on the 2-core VM, the larger part of a launch of a few short runs. Here one process imports them once
(`support.env.freeze_imports`), then forks the N ranks. With `--serve`, that process stays (one per test session) and
forks a launcher per request, which forks the ranks: a launch then starts in a fraction of a second.

Each rank is a real process with its own interpreter state from the fork on, in a session of its own, with the
environment torchrun gives a worker (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR/PORT, the TORCHELASTIC_* variables,
the store hosted by the launcher as torchrun's agent hosts it: `TORCHELASTIC_USE_AGENT_STORE=True`), and runs
`dist_worker.main(spec)` on gloo. As torchrun does, the launcher exits 0 when every rank did; when one fails it
stops the others (SIGTERM, SIGKILL after `GRACE` s) and exits with that rank's status.

What is torchrun's own (restarts, its signal forwarding, kills of the launcher) is tested with torchrun itself
(`support.launches.torchrun(..., launcher_args=...)`, `torchrun_popen`, `torchrun_machines`, the recipes' launchers).
`HF_UC_TEST_LAUNCHER=torchrun` sends every launch to torchrun.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
import time
import uuid

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: `import support.x`

from support.workers import dist_worker  # noqa: E402  (torch)
from support.env import freeze_imports  # noqa: E402

#: Seconds between the SIGTERM and the SIGKILL of the ranks still running after one failed.
GRACE = 5.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker_env(rank: int, nproc: int, port: int, run_id: str) -> dict[str, str]:
    """What torchrun's local agent sets for worker `rank` of a single-machine launch (torch 2.13,
    `LocalElasticAgent._start_workers`)."""
    return {"RANK": str(rank), "LOCAL_RANK": str(rank), "GROUP_RANK": "0", "ROLE_RANK": str(rank),
            "ROLE_NAME": "default", "LOCAL_WORLD_SIZE": str(nproc), "WORLD_SIZE": str(nproc),
            "GROUP_WORLD_SIZE": "1", "ROLE_WORLD_SIZE": str(nproc), "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port), "TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_MAX_RESTARTS": "0",
            "TORCHELASTIC_RUN_ID": run_id, "TORCHELASTIC_USE_AGENT_STORE": "True",
            "TORCH_NCCL_ASYNC_ERROR_HANDLING": os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")}


def _stop(pids: dict[int, int]) -> None:
    """SIGTERM to the sessions of the ranks still running, SIGKILL to those alive `GRACE` s later."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids:
            try:
                os.killpg(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + GRACE
        while pids and (sig == signal.SIGKILL or time.monotonic() < deadline):
            pid, status = os.waitpid(-1, os.WNOHANG if sig == signal.SIGTERM else 0)
            if pid:
                pids.pop(pid, None)
            elif sig == signal.SIGTERM:
                time.sleep(0.05)


def launch(nproc: int, spec: str) -> int:
    """Fork the `nproc` ranks of `spec`, host their store, wait for them; the launch's exit status."""
    from torch.distributed import TCPStore

    port, run_id = _free_port(), uuid.uuid4().hex[:8]
    pids = {}
    for rank in range(nproc):
        pid = os.fork()
        if pid == 0:  # the rank: its own session, as torchrun starts workers; an exception ends it with status 1
            os.setsid()
            os.environ.update(_worker_env(rank, nproc, port, run_id))
            dist_worker.main(spec)
            sys.exit(0)
        pids[pid] = rank
    # the agent's store, made after the forks (a store's server thread must not be forked); the ranks retry until
    # it listens
    store = TCPStore("127.0.0.1", port, nproc, is_master=True, wait_for_workers=False)  # noqa: F841
    status = 0
    while pids:
        pid, raw = os.wait()
        rank, code = pids.pop(pid), os.waitstatus_to_exitcode(raw)
        if code:
            print(f"fork_launch: rank {rank} (pid {pid}) exited with {code}; stopping the others", file=sys.stderr,
                  flush=True)
            status = code if code > 0 else 128 - code
            _stop(pids)
    return status


def serve(path: str, parent: int) -> None:
    """Answer launch requests on the Unix socket `path`, one at a time, until a request says stop or the process that
    started this one (pid `parent`) is gone. A request is one
    line of JSON {"nproc", "spec", "env", "cwd", "stdout", "stderr"}; the answer is two lines: the launcher's pid
    (its session's leader: kill that tree to stop the launch), then the launch's exit status."""
    freeze_imports()
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(f"{path}.binding")
    server.listen()
    os.rename(f"{path}.binding", path)  # `path` appears once it accepts
    server.settimeout(2.0)
    while True:
        try:
            conn, _ = server.accept()
        except (TimeoutError, socket.timeout):
            if os.getppid() != parent:  # the test session was killed without stopping this server
                return
            continue
        conn.settimeout(None)
        with conn, conn.makefile("rw") as stream:
            request = json.loads(stream.readline() or "{}")
            if not request or request.get("stop"):
                return
            pid = os.fork()
            if pid == 0:
                server.close()
                os._exit(_launcher(request))
            try:
                stream.write(f"{pid}\n")
                stream.flush()
            except OSError:
                pass
            status = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
            try:
                stream.write(f"{status}\n")
                stream.flush()
            except OSError:  # the client gave up (its timeout) and killed the launch
                pass


def _launcher(request: dict) -> int:
    """The forked launcher of one request: its own session, the request's environment, folder and output files."""
    os.setsid()
    for fd, name in ((1, request["stdout"]), (2, request["stderr"])):
        target = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(target, fd)
        os.close(target)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    return launch(int(request["nproc"]), request["spec"])


if __name__ == "__main__":
    if sys.argv[1] == "--serve":
        serve(sys.argv[2], int(sys.argv[3]))
    else:
        freeze_imports()
        sys.exit(launch(int(sys.argv[1]), sys.argv[2]))
