#!/usr/bin/env python3
"""Drafter transfer benchmark (issue 28 item 1): a ~1 GB draft directory sent as a content-addressed artifact
(`patchctl.core.artifact`) to 1 host and to N hosts at once, over real sshd on loopback (tests/sshhosts.py).

    python bench/drafter_transfer.py [--mb 1024] [--hosts 4] [--rounds 2] [--profile]

Writes a draft directory once (config.json, a small tokenizer file, one --mb MiB weights file of random
bytes) into a temp dir, starts --hosts sshd hosts on 127.0.1.2.., then per round, for 1 host and for N
hosts: wipes the hosts' drafters/, sends (`send_all`), and sends again (0 bytes: the probe only). Reported:
wall, MB/s per host (its bytes / its own send's seconds) and aggregate (all bytes / wall), the controller's
CPU seconds per GB sent (getrusage of this process, every thread: paramiko's encryption and packetizing run
in the threads that feed each channel), the hosts' CPU per GB (sshd + agent: each test sshd listener's
children's CPU once their sessions ended), and the second send's wall. Also the load (os.getloadavg) before
each measurement: the machine may be shared. `--profile`: the feeding threads' top functions (cProfile) of
one N-host send, to say where the controller's time goes.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import resource
import shutil
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))

from sshhosts import _children, inventory_toml, known_hosts_for, start_hosts, stop_hosts  # noqa: E402

from patchctl.core import artifact as A  # noqa: E402
from patchctl.core.console import App  # noqa: E402
from patchctl.core.options import RunOptions  # noqa: E402
from patchctl.core.session import Run  # noqa: E402


def cpu_self() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def children_cpu(pid: int) -> float:
    """CPU seconds of a process's reaped descendants (cutime + cstime): an sshd listener's sessions and agents."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[13]) + int(fields[14])) / os.sysconf("SC_CLK_TCK")


def sessions_ended(hosts, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while any(_children(h.proc.pid) for h in hosts):
        if time.monotonic() > deadline:
            raise RuntimeError("test sshd sessions did not end")
        time.sleep(0.05)  # polling the process table, not synchronisation


def write_draft(d: Path, mb: int) -> None:
    d.mkdir(parents=True)
    (d / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLMEagle3"], "hidden_size": 4096,
                                               "num_hidden_layers": 1, "vocab_size": 128256}))
    (d / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 8192}))
    with open(d / "model.safetensors", "wb") as f:
        left = mb << 20
        while left:
            n = min(left, 64 << 20)
            f.write(os.urandom(n))
            left -= n


class _Profiled(A._Stream):
    """The stream, with a cProfile of the thread that feeds it (the transport's feeding thread)."""

    profiles: list = []

    def __iter__(self):
        prof = cProfile.Profile()
        prof.enable()
        try:
            yield from super().__iter__()
        finally:
            prof.disable()
            _Profiled.profiles.append(prof)


def one_send(inv: Path, hosts, art, limit: str, profile: bool = False) -> dict:
    """send_all to `limit`'s hosts in a fresh Run (own connections), measured until every session ended."""
    load = os.getloadavg()[0]
    host_cpu0 = sum(children_cpu(h.proc.pid) for h in hosts)
    cpu0, t0 = cpu_self(), time.monotonic()
    run = Run(App(patches_dir=inv.parent, inventory_path=inv), RunOptions(limit=limit), "bench")
    if profile:
        A._Stream, real = _Profiled, A._Stream
    try:
        res = A.send_all(run, art, keep_free=0, progress_every=3600)
    finally:
        if profile:
            A._Stream = real
        run.close()
    wall = time.monotonic() - t0
    cpu = cpu_self() - cpu0
    sessions_ended(hosts)
    host_cpu = sum(children_cpu(h.proc.pid) for h in hosts) - host_cpu0
    bad = {k: v for k, v in res.items() if isinstance(v, Exception)}
    if bad:
        raise RuntimeError(f"send failed: {bad}")
    sent = sum(r["bytes_sent"] for r in res.values())
    return {"load": load, "wall": wall, "cpu": cpu, "host_cpu": host_cpu, "sent": sent, "hosts": len(res),
            "per_host_mbs": [r["bytes_sent"] / r["seconds"] / 1e6 for r in res.values()],
            "seconds": [r["seconds"] for r in res.values()]}


SINK = ("import fcntl, sys\nb = sys.stdin.buffer\ntry:\n    fcntl.fcntl(0, 1031, 1 << 20)\nexcept OSError:\n    pass\n"
        "while b.read(1 << 20):\n    pass\n")  # the agent's 1 MiB pipe too (host/artifact.py _widen_pipe)


def raw_send(inv: Path, hosts, path: Path) -> dict:
    """The ceiling of one channel: the same bytes through the same transport (paramiko, AES-GCM) to a Python
    that only reads its stdin (no framing, no hashing, no file written)."""
    load = os.getloadavg()[0]
    host_cpu0 = children_cpu(hosts[0].proc.pid)
    run = Run(App(patches_dir=inv.parent, inventory_path=inv), RunOptions(limit=hosts[0].name), "bench")
    size = path.stat().st_size
    try:
        t = run.session(run.hosts[0]).transport
        t.run_python("pass\n")  # connect first: the ceiling is the bytes, not the handshake
        cpu0, t0 = cpu_self(), time.monotonic()
        with open(path, "rb") as fh:
            res = t.run_python(SINK, stream=iter(lambda: fh.read(A.CHUNK), b""), silence=30)
        wall, cpu = time.monotonic() - t0, cpu_self() - cpu0
        assert res.exit_code == 0, res
    finally:
        run.close()
    sessions_ended(hosts)
    return {"load": load, "wall": wall, "cpu": cpu, "host_cpu": children_cpu(hosts[0].proc.pid) - host_cpu0,
            "size": size}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mb", type=int, default=1024, help="MiB of the weights file (default 1024)")
    ap.add_argument("--hosts", type=int, default=4, help="N, the hosts sent to at once (default 4)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--profile", action="store_true")
    a = ap.parse_args()
    base = Path(tempfile.mkdtemp(prefix="patchctl-drafter-bench-"))
    hosts = []
    try:
        t = time.monotonic()
        write_draft(base / "draft", a.mb)
        print(f"draft directory: {a.mb} MiB weights + 2 small files, written in {time.monotonic() - t:.1f}s", flush=True)
        t, c = time.monotonic(), cpu_self()
        art = A.Artifact.from_dir(base / "draft")
        print(f"Artifact.from_dir (sha256 of {art.total_bytes / 1e9:.2f} GB): {time.monotonic() - t:.1f}s wall, "
              f"{cpu_self() - c:.1f}s CPU; again (cached per inode/size/mtime): ", end="")
        t = time.monotonic()
        A.Artifact.from_dir(base / "draft")
        print(f"{(time.monotonic() - t) * 1e3:.1f} ms", flush=True)
        hosts = start_hosts(a.hosts, base / "hosts")
        known_hosts_for(hosts, base / "hosts" / "known_hosts")
        inv = base / "inventory.toml"
        inv.write_text(inventory_toml(hosts))
        raw = raw_send(inv, hosts, base / "draft" / "model.safetensors")
        gb = raw["size"] / 1e9
        print(f"ceiling, one channel to a stdin sink: {raw['size'] / raw['wall'] / 1e6:.0f} MB/s, controller "
              f"{raw['cpu'] / gb:.2f} CPU s/GB, host {raw['host_cpu'] / gb:.2f} CPU s/GB (sshd + the sink; includes "
              f"the connection's handshake) (load {raw['load']:.2f})", flush=True)
        rows = []
        for rnd in range(1, a.rounds + 1):
            for n in sorted({1, a.hosts}):
                for h in hosts:
                    shutil.rmtree(h.dir / "state", ignore_errors=True)
                limit = ",".join(h.name for h in hosts[:n])
                first = one_send(inv, hosts, art, limit, profile=a.profile and rnd == a.rounds and n == a.hosts)
                second = one_send(inv, hosts, art, limit)
                assert second["sent"] == 0, second
                rows.append((rnd, n, first, second))
                print(f"round {rnd}, {n} host(s): {first['sent'] / 1e6:.0f} MB in {first['wall']:.1f}s "
                      f"(load {first['load']:.2f}); second send {second['wall'] * 1e3:.0f} ms", flush=True)
        print()
        print(f"{'round':>5} {'hosts':>5} {'load':>5} {'wall s':>7} {'MB/s/host':>16} {'agg MB/s':>9} "
              f"{'ctl CPU s/GB':>12} {'host CPU s/GB':>13} {'2nd send ms':>11} {'2nd ctl CPU ms':>14}")
        for rnd, n, f, s in rows:
            gb = f["sent"] / 1e9
            per = ",".join(f"{x:.0f}" for x in f["per_host_mbs"])
            print(f"{rnd:>5} {n:>5} {f['load']:>5.2f} {f['wall']:>7.1f} {per:>16} {f['sent'] / f['wall'] / 1e6:>9.0f} "
                  f"{f['cpu'] / gb:>12.2f} {f['host_cpu'] / gb:>13.2f} {s['wall'] * 1e3:>11.0f} {s['cpu'] * 1e3:>14.0f}")
        print(f"\nload after: {' '.join(f'{x:.2f}' for x in os.getloadavg())} (1/5/15 min), {os.cpu_count()} CPUs")
        if _Profiled.profiles:
            out = io.StringIO()
            st = pstats.Stats(_Profiled.profiles[0], stream=out)
            for p in _Profiled.profiles[1:]:
                st.add(p)
            st.sort_stats("tottime").print_stats(14)
            print("\nfeeding threads of the last N-host send, by own time (cProfile):")
            print("\n".join(out.getvalue().splitlines()[6:]))
    finally:
        stop_hosts(hosts)
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
