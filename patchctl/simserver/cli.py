"""The stand-in's command line and start-up, in SGLang's order; SIGTERM/SIGINT shut it down.

Start-up, in SGLang's order:
  1. compile (in memory) every `.py` under `sglang/` whose sha256 differs from
     the dist-info RECORD or that RECORD does not list (without RECORD:
     `sglang/srt/model_executor/*.py` and `sglang/srt/hidden_dump.py`);
  2. import `sglang/srt/hidden_dump.py`, if present, as `sglang.srt.hidden_dump`
     (stub parent packages, so SGLang's heavy `__init__`s do not run, and a stub
     `sglang.srt.runtime_context` whose `get_parallel()` says attention-TP rank 0);
  3. extract the hook statements from `ModelRunner.forward` and `ForwardBatch.init_new`;
  4. open the HTTP port, "load" the model, warm up with one `/generate`-like
     request (text "The capital city of France is", 8 tokens, random rid, as
     SGLang 0.5.23 does), then log "The server is fired up and ready to roll!".

The warm-up request (rid = random hex) goes through the hook like SGLang's does: a hook
that raises makes start-up fail ("warmup error"); whether it is dumped is the tree's
hidden_dump's decision (the current one never dumps a rid SGLang made up).

Speculative decoding (EAGLE3, `spec.py`, `draft.py`): the speculative flags are validated as SGLang 0.5.23
validates them before anything else loads (a refused combination exits 1 with SGLang's reason), and the
draft directory is loaded with the model ("Load weight").

SIGTERM/SIGINT: /health turns 503, `hidden_dump.flush()` is called (if the
module has one, at most ~1.5 s), exit 0.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import threading
import time
import traceback
import uuid
from http.server import ThreadingHTTPServer
from pathlib import Path

from patchctl.simserver import knobs
from patchctl.simserver.api import STAND_IN, App, Handler, tokenize
from patchctl.simserver.engine import Engine, Work, derived_context_len
from patchctl.simserver.hook import FORWARD_BATCH_INFO, MODEL_RUNNER, extract_batch_hook, extract_hook
from patchctl.simserver.model import CaptureRefused, resolve_capture
from patchctl.simserver.multinode import DistInitError, follow_head, head_rendezvous
from patchctl.simserver.tree import (HIDDEN_DUMP_MODULE, compile_check, find_sglang_root, import_hidden_dump,
                                     read_tree_version, stub_packages)

logger = logging.getLogger("patchctl.simserver")

EPILOG = """\
This is a STAND-IN for `python -m sglang.launch_server`, shipped with patchctl for
tests and the local demo. Production inventories run the real SGLang.

environment knobs:
""" + knobs.HELP + """\
SGLang env such as SGLANG_HIDDEN_DUMP_DIR is read by the served tree's own code.
Multi-node: --nnodes/--node-rank/--dist-init-addr; rank 0 waits for the others, ranks >= 1
serve no HTTP; when a node dies the others exit 1.
Unknown sglang flags are accepted and ignored (logged).

speculative decoding (EAGLE3 only, as SGLang 0.5.23 serves a SpecForge-trained draft):
  --speculative-algorithm EAGLE3 --speculative-draft-model-path DIR with --speculative-num-steps N
  --speculative-eagle-topk 1 [--speculative-num-draft-tokens N+1]. The draft (config.json + *.safetensors,
  LlamaForCausalLMEagle3, midlayer.* -> layers.0.*, d2t hot ids, the target's embedding) proposes N tokens
  greedily as a chain; the target verifies them in one forward; outputs are exactly the target's greedy
  tokens. /generate's meta_info carries spec_verify_ct, spec_accept_length, spec_accept_rate,
  spec_num_correct_drafts, spec_num_proposed_drafts, spec_correct_drafts_histogram; /server_info's
  internal_states[0].avg_spec_accept_length; POST /flush_cache resets it when idle.
  Does NOT: draft trees (top-k > 1 is refused: "stand-in supports --speculative-eagle-topk 1 only", so the
  Llama default (5, 4, 8) is refused too: set the three flags), other algorithms, sampling (temperature is
  ignored everywhere), run the tree's hidden_dump hooks in speculative forwards, compute in bf16 (float32),
  speculate in PATCHCTL_SIM_LIGHT mode. SGLANG_SIMULATE_ACC_LEN fakes the acceptance as SGLang does.
  --enable-return-aux-hidden-states (capture) with a draft path is refused, as in SGLang.

capture (--enable-return-aux-hidden-states --speculative-algorithm EAGLE3|DFLASH|DSPARK, the capture convention):
  EAGLE3 ids are used as given; DFLASH/DSPARK capture the layers the served architecture's own method captures
  (patchctl.host.capture_rules: Llama +1, Kimi-K3 keeps them as layer outputs in dspark_layers_to_capture); what
  SGLang 0.5.23 refuses at start (DFLASH/DSPARK without --return-aux-hidden-state-layer-ids, a model without the
  convention's method, e.g. Kimi-K3 with EAGLE3) exits 1 with SGLang's reason.
"""


def build_parser():
    p = argparse.ArgumentParser(
        prog="patchctl-simserver",
        description=f"{STAND_IN}: serves SGLang's HTTP API with a tiny deterministic model and the "
                    "SGLang tree's own hidden_dump hook. Same command line as `python -m sglang.launch_server`.",
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False)
    p.add_argument("--model-path", "--model", required=True, help="directory with config.json")
    p.add_argument("--tokenizer-path", default=None)
    p.add_argument("--served-model-name", default=None)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--tp", "--tp-size", "--tensor-parallel-size", dest="tp_size", type=int, default=1)
    p.add_argument("--enable-return-aux-hidden-states", action="store_true")
    p.add_argument("--speculative-algorithm", default=None,
                   help="EAGLE3 with a draft path: speculative decoding; with --enable-return-aux-hidden-states: "
                        "names the capture convention")
    p.add_argument("--speculative-draft-model-path", default=None, help="EAGLE-3 draft directory (SpecForge export)")
    p.add_argument("--speculative-num-steps", type=int, default=None, help="draft tokens proposed per verify step")
    p.add_argument("--speculative-eagle-topk", type=int, default=None,
                   help="stand-in supports --speculative-eagle-topk 1 only (chain drafting)")
    p.add_argument("--speculative-num-draft-tokens", type=int, default=None,
                   help="with top-k 1 always steps + 1 (as SGLang forces it)")
    p.add_argument("--speculative-dflash-block-size", type=int, default=None,
                   help="DFLASH: the block (verify window); default the draft config's block_size, else 16")
    p.add_argument("--speculative-dspark-block-size", type=int, default=None,
                   help="DSPARK: gamma, tokens proposed a step (verify window gamma + 1); default the draft's block_size")
    p.add_argument("--return-aux-hidden-state-layer-ids", nargs="+", default=None,
                   help="layer ids to capture (input of each layer; used as given); also a JSON list")
    p.add_argument("--disable-radix-cache", action="store_true")
    p.add_argument("--chunked-prefill-size", type=int, default=None)
    p.add_argument("--context-length", type=int, default=None,
                   help="the model's context length (default: config.json's, as SGLang derives it; 2048 without one)")
    p.add_argument("--sglang-root", default=None,
                   help="directory containing the sglang/ package to serve (default: find_spec('sglang'))")
    p.add_argument("--nnodes", type=int, default=1)
    p.add_argument("--node-rank", type=int, default=0)
    p.add_argument("--dist-init-addr", default=None,
                   help="host:port where node rank 0 waits for the other nodes to join")
    p.add_argument("--pid-file", default=None)
    p.add_argument("--log-level", default="info")
    return p


def _parse_layer_ids(values):
    if values is None:
        return None
    out = []
    for v in values:
        v = v.strip()
        if v.startswith("["):
            out.extend(int(x) for x in json.loads(v))
        else:
            out.extend(int(x) for x in v.replace(",", " ").split())
    return out


def _fatal(msg):
    logger.error(msg)
    logging.shutdown()
    sys.exit(1)


def main(argv=None):
    args, unknown, t_start = _parse(argv)
    light = knobs.light()
    logger.info("%s starting (pid %d)%s", STAND_IN, os.getpid(), " in LIGHT mode (no torch, no hook)" if light else "")
    logger.info("server_args=%s", {k: v for k, v in vars(args).items()})
    if unknown:
        logger.warning("Stand-in ignores unsupported sglang arguments: %s", " ".join(unknown))
    stop = threading.Event()

    def on_signal(signum, frame):
        stop.set()
    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)

    root, version = _tree(args)
    model_cfg, layers = _model_config(args)
    spec_cfg = _spec(args, model_cfg, light)
    _compile(root)  # 1. compile what patches changed, as importing the tree would
    hd, hook, batch_hook = (None, None, None) if light else _hooks(root)  # 2./3. hidden_dump and its hooks
    _check_capture(args, layers, model_cfg)
    engine = _engine(args, model_cfg, hook, hd, light, batch_hook, spec_cfg)
    app = App(args, root, version, model_cfg, engine, unknown)
    Handler.app = app
    follower = args.nnodes > 1 and args.node_rank >= 1
    httpd = None if follower else _serve_http(args)  # like SGLang: non-zero-rank nodes run no HTTP server
    if args.pid_file:
        Path(args.pid_file).write_text(f"{os.getpid()}\n")

    def shutdown(code=0):
        _shutdown(app, hd, httpd, args.pid_file, code)

    if args.nnodes > 1:
        _join_nodes(args, stop, app, follower, shutdown)
    _load(engine, stop, shutdown, layers, model_cfg)
    if follower:
        logger.info("node_rank %d: ready as a follower of %s; no HTTP server on non-zero rank nodes "
                    "(as in SGLang)", args.node_rank, args.dist_init_addr)
        _until(stop, shutdown)
    if knobs.hang():
        logger.warning("PATCHCTL_SIM_HANG: the stand-in will never become ready")
        _until(stop, shutdown)
    _warm_up(engine)
    app.state.ready = True
    logger.info("The server is fired up and ready to roll! (stand-in, %.2fs after start)", time.time() - t_start)
    _until(stop, shutdown)


def _parse(argv):
    """(args, the sglang flags the stand-in ignores, start time), logging set up as SGLang's."""
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    try:
        sys.stdout.reconfigure(line_buffering=True)
    except Exception:  # noqa: BLE001
        pass
    logging.basicConfig(level=getattr(logging, str(args.log_level).upper(), logging.INFO),
                        format="[%(asctime)s] %(message)s", datefmt="%Y-%m-%d %H:%M:%S", stream=sys.stdout)
    t_start = time.time()
    try:
        args.return_aux_hidden_state_layer_ids = _parse_layer_ids(args.return_aux_hidden_state_layer_ids)
    except (ValueError, TypeError) as e:
        parser.error(f"--return-aux-hidden-state-layer-ids: {e}")
    return args, unknown, t_start


def _tree(args) -> tuple[Path, str]:
    root = Path(args.sglang_root) if args.sglang_root else find_sglang_root()
    if root is None or not (root / "sglang").is_dir():
        _fatal(f"ModuleNotFoundError: No module named 'sglang' (stand-in looked in {root or 'sys.path'})")
    root = root.resolve()
    version = read_tree_version(root)
    logger.info("Serving SGLang tree %s (version %s) with the stand-in", root, version)
    return root, version


def _model_config(args) -> tuple[dict, int]:
    cfg_path = Path(args.model_path) / "config.json"
    try:
        model_cfg = json.loads(cfg_path.read_text())
        if isinstance(model_cfg.get("text_config"), dict) and "num_hidden_layers" not in model_cfg:
            # a multimodal wrapper (Kimi-K2.5's KimiK25ForConditionalGeneration): the language model's part,
            # as SGLang's hf_text_config, under the wrapper's architectures
            model_cfg = {**model_cfg["text_config"], "architectures": model_cfg.get("architectures")}
        layers = int(model_cfg["num_hidden_layers"])
        int(model_cfg["hidden_size"])
        int(model_cfg["vocab_size"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        _fatal(f"OSError: cannot load model config {cfg_path}: {type(e).__name__}: {e}")
    return model_cfg, layers


def _compile(root: Path) -> None:
    t0 = time.time()
    try:
        files = compile_check(root)
    except SyntaxError as e:
        tb = "".join(traceback.format_exception_only(type(e), e)).rstrip()
        _fatal(f"Traceback (most recent call last):\n  File \"{e.filename}\", line {e.lineno}, in <module>\n{tb}\n"
               f"Stand-in start-up failed: the SGLang tree does not compile")
    logger.info("Compiled %d changed file(s) of the tree in %.2fs%s", len(files), time.time() - t0,
                (": " + ", ".join(str(p.relative_to(root)) for p in files[:10])) if files else "")


def _hooks(root: Path):
    """(the tree's hidden_dump module, the ModelRunner.forward hook, the ForwardBatch.init_new hook), each None
    where the tree has none."""
    hd = None
    if (root / "sglang" / "srt" / "hidden_dump.py").exists():
        try:
            hd = import_hidden_dump(root)
        except BaseException:  # noqa: BLE001
            _fatal(traceback.format_exc().rstrip() + f"\nStand-in start-up failed: cannot import {HIDDEN_DUMP_MODULE}")
        logger.info("Imported %s from %s", HIDDEN_DUMP_MODULE, hd.__file__)
    try:
        hook = extract_hook(root)
        batch_hook = extract_batch_hook(root)
    except SyntaxError as e:
        _fatal(f"SyntaxError in {e.filename}: {e}")
    for h, rel in ((hook, MODEL_RUNNER), (batch_hook, FORWARD_BATCH_INFO)):
        if h is not None and hd is None:
            _fatal(f"ModuleNotFoundError: No module named '{HIDDEN_DUMP_MODULE}' (imported by {rel})")
    if hook is not None:
        logger.info("ModelRunner.forward calls %s.on_forward_end at line(s) %s%s", hook.aliases[0], hook.lines,
                    " (with statements before the raw forward)" if hook.pre is not None else "")
    else:
        logger.info("No hidden_dump hook in ModelRunner.forward")
        return _plugin_hooks(root, hd, batch_hook)
    if batch_hook is not None:
        logger.info("ForwardBatch.init_new calls %s.note_batch at line(s) %s", batch_hook.aliases[0],
                    batch_hook.lines)
    return hd, hook, batch_hook


def _plugin_hooks(root: Path, hd, batch_hook):
    """A tree without the diff series' hook: SGLang's own plugin loading (simserver/plugins.py), as
    run_scheduler_process runs it; the plugins' hooks take the hooks' place."""
    from patchctl.simserver import plugins  # noqa: PLC0415

    stub_packages(root)
    try:
        hooks, module = plugins.load(root)
    except Exception:  # noqa: BLE001 - SGLang's load_plugins itself raising ends the scheduler process
        _fatal(traceback.format_exc().rstrip() + "\nStand-in start-up failed: loading plugins")
    if hooks is None:
        return hd, None, batch_hook
    return module, hooks, hooks if "ForwardBatch.init_new" in hooks.hooked else None


def _check_capture(args, layers: int, model_cfg: dict) -> None:
    """The capture the flags ask for, refused as SGLang 0.5.23 refuses it at start (model.resolve_capture)."""
    try:
        cap = resolve_capture(args, layers, (model_cfg.get("architectures") or [None])[0])
    except CaptureRefused as e:
        _fatal(f"{e}\nStand-in start-up failed: aux hidden-state capture refused")
    capture = cap.layers if cap else None
    if cap is not None:
        logger.info("Capturing aux hidden states (%s convention): input of layers %s (%s; the model's %s = %s)",
                    cap.convention, capture, cap.how, cap.attr, cap.value)
    nan_layer = knobs.nan_layer()
    if nan_layer:
        if capture is None or int(nan_layer) not in capture:
            logger.warning("PATCHCTL_SIM_NAN_LAYER=%s is not a captured layer (%s): no NaN will appear",
                           nan_layer, capture)
        else:
            logger.warning("PATCHCTL_SIM_NAN_LAYER=%s: captured input of that layer gets NaN (stand-in knob)",
                           nan_layer)


def _spec(args, model_cfg: dict, light: bool):
    """The speculative configuration (spec.SpecConfig or None); a combination SGLang refuses fails the start."""
    from patchctl.simserver.spec import SpecRefused, resolve  # noqa: PLC0415

    try:
        cfg = resolve(args, model_cfg)
    except SpecRefused as e:
        _fatal(f"{e}\nStand-in start-up failed: speculative decoding arguments refused")
    if cfg is not None and light:
        _fatal("PATCHCTL_SIM_LIGHT: the light stand-in has no model to speculate with; drop the knob or the draft")
    if cfg is not None:  # the resolved values, as SGLang's server_args shows them
        args.speculative_algorithm = cfg.algorithm
        args.speculative_num_steps, args.speculative_eagle_topk = (1, 1) if cfg.algorithm != "EAGLE3" else (cfg.steps,
                                                                                                           cfg.topk)
        args.speculative_num_draft_tokens = cfg.draft_tokens
    return cfg


def _engine(args, model_cfg: dict, hook, hd, light: bool, batch_hook, spec_cfg=None) -> Engine:
    """The engine, after SGLang's context-length check."""
    derived = derived_context_len(model_cfg)
    if args.context_length is not None and args.context_length > derived:
        msg = (f"Warning: User-specified context_length ({args.context_length}) is greater than the derived "
               f"context_length ({derived}).")
        if os.environ.get("SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN", "").lower() not in ("1", "true"):
            _fatal(f"ValueError: {msg} To allow overriding this maximum, set the env var "
                   "SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN=1")
        logger.warning(msg)
    engine = Engine(args, model_cfg, hook, hd, light, batch_hook, spec_cfg)
    if engine.kv_tokens < engine.context_len:
        logger.warning("KV pool holds %d tokens, fewer than --context-length %d. One full-length request cannot fit, "
                       "so long requests will be refused or truncated at serving time.", engine.kv_tokens,
                       engine.context_len)
    logger.info("context_len=%d, KV pool %d tokens (PATCHCTL_SIM_KV_TOKENS), max_req_input_len=%d",
                engine.context_len, engine.kv_tokens, engine.max_req_input_len)
    return engine


def _serve_http(args) -> ThreadingHTTPServer:
    try:
        httpd = ThreadingHTTPServer((args.host, args.port), Handler)
    except OSError as e:
        _fatal(f"OSError: [Errno {e.errno}] error while attempting to bind on address "
               f"({args.host!r}, {args.port}): {e.strerror}")
    httpd.daemon_threads = True
    threading.Thread(target=httpd.serve_forever, name="http", daemon=True).start()
    logger.info("Uvicorn running on http://%s:%d (stand-in HTTP server; not ready yet)", args.host, args.port)
    return httpd


def _shutdown(app: App, hd, httpd, pid_file, code: int = 0):
    """/health turns 503, hidden_dump.flush() (at most ~1.5 s), the port and pid file released, exit `code`."""
    app.state.shutting_down = True
    logger.info("Received termination signal; shutting down the stand-in gracefully")
    flush = getattr(hd, "flush", None)
    if callable(flush):
        th = threading.Thread(target=flush, daemon=True)
        th.start()
        th.join(1.5)
        if th.is_alive():
            logger.warning("hidden_dump.flush() did not finish within 1.5s")
    if httpd is not None:
        try:
            httpd.server_close()
        except Exception:  # noqa: BLE001
            pass
    if pid_file:
        try:
            Path(pid_file).unlink()
        except OSError:
            pass
    logger.info("Stand-in stopped")
    logging.shutdown()
    sys.stdout.flush()
    os._exit(code)


def _join_nodes(args, stop: threading.Event, app: App, follower: bool, shutdown) -> None:
    """Multi-node: a follower joins the head (and never returns); the head waits until every node joined."""
    if not args.dist_init_addr:
        _fatal("ValueError: --dist-init-addr is required when --nnodes > 1")
    if follower:
        follow_head(args, stop, shutdown)
        return
    try:
        joined = head_rendezvous(args, stop, app.state)
    except DistInitError as e:
        _fatal(str(e))
    if not joined:
        shutdown()


def _load(engine: Engine, stop: threading.Event, shutdown, layers: int, model_cfg: dict) -> None:
    """"Load weights" (and the start-up knobs: a delay, a gate file, a crash)."""
    delay = knobs.start_delay()
    logger.info("Load weight begin (stand-in: seeded random weights, %d layers, hidden %s)%s", layers,
                model_cfg.get("hidden_size"), f", simulated load time {delay}s" if delay else "")
    try:
        engine.load()
    except Exception:  # noqa: BLE001
        _fatal(traceback.format_exc().rstrip())
    if stop.wait(delay):
        shutdown()
    gate = knobs.start_gate()
    if gate:
        logger.info("stand-in: loading until %s exists (PATCHCTL_SIM_START_GATE)", gate)
        while not os.path.exists(gate):
            if stop.wait(0.05):
                shutdown()
    logger.info("Load weight end")
    if knobs.crash_at_start():
        logger.error("RuntimeError: simulated crash at start-up (PATCHCTL_SIM_CRASH_AT_START)")
        logging.shutdown()
        os._exit(1)


def _until(stop: threading.Event, shutdown) -> None:
    """Serve until SIGTERM/SIGINT, then shut down (never returns)."""
    while not stop.wait(0.5):
        pass
    shutdown()


def _warm_up(engine: Engine) -> None:
    """Like SGLang 0.5.23: one /generate with a random rid, 8 tokens; its failure fails the start-up."""
    w = Work(uuid.uuid4().hex, tokenize("The capital city of France is", engine.vocab), 8)
    engine.submit(w)
    w.done.wait()
    if w.error is not None:
        logger.error("Initialization failed. warmup error: %s: %s", type(w.error).__name__, w.error)
        logging.shutdown()
        os._exit(1)
