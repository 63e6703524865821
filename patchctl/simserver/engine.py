"""The scheduler: one thread batches requests into an extend forward, then decodes; hooks run around it.

Each forward gets a duck-typed ForwardBatch with the fields SGLang's has for that
batch, runs the tree's `ForwardBatch.init_new` hook, the statements of
`ModelRunner.forward` before the raw forward, the tiny model, then the rest of
the hook with `output.logits_output` as SGLang builds it. Forward modes
produced: EXTEND (prefill) and DECODE only; temperature is ignored.
"""

from __future__ import annotations

import hashlib
import logging
import os
import queue
import threading
import time
import traceback

from patchctl.host import limits
from patchctl.simserver import knobs
from patchctl.simserver.ducks import NS, ForwardMode
from patchctl.simserver.model import TinyModel, resolve_capture_ids

logger = logging.getLogger("patchctl.simserver")

MAX_BATCH = 32


class Work:
    def __init__(self, rid, input_ids, max_new_tokens, abort: str | None = None, stop_ids=()):
        self.rid = rid
        self.input_ids = input_ids
        self.max_new_tokens = max_new_tokens
        self.stop_ids = frozenset(stop_ids)  # the tokenizer's eos: generation ends after it (finish_reason stop)
        self.choose = None  # (work, the model's greedy token) -> the token generated (chat.Chooser), or None
        # SGLang's Req.set_finish_with_abort: the prompt replaced by the 1-token stub [0], `to_finish` set;
        # the stub is still prefilled (and the request answered with the abort's message, HTTP 400)
        self.abort = abort
        self.output_ids: list[int] = []
        self.error: BaseException | None = None
        self.done = threading.Event()
        self.t0 = time.time()


def derived_context_len(model_cfg) -> int:
    """get_context_length on the model's config (2048 when it sets no context key)."""
    return limits.config_context_len(model_cfg)[0] or limits.DEFAULT_CONTEXT_LEN


def _finish_abort(message):
    """SGLang's FINISH_ABORT as set_finish_with_abort makes it (status 400, BadRequestError)."""
    j = {"type": "abort", "message": message, "status_code": 400, "err_type": "BadRequestError"}
    return NS(message=message, status_code=400, err_type="BadRequestError", to_json=lambda: dict(j))


class Engine:
    """One scheduler thread: batches requests that arrive together into one extend forward."""

    def __init__(self, args, model_cfg, hook, hd_module, light, batch_hook=None):
        self.args = args
        self.cfg = model_cfg
        self.hook = hook
        self.batch_hook = batch_hook
        self.hd = hd_module
        self.light = light
        self.vocab = int(model_cfg.get("vocab_size", 512))
        self.layers = int(model_cfg.get("num_hidden_layers", 8))
        self.hidden = int(model_cfg.get("hidden_size", 64))
        self.capture_ids = resolve_capture_ids(args, self.layers)
        # SGLang's ModelConfig context_len (--context-length, else config.json's) and the scheduler's bound
        self.context_len = getattr(args, "context_length", None) or derived_context_len(model_cfg)
        self.kv_tokens = knobs.kv_tokens()
        self.max_req_input_len = limits.max_req_input_len(self.context_len, self.kv_tokens)
        self.model = None
        self.q: queue.Queue[Work] = queue.Queue()
        self.forward_pass_id = 0
        hf_config = NS(**{"architectures": model_cfg.get("architectures"), **model_cfg})
        self.runner = NS(
            is_draft_worker=False, attn_tp_rank=0, tp_rank=0, tp_size=args.tp_size, gpu_id=0, pp_rank=0,
            pp_size=1, dp_rank=None, attn_dp_rank=0, forward_pass_id=0,
            server_args=NS(**{**vars(args), "return_aux_hidden_state_layer_ids": args.return_aux_hidden_state_layer_ids}),
            model_config=NS(hidden_size=self.hidden, num_hidden_layers=self.layers, vocab_size=self.vocab,
                            hf_config=hf_config, hf_text_config=hf_config, model_path=args.model_path),
            # Like SGLang's SpecAuxHiddenStateConfig: the ids as given, None for the model's default.
            spec_aux_config=NS(eagle_use_aux_hidden_state=self.capture_ids is not None,
                               eagle_aux_hidden_state_layer_ids=args.return_aux_hidden_state_layer_ids
                               if self.capture_ids is not None else None),
            # SGLang's set_eagle3_layers_to_capture sets this on the CausalLM's inner model.
            model=NS(model=NS(layers_to_capture=list(self.capture_ids) if self.capture_ids else None)),
        )

    def load(self):
        if not self.light:
            nan = knobs.nan_layer()
            self.model = TinyModel(self.layers, self.hidden, self.vocab, self.capture_ids,
                                   int(nan) if nan not in (None, "") else None, knobs.nan_tokens(),
                                   model_dir=self.args.model_path)
        threading.Thread(target=self._loop, name="scheduler", daemon=True).start()

    def submit(self, work: Work):
        self.q.put(work)

    def _loop(self):
        while True:
            batch = [self.q.get()]
            time.sleep(0.002)  # let requests that arrive together share the forward
            while len(batch) < MAX_BATCH:
                try:
                    batch.append(self.q.get_nowait())
                except queue.Empty:
                    break
            try:
                self._run_batch(batch)
            except BaseException as e:  # noqa: BLE001 - the request fails, the server keeps serving
                logger.error("Forward failed for rids %s:\n%s", [w.rid for w in batch], traceback.format_exc().rstrip())
                for w in batch:
                    w.error = e
            for w in batch:
                w.done.set()

    def _run_batch(self, batch):
        nexts = self._forward("EXTEND", batch, [w.input_ids for w in batch])
        for w, t in zip(batch, nexts):
            if w.max_new_tokens > 0 and w.abort is None:
                w.output_ids.append(w.choose(w, t) if w.choose else t)
        while True:
            active = [w for w in batch if 0 < len(w.output_ids) < w.max_new_tokens and w.abort is None
                      and w.output_ids[-1] not in w.stop_ids]
            if not active:
                break
            nexts = self._forward("DECODE", active, [[w.output_ids[-1]] for w in active])
            for w, t in zip(active, nexts):
                w.output_ids.append(w.choose(w, t) if w.choose else t)

    def _forward(self, mode, batch, seqs):
        self.forward_pass_id += 1
        if self.light:
            out = []
            for s in seqs:
                acc = 0
                for t in s:
                    acc = (acc * 31 + t + 7) % 1000003
                out.append(acc % self.vocab)
            return out
        torch = self.model.torch
        flat = [t for s in seqs for t in s]
        lens = [len(s) for s in seqs]
        input_ids = torch.tensor(flat, dtype=torch.int64)
        last_index = torch.tensor([sum(lens[: i + 1]) - 1 for i in range(len(lens))], dtype=torch.int64)
        fb = self._forward_batch(mode, batch, seqs, input_ids) if self.hook is not None else None
        if fb is not None and self.batch_hook is not None:
            reqs = [NS(rid=w.rid, origin_input_ids=list(w.input_ids), output_ids=list(w.output_ids),
                       to_finish=None if w.abort is None else _finish_abort(w.abort),
                       finished_reason=None, finished=lambda: False)
                    for w in batch]
            self.batch_hook.run(self.hd, self.runner, fb, NS(reqs=reqs, forward_mode=fb.forward_mode))
        if fb is not None:
            self.runner.forward_pass_id = self.forward_pass_id
            ns = self.hook.namespace(self.hd, self.runner, fb)
            self.hook.run_pre(ns)
        aux, last, logits = self.model.forward(input_ids, last_index)
        nexts = logits.argmax(-1).tolist()
        if mode == "EXTEND" and aux is not None and knobs.record_dir():
            self._record(batch, lens, aux, last)
        if fb is not None:
            logits_output = NS(next_token_logits=logits, hidden_states=aux, last_hidden_states=last,
                               next_token_logprobs=None)
            output = NS(logits_output=logits_output, can_run_graph=False,
                        expert_distribution_metrics=None, routed_experts_output=None)
            self.hook.run(ns, output)
        return nexts

    def _record(self, batch, lens, aux, last):
        """PATCHCTL_SIM_RECORD_DIR: each prompt's rows exactly as the model computed them in its batch, kept
        apart from the hook's path (tests compare every dump with these, bit for bit)."""
        from safetensors.torch import save_file

        start = 0
        for w, n in zip(batch, lens):
            name = hashlib.sha256(str(w.rid).encode()).hexdigest()[:32] + ".safetensors"
            save_file({"aux_hidden_states": aux[start:start + n].contiguous(),
                       "hidden_states": last[start:start + n].contiguous()},
                      os.path.join(knobs.record_dir(), name), metadata={"rid": str(w.rid)})
            start += n

    def _forward_batch(self, mode, batch, seqs, input_ids):
        """A duck-typed ForwardBatch with the fields SGLang's has for this batch."""
        torch = self.model.torch
        lens = [len(s) for s in seqs]
        extend = mode == "EXTEND"
        if extend:
            seq_lens, prefix = lens, [0] * len(batch)
        else:
            seq_lens = [len(w.input_ids) + len(w.output_ids) for w in batch]
            prefix = [n - 1 for n in seq_lens]
        starts = [sum(lens[:i]) for i in range(len(lens))]
        i32, i64 = torch.int32, torch.int64
        return NS(
            forward_mode=ForwardMode(mode),
            rids=[w.rid for w in batch],
            input_ids=input_ids,
            positions=torch.tensor([p + j for p, n in zip(prefix, lens) for j in range(n)], dtype=i64),
            batch_size=len(batch),
            seq_lens=torch.tensor(seq_lens, dtype=i64),
            seq_lens_cpu=torch.tensor(seq_lens, dtype=i64),
            seq_lens_sum=sum(seq_lens),
            extend_seq_lens=torch.tensor(lens, dtype=i32) if extend else None,
            extend_prefix_lens=torch.tensor(prefix, dtype=i32) if extend else None,
            extend_start_loc=torch.tensor(starts, dtype=i32) if extend else None,
            extend_seq_lens_cpu=list(lens) if extend else None,
            extend_prefix_lens_cpu=list(prefix) if extend else None,
            extend_num_tokens=sum(lens) if extend else None,
            return_logprob=False,
            capture_hidden_mode=NS(name="FULL" if self.capture_ids else "NULL"),
        )
