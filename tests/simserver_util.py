"""Helpers to run the SGLang stand-in server (patchctl.simserver) as a real process in tests."""

from __future__ import annotations

import base64
import hashlib
import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from sshhosts import free_port  # noqa: F401  (tests import it from here too)

REPO = Path(__file__).resolve().parent.parent

# A small hidden_dump.py honouring the capture contract (synchronous writer: test stand-in
# for the real series until patches/hidden-dump exists).
TEST_HIDDEN_DUMP = '''\
"""Test hidden_dump: one safetensors file per request, prefill only."""
import json
import os

import torch
from safetensors.torch import save_file

FORMAT_VERSION = "1"
CALLS = []


def _dir():
    return os.environ.get("SGLANG_HIDDEN_DUMP_DIR")


def enabled():
    return bool(_dir())


def on_forward_end(model_runner, forward_batch, logits_output):
    CALLS.append(forward_batch.forward_mode)
    d = _dir()
    if not d or model_runner.is_draft_worker or model_runner.attn_tp_rank != 0:
        return
    mode = forward_batch.forward_mode
    if not mode.is_extend() or mode.is_target_verify():
        return
    prefix = os.environ.get("SGLANG_HIDDEN_DUMP_RID_PREFIX", "")
    layers = list(model_runner.server_args.return_aux_hidden_state_layer_ids or [])
    H = model_runner.model_config.hidden_size
    start = 0
    for rid, n, p in zip(forward_batch.rids, forward_batch.extend_seq_lens_cpu,
                         forward_batch.extend_prefix_lens_cpu):
        sl = slice(start, start + n)
        start += n
        if rid.startswith("HEALTH_CHECK") or not rid.startswith(prefix):
            continue
        tensors = {
            "input_ids": forward_batch.input_ids[sl].to(torch.int64).contiguous(),
            "aux_hidden_states": logits_output.hidden_states[sl].contiguous(),
            "hidden_states": logits_output.last_hidden_states[sl].contiguous(),
        }
        meta = {"format_version": FORMAT_VERSION, "rid": rid, "num_tokens": str(n), "prefix_len": str(p),
                "hidden_size": str(H), "layers": json.dumps(layers),
                "model_arch": model_runner.model_config.hf_config.architectures[0], "dtype": "bfloat16"}
        path = os.path.join(d, rid + ".safetensors")
        save_file(tensors, path + ".tmp", metadata=meta)
        os.replace(path + ".tmp", path)


def flush():
    d = _dir()
    if d:
        open(os.path.join(d, "_flushed"), "w").close()
'''

HOOK_IMPORT = "from sglang.srt import hidden_dump as _hidden_dump\n"
HOOK_CALL = (
    "        if _hidden_dump.enabled() and not self.is_draft_worker:\n"
    "            _hidden_dump.on_forward_end(self, forward_batch, output.logits_output)\n"
)
ANCHOR = "        output.expert_distribution_metrics = recorder_outputs.get(\"metrics\")\n"


def record_hash(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def make_mini_tree(pristine: Path, dest: Path) -> Path:
    """A small wheel-layout tree: the real model_runner.py, version files, and a RECORD for them."""
    files = ["sglang/__init__.py", "sglang/version.py", "sglang/_version.py",
             "sglang/srt/__init__.py", "sglang/srt/model_executor/__init__.py",
             "sglang/srt/model_executor/model_runner.py",
             "sglang/srt/model_executor/forward_batch_info.py",
             "sglang/srt/models/__init__.py", "sglang/srt/models/llama.py"]
    info = dest / "sglang-0.5.23.dist-info"
    info.mkdir(parents=True)
    rows = []
    for rel in files:
        src = pristine / rel
        if not src.exists():
            continue
        (dest / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src, dest / rel)
        data = src.read_bytes()
        rows.append(f"{rel},{record_hash(data)},{len(data)}")
    rows.append("sglang-0.5.23.dist-info/RECORD,,")
    (info / "RECORD").write_text("\n".join(rows) + "\n")
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: sglang\nVersion: 0.5.23\n")
    return dest


def apply_series(tree: Path, series_dir: Path) -> None:
    """Apply a series' patches (series.toml order, following references to other series) with patch -p1."""
    from hidden_dump_util import series_patch_paths
    for path in series_patch_paths(series_dir):
        subprocess.run(["patch", "-p1", "-s", "--no-backup-if-mismatch", "-d", str(tree),
                        "-i", str(path)], check=True)


def add_hidden_dump(tree: Path, source: str = TEST_HIDDEN_DUMP) -> None:
    (tree / "sglang/srt/hidden_dump.py").write_text(source)


def hook_model_runner(tree: Path, where: str = "forward") -> None:
    """Insert the hook into ModelRunner.forward right after the raw forward (or elsewhere)."""
    p = tree / "sglang/srt/model_executor/model_runner.py"
    src = p.read_text()
    src = src.replace("from sglang.srt.configs.draft_parallel", HOOK_IMPORT + "from sglang.srt.configs.draft_parallel", 1)
    if where == "forward":
        assert src.count(ANCHOR) == 1
        src = src.replace(ANCHOR, ANCHOR + HOOK_CALL)
    elif where == "elsewhere":
        # Another method of ModelRunner: never reached through ModelRunner.forward.
        marker = "    def forward(\n"
        i = src.index(marker)
        src = src[:i] + (
            "    def _dump_elsewhere(self, forward_batch, output):\n"
            "        _hidden_dump.on_forward_end(self, forward_batch, output.logits_output)\n\n"
        ) + src[i:]
    elif where == "before-raw":
        # Before `output = self._forward_raw(...)`: `output` is not bound yet there.
        anchor = "            output = self._forward_raw(\n"
        i = src.index(anchor, src.index("    def forward(\n"))
        early = HOOK_CALL.replace("        if", "            if").replace("            _hidden", "                _hidden")
        src = src[:i] + early + src[i:]
    elif where == "local-import":
        # The import inside forward instead of at module level.
        src = src.replace(HOOK_IMPORT, "", 1)
        src = src.replace(ANCHOR, ANCHOR + "        from sglang.srt import hidden_dump as _hidden_dump\n" + HOOK_CALL)
    else:
        raise ValueError(where)
    p.write_text(src)


def write_model(path: Path, layers=8, hidden=64, vocab=512) -> Path:
    from patchctl.simserver.model import write_model_config
    return write_model_config(path, layers=layers, hidden=hidden, vocab=vocab)


class Server:
    """A stand-in server process; `log` holds its combined stdout/stderr."""

    def __init__(self, tree: Path, model: Path, log: Path, *, env=None, args=(), capture=True,
                 root_via_pythonpath=False, port=None):
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        cmd = [sys.executable, "-m", "patchctl.simserver", "--model-path", str(model),
               "--host", "127.0.0.1", "--port", str(self.port)]
        if not root_via_pythonpath:
            cmd += ["--sglang-root", str(tree)]
        if capture:
            cmd += ["--enable-return-aux-hidden-states", "--speculative-algorithm", "EAGLE3",
                    "--disable-radix-cache", "--chunked-prefill-size", "-1"]
        cmd += list(args)
        e = {k: v for k, v in os.environ.items() if not k.startswith(("PATCHCTL_SIM_", "SGLANG_HIDDEN_DUMP"))}
        e["PYTHONPATH"] = os.pathsep.join(([str(tree)] if root_via_pythonpath else []) + [str(REPO)]
                                          + ([e["PYTHONPATH"]] if e.get("PYTHONPATH") else []))
        e["PYTHONDONTWRITEBYTECODE"] = "1"
        e.update(env or {})
        self._logf = open(log, "wb")
        self.proc = subprocess.Popen(cmd, stdout=self._logf, stderr=subprocess.STDOUT, env=e,
                                     start_new_session=True)

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def get(self, path, timeout=10):
        return request(self.url + path, timeout=timeout)

    def post(self, path, body, timeout=30):
        return request(self.url + path, body, timeout=timeout)

    def wait_port(self, deadline=120.0):  # deadlines only catch a hang (a loaded machine starts torch slowly)
        end = time.monotonic() + deadline
        while time.monotonic() < end:
            assert self.proc.poll() is None, f"server exited {self.proc.returncode}:\n{self.text()}"
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.5):
                    return
            except OSError:
                time.sleep(0.02)
        raise AssertionError(f"port never opened:\n{self.text()}")

    def wait_ready(self, deadline=120.0):
        end = time.monotonic() + deadline
        while time.monotonic() < end:
            assert self.proc.poll() is None, f"server exited {self.proc.returncode}:\n{self.text()}"
            try:
                if self.get("/health_generate", timeout=5)[0] == 200:
                    return
            except OSError:
                pass
            time.sleep(0.05)
        raise AssertionError(f"server never became ready:\n{self.text()}")

    def wait_exit(self, deadline=120.0) -> int:
        try:
            return self.proc.wait(deadline)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"server did not exit:\n{self.text()}") from None

    def stop(self):
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self._logf.close()


def request(url, body=None, timeout=10):
    """(status, parsed JSON or None) without raising on HTTP errors."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method="GET" if body is None else "POST",
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            raw = r.read()
            return r.status, (json.loads(raw) if raw else None)
    except urllib.error.HTTPError as e:
        raw = e.read()
        try:
            return e.code, (json.loads(raw) if raw else None)
        except ValueError:
            return e.code, raw.decode(errors="replace")
