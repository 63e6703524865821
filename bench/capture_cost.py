#!/usr/bin/env python3
"""What does the hidden-dump hook cost the server's prefill?  (issue 8; a benchmark, not a test)

Materialises `sglang/srt/hidden_dump.py` by applying patch 0001 of `patches/hidden-dump`
in a temporary directory (no SGLang import), then drives its `on_forward_end` with
duck-typed batches like SGLang's, interleaved with a stand-in prefill on the same stream:

  stand-in prefill = L dense MLP pairs relu(x @ W1) @ W2 with W1 [H, F], W2 [F, H]
                     (H = 7168, F = 18432: one Kimi-sized dense MLP; L = 30 by default,
                     ~0.33 s for a 16k-token batch on one H200), then the "captured"
                     hidden states are written into STATIC output buffers (like a CUDA
                     graph's outputs) that the next batch overwrites: a hook that reads
                     them late would write corrupted files, which verification catches.
  batch            = several requests of unequal lengths summing to T (4k, 16k, 32k);
                     aux [T, K*H] and final [T, H] in bf16, input_ids int64, all drawn
                     from a seeded generator so every file can be checked bit for bit
                     against a regenerated reference without holding copies.

Phases per T, in one run: baseline (forward only), hook (forward + on_forward_end with room
in the queue), naive (forward + synchronous .cpu() + safetensors save + fsync), sustained
(back-to-back batches past the queue cap: the disk sets the rate; back-pressure).  The disk's
own rate is measured in the same run (dd-like 16 MiB writes + fsync).  Prints a markdown
table and writes JSON.

    python bench/capture_cost.py                   # CUDA, full (H200: about 3 minutes, ~35 GB free disk)
    python bench/capture_cost.py --cpu --quick     # CPU smoke run: keeps the bench from rotting
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import types
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # run from a plain checkout (the GPU box has no patchctl install)
# SGLang's ForwardMode, duck-typed, and a stub of its runtime context (attention-TP rank 0).
from patchctl.simserver.ducks import ForwardMode, install_runtime_context  # noqa: E402
PATCH = REPO / "patches" / "hidden-dump" / "0001-hidden-dump-module.patch"


# --------------------------------------------------------------------------- module


def materialise_module(workdir: Path) -> Path:
    """Apply patch 0001 (a new-file patch) in an empty dir; return the module's path."""
    workdir.mkdir(parents=True, exist_ok=True)
    target = workdir / "sglang" / "srt" / "hidden_dump.py"
    try:
        subprocess.run(["git", "apply", "-p1", str(PATCH)], cwd=workdir,
                       check=True, capture_output=True)
    except (OSError, subprocess.CalledProcessError):
        # No git on the box: the patch only adds one file, so take its '+' lines.
        lines, body = PATCH.read_text().splitlines(), False
        out = []
        for ln in lines:
            if ln.startswith("@@"):
                body = True
                continue
            if body and ln.startswith("+"):
                out.append(ln[1:])
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text("\n".join(out) + "\n")
    return target


def load_module(path: Path):
    spec = importlib.util.spec_from_file_location("hidden_dump_bench", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


# --------------------------------------------------------------------------- duck types


def model_runner(H: int, layers: list[int]):
    install_runtime_context(attn_tp_rank=0)
    return types.SimpleNamespace(
        is_draft_worker=False,
        server_args=types.SimpleNamespace(return_aux_hidden_state_layer_ids=layers),
        model_config=types.SimpleNamespace(
            num_hidden_layers=61, hidden_size=H,
            hf_config=types.SimpleNamespace(architectures=["DeepseekV3ForCausalLM"])),
        # DeepseekV2 takes explicit ids as given (set_eagle3_layers_to_capture)
        model=types.SimpleNamespace(model=types.SimpleNamespace(layers_to_capture=list(layers))),
    )


def forward_batch(rids: list[str], lens: list[int]):
    """An extend batch of whole prompts, as ForwardBatch.init_new + the series' hook leave it."""
    return types.SimpleNamespace(forward_mode=ForwardMode("EXTEND"), rids=rids, extend_seq_lens_cpu=lens,
                                 extend_prefix_lens_cpu=[0] * len(lens), hidden_dump_prompt_lens=list(lens))


def split_lengths(T: int, n: int) -> list[int]:
    """n unequal lengths summing to T (ratios 1:2:3:...)."""
    w = list(range(1, n + 1))
    lens = [T * x // sum(w) for x in w]
    lens[-1] += T - sum(lens)
    return lens


# --------------------------------------------------------------------------- workload


class StandIn:
    def __init__(self, dev, H, F, L, K, Tmax, seed=0):
        g = torch.Generator(device=dev).manual_seed(seed)
        self.dev, self.H, self.K, self.L = dev, H, K, L
        dt = torch.bfloat16
        self.W1 = (torch.randn(H, F, device=dev, generator=g, dtype=torch.float32) / H ** 0.5).to(dt)
        self.W2 = (torch.randn(F, H, device=dev, generator=g, dtype=torch.float32) / F ** 0.5).to(dt)
        # static output buffers, overwritten by every batch (like CUDA-graph outputs)
        self.aux_buf = torch.empty(Tmax, K * H, device=dev, dtype=dt)
        self.last_buf = torch.empty(Tmax, H, device=dev, dtype=dt)
        self.ids_buf = torch.empty(Tmax, device=dev, dtype=torch.int64)

    def prefill(self, T: int, layers: int | None = None):
        x = torch.randn(T, self.H, device=self.dev, dtype=torch.bfloat16)
        for _ in range(self.L if layers is None else layers):
            x = torch.relu(x @ self.W1) @ self.W2
            x = x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6).to(x.dtype)
        return x

    def outputs(self, T: int, seed: int):
        """The batch's 'captured' tensors, written into the static buffers."""
        aux, last, ids = reference(self.dev, T, self.H, self.K, seed)
        self.aux_buf[:T].copy_(aux)
        self.last_buf[:T].copy_(last)
        self.ids_buf[:T].copy_(ids)
        return self.aux_buf[:T], self.last_buf[:T], self.ids_buf[:T]


def reference(dev, T, H, K, seed):
    g = torch.Generator(device=dev).manual_seed(seed)
    aux = torch.randn(T, K * H, device=dev, generator=g, dtype=torch.float32).to(torch.bfloat16)
    last = torch.randn(T, H, device=dev, generator=g, dtype=torch.float32).to(torch.bfloat16)
    ids = torch.randint(0, 163840, (T,), device=dev, generator=g, dtype=torch.int64)
    return aux, last, ids


# --------------------------------------------------------------------------- measuring


class Timer:
    """Forward-stream time of one batch: events around it, or wall time on CPU."""

    def __init__(self, cuda: bool):
        self.cuda = cuda

    def start(self):
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            return e
        return time.perf_counter()

    def stop(self, s) -> float:
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            e.synchronize()  # a real scheduler syncs every batch (sampled tokens to host)
            return s.elapsed_time(e)
        return (time.perf_counter() - s) * 1e3


def disk_rate(path: Path, nbytes: int, chunk: int = 16 << 20) -> float:
    """dd-like: sequential writes of `chunk` bytes then fsync; GB/s."""
    buf = os.urandom(chunk)
    f = path / ".ddtest"
    t0 = time.perf_counter()
    fd = os.open(f, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    left = nbytes
    while left > 0:
        left -= os.write(fd, buf[: min(chunk, left)])
    os.fsync(fd)
    os.close(fd)
    dt = time.perf_counter() - t0
    os.unlink(f)
    return nbytes / dt / 1e9


def verify(hd_dir: Path, expected: dict, dev, H, K) -> dict:
    """Every expected file present and equal bit for bit; no temporary leftovers."""
    from safetensors import safe_open

    bad, ok = [], 0
    names = set(os.listdir(hd_dir))
    leftovers = [n for n in names if n.endswith(".tmp")]
    for fname, (rid, seed, start, T, Tb) in expected.items():
        p = hd_dir / fname
        if fname not in names:
            bad.append((fname, "missing"))
            continue
        aux, last, ids = reference(dev, Tb, H, K, seed)
        try:
            with safe_open(str(p), "pt", device="cpu") as f:
                meta = f.metadata()
                ga, gl, gi = (f.get_tensor("aux_hidden_states"), f.get_tensor("hidden_states"),
                              f.get_tensor("input_ids"))
            good = (meta["rid"] == rid and int(meta["num_tokens"]) == T
                    and torch.equal(ga.to(dev), aux[start:start + T])
                    and torch.equal(gl.to(dev), last[start:start + T])
                    and torch.equal(gi.to(dev), ids[start:start + T]))
        except Exception as e:  # unreadable = corrupted
            good = False
            bad.append((fname, repr(e)))
            continue
        if good:
            ok += 1
        else:
            bad.append((fname, "content differs"))
    return {"verified": ok, "corrupted": len(bad), "bad": bad[:5], "tmp_leftovers": len(leftovers),
            "unexpected": len([n for n in names if n.endswith(".safetensors") and n not in expected])}


def clean(d: Path):
    for n in os.listdir(d):
        if n.endswith(".safetensors") or n.endswith(".tmp"):
            os.unlink(d / n)


def naive_dump(d: Path, rids, lens, aux, last, ids):
    """What the hand patch did: synchronous pageable .cpu() and a blocking save."""
    from safetensors.torch import save_file

    off = 0
    for rid, T in zip(rids, lens):
        t = {"input_ids": ids[off:off + T].cpu(), "aux_hidden_states": aux[off:off + T].cpu(),
             "hidden_states": last[off:off + T].cpu()}
        off += T
        p = d / f"naive-{rid}.safetensors"
        save_file(t, str(p), metadata={"rid": rid})
        fd = os.open(p, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)


# --------------------------------------------------------------------------- main


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cpu", action="store_true", help="run on CPU (tiny shapes with --quick)")
    ap.add_argument("--quick", action="store_true", help="tiny sizes, few batches")
    ap.add_argument("--sizes", default=None, help="tokens per batch, e.g. 4096,16384,32768")
    ap.add_argument("--hidden", type=int, default=None)
    ap.add_argument("--ffn", type=int, default=None)
    ap.add_argument("--layers", type=int, default=None, help="stand-in MLP pairs per prefill")
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--requests", type=int, default=4, help="requests per batch")
    ap.add_argument("--batches", type=int, default=None, help="timed batches per phase")
    ap.add_argument("--sustained-gb", type=float, default=None, help="GB per sustained phase")
    ap.add_argument("--sustained-layers", type=int, default=4,
                    help="MLP pairs of the (disk-bound) sustained phase's light prefill")
    ap.add_argument("--host-cap", type=float, default=None, help="GiB; hook's host queue cap")
    ap.add_argument("--gpu-cap", type=float, default=None, help="GiB; hook's GPU snapshot cap")
    ap.add_argument("--dir", default=None, help="dump directory (local disk)")
    ap.add_argument("--json", default=None, help="write results here")
    a = ap.parse_args(argv)

    cuda = not a.cpu
    if cuda and not torch.cuda.is_available():
        print("no CUDA device: use --cpu --quick", file=sys.stderr)
        return 2
    dev = torch.device("cuda" if cuda else "cpu")
    quick = a.quick or a.cpu
    sizes = [int(s) for s in (a.sizes or ("256,512" if quick else "4096,16384,32768")).split(",")]
    H = a.hidden or (64 if quick else 7168)
    F = a.ffn or (4 * H if quick else 18432)
    L = a.layers or (2 if quick else 30)
    K = a.k
    nb = a.batches or (3 if quick else 8)
    sustained = a.sustained_gb if a.sustained_gb is not None else (0.02 if quick else 30.0)
    host_cap = int((a.host_cap if a.host_cap is not None else (0.004 if quick else 8.0)) * (1 << 30))
    gpu_cap = int((a.gpu_cap if a.gpu_cap is not None else (0.004 if quick else 2.0)) * (1 << 30))
    layers = [2, 30, 58][:K] if K == 3 else list(range(2, 2 + K))

    work = Path(tempfile.mkdtemp(prefix="capture_cost_"))
    dump = Path(a.dir) if a.dir else work / "dumps"
    dump.mkdir(parents=True, exist_ok=True)
    clean(dump)
    os.environ["SGLANG_HIDDEN_DUMP_DIR"] = str(dump)
    os.environ["SGLANG_HIDDEN_DUMP_MAX_QUEUE_BYTES"] = str(host_cap)
    os.environ["SGLANG_HIDDEN_DUMP_MAX_GPU_BYTES"] = str(gpu_cap)
    os.environ["SGLANG_HIDDEN_DUMP_ON_FULL"] = "block"
    os.environ.pop("SGLANG_HIDDEN_DUMP_RID_PREFIX", None)
    hd = load_module(materialise_module(work / "tree"))
    mr = model_runner(H, layers)
    timer = Timer(cuda)
    res = {
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "torch": torch.__version__, "H": H, "F": F, "L": L, "K": K,
        "requests_per_batch": a.requests, "batches_per_phase": nb,
        "host_cap_bytes": host_cap, "gpu_cap_bytes": gpu_cap, "dump_dir": str(dump),
        "free_disk_gb": shutil.disk_usage(dump).free / 1e9, "sizes": {},
    }
    print(f"# capture cost on {res['device']}: H={H} K={K} stand-in {L}x MLP[{H}x{F}] "
          f"host cap {host_cap / 2**30:.2f} GiB, GPU cap {gpu_cap / 2**30:.2f} GiB, dir {dump}",
          flush=True)
    dd_bytes = int(0.064e9 if quick else 4e9)
    res["disk_rate_gbps_before"] = max(disk_rate(dump, dd_bytes), disk_rate(dump, dd_bytes))
    print(f"disk (dd-like, {dd_bytes / 1e9:.1f} GB + fsync): {res['disk_rate_gbps_before']:.2f} GB/s",
          flush=True)

    Tmax = max(sizes)
    w = StandIn(dev, H, F, L, K, Tmax)
    seed = 1000
    total_corrupt = 0
    for T in sizes:
        lens = split_lengths(T, a.requests)
        r = {"lens": lens}
        bytes_per_batch = T * (8 + 2 * K * H + 2 * H)
        r["bytes_per_batch"] = bytes_per_batch
        # warm-up (kernels, allocator, the module's threads and pinned pool)
        for _ in range(2):
            w.prefill(T)
        if cuda:
            torch.cuda.synchronize()

        def batch(kind, tag, i, expected, layers=None):
            nonlocal seed
            seed += 1
            rids = [f"{tag}-T{T}-b{i}-r{j}" for j in range(len(lens))]
            fb = forward_batch(rids, lens)
            s = timer.start()
            w.prefill(T, layers)
            aux, last, ids = w.outputs(T, seed)
            fb.input_ids = ids
            hook_cpu, hs = 0.0, None
            if kind == "hook":
                lo = types.SimpleNamespace(hidden_states=aux, last_hidden_states=last)
                hs = timer.start() if cuda else None
                c0 = time.perf_counter()
                hd.on_forward_end(mr, fb, lo)
                hook_cpu = (time.perf_counter() - c0) * 1e3
                if cuda:
                    he = torch.cuda.Event(enable_timing=True)
                    he.record()
                off = 0
                for rid, n in zip(rids, lens):
                    expected[hd.file_name(rid)] = (rid, seed, off, n, T)
                    off += n
            elif kind == "naive":
                naive_dump(dump, rids, lens, aux, last, ids)
            ms = timer.stop(s)
            hook_stream = hs.elapsed_time(he) if hs is not None else hook_cpu
            return ms, hook_cpu, hook_stream

        # baseline
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        base = [batch("none", "base", i, None)[0] for i in range(nb)]
        base_peak = torch.cuda.max_memory_allocated() if cuda else 0
        # hook: cold start (fresh writer, pinned pool grows), then warm with room in the
        # queue (not disk-bound): the cost the forward pays per batch
        hd.reset()
        exp: dict = {}
        cold = [batch("hook", "cold", i, exp) for i in range(2)]
        hd.flush(600)
        vc = verify(dump, exp, dev, H, K)
        clean(dump)
        hd.reset_stats()
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        exp = {}
        n_hook = max(1, min(nb, int(host_cap // bytes_per_batch)))
        t0 = time.perf_counter()
        hk = [batch("hook", "hook", i, exp) for i in range(n_hook)]
        t_enq = time.perf_counter() - t0
        hd.flush(600)
        t_all = time.perf_counter() - t0
        st = hd.stats()
        if cuda:
            r["gpu_extra_peak_bytes"] = torch.cuda.max_memory_allocated() - base_peak
        v = verify(dump, exp, dev, H, K)
        v["verified"] += vc["verified"]
        v["corrupted"] += vc["corrupted"]
        v["tmp_leftovers"] += vc["tmp_leftovers"]
        clean(dump)
        r["baseline_ms"] = base
        r["cold_hook_ms"] = [x[0] for x in cold]
        r["cold_hook_cpu_ms"] = [x[1] for x in cold]
        r["hook_ms"] = [x[0] for x in hk]
        r["hook_cpu_ms"] = [x[1] for x in hk]
        r["hook_stream_ms"] = [x[2] for x in hk]
        r["hook_phase"] = {"batches": n_hook, "enqueue_s": t_enq, "drained_s": t_all,
                           "stats": st, "verify": v}
        # naive (synchronous .cpu() + write) — a few batches suffice, it is slow
        nv = [batch("naive", "naive", i, None)[0] for i in range(max(1, min(3, nb)))]
        clean(dump)
        r["naive_ms"] = nv
        # sustained: back-to-back past the cap; the disk sets the rate (back-pressure)
        hd.reset_stats()
        exp = {}
        n_sus = max(2, int(sustained * 1e9 // bytes_per_batch))
        t0 = time.perf_counter()
        # a light prefill (L_sus MLP pairs) produces far faster than the disk writes
        sus = [batch("hook", "sus", i, exp, layers=a.sustained_layers) for i in range(n_sus)]
        hd.flush(600)
        dt = time.perf_counter() - t0
        st2 = hd.stats()
        v2 = verify(dump, exp, dev, H, K)
        clean(dump)
        r["sustained"] = {
            "batches": n_sus, "seconds": dt, "files": st2["files_written"],
            "bytes": st2["bytes_written"], "files_per_s": st2["files_written"] / dt,
            "gbps": st2["bytes_written"] / dt / 1e9, "forward_ms": [x[0] for x in sus],
            "produced_gbps": n_sus * bytes_per_batch / 1e9 / max(1e-9, sum(x[0] for x in sus) / 1e3),
            "layers": a.sustained_layers,
            "stats": st2, "verify": v2,
            "blocked_fraction": st2["blocked_seconds"] / dt,
        }
        total_corrupt += v["corrupted"] + v2["corrupted"] + v["tmp_leftovers"] + v2["tmp_leftovers"]
        b, h = statistics.median(base), statistics.median(r["hook_ms"])
        r["summary"] = {
            "baseline_ms": b, "hook_ms": h, "added_ms": h - b, "added_pct": 100 * (h - b) / b,
            "naive_ms": statistics.median(nv), "naive_added_pct": 100 * (statistics.median(nv) - b) / b,
            "hook_cpu_ms": statistics.median(r["hook_cpu_ms"]),
            "hook_stream_ms": statistics.median(r["hook_stream_ms"]),
            "hook_stream_pct": 100 * statistics.median(r["hook_stream_ms"]) / b,
            "baseline_spread_pct": 100 * (max(base) - min(base)) / b,
            "cold_first_ms": r["cold_hook_ms"][0],
        }
        res["sizes"][str(T)] = r
        print(f"T={T}: cold first batch {r['cold_hook_ms'][0]:.1f} ms (hook CPU "
              f"{r['cold_hook_cpu_ms'][0]:.1f} ms); hook on stream {r['summary']['hook_stream_ms']:.2f} ms",
              flush=True)
        print(f"T={T}: base {b:.1f} ms, hook {h:.1f} ms ({r['summary']['added_pct']:+.2f}%), naive "
              f"{r['summary']['naive_ms']:.1f} ms; sustained {r['sustained']['gbps']:.2f} GB/s; "
              f"verified {v['verified']}+{v2['verified']}, corrupted {v['corrupted'] + v2['corrupted']}",
              flush=True)
        hd.reset()

    # ---- edge paths on the device: a request larger than the GPU budget (copied on the
    # forward stream), and the drop policy under a small host cap
    edge = {}
    T = sizes[0]
    lens = split_lengths(T, a.requests)

    def run_batches(tag, n, layers=None):
        nonlocal seed
        exp, ms = {}, []
        for i in range(n):
            seed += 1
            rids = [f"{tag}-T{T}-b{i}-r{j}" for j in range(len(lens))]
            fb = forward_batch(rids, lens)
            s0 = timer.start()
            w.prefill(T, layers)
            aux, last, ids = w.outputs(T, seed)
            fb.input_ids = ids
            hd.on_forward_end(mr, fb, types.SimpleNamespace(hidden_states=aux, last_hidden_states=last))
            ms.append(timer.stop(s0))
            off = 0
            for rid, n_ in zip(rids, lens):
                exp[hd.file_name(rid)] = (rid, seed, off, n_, T)
                off += n_
        hd.flush(600)
        return exp, ms

    small = max(lens) * (8 + 2 * K * H + 2 * H) // 2  # below the largest request
    os.environ["SGLANG_HIDDEN_DUMP_MAX_GPU_BYTES"] = str(small)
    hd.reset()
    exp, ms = run_batches("direct", 3)
    st = hd.stats()
    edge["direct"] = {"gpu_cap": small, "stats": st, "forward_ms": ms,
                      "verify": verify(dump, exp, dev, H, K)}
    clean(dump)
    os.environ["SGLANG_HIDDEN_DUMP_MAX_GPU_BYTES"] = str(gpu_cap)
    os.environ["SGLANG_HIDDEN_DUMP_ON_FULL"] = "drop"
    os.environ["SGLANG_HIDDEN_DUMP_MAX_QUEUE_BYTES"] = str(max(1, host_cap // 16))
    hd.reset()
    T = sizes[1] if len(sizes) > 1 else sizes[0]
    lens = split_lengths(T, a.requests)
    exp, ms = run_batches("drop", 12, layers=a.sustained_layers)
    st = hd.stats()
    present = {k: v for k, v in exp.items() if (dump / k).exists()}
    vd = verify(dump, present, dev, H, K)
    vd["missing_equals_dropped"] = len(exp) - len(present) == st["dropped"]
    edge["drop"] = {"host_cap": host_cap // 16, "stats": st, "forward_ms": ms, "verify": vd}
    clean(dump)
    os.environ["SGLANG_HIDDEN_DUMP_ON_FULL"] = "block"
    os.environ["SGLANG_HIDDEN_DUMP_MAX_QUEUE_BYTES"] = str(host_cap)
    hd.reset()
    res["edge"] = edge
    for k, e in edge.items():
        total_corrupt += e["verify"]["corrupted"] + e["verify"]["tmp_leftovers"]
    print(f"edge: direct (GPU cap {small / 2**20:.0f} MiB < request): {edge['direct']['stats']['direct_copies']} "
          f"direct copies, verified {edge['direct']['verify']['verified']}, corrupted "
          f"{edge['direct']['verify']['corrupted']}; drop (host cap {host_cap / 16 / 2**30:.2f} GiB): "
          f"{edge['drop']['stats']['files_written']} written, {edge['drop']['stats']['dropped']} dropped "
          f"(missing == dropped: {vd['missing_equals_dropped']}), host peak "
          f"{edge['drop']['stats']['host_bytes_peak'] / 2**30:.2f} GiB, verified {vd['verified']}, "
          f"corrupted {vd['corrupted']}; forward ms median {statistics.median(ms):.1f}", flush=True)

    res["disk_rate_gbps_after"] = disk_rate(dump, dd_bytes)
    # compare against the best the disk showed in this run (the stricter choice)
    disk = max(res["disk_rate_gbps_before"], res["disk_rate_gbps_after"])
    res["disk_rate_gbps"] = disk
    res["corrupted_total"] = total_corrupt

    # ---- table
    rows = ["| T tokens | MB/batch | prefill ms (spread) | + hook ms (%) | hook on stream ms (%) "
            "| hook CPU ms | naive ms (+%) | sustained GB/s (% of disk) [produced] | files/s | blocked % "
            "| peak host / cap GiB | peak GPU / cap GiB | pinned GiB | extra GPU GiB | files ok / bad |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for T, r in res["sizes"].items():
        s, su = r["summary"], r["sustained"]
        st = su["stats"]
        hp = max(st["host_bytes_peak"], r["hook_phase"]["stats"]["host_bytes_peak"])
        gp = max(st["gpu_bytes_peak"], r["hook_phase"]["stats"]["gpu_bytes_peak"])
        pin = max(st["pinned_bytes"], r["hook_phase"]["stats"]["pinned_bytes"])
        ok = r["hook_phase"]["verify"]["verified"] + su["verify"]["verified"]
        badn = r["hook_phase"]["verify"]["corrupted"] + su["verify"]["corrupted"]
        rows.append(
            f"| {T} | {r['bytes_per_batch'] / 1e6:.0f} | {s['baseline_ms']:.1f} "
            f"(±{s['baseline_spread_pct'] / 2:.1f}%) | "
            f"{s['added_ms']:+.2f} ({s['added_pct']:+.2f}%) | {s['hook_stream_ms']:.2f} "
            f"({s['hook_stream_pct']:.2f}%) | {s['hook_cpu_ms']:.2f} | "
            f"{s['naive_ms']:.0f} ({s['naive_added_pct']:+.0f}%) | {su['gbps']:.2f} "
            f"({100 * su['gbps'] / disk:.0f}%) [{su['produced_gbps']:.1f}] | {su['files_per_s']:.1f} | "
            f"{100 * su['blocked_fraction']:.0f} | "
            f"{hp / 2**30:.2f} / {host_cap / 2**30:.2f} | {gp / 2**30:.2f} / {gpu_cap / 2**30:.2f} | "
            f"{pin / 2**30:.2f} | {r.get('gpu_extra_peak_bytes', 0) / 2**30:.2f} | {ok} / {badn} |")
    table = "\n".join(rows)
    res["table"] = table
    print()
    print(f"disk rate (dd-like, same run): {res['disk_rate_gbps_before']:.2f} / "
          f"{res['disk_rate_gbps_after']:.2f} GB/s (before / after)")
    print(table)
    out = Path(a.json) if a.json else (REPO / "bench" / "results" / "capture_cost.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=1, default=str))
    print(f"\nJSON: {out}")
    shutil.rmtree(work, ignore_errors=True)
    return 1 if total_corrupt else 0


if __name__ == "__main__":
    sys.exit(main())
