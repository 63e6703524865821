"""What a host's running server serves: the one reader of the served model (`served_model`: the record
answers.ServedModel that the capture and drafter probes carry, and the smoke's sizes), and the drafter
probe's answer (`drafter check`, `drafter bench`).

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
from .answers import ServedModel
from .osutil import expand
from .server import http_request
from .tokenizer import served as served_tokenizer

# the attention layout an MLA draft shares with its target (models/kimi_k25_eagle3.py builds its
# DeepseekV2AttentionMLA from these); all but the heads are None on a model without MLA
MLA_LAYOUT = ("num_attention_heads", "kv_lora_rank", "q_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
              "v_head_dim")
# config.json fields an EAGLE-3 draft config copies from its target (what SpecForge's own target-derived
# draft config copies: training/model_loading.py _TARGET_ARCHITECTURE_FIELDS), for `capture collect`
DRAFT_FIELDS = ("num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size", "hidden_act",
                "rms_norm_eps", "rope_theta", "rope_scaling", "rope_parameters", "attention_bias",
                "bos_token_id", "eos_token_id", "pad_token_id", "torch_dtype")
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


class Reading(object):
    """The served model read once (`served_model`): `model`, the record every answer that reports the
    served model carries (answers.ServedModel), and what it was read from, for an answer's own fields."""

    def __init__(self):
        self.model = ServedModel()
        self.config_path = None  # the config.json read ("" where /get_model_info named no model path)
        self.config = None  # its text config (limits.text_config) with the wrapper's architectures; None: unread
        self.why = None  # why there are no config facts (the server does not answer, config.json unreadable)
        self.info = None  # /server_info's answer (None: it gave none)
        self.tokenizer = {}  # tokenizer.served's answer


def served_model(cfg, full=True):
    """The model the server of `cfg` serves, as a `Reading`: its path from /get_model_info (as SGLang loaded
    it), that config.json's facts, and with `full` the server's own limits (/server_info) and its tokenizer
    (tokenizer.served: the digest `capture prepare` records). The one place a host reads the served model:
    the smoke (sizes only), the capture probe and the drafter probe. Every field of the record is given
    (None where unknown) once /get_model_info named a model, so an answer says what it could not read."""
    r = Reading()
    _read_config(cfg, r)
    if full:
        _read_server_info(cfg, r)
        tok = r.tokenizer = served_tokenizer(cfg)
        r.model.tokenizer = {"path": tok.get("tokenizer_path"), "digest": tok.get("digest"), "why": tok.get("why")}
    return r


def _read_config(cfg, r):
    m = r.model
    for name in ("model_path", "architectures", "hidden_size", "num_hidden_layers", "vocab_size",
                 "max_position_embeddings", "config_context_len", "config_context_from"):
        setattr(m, name, None)
    try:
        status, info = http_request(cfg["host"], cfg["port"], "GET", "/get_model_info", None, 10)
    except (OSError, http.client.HTTPException) as e:
        r.why = "the server on port %s does not answer: %s" % (cfg.get("port"), e)
        return
    if status != 200 or not isinstance(info, dict):
        r.why = "/get_model_info answered HTTP %s" % status
        return
    m.model_path = info.get("model_path") or ""
    r.config_path = os.path.join(expand(m.model_path), "config.json") if m.model_path else ""
    try:
        with open(r.config_path) as f:
            c = json.load(f)
        if not isinstance(c, dict):
            raise ValueError("not a JSON object")
    except (OSError, ValueError) as e:
        r.why = "the served model's config.json (%s) cannot be read: %s" % (r.config_path or "no model path", e)
        return
    m.config_context_len, m.config_context_from = limits.config_context_len(c)
    r.config = dict(limits.text_config(c), architectures=c.get("architectures"))
    for name in ("architectures", "hidden_size", "num_hidden_layers", "vocab_size", "max_position_embeddings"):
        setattr(m, name, r.config.get(name))


def _read_server_info(cfg, r):
    """/server_info's context length (limits.from_server_info), or why it said nothing (`server_info_error`)."""
    why = None
    for path in ("/server_info", "/get_server_info"):  # the second: releases before /server_info existed
        try:
            status, info = http_request(cfg["host"], cfg["port"], "GET", path, None, 10)
        except (OSError, http.client.HTTPException) as e:
            why = "%s: %s" % (path, e or e.__class__.__name__)
            break
        if status == 200 and isinstance(info, dict):
            r.info = info
            break
        why = "%s answered HTTP %s" % (path, status)
    for name, value in limits.from_server_info(r.info).items():
        setattr(r.model, name, value)
    r.model.server_info_error = None if r.info is not None else why


def avg_accept_lengths(info):
    """internal_states[i]["avg_spec_accept_length"] per DP rank (None where a rank reports none)."""
    states = info.get("internal_states") if isinstance(info, dict) else None
    if not isinstance(states, list):
        return None
    vals = [s.get("avg_spec_accept_length") if isinstance(s, dict) else None for s in states]
    return vals if any(v is not None for v in vals) else None


def facts(cfg, pid):
    """`drafter_probe`'s answer for the server of `cfg` (mgr.current_config()) running as `pid`: the served
    model (`served_model`), with the config it was read from, /server_info's acceptance figures, the env
    and the speculative flags, as a dict for answers.DrafterProbeAnswer."""
    out = {"running": bool(cfg.get("running")), "port": cfg.get("port")}
    if not out["running"]:
        out["why"] = "no server is running on port %s" % cfg.get("port")
        return out
    r = served_model(cfg)
    if r.why:
        out["why"] = r.why
    out.update(r.model.to_wire())
    if r.config_path is not None:
        out["config_path"] = r.config_path
    if r.config is not None:
        out.update((k, r.config.get(k)) for k in MLA_LAYOUT)
    out["avg_spec_accept_length"] = avg_accept_lengths(r.info)
    if (r.info or {}).get("speculative_algorithm"):
        out["server_speculative_algorithm"] = r.info.get("speculative_algorithm")
    out["env"] = server_env(cfg, pid)
    out["speculative"] = speculative_of(cfg.get("argv"))
    return out
