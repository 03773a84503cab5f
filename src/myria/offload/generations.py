"""The generation files of one offloaded optimizer: created, reused, committed, restored.

`gen_00000012.bin` is the state after 12 updates, `gen_00000012.json` its map
(files.FileMap). A generation is never written twice: update N+1 reads generation N and writes
another file; when its last chunk is written it is synced (`commit`), and generation N is
dropped. Its file is kept as `spare.bin` and becomes generation N+2's (its blocks are allocated
already: deleting and allocating 4 GB files each step slowed the disk for the reads that
followed), unless a checkpoint links it, in which case only its name goes. A new file is
created at full size first (`posix_fallocate`, so a full disk fails before any parameter
changes). A fresh run starts from a preallocated file of zeros, which is AdamW's initial state.
"""

from __future__ import annotations

import errno
import os
import threading
from pathlib import Path

from myria.errors import OffloadError
from myria.fsutil import atomic_write_json, link_or_copy
from myria.offload.diskio import open_file
from myria.offload.files import FileMap

SPARE = "spare.bin"          # a replaced generation's file, rewritten as a later one


class Generations:
    """The files of one optimizer's state in `directory`, laid out by `filemap`."""

    def __init__(self, directory: Path, filemap: FileMap, direct: bool):
        self.dir = Path(directory)
        self.filemap = filemap
        self.direct = direct
        # a file the next generation can be written into (`file_for`): a dropped
        # speculation's (its gen, fd), or a replaced generation's, renamed SPARE (-1, fd)
        self._spare: tuple[int, int] | None = None
        self._spare_lock = threading.Lock()
        self.closed = False
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            for f in [*self.dir.glob("gen_*"), self.dir / SPARE]:   # a crashed run's
                f.unlink(missing_ok=True)
        except OSError as e:
            raise OffloadError(f"offload directory {self.dir} is not usable: "
                               f"{e.strerror or e}") from None

    def path(self, gen: int, suffix: str = ".bin") -> Path:
        return self.dir / f"gen_{gen:08d}{suffix}"

    def create(self, gen: int) -> int:
        """A new generation file at full size (zeros); OffloadError when there is no room."""
        path = self.path(gen)
        try:
            path.unlink(missing_ok=True)   # never truncate a file a checkpoint may link
            fd = open_file(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, self.direct)
            try:
                if self.filemap.file_bytes:
                    os.posix_fallocate(fd, 0, self.filemap.file_bytes)
            except OSError:
                os.close(fd)
                path.unlink(missing_ok=True)
                raise
            return fd
        except OSError as e:
            raise self.error(e, f"creating {path.name}") from None

    def error(self, e: BaseException, doing: str) -> OffloadError:
        """The one-line error for an I/O failure while `doing`."""
        full = isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT)
        why = "is full" if full else "failed"
        detail = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
        return OffloadError(
            f"offload directory {self.dir} {why} ({detail}) while {doing} "
            f"({self.filemap.file_bytes / 1e9:.3g} GB per generation); training stopped, "
            "the committed checkpoints are intact: free space or set parallel.offload_dir, then "
            "run the same command to resume")

    def write_index(self, gen: int) -> None:
        atomic_write_json(self.path(gen, ".json"),
                          {"gen": gen, "direct": self.direct, **self.filemap.to_json()},
                          indent=None, durable=False)

    # -- the spare file ------------------------------------------------------------------
    def _spare_path(self, gen: int) -> Path:
        return self.dir / SPARE if gen < 0 else self.path(gen)

    def drop_spare(self) -> None:
        with self._spare_lock:
            spare, self._spare = self._spare, None
        if spare is not None:
            os.close(spare[1])
            self._spare_path(spare[0]).unlink(missing_ok=True)

    def keep_spare(self, gen: int, fd: int) -> bool:
        """Keep the file of generation `gen` (or -1: already named SPARE) to write a later
        generation into, if nothing else is kept and no checkpoint links it; False: not kept."""
        with self._spare_lock:
            if self._spare is not None or self.closed or os.fstat(fd).st_nlink != 1:
                return False
            if gen >= 0:
                os.replace(self.path(gen), self.dir / SPARE)
            self._spare = (-1, fd)
            return True

    def file_for(self, gen: int) -> int:
        """The file generation `gen` is written into: a dropped speculation's or a replaced
        generation's (its blocks already allocated: rewriting them costs the file system
        nothing, while deleting a generation file frees every block of it, discarding them
        on a disk mounted with `discard`, and a new one is allocated and its extents converted
        as they are written: measured here, the next forward's first layer reads ran 3-5x
        slower for the half second after each deletion), else a new one."""
        with self._spare_lock:
            spare, self._spare = self._spare, None
        if spare is not None:
            sgen, fd = spare
            if sgen == gen:
                return fd
            try:
                os.replace(self._spare_path(sgen), self.path(gen))
                return fd
            except OSError:
                os.close(fd)
                self._spare_path(sgen).unlink(missing_ok=True)
        return self.create(gen)

    def discard(self, gen: int, fd: int) -> None:
        """A generation never committed (a dropped speculation's): kept as the spare, or gone."""
        if not self.keep_spare(gen, fd):
            os.close(fd)
            self.path(gen).unlink(missing_ok=True)

    # -- commit and restore --------------------------------------------------------------
    def commit(self, gen: int, fd: int, old_fd: int, old: int) -> None:
        """Writer thread, after the last chunk of `gen`: sync it, then drop generation `old`."""
        os.fdatasync(fd)
        self.write_index(gen)
        self.path(old, ".json").unlink(missing_ok=True)
        if not self.keep_spare(old, old_fd):   # linked into a checkpoint: the link keeps it
            os.close(old_fd)
            self.path(old).unlink(missing_ok=True)

    def restore(self, src: Path, gen: int, current: int, current_fd: int) -> tuple[int, str]:
        """Make `src` (a checkpoint's state file) generation `gen`, replacing the current
        generation `current` (its fd is closed); returns the new fd and how it was linked."""
        try:
            if gen != current:
                self.path(gen).unlink(missing_ok=True)
            how = link_or_copy(src, self.path(gen, ".bin.tmp"))
            os.replace(self.path(gen, ".bin.tmp"), self.path(gen))
            fd = open_file(self.path(gen), os.O_RDWR, self.direct)
        except OSError as e:
            raise self.error(e, f"restoring {src}") from None
        os.close(current_fd)
        if gen != current:
            self.path(current).unlink(missing_ok=True)
            self.path(current, ".json").unlink(missing_ok=True)
        self.write_index(gen)
        return fd, how
