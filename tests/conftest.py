import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
sys.path.insert(0, str(TESTS))

from _runs import THREADS  # noqa: E402  (every run pins its own threads; launches start with the same count)


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
               *launcher_args, str(TESTS / "dist_worker.py"), str(spec)]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    else:  # the ranks forked from a process that imported the stack once (fork_launch.py: torchrun's environment)
        proc = _LAUNCHES.launch(nproc, spec, env, timeout)
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
        cmd = [sys.executable, str(TESTS / "fork_launch.py"), str(nproc), str(spec)]
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
            self.server = subprocess.Popen([sys.executable, str(TESTS / "fork_launch.py"), "--serve", self.path,
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


_LAUNCHES = _Launches()


def pytest_sessionfinish(session, exitstatus):
    _LAUNCHES.stop()


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
           str(TESTS / "dist_worker.py"), str(spec)]
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
               f"--master_port={port}", str(TESTS / "dist_worker.py"), str(spec)]
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


_FAULTS: dict[str, bool] = {}


def record_fault(name: str, survived: bool) -> None:
    """Fault-injection tests report here; the run ends with a summary line of faults tried and survived."""
    _FAULTS[name] = survived


def pytest_terminal_summary(terminalreporter):
    if _FAULTS:
        survived = sum(_FAULTS.values())
        terminalreporter.write_line(f"fault injection: {len(_FAULTS)} faults tried, {survived} survived"
                                    + ("" if survived == len(_FAULTS) else
                                       f" (not survived: {sorted(k for k, v in _FAULTS.items() if not v)})"))


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory):
    """A real S3 server (SeaweedFS) on loopback for the whole session, started on first use; the standard AWS
    environment points at it while it runs (so launched workers inherit it)."""
    from s3_server import SeaweedS3

    server = SeaweedS3(tmp_path_factory.mktemp("weed")).start()
    saved = {k: os.environ.get(k) for k in server.environment()}
    os.environ.update(server.environment())
    try:
        yield server
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        server.stop()


@pytest.fixture(scope="session")
def s3_session_bucket(s3_server):
    return s3_server.make_bucket("hfuc-tests")


@pytest.fixture
def s3_bucket(s3_session_bucket):
    """A fresh, empty prefix in the session's bucket on the real S3 server, as an `s3://bucket/prefix` URL."""
    import uuid

    return f"{s3_session_bucket}/t-{uuid.uuid4().hex[:12]}"


def pytest_collection_finish(session):
    """Freeze the imported training stack out of the garbage collector's walks (`_runs.freeze_imports`) in this
    process too: tests run many Trainer runs in it."""
    from _runs import freeze_imports

    freeze_imports()
