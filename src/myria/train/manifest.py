"""A checkpoint directory against its manifest (meta.json's sizes and CRC-32s), without torch.

`myria train` asks whether a finished run has anything to do before it imports torch;
`CheckpointManager.verify` uses the same rule for every checkpoint a run resumes.
"""

from __future__ import annotations

import json
from pathlib import Path

from myria.fsutil import file_crc32


def verify_dir(path: Path, checksums: bool = True, part: tuple[int, int] = (0, 1)
               ) -> tuple[str | None, int]:
    """(None when `path` is complete and undamaged, else the reason; bytes checksummed).

    Sizes are always checked; with `checksums`, the CRC-32 of the files with index
    `i % part[1] == part[0]` (so that ranks can share the reading)."""
    read = 0
    try:
        meta = json.loads((path / "meta.json").read_text())
    except (OSError, ValueError) as e:
        return f"meta.json unreadable ({e})", read
    for name, size in meta.get("files", {}).items():
        f = path / name
        if not f.exists():
            return f"{name} is missing", read
        if f.stat().st_size != size:
            return f"{name} has {f.stat().st_size} bytes, expected {size}", read
    sums = meta.get("checksums", {})
    if checksums:
        for i, name in enumerate(sorted(sums)):
            if i % part[1] != part[0]:
                continue
            crc, n = file_crc32(path / name)
            read += n
            if crc != sums[name]:
                return f"{name} fails its checksum (CRC-32 {crc}, manifest {sums[name]})", read
    return None, read
