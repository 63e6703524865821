"""`bench/collect_rate.py convert`: the --on-host conversion (the agent's `convert` op) before and after, side by
side in one run, with the disk's own write rate beside it (issue 30).

    python bench/collect_rate.py convert [--dumps 30] [--tokens 2000] [--hidden 7168] [--workers 1,D,C]
                                         [--rounds 1] [--variants before,after,inline,torch.save,disk,dd]
                                         [--before f53753e | --before-tree DIR] [--prev REV | --prev-tree DIR]
                                         [--dir DIR]

Writes --dumps hidden-dump files of T x H (K = 3, bf16: 8 * H bytes a token, 115 MB at T = 2 000, H = 7 168)
with the capture module's metadata into <dir>/state/dumps/captures/bench/ (then in the page cache: this
measures the conversion and the disk it writes to, not a cold read), then for each round, each worker count W
(default: 1, the op's default cores - 1, and all cores) and each variant, in turn (the order reversed on odd
rounds), converts or writes all of them into a fresh directory on the same file system:

  before      the `convert` op's Converter as on main at --before (loaded from git, `git archive`, or from
              --before-tree, a copy of that commit's `patchctl/` package where there is no git: the GPU host)
  prev        the same for another commit, --prev / --prev-tree (a step between before and after: variant
              "prev" runs when one of them is given)
  after       this tree's Converter (host/convert.py + host/ckpt.py)
  inline      this tree's, hashing on the worker's own thread (ckpt.OVERLAP = False)
  torch.save  the ceiling of any torch.save converter: W processes torch.save the same tensors (already in
              memory) to their files and fsync them; no read, no hashing, no checks
  disk        the disk at the same concurrency: W processes write + fsync the same number of bytes
  dd          the disk, one stream: `dd if=/dev/zero bs=16M conv=fsync` of the same bytes (once per round)

Each row: wall, GB/s written (the outputs' bytes over wall: the figure to set beside the disk's), GB/s of
dumps read, CPU seconds per dump (every process: RUSAGE_SELF + RUSAGE_CHILDREN, children reaped), the cores
kept busy (/proc/stat) and os.getloadavg() before the row. Round 0's converted files are hashed and compared
with after's: every variant wrote the same bytes.
"""

from __future__ import annotations

import atexit
import hashlib
import importlib
import importlib.util
import io
import json
import multiprocessing
import os
import resource
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
VARIANTS = ("before", "prev", "after", "inline", "torch.save", "disk", "dd")
CONVERTERS = ("before", "prev", "after", "inline")


def add_args(c) -> None:
    n = os.cpu_count() or 2
    default = max(1, n - 1)  # the op's default (host/convert.py)
    c.add_argument("--dumps", type=int, default=30)
    c.add_argument("--tokens", type=int, default=2000)
    c.add_argument("--hidden", type=int, default=7168)
    c.add_argument("--workers", type=lambda s: [int(x) for x in s.split(",")], default=sorted({1, default, n}))
    c.add_argument("--rounds", type=int, default=1)
    c.add_argument("--variants", type=lambda s: s.split(","), default=list(VARIANTS))
    c.add_argument("--check-every", type=int, default=1, help="round 0: hash every Nth converted file (1: all)")
    c.add_argument("--phases", action="store_true", help="also time one dump's phases in this process")
    c.add_argument("--before", default="f53753e", help="the commit whose converter is 'before' (git archive)")
    c.add_argument("--before-tree", type=Path, default=None,
                   help="a directory holding that commit's patchctl/ package (where the tree has no git)")
    c.add_argument("--prev", default=None, help="a second commit to convert with, as variant 'prev'")
    c.add_argument("--prev-tree", type=Path, default=None, help="--before-tree's twin for --prev")


def load_before(rev: str, tree: Path | None, name: str = "patchctl_before"):
    """The `convert` and `events` modules of commit `rev`'s agent, imported as package `name`."""
    if tree is None:
        tree = Path(tempfile.mkdtemp(prefix="convert-before-"))
        atexit.register(shutil.rmtree, tree, True)
        blob = subprocess.run(["git", "-C", str(REPO), "archive", rev, "patchctl/__init__.py", "patchctl/host"],
                              check=True, capture_output=True).stdout
        with tarfile.open(fileobj=io.BytesIO(blob)) as tf:
            tf.extractall(tree)
    pkg = tree / "patchctl"
    spec = importlib.util.spec_from_file_location(name, pkg / "__init__.py", submodule_search_locations=[str(pkg)])
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return importlib.import_module(f"{name}.host.convert"), importlib.import_module(f"{name}.host.events")


def _cpu() -> float:
    return sum(r.ru_utime + r.ru_stime for r in (resource.getrusage(resource.RUSAGE_SELF),
                                                 resource.getrusage(resource.RUSAGE_CHILDREN)))


class Bench:
    def __init__(self, args):
        import torch

        sys.path.insert(0, str(REPO / "bench"))
        from collect_rate import machine_busy_s, write_dump

        self.torch, self.busy, self.args = torch, machine_busy_s, args
        self.base = Path(tempfile.mkdtemp(prefix="convert-rate-", dir=args.dir))
        self.state = self.base / "state"
        root = self.state / "dumps" / "captures" / "bench"
        root.mkdir(parents=True)
        payload = os.urandom(args.tokens * args.hidden * 2)  # bf16 bits (the converters copy them, never read them)
        self.items = []
        for i in range(args.dumps):
            p = root / f"s{i:05d}.safetensors"
            write_dump(p, [(i + t) % 50000 for t in range(args.tokens)], args.hidden, 3, payload)
            data = p.read_bytes()
            self.items.append({"id": f"s{i:05d}", "path": str(p), "sha256": hashlib.sha256(data).hexdigest(),
                               "bytes": len(data), "tokens": args.tokens})
        self.dump_bytes = sum(it["bytes"] for it in self.items)
        from patchctl.host import ckpt, convert, events

        self.ckpt, self.after, self.events = ckpt, convert, events
        self.before, self.before_events = load_before(args.before, args.before_tree) if "before" in args.variants \
            else (None, None)
        self.prev, self.prev_events = (None, None)
        if "prev" in args.variants and (args.prev or args.prev_tree):
            self.prev, self.prev_events = load_before(args.prev, args.prev_tree, "patchctl_prev")
        fd = os.open(self.items[0]["path"], os.O_RDONLY)
        view = ckpt.read_dump(fd, self.items[0]["bytes"])
        os.close(fd)
        # for the torch.save rows: views of this thread's read buffer (read_dump is not called here again). No
        # torch op that runs a parallel region (clone of a large tensor) before the workers fork: GNU OpenMP's
        # threads do not survive a fork, and the before converter's clones would hang in its workers
        self.sample, _T, _m = ckpt.sample_of(torch, view, None, 3)
        buf = io.BytesIO()
        torch.save(self.sample, buf)
        self.out_size = len(buf.getvalue())  # what each converted file holds (to the byte: the same tensors)
        self.digests: dict[tuple, dict] = {}  # (variant, W) -> {file: sha256} of round 0

    # the variants -------------------------------------------------------------------------------
    def convert(self, mod, out: Path, w: int) -> int:
        stdin = io.BytesIO("".join(json.dumps(it) + "\n" for it in self.items).encode())
        req = {"run": "bench", "out_dir": str(out), "host": "bench", "layers": 3, "workers": w,
               "expect": {"layers_to_capture": {"ids": [2, 30, 58], "from": "bench"}}}
        saved, sys.stderr = sys.stderr, open(os.devnull, "w")  # the op's events
        try:
            res = mod.Converter(str(self.state), req, stdin).run_all([it["id"] for it in self.items])
        finally:
            sys.stderr.close()
            sys.stderr = saved
        assert res["converted"] == len(self.items) and res["failed"] == 0, res
        return res["bytes"]

    def _pool_map(self, fn, w: int, out: Path) -> int:
        out.mkdir()
        ctx = multiprocessing.get_context("fork")
        pool = ctx.Pool(w)
        try:
            sizes = pool.map(fn, [str(out / f"{i:05d}.ckpt") for i in range(len(self.items))], chunksize=1)
        finally:
            pool.close()
            pool.join()  # reaped: their CPU is in RUSAGE_CHILDREN
        return sum(sizes)

    def run_variant(self, v: str, w: int, out: Path) -> int:
        if v == "before":
            return self.convert(self.before, out, w)
        if v == "prev":
            return self.convert(self.prev, out, w)
        if v in ("after", "inline"):
            self.ckpt.OVERLAP = v == "after"  # set before the workers fork
            try:
                return self.convert(self.after, out, w)
            finally:
                self.ckpt.OVERLAP = True
        if v == "torch.save":
            return self._pool_map(_torch_save_one, w, out)
        if v == "disk":
            return self._pool_map(_write_one, w, out)
        if v == "dd":
            out.mkdir()
            total = self.out_size * len(self.items)
            bs = 16 << 20
            subprocess.run(["dd", "if=/dev/zero", f"of={out / 'dd.bin'}", f"bs={bs}", f"count={-(-total // bs)}",
                            "conv=fsync", "status=none"], check=True)
            return (out / "dd.bin").stat().st_size
        raise ValueError(v)

    def row(self, rnd: int, v: str, w: int) -> dict:
        out = self.base / f"out-{rnd}-{v}-{w}"
        load = os.getloadavg()
        global _BENCH
        _BENCH = self  # the forked writers read it
        c0, busy0, t0 = _cpu(), self.busy(), time.perf_counter()
        written = self.run_variant(v, w, out)
        wall = time.perf_counter() - t0
        cpu, busy = _cpu() - c0, self.busy() - busy0
        if v in CONVERTERS and rnd == 0:  # compared with after's when the round is over
            files = sorted(out.rglob("*.ckpt"), key=lambda p: p.name)
            assert len(files) == len(self.items), v
            self.digests[(v, w)] = {p.name: hashlib.sha256(p.read_bytes()).hexdigest()
                                    for p in files[::self.args.check_every]}
        shutil.rmtree(out)
        r = {"round": rnd, "variant": v, "workers": 1 if v == "dd" else w, "wall_s": round(wall, 2),
             "gb_per_s": round(written / wall / 1e9, 3),
             "dump_gb_per_s": round(self.dump_bytes / wall / 1e9, 3) if v in CONVERTERS else None,
             "cpu_s_per_dump": round(cpu / len(self.items), 3), "busy_cores": round(busy / wall, 2),
             "loadavg_before": [round(x, 2) for x in load], "bytes_written": written}
        print(json.dumps(r), flush=True)
        return r

    def phases(self) -> dict:
        """One dump in this process, best of 3 each: read_dump, its sha256 alone, sample_of, torch.save through the
        hashing writer into a file (no fsync), the fsync; then the worker's path with the dump's sha256 on a
        thread of its own beside sample_of and the save (read -> saved, no fsync), and inline (one thread)."""
        out, torch, ckpt, item = self.base / "phase.ckpt", self.torch, self.ckpt, self.items[0]

        def once(overlap):
            ckpt.OVERLAP = overlap
            t = [time.perf_counter()]
            fd = os.open(item["path"], os.O_RDONLY)
            view = ckpt.read_dump(fd, item["bytes"])
            os.close(fd)
            t.append(time.perf_counter())
            hashlib.sha256(view).hexdigest()
            t.append(time.perf_counter())
            sample, _T, _m = ckpt.sample_of(torch, view, None, 3)
            t.append(time.perf_counter())
            ckpt.save(torch, sample, str(out), sync=False)
            t.append(time.perf_counter())
            ckpt.fsync_path(str(out))
            t.append(time.perf_counter())
            t0 = time.perf_counter()  # the worker's path: read, then sha256 beside sample_of + save
            fd = os.open(item["path"], os.O_RDONLY)
            view = ckpt.read_dump(fd, item["bytes"])
            os.close(fd)
            digest = ckpt.Digest(view)
            sample, _T, _m = ckpt.sample_of(torch, view, None, 3)
            ckpt.save(torch, sample, str(out), sync=False)
            digest.hexdigest()
            worker = time.perf_counter() - t0
            ckpt.fsync_path(str(out))
            return [round(b - a, 4) for a, b in zip(t, t[1:])] + [round(worker, 4)]

        res = {}
        for overlap in (False, True):
            best = min((once(overlap) for _ in range(3)), key=lambda d: d[-1])
            res["overlap" if overlap else "inline"] = dict(zip(("read", "sha256", "sample_of", "save_sha256_write",
                                                                "fsync", "worker_read_to_saved"), best))
        ckpt.OVERLAP = True
        out.unlink()
        print(json.dumps({"phases_s_per_dump": res}), flush=True)
        return res

    def close(self):
        for ev in (self.events, self.before_events, self.prev_events):
            if ev is not None:
                ev.stop_beating.set()
        shutil.rmtree(self.base, ignore_errors=True)


_BENCH: Bench | None = None


def _torch_save_one(path: str) -> int:
    b = _BENCH
    b.torch.save(b.sample, path)
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    return os.stat(path).st_size


_BLOCK: list[bytes] = []


def _write_one(path: str) -> int:
    if not _BLOCK:
        _BLOCK.append(os.urandom(_BENCH.out_size))
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        view = memoryview(_BLOCK[0])
        while view:
            view = view[os.write(fd, view):]
        os.fsync(fd)
    finally:
        os.close(fd)
    return len(_BLOCK[0])


def summary(rows: list[dict]) -> list[str]:
    """One line per worker count: the best round of each variant, GB/s written, and the ratios."""
    best: dict[tuple, dict] = {}
    for r in rows:
        k = (r["variant"], r["workers"])
        if k not in best or r["gb_per_s"] > best[k]["gb_per_s"]:
            best[k] = r
    dd = best.get(("dd", 1))
    lines = []
    for w in sorted({r["workers"] for r in rows if r["variant"] != "dd"}):
        get = lambda v: best.get((v, w))  # noqa: E731
        parts = [f"W={w:>2}"]
        for v in ("before", "prev", "after", "inline", "torch.save", "disk"):
            if get(v):
                parts.append(f"{v} {get(v)['gb_per_s']:.2f} GB/s ({get(v)['cpu_s_per_dump']:.2f} s CPU/dump)")
        if get("before") and get("after"):
            parts.append(f"after/before {get('after')['gb_per_s'] / get('before')['gb_per_s']:.2f}x")
        if get("prev") and get("after"):
            parts.append(f"after/prev {get('after')['gb_per_s'] / get('prev')['gb_per_s']:.2f}x")
        if get("after") and get("disk"):
            parts.append(f"after/disk(W) {100 * get('after')['gb_per_s'] / get('disk')['gb_per_s']:.0f}%")
        if get("after") and dd:
            parts.append(f"after/dd {100 * get('after')['gb_per_s'] / dd['gb_per_s']:.0f}%")
        lines.append(", ".join(parts))
    if dd:
        lines.append(f"dd (1 stream, conv=fsync) {dd['gb_per_s']:.2f} GB/s")
    return lines


def run(args) -> dict:
    b = Bench(args)
    rows = []
    phases = None
    try:
        if args.phases:
            phases = b.phases()
        order = [v for v in VARIANTS if v in args.variants and (v != "prev" or b.prev is not None)]
        for rnd in range(args.rounds):
            seq = order if rnd % 2 == 0 else order[::-1]
            for w in args.workers:
                for v in seq:
                    if v == "dd" and w != args.workers[0]:
                        continue
                    rows.append(b.row(rnd, v, w))
        ref = next((d for (v, _w), d in b.digests.items() if v == "after"), None)
        same = {"%s W=%d" % k: d == ref for k, d in b.digests.items()} if ref else {}
        assert all(same.values()), "a converter wrote other bytes than after's: %s" % same
    finally:
        b.close()
    res = {"mode": "convert", "dumps": args.dumps, "tokens": args.tokens, "hidden": args.hidden,
           "dump_mb": round(b.dump_bytes / len(b.items) / 1e6, 1), "ckpt_mb": round(b.out_size / 1e6, 1),
           "before": args.before, "prev": args.prev, "cores": os.cpu_count(), "torch": b.torch.__version__,
           "python": sys.version.split()[0], "dir": str(Path(args.dir or tempfile.gettempdir()).resolve()),
           "rounds": args.rounds, "phases_s_per_dump": phases, "same_bytes_as_after": same, "rows": rows, "summary": summary(rows)}
    print("\n".join(res["summary"]), flush=True)
    return res
