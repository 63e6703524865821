#!/usr/bin/env python3
"""Extraction-run benchmark (issue 14): `patchctl capture run` against a plain local client, same servers.

    python bench/capture_run.py [--hosts 3] [--samples 600] [--in-flight 8] [--rounds 3] [--out FILE]

Stands up N real sshd hosts on 127.0.1.2.. (tests/sshhosts.py), each with its own SGLang 0.5.23 tree and
stand-in server (full mode: torch, the patched tree's own hidden_dump module writing real files), and
deploys the hidden-dump series with `patchctl apply` (smoke verified). Then, alternating for R rounds on
the same servers with fresh sample ids each time (same lengths, same token counts):

  plain    a local client at saturation: --in-flight requests per server in flight (threads), each
           POST /generate with a dumping rid, done when its file has landed (what a hand-written
           requests + thread-pool script does, minus any verification)
  patchctl `patchctl capture run` (routing over the hosts' SSH connections, every dump validated,
           moved and hashed on its host, the journal on the controller)

Reports per round: samples/s and tokens/s of each, their ratio (patchctl / plain), controller CPU
(RUSAGE_CHILDREN of the patchctl process) per 1000 samples; and the resume cost: a capture killed
(SIGKILL) half way and run again, the second invocation's wall time against what its remaining samples
take at the measured rate, plus the fixed cost of a resume that has nothing left to send.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))

from fleet import Fleet, wait_for  # noqa: E402

from patchctl.core.release import fetch_release  # noqa: E402


def make_dataset(path: Path, n: int, tag: str, seed: int = 7) -> list[tuple[str, list[int]]]:
    """n samples of 64-256 tokens (the same lengths for every tag: the same work each round)."""
    r = random.Random(seed)
    rows = [(f"{tag}-{i:06d}", [r.randrange(10, 500) for _ in range(r.randrange(64, 257))]) for i in range(n)]
    with open(path, "w") as fh:
        for sid, ids in rows:
            fh.write(json.dumps({"id": sid, "input_ids": ids}) + "\n")
    return rows


def machine_busy_s() -> float:
    """CPU seconds spent by the whole machine so far (every process, /proc/stat: all but idle and iowait)."""
    with open("/proc/stat") as fh:
        v = [int(x) for x in fh.readline().split()[1:]]
    return (sum(v) - v[3] - v[4]) / os.sysconf("SC_CLK_TCK")


def plain_client(f: Fleet, rows, in_flight: int) -> float:
    """Saturate every server directly; return the wall time until every dump file exists."""
    work = list(rows)
    lock = threading.Lock()
    per_host = {h.name: 0 for h in f.hosts}

    def worker(h):
        while True:
            with lock:
                if not work:
                    return
                sid, ids = work.pop()
            rid = f"patchctl-plain-{sid}"
            body = json.dumps({"rid": rid, "input_ids": ids,
                               "sampling_params": {"max_new_tokens": 1, "temperature": 0}}).encode()
            req = urllib.request.Request(f"http://127.0.0.1:{h.server_port}/generate", data=body,
                                         headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=600) as resp:
                resp.read()
            path = h.dumps / f"{rid}.safetensors"
            while not path.exists():
                time.sleep(0.005)
            with lock:
                per_host[h.name] += 1

    threads = [threading.Thread(target=worker, args=(h,)) for h in f.hosts for _ in range(in_flight)]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.monotonic() - t0
    for h in f.hosts:  # the plain client's files are its own: clear them so disks do not fill over rounds
        for p in h.dumps.glob("patchctl-plain-*.safetensors"):
            p.unlink()
    return wall


def capture(f: Fleet, dataset: Path, name: str, in_flight: int, kill_after: int | None = None) -> dict:
    cmd = f.cmd("capture", "run", str(dataset), "--name", name, "--in-flight", str(in_flight), "--keep-free", "0")
    env = dict(os.environ, XDG_STATE_HOME=str(f.base / "xdg-state"))
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
    err: list[str] = []
    reader = threading.Thread(target=lambda: err.append(proc.stderr.read()), daemon=True)
    reader.start()
    if kill_after is not None:
        journal = f.base / "xdg-state" / "patchctl" / "captures" / name / "journal.jsonl"
        wait_for(lambda: journal.exists() and journal.read_text().count('"rec":"done"') >= kill_after, 600,
                 what="half the samples done")
        proc.send_signal(signal.SIGKILL)
    # the controller's own CPU, from its own rusage (RUSAGE_CHILDREN would also count servers reaped meanwhile)
    _, status, ru = os.wait4(proc.pid, 0)
    wall = time.monotonic() - t0
    proc.returncode = os.waitstatus_to_exitcode(status)
    reader.join(10)
    if kill_after is None and proc.returncode != 0:
        raise SystemExit(f"capture run failed (exit {proc.returncode}):\n{''.join(err)[-3000:]}")
    return {"wall": wall, "cpu": ru.ru_utime + ru.ru_stime, "exit": proc.returncode}


def clear_captures(f: Fleet, name: str) -> None:
    for h in f.hosts:
        d = h.dumps / "captures" / name
        if d.is_dir():
            for p in d.rglob("*.safetensors"):
                p.unlink()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hosts", type=int, default=3)
    ap.add_argument("--samples", type=int, default=600)
    ap.add_argument("--in-flight", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "capture_run.json")
    a = ap.parse_args()

    tree = fetch_release("0.5.23")
    base = Path(tempfile.mkdtemp(prefix="capture-bench-"))
    f = Fleet(base, a.hosts, tree)
    results = {"hosts": a.hosts, "samples": a.samples, "in_flight": a.in_flight, "rounds": [],
               "cores": os.cpu_count(), "load_before": os.getloadavg()}
    try:
        f.start_servers()
        p = f.patchctl("apply", "hidden-dump")
        if p.returncode != 0:
            raise SystemExit(p.stderr)
        for r in range(a.rounds):
            rows = make_dataset(base / f"plain{r}.jsonl", a.samples, f"p{r}")
            tokens = sum(len(ids) for _, ids in rows)
            b0 = machine_busy_s()
            plain = plain_client(f, rows, a.in_flight)
            b1 = machine_busy_s()
            make_dataset(base / f"cap{r}.jsonl", a.samples, f"c{r}")
            b2 = machine_busy_s()
            cap = capture(f, base / f"cap{r}.jsonl", f"bench{r}", a.in_flight)
            b3 = machine_busy_s()
            clear_captures(f, f"bench{r}")
            row = {"plain_s": round(plain, 2), "capture_s": round(cap["wall"], 2),
                   "plain_samples_per_s": round(a.samples / plain, 1), "capture_samples_per_s": round(a.samples / cap["wall"], 1),
                   "plain_tokens_per_s": round(tokens / plain), "capture_tokens_per_s": round(tokens / cap["wall"]),
                   "ratio": round(plain / cap["wall"], 3), "controller_cpu_s": round(cap["cpu"], 2),
                   "controller_cpu_ms_per_1000": round(cap["cpu"] / a.samples * 1e6, 0),
                   "machine_cpu_ms_per_sample_plain": round((b1 - b0) / a.samples * 1e3, 1),
                   "machine_cpu_ms_per_sample_capture": round((b3 - b2) / a.samples * 1e3, 1)}
            results["rounds"].append(row)
            print(f"round {r + 1}: plain {row['plain_samples_per_s']}/s, capture {row['capture_samples_per_s']}/s, "
                  f"ratio {row['ratio']}, controller CPU {row['controller_cpu_s']} s", flush=True)
        # resume: killed half way, run again; and a resume with nothing left
        make_dataset(base / "resume.jsonl", a.samples, "r")
        first = capture(f, base / "resume.jsonl", "resume", a.in_flight, kill_after=a.samples // 2)
        second = capture(f, base / "resume.jsonl", "resume", a.in_flight)
        journal = (base / "xdg-state" / "patchctl" / "captures" / "resume" / "journal.jsonl").read_text().splitlines()
        starts = [i for i, l in enumerate(journal) if '"event":"start"' in l]
        sent_second = sum(1 for l in journal[starts[-1]:] if '"rec":"sent"' in l)
        rate = statistics.median(x["capture_samples_per_s"] for x in results["rounds"])
        noop = capture(f, base / "resume.jsonl", "resume", a.in_flight)
        results["resume"] = {"killed_after_s": round(first["wall"], 2), "resumed_s": round(second["wall"], 2),
                             "sent_again": sent_second, "expected_s_at_rate": round(sent_second / rate, 2),
                             "overhead_s": round(second["wall"] - sent_second / rate, 2),
                             "noop_resume_s": round(noop["wall"], 2), "noop_resume_cpu_s": round(noop["cpu"], 2)}
        results["load_after"] = os.getloadavg()
    finally:
        f.close()
    ratios = [x["ratio"] for x in results["rounds"]]
    results["ratio_median"] = statistics.median(ratios)
    results["controller_cpu_ms_per_1000_median"] = statistics.median(x["controller_cpu_ms_per_1000"] for x in results["rounds"])
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(results, indent=2))
    print()
    print("| round | plain samples/s | capture samples/s | capture / plain | controller CPU per 1000 samples "
          "| machine CPU per sample: plain / capture |")
    print("|---|---|---|---|---|---|")
    for i, x in enumerate(results["rounds"], 1):
        print(f"| {i} | {x['plain_samples_per_s']} | {x['capture_samples_per_s']} | {x['ratio']:.3f} | "
              f"{x['controller_cpu_ms_per_1000'] / 1000:.2f} s | {x['machine_cpu_ms_per_sample_plain']} / "
              f"{x['machine_cpu_ms_per_sample_capture']} ms |")
    rs = results["resume"]
    print(f"\nmedian capture / plain: {results['ratio_median']:.3f} (goal >= 0.95) over {len(ratios)} rounds; "
          f"{a.hosts} hosts, {a.samples} samples of 64-256 tokens, {a.in_flight} in flight per server, "
          f"{results['cores']} cores, load {results['load_before'][0]:.1f} before")
    print(f"resume after SIGKILL at half: {rs['sent_again']} samples sent again in {rs['resumed_s']} s "
          f"({rs['expected_s_at_rate']} s at the measured rate: overhead {rs['overhead_s']} s); "
          f"a resume with nothing left: {rs['noop_resume_s']} s, {rs['noop_resume_cpu_s']} s CPU")
    print(f"written: {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
