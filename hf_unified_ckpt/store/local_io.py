"""POSIX file primitives of `LocalStore`: positional writes, fsync, atomic small files, checksums of a file or
of one range (mapped, not read), and the one way a file is opened for reading (`open_regular`)."""

from __future__ import annotations

import errno
import mmap
import os
import stat
import threading

from ..errors import NotRegularFileError, short_read
from ..format.checksum import crc32

_CHUNK = 16 * 2**20


_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"), (stat.S_ISLNK, "a symbolic link"))


def kind_of(mode: int) -> str:
    """What a file of mode `mode` is, in words ("a FIFO (named pipe)"); "a regular file" for one."""
    return next((words for test, words in _KINDS if test(mode)), "a regular file" if stat.S_ISREG(mode) else
                "a special file")


def not_regular(path, mode: int) -> NotRegularFileError:
    return NotRegularFileError(f"{path} is {kind_of(mode)}, not a regular file: a checkpoint holds regular files "
                               "only, and this one is not read (replace it with the file itself)")


def open_regular(path: str | os.PathLike) -> int:
    """A read-only descriptor of `path`, which must be a regular file; `NotRegularFileError` otherwise. The open
    does not follow a final symbolic link (`O_NOFOLLOW`) and does not wait (`O_NONBLOCK`: a FIFO with no writer
    opens at once), and the kind is checked on the descriptor itself (`fstat`), so the file checked is the file
    read: no window between a check and the open. Blocking mode is restored for the reads."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        if e.errno == errno.ELOOP and os.path.islink(path):
            raise not_regular(path, stat.S_IFLNK) from None
        raise
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise not_regular(path, mode)
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def regular_size(path: str | os.PathLike) -> int | None:
    """The size of regular file `path`; None when nothing is there or it is a folder (a symbolic link to a folder
    included: a checkpoint folder may be one); `NotRegularFileError` for anything else (a FIFO, a device, a socket,
    a symbolic link to a file)."""
    try:
        st = os.lstat(path)
        if stat.S_ISLNK(st.st_mode):
            target = os.stat(path)
            if stat.S_ISDIR(target.st_mode):
                return None
    except OSError:
        return None
    if stat.S_ISDIR(st.st_mode):
        return None
    if not stat.S_ISREG(st.st_mode):
        raise not_regular(path, st.st_mode)
    return st.st_size


def read_file(path: str | os.PathLike, offset: int = 0, length: int | None = None) -> bytes:
    """Bytes `[offset, offset + length)` of regular file `path` (to its end when `length` is None); raises when
    the file ends before `offset + length` (`CorruptCheckpointError` naming it: a short read is never passed on)."""
    with open(open_regular(path), "rb", closefd=True) as f:
        if offset:
            f.seek(offset)
        data = f.read() if length is None else f.read(length)
    if length is not None and len(data) != length:
        raise short_read(path, offset, length, len(data))
    return data


def is_private(folder: str | os.PathLike) -> bool:
    """Whether `folder` is owner-only (no permission for its group or others): what is created in it is too."""
    try:
        return not os.lstat(folder).st_mode & 0o077
    except OSError:
        return False


def file_mode(path: str | os.PathLike) -> int:
    """The mode a new file at `path` is created with: owner-only (0600) inside an owner-only folder (the memory
    tier's run folder, `store.node.private_folder`), else 0644."""
    return 0o600 if is_private(os.path.dirname(os.path.abspath(path))) else 0o644


def make_folders(path: str | os.PathLike) -> None:
    """`os.makedirs(path, exist_ok=True)`, each folder created inside an owner-only one owner-only too (0700)."""
    path = os.path.abspath(path)
    if os.path.isdir(path):
        return
    parent = os.path.dirname(path)
    if parent != path:
        make_folders(parent)
    try:
        os.mkdir(path, 0o700 if is_private(parent) else 0o777)
    except FileExistsError:
        if not os.path.isdir(path):
            raise


def pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    """`os.pwrite` until every byte of `data` is written at `offset` (a write may be short)."""
    done = 0
    while done < len(data):
        done += os.pwrite(fd, data[done:], offset + done)


def fsync_file(path: str | os.PathLike) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: str | os.PathLike) -> None:
    """Persist a directory's entries (a rename or a new file in it)."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def file_crc32(path: str | os.PathLike) -> str:
    """CRC-32 of a file's bytes, as 8 lowercase hex digits."""
    crc = 0
    with open(open_regular(path), "rb", buffering=0) as f:
        while chunk := f.read(_CHUNK):
            crc = crc32(chunk, crc)
    return f"{crc:08x}"


def range_crc32(path: str | os.PathLike, offset: int, length: int) -> int | None:
    """The CRC-32 of bytes `[offset, offset + length)` of a file, None when it is missing or shorter (an unreadable
    file, or one that is not regular, raises). The range is mapped, not read: CRC-32 runs on the page cache's bytes
    without a copy (a third faster than `pread` here)."""
    try:
        f = open(open_regular(path), "rb", buffering=0)
    except FileNotFoundError:
        return None
    with f:
        if os.fstat(f.fileno()).st_size < offset + length:
            return None
        if not length:
            return 0
        first = offset - offset % mmap.ALLOCATIONGRANULARITY
        with mmap.mmap(f.fileno(), offset + length - first, access=mmap.ACCESS_READ,
                       offset=first) as mapped, memoryview(mapped) as view:
            crc, skip = 0, offset - first
            for at in range(skip, skip + length, _CHUNK):
                crc = crc32(view[at:min(at + _CHUNK, skip + length)], crc)
        return crc


def mapped_chunks(path: str | os.PathLike, chunk: int):
    """(offset, memoryview) ranges of `chunk` bytes covering file `path`, views of one read-only mapping (no copy,
    no allocation: reading a large file this way costs a third of the CPU of `read`s into fresh buffers on this
    VM). The mapping is unmapped when the generator ends, or once the last view the caller kept is gone."""
    with open(open_regular(path), "rb", buffering=0) as f:
        size = os.fstat(f.fileno()).st_size
        if not size:
            yield 0, memoryview(b"")
            return
        mapped = mmap.mmap(f.fileno(), size, access=mmap.ACCESS_READ)
    try:
        for offset in range(0, size, chunk):
            yield offset, memoryview(mapped)[offset:offset + chunk]
    finally:
        try:
            mapped.close()
        except BufferError:  # the caller still holds a view: unmapped when it is dropped
            pass


def write_atomic(path: str | os.PathLike, data: bytes, exclusive: bool = False) -> None:
    """Write `data` durably through a temporary file and an atomic rename (several processes may write the same
    file at once: each uses its own temporary name, and the last rename wins). `exclusive`: a hard link instead of
    the rename, which fails (FileExistsError) when `path` exists."""
    path = os.fspath(path)
    head, name = os.path.split(path)
    tmp = os.path.join(head, f".{name}.{os.getpid()}-{threading.get_ident()}.tmp")
    with open(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, file_mode(tmp)), "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    if not exclusive:
        os.replace(tmp, path)
        return
    try:
        os.link(tmp, path)
    except FileExistsError:
        os.unlink(tmp)
        raise
    except OSError:  # a filesystem without hard links (some network and FUSE mounts): checked, then renamed
        if os.path.exists(path):
            os.unlink(tmp)
            raise FileExistsError(errno.EEXIST, "exists", path) from None
        os.replace(tmp, path)
        return
    os.unlink(tmp)


def write_at(path: str | os.PathLike, ranges, size: int | None) -> list[tuple[int, int, int]]:
    """Write (offset, bytes) ranges into `path`, created if missing and never truncated; grown to `size` first.
    Returns each range's (offset, length, CRC-32), computed from memory once it is written."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, file_mode(path))
    written = []
    try:
        if size is not None:
            grow_to(fd, size, path)
        for offset, data in ranges:
            pwrite_all(fd, data, offset)
            written.append((offset, len(data), crc32(data)))
            del data
    finally:
        os.close(fd)
    return written


def grow_to(fd: int, size: int, path) -> None:
    """Size the open file `fd` to `size` bytes by growing it; a file already larger is refused, never shrunk: a
    file may be mapped by another process (the persister's copy) or hold tensors a process read from it, and
    shrinking it drops even the privately written pages of a copy-on-write mapping beyond the new end (SIGBUS on
    their next access). Writers take a fresh file (`unlink_existing`) or one of exactly the planned size."""
    current = os.fstat(fd).st_size
    if current > size:
        raise ValueError(f"{path} is {current} bytes, larger than the {size} planned: a file that may be mapped is "
                         "never shrunk (take a fresh file instead).")
    if current < size:
        os.ftruncate(fd, size)


def unlink_existing(path: str | os.PathLike) -> None:
    """Remove the file at `path` if there is one, so that what is written there next is a new file: whoever has the
    old one open or mapped keeps its bytes intact (truncating it in place would pull them from under them)."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def write_whole(path: str | os.PathLike, ranges, size: int) -> list[tuple[int, int, int]]:
    """Create `path` (a new file: an existing one is unlinked, never truncated) from (offset, bytes) ranges tiling
    [0, size), written in order through the page cache, each range's CRC-32 computed from memory once it is
    written."""
    unlink_existing(path)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, file_mode(path))
    written, end = [], 0
    try:
        for offset, data in ranges:
            if offset != end:
                raise ValueError(f"{path}: a range starts at byte {offset}, expected {end} (gap or overlap)")
            pwrite_all(fd, data, offset)
            written.append((offset, len(data), crc32(data)))
            end += len(data)
            del data
    finally:
        os.close(fd)
    if end != size:
        raise ValueError(f"{path}: the ranges end at {end}, the file is {size} bytes")
    return written


class WritableMaps:
    """Shared writable mappings of files, each kept from one save to the next while its file lives: a file written
    again (the memory tier's spare files keep their inode through every rename) is copied into through the mapping
    it already has, which costs a plain memory copy; mapping it afresh costs a page fault per page, and `pwrite`
    from a host buffer a second copy (per 600 MB in /dev/shm on the 2-core VM, idle: 0.064 s, 0.32 s and 0.17 s).
    One thread uses an instance at a time; `close` releases every mapping."""

    def __init__(self):
        self._maps: dict[tuple[int, int], tuple[int, mmap.mmap]] = {}  # (st_dev, st_ino) -> (fd, mapping)

    def view(self, path: str | os.PathLike, size: int) -> memoryview:
        """A writable view of file `path` (created if missing, or of exactly `size` bytes: a larger one is refused,
        never shrunk, see `grow_to`) of `size` bytes. A new mapping first takes the file's blocks
        (`posix_fallocate`): a full filesystem raises ENOSPC here, not SIGBUS at the copy."""
        fd = os.open(path, os.O_RDWR | os.O_CREAT, file_mode(path))
        try:
            st = os.fstat(fd)
            key = (st.st_dev, st.st_ino)
            held = self._maps.get(key)
            if held is not None and len(held[1]) == size == st.st_size and os.fstat(held[0]).st_nlink:
                # the same live file (a removed one's inode number may come back with a new file)
                os.close(fd)
                return memoryview(held[1])
            grow_to(fd, size, path)
            os.posix_fallocate(fd, 0, size)
            mapped = mmap.mmap(fd, size, mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0),
                               mmap.PROT_READ | mmap.PROT_WRITE)  # populated: one call, not a fault per page
        except BaseException:
            os.close(fd)
            raise
        self._release(key)
        self._maps[key] = (fd, mapped)  # the descriptor tells `prune` whether the file still exists
        return memoryview(mapped)

    def prune(self) -> None:
        """Release the mappings of files removed since (their memory is freed once unmapped)."""
        for key, (fd, _) in list(self._maps.items()):
            if os.fstat(fd).st_nlink == 0:
                self._release(key)

    def close(self) -> None:
        for key in list(self._maps):
            self._release(key)

    def __len__(self) -> int:
        return len(self._maps)

    def _release(self, key) -> None:
        held = self._maps.pop(key, None)
        if held is None:
            return
        fd, mapped = held
        os.close(fd)
        try:
            mapped.close()
        except BufferError:  # a view of it is still held (a job not yet dropped): unmapped when that view goes
            pass
