"""The map of a generation file: which bytes hold which piece of which tensor.

`OFFLOAD_DIR/rankNNNNN/partK/gen_00000012.bin` holds one region per section (`param`,
`exp_avg`, `exp_avg_sq`), each holding the rank's local tensors one after another at
4 KiB-aligned offsets (`FileMap`); the pipeline moves it in `Chunk`s, byte ranges of every
region cut at the same offsets, and a chunk's `Piece`s say which elements of which tensor it
holds. `gen_N.json` beside the file is `FileMap.to_json()` and the generation number.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from myria.offload.diskio import round_up


@dataclass(frozen=True)
class Piece:
    """Elements [start, stop) of tensor `index`, at byte `offset` of a chunk's section."""

    index: int
    start: int
    stop: int
    offset: int


@dataclass(frozen=True)
class Chunk:
    """Bytes [start, stop) of every section region, and the tensor pieces they hold."""

    start: int
    stop: int
    pieces: tuple[Piece, ...]


class FileMap:
    """Where each tensor lives in a generation file: sections (e.g. exp_avg, exp_avg_sq) one
    region after another; in each region the tensors in optimizer order (or in `order`: tensor
    indices in the order they are placed), each at a 4 KiB-aligned byte offset."""

    def __init__(self, tensors: list[tuple[tuple[int, ...], torch.dtype]],
                 sections: tuple[str, ...], order: list[int] | None = None):
        self.sections = sections
        self.shapes = [tuple(s) for s, _ in tensors]
        self.dtypes = [d for _, d in tensors]
        self.numels = [math.prod(s) for s in self.shapes]
        self.itemsizes = [torch.empty((), dtype=d).element_size() for d in self.dtypes]
        self.order = list(order) if order is not None else list(range(len(tensors)))
        if sorted(self.order) != list(range(len(tensors))):
            raise ValueError("FileMap: order must place every tensor once")
        self.offsets = [0] * len(tensors)
        off = 0
        for t in self.order:
            self.offsets[t] = off
            off += round_up(self.numels[t] * self.itemsizes[t])
        self.region = off
        self.file_bytes = off * len(sections)

    def section(self, name: str) -> int:
        return self.sections.index(name)

    def chunks(self, cap: int) -> list[Chunk]:
        """The region cut into chunks of at most `cap` bytes (a multiple of ALIGN)."""
        out = []
        a = 0
        while a < self.region:
            b = min(a + cap, self.region)
            pieces = []
            for t, (o, n, isz) in enumerate(zip(self.offsets, self.numels, self.itemsizes)):
                x, y = max(a, o), min(b, o + n * isz)
                if x < y:
                    pieces.append(Piece(t, (x - o) // isz, (y - o) // isz, x - a))
            out.append(Chunk(a, b, tuple(pieces)))
            a = b
        return out

    def to_json(self) -> dict:
        out = {"sections": list(self.sections),
               "tensors": [[list(s), str(d).replace("torch.", "")]
                           for s, d in zip(self.shapes, self.dtypes)],
               "region_bytes": self.region}
        if self.order != list(range(len(self.shapes))):
            out["order"] = self.order
        return out
