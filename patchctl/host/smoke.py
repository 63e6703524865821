"""The smoke extraction and dump validation (DESIGN.md "Smoke validation").

Owns sending the profile's prompts to the running server, waiting (bounded)
for the asynchronous writer's files, checking each dump (a stdlib
safetensors reader: ids, prefix_len, shapes, bfloat16, finite, no all-zero
or identical layer slices, no leftovers, no new error-log lines), removing
exactly the files named with the run's own prefix, and the served model's
facts (config.json) that give the expected layers and hidden size.
"""

import http.client
import json
import os
import random
import struct
import time

from .events import AgentError, event, heartbeat
from .osutil import expand, log_tail
from .server import http_request

DUMP_WAIT_S = 10  # how long the smoke waits for the asynchronous writer's files to land


def read_safetensors(path):
    with open(path, "rb") as f:
        data = f.read()
    if len(data) < 8:
        raise ValueError("truncated file")
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n].decode())
    meta = header.pop("__metadata__", {}) or {}
    body = data[8 + n:]
    tensors = {}
    for name, info in header.items():
        b, e = info["data_offsets"]
        if e > len(body):
            raise ValueError("tensor %s runs past the end of the file" % name)
        tensors[name] = (info["dtype"], list(info["shape"]), body[b:e])
    return meta, tensors


def _bf16_nonfinite(buf):
    mv = memoryview(buf).cast("H") if len(buf) % 2 == 0 else None
    if mv is None:
        return True
    for v in mv:
        if v & 0x7F80 == 0x7F80:
            return True
    return False


def validate_dump(path, sent_ids, layers, hidden):
    """Every check of DESIGN.md's smoke validation for one file; returns a list of problems."""
    problems = []
    try:
        meta, t = read_safetensors(path)
    except Exception as e:
        return ["unreadable safetensors file: %s" % e]
    T = len(sent_ids)
    K = len(layers) if layers is not None else None
    for name in ("input_ids", "aux_hidden_states", "hidden_states"):
        if name not in t:
            problems.append("tensor %s missing" % name)
    if problems:
        return problems
    dt, shape, raw = t["input_ids"]
    if dt != "I64" or shape != [T]:
        problems.append("input_ids is %s %s, expected I64 [%d]" % (dt, shape, T))
    else:
        got = list(struct.unpack("<%dq" % T, raw))
        if got != list(sent_ids):
            problems.append("input_ids differ from the prompt sent")
    if meta.get("prefix_len") != "0":
        problems.append("prefix_len is %r, expected '0' (radix cache or chunked prefill on?)" % meta.get("prefix_len"))
    if layers is not None:
        try:
            got_layers = json.loads(meta.get("layers", "null"))
        except ValueError:
            got_layers = None
        if got_layers != list(layers):
            problems.append("layers %s, expected %s" % (meta.get("layers"), list(layers)))
    if hidden is not None and meta.get("hidden_size") not in (None, str(hidden)):
        problems.append("hidden_size %s, expected %d" % (meta.get("hidden_size"), hidden))
    dt, shape, raw = t["hidden_states"]
    if dt != "BF16" or len(shape) != 2 or shape[0] != T or (hidden is not None and shape[1] != hidden):
        problems.append("hidden_states is %s %s, expected BF16 [%d, %s]" % (dt, shape, T, hidden))
    elif _bf16_nonfinite(raw):
        problems.append("hidden_states has NaN or Inf")
    H = hidden if hidden is not None else (shape[1] if len(shape) == 2 else None)
    dt, shape, raw = t["aux_hidden_states"]
    if K is None and H:
        K = shape[1] // H if len(shape) == 2 and H else None
    if dt != "BF16" or len(shape) != 2 or shape[0] != T or not H or not K or shape[1] != K * H:
        problems.append("aux_hidden_states is %s %s, expected BF16 [%d, %s*%s]" % (dt, shape, T, K, H))
        return problems
    row = K * H * 2
    slices = []
    for k in range(K):
        parts = [raw[r * row + k * H * 2: r * row + (k + 1) * H * 2] for r in range(T)]
        slices.append(b"".join(parts))
    for k, s in enumerate(slices):
        if _bf16_nonfinite(s):
            problems.append("layer %s slice has NaN or Inf" % (layers[k] if layers else k))
        if not s.strip(b"\0"):
            problems.append("layer %s slice is all zeros" % (layers[k] if layers else k))
    for a in range(K):
        for b in range(a + 1, K):
            if slices[a] == slices[b]:
                problems.append("layer slices %s and %s are identical" % (a, b))
    return problems


def model_facts(cfg):
    """num_hidden_layers / hidden_size / vocab from the served model's config.json (path from /get_model_info)."""
    try:
        status, info = http_request(cfg["host"], cfg["port"], "GET", "/get_model_info", timeout=10)
    except (OSError, http.client.HTTPException):
        return {}
    if status != 200 or not isinstance(info, dict):
        return {}
    path = info.get("model_path") or ""
    facts = {"model_path": path}
    conf = os.path.join(expand(path), "config.json") if path else None
    if conf and os.path.isfile(conf):
        with open(conf) as f:
            c = json.load(f)
        c = c.get("text_config", c) if isinstance(c.get("text_config"), dict) and "num_hidden_layers" not in c else c
        facts.update(num_hidden_layers=c.get("num_hidden_layers"), hidden_size=c.get("hidden_size"),
                     vocab_size=c.get("vocab_size"), architectures=c.get("architectures"))
    return facts


def model_arch_of(argv):
    """architectures[0] of the config.json in the server command's --model-path, when it is a local dir."""
    for i, a in enumerate(argv[:-1]):
        if a in ("--model-path", "--model"):
            conf = os.path.join(expand(argv[i + 1]), "config.json")
            try:
                with open(conf) as f:
                    archs = json.load(f).get("architectures") or []
                return archs[0] if archs else None
            except (OSError, ValueError):
                return None
    return None


def smoke(state_dir, cfg, run_id, host_layers=None, host_hidden=None):
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
    facts = model_facts(cfg)
    layers = host_layers or cfg.get("capture_layers") or profile.get("layers")
    if not layers and facts.get("num_hidden_layers"):
        n = int(facts["num_hidden_layers"])
        layers = [2, n // 2, n - 3]
    hidden = host_hidden or profile.get("hidden_size") or facts.get("hidden_size")
    vocab = int(facts.get("vocab_size") or 1000)
    prefix = (env.get(profile.get("rid_prefix_env") or "SGLANG_HIDDEN_DUMP_RID_PREFIX") or "") + "patchctl-smoke-%s-" % run_id
    errlog = os.path.join(dump_dir, "_hidden_dump_errors.log")
    try:
        errlog_size = os.path.getsize(errlog)
    except OSError:
        errlog_size = 0
    rng = random.Random(run_id)
    n_prompts = int(profile.get("prompts") or 4)
    n_tokens = int(profile.get("prompt_tokens") or 32)
    sent = {}
    problems = []
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
    # the writer is asynchronous: wait (bounded) for every file to land
    expected = dict((rid, os.path.join(dump_dir, rid + ".safetensors")) for rid in sent)
    deadline = time.time() + DUMP_WAIT_S
    while time.time() < deadline and not all(os.path.exists(p) for p in expected.values()):
        heartbeat(step="smoke_wait_files")
        time.sleep(0.05)
    found = sorted(os.listdir(dump_dir)) if os.path.isdir(dump_dir) else []
    ours = [f for f in found if f.startswith(prefix)]
    tmp_left = [f for f in found if f.startswith(prefix) and not f.endswith(".safetensors")] + \
               [f for f in found if f.endswith(".tmp") and prefix in f]
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
        for p in validate_dump(path, sent[rid], layers, hidden):
            problems.append("%s: %s" % (rid, p))
    extra = [f for f in ours if f[: -len(".safetensors")] not in expected and f not in tmp_left]
    if extra:
        problems.append("unexpected extra files: %s" % ", ".join(extra[:5]))
    if tmp_left:
        problems.append("temporary files left behind: %s" % ", ".join(sorted(set(tmp_left))[:5]))
    try:
        grown = os.path.getsize(errlog) > errlog_size
    except OSError:
        grown = False
    if grown:
        with open(errlog, "rb") as f:
            f.seek(errlog_size)
            problems.append("hidden_dump error log: %s" % f.read(500).decode("utf-8", "replace").strip())
    removed = []
    for f in ours:  # only files named with this run's unique prefix
        try:
            os.unlink(os.path.join(dump_dir, f))
            removed.append(f)
        except OSError:
            pass
    result = {"prompts": n_prompts, "tokens": tokens, "bytes": nbytes, "seconds": round(time.time() - t0, 3),
              "layers": layers, "hidden_size": hidden, "dump_dir": dump_dir, "removed": len(removed)}
    if problems:
        raise AgentError("failed", "smoke failed: " + "; ".join(problems[:8]), smoke=result, problems=problems)
    event("smoke_passed", **result)
    return result

