"""Does the update's arithmetic on a second thread slow training beyond the CPU it uses?

    .venv/bin/python bench/offload_contention.py   # ~3 min; bench/results/offload_contention.json

The bench model of bench/offload.py (359M parameters) in memory: forward+backward on the main
thread, and AdamW (torch's functional adam on 64 MB chunks, as the offloaded update runs it)
over as many elements on another thread, three ways: `serial` (one after the other), `conc2`
(at once, default thread pools), `conc1` (at once, `torch.set_num_threads(1)` on the update's
thread: in this build that is that thread's OpenMP setting; the main thread keeps 2, threads
started later take 1, so the main thread sets 2 again). 3 repetitions; wall and CPU seconds.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import torch  # noqa: E402
from torch.optim.adam import adam  # noqa: E402

import offload as bench  # noqa: E402
from myria import config  # noqa: E402
from myria.train.engine import Engine  # noqa: E402

CHUNK = 64 << 20
KW = dict(amsgrad=False, has_complex=False, beta1=0.9, beta2=0.95, lr=1e-4, weight_decay=0.1,
          eps=1e-8, maximize=False, foreach=True, capturable=False, differentiable=False,
          fused=None, grad_scale=None, found_inf=None, decoupled_weight_decay=True)


def main() -> None:
    torch.set_num_threads(2)
    cfg = config.load(None, [*bench.MODEL, "--model.layers=24", "--model.hidden=1152"])
    e = Engine(cfg, None, torch.device("cpu"), tempfile.mkdtemp())
    n = sum(p.numel() for p in e.model.parameters())
    chunks, left = [], n
    while left > 0:
        k = min(CHUNK // 4, left)
        chunks.append([torch.randn(k) for _ in range(4)] + [torch.tensor(0.0)])
        left -= k
    x = torch.randint(0, cfg.model.vocab_size, (1, 2, cfg.model.seq_len + 1),
                      generator=torch.Generator().manual_seed(7))

    def fb():
        e.forward_backward(x[..., :-1], x[..., 1:])

    def upd(threads=0, out=None):
        if threads:
            torch.set_num_threads(threads)
        t0, c0 = time.perf_counter(), time.thread_time()
        with torch.no_grad():
            for p, g, m, v, s in chunks:
                adam([p], [g], [m], [v], [], [s], **KW)
        if out is not None:
            out.append((time.perf_counter() - t0, time.thread_time() - c0))

    def timed(f):
        c0, t0 = sum(os.times()[:2]), time.perf_counter()
        f()
        return time.perf_counter() - t0, sum(os.times()[:2]) - c0

    fb()   # warm-up
    res: dict = {"params": n, "chunk_bytes": CHUNK}
    for rep in range(3):
        for mode in ("serial", "conc2", "conc1"):
            if mode == "serial":
                a, ca = timed(fb)
                b, cb = timed(upd)
                r = dict(wall=a + b, fb=a, upd=b, cpu=ca + cb)
            else:
                th, out = (2 if mode == "conc2" else 1), []

                def both(th=th, out=out):
                    t = threading.Thread(target=upd, args=(th, out))
                    t.start()
                    if th == 1:
                        time.sleep(0.01)
                        torch.set_num_threads(2)   # back to 2 for threads started later
                    fb()
                    t.join()

                w, c = timed(both)
                r = dict(wall=w, cpu=c, upd=out[0][0], upd_cpu=out[0][1])
            res.setdefault(mode, []).append(r)
            print(rep, mode, {k: round(v, 2) for k, v in r.items()}, flush=True)
    (HERE / "results" / "offload_contention.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
