"""Facts about this machine that the memory tier needs (`flash/`), read here, below the storage seam: how much
memory a snapshot may take, free bytes of a folder, whether a process lives, an advisory lock, a heartbeat file's
age, the persister's log file, a folder made this user's own (`private_folder`).

Memory that a tmpfs holds is RAM: its free size alone says nothing (a 24 GiB `/dev/shm` on a 23 GiB machine), so
`memory_room` takes the least of MemAvailable, the cgroup's limit less its usage, and the folder's free bytes.
"""

from __future__ import annotations

import fcntl
import os
import stat
import time

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
