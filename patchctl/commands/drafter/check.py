"""`patchctl drafter check DIR [--data COLLECTED_DIR] [--limit P]`: every way a trained EAGLE-3 draft directory
does not fit, before any server loads it (commands/drafter/checks.py has the checks and why each matters).

Local checks always: config.json, the safetensors headers (a truncated file named), names, dtypes and shapes
against the config, the vocab map. With --data (a `capture collect` directory): its draft-config.json's layer
ids, target_hidden_size and vocab_size, and the training data's tokenizer. With --limit: each selected host is
asked once, read-only (agent op `drafter_probe`: the served model's config.json facts, the server's context
length, tokenizer digest and env), and the draft is judged against what it serves.

Exit 0: no problem; 2: problems, every one listed (field, found, expected, where each came from); 3: a host
could not be read (its row says why).
"""

from __future__ import annotations

from patchctl.commands.drafter import checks as drafter
from patchctl.commands.drafter import checks_block as drafter_block
from patchctl.core import drafter_mla
from patchctl.core.console import App, table
from patchctl.core.options import DrafterOptions
from patchctl.core.session import Run, host_error, worst
from patchctl.host.drafter import launch_problems
from patchctl.host.protocol import EXIT_BAD_INPUT


def run_check(app: App, opts: DrafterOptions) -> int:
    facts = drafter.read_draft(opts.dir)
    data = drafter.read_data(opts.data) if opts.data else None
    local = drafter.check_draft(facts, data=data)
    hosts, codes = [], [EXIT_BAD_INPUT if local else 0]
    if data and data.get("tokenizer_why"):
        app.info(f"the training data's tokenizer is not checked: {data['tokenizer_why']}")
    if opts.limit is not None:
        hosts = _against_hosts(app, opts, facts, data, local)
        codes += [h["code"] for h in hosts]
    _, left = drafter.what_sglang_reads(opts.dir)
    out = {"draft": drafter.summary(facts), "data": data, "problems": [p.to_dict() for p in local],
           "not_sent": left,
           "hosts": [{k: v for k, v in h.items() if k not in ("probe", "error_obj")} for h in hosts]}
    app.result(out, _render(out))
    return worst(codes)


def _against_hosts(app: App, opts: DrafterOptions, facts, data, local) -> list[dict]:
    """Each selected host's served model, one read-only probe each; the problems the draft has there and
    not already locally."""
    run = Run(app, opts, "drafter check")
    seen = {p.message() for p in local}
    try:
        return run.parallel(lambda h: judge_host(run, h, facts, data, seen), run.hosts)
    finally:
        run.close()


def launch_rows(h, facts) -> list[dict]:
    """The flags this host's server would be restarted with that SGLang 0.5.23 refuses at start or serves wrongly
    for this draft (host/drafter.py launch_problems: each names SGLang's file and line), as problem rows."""
    import shlex

    try:
        words = shlex.split(h.server.command or "")
    except ValueError:
        words = []
    arch = (facts.config.get("architectures") or [None])[0] if isinstance(facts.config.get("architectures"), list) else None
    block = drafter_block.block_size(facts.config) if arch in drafter_block.ARCHS else None
    where = f"{h.name}'s server command and [server.speculative]"
    return [{"field": flag, "found": None, "expected": None, "where": where, "expected_from": "SGLang 0.5.23",
             "why": why, "message": f"{where}: {flag}: {why}"} for flag, why in launch_problems(h.server.speculative, words, arch, block)]


def judge_host(run: Run, h, facts, data, seen=frozenset()) -> dict:
    """One host asked once (`drafter_probe`, read-only) and the draft judged against what it serves: its row,
    with the probe's answer in "probe" (or the error it raised in "error_obj"). The flags its server would be
    restarted with are judged whether or not it answers (`launch_rows`)."""
    row = _judge_host(run, h, facts, data, seen)
    flags = launch_rows(h, facts)
    if flags:
        row["problems"] = flags + row["problems"]
        row["code"] = EXIT_BAD_INPUT
    return row


def _judge_host(run: Run, h, facts, data, seen) -> dict:
    try:
        r = run.session(h).call("drafter_probe")
    except Exception as e:  # noqa: BLE001 - one host's error never takes the others down
        outcome, msg = host_error(e)
        return {"host": h.name, "ok": False, "outcome": str(outcome), "error": msg,
                "code": getattr(e, "exit_code", 3), "problems": [], "error_obj": e}
    if not r.running:
        from patchctl.commands.drafter.bench import server_down

        return {"host": h.name, "ok": False, "outcome": "server down", "error": server_down(run.app, h.name),
                "code": 3, "problems": [], "served": r.to_wire(), "probe": r}
    if r.why:
        return {"host": h.name, "ok": False, "outcome": "unknown", "error": r.why,
                "code": 3, "problems": [], "served": r.to_wire(), "probe": r}
    probs = drafter.check_draft(facts, target=drafter.target_from_probe(h.name, r), data=data,
                                served=drafter.served_from_probe(h.name, r))
    mine = [p.to_dict() for p in probs if p.message() not in seen]
    return {"host": h.name, "ok": True, "problems": mine, "code": EXIT_BAD_INPUT if mine else 0, "probe": r,
            "served": {k: getattr(r, k) for k in ("config_path", "architectures", "hidden_size", "num_hidden_layers",
                                             "vocab_size", *drafter_mla.SHARED, "context_length", "tokenizer",
                                             "speculative", "env")}}


def _render(out: dict):
    from rich.markup import escape  # messages hold [..] lists rich would take for markup

    t = table("drafter check: " + out["draft"]["dir"], "where", "problem")
    for p in out["problems"]:
        t.add_row("draft", escape(p["message"]))
    for h in out["hosts"]:
        if not h["ok"]:
            t.add_row(h["host"], escape(f"not read: {h['error']}"))
        for p in h["problems"]:
            t.add_row(h["host"], escape(p["message"]))
        if h["ok"] and not h["problems"]:
            s = h["served"]
            t.add_row(h["host"], escape(f"fits what it serves ({s.get('config_path')})"))
    for rel, why in sorted((out.get("not_sent") or {}).items()):
        t.add_row("not sent", escape(f"{rel}: {why}"))
    if not out["problems"] and all(h["ok"] and not h["problems"] for h in out["hosts"]):
        t.add_row("draft", f"no problem ({out['draft']['tensors']} tensors in {', '.join(out['draft']['files'])})")
    return t
