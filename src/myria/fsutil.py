"""The project's file helpers: atomic write, fsync of a directory, hard link or copy, CRC.

Torch-free and importing nothing of myria, so every module that writes state can use them at
the top of its file (the supervisor, the event recorder, the data preparation, the caches).

- `atomic_write(path, data)`: all or nothing. The bytes go to a temporary file beside `path`
  (named per process and thread, so concurrent writers never share one), are flushed and, with
  `durable=True` (the default), fsynced; then the file is renamed over `path`. A reader sees the
  old file or the new one, never a part. `durable=False` keeps the rename's atomicity but skips
  the fsync, for files rewritten often whose loss on a power cut costs nothing (caches, stats).
- `atomic_write_json(path, obj)`: the same for a JSON document.
- `fsync_dir(path)`: make a rename or a new entry in `path` durable (errors ignored: some file
  systems refuse to open a directory).
- `link_or_copy(src, dst)`: `dst` holds `src`'s bytes without reading them through this process.
- `file_crc32(path)`: CRC-32 of a file and the bytes read.
- `pid_alive(pid)`: whether a process of this host runs (a zombie does not).
- `proc_stat(pid)`: the fields of /proc/PID/stat after the command name (state first).
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import threading
import zlib
from pathlib import Path
from typing import Any

_CHUNK = 8 << 20


def atomic_write(path: str | Path, data: str | bytes, *, durable: bool = True) -> None:
    """Write `data` (text or bytes) to `path` through a temporary file and a rename."""
    path = Path(path)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        with open(tmp, "wb") as fh:
            fh.write(data.encode() if isinstance(data, str) else data)
            fh.flush()
            if durable:
                os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def atomic_write_json(path: str | Path, obj: Any, *, indent: int | None = 1,
                      durable: bool = True) -> None:
    """`atomic_write` of `json.dumps(obj, indent=indent)`."""
    atomic_write(path, json.dumps(obj, indent=indent), durable=durable)


def fsync_dir(path: str | Path) -> None:
    """fsync a directory, so that renames and new entries in it survive a power cut."""
    try:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError:
        pass


def link_or_copy(src: Path, dst: Path) -> str:
    """Make `dst` hold `src`'s bytes without reading them through this process: a hard link
    (same file system), else a reflink (copy-on-write clone: btrfs, XFS), else a kernel-side
    copy (`shutil.copyfile`, which uses sendfile/copy_file_range). Returns which was used."""
    dst.unlink(missing_ok=True)
    try:
        os.link(src, dst)
        return "link"
    except OSError:
        pass
    try:
        with open(src, "rb") as fs, open(dst, "wb") as fd:
            fcntl.ioctl(fd.fileno(), 0x40049409, fs.fileno())  # FICLONE
        return "reflink"
    except OSError:
        dst.unlink(missing_ok=True)
    shutil.copyfile(src, dst)
    return "copy"


def file_crc32(path: str | Path, chunk: int = _CHUNK) -> tuple[str, int]:
    """CRC-32 of a file (hex) and the bytes read; zlib releases the GIL while it hashes."""
    crc, n = 0, 0
    with open(path, "rb") as fh:
        while block := fh.read(chunk):
            crc = zlib.crc32(block, crc)
            n += len(block)
    return f"{crc:08x}", n


def pid_alive(pid: int) -> bool:
    """Whether process `pid` of this host is running: it exists (another user's counts) and is
    not a zombie, which has exited and only waits for its parent to reap it."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    fields = proc_stat(pid)
    return fields is None or fields[0] != "Z"   # no /proc here: os.kill found it


def proc_stat(pid: int | str = "self") -> list[str] | None:
    """The fields of /proc/PID/stat after the command name, the process's state first (field 3
    of proc(5) is [0], utime [11], stime [12], starttime [19]); None without /proc or process.
    The name is cut at its last ")": it may hold spaces and parentheses."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            fields = fh.read().rsplit(")", 1)[1].split()
        return fields or None
    except (OSError, IndexError):
        return None
