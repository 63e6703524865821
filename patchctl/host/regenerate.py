"""Regeneration on the host (`patchctl capture regenerate`): the probe, and one long-running op per host.

Conversations arrive on stdin, one JSON line each (`{"id", "rid", "messages": [{role, content}, ...]}`),
while the op runs; up to `in_flight` are worked on at a time. Each assistant turn, in order, is replaced
by the local server's own answer to everything before it (`POST /v1/chat/completions`, the server's chat
template: each turn's context holds the regenerated earlier turns). Answers: `sample_done` with the new
turns, `sample_failed` with the reason (the server refused a turn), or, when the server does not answer,
`host_stopped` and `sample_returned` for this and every later conversation (the controller routes them
elsewhere). Request ids start with `regen-`, never the capture series' dump prefix: nothing is dumped.
Standard library only.
"""

import http.client
import json
import time

from .events import ControllerGone
from .server import http_once
from .streamed import Streamed
from .tokenizer import served as served_tokenizer


def probe(cfg):
    """Does this host take part: its server runs and generates; with the served tokenizer (same model
    everywhere is checked on the controller). Reads only."""
    out = {"ready": False, "port": cfg.get("port")}
    if not cfg.get("running"):
        out["why"] = "no server is running on port %s" % cfg.get("port")
        return out
    try:
        status, _ = http_once(cfg["host"], cfg["port"], "GET", "/health_generate", None, 30.0)
    except (OSError, http.client.HTTPException) as e:
        status, out["why"] = None, "the server on port %s does not answer: %s" % (cfg.get("port"), e)
    if status != 200:
        out.setdefault("why", "the server on port %s is not healthy (/health_generate: HTTP %s)" % (cfg.get("port"), status))
        return out
    tok = served_tokenizer(cfg)
    out.update(ready=True, model_path=tok.get("model_path"), tokenizer={"path": tok.get("tokenizer_path"),
                                                                         "digest": tok["digest"], "why": tok.get("why")})
    return out


class Regenerate(Streamed):
    def __init__(self, cfg, req, stdin):
        Streamed.__init__(self, int(req.get("in_flight") or 8), stdin, {"tokens": 0})
        self.cfg = cfg
        self.request_timeout = float(req.get("request_timeout") or 600)
        self.max_new_tokens = int(req.get("max_new_tokens") or 512)
        self.temperature = float(req.get("temperature") or 0.0)

    def run_all(self):
        t0 = time.time()
        self._run_workers("regenerate")
        if self.gone:
            raise ControllerGone()
        return dict(self.counts, stopped=self.stopped, seconds=round(time.time() - t0, 3))

    def _take(self, s):
        try:
            self._one(s)
        except ControllerGone:
            raise
        except Exception as e:  # an agent bug fails this conversation loudly, never silently
            self._emit("sample_failed", id=s["id"], reason="agent error: %s: %s" % (e.__class__.__name__, e))

    def _one(self, s):
        t0 = time.time()
        context, turns, tokens = [], [], 0
        for i, m in enumerate(s["messages"]):
            if m["role"] != "assistant":
                context.append(m)
                continue
            body = {"model": "default", "messages": context, "max_tokens": self.max_new_tokens,
                    "temperature": self.temperature, "stream": False, "rid": "%s-%d" % (s["rid"], i)}
            try:
                status, resp = http_once(self.cfg["host"], self.cfg["port"], "POST", "/v1/chat/completions", body,
                                         self.request_timeout)
            except (OSError, http.client.HTTPException) as e:
                self._stop("the server on port %s does not answer: %s" % (self.cfg["port"], e or e.__class__.__name__))
                return self._emit("sample_returned", id=s["id"], reason=self.stopped)
            if status != 200 or not isinstance(resp, dict) or not resp.get("choices"):
                return self._emit("sample_failed", id=s["id"], reason="turn %d: HTTP %s from the server: %s" % (
                    i, status, json.dumps(resp)[:300] if not isinstance(resp, str) else resp[:300]))
            choice = resp["choices"][0]
            msg = choice.get("message") or {}
            text = msg.get("content") or ""
            n = int((resp.get("usage") or {}).get("completion_tokens") or 0)
            tokens += n
            turns.append({"index": i, "content": text, "reasoning_content": msg.get("reasoning_content"),
                          "finish_reason": choice.get("finish_reason"), "tokens": n})
            context.append({"role": "assistant", "content": text})
        with self.lock:
            self.counts["tokens"] += tokens
        self._emit("sample_done", id=s["id"], turns=turns, tokens=tokens, seconds=round(time.time() - t0, 3))
