"""Rendering of bench/scale_bench.py's rows: the markdown tables and the PNG plot (matplotlib)."""

from __future__ import annotations

from pathlib import Path

SUMMARY_OPS = ("apply (restart)", "deploy")  # patchctl's deploy without smoke; Ansible's deploy.yml (no smoke)


def _f(v, fmt="{:.2f}"):
    return "—" if v is None else fmt.format(v)


def _conn(r: dict) -> str:
    c, m = r["connections"], r["commands"]
    conn = f"{c['max']}" if c["min"] == c["max"] else f"{c['min']}–{c['max']}"
    cmd = f"{m['max']}" if m["min"] == m["max"] else f"{m['min']}–{m['max']}"
    sub = r.get("subsystem_sessions", {}).get("max")
    return f"{conn} | {cmd}" + (f" +{sub} sftp" if sub else "")


def table_md(rows: list[dict]) -> str:
    runs = [r for r in rows if r.get("tool") != "check"]
    ns = sorted({r["n"] for r in runs})
    base = {}
    for r in runs:  # the marginal RSS per added host: peak(N) - peak(smallest N), same tool and op
        base.setdefault((r["tool"], r["op"]), (r["n"], r["ctrl_maxrss_mb"]))
    out = ["Summary — a deploy with restart (patchctl `apply --no-smoke`, the new server light; Ansible `deploy.yml`, no smoke):", "",
           "| N | tool | wall s | ctrl CPU ms/host | ctrl peak RSS MB (÷N) | marginal MB/host | wall ÷ CPU floor | conn/host | cmd/host | threads peak |",
           "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for n in ns:
        for r in runs:
            if r["n"] == n and r["op"] in SUMMARY_OPS:
                n0, rss0 = base[(r["tool"], r["op"])]
                marg = (r["ctrl_maxrss_mb"] - rss0) / (n - n0) if n != n0 else None
                out.append(f"| {n} | {r['tool']} | {_f(r['wall'])} | {_f(r['ctrl_cpu_ms_per_host'], '{:.1f}')} | "
                           f"{_f(r['ctrl_maxrss_mb'], '{:.0f}')} ({_f(r['ctrl_rss_mb_per_host'], '{:.2f}')}) | "
                           f"{_f(marg, '{:.3f}')} | {_f(r['wall_over_floor'])} | {_conn(r)} | {r['threads_peak']} |")
    out += ["", "Every run:", "",
            "| N | tool | op | exit | wall s | ctrl CPU s | ms/host | peak RSS MB | threads | host SSH CPU s | "
            "machine CPU s (floor s) | wall ÷ floor | other CPU s | conn/host | cmd/host | load 1m |",
            "|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in runs:
        out.append(f"| {r['n']} | {r['tool']} | {r['op']} | {r['exit']} | {_f(r['wall'])} | {_f(r['ctrl_cpu'])} | "
                   f"{_f(r['ctrl_cpu_ms_per_host'], '{:.1f}')} | {_f(r['ctrl_maxrss_mb'], '{:.0f}')} | {r['threads_peak']} | "
                   f"{_f(r['host_cpu'], '{:.1f}')} | {_f(r['machine_cpu'], '{:.1f}')} ({_f(r['cpu_floor'], '{:.1f}')}) | "
                   f"{_f(r['wall_over_floor'])} | {_f(r['other_cpu'], '{:.1f}')} | {_conn(r)} | {_f(r['loadavg_before'], '{:.1f}')} |")
    return "\n".join(out)


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [r for r in rows if r.get("tool") != "check" and r["op"] in SUMMARY_OPS]
    series: dict[str, list[dict]] = {}
    for r in runs:
        series.setdefault(r["tool"], []).append(r)
    fig, (a, b, c) = plt.subplots(1, 3, figsize=(15, 4.6))
    style = {"patchctl": "o-", "patchctl (before)": "s--", "ansible": "^-"}
    for tool, rs in series.items():
        rs.sort(key=lambda r: r["n"])
        xs = [r["n"] for r in rs]
        a.plot(xs, [r["ctrl_cpu"] for r in rs], style.get(tool, "x-"), label=tool)
        b.plot(xs, [r["ctrl_cpu_ms_per_host"] for r in rs], style.get(tool, "x-"), label=tool)
        c.plot(xs, [r["wall"] for r in rs], style.get(tool, "x-"), label=tool)
    for ax, title, ylab in ((a, "controller CPU", "CPU seconds"), (b, "controller CPU per host (dashed: 30 ms)", "ms per host"),
                            (c, "wall time (= the machine's CPU floor here, ±3%)", "seconds")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks(sorted({r["n"] for r in runs}), [str(n) for n in sorted({r["n"] for r in runs})])
        ax.set_title(title)
        ax.set_xlabel("hosts (N)")
        ax.set_ylabel(ylab)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    b.axhline(30, color="grey", lw=0.8, ls="--")
    fig.suptitle("A deploy with restart (no smoke) to N real sshd hosts on one 2-core machine: patchctl and Ansible")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
