"""SGLang's HTTP surface, as patchctl sees it: health, model and server info, POST /generate.

`/health` and `/health_generate` answer 503 until the server is ready (and while
it shuts down), then run a one-token health request through the engine;
`/get_model_info` and `/get_server_info` say they are a stand-in; `POST /generate`
takes `text` or `input_ids` (one or a batch), `rid`, `sampling_params`, and answers
with `meta_info.prompt_tokens` as SGLang does. Prompt lengths are checked as SGLang 0.5.23 does
(patchctl.host.limits): `T >= context` or `T + max_new_tokens > context` refused up front (HTTP 400),
`T >= max_req_input_len` aborted by the scheduler: a 1-token stub prefill, then HTTP 400. The DIE_AFTER / STALL_AFTER / REQUEST_GATE knobs act here.
Generation is greedy from the tiny model (temperature is ignored), up to max_new_tokens, ending early
after the tokenizer's eos (finish_reason stop). With tokenizer files in the model directory
(`chat.ChatTokenizer`) `text` is tokenized and answered with them and `POST /v1/chat/completions`
renders the chat template, as SGLang's OpenAI endpoint does; only the prompt's prefill is dumped.
With speculation (spec.py) `/generate`'s meta_info adds SGLang's spec_* fields per request, `/server_info`'s
internal_states[0] `avg_spec_accept_length`, and `POST /flush_cache` resets it when no request runs (400
otherwise, as SGLang answers a flush it did not perform).
"""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler

from patchctl.simserver import knobs
from patchctl.simserver.engine import Work

logger = logging.getLogger("patchctl.simserver")

STAND_IN = "patchctl SGLang stand-in (not SGLang)"
HEALTH_CHECK_RID_PREFIX = "HEALTH_CHECK"
HEALTH_CHECK_TIMEOUT = float(os.environ.get("SGLANG_HEALTH_CHECK_TIMEOUT", 20))


class State:
    def __init__(self):
        self.ready = False
        self.shutting_down = False
        self.generate_count = 0
        self.count_lock = threading.Lock()
        self.die_after = knobs.die_after()
        self.stall_after = knobs.stall_after()
        self.request_gate = knobs.request_gate()


class BadRequest(ValueError):
    pass


def tokenize(text: str, vocab: int) -> list[int]:
    return [b % vocab for b in text.encode("utf-8")]


def detokenize(ids) -> str:
    return bytes(i % 256 for i in ids).decode("utf-8", errors="replace")


class Handler(BaseHTTPRequestHandler):
    server_version = "patchctl-simserver"
    protocol_version = "HTTP/1.1"
    app = None  # set by serve()

    def log_message(self, fmt, *a):
        logger.info('%s - "%s %s" %s', self.client_address[0], self.command, self.path, a[1] if len(a) > 1 else "")

    def _send(self, code, body=None):
        data = b"" if body is None else json.dumps(body).encode()
        self.send_response(code)
        if body is not None:
            self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        app = self.app
        path = self.path.split("?", 1)[0]
        if path in ("/health", "/health_generate"):
            if app.state.shutting_down or not app.state.ready:
                return self._send(503)
            w = Work(f"{HEALTH_CHECK_RID_PREFIX}_{uuid.uuid4().hex}", [0], 1)
            app.engine.submit(w)
            if w.done.wait(HEALTH_CHECK_TIMEOUT) and w.error is None:
                return self._send(200)
            logger.error("Health check failed: %s", w.error or "timeout")
            return self._send(503)
        if path in ("/ready",):
            return self._send(200 if app.state.ready and not app.state.shutting_down else 503)
        if path in ("/get_model_info", "/model_info"):
            return self._send(200, app.model_info())
        if path in ("/get_server_info", "/server_info"):
            return self._send(200, app.server_info())
        return self._send(404, {"detail": "Not Found"})

    def do_POST(self):
        app = self.app
        path = self.path.split("?", 1)[0]
        n = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(n) if n else b""
        if path == "/flush_cache":
            return self._flush()
        if path not in ("/generate", "/v1/chat/completions"):
            return self._send(404, {"detail": "Not Found"})
        with app.state.count_lock:
            app.state.generate_count += 1
            count = app.state.generate_count
        if app.state.die_after and count >= app.state.die_after:
            logger.error("PATCHCTL_SIM_DIE_AFTER=%d: request %d arrived, dying abruptly (stand-in knob)",
                         app.state.die_after, count)
            logging.shutdown()
            os._exit(1)
        if app.state.stall_after and count >= app.state.stall_after:
            logger.warning("PATCHCTL_SIM_STALL_AFTER=%d: request %d will never be answered (stand-in knob)",
                           app.state.stall_after, count)
            while not app.state.shutting_down:
                time.sleep(0.05)
            return self._send(503, {"detail": "shutting down"})
        gate = app.state.request_gate
        if gate and not os.path.exists(gate):
            logger.warning("PATCHCTL_SIM_REQUEST_GATE: request %d waits until %s exists (stand-in knob)", count, gate)
            while not os.path.exists(gate) and not app.state.shutting_down:
                time.sleep(0.05)
        if not app.state.ready:
            # SGLang queues requests until the scheduler runs; we do the same by waiting.
            while not app.state.ready and not app.state.shutting_down:
                time.sleep(0.05)
        try:
            body = json.loads(raw or b"null")
            if not isinstance(body, dict):
                raise BadRequest("Request body must be a JSON object.")
            code, res = 200, (app.generate(body) if path == "/generate" else app.chat(body))
        except (BadRequest, json.JSONDecodeError) as e:
            logger.error("[http_server] Error: %s", e)
            code, res = 400, {"error": {"message": str(e)}}
        except Exception as e:  # noqa: BLE001
            code, res = 500, {"error": {"message": f"{type(e).__name__}: {e}"}}
        self._send(code, res)

    do_PUT = do_POST

    def _flush(self):
        """SGLang's /flush_cache: done only when idle; resets the lifetime acceptance figures."""
        ok = self.app.engine.idle()
        if ok and self.app.engine.speculator is not None:
            self.app.engine.speculator.totals.reset()
        text = ("Cache flushed.\nPlease check backend logs for more details. (When there are running or waiting "
                "requests, the operation will not be performed.)\n") if ok else "Flush cache failed.\n"
        logger.info("Cache flushed successfully!" if ok else "Cache not flushed: requests are running or waiting")
        data = text.encode()
        self.send_response(200 if ok else 400)
        self.send_header("Content-Type", "text/plain; charset=utf-8")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


class App:
    def __init__(self, args, root, version, model_cfg, engine, unknown):
        self.args, self.root, self.version = args, root, version
        self.cfg, self.engine, self.unknown = model_cfg, engine, unknown
        self.state = State()

    def model_info(self):
        return {
            "model_path": self.args.model_path,
            "served_model_name": self.args.served_model_name or self.args.model_path,
            "tokenizer_path": self.args.tokenizer_path or self.args.model_path,
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": "default",
            "load_format": "auto",
            "has_image_understanding": False,
            "has_audio_understanding": False,
            "model_type": self.cfg.get("model_type"),
            "architectures": self.cfg.get("architectures"),
            "stand_in": True,
        }

    def server_info(self):
        info = {k: v for k, v in vars(self.args).items()}
        info.update(
            version=self.version,
            stand_in=True,
            stand_in_note=f"{STAND_IN}: patchctl.simserver serving the SGLang tree at {self.root}",
            sglang_root=str(self.root),
            ignored_args=self.unknown,
            status="ready" if self.state.ready else "starting",
            aux_hidden_state_layer_ids=self.engine.capture_ids,
            hook_lines=self.engine.hook.lines if self.engine.hook else [],
            internal_states=[self._internal_state()],
            # the scheduler's init info, merged in as SGLang's build_server_info does
            max_total_num_tokens=self.engine.kv_tokens,
            max_req_input_len=self.engine.max_req_input_len,
            launch_command=" ".join([sys.executable, "-m", "patchctl.simserver"] + sys.argv[1:]),
        )
        return info

    def _internal_state(self):
        state = {"last_gen_throughput": 0.0, "forward_pass_id": self.engine.forward_pass_id}
        spec = self.engine.speculator
        if spec is not None and spec.totals.avg() is not None:
            state["avg_spec_accept_length"] = spec.totals.avg()
        return state

    @property
    def tokenizer(self):
        """The model directory's tokenizer (`chat.ChatTokenizer`), or None: the byte tokenizer, no chat."""
        if not hasattr(self, "_tokenizer"):
            from patchctl.simserver.chat import ChatTokenizer

            self._tokenizer = ChatTokenizer.of(self.args.tokenizer_path or self.args.model_path)
        return self._tokenizer

    def _run(self, rid, ids, max_new):
        w = self._work(rid, ids, max_new)
        if self.tokenizer is not None:
            from patchctl.simserver.chat import Chooser

            if not hasattr(self, "_chooser"):
                self._chooser = Chooser(self.tokenizer, self.engine.vocab)
            w.stop_ids = frozenset(self.tokenizer.eos_ids)
            w.choose = self._chooser
        self.engine.submit(w)
        return w

    def _finish(self, w):
        if w.abort is not None:
            return {"type": "abort", "message": w.abort}
        if w.output_ids and w.output_ids[-1] in w.stop_ids:
            return {"type": "stop", "matched": w.output_ids[-1]}
        return {"type": "length", "length": w.max_new_tokens}

    def _text(self, ids):
        return self.tokenizer.decode(ids) if self.tokenizer is not None else detokenize(ids)

    def chat(self, body):
        """POST /v1/chat/completions (non-streaming): the chat template rendered with a generation prompt,
        tokenized without adding special tokens (as SGLang's serving_chat does), generated greedily."""
        tok = self.tokenizer
        if tok is None or not tok.template_text:
            raise BadRequest("This model has no chat template (no tokenizer files in its model directory).")
        msgs = body.get("messages")
        if not isinstance(msgs, list) or not msgs or not all(isinstance(m, dict) for m in msgs):
            raise BadRequest("messages must be a non-empty list of objects")
        max_new = body.get("max_completion_tokens", body.get("max_tokens"))
        max_new = 128 if max_new is None else max_new
        if not isinstance(max_new, int) or isinstance(max_new, bool) or max_new < 0:
            raise BadRequest(f"max_tokens must be a non-negative integer, got {max_new!r}")
        try:
            prompt = tok.render(msgs, add_generation_prompt=True, tools=body.get("tools"))
        except Exception as e:  # noqa: BLE001 - the template's raise_exception and any render error: the request's
            raise BadRequest(f"The chat template refused the messages: {e}") from None
        ids = tok.encode(prompt, add_special_tokens=False)
        if not ids or max(ids) >= self.engine.vocab:
            raise BadRequest("The rendered prompt is empty or holds ids outside the model's vocabulary.")
        rid = body.get("rid") or f"chatcmpl-{uuid.uuid4().hex}"
        w = self._run(str(rid), ids, max_new)
        _wait(w)
        out = [t for t in w.output_ids if t not in w.stop_ids]
        fin = self._finish(w)
        return {"id": rid, "object": "chat.completion", "created": int(time.time()),
                "model": self.args.served_model_name or self.args.model_path,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": tok.decode(out),
                                                     "reasoning_content": None, "tool_calls": None},
                             "finish_reason": fin["type"], "matched_stop": fin.get("matched")}],
                "usage": {"prompt_tokens": len(ids), "completion_tokens": len(w.output_ids),
                          "total_tokens": len(ids) + len(w.output_ids)}}

    def _work(self, rid, ids, max_new):
        """The scheduler's prompt-length check (validate_input_length): a prompt of max_req_input_len tokens or
        more is aborted, its request turned into a 1-token stub that is still prefilled."""
        limit = self.engine.max_req_input_len
        if len(ids) < limit:
            return Work(rid, ids, max_new)
        msg = (f"Input length ({len(ids)} tokens) exceeds the maximum allowed length ({limit} tokens). "
               "Use a shorter input or enable --allow-auto-truncate.")
        logger.error("%s, self.rid=%r", msg, rid)
        return Work(rid, [0], max_new, abort=msg)

    def generate(self, body):
        max_new = self._max_new(body.get("sampling_params") or {})
        single, prompts = self._prompts(body)
        self._check_lengths(prompts, max_new)
        rids = self._rids(body.get("rid"), single, len(prompts))
        works = [self._run(r, p, max_new) for r, p in zip(rids, prompts)]
        results = []
        for w in works:
            _wait(w)
            results.append({
                "text": self._text([t for t in w.output_ids if t not in w.stop_ids]),
                "output_ids": list(w.output_ids),
                "meta_info": {
                    "id": w.rid,
                    "finish_reason": self._finish(w),
                    "prompt_tokens": len(w.input_ids),
                    "completion_tokens": len(w.output_ids),
                    "cached_tokens": 0,
                    "e2e_latency": round(time.time() - w.t0, 6),
                    **(w.spec.meta(len(w.output_ids), self.engine.spec_cfg.draft_tokens) if w.spec else {}),
                },
            })
        return results[0] if single else results

    @staticmethod
    def _max_new(sp) -> int:
        """max_new_tokens of /generate's sampling_params, which are checked as SGLang checks them."""
        if not isinstance(sp, dict):
            raise BadRequest("sampling_params must be an object")
        max_new = sp.get("max_new_tokens", 128)
        if not isinstance(max_new, int) or isinstance(max_new, bool) or max_new < 0:
            raise BadRequest(f"max_new_tokens must be a non-negative integer, got {max_new!r}")
        temp = sp.get("temperature", 1.0)
        if not isinstance(temp, (int, float)) or temp < 0:
            raise BadRequest(f"temperature must be non-negative, got {temp!r}")
        return max_new

    def _prompts(self, body) -> tuple[bool, list[list[int]]]:
        """(one prompt rather than a batch, the prompts' token ids) from "text" or "input_ids"."""
        text, ids = body.get("text"), body.get("input_ids")
        if (text is None) == (ids is None):
            raise BadRequest("Either text or input_ids should be provided." if text is None
                             else "Only one of text or input_ids should be provided.")
        vocab = self.engine.vocab
        if text is not None:
            single = isinstance(text, str)
            texts = [text] if single else text
            if not isinstance(texts, list) or not texts or not all(isinstance(t, str) for t in texts):
                raise BadRequest("text must be a string or a non-empty list of strings")
            prompts = [tokenize(t, vocab) if self.tokenizer is None else self.tokenizer.encode(t) for t in texts]
        else:
            single = isinstance(ids, list) and all(isinstance(t, int) for t in ids)
            prompts = [ids] if single else ids
            if not isinstance(prompts, list) or not prompts or not all(
                    isinstance(p, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in p)
                    for p in prompts):
                raise BadRequest("input_ids must be a list of integers or a list of lists of integers")
        for p in prompts:
            if not p:
                raise BadRequest("The input_ids is empty.")
            bad = [t for t in p if t < 0 or t >= vocab]
            if bad:
                raise BadRequest(f"The input_ids {bad[:5]} contains values outside the vocabulary [0, {vocab}).")
        return single, prompts

    def _check_lengths(self, prompts, max_new: int) -> None:
        """TokenizerManager's checks: refused before the scheduler sees the request."""
        ctx = self.engine.context_len
        for p in prompts:
            if len(p) >= ctx:
                raise BadRequest(f"The input ({len(p)} tokens) is longer than the model's context length ({ctx} tokens).")
            if max_new + len(p) > ctx:
                raise BadRequest(
                    f"Requested token count exceeds the model's maximum context length of {ctx} tokens. You requested "
                    f"a total of {max_new + len(p)} tokens: {len(p)} tokens from the input messages and {max_new} "
                    f"tokens for the completion. Please reduce the number of tokens in the input messages or the "
                    f"completion to fit within the limit.")

    @staticmethod
    def _rids(rid, single: bool, n: int) -> list[str]:
        """The request's rid(s), random ones where it gives none."""
        if single:
            rids = [rid if rid is not None else uuid.uuid4().hex]
        elif rid is None:
            rids = [uuid.uuid4().hex for _ in range(n)]
        elif isinstance(rid, list) and len(rid) == n:
            rids = rid
        else:
            raise BadRequest("The rid should be a list with the same length as the prompts for a batch request.")
        if not all(isinstance(r, str) for r in rids):
            raise BadRequest("rid must be a string")
        return rids


def _wait(w: Work) -> None:
    """Until the engine is done with `w`; its error a 500, its abort (prompt too long) a 400."""
    w.done.wait()
    if w.error is not None:
        raise RuntimeError(f"{type(w.error).__name__}: {w.error}")
    if w.abort is not None:
        raise BadRequest(w.abort)
