"""What a host's running server serves, as a drafter is judged against it (`drafter check`, `drafter bench`).

One read-only look, whatever the server runs (a capture series, a drafter, nothing patchctl deployed):
the served model's config.json facts (its path from /get_model_info, as SGLang loaded it), the server's
own context length (/server_info), its tokenizer's digest (tokenizer.served: the same digest `capture
prepare` records), whether it speculates and with what (its command line), and the env names that change
what a drafter does there: SGLANG_SIMULATE_ACC_LEN fakes acceptance (sglang/srt/environ.py:527, active
when > 0: speculative/spec_utils.py:276) and SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN lets a draft with a
shorter context start (configs/model_config.py:1295-1316). The env is read from the server's process
(/proc/PID/environ) where this user may, else from the config patchctl started it with. Standard library.
"""

import http.client
import json
import os

from . import limits
from .osutil import expand
from .server import http_request
from .tokenizer import served as served_tokenizer

# the attention layout an MLA draft shares with its target (models/kimi_k25_eagle3.py builds its
# DeepseekV2AttentionMLA from these); all but the heads are None on a model without MLA
MLA_LAYOUT = ("num_attention_heads", "kv_lora_rank", "q_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
              "v_head_dim")
WATCHED_ENV = ("SGLANG_SIMULATE_ACC_LEN", "SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN")
SPEC_FLAGS = {"--speculative-algorithm": "algorithm", "--speculative-draft-model-path": "draft_path",
              "--speculative-num-steps": "num_steps", "--speculative-eagle-topk": "eagle_topk",
              "--speculative-num-draft-tokens": "num_draft_tokens", "--speculative-dflash-block-size": "block_size",
              "--speculative-dspark-block-size": "block_size"}


def speculative_of(argv):
    """{"algorithm", "draft_path", ...} from a server command line ({} without speculation)."""
    out = {}
    for i, a in enumerate(argv or []):
        key, _, val = a.partition("=")
        if key in SPEC_FLAGS:
            if not val and i + 1 < len(argv):
                val = argv[i + 1]
            out[SPEC_FLAGS[key]] = val
    if "--enable-return-aux-hidden-states" in (argv or []):
        out["capture"] = True  # capture mode: SGLang resets the algorithm to None (validation_hook.py:696-748)
    return out


def server_env(cfg, pid):
    """{name: value} of WATCHED_ENV in the server's environment."""
    out = {}
    env = None
    if pid:
        try:
            with open("/proc/%d/environ" % pid, "rb") as f:
                env = dict(item.decode("utf-8", "replace").split("=", 1) for item in f.read().split(b"\0") if b"=" in item)
        except OSError:
            env = None
    for name in WATCHED_ENV:
        v = (env if env is not None else (cfg.get("env") or {})).get(name)
        if v is not None:
            out[name] = v
    return out


def simulated_acceptance(env):
    """The SGLANG_SIMULATE_ACC_LEN value that makes SGLang fake acceptance, or None (unset, or <= 0: off)."""
    v = env.get("SGLANG_SIMULATE_ACC_LEN")
    if v is None:
        return None
    try:
        return None if float(v) <= 0 else v
    except ValueError:
        return v


def model_config(cfg):
    """The served model's config.json facts: {"model_path", "config_path", ...} or {"why"}."""
    try:
        status, info = http_request(cfg["host"], cfg["port"], "GET", "/get_model_info", None, 10)
    except (OSError, http.client.HTTPException) as e:
        return {"why": "the server on port %s does not answer: %s" % (cfg.get("port"), e)}
    if status != 200 or not isinstance(info, dict):
        return {"why": "/get_model_info answered HTTP %s" % status}
    path = info.get("model_path") or ""
    conf = os.path.join(expand(path), "config.json") if path else ""
    out = {"model_path": path, "config_path": conf}
    try:
        with open(conf) as f:
            c = json.load(f)
    except (OSError, ValueError) as e:
        out["why"] = "the served model's config.json (%s) cannot be read: %s" % (conf or "no model path", e)
        return out
    ctx, ctx_from = limits.config_context_len(c)
    t = limits.text_config(c)
    out.update(architectures=c.get("architectures"), hidden_size=t.get("hidden_size"),
               num_hidden_layers=t.get("num_hidden_layers"), vocab_size=t.get("vocab_size"),
               max_position_embeddings=t.get("max_position_embeddings"), config_context_len=ctx,
               config_context_from=ctx_from)
    out.update((k, t.get(k)) for k in MLA_LAYOUT)
    return out


def server_info(cfg):
    """/server_info's context length and acceptance figures, or why there are none."""
    try:
        status, info = http_request(cfg["host"], cfg["port"], "GET", "/server_info", None, 10)
    except (OSError, http.client.HTTPException) as e:
        return {"server_info_error": "/server_info: %s" % (e or e.__class__.__name__)}
    if status != 200 or not isinstance(info, dict):
        return {"server_info_error": "/server_info answered HTTP %s" % status}
    out = limits.from_server_info(info)
    out["avg_spec_accept_length"] = avg_accept_lengths(info)
    if info.get("speculative_algorithm"):
        out["server_speculative_algorithm"] = info.get("speculative_algorithm")
    return out


def avg_accept_lengths(info):
    """internal_states[i]["avg_spec_accept_length"] per DP rank (None where a rank reports none)."""
    states = info.get("internal_states") if isinstance(info, dict) else None
    if not isinstance(states, list):
        return None
    vals = [s.get("avg_spec_accept_length") if isinstance(s, dict) else None for s in states]
    return vals if any(v is not None for v in vals) else None


def facts(cfg, pid):
    """`drafter_probe`'s answer for the server of `cfg` (mgr.current_config()) running as `pid`."""
    out = {"running": bool(cfg.get("running")), "port": cfg.get("port")}
    if not out["running"]:
        out["why"] = "no server is running on port %s" % cfg.get("port")
        return out
    out.update(model_config(cfg))
    out.update(server_info(cfg))
    tok = served_tokenizer(cfg)
    out["tokenizer"] = {"path": tok.get("tokenizer_path"), "digest": tok.get("digest"), "why": tok.get("why")}
    out["env"] = server_env(cfg, pid)
    out["speculative"] = speculative_of(cfg.get("argv"))
    return out
