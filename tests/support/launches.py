"""Launches of real processes for the tests: `torchrun` (ranks forked by the session's launch server,
`fork_launch.py`, or torchrun itself), `torchrun_popen` (without waiting), `torchrun_machines` (several simulated
machines), `kill_tree`. Each rank runs `workers/dist_worker.py` on a spec of runs (`specs.run_spec`)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from .env import THREADS
from .paths import SUPPORT, WORKERS

DIST_WORKER = WORKERS / "dist_worker.py"


def torchrun(nproc: int, runs: list[dict], workdir: Path, timeout: int = 900, expect_failure: bool = False,
             launcher_args: tuple[str, ...] = (), env: dict | None = None):
    """Launch `nproc` real processes (gloo, CPU) running `runs` in one launch (`fork_launch.py`, or torchrun itself
    with `launcher_args`); fail with their output.
    With `expect_failure`, return the completed process of a launch that must fail; `launcher_args` go to torchrun
    (e.g. --max-restarts=1), `env` to its environment."""
    spec = workdir / f"spec-{nproc}-{len(list(workdir.glob('spec-*')))}.json"
    spec.write_text(json.dumps({"runs": runs}))
    env = {**os.environ, "OMP_NUM_THREADS": str(THREADS), "PYTHONUNBUFFERED": "1", **(env or {})}
    if launcher_args or os.environ.get("HF_UC_TEST_LAUNCHER") == "torchrun":
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
               *launcher_args, str(DIST_WORKER), str(spec)]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    else:  # the ranks forked from a process that imported the stack once (fork_launch.py: torchrun's environment)
        proc = LAUNCHES.launch(nproc, spec, env, timeout)
    if expect_failure:
        assert proc.returncode != 0, "the launch was expected to fail"
        return proc
    if proc.returncode != 0:
        pytest.fail(f"torchrun -n {nproc} failed ({proc.returncode}):\n{proc.stdout[-5000:]}\n{proc.stderr[-8000:]}")
    return proc


class _Launches:
    """The session's launch server (`fork_launch.py --serve`), started at the first launch, stopped at the end of
    the session (`pytest_sessionfinish`)."""

    def __init__(self):
        self.server: subprocess.Popen | None = None
        self.path: str | None = None

    def launch(self, nproc: int, spec: Path, env: dict, timeout: float) -> subprocess.CompletedProcess:
        """One launch of `spec` on `nproc` forked ranks; its output and status, as `subprocess.run` gives them."""
        import socket

        request = {"nproc": nproc, "spec": str(spec), "env": env, "cwd": os.getcwd(),
                   "stdout": str(spec.with_suffix(".out")), "stderr": str(spec.with_suffix(".err"))}
        cmd = [sys.executable, str(SUPPORT / "fork_launch.py"), str(nproc), str(spec)]
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
            conn.connect(self._serving())
            conn.settimeout(timeout)
            conn.sendall(json.dumps(request).encode() + b"\n")
            answer = conn.makefile("r")
            launcher = int(answer.readline())
            try:
                status = int(answer.readline())
            except (TimeoutError, socket.timeout):
                kill_tree(launcher)
                raise subprocess.TimeoutExpired(cmd, timeout) from None
        return subprocess.CompletedProcess(cmd, status, Path(request["stdout"]).read_text(errors="replace"),
                                           Path(request["stderr"]).read_text(errors="replace"))

    def _serving(self) -> str:
        import tempfile
        import time

        if self.server is None or self.server.poll() is not None:
            self.path = os.path.join(tempfile.mkdtemp(prefix="hf_uc_launch_"), "socket")
            env = {**os.environ, "OMP_NUM_THREADS": str(THREADS), "PYTHONUNBUFFERED": "1"}
            self.server = subprocess.Popen([sys.executable, str(SUPPORT / "fork_launch.py"), "--serve", self.path,
                                            str(os.getpid())],
                                           env=env, start_new_session=True)
            deadline = time.monotonic() + 120
            while not os.path.exists(self.path):
                assert self.server.poll() is None and time.monotonic() < deadline, "the launch server did not start"
                time.sleep(0.05)
        return self.path

    def stop(self) -> None:
        if self.server is not None and self.server.poll() is None:
            self.server.kill()
            self.server.wait()
        if self.path:
            import shutil

            shutil.rmtree(os.path.dirname(self.path), ignore_errors=True)


LAUNCHES = _Launches()


def kill_tree(pid: int) -> list[int]:
    """SIGKILL process `pid` and every process below it, all at once (torchrun starts its workers in sessions of
    their own, so a process-group kill would leave them running). Linux (/proc). Returns the pids killed."""
    import signal

    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    tree, todo = [], [pid]
    while todo:
        tree.append(todo.pop())
        todo += children.get(tree[-1], [])
    for p in tree:
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return tree


def torchrun_popen(nproc: int, runs: list[dict], workdir: Path) -> subprocess.Popen:
    """Start a `torchrun` launch like `torchrun`, without waiting (kill it whole with `kill_tree(proc.pid)`), its
    output in workdir."""
    spec = workdir / f"spec-{nproc}-{len(list(workdir.glob('spec-*')))}.json"
    spec.write_text(json.dumps({"runs": runs}))
    env = {**os.environ, "OMP_NUM_THREADS": str(THREADS), "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           str(DIST_WORKER), str(spec)]
    log = open(workdir / f"{spec.stem}.log", "wb")
    return subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def torchrun_machines(machines: list[tuple[int, list[dict]]], workdir: Path, timeout: int = 600,
                      expect_failure: bool = False) -> list[subprocess.CompletedProcess]:
    """Simulate several machines on this one: one `torchrun` per machine (static rendezvous on 127.0.0.1),
    machine k running `machines[k] = (processes, runs)`; each machine's runs name its own local output folders.
    Global ranks are numbered machine by machine. Fails with every machine's output unless `expect_failure`."""
    port = _free_port()
    env = {**os.environ, "OMP_NUM_THREADS": str(THREADS), "PYTHONUNBUFFERED": "1"}
    procs = []
    for k, (nproc, runs) in enumerate(machines):
        spec = workdir / f"spec-machine{k}-{len(list(workdir.glob('spec-*')))}.json"
        spec.write_text(json.dumps({"runs": runs}))
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nnodes={len(machines)}", f"--node_rank={k}",
               f"--nproc_per_node={nproc}", "--rdzv_backend=static", "--master_addr=127.0.0.1",
               f"--master_port={port}", str(DIST_WORKER), str(spec)]
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    done = []
    for proc in procs:
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for other in procs:
                other.kill()
            out, err = proc.communicate()
        done.append(subprocess.CompletedProcess(proc.args, proc.returncode, out, err))
    failed = any(p.returncode != 0 for p in done)
    if expect_failure:
        assert failed, "the launch was expected to fail"
        return done
    if failed:
        pytest.fail("\n".join(f"machine {k} exited {p.returncode}:\n{p.stdout[-3000:]}\n{p.stderr[-6000:]}"
                              for k, p in enumerate(done)))
    return done


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
