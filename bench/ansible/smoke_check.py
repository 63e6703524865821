"""Smoke validation for bench/ansible/deploy.yml (shipped to the host with `script`; stdlib only).

The same checks as patchctl's agent (docs/design.md "Smoke validation"): for every prompt exactly one
`<prefix><i>.safetensors` (waiting up to --wait s for the asynchronous writer), input_ids equal to
what was sent, prefix_len 0, layers and hidden size as expected, bf16 [T, K*H] / [T, H], all values
finite, no all-zero or identical layer slices, no .tmp leftovers, no new error-log lines. Removes the
smoke's own files (and only those). Exit 0 and one JSON line on success, exit 1 with the problems.
"""

import argparse
import json
import os
import struct
import sys
import time


def read_safetensors(path):
    with open(path, "rb") as f:
        data = f.read()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n].decode())
    meta = header.pop("__metadata__", {}) or {}
    body = data[8 + n:]
    return meta, {k: (v["dtype"], v["shape"], body[v["data_offsets"][0]:v["data_offsets"][1]]) for k, v in header.items()}


def nonfinite_bf16(raw):
    mv = memoryview(raw).cast("H")
    return any(v & 0x7F80 == 0x7F80 for v in mv)


def validate(path, ids, layers, hidden):
    problems = []
    try:
        meta, t = read_safetensors(path)
    except Exception as e:  # noqa: BLE001
        return ["unreadable safetensors file: %s" % e]
    missing = [n for n in ("input_ids", "aux_hidden_states", "hidden_states") if n not in t]
    if missing:
        return ["tensor %s missing" % m for m in missing]
    T, K, H = len(ids), len(layers), hidden
    dt, shape, raw = t["input_ids"]
    if dt != "I64" or shape != [T]:
        problems.append("input_ids is %s %s, expected I64 [%d]" % (dt, shape, T))
    elif list(struct.unpack("<%dq" % T, raw)) != list(ids):
        problems.append("input_ids differ from the prompt sent")
    if meta.get("prefix_len") != "0":
        problems.append("prefix_len is %r, expected '0'" % meta.get("prefix_len"))
    if json.loads(meta.get("layers", "null")) != list(layers):
        problems.append("layers %s, expected %s" % (meta.get("layers"), list(layers)))
    dt, shape, raw = t["hidden_states"]
    if dt != "BF16" or shape != [T, H]:
        problems.append("hidden_states is %s %s, expected BF16 [%d, %d]" % (dt, shape, T, H))
    elif nonfinite_bf16(raw):
        problems.append("hidden_states has NaN or Inf")
    dt, shape, raw = t["aux_hidden_states"]
    if dt != "BF16" or shape != [T, K * H]:
        problems.append("aux_hidden_states is %s %s, expected BF16 [%d, %d]" % (dt, shape, T, K * H))
        return problems
    row = K * H * 2
    slices = [b"".join(raw[r * row + k * H * 2: r * row + (k + 1) * H * 2] for r in range(T)) for k in range(K)]
    for k, s in enumerate(slices):
        if nonfinite_bf16(s):
            problems.append("layer %s slice has NaN or Inf" % layers[k])
        if not s.strip(b"\0"):
            problems.append("layer %s slice is all zeros" % layers[k])
    for a in range(K):
        for b in range(a + 1, K):
            if slices[a] == slices[b]:
                problems.append("layer slices %s and %s are identical" % (a, b))
    return problems


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dump-dir", required=True)
    ap.add_argument("--prefix", required=True)
    ap.add_argument("--prompts", required=True, help="JSON list of token id lists, in rid order")
    ap.add_argument("--layers", required=True)
    ap.add_argument("--hidden", type=int, required=True)
    ap.add_argument("--wait", type=float, default=10.0)
    a = ap.parse_args()
    t0 = time.time()
    prompts = json.loads(a.prompts)
    layers = [int(x) for x in a.layers.split(",")]
    expected = {"%s%d" % (a.prefix, i): ids for i, ids in enumerate(prompts)}
    paths = {rid: os.path.join(a.dump_dir, rid + ".safetensors") for rid in expected}
    deadline = time.time() + a.wait
    while time.time() < deadline and not all(os.path.exists(p) for p in paths.values()):
        time.sleep(0.05)
    problems, nbytes = [], 0
    for rid, p in sorted(paths.items()):
        if not os.path.exists(p):
            problems.append("%s: no dump file (the hook never fired?)" % rid)
            continue
        nbytes += os.path.getsize(p)
        problems += ["%s: %s" % (rid, x) for x in validate(p, expected[rid], layers, a.hidden)]
    found = os.listdir(a.dump_dir) if os.path.isdir(a.dump_dir) else []
    ours = [f for f in found if f.startswith(a.prefix)]
    leftovers = [f for f in ours if not f.endswith(".safetensors")] + [f for f in found if f.endswith(".tmp") and a.prefix in f]
    if leftovers:
        problems.append("temporary files left behind: %s" % ", ".join(sorted(set(leftovers))[:5]))
    errlog = os.path.join(a.dump_dir, "_hidden_dump_errors.log")
    if os.path.exists(errlog) and os.path.getmtime(errlog) >= t0 - 60:
        problems.append("hidden_dump error log written recently: %s" % errlog)
    for f in ours:
        try:
            os.unlink(os.path.join(a.dump_dir, f))
        except OSError:
            pass
    if problems:
        print("smoke failed: " + "; ".join(problems[:8]), file=sys.stderr)
        sys.exit(1)
    print(json.dumps({"prompts": len(prompts), "bytes": nbytes, "seconds": round(time.time() - t0, 3)}))


if __name__ == "__main__":
    main()
