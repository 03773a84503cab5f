"""O_DIRECT from buffers on 4 KiB pages against buffers on transparent huge pages.

    .venv/bin/python bench/offload_hugepages.py [--dir DIR] [--gb 2] [--repeat 2]
    # ~1 min; bench/results/offload_hugepages.json

Writes then reads `--gb` GB of one file in the offload's call size (a chunk's section, 18 MB
here) with O_DIRECT, from one buffer of each kind, alternating, `--repeat` times. Reports the
bandwidth, the process's CPU time, and the CPU time of the kernel's workers (kworker and
ksoftirqd threads, from /proc/*/stat): on a virtio disk those complete block requests, and no
process is charged for them. A direct I/O request holds at most `max_segments` physical
segments (printed), so from 4 KiB pages a large call becomes many small requests.

`4k` is a buffer from torch's allocator (what `aligned_buffer` returned before); `huge` is
`myria.offload.diskio.aligned_buffer`, which maps buffers of 2 MiB and more on huge pages.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import time
from pathlib import Path

import torch

from myria.offload.diskio import ALIGN, aligned_buffer, full_io, probe_direct

OUT = Path(__file__).resolve().parent / "results" / "offload_hugepages.json"
CALL = 18 << 20


def small_page_buffer(n: int) -> torch.Tensor:
    raw = torch.empty(n + ALIGN, dtype=torch.uint8)
    skip = (-raw.data_ptr()) % ALIGN
    return raw[skip:skip + n]


def kernel_workers_s() -> float:
    """CPU seconds of the kernel's worker threads so far (user + system ticks)."""
    tick, total = os.sysconf("SC_CLK_TCK"), 0
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            text = open(f"/proc/{pid}/stat").read()
        except OSError:
            continue
        name, rest = text[text.index("(") + 1:text.rindex(")")], text[text.rindex(")") + 2:]
        if name.startswith(("kworker", "ksoftirqd")):
            f = rest.split()
            total += int(f[11]) + int(f[12])
    return total / tick


def huge_kb(addr: int) -> int:
    """AnonHugePages (kB) of the mapping holding `addr`."""
    hit = False
    for line in open("/proc/self/smaps"):
        head = line.split()[0]
        if "-" in head and ":" not in head:
            lo, hi = (int(x, 16) for x in head.split("-"))
            hit = lo <= addr < hi
        elif hit and line.startswith("AnonHugePages:"):
            return int(line.split()[1])
    return 0


def one(path: Path, buf: torch.Tensor, nbytes: int, op: str, direct: bool) -> dict:
    mv = memoryview(buf.numpy()).cast("B")
    flags = os.O_RDWR | os.O_CREAT | (os.O_DIRECT if direct else 0)
    fd = os.open(path, flags, 0o644)
    try:
        k0, c0, t0 = kernel_workers_s(), os.times(), time.perf_counter()
        for off in range(0, nbytes, CALL):
            full_io(os.pwritev if op == "write" else os.preadv, fd, mv, off)
        if op == "write":
            os.fdatasync(fd)
        dt, c1, k1 = time.perf_counter() - t0, os.times(), kernel_workers_s()
    finally:
        os.close(fd)
    return {"gbs": nbytes / dt / 1e9, "wall_s": dt,
            "process_cpu_s": (c1[0] + c1[1]) - (c0[0] + c0[1]),
            "kernel_workers_cpu_s": k1 - k0}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dir", default="", help="a directory on the disk to test (default: a "
                    "temporary directory under the working directory)")
    ap.add_argument("--gb", type=float, default=2.0)
    ap.add_argument("--repeat", type=int, default=2)
    a = ap.parse_args()
    base = Path(a.dir) if a.dir else Path(tempfile.mkdtemp(prefix=".hugepages-", dir="."))
    base.mkdir(parents=True, exist_ok=True)
    path = base / "probe.bin"
    direct = probe_direct(base)
    nbytes = max(1, int(a.gb * (1 << 30)) // CALL) * CALL
    dev = os.stat(base).st_dev
    queue = Path(f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}")
    queue = (queue / "queue") if (queue / "queue").exists() else (queue / ".." / "queue")
    segs = (queue / "max_segments").read_text().strip() if (queue / "max_segments").exists() \
        else "?"
    thp = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    runs: dict[str, list] = {"4k": [], "huge": []}
    try:
        for _ in range(a.repeat):
            for kind in ("4k", "huge"):
                buf = (small_page_buffer if kind == "4k" else aligned_buffer)(CALL)
                buf.fill_(1)
                r = {op: one(path, buf, nbytes, op, direct) for op in ("write", "read")}
                r["huge_pages_kb"] = huge_kb(buf.data_ptr())
                runs[kind].append(r)
                del buf
                print(f"{kind:5s} write {r['write']['gbs']:.2f} GB/s  read {r['read']['gbs']:.2f}"
                      f" GB/s  kernel workers {r['write']['kernel_workers_cpu_s']:.2f} + "
                      f"{r['read']['kernel_workers_cpu_s']:.2f} s  huge pages "
                      f"{r['huge_pages_kb'] >> 10} MB of {CALL >> 20}")
    finally:
        path.unlink(missing_ok=True)
        if not a.dir:
            base.rmdir()
    res = {"command": "python bench/offload_hugepages.py", "date": time.strftime("%Y-%m-%d"),
           "machine": f"{platform.machine()}, {os.cpu_count()} cores", "gb": nbytes / 1e9,
           "call_bytes": CALL, "direct": direct, "max_segments": segs,
           "thp": thp.read_text().strip() if thp.exists() else "absent", "runs": runs}
    OUT.parent.mkdir(exist_ok=True)
    OUT.write_text(json.dumps(res, indent=1) + "\n")
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
