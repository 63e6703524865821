"""The smoke extraction and dump validation (docs/design.md "Smoke validation").

Owns sending the profile's prompts to the running server, waiting (bounded)
for the asynchronous writer's files, checking each dump (`check_dump`: ids,
prefix_len, metadata, shapes, bfloat16, finite, no all-zero or identical layer
slices, over a read-only mapping of the file through dumpscan; also what a
capture run checks every dump with), no leftovers, no new error-log lines, removing
exactly the files named with the run's own prefix, and the served model's
facts (config.json) that give the expected layers and hidden size.
"""

import hashlib
import http.client
import json
import os
import random
import struct
import time

from . import dumpscan, limits
from .capture_rules import convention_of, judge, method_where, rule_for
from .events import AgentError, event, heartbeat
from .osutil import expand, log_tail
from .served import served_model
from .server import http_request

DUMP_WAIT_S = 10  # how long the smoke waits for the asynchronous writer's files to land


def read_safetensors(path):
    with open(path, "rb") as f:
        return parse_safetensors(f.read())


def parse_safetensors(data):
    """(metadata, {name: (dtype, shape, bytes)}) of a safetensors file's contents; `data` may be any
    buffer (a memoryview of a bytearray gives zero-copy, writable tensor bytes)."""
    if len(data) < 8:
        raise ValueError("truncated file")
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(bytes(data[8:8 + n]).decode())
    meta = header.pop("__metadata__", {}) or {}
    body = data[8 + n:]
    tensors = {}
    for name, info in header.items():
        b, e = info["data_offsets"]
        if e > len(body):
            raise ValueError("tensor %s runs past the end of the file" % name)
        tensors[name] = (info["dtype"], list(info["shape"]), body[b:e])
    return meta, tensors


FORMAT_VERSION = "2"  # of the hidden-dump files this smoke understands
LAYER_NAMES = {
    "layers_to_capture": "SGLang's capture indices (the hidden state entering decoder layer i)",
    "layer_outputs": "outputs of decoder layers (EAGLE-3 lists such as Kimi-K2.5's [2, 30, 58])",
    "eagle_aux_hidden_state_layer_ids": "the ids SGLang was given (--return-aux-hidden-state-layer-ids)",
}


def expected_layers(given=None, outputs=None, num_layers=None, convention=None, arch=None):
    """What a dump's layers must be, each in the convention its source speaks:
    `given` (inventory/profile capture_layers) are the ids passed to SGLang's flag, which maps
    them per architecture (+1 on Llama, as given on DeepseekV2); `outputs` (layer_outputs) are
    the decoder layers whose outputs the drafter is trained on; without either, SGLang's default
    capture indices [2, N//2, N-3] for the served model's N layers. Under the DFLASH or DSPARK
    capture convention (`convention`, from the server's --speculative-algorithm) the dump must also
    hold the layers that family's method of `arch` captures for the ids (capture_rules).
    {metadata key: (ids, source)}."""
    exp = {}
    if given:
        exp["eagle_aux_hidden_state_layer_ids"] = (list(given), "capture_layers")
    if outputs:
        exp["layer_outputs"] = (list(outputs), "layer_outputs")
    if not given and num_layers:
        n = int(num_layers)
        exp["layers_to_capture"] = ([2, n // 2, n - 3], "SGLang's default for N = %d layers (config.json)" % n)
    if given and convention in ("dflash", "dspark") and arch:
        layers, _ = judge(convention, arch, list(given), int(num_layers) if num_layers else None)
        rule = rule_for(convention, arch)
        if layers is not None and rule is not None:
            exp["layers_to_capture"] = (layers, "%s of %s for ids %s (sglang/srt/%s)" % (
                method_where(convention, arch).split(" ")[0], arch, list(given), rule.where))
    return exp


def _json_meta(meta, key):
    try:
        return json.loads(meta.get(key, "null"))
    except ValueError:
        return None


def check_layers(meta, expect):
    """Problems with the file's layer metadata against `expect` (see expected_layers); every
    message names the convention of both sides."""
    if meta.get("format_version") != FORMAT_VERSION:
        return ["format_version %r, expected %r: the file was written by another hidden-dump module "
                "(its layer metadata is not comparable; deploy hidden-dump >= 2.0.0)" % (
                    meta.get("format_version"), FORMAT_VERSION)]
    captured = _json_meta(meta, "layers_to_capture")
    problems = []
    for key, (want, source) in sorted(expect.items()):
        got = _json_meta(meta, key)
        if got != want:
            problems.append("%s %s, expected %s from %s [%s: %s]; the file holds layers_to_capture %s, "
                            "i.e. the outputs of layers %s" % (
                                key, json.dumps(got), json.dumps(want), source, key, LAYER_NAMES[key],
                                json.dumps(captured), meta.get("layer_outputs")))
    return problems


def validate_dump(path, sent_ids, expect, hidden, backend=None):
    """Every check of docs/design.md's smoke validation for one file; returns a list of problems.
    `expect` is expected_layers(...)."""
    return check_dump(path, sent_ids, expect, hidden, digest=False, backend=backend)[0]


def check_dump(path, sent_ids, expect, hidden, digest=True, backend=None):
    """(problems, sha256 of the file or None): validate_dump's checks and, for a file without problems
    when `digest` is asked, its hash, both from one read-only mapping of the file (dumpscan).
    `backend`: dumpscan's ("auto" numpy when importable, "numpy", "stdlib"); None for its default."""
    try:
        dump = dumpscan.open_dump(path)
    except (OSError, ValueError) as e:
        return ["unreadable safetensors file: %s" % e], None
    with dump:
        problems = _check_mapped(dump.buf, sent_ids, expect, hidden, backend)
        return problems, (hashlib.sha256(dump.buf).hexdigest() if digest and not problems else None)


def dump_layout(meta, tensors, expect):
    """(the file's layers_to_capture or None, the expected id lists, K: how many layers it should hold,
    problems: its missing tensors)."""
    layers = _json_meta(meta, "layers_to_capture")
    if not isinstance(layers, list):
        layers = None
    wanted = [ids for ids, _ in expect.values()]
    K = len(layers) if layers is not None else (len(wanted[0]) if wanted else None)
    problems = ["tensor %s missing" % name for name in ("input_ids", "aux_hidden_states", "hidden_states")
                if name not in tensors]
    return layers, wanted, K, problems


def _check_mapped(buf, sent_ids, expect, hidden, backend):
    try:
        meta, t = dumpscan.layout(buf)
    except ValueError as e:
        return ["unreadable safetensors file: %s" % e]
    T = len(sent_ids)
    layers, wanted, K, problems = dump_layout(meta, t, expect)
    if problems:
        return problems
    dt, shape, at, _end = t["input_ids"]
    if dt != "I64" or shape != [T]:
        problems.append("input_ids is %s %s, expected I64 [%d]" % (dt, shape, T))
    elif list(struct.unpack_from("<%dq" % T, buf, at)) != list(sent_ids):
        problems.append("input_ids differ from the prompt sent")
    if meta.get("prefix_len") != "0":
        problems.append("prefix_len is %r, expected '0' (radix cache or chunked prefill on?)" % meta.get("prefix_len"))
    if meta.get("num_tokens") not in (None, str(T)):
        problems.append("num_tokens is %r, %d tokens were sent" % (meta.get("num_tokens"), T))
    problems += check_layers(meta, expect)
    if any(len(ids) != K for ids in wanted):
        problems.append("%s layers captured, %s expected" % (K, " / ".join(str(len(ids)) for ids in wanted)))
    if hidden is not None and meta.get("hidden_size") not in (None, str(hidden)):
        problems.append("hidden_size %s, expected %d" % (meta.get("hidden_size"), hidden))
    dt, shape, last_at, _end = t["hidden_states"]
    last_ok = dt == "BF16" and len(shape) == 2 and shape[0] == T and (hidden is None or shape[1] == hidden)
    if not last_ok:
        problems.append("hidden_states is %s %s, expected BF16 [%d, %s]" % (dt, shape, T, hidden))
    H = hidden if hidden is not None else (shape[1] if len(shape) == 2 else None)
    dt, shape, aux_at, _end = t["aux_hidden_states"]
    if K is None and H:
        K = shape[1] // H if len(shape) == 2 and H else None
    if dt != "BF16" or len(shape) != 2 or shape[0] != T or not H or not K or shape[1] != K * H:
        problems.append("aux_hidden_states is %s %s, expected BF16 [%d, %s*%s]" % (dt, shape, T, K, H))
        return problems
    if not last_ok:
        return problems
    v = dumpscan.scan_bf16(buf, aux_at, last_at, T, K, H, backend)
    if v["last_nonfinite"]:
        problems.append("hidden_states has NaN or Inf")
    names = layers if layers else list(range(K))
    problems += ["layer %s slice has NaN or Inf" % names[k] for k in v["nonfinite"]]
    problems += ["layer %s slice is all zeros" % names[k] for k in v["zero"]]
    problems += ["layer slices %s and %s are identical" % p for p in v["identical"]]
    return problems


def capture_convention(cfg, model=None):
    """(the capture convention the running server's command line names, the architecture it serves: its
    --model-path's, else `model`'s, a served.ServedModel): what expected_layers judges a dump by."""
    argv = cfg.get("argv") or []
    arch = model_arch_of(argv) or (((model and model.architectures) or [None]))[0]
    return convention_of(argv), arch


def model_arch_of(argv):
    """architectures[0] of the config.json in the server command's --model-path, when it is a local dir."""
    archs = (model_config_of(argv) or {}).get("architectures") or []
    return archs[0] if archs and isinstance(archs, list) else None


def model_config_of(argv):
    """The config.json in the server command's --model-path (a multimodal wrapper's text_config, under the
    wrapper's architectures, as SGLang's hf_text_config), when it is a local dir; else None."""
    for i, a in enumerate(argv[:-1]):
        if a in ("--model-path", "--model"):
            conf = os.path.join(expand(argv[i + 1]), "config.json")
            try:
                with open(conf) as f:
                    c = json.load(f)
            except (OSError, ValueError):
                return None
            if not isinstance(c, dict):
                return None
            text = limits.text_config(c)
            return dict(text, architectures=c.get("architectures"))
    return None


def smoke_prefix(env_prefix, run_id):
    """The smoke's own rid prefix: unique to the run, and inside the series' dump prefix
    (SGLANG_HIDDEN_DUMP_RID_PREFIX) without repeating it."""
    own = "patchctl-smoke-%s-" % run_id
    return own if own.startswith(env_prefix) else env_prefix + own


def smoke(state_dir, cfg, run_id, host_layers=None, host_hidden=None, host_outputs=None):
    """Send the profile's prompts, validate each dump, remove the smoke's own files (and only those)."""
    profile = cfg.get("profile")
    if not profile:
        raise AgentError("bad_input", "the running server was not started with a capture profile: nothing to smoke")
    t0 = time.time()
    env = cfg.get("env") or {}
    dump_dir = env.get(profile.get("dump_dir_env") or "SGLANG_HIDDEN_DUMP_DIR")
    if not dump_dir:
        raise AgentError("bad_input", "server env has no %s: capture is off" % profile.get("dump_dir_env"))
    dump_dir = expand(dump_dir)
    model = served_model(cfg, full=False).model
    expect = expected_layers(host_layers or cfg.get("capture_layers") or profile.get("layers"),
                             host_outputs, model.num_hidden_layers, *capture_convention(cfg, model))
    hidden = host_hidden or profile.get("hidden_size") or model.hidden_size
    vocab = int(model.vocab_size or 1000)
    prefix = smoke_prefix(env.get(profile.get("rid_prefix_env") or "SGLANG_HIDDEN_DUMP_RID_PREFIX") or "", run_id)
    errlog = os.path.join(dump_dir, "_hidden_dump_errors.log")
    errlog_size = _size(errlog)
    rng = random.Random(run_id)
    n_prompts = int(profile.get("prompts") or 4)
    n_tokens = int(profile.get("prompt_tokens") or 32)
    problems = []
    sent = _send_prompts(cfg, prefix, n_prompts, n_tokens, vocab, rng, problems)
    expected = dict((rid, os.path.join(dump_dir, rid + ".safetensors")) for rid in sent)
    _wait_for_files(expected.values())
    ours, tmp_left = _own_files(dump_dir, prefix)
    nbytes, tokens, captured = _check_dumps(expected, sent, expect, hidden, problems)
    extra = [f for f in ours if f[: -len(".safetensors")] not in expected and f not in tmp_left]
    if extra:
        problems.append("unexpected extra files: %s" % ", ".join(extra[:5]))
    if tmp_left:
        problems.append("temporary files left behind: %s" % ", ".join(sorted(set(tmp_left))[:5]))
    logged = _new_in_log(errlog, errlog_size)
    if logged is not None:
        problems.append("hidden_dump error log: %s" % logged)
    removed = _remove(dump_dir, ours)
    result = {"prompts": n_prompts, "tokens": tokens, "bytes": nbytes, "seconds": round(time.time() - t0, 3),
              "layers": captured.get("layers_to_capture"), "hidden_size": hidden, "dump_dir": dump_dir,
              "capture_convention": capture_convention(cfg)[0],
              "removed": len(removed), "captured": captured,
              "expected": dict((k, {"ids": ids, "from": src}) for k, (ids, src) in expect.items())}
    if problems:
        raise AgentError("failed", "smoke failed: " + "; ".join(problems[:8]), smoke=result, problems=problems)
    event("smoke_passed", **result)
    return result


def _size(path):
    try:
        return os.path.getsize(path)
    except OSError:
        return 0


def _wait_for_files(paths):
    """The writer is asynchronous: wait (at most DUMP_WAIT_S) for every file to land."""
    deadline = time.time() + DUMP_WAIT_S
    while time.time() < deadline and not all(os.path.exists(p) for p in paths):
        heartbeat(step="smoke_wait_files")
        time.sleep(0.05)


def _own_files(dump_dir, prefix):
    """(the dump directory's files named with the smoke's prefix, the temporary ones among them or of the writer)."""
    found = sorted(os.listdir(dump_dir)) if os.path.isdir(dump_dir) else []
    ours = [f for f in found if f.startswith(prefix)]
    tmp_left = [f for f in found if f.startswith(prefix) and not f.endswith(".safetensors")] + \
               [f for f in found if f.endswith(".tmp") and prefix in f]
    return ours, tmp_left


def _remove(dump_dir, ours):
    """Only files named with this run's unique prefix; those removed."""
    removed = []
    for f in ours:
        try:
            os.unlink(os.path.join(dump_dir, f))
            removed.append(f)
        except OSError:
            pass
    return removed


def _send_prompts(cfg, prefix, n_prompts, n_tokens, vocab, rng, problems):
    """The smoke's prompts (distinct lengths, random ids) to the server, one token each: {rid: ids}."""
    sent = {}
    for i in range(n_prompts):
        rid = "%s%d" % (prefix, i)
        ids = [rng.randrange(10, max(11, vocab - 1)) for _ in range(n_tokens + i)]  # distinct lengths
        sent[rid] = ids
        try:
            status, resp = http_request(cfg["host"], cfg["port"], "POST", "/generate",
                                        {"rid": rid, "input_ids": ids,
                                         "sampling_params": {"max_new_tokens": 1, "temperature": 0}}, timeout=300)
        except (OSError, http.client.HTTPException) as e:
            raise AgentError("failed", "smoke request %s failed: %s" % (rid, e), log_tail=log_tail(cfg["log"]))
        if status != 200:
            raise AgentError("failed", "smoke request %s: HTTP %d %s" % (rid, status, str(resp)[:300]), log_tail=log_tail(cfg["log"]))
        pt = (resp.get("meta_info") or {}).get("prompt_tokens") if isinstance(resp, dict) else None
        if pt is not None and pt != len(ids):
            problems.append("%s: server counted %s prompt tokens, sent %d" % (rid, pt, len(ids)))
        heartbeat(step="smoke", sent=i + 1)
    return sent


def _check_dumps(expected, sent, expect, hidden, problems):
    """Each prompt's dump file validated (missing ones named): (bytes, tokens, the layers it says it captured)."""
    captured = {}
    nbytes = 0
    tokens = 0
    missing = [rid for rid, path in sorted(expected.items()) if not os.path.exists(path)]
    if missing:
        problems.append("no dump file for %d of %d prompts (%s): the hook never fired?" % (
            len(missing), len(expected), ", ".join(missing[:2]) + (", ..." if len(missing) > 2 else "")))
    for rid, path in sorted(expected.items()):
        if rid in missing:
            continue
        nbytes += os.path.getsize(path)
        tokens += len(sent[rid])
        if not captured:
            try:
                meta = read_safetensors(path)[0]
                captured = dict((k, _json_meta(meta, k)) for k in LAYER_NAMES)
            except Exception:  # reported by validate_dump
                pass
        for p in validate_dump(path, sent[rid], expect, hidden):
            problems.append("%s: %s" % (rid, p))
    return nbytes, tokens, captured


def _new_in_log(errlog, size):
    """What the hidden_dump module logged since the smoke began (its first 500 bytes), or None."""
    try:
        if os.path.getsize(errlog) <= size:
            return None
    except OSError:
        return None
    with open(errlog, "rb") as f:
        f.seek(size)
        return f.read(500).decode("utf-8", "replace").strip()
