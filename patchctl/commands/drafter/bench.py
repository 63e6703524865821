"""`patchctl drafter bench --prompts FILE [--max-new-tokens N] [--limit P]`: acceptance and tokens/s of what each
host serves now, on one fixed prompt set; read-only (the measuring is host/accept.py, defined as SpecForge's
`specforge benchmark` defines it).

Before anything is sent: the prompt set is read and validated (commands/drafter/prompts.py: FILE:LINE, exit 2), each host
is asked once what it serves (`drafter_probe`): a server whose env sets SGLANG_SIMULATE_ACC_LEN is refused
(SGLang fakes acceptance with it), prompts whose ids the served vocabulary lacks are refused, and where
conversations were rendered with --tokenizer, a host serving another tokenizer is refused. Then each host
measures on its own server (`accept_measure`), all hosts at once.

`measure(session, prompts, max_new_tokens)` is the measuring as a function for the canary of `drafter deploy`.

Exit 0: measured on every host; 1: a host's requests failed; 2: bad prompt set, a refused server, nothing
sent there; 3: a host could not be reached.
"""

from __future__ import annotations

from patchctl.commands.drafter import canary
from patchctl.commands.drafter import prompts as promptsets
from patchctl.core.console import App, table
from patchctl.commands.drafter.checks import served_from_probe
from patchctl.core.errors import BadInput
from patchctl.core.options import DrafterOptions
from patchctl.core.session import HostSession, Run, host_error, worst
from patchctl.host.accept import DEFAULT_CONCURRENCY, DEFAULT_MAX_NEW_TOKENS
from patchctl.host.protocol import DrafterProbeAnswer


def measure(session: HostSession, prompts, max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS, *,
            concurrency: int = DEFAULT_CONCURRENCY, request_timeout: int = 600, context_length: int | None = None,
            train_length: int | None = None) -> dict:
    """One host's figures on `prompts` (a commands/drafter/prompts.py PromptSet, or a list of {"input_ids"} / {"text"} bodies):
    the AcceptAnswer's fields (accept_length = sum(completion_tokens) / sum(spec_verify_ct), None without
    speculation; accept_length_mean; tokens_per_s; requests; ...) plus "prompt_digest" where known and, from
    the per-request rows (summarized, then dropped: commands/drafter/canary.py), "categories", "loops" and "lengths"
    (against `context_length` and the draft's `train_length` when given). Raises the
    agent's failure (AgentFailure: bad_input for SGLANG_SIMULATE_ACC_LEN, failed for a failed request)."""
    bodies = prompts.prompts if isinstance(prompts, promptsets.PromptSet) else list(prompts)
    ans = session.call("accept_measure", prompts=bodies, max_new_tokens=int(max_new_tokens),
                       concurrency=int(concurrency), request_timeout=int(request_timeout))
    r = {k: v for k, v in ans.to_wire().items() if k != "notes"}  # the figures, as canary.summarize reads them
    if isinstance(prompts, promptsets.PromptSet):
        r["prompt_digest"] = prompts.digest
        return canary.summarize(r, prompts.categories, prompts.lines, context_length, train_length)
    return canary.summarize(r, [None] * len(bodies), list(range(1, len(bodies) + 1)), context_length, train_length)


def served_limit(host: str, probe: DrafterProbeAnswer) -> int | None:
    """The longest context the host's server serves: its context length (/server_info, else the model's
    config), else the longest prompt it accepts (/server_info max_req_input_len)."""
    return served_from_probe(host, probe)["context_length"] or probe.max_req_input_len


def canary_words(m: dict) -> list[str]:
    """What a measurement says beyond its acceptance: per category, loops, lengths (and their warning)."""
    from patchctl.commands.drafter.gate import describe_categories

    out = []
    if m.get("categories"):
        out.append(f"per category: {describe_categories(m)}")
    lp = m.get("loops") or {}
    if lp.get("requests"):
        share = lp.get("gain_share")
        out.append(f"{lp['requests']} of {lp['of']} completions loop (period {', '.join(map(str, lp['periods']))}; "
                   f"prompt lines {', '.join(map(str, lp['lines']))})"
                   + (f", {share:.0%} of the speculative gain" if share is not None else ""))
    if m.get("lengths"):
        out.append(canary.describe_lengths(m["lengths"]))
        if m["lengths"].get("long_gap"):
            out.append("warning: " + m["lengths"]["long_gap"])
    return out


def tokenizer_dir(app: App, opts: DrafterOptions):
    """--tokenizer DIR, or the served tokenizer of --from HOST (fetched and cached as `capture prepare --from`)."""
    if opts.tokenizer_from:
        from patchctl.core.tokenizers import fetch
        from patchctl.core.options import RunOptions

        return fetch(app, RunOptions(forks=opts.forks, accept_new_host_keys=opts.accept_new_host_keys),
                     opts.tokenizer_from).path
    return opts.tokenizer


def run_bench(app: App, opts: DrafterOptions) -> int:
    ps = promptsets.load_prompts(opts.prompts, tokenizer_dir(app, opts))
    run = Run(app, opts, "drafter bench")
    try:
        probes = dict(run.parallel(lambda h: (h.name, _probe(run, h)), run.hosts))
        refuse_before_sending(ps, probes)
        app.info(f"{len(ps.prompts)} prompts ({ps.path}, sha256 {ps.sha256[:12]}), max_new_tokens {opts.max_new_tokens}, "
                 f"concurrency {opts.concurrency}, temperature 0")

        def one(h):
            p = probes[h.name]
            if isinstance(p, Exception):
                return _failed(h.name, p)
            if p.running is False:
                return {"host": h.name, "ok": False, "outcome": "server down", "error": server_down(app, h.name),
                        "code": 3}
            try:
                r = measure(run.session(h), ps, opts.max_new_tokens, concurrency=opts.concurrency,
                            request_timeout=opts.request_timeout, context_length=served_limit(h.name, p))
            except Exception as e:  # noqa: BLE001 - one host's error never takes the others down
                return _failed(h.name, e)
            return dict({"host": h.name, "ok": True, "code": 0, "serving": serving(r.get("speculative"))}, **r)

        rows = run.parallel(one, run.hosts)
    finally:
        run.close()
    for r in rows:
        if not r["ok"]:
            app.info(f"{r['host']}: {r['outcome']}: {r['error']}")
        else:
            for words in canary_words(r):
                app.info(f"{r['host']}: {words}")
    out = {"prompts": {"path": str(ps.path), "sha256": ps.sha256, "digest": ps.digest, "count": len(ps.prompts),
                       "kinds": ps.kinds, "tokenizer": ps.tokenizer},
           "max_new_tokens": opts.max_new_tokens, "concurrency": opts.concurrency, "hosts": rows}
    app.result(out, _render(out))
    return worst(r["code"] for r in rows)


def _probe(run: Run, h):
    try:
        return run.session(h).call("drafter_probe")
    except Exception as e:  # noqa: BLE001 - said in its row
        return e


def refuse_before_sending(ps, probes: dict) -> None:
    """Bad input found before anything is sent: a faked acceptance, ids the vocabulary lacks, another tokenizer."""
    from patchctl.host.served import simulated_acceptance

    bad = []
    for host, p in sorted(probes.items()):
        if isinstance(p, Exception) or p.running is False:
            continue  # its row (or unit) says why: not read, or its server is down (server_down)
        fake = simulated_acceptance(p.env or {})
        if fake is not None:
            bad.append(f"{host}: its server runs with SGLANG_SIMULATE_ACC_LEN={fake}: SGLang fakes the acceptance with "
                       "it (sglang/srt/environ.py:527); not measured")
        vocab = p.vocab_size
        top = max((max(x["input_ids"]) for x in ps.prompts if "input_ids" in x), default=-1)
        if vocab and top >= vocab:
            line = next(n for x, n in zip(ps.prompts, ps.lines) if "input_ids" in x and max(x["input_ids"]) >= vocab)
            bad.append(f"{ps.path}:{line}: token id {top} >= vocab_size {vocab} of the model {host} serves")
        tok = (p.tokenizer or {}).get("digest")
        if ps.tokenizer and tok != ps.tokenizer:
            bad.append(f"{host} serves tokenizer {(tok or 'unknown')[:12]} ({(p.tokenizer or {}).get('path')}); the "
                       f"conversations were rendered with {ps.tokenizer[:12]} (--tokenizer)")
    if bad:
        raise BadInput("\n".join(bad) + "\nnothing sent")


def server_down(app, host: str) -> str:
    """What a host whose server is not running is told, with the command that starts it."""
    return f"{host}'s server is not running; `{app.cmd('start', '--limit', host)}`"


def _failed(host: str, e: Exception) -> dict:
    outcome, msg = host_error(e)
    return {"host": host, "ok": False, "outcome": str(outcome), "error": msg, "code": getattr(e, "exit_code", 3)}


def serving(spec: dict | None) -> str:
    """What serves, in words: the speculative algorithm and draft, or none."""
    spec = spec or {}
    if spec.get("capture"):
        return "capture mode (no speculation)"
    if not spec.get("algorithm"):
        return "no speculation"
    if spec.get("block_size") or spec["algorithm"] in ("DFLASH", "DSPARK"):
        return f"{spec['algorithm']} {spec.get('draft_path') or ''} (block size {spec.get('block_size') or 'the draft config'})"
    steps = "/".join(str(spec.get(k, "-")) for k in ("num_steps", "eagle_topk", "num_draft_tokens"))
    return f"{spec['algorithm']} {spec.get('draft_path') or ''} (steps/topk/draft {steps})".replace("  ", " ")


def accept_cell(r: dict) -> str:
    if r.get("accept_length") is None:
        return "off"
    mean = r.get("accept_length_mean")
    return f"{r['accept_length']:.3f}" + (f" (mean {mean:.3f})" if mean is not None else "")


def _render(out: dict):
    from rich.markup import escape

    t = table(f"drafter bench: {out['prompts']['count']} prompts ({out['prompts']['path']}), max_new_tokens "
              f"{out['max_new_tokens']}, temperature 0", "host", "acceptance (mean)", "tokens/s", "requests", "prompts",
              "serving")
    for r in out["hosts"]:
        if not r["ok"]:
            t.add_row(r["host"], escape(str(r["outcome"])), "", "", "", escape(r["error"]))
            continue
        t.add_row(r["host"], accept_cell(r), f"{r['tokens_per_s']:.1f}", str(r["requests"]),
                  r.get("prompt_digest", "")[:12], escape(r["serving"]))
    return t
