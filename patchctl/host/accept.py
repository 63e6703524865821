"""Measuring a server's speculative acceptance on a fixed prompt set (`drafter bench`, the canary's measuring half).

Defined as SpecForge 0.2.0's `specforge benchmark` defines it (specforge/benchmarks/sglang.py), so a
SpecForge user can put the two figures side by side: /flush_cache first (a failure only noted, as there),
`warmup` requests (SpecForge: as many as the concurrency, default 1) that are not counted, then every prompt
at temperature 0 (top_p 1, top_k 1) with the same max_new_tokens, `concurrency` at a time (default 1);
output tokens/s = sum(completion_tokens) / wall time of the measured requests; the mean of the
per-request `meta_info["spec_accept_length"]` (SpecForge's "average acceptance length"). Beside it the
sound aggregate, weighted by verify steps: sum(completion_tokens) / sum(spec_verify_ct) over the requests
that report spec_verify_ct (SGLang's own per-request definition, managers/tokenizer_manager.py:3148-3200:
accept_length = completion_tokens / verify_ct, counting the bonus token), and the strict acceptance rate
sum(spec_num_correct_drafts) / sum(spec_num_proposed_drafts). Without speculation SGLang writes no spec_*
field: acceptance is None ("off"), never invented. /server_info's internal_states avg_spec_accept_length
(per DP rank, lifetime, refreshed every 40 decode steps) is read before and after, for the record only.

Per request the op also answers its prompt and completion tokens, spec_verify_ct and whether the completion
degenerated into a loop (`loop_of`, judged on /generate's `output_ids`), in prompt order ("per_request"): the
controller groups them by the prompt set's categories and gates on them (commands/drafter/gate.py).

Requests go to the server bound to the host's loopback, from worker threads; the op's own thread waits
and beats, so the controller sees a live agent through minutes of generation. Standard library only.
"""

import http.client
import time
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait

from .events import AgentError, heartbeat
from .server import http_once, http_request
from .served import avg_accept_lengths, simulated_acceptance

DEFAULT_CONCURRENCY = 1  # specforge benchmark --concurrency
DEFAULT_MAX_NEW_TOKENS = 2048  # specforge benchmark --max-new-tokens
SAMPLING = {"temperature": 0.0, "top_p": 1.0, "top_k": 1}  # specforge benchmark's defaults: greedy
# A completion degenerates into a loop when its last LOOP_MIN_TOKENS tokens or more are one block of at most
# LOOP_MAX_PERIOD tokens repeated (token i equals token i - period throughout): at least two full periods,
# 32 tokens. A shorter completion is not judged.
LOOP_MAX_PERIOD = 16
LOOP_MIN_TOKENS = 32


def loop_of(ids):
    """{"period", "tokens", "start"} of the repeated tail of `ids` (the smallest period; `tokens` counts the
    whole looping tail, its first period included; `start` its index), or None: no loop of at least
    LOOP_MIN_TOKENS tokens with a period of at most LOOP_MAX_PERIOD."""
    n = len(ids)
    for p in range(1, LOOP_MAX_PERIOD + 1):
        if n < max(LOOP_MIN_TOKENS, 2 * p):
            break
        i = n - 1
        while i - p >= 0 and ids[i] == ids[i - p]:
            i -= 1
        start = i - p + 1  # ids[start:] repeats its first p tokens
        if n - start >= LOOP_MIN_TOKENS and n - start >= 2 * p:
            return {"period": p, "tokens": n - start, "start": start}
    return None


def per_request(answers):
    """The per-request rows of (meta_info, output_ids) answers: tokens, verify steps, loop (or None)."""
    rows = []
    for meta, ids in answers:
        v = meta.get("spec_verify_ct")
        rows.append({"prompt_tokens": int(meta.get("prompt_tokens") or 0),
                     "completion_tokens": int(meta.get("completion_tokens") or 0),
                     "verify_ct": None if v is None else int(v),
                     "loop": loop_of(ids) if isinstance(ids, list) else None})
    return rows


def aggregate(metas, seconds):
    """The figures of a set of `meta_info` dicts measured in `seconds` of wall time (pure: unit-tested on
    recorded answers)."""
    completion = sum(int(m.get("completion_tokens") or 0) for m in metas)
    spec = [m for m in metas if m.get("spec_verify_ct") is not None]
    lengths = [float(m["spec_accept_length"]) for m in metas if m.get("spec_accept_length") is not None]
    out = {"requests": len(metas), "completion_tokens": completion,
           "prompt_tokens": sum(int(m.get("prompt_tokens") or 0) for m in metas),
           "seconds": round(seconds, 4), "tokens_per_s": round(completion / max(seconds, 1e-12), 3),
           "spec_requests": len(spec), "verify_ct": None, "accept_length": None, "accept_length_mean": None,
           "accept_rate": None}
    if not spec:
        return out
    verify = sum(int(m["spec_verify_ct"]) for m in spec)
    out["verify_ct"] = verify
    if verify:
        out["accept_length"] = round(sum(int(m.get("completion_tokens") or 0) for m in spec) / float(verify), 4)
    if lengths:
        out["accept_length_mean"] = round(sum(lengths) / len(lengths), 4)
    proposed = sum(int(m.get("spec_num_proposed_drafts") or 0) for m in spec)
    if proposed:
        out["accept_rate"] = round(sum(int(m.get("spec_num_correct_drafts") or 0) for m in spec) / float(proposed), 4)
    return out


class Measure(object):
    """One measurement on the server of `cfg` (its current config: host, port, env as read by served.py)."""

    def __init__(self, cfg, env, prompts, max_new_tokens, concurrency=None, warmup=None, request_timeout=None):
        self.cfg = cfg
        self.env = env
        self.prompts = prompts
        self.max_new = int(max_new_tokens or DEFAULT_MAX_NEW_TOKENS)
        self.concurrency = int(concurrency or DEFAULT_CONCURRENCY)
        self.warmup = self.concurrency if warmup is None else int(warmup)
        self.timeout = float(request_timeout or 600)

    def body(self, prompt):
        b = dict(prompt)  # {"input_ids": [...]} or {"text": "..."}
        b["sampling_params"] = dict(SAMPLING, max_new_tokens=self.max_new)
        return b

    def post(self, prompt):
        status, res = http_once(self.cfg["host"], self.cfg["port"], "POST", "/generate", self.body(prompt), self.timeout)
        if status != 200 or not isinstance(res, dict):
            raise AgentError("failed", "POST /generate answered HTTP %s: %s" % (status, str(res)[:300]))
        return res.get("meta_info") or {}, res.get("output_ids")

    def run(self):
        fake = simulated_acceptance(self.env)
        if fake is not None:
            raise AgentError("bad_input", "the server on port %s runs with SGLANG_SIMULATE_ACC_LEN=%s: SGLang fakes the "
                             "acceptance with it (sglang/srt/environ.py:527, speculative/spec_utils.py:276); not "
                             "measured" % (self.cfg.get("port"), fake))
        if not self.cfg.get("running"):
            raise AgentError("failed", "no server is running on port %s" % self.cfg.get("port"))
        before = self.server_figures()
        flush = self.flush()
        pool = ThreadPoolExecutor(max_workers=self.concurrency)
        try:
            self.gather(pool, [self.prompts[i % len(self.prompts)] for i in range(self.warmup)], "warm-up")
            t0 = time.time()
            answers = self.gather(pool, self.prompts, "measure")
            seconds = time.time() - t0
        finally:  # a failure or a gone controller does not wait for the requests still in flight
            pool.shutdown(wait=False)
        out = aggregate([m for m, _ in answers], seconds)
        out["per_request"] = per_request(answers)
        out.update(max_new_tokens=self.max_new, concurrency=self.concurrency, warmup=self.warmup, flush=flush,
                   server_accept_before=before, server_accept_after=self.server_figures())
        return out

    def gather(self, pool, prompts, step):
        """Every prompt's (meta_info, output_ids), in order; the first failure ends the measurement (nothing half-counted)."""
        futures = [pool.submit(self.post, p) for p in prompts]
        pending = set(futures)
        try:
            while pending:
                done, pending = wait(pending, timeout=0.25, return_when=FIRST_COMPLETED)
                for f in done:
                    f.result()  # raises the request's error at once
                heartbeat(step=step, sent=len(futures) - len(pending))
        except (OSError, http.client.HTTPException) as e:
            raise AgentError("failed", "%s: a request to the server on port %s failed: %s" % (step, self.cfg.get("port"), e))
        finally:
            for f in pending:
                f.cancel()
        return [f.result() for f in futures]

    def flush(self):
        """POST /flush_cache as SpecForge does before measuring: "ok", or why not (noted, not fatal)."""
        try:
            status, _ = http_request(self.cfg["host"], self.cfg["port"], "POST", "/flush_cache", None, 60)
        except (OSError, http.client.HTTPException) as e:
            return "failed: %s" % (e or e.__class__.__name__)
        return "ok" if status == 200 else "HTTP %s" % status

    def server_figures(self):
        try:
            status, info = http_request(self.cfg["host"], self.cfg["port"], "GET", "/server_info", None, 10)
        except (OSError, http.client.HTTPException):
            return None
        return avg_accept_lengths(info) if status == 200 else None
