#!/usr/bin/env python3
"""How fast does a capture host check its dumps?  (issue 18 item 2; a benchmark, not a test)

A capture host checks every dump before it counts (`patchctl.host.capture.check_file`: the smoke's
checks and the file's sha256) in a pool of worker processes; one H200 server writes 1.6-2.0 GB/s.
This bench writes real dumps (T = 2000, H = 7168, K = 3, bf16: 115 MB each) with the hidden-dump
module itself (patch 0001 of patches/hidden-dump, driven by bench/capture_cost.py's duck-typed
batch), then checks them, side by side in one run, with

    numpy    check_file as a host runs it when numpy is importable (the default on SGLang's Python)
    stdlib   check_file with the standard-library fallback forced (dumpscan.BACKEND = "stdlib")
    old      the check before issue 18 (validate_dump over f.read() + sha256_file), kept verbatim below

each at 1, 2, 4, ... N worker processes (N = the usable cores; also the default pool size,
capture.checker_workers()), through the real pool (capture._checker_pool).  Per configuration:
the CPU seconds each check took in its worker (time.process_time, median over the checks) and the
rate (bytes checked / wall seconds, median over --runs).  The dumps are in the page cache, as they
are when a host checks what its server has just written.  Load (os.getloadavg) is printed before and
after: on a shared machine the wall rates move with it, the CPU seconds much less.

    python bench/verify_rate.py                        # 16 dumps (1.8 GB on disk), 3 runs
    python bench/verify_rate.py --dumps 4 --runs 1 --workers 1,2 --checks numpy,old   # a quick look
    python bench/verify_rate.py --dumps 2 --runs 1 --workers 1 --tokens 64 --hidden 256  # keeps it running (tests)
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import shutil
import statistics
import struct
import sys
import tempfile
import time
import types
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # a plain checkout on the GPU box (no patchctl install)
sys.path.insert(0, str(REPO / "bench"))

from patchctl.host import capture, dumpscan, smoke  # noqa: E402

T, H, K = 2000, 7168, 3
LAYERS = [3, 31, 59]  # DeepseekV2 keeps explicit ids: layers_to_capture [3, 31, 59]


# --------------------------------------------------------------------------- the check before issue 18


_EXP_HIGH = bytes(1 if b & 0x7F == 0x7F else 0 for b in range(256))
_EXP_LOW = bytes(1 if b & 0x80 else 0 for b in range(256))


def old_bf16_nonfinite(buf):
    if len(buf) % 2:
        return True
    high = bytes(buf[1::2]).translate(_EXP_HIGH)
    low = bytes(buf[0::2]).translate(_EXP_LOW)
    return (int.from_bytes(high, "little") & int.from_bytes(low, "little")) != 0


def old_validate_dump(path, sent_ids, expect, hidden):
    """hidden-dump's host check as of commit 4019c96 (smoke.validate_dump); its file parsing and layout
    steps are smoke's own, which have not changed since (but for a length check)."""
    problems = []
    try:
        with open(path, "rb") as f:
            meta, t = smoke.parse_safetensors(f.read())  # the parser of 4019c96, unchanged since but for a length check
    except Exception as e:
        return ["unreadable safetensors file: %s" % e]
    T_ = len(sent_ids)
    layers, wanted, K_, problems = smoke.dump_layout(meta, t, expect)
    if problems:
        return problems
    dt, shape, raw = t["input_ids"]
    if dt != "I64" or shape != [T_]:
        problems.append("input_ids is %s %s, expected I64 [%d]" % (dt, shape, T_))
    else:
        got = list(struct.unpack("<%dq" % T_, raw))
        if got != list(sent_ids):
            problems.append("input_ids differ from the prompt sent")
    if meta.get("prefix_len") != "0":
        problems.append("prefix_len is %r" % meta.get("prefix_len"))
    problems += smoke.check_layers(meta, expect)
    if any(len(ids) != K_ for ids in wanted):
        problems.append("%s layers captured" % K_)
    if hidden is not None and meta.get("hidden_size") not in (None, str(hidden)):
        problems.append("hidden_size %s, expected %d" % (meta.get("hidden_size"), hidden))
    dt, shape, raw = t["hidden_states"]
    if dt != "BF16" or len(shape) != 2 or shape[0] != T_ or (hidden is not None and shape[1] != hidden):
        problems.append("hidden_states is %s %s" % (dt, shape))
    elif old_bf16_nonfinite(raw):
        problems.append("hidden_states has NaN or Inf")
    H_ = hidden if hidden is not None else (shape[1] if len(shape) == 2 else None)
    dt, shape, raw = t["aux_hidden_states"]
    if K_ is None and H_:
        K_ = shape[1] // H_ if len(shape) == 2 and H_ else None
    if dt != "BF16" or len(shape) != 2 or shape[0] != T_ or not H_ or not K_ or shape[1] != K_ * H_:
        problems.append("aux_hidden_states is %s %s" % (dt, shape))
        return problems
    row = K_ * H_ * 2
    slices = []
    for k in range(K_):
        parts = [raw[r * row + k * H_ * 2: r * row + (k + 1) * H_ * 2] for r in range(T_)]
        slices.append(b"".join(parts))
    for k, s in enumerate(slices):
        if old_bf16_nonfinite(s):
            problems.append("layer %s slice has NaN or Inf" % (layers[k] if layers else k))
        if not s.strip(b"\0"):
            problems.append("layer %s slice is all zeros" % (layers[k] if layers else k))
    for a in range(K_):
        for b in range(a + 1, K_):
            if slices[a] == slices[b]:
                problems.append("layer slices %s and %s are identical" % (a, b))
    return problems


def old_check_file(path, ids, expect, hidden):
    problems = old_validate_dump(path, ids, expect, hidden)
    if problems:
        return problems, None
    with open(path, "rb") as f:
        return problems, hashlib.sha256(f.read()).hexdigest()


# --------------------------------------------------------------------------- one check in a worker


def timed_check(kind, path, ids, expect, hidden):
    """(CPU seconds in this worker, problems, sha256) of one check of `kind`."""
    t0 = time.process_time()
    if kind == "old":
        problems, digest = old_check_file(path, ids, expect, hidden)
    else:
        dumpscan.BACKEND = kind  # numpy | stdlib, in this worker process
        problems, digest = capture.check_file(path, ids, expect, hidden)
    return time.process_time() - t0, problems, digest


# --------------------------------------------------------------------------- the dumps


def write_dumps(directory: Path, n: int) -> list:
    """n dumps written by the hidden-dump module (its real writer: header, safetensors layout, fsync,
    rename); returns [(path, input_ids, sha256 of the tensors' source bytes)]."""
    import torch
    import capture_cost as cc

    workdir = Path(tempfile.mkdtemp(prefix="verify-rate-module-"))
    try:
        mod = cc.load_module(cc.materialise_module(workdir))
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    os.environ["SGLANG_HIDDEN_DUMP_DIR"] = str(directory)
    os.environ.pop("SGLANG_HIDDEN_DUMP_RID_PREFIX", None)
    mod.reset()
    runner = cc.model_runner(H, LAYERS)
    out = []
    for i in range(n):
        g = torch.Generator().manual_seed(1000 + i)
        ids = torch.randint(0, 163840, (T,), generator=g)
        aux = torch.randn(T, K * H, generator=g).to(torch.bfloat16)
        last = torch.randn(T, H, generator=g).to(torch.bfloat16)
        rid = "verify-rate-%03d" % i
        fb = cc.forward_batch([rid], [T])
        fb.input_ids = ids
        fb.hidden_dump_aborted = [False]
        mod.on_forward_end(runner, fb, types.SimpleNamespace(hidden_states=aux, last_hidden_states=last))
        out.append((str(directory / (rid + ".safetensors")), ids.tolist()))
    assert mod.flush(600), "the module did not finish writing"
    stats = mod.stats()
    mod.reset()
    assert stats["files_written"] == n and stats["errors"] == 0, stats
    return out


# --------------------------------------------------------------------------- the measurement


def measure(kind, workers, dumps, expect, runs):
    """Median rate (GB/s) over runs and median per-check CPU seconds for one configuration."""
    pool = capture._checker_pool(workers)
    assert pool is not None, "no process pool"
    rates, cpus = [], []
    try:
        checks = max(len(dumps), 3 * workers)  # every worker busy for several checks
        for _ in range(runs):
            jobs = [dumps[j % len(dumps)] for j in range(checks)]
            t0 = time.perf_counter()
            futs = [pool.submit(timed_check, kind, p, ids, expect, H) for p, ids in jobs]
            res = [f.result() for f in futs]
            wall = time.perf_counter() - t0
            for (cpu, problems, digest), (p, _ids) in zip(res, jobs):
                assert problems == [] and digest, (kind, p, problems)
                cpus.append(cpu)
            rates.append(sum(os.path.getsize(p) for p, _ in jobs) / wall / 1e9)
    finally:
        pool.shutdown()
    return {"check": kind, "workers": workers, "gb_s": round(statistics.median(rates), 3),
            "gb_s_runs": [round(r, 3) for r in rates], "cpu_s_per_dump": round(statistics.median(cpus), 4),
            "checks": len(cpus)}


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def main(argv=None) -> int:
    global T, H
    cores = capture.usable_cores()
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dumps", type=int, default=16, help="dumps written (115 MB each)")
    ap.add_argument("--runs", type=int, default=3, help="timed passes per configuration")
    ap.add_argument("--workers", default=None,
                    help="comma list (default 1,2,4,... up to the %d usable cores, and the default pool size)" % cores)
    ap.add_argument("--checks", default="numpy,stdlib,old")
    ap.add_argument("--tokens", type=int, default=T, help="T per dump (the issue's figures: 2000)")
    ap.add_argument("--hidden", type=int, default=H, help="H (the issue's figures: 7168)")
    ap.add_argument("--dir", default=None, help="where the dumps go (default: a temporary directory, removed)")
    ap.add_argument("--out", default=str(REPO / "bench" / "results" / "verify_rate.json"))
    args = ap.parse_args(argv)
    T, H = args.tokens, args.hidden

    if args.workers:
        workers = sorted({int(x) for x in args.workers.split(",")})
    else:
        workers, w = [], 1
        while w < cores:
            workers.append(w)
            w *= 2
        workers = sorted(set(workers + [cores, capture.checker_workers()]))
    checks = args.checks.split(",")
    np = dumpscan.numpy_module()
    if "numpy" in checks and np is None:
        print("numpy is not importable here: the numpy row is left out")
        checks.remove("numpy")
    base = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="verify-rate-"))
    base.mkdir(parents=True, exist_ok=True)
    expect = smoke.expected_layers(LAYERS)
    facts = {"cpu": cpu_model(), "usable_cores": cores, "default_workers": capture.checker_workers(),
             "python": platform.python_version(), "numpy": getattr(np, "__version__", None),
             "T": T, "H": H, "K": K, "dumps": args.dumps, "runs": args.runs,
             "load_before": [round(x, 2) for x in os.getloadavg()], "dir": str(base)}
    print("machine: %(cpu)s, %(usable_cores)d usable cores, Python %(python)s, numpy %(numpy)s; "
          "default checker pool %(default_workers)d" % facts)
    print("load average before: %s" % facts["load_before"])
    try:
        t0 = time.perf_counter()
        dumps = write_dumps(base, args.dumps)
        size = os.path.getsize(dumps[0][0])
        facts["dump_bytes"] = size
        facts["write_s"] = round(time.perf_counter() - t0, 1)
        print("wrote %d dumps of %.1f MB with the hidden-dump module in %.1f s" % (
            len(dumps), size / 1e6, facts["write_s"]))
        rows = []
        for w in workers:  # every check at this worker count, one after the other: side by side
            for kind in checks:
                r = measure(kind, w, dumps, expect, args.runs)
                rows.append(r)
                print("  %-6s %2d workers: %.3f s CPU per dump, %.2f GB/s (runs %s)" % (
                    kind, w, r["cpu_s_per_dump"], r["gb_s"], r["gb_s_runs"]), flush=True)
    finally:
        if not args.dir:
            shutil.rmtree(base, ignore_errors=True)
    facts["load_after"] = [round(x, 2) for x in os.getloadavg()]
    old = dict((r["workers"], r) for r in rows if r["check"] == "old")
    print()
    print("| check | workers | CPU s per %.0f MB dump | GB/s per CPU-second | GB/s (wall) | vs old (GB/s) |" % (
        facts["dump_bytes"] / 1e6))
    print("|---|---|---|---|---|---|")
    for r in rows:
        o = old.get(r["workers"])
        ratio = "%.1fx" % (r["gb_s"] / o["gb_s"]) if o and r["check"] != "old" else ""
        default = " (default)" if r["workers"] == facts["default_workers"] else ""
        r["gb_per_cpu_s"] = round(facts["dump_bytes"] / r["cpu_s_per_dump"] / 1e9, 2)
        print("| %s | %d%s | %.3f | %.2f | %.2f | %s |" % (r["check"], r["workers"], default, r["cpu_s_per_dump"],
                                                          r["gb_per_cpu_s"], r["gb_s"], ratio))
    print()
    print("%d runs per configuration; load average before %s, after %s" % (
        args.runs, facts["load_before"], facts["load_after"]))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"facts": facts, "rows": rows}, indent=1))
    print("wrote %s" % out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
