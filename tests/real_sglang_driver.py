"""Run the patched hidden-dump module inside real SGLang 0.5.23 code, on CPU: one scenario per process.

Usage: python real_sglang_driver.py SPEC.json   (the patched tree first on PYTHONPATH)
       python real_sglang_driver.py --serve     (spec paths on stdin, one line each)

The plugin series instead (tests/test_real_sglang_plugin.py): a pristine tree first on
PYTHONPATH, the plugin's site directory before it, and spec "plugin_site" (that directory)
+ "dump_module" (the plugin's copy of the module): before anything else the scenario's process
runs SGLang's own `load_plugins()`, as `run_scheduler_process` does (see `load_plugins` below).

Every scenario and rank runs in a process of its own, so SGLang's process-wide state
(runtime context, process groups, the module's writer) is never shared and never enters
pytest.  The test (tests/test_real_sglang.py) runs `--serve` once per session: it imports
SGLang once (most of a scenario's start-up) and forks one fresh process per spec it is sent,
so each scenario starts from the same imported, not yet configured SGLang.  Everything below
is SGLang 0.5.23's own code, driven the way its scheduler and TP worker drive it:

    ServerArgs        `prepare_server_args` (SGLang's argparse) on the series' [smoke]
                      server_args + the scenario's flags; `runtime_context.publish` runs
                      SGLang's resolution pipeline and records this rank (`SpawnRanks`).
    process groups    `distributed.bootstrap.init_parallel_runtime` (SGLang's CPU path):
                      real GroupCoordinators on gloo, one process per rank, so the
                      attention-TP / DP ranks the module reads come from SGLang itself.
    ModelConfig       `ModelConfig.from_server_args` on the config.json the test writes.
    ModelRunner       the real class: `__init__` (spec aux-hidden-state resolution, sampler,
                      layer info, ...), `alloc_memory_pool` (KV pools sized by SGLang from
                      --max-total-tokens), `init_attention_backends` (the real
                      `configure_aux_hidden_state_capture`, torch_native attention backend
                      on CPU), `init_cuda_graphs` (gives the real EagerRunner on CPU) and
                      the patched `forward`.
    batches           real `Req`s, `PrefillAdder` (chunking, mixed-chunk budget),
                      `ScheduleBatch.init_new` / `prepare_for_extend` / `mix_with_running` /
                      `prepare_for_decode` / `convert_decode_to_extend`, the tree cache
                      (`create_tree_cache`, radix disabled by the profile),
                      `resolve_forward_inputs`, DP attention's `prepare_mlp_sync_batch_raw`
                      (a real gloo exchange between the DP ranks), and the (patched)
                      `ForwardBatch.init_new`.
    logits            the real `LogitsProcessor` builds the `LogitsProcessorOutput`.

Replaced, and why:
  * the model's weights and layers (`load_model` is overridden): a deterministic tiny torch
    module, because real weights/attention kernels are GPU-sized.  It keeps SGLang's model
    contract: the inner `.model.layers_to_capture` is set by the real
    `LlamaForCausalLM.set_eagle3_layers_to_capture` / `DeepseekV2ForCausalLM....` (bound as
    the tiny model's method), the hidden state *entering* each captured layer is captured
    (`AuxHiddenStateList.capture`, as LlamaModel does), the final state is RMS-normed, and
    `LogitsProcessor(input_ids, hidden, lm_head, forward_batch, aux)` is called as
    LlamaForCausalLM.forward does.  Its lm_head is this TP rank's vocab shard, so SGLang's
    own logits all-gather runs.
    Spec "model": "kimi_k3" loads SGLang's own Kimi-K3 classes at tiny size instead (their real
    set_dspark/set_dflash_layers_to_capture and capture loop; only the attention cores and the
    vision tower replaced): tests/real_sglang_k3.py, which says what and why.
  * attention kernels: none run (the tiny model has no attention); the real torch_native
    backend's metadata init still runs in EagerRunner.
  * GPU-only parts: device is "cpu", collectives go over gloo.  Three module-level choices
    SGLang makes only under its CPU engine (SGLANG_USE_CPU_ENGINE=1, unusable without the
    sgl_kernel CPU build) are made here for DP attention: see `_cpu_engine_padding`.
  * the scheduler loop and the sampler: this file calls the scheduler's building blocks in
    the scheduler's order (Scheduler.get_new_batch_prefill / get_next_batch_to_run /
    process_batch_result, handle_generate_request's logprob_start_len) and samples greedily
    from the real logits; the overlap scheduler's FutureMap is reduced to its
    `output_tokens_buf` (all `resolve_forward_inputs` reads).
  * target verify: capture mode loads no draft, so SGLang never schedules one; the running
    batch is scheduled as TARGET_VERIFY to show the hook skips that mode.
  * torchvision's C ops: see `_torchvision_without_ops` (PyPI's torchvision wheels link
    CUDA torch; no CPU build is reachable from CI).
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
import types
import uuid
from array import array
from pathlib import Path


def _torchvision_without_ops() -> None:
    """Let the real torchvision package import on a CPU-only torch.

    SGLang imports `torchvision.transforms` at module level (sglang/srt/configs/__init__.py ->
    nano_nemotron_vl -> multimodal/internvl_utils.py), so ModelConfig cannot import without
    it.  PyPI's linux torchvision wheels are linked against CUDA torch (libtorch_cuda.so,
    libc10_cuda.so), so their `_C` extension cannot load next to torch 2.13.0+cpu, and the
    matching `+cpu` build is only on download.pytorch.org.  torchvision handles a missing
    `_C` everywhere except `_meta_registrations.py`, which registers fake kernels for
    `torchvision::nms` / `torchvision::qnms` unconditionally and raises "operator
    torchvision::nms does not exist".  Declaring those two operator schemas (no kernels)
    lets the real package import; nothing here calls a torchvision operator.
    """
    import torch

    try:
        torch.ops.torchvision.nms
        return  # a torchvision whose ops loaded
    except (AttributeError, RuntimeError):
        pass
    torch.library.define("torchvision::nms", "(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    torch.library.define("torchvision::qnms", "(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")


_torchvision_without_ops()

import torch  # noqa: E402
from torch import nn  # noqa: E402

torch.set_num_threads(1)

VOCAB_SEED = 20231
DUMP_MODULE = "sglang.srt.hidden_dump"  # where the diff series puts the capture module

# The two methods the capture hooks (the diff series patches them; the plugin wraps them).
HOOKED = ("sglang.srt.model_executor.model_runner.ModelRunner.forward",
          "sglang.srt.model_executor.forward_batch_info.ForwardBatch.init_new")

# --------------------------------------------------------------------------- plugins


def load_plugins(site: str) -> dict:
    """SGLang's own plugin loading, as `run_scheduler_process` does it first thing
    (managers/scheduler.py:6323): `sglang.srt.plugins.load_plugins()` discovers the
    `sglang.srt.plugins` entry points with importlib.metadata, filters them by SGLANG_PLUGINS,
    runs each, then `HookRegistry.apply_hooks()`.

    `site` (spec "plugin_site") is a plugin site directory: the test puts it first on the
    fork server's PYTHONPATH (as patchctl puts it on the server's), so it is on sys.path before
    anything asks importlib.metadata; if it is not, it goes first now and the import system's
    caches (importlib.metadata's path cache among them) are dropped.  Returns what SGLang found
    and ran, for the test."""
    import importlib
    from importlib.metadata import entry_points

    site = str(Path(site).resolve())
    added = site not in sys.path
    if added:
        sys.path.insert(0, site)
        importlib.invalidate_caches()
    from sglang.srt.plugins import GENERAL_PLUGINS_GROUP
    from sglang.srt.plugins import load_plugins as sglang_load_plugins
    from sglang.srt.plugins.hook_registry import HookRegistry

    sglang_load_plugins()
    found = [{"name": ep.name, "value": ep.value, "dist": ep.dist.name if ep.dist else None,
              "dist_path": str(ep.dist.locate_file("")) if ep.dist else None}
             for ep in entry_points(group=GENERAL_PLUGINS_GROUP)]
    return {
        "site": site,
        "site_index_on_sys_path": sys.path.index(site),
        "site_added_by_driver": added,
        "sglang_plugins_env": os.environ.get("SGLANG_PLUGINS"),
        "entry_points": found,
        "registered": {t: [[ht.value, "%s.%s" % (h.__module__, h.__qualname__),
                            src.plugin_name if src else None, src.dist_name if src else None]
                           for ht, h, src in hooks] for t, hooks in HookRegistry._hooks.items()},
        "patched": sorted(HookRegistry._patched),
        "modules": {m: getattr(sys.modules[m], "__file__", None) for m in sorted(sys.modules)
                    if m.split(".")[0] in {ep["value"].split(":")[0].split(".")[0] for ep in found}},
    }


def hook_facts() -> dict:
    """For each method the capture hooks (and any other target a plugin registered): what the
    attribute is now, i.e. the chain of HookRegistry wrappers (`_wrap_fn`, each with the
    `__wrapped__` it wraps) down to the original function, and where that original is defined."""
    import inspect
    import pkgutil

    targets = set(HOOKED)
    if "sglang.srt.plugins.hook_registry" in sys.modules:
        targets |= set(sys.modules["sglang.srt.plugins.hook_registry"].HookRegistry._hooks)
    out = {}
    for target in sorted(targets):
        obj_path, attr = target.rsplit(".", 1)
        obj = pkgutil.resolve_name(obj_path)
        raw = obj.__dict__.get(attr) if isinstance(obj, type) else getattr(obj, attr)
        kind = type(raw).__name__ if isinstance(raw, (classmethod, staticmethod)) else "function"
        fn = raw.__func__ if isinstance(raw, (classmethod, staticmethod)) else raw
        chain = []
        while getattr(getattr(fn, "__code__", None), "co_filename", "").endswith(
                os.path.join("plugins", "hook_registry.py")):
            hook = inspect.getclosurevars(fn).nonlocals.get("hook")
            chain.append("%s.%s" % (hook.__module__, hook.__qualname__))
            fn = fn.__wrapped__
        out[target] = {
            "kind": kind,
            "wrapped": hasattr(raw.__func__ if kind != "function" else raw, "__wrapped__"),
            "hooks": chain,
            "original": "%s.%s" % (fn.__module__, fn.__qualname__),
            "original_file": fn.__code__.co_filename,
        }
    return out


# --------------------------------------------------------------------------- the harness


class Harness:
    """One rank of one SGLang server, built from SGLang's own pieces (see module doc)."""

    def __init__(self, spec: dict):
        self.spec = spec
        self.t0 = time.monotonic()
        self.timings = {}
        from sglang.srt import runtime_context as rc
        from sglang.srt.server_args import prepare_server_args

        argv = ["--model-path", spec["model_dir"], "--device", "cpu", "--skip-tokenizer-init",
                "--max-total-tokens", "4096", "--max-running-requests", "16",
                "--mem-fraction-static", "0.5", "--log-level", "warning"]
        argv += list(spec.get("server_args", []))
        self.argv = argv
        self.server_args = sa = prepare_server_args(argv)
        self.world_rank = int(spec.get("world_rank", 0))
        rc.publish(sa, role="scheduler", ranks=rc.SpawnRanks(world_rank=self.world_rank,
                                                             gpu_id=self.world_rank))
        self.rc = rc
        self._mark("server_args")

        from sglang.srt.distributed.bootstrap import init_layer_runtime, init_parallel_runtime

        init_parallel_runtime(server_args=sa, device="cpu", dist_port=int(spec["dist_port"]))
        self._mark("process_groups")

        from sglang.srt.configs.model_config import ModelConfig

        self.model_config = mc = ModelConfig.from_server_args(sa)
        init_layer_runtime(model_config=mc)

        from sglang.srt.model_executor.model_runner import ModelRunner

        class CpuHarnessModelRunner(ModelRunner):
            """The real ModelRunner; only the model it loads is the tiny one."""

            def load_model(self):
                self.model = _load_model(spec, self.model_config)
                self.dtype = self.model_config.dtype
                self.sliding_window_size = None
                self.weight_load_mem_usage = 0

        self.runner = mr = CpuHarnessModelRunner(
            model_config=mc, mem_fraction_static=0.5, gpu_id=self.world_rank,
            nccl_port=int(spec["dist_port"]), server_args=sa)
        mr.alloc_memory_pool()
        mr.init_attention_backends()
        _cpu_engine_padding(mr.attn_backend)
        mr.init_cuda_graphs()
        self._mark("model_runner")

        self.tree_cache = self._tree_cache()
        from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

        self.spec_algorithm = SpeculativeAlgorithm.from_string(
            rc.get_spec().speculative_algorithm)
        # The overlap scheduler's FutureMap, reduced to what resolve_forward_inputs reads.
        self.future_map = types.SimpleNamespace(
            spec_algo=self.spec_algorithm,
            output_tokens_buf=torch.zeros(mr.req_to_token_pool.size + 2, dtype=torch.int64))
        self.running = None  # ScheduleBatch of decoding requests
        self.waiting = []
        self.chunked_req = None
        self.forwards = []
        self.out_dir = Path(spec["out_dir"])
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.notes = {}

    def _mark(self, what: str) -> None:
        self.timings[what] = round(time.monotonic() - self.t0, 2)

    def _tree_cache(self):
        from sglang.srt.mem_cache.cache_init_params import CacheInitParams
        from sglang.srt.mem_cache.registry import TreeCacheBuildContext, create_tree_cache

        rc, mr = self.rc, self.runner
        p = rc.get_parallel()
        params = CacheInitParams(
            disable=rc.get_memory().disable_radix_cache,
            req_to_token_pool=mr.req_to_token_pool,
            token_to_kv_pool_allocator=mr.token_to_kv_pool_allocator,
            page_size=mr.page_size or 1,
            tp_cache_group=p.tp_group.cpu_group,
            attn_tp_cache_group=p.attn_tp_group.cpu_group,
            attn_cp_cache_group=p.attn_cp_group.cpu_group,
            pp_cache_group=p.pp_group.cpu_group,
            chunked_prefill_size=rc.get_schedule().chunked_prefill_size,
        )
        ctx = TreeCacheBuildContext(
            server_args=self.server_args, params=params, is_hybrid_swa=False,
            is_hybrid_ssm=False, enable_hierarchical_cache=False,
            disable_radix_cache=rc.get_memory().disable_radix_cache, tp_worker=None,
            model_config=self.model_config, tp_size=p.tp_size, tp_rank=p.tp_rank,
            tp_group=p.tp_group)
        return create_tree_cache(ctx)

    # ----------------------------------------------------------------- requests

    def req(self, rid: str, n: int, *, seed: int = 0, ids=None, max_new_tokens: int = 8,
            return_logprob: bool = False, top_logprobs_num: int = 0):
        """A real Req, as the tokenizer manager hands it to the scheduler."""
        from sglang.srt.managers.schedule_batch import Req
        from sglang.srt.sampling.sampling_params import SamplingParams

        if ids is None:
            g = torch.Generator().manual_seed(VOCAB_SEED + seed)
            ids = torch.randint(3, self.model_config.vocab_size, (n,), generator=g).tolist()
        sp = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0)
        sp.normalize(None)
        sp.verify(self.model_config.vocab_size)
        r = Req(str(rid), "", array("q", ids), sp, return_logprob=return_logprob,
                top_logprobs_num=top_logprobs_num, vocab_size=self.model_config.vocab_size)
        # Scheduler.handle_generate_request: without logprobs only the last token needs
        # them (-1); the logprob case asks for the input logprobs from token 0.
        r.logprob_start_len = 0 if return_logprob else -1
        return r

    def submit(self, *reqs) -> None:
        self.waiting.extend(reqs)

    # ----------------------------------------------------------------- scheduling

    def _prefill_batch(self, mixed: bool):
        """Scheduler.get_new_batch_prefill, in its order, with the real PrefillAdder."""
        from sglang.srt.managers.schedule_batch import ScheduleBatch
        from sglang.srt.managers.schedule_policy import AddReqResult, PrefillAdder

        rc, mr = self.rc, self.runner
        running = self.running
        running_bs = len(running.reqs) if running is not None else 0
        chunk = rc.get_schedule().chunked_prefill_size
        chunk = None if chunk is None or chunk <= 0 else chunk
        adder = PrefillAdder(
            mr.page_size or 1, self.tree_cache, mr.token_to_kv_pool_allocator, running,
            0.7, rc.get_schedule().max_prefill_tokens, chunk,
            running_bs if mixed else 0, max_running_requests=mr.max_running_requests)
        if self.chunked_req is not None:
            self.chunked_req.init_next_round_input()
            self.chunked_req = adder.add_chunked_req(self.chunked_req)
        for r in list(self.waiting):
            r.init_next_round_input(self.tree_cache)
            res = adder.add_one_req(r, has_chunked_req=self.chunked_req is not None,
                                    truncation_align_size=None)
            if res != AddReqResult.CONTINUE:
                break
        can_run = adder.can_run_list
        if not can_run:
            return None
        self.waiting = [r for r in self.waiting if r not in can_run]
        if adder.new_chunked_req is not None:
            self.chunked_req = adder.new_chunked_req
        b = ScheduleBatch.init_new(can_run, mr.req_to_token_pool, mr.token_to_kv_pool_allocator,
                                   self.tree_cache, self.model_config, False, self.spec_algorithm,
                                   chunked_req=self.chunked_req)
        b.prepare_for_extend()
        b.decoding_reqs = None
        if mixed and running is not None and not running.is_empty():
            running.filter_batch()
            if not running.is_empty() and running.check_decode_mem():
                running.prepare_for_decode()
                b.mix_with_running(running)
                b.decoding_reqs = running.reqs
                self.running = None
        return b

    def step_prefill(self, mixed: bool = False, label: str = "prefill") -> dict:
        b = self._prefill_batch(mixed)
        assert b is not None, "nothing to prefill"
        return self._run(b, label)

    def step_decode(self, label: str = "decode", convert_to_extend: bool = False) -> dict:
        b = self.running
        assert b is not None and not b.is_empty(), "nothing running"
        b.prepare_for_decode()
        if convert_to_extend:
            # What DP attention's maybe_convert_decode_to_extend does when a peer prefills and
            # the prefill CUDA graph can replay (a GPU-only vote): the real method.
            b.convert_decode_to_extend()
        return self._run(b, label)

    def step_idle(self, label: str = "idle") -> dict:
        from sglang.srt.managers.schedule_batch import ScheduleBatch

        mr = self.runner
        b = ScheduleBatch.init_new([], mr.req_to_token_pool, mr.token_to_kv_pool_allocator,
                                   self.tree_cache, self.model_config, False, self.spec_algorithm)
        b.prepare_for_idle()
        return self._run(b, label)

    def step_target_verify(self, label: str = "target_verify") -> dict:
        """A target-verify forward over the running requests.

        Capture mode loads no draft, so SGLang never builds an EagleVerifyInput here; the
        running batch, prepared for decode, is scheduled as TARGET_VERIFY (one token per
        request) to show the hook skips that mode."""
        from sglang.srt.model_executor.forward_batch_info import ForwardMode

        b = self.running
        assert b is not None and not b.is_empty()
        b.prepare_for_decode()
        b.forward_mode = ForwardMode.TARGET_VERIFY
        rec = self._run(b, label, sample=False)
        b.forward_mode = ForwardMode.DECODE
        return rec

    def _run(self, batch, label: str, sample: bool = True) -> dict:
        """TpWorker.forward_batch_generation: resolve inputs, (DP) mlp sync, init, forward."""
        from sglang.srt.managers.overlap_utils import resolve_forward_inputs
        from sglang.srt.model_executor.forward_batch_info import ForwardBatch

        rc, mr = self.rc, self.runner
        resolve_forward_inputs(batch, self.future_map)
        if rc.get_parallel().attn_dp_size > 1:
            from sglang.srt.managers.scheduler_components.dp_attn import (
                prepare_mlp_sync_batch_raw,
            )
            from sglang.srt.utils.common import require_mlp_tp_gather

            batch = prepare_mlp_sync_batch_raw(
                batch, model_runner=mr, get_idle_batch=self._idle_batch,
                disable_cuda_graph=True, require_mlp_tp_gather=require_mlp_tp_gather(),
                disable_overlap_schedule=True, offload_tags=set())
        scheduled = batch.forward_mode
        fb = ForwardBatch.init_new(batch, mr, return_hidden_states_before_norm=False)
        rec = {
            "label": label,
            "scheduled_mode": scheduled.name,
            "rids": list(fb.rids or []),
            "extend_seq_lens": list(fb.extend_seq_lens_cpu) if fb.extend_seq_lens_cpu is not None else None,
            "extend_prefix_lens": list(fb.extend_prefix_lens_cpu) if fb.extend_prefix_lens_cpu is not None else None,
            "prompt_lens": [len(r.origin_input_ids) for r in batch.reqs],
            "noted_prompt_lens": getattr(fb, "hidden_dump_prompt_lens", None),
            "noted_aborted": getattr(fb, "hidden_dump_aborted", None),
            "capture_hidden_mode": fb.capture_hidden_mode.name,
        }
        out = mr.forward(fb)
        lo = out.logits_output
        rec["mode_after_forward"] = fb.forward_mode.name
        rec["returned"] = type(out).__name__
        rec["logits_output"] = type(lo).__name__
        tensors = {"input_ids": fb.input_ids.detach().to(torch.int64).contiguous()}
        for name, attr in (("aux", "hidden_states"), ("last", "last_hidden_states")):
            t = getattr(lo, attr, None)
            rec[name + "_shape"] = list(t.shape) if t is not None else None
            if t is not None:
                tensors[name] = t.detach().contiguous()
        rec["ids_rows"] = int(fb.input_ids.shape[0])
        itl = getattr(lo, "input_token_logprobs", None)
        rec["input_token_logprobs"] = list(itl.shape) if isinstance(itl, torch.Tensor) else (
            None if itl is None else len(itl))
        idx = len(self.forwards)
        from safetensors.torch import save_file

        fname = "forward%d.safetensors" % idx
        save_file(tensors, str(self.out_dir / fname))
        rec["tensors"] = fname
        self.forwards.append(rec)
        if sample and batch.reqs:
            self._process_result(batch, lo)
        return rec

    def _idle_batch(self):
        from sglang.srt.managers.schedule_batch import ScheduleBatch

        mr = self.runner
        b = ScheduleBatch.init_new([], mr.req_to_token_pool, mr.token_to_kv_pool_allocator,
                                   self.tree_cache, self.model_config, False, self.spec_algorithm)
        b.prepare_for_idle()
        return b

    def _process_result(self, batch, lo) -> None:
        """Scheduler.process_batch_result (greedy sampling): a finished prefill and a decode
        row append a token; a chunk in progress stays the chunked request."""
        from sglang.srt.mem_cache.common import checkpoint_kv_cache

        bs = len(batch.reqs)
        next_ids = torch.argmax(lo.next_token_logits[:bs].float(), dim=-1).to(torch.int64)
        keep = []
        for i, r in enumerate(batch.reqs):
            if r is self.chunked_req:
                continue
            r.output_ids.append(int(next_ids[i]))
            keep.append(r)
        self.future_map.output_tokens_buf[batch.req_pool_indices[:bs].long()] = next_ids
        batch.input_ids = next_ids  # non-overlap: the next decode's input
        if self.chunked_req is not None:
            checkpoint_kv_cache(self.chunked_req, self.tree_cache)  # stash_chunked_request
        # Merge into the running batch (Scheduler.get_next_batch_to_run).
        if batch.forward_mode.is_extend() or batch.forward_mode.is_mixed():
            exclude = [self.chunked_req] if self.chunked_req is not None else []
            batch.filter_batch(reqs_to_exclude=exclude)
            if not batch.is_empty() and batch is not self.running:
                if self.running is None or self.running.is_empty():
                    self.running = batch
                else:
                    self.running.merge_batch(batch)

    # ----------------------------------------------------------------- results

    def dump_module(self):
        """The capture module as this process imported it (None if nothing imported it): the diff
        series' `sglang.srt.hidden_dump` (imported by the patched model_runner), or the plugin's
        copy (spec "dump_module", imported by SGLang's `load_plugins`).  Never imported here: a
        plugin SGLang skipped stays unimported."""
        return sys.modules.get(self.spec.get("dump_module", DUMP_MODULE))

    def listing(self) -> list:
        """The dump directory once the module's writer has finished what it accepted."""
        hidden_dump = self.dump_module()
        if hidden_dump is not None:
            hidden_dump.flush(60.0)
        d = Path(os.environ["SGLANG_HIDDEN_DUMP_DIR"])
        return sorted(os.listdir(d)) if d.is_dir() else []

    def facts(self) -> dict:
        from sglang.srt.arg_groups.overrides import resolution_result
        from sglang.srt.model_executor.forward_batch_info import (
            get_server_return_hidden_states_mode,
        )

        rc, mr, sa = self.rc, self.runner, self.server_args
        p = rc.get_parallel()
        res = {}
        for k in ("speculative_algorithm", "speculative_draft_model_path",
                  "enable_return_aux_hidden_states", "return_aux_hidden_state_layer_ids",
                  "return_hidden_states_mode", "chunked_prefill_size", "disable_radix_cache",
                  "enable_mixed_chunk", "tp_size", "dp_size"):
            try:
                v = resolution_result(sa, k)
                res[k] = list(v) if isinstance(v, (list, tuple)) else v
            except Exception as e:  # a name this version does not resolve
                res[k] = "unresolved: %s" % e
        sac = mr.spec_aux_config
        inner = mr.model.model
        if spec_model(self.spec) == "kimi_k3":  # the real Kimi-K3 classes (real_sglang_k3.py)
            from real_sglang_k3 import k3_facts

            inner = types.SimpleNamespace(layers_to_capture=[])
            mr.model.real_class = type(mr.model).__name__
            mr.model.capture_aux_hidden_states = mr.model.language_model.capture_aux_hidden_states
            self.notes["kimi_k3"] = k3_facts(mr.model)
        return {
            "resolved": res,
            "aux_hidden_state_capture": rc.get_exec().features.aux_hidden_state_capture,
            "server_capture_hidden_mode": get_server_return_hidden_states_mode().name,
            "spec_algorithm": self.spec_algorithm.name if hasattr(self.spec_algorithm, "name") else str(self.spec_algorithm),
            "spec_algorithm_is_none": bool(self.spec_algorithm.is_none()),
            "draft_model_config": None if sac.draft_model_config is None else "loaded",
            "eagle_use_aux_hidden_state": bool(sac.eagle_use_aux_hidden_state),
            "eagle_aux_hidden_state_layer_ids": sac.eagle_aux_hidden_state_layer_ids,
            "capture_aux_hidden_states": bool(mr.model.capture_aux_hidden_states),
            "set_eagle3_layers_to_capture_of": mr.model.real_class,
            "layers_to_capture": list(inner.layers_to_capture),
            "model_arch": mr.model_config.hf_config.architectures[0],
            "attention_arch": mr.model_config.attention_arch.name,
            "kv_pool": type(mr.token_to_kv_pool).__name__,
            "hidden_size": mr.model_config.hidden_size,
            "num_hidden_layers": mr.model_config.num_hidden_layers,
            "is_draft_worker": bool(mr.is_draft_worker),
            "runner_class_mro": [c.__name__ for c in type(mr).__mro__[:2]],
            "eager_runner": type(mr.eager_runner).__name__,
            "attn_backend": type(mr.attn_backend).__name__,
            "ranks": {k: getattr(p, k) for k in ("tp_rank", "tp_size", "attn_tp_rank",
                                                  "attn_tp_size", "attn_dp_rank", "attn_dp_size")},
            "hooks": hook_facts(),
            "timings": self.timings,
        }

    def result(self) -> dict:
        hidden_dump = self.dump_module()
        flushed = hidden_dump.flush(60.0) if hidden_dump is not None else None
        d = Path(os.environ.get("SGLANG_HIDDEN_DUMP_DIR") or self.spec["dump_dir"])
        files = sorted(p.name for p in d.iterdir()) if d.is_dir() else []
        log = d / "_hidden_dump_errors.log"
        self._mark("done")
        return {
            "ok": True,
            "facts": self.facts(),
            "forwards": self.forwards,
            "stats": hidden_dump.stats() if hidden_dump is not None else None,
            "flushed": flushed,
            "files": files,
            "errors_log": log.read_text() if log.is_file() else "",
            "dump_module": self.spec.get("dump_module", DUMP_MODULE),
            "module_file": hidden_dump.__file__ if hidden_dump is not None else None,
            "notes": self.notes,
        }


def _cpu_engine_padding(backend) -> None:
    """What SGLang's CPU engine sets for DP-attention padding, without importing it.

    `ForwardBatch.prepare_mlp_sync_batch` pins a host tensor unless the module-level
    `forward_batch_info._is_cpu` is true (forward_batch_info.py:1948 in the pristine tree; every other copy there
    asks `is_pin_memory_available(device)`), and `_pad_inputs_to_size` asks the attention
    backend for a padded row's seq_len through `get_cpu_graph_seq_len_fill_value` when
    `_is_cpu` (:2013-2017).  `_is_cpu` comes from SGLANG_USE_CPU_ENGINE=1, which cannot be
    set here: it makes sglang import the sgl_kernel CPU build (not on PyPI) at import time.
    So: `_is_cpu = True` in that one module, and the torch_native backend answers the fill
    value as SGLang's CPU backend (intel_amx_backend.py:198) and every GPU backend do: 1.
    Likewise DP attention's gather copies rows with a triton kernel unless `_is_cpu`
    (layers/dp_attention.py:644): the CPU engine's `memcpy_cpu` (a plain slice copy) is
    selected instead.
    """
    from sglang.srt.layers import dp_attention
    from sglang.srt.model_executor import forward_batch_info

    forward_batch_info._is_cpu = True
    dp_attention.memcpy_func = dp_attention.memcpy_cpu
    if not hasattr(backend, "get_cpu_graph_seq_len_fill_value"):
        backend.get_cpu_graph_seq_len_fill_value = lambda: 1


# --------------------------------------------------------------------------- the tiny model


def spec_model(spec: dict) -> str:
    return spec.get("model", "tiny")


def _load_model(spec: dict, model_config):
    """The model the harness's ModelRunner loads: the tiny one, or (spec "model": "kimi_k3") SGLang's own Kimi-K3
    classes at tiny size (tests/real_sglang_k3.py, which says what it replaces)."""
    if spec_model(spec) == "kimi_k3":
        from real_sglang_k3 import build_kimi_k3

        model_config.hf_config.architectures = ["KimiK3ForConditionalGeneration"]
        return build_kimi_k3(model_config)
    return TinyCausalLM(model_config)


class _TinyInner(nn.Module):
    """Stands in for LlamaModel / DeepseekV2Model: per-layer residual updates, the hidden
    state *entering* layer i captured when i is in `layers_to_capture`, final RMS norm."""

    def __init__(self, cfg, H: int, N: int, V: int):
        super().__init__()
        g = torch.Generator().manual_seed(1234)
        self.config = cfg
        self.embed = (torch.randn(V, H, generator=g) * 0.5).to(torch.bfloat16)
        self.pos = (torch.randn(8192, H, generator=g) * 0.1).to(torch.bfloat16)
        self.w = [(torch.randn(H, H, generator=g) / H ** 0.5).to(torch.bfloat16) for _ in range(N)]
        self.num_layers = N
        self.layers_to_capture = []
        self.start_layer, self.end_layer = 0, N

    def forward(self, input_ids, positions, forward_batch):
        from sglang.srt.layers.aux_hidden_states import AuxHiddenStateList

        h = self.embed[input_ids] + self.pos[positions]
        aux = AuxHiddenStateList()
        for i in range(self.num_layers):
            if i in self.layers_to_capture:
                aux.capture(h)
            h = h + torch.tanh(h @ self.w[i])
        h = (h.float() * torch.rsqrt(h.float().pow(2).mean(-1, keepdim=True) + 1e-6)).to(h.dtype)
        return (h, aux) if len(aux) else h


class TinyCausalLM(nn.Module):
    """Stands in for <Arch>ForCausalLM; `set_eagle3_layers_to_capture` is the real class's."""

    def __init__(self, model_config):
        super().__init__()
        from sglang.srt.configs.shared_experts import SharedExpertsConfig
        from sglang.srt.layers.logits_processor import LogitsProcessor
        from sglang.srt.runtime_context import get_parallel

        cfg = model_config.hf_config
        p = get_parallel()
        self.config = cfg
        self.pp_group = p.pp_group
        H, N, V = model_config.hidden_size, model_config.num_hidden_layers, model_config.vocab_size
        self.model = _TinyInner(cfg, H, N, V)
        g = torch.Generator().manual_seed(99)
        full = (torch.randn(V, H, generator=g) * 0.1).to(torch.bfloat16)
        shard = V // p.tp_size
        # This TP rank's vocab shard (ParallelLMHead's layout): SGLang gathers the logits.
        self.lm_head = nn.Module()
        self.lm_head.weight = nn.Parameter(full[p.tp_rank * shard:(p.tp_rank + 1) * shard].clone(),
                                           requires_grad=False)
        self.logits_processor = LogitsProcessor(cfg)
        self.capture_aux_hidden_states = False
        self.shared_experts_config = SharedExpertsConfig()
        self.start_layer, self.end_layer = 0, N
        arch = (cfg.architectures or ["LlamaForCausalLM"])[0]
        if "Deepseek" in arch:
            from sglang.srt.models.deepseek_v2 import DeepseekV2ForCausalLM as real
        else:
            from sglang.srt.models.llama import LlamaForCausalLM as real
        self.real_class = real.__name__
        # The real layer-numbering logic, run on this model.
        self.set_eagle3_layers_to_capture = types.MethodType(real.set_eagle3_layers_to_capture, self)

    def get_input_embeddings(self):
        return None

    @torch.no_grad()
    def forward(self, input_ids, positions, forward_batch, input_embeds=None,
                get_embedding=False, pp_proxy_tensors=None):
        hidden = self.model(input_ids, positions, forward_batch)
        aux = None
        if self.capture_aux_hidden_states:
            hidden, aux = hidden
        return self.logits_processor(input_ids, hidden, self.lm_head, forward_batch, aux)


# --------------------------------------------------------------------------- scenarios
# Each returns nothing; the forwards and the module's files are the result.  Rids the test
# expects to be written start with "patchctl-" (the series' smoke rid prefix).


def sc_extend(h: Harness) -> None:
    h.submit(h.req("patchctl-a", 5, seed=1), h.req("patchctl-b", 9, seed=2),
             h.req("patchctl-c", 3, seed=3), h.req("other-client-1", 4, seed=4))
    h.step_prefill()


def sc_decode(h: Harness) -> None:
    h.submit(h.req("patchctl-a", 6, seed=1), h.req("patchctl-b", 4, seed=2))
    h.step_prefill()
    h.notes["after_prefill"] = h.listing()
    h.step_decode()
    h.step_decode()
    # DP attention turns a decode batch into 1-token extends when a peer prefills and the
    # prefill graph can replay: the scheduled mode is EXTEND then.
    h.step_decode(label="decode_as_extend", convert_to_extend=True)


def sc_target_verify(h: Harness) -> None:
    h.submit(h.req("patchctl-a", 6, seed=1), h.req("patchctl-b", 4, seed=2))
    h.step_prefill()
    h.notes["after_prefill"] = h.listing()
    h.step_target_verify()


def sc_health_check(h: Harness) -> None:
    from sglang.srt.constants import HEALTH_CHECK_RID_PREFIX

    # What /health_generate sends (entrypoints/http_server.py: rid, input_ids=[0]).
    hc = h.req(f"{HEALTH_CHECK_RID_PREFIX}_{uuid.uuid4().hex}", 1, ids=[0], max_new_tokens=1)
    h.notes["health_rid"] = hc.rid
    h.submit(hc, h.req("patchctl-a", 5, seed=1))
    h.step_prefill()


def sc_ranks(h: Harness) -> None:
    """Plain TP: every rank runs the same batch; only attention-TP rank 0 writes."""
    h.submit(h.req("patchctl-a", 5, seed=1), h.req("patchctl-b", 7, seed=2))
    h.step_prefill()


def sc_dp_attention(h: Harness) -> None:
    """--tp 4 --dp 2 --enable-dp-attention: DP group 0 (ranks 0, 1) and group 1 (ranks 2, 3)
    run different requests; SGLang pads each rank's rows (and syncs token counts over gloo)."""
    group = h.rc.get_parallel().attn_dp_rank
    if group == 0:
        h.submit(h.req("patchctl-g0-a", 7, seed=10), h.req("patchctl-g0-b", 4, seed=11))
    else:
        h.submit(h.req("patchctl-g1-a", 5, seed=20))
    h.step_prefill(label="prefill_both_groups")
    # Group 0 prefills again while group 1 decodes: different modes in one synced step.
    if group == 0:
        h.submit(h.req("patchctl-g0-c", 3, seed=12))
        h.step_prefill(label="prefill_g0_decode_g1")
    else:
        h.step_decode(label="prefill_g0_decode_g1")
    # Group 1 idles while group 0 decodes.
    if group == 0:
        h.step_decode(label="decode_g0_idle_g1")
    else:
        h.step_idle(label="decode_g0_idle_g1")


def sc_mixed_chunk(h: Harness) -> None:
    """--enable-mixed-chunk --chunked-prefill-size 8: running requests' decode tokens ride in
    the prefill batch (MIXED) as 1-token extends after the prefill rows; a long prompt's first
    chunk too."""
    h.submit(h.req("patchctl-a", 5, seed=1))
    h.step_prefill(label="prefill_a")
    h.submit(h.req("patchctl-b", 4, seed=2))
    h.step_prefill(mixed=True, label="mixed_b_with_a")
    h.submit(h.req("patchctl-c", 3, seed=3))
    h.step_prefill(mixed=True, label="mixed_c_with_ab")
    # A prompt longer than what is left of the chunk budget (8 - 3 decode rows): its first
    # chunk rides in the mixed batch.
    h.submit(h.req("patchctl-d", 12, seed=4))
    h.step_prefill(mixed=True, label="mixed_d_chunk_with_abc")


def sc_chunked(h: Harness) -> None:
    """--chunked-prefill-size 8: a 20-token prompt arrives in chunks 8 + 8 + 4; a 5-token
    prompt that fits one chunk's budget is whole."""
    h.submit(h.req("patchctl-long", 20, seed=5))
    for i in range(3):
        h.step_prefill(label="chunk%d" % i)
    h.submit(h.req("patchctl-short", 5, seed=6))
    h.step_prefill(label="short")


def sc_warmup(h: Harness) -> None:
    """The server's start-up warm-up: /generate without a rid (entrypoints/http_server.py
    _execute_server_warmup); GenerateReqInput normalisation gives it uuid4().hex."""
    from sglang.srt.managers.io_struct import GenerateReqInput

    gri = GenerateReqInput(input_ids=[10, 11, 12, 13, 14, 15], sampling_params={"max_new_tokens": 8})
    gri.normalize_batch_and_arguments()
    h.notes["warmup_rid"] = gri.rid
    h.submit(h.req(gri.rid, 6, ids=gri.input_ids), h.req("patchctl-a", 5, seed=1))
    h.step_prefill()


def sc_logprob(h: Harness) -> None:
    h.submit(h.req("patchctl-a", 6, seed=1, return_logprob=True, top_logprobs_num=2),
             h.req("patchctl-b", 4, seed=2, return_logprob=True))
    h.step_prefill()


def sc_aborted(h: Harness) -> None:
    """Requests the scheduler aborts before their prefill, beside normal ones in one batch.

    Scheduler.handle_generate_request validates the prompt length with the real
    `validate_input_length` against `max_req_input_len` (the real
    `TpModelWorker.get_worker_info`, on this runner) and on failure calls the real
    `Req.set_finish_with_abort`, which leaves a 1-token stub ([0], `to_finish` set) that is
    still queued and prefilled (managers/scheduler.py:3245-3252).  The grammar manager's
    abort of a queued request (AbortReq) calls the same method.  A genuine 1-token prompt
    [0] rides along: the stub's rows look exactly like it."""
    from sglang.srt.managers.tp_worker import TpModelWorker
    from sglang.srt.managers.utils import validate_input_length

    mr = h.runner
    worker = types.SimpleNamespace(model_runner=mr, model_config=h.model_config,
                                   dllm_algorithm=None, random_seed=0, device="cpu")
    max_req_input_len = TpModelWorker.get_worker_info(worker)[5]
    long_req = h.req("patchctl-too-long", max_req_input_len, seed=7)
    err = validate_input_length(long_req, max_req_input_len, False)
    assert err, "a prompt of max_req_input_len tokens was accepted"
    long_req.set_finish_with_abort(err)
    client_abort = h.req("patchctl-client-abort", 6, seed=8)
    client_abort.set_finish_with_abort("Aborted by AbortReq.")
    h.notes["max_req_input_len"] = max_req_input_len
    h.notes["abort_error"] = err
    h.notes["stub_ids"] = [list(r.origin_input_ids) for r in (long_req, client_abort)]
    h.notes["to_finish"] = [type(r.to_finish).__name__ for r in (long_req, client_abort)]
    h.submit(h.req("patchctl-a", 5, seed=1), long_req, h.req("patchctl-one", 1, ids=[0]),
             client_abort, h.req("patchctl-b", 7, seed=2))
    h.step_prefill()


def sc_no_capture(h: Harness) -> None:
    h.submit(h.req("patchctl-a", 5, seed=1))
    h.step_prefill()


def sc_layers(h: Harness) -> None:
    h.submit(h.req("patchctl-a", 5, seed=1))
    h.step_prefill()


SCENARIOS = {
    "extend": sc_extend,
    "decode": sc_decode,
    "target_verify": sc_target_verify,
    "health_check": sc_health_check,
    "ranks": sc_ranks,
    "dp_attention": sc_dp_attention,
    "mixed_chunk": sc_mixed_chunk,
    "chunked": sc_chunked,
    "warmup": sc_warmup,
    "logprob": sc_logprob,
    "aborted": sc_aborted,
    "no_capture": sc_no_capture,
    "layers": sc_layers,
}


def main(argv) -> int:
    spec = json.loads(Path(argv[1]).read_text())
    out = Path(spec["out_dir"]) / "result.json"
    try:
        plugins = load_plugins(spec["plugin_site"]) if spec.get("plugin_site") else None
        h = Harness(spec)
        SCENARIOS[spec["scenario"]](h)
        res = h.result()
        res["plugins"] = plugins
    except BaseException as e:  # the test shows this instead of a bare exit status
        res = {"ok": False, "error": "%s: %s" % (type(e).__name__, e),
               "traceback": traceback.format_exc()}
        Path(spec["out_dir"]).mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(res, indent=1, default=str))
        return 1
    out.write_text(json.dumps(res, indent=1, default=str))
    return 0


# --------------------------------------------------------------------------- the fork server

# Every SGLang module a scenario imports (what `--serve` imports once, before forking).
PRELOAD = (
    "sglang.srt.runtime_context", "sglang.srt.server_args", "sglang.srt.distributed.bootstrap",
    "sglang.srt.configs.model_config", "sglang.srt.model_executor.model_runner",
    "sglang.srt.managers.schedule_batch", "sglang.srt.managers.schedule_policy",
    "sglang.srt.mem_cache.cache_init_params", "sglang.srt.mem_cache.registry",
    "sglang.srt.mem_cache.common", "sglang.srt.managers.overlap_utils",
    "sglang.srt.model_executor.forward_batch_info", "sglang.srt.sampling.sampling_params",
    "sglang.srt.speculative.spec_info", "sglang.srt.arg_groups.overrides",
    "sglang.srt.configs.shared_experts", "sglang.srt.layers.aux_hidden_states",
    "sglang.srt.layers.logits_processor", "sglang.srt.models.llama", "sglang.srt.models.deepseek_v2",
    "sglang.srt.managers.scheduler_components.dp_attn", "sglang.srt.utils.common",
    "sglang.srt.constants", "sglang.srt.layers.dp_attention", "sglang.srt.managers.io_struct",
    "sglang.srt.managers.tp_worker", "sglang.srt.managers.utils",
    "sglang.srt.plugins", "sglang.srt.plugins.hook_registry",  # imported; plugins load per scenario
    "sglang.srt.models.registry",  # imports every model class (ModelRunner asks it for the architecture)
)
# Not listed: the capture module.  A patched tree's model_runner imports sglang.srt.hidden_dump
# itself; a pristine tree has none, and a plugin's copy is imported only by SGLang's load_plugins
# in the scenario's process (so SGLANG_PLUGINS can leave it unimported).


def _run_forked(spec_path: str) -> None:
    """In the forked child: the spec's log as stdout/stderr, the spec's env, one scenario, exit."""
    rc = 1
    try:
        spec = json.loads(Path(spec_path).read_text())
        fd = os.open(spec["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
        for k in [k for k in os.environ if k.startswith("SGLANG_")]:
            del os.environ[k]
        os.environ.update(spec.get("env", {}))
        rc = main(["", spec_path])
    except BaseException:
        traceback.print_exc()
    finally:
        import logging

        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(rc)


def serve() -> int:
    """Import SGLang once, then fork one process per spec path read from stdin.

    Answers on stdout, one line each: `ready`, `started PID SPEC`, `exited CODE SPEC`.  Only the
    main thread exists when it forks (checked), so a child holds no lock another thread held.
    Ends when stdin closes and every child has exited."""
    import gc
    import importlib
    import select
    import threading

    for name in PRELOAD:
        importlib.import_module(name)
    gc.freeze()  # what was imported stays out of the children's collections (SGLang's memory probe collects)
    extra = [t.name for t in threading.enumerate() if t is not threading.main_thread()]
    if extra:
        print("error threads before fork: %s" % extra, flush=True)
        return 1
    print("ready", flush=True)
    children: dict = {}
    pending = b""
    eof = False
    while not eof or children:
        if not eof:
            ready, _, _ = select.select([0], [], [], 0.1)
            if ready:
                chunk = os.read(0, 65536)
                eof = not chunk
                pending += chunk
                *lines, pending = pending.split(b"\n")
                for line in lines:
                    spec_path = line.decode()
                    pid = os.fork()
                    if pid == 0:
                        _run_forked(spec_path)  # never returns
                    children[pid] = spec_path
                    print("started %d %s" % (pid, spec_path), flush=True)
        while children:
            pid, status = os.waitpid(-1, 0 if eof else os.WNOHANG)
            if pid == 0:
                break
            print("exited %d %s" % (os.waitstatus_to_exitcode(status), children.pop(pid)), flush=True)
    sys.stdout.flush()
    os._exit(0)  # nothing left to do: skip tearing down everything SGLang imported


if __name__ == "__main__":
    sys.exit(serve() if sys.argv[1:] == ["--serve"] else main(sys.argv))
