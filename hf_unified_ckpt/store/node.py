"""Facts about this machine that the memory tier (`flash/`) and the output_dir lease (`checkpoint/folder/lease.py`)
need, read here, below the storage seam: how much memory a snapshot may take, free bytes of a folder, whether a process
lives and when it started, who this process is (`Process`, `owner_tag`), an advisory lock, a heartbeat file's age,
the persister's log file, a folder made this user's own (`private_folder`).

Memory that a tmpfs holds is RAM: its free size alone says nothing (a 24 GiB `/dev/shm` on a 23 GiB machine), so
`memory_room` takes the least of MemAvailable, the cgroup's limit less its usage, and the folder's free bytes.
"""

from __future__ import annotations

import fcntl
import os
import re
import socket
import stat
import time
import uuid
from dataclasses import dataclass

from .local_io import file_mode


def mem_available() -> int | None:
    """MemAvailable of /proc/meminfo in bytes (None where there is none)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def cgroup_room() -> int | None:
    """Bytes this process's cgroup may still take (its memory limit less its usage; v2, then v1), or None when
    there is no limit."""
    for limit_file, usage_file in (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                                   ("/sys/fs/cgroup/memory/memory.limit_in_bytes",
                                    "/sys/fs/cgroup/memory/memory.usage_in_bytes")):
        try:
            with open(limit_file) as f:
                limit = f.read().strip()
            with open(usage_file) as f:
                usage = int(f.read().strip())
        except (OSError, ValueError):
            continue
        if limit == "max" or int(limit) >= 2**60:
            return None
        return max(0, int(limit) - usage)
    return None


def free_bytes(folder: str) -> int:
    """Bytes an unprivileged process may still write into `folder`'s filesystem (its nearest existing parent's)."""
    while not os.path.isdir(folder) and os.path.dirname(folder) != folder:
        folder = os.path.dirname(folder)
    stat = os.statvfs(folder)
    return stat.f_bavail * stat.f_frsize


def memory_room(folder: str) -> dict[str, int | None]:
    """What limits a snapshot into `folder` (a tmpfs): MemAvailable, the cgroup's room, the folder's free bytes."""
    return {"MemAvailable": mem_available(), "cgroup": cgroup_room(), "free in folder": free_bytes(folder)}


def pid_alive(pid: int) -> bool:
    """Whether process `pid` exists and is not a zombie."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


def start_ticks(pid: int) -> int | None:
    """When process `pid` started, in clock ticks since boot (`/proc/<pid>/stat`, field 22): with the boot id, what
    tells a process from a later one that reuses its pid. None where it cannot be read (no such process, no
    /proc)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def boot_id() -> str:
    """This boot of this machine (`/proc/sys/kernel/random/boot_id`; "" where there is none): pids and start times
    compare only within one boot."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


def pid_namespace() -> str:
    """The pid namespace of this process ("" where there is none): two containers on one machine number their
    processes apart, so a pid is checked only within the namespace that recorded it."""
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return ""


def started_at(ticks: int | None) -> float | None:
    """The wall-clock time (seconds since the epoch) of `ticks` since this machine's boot, for people to read."""
    if ticks is None:
        return None
    try:
        with open("/proc/stat") as f:
            boot = next(int(line.split()[1]) for line in f if line.startswith("btime "))
    except (OSError, StopIteration, ValueError):
        return None
    return boot + ticks / os.sysconf("SC_CLK_TCK")


def host_name() -> str:
    """This machine's name, reduced to letters, digits and `-` (it goes into file names)."""
    return re.sub(r"[^A-Za-z0-9-]+", "-", socket.gethostname()).strip("-") or "host"


@dataclass(frozen=True)
class Process:
    """Who a process is, as a lease records it: its machine (`host`, `boot`), pid namespace, pid and start time
    (`start_ticks` to compare, `started` to read)."""

    host: str
    boot: str
    pid_ns: str
    pid: int
    start_ticks: int | None
    started: float | None

    @classmethod
    def this(cls) -> "Process":
        pid = os.getpid()
        ticks = start_ticks(pid)
        return cls(host_name(), boot_id(), pid_namespace(), pid, ticks, started_at(ticks))

    def alive(self) -> bool | None:
        """Whether the process lives, judged on this machine: False when it ran on this machine in an earlier boot,
        or its pid is gone, or now belongs to a process started at another time; None when this machine cannot
        tell (another machine, or another pid namespace: a heartbeat decides)."""
        if self.host != host_name():
            return None
        if self.boot and boot_id() and self.boot != boot_id():
            return False
        if self.pid_ns != pid_namespace():
            return None
        if not pid_alive(self.pid):
            return False
        return self.start_ticks is None or start_ticks(self.pid) in (None, self.start_ticks)


#: A hidden folder name's owner tag, `.<host>.<pid>.<token>` before its suffix (`owner_tag`).
_OWNED = re.compile(r"\.(?P<host>[A-Za-z0-9-]+)\.(?P<pid>\d+)\.(?P<token>[0-9a-f]+)(?P<suffix>\.[a-z]+)$")


def owner_tag(token: str | None = None) -> str:
    """`<host>.<pid>.<token>`: what makes a hidden folder's name unique to one save of one process and says whose
    it is (`owner_of`); `token` defaults to a random one."""
    return f"{host_name()}.{os.getpid()}.{token or uuid.uuid4().hex[:12]}"


def owner_of(name: str) -> tuple[str, int] | None:
    """(host, pid) of the process whose `owner_tag` ends `name` (before its suffix), or None for an untagged name."""
    match = _OWNED.search(name)
    return (match.group("host"), int(match.group("pid"))) if match else None


def owner_gone(name: str, quiet_after: float) -> bool:
    """Whether the process that made hidden folder `name` (its `owner_tag`) no longer works on it: this process
    itself (a save of its own that failed), a dead process of this machine, or, on another machine, a folder
    untouched for `quiet_after` seconds (`quiet_for`); so is a name without an owner tag (a persister's, named after
    its save, or an earlier version's). `name` is the folder's path."""
    owner = owner_of(os.path.basename(name))
    if owner is not None and owner[0] == host_name():
        return owner[1] == os.getpid() or not pid_alive(owner[1])
    return quiet_for(name) > quiet_after


def quiet_for(folder: str) -> float:
    """Seconds since the newest change of `folder` and of what lies directly in it (inf when it is gone)."""
    paths = [folder]
    try:
        paths += [os.path.join(folder, n) for n in os.listdir(folder)]
    except OSError:
        pass
    ages = [age(p) for p in paths]
    return min((a for a in ages if a is not None), default=float("inf"))


def touch(path: str) -> None:
    """Create `path` or set its modification time to now (a heartbeat)."""
    with open(path, "a"):
        os.utime(path, None)


def age(path: str) -> float | None:
    """Seconds since `path` was last modified, or None if it does not exist."""
    try:
        return max(0.0, time.time() - os.stat(path).st_mtime)
    except FileNotFoundError:
        return None


def private_folder(path: str) -> str:
    """Make folder `path` this user's own, before anything in it is read: created owner-only (0700; its parents as
    usual) when missing; an existing one must be a folder (not a link) owned by this user, and is made owner-only.
    What is created in it is owner-only too (`local_io.file_mode`, `local_io.make_folders`), so no other user reads
    it or plants a file in it. PermissionError naming the folder and its owner otherwise."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
        raise PermissionError(
            f"{path} is {'a folder' if stat.S_ISDIR(st.st_mode) else 'not a folder'} owned by user id {st.st_uid}, not "
            f"by this user ({os.geteuid()}): another user's memory folder, or one planted there. Nothing in it was "
            "read. Remove it, or set unified_checkpoint_memory_dir to a folder of your own.")
    if st.st_mode & 0o077:
        os.chmod(path, 0o700)
    return path


def is_mine(path: str) -> bool:
    """Whether `path` is a folder (not a link) owned by this user."""
    try:
        st = os.lstat(path)
    except OSError:
        return False
    return stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid()


class Lock:
    """An exclusive advisory lock on `path` (flock), held while the object lives or until `release`; released by
    the kernel when its process dies, however it dies."""

    def __init__(self, path: str):
        self.path = path
        self._fd: int | None = None

    def acquire(self, wait: bool = False) -> bool:
        """Take the lock; without `wait`, False at once if another process holds it."""
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, file_mode(self.path))
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
        except BlockingIOError:
            os.close(fd)
            return False
        self._fd = fd
        return True

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def is_locked(path: str) -> bool:
    """Whether some process holds the lock of `path` (a persister at work)."""
    probe = Lock(path)
    if not os.path.exists(path):
        return False
    if probe.acquire():
        probe.release()
        return False
    return True


def open_log(path: str):
    """`path` opened for appending, for a child process's output."""
    return open(path, "ab", buffering=0)


def remove_if_empty(folder: str) -> None:
    """Remove `folder` if nothing is left in it (another run may still use it otherwise)."""
    try:
        os.rmdir(folder)
    except OSError:
        pass
