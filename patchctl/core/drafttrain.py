"""From a collected SpecForge training directory to a trained EAGLE-3 draft directory: the run config
`capture collect` writes beside the data, the one command line a user types, and the function the demo and
the tests call to train and export with SpecForge 0.2.0's own CLI.

SpecForge 0.2.0 has one training entry point, `specforge train --config RUN.yaml [section.field=value ...]`
(specforge/cli.py; the dotted overrides re-validate through the same strict schema, config/schema.py, which
forbids unknown keys), and `specforge export --to sglang --checkpoint OUT --draft-config DRAFT.json
--output-dir DIR` (export/to_sglang.py) for the directory SGLang loads. Training on CPU needs two things
the GPU path does not: its KL loss is a Triton kernel launched unconditionally (core/loss.py), which runs on
CPU only in Triton's interpreter (TRITON_INTERPRET=1), and its RMSNorm is `torch.compile`d, whose CPU
compile costs minutes on a small machine (TORCHDYNAMO_DISABLE=1 runs it eagerly). The run config itself is
device-neutral: one process, `fsdp_sharding: NO_SHARD` (nothing to shard for a one-layer draft in one
process) and `attention_backend: sdpa` (flex_attention, SpecForge's default, needs a GPU compile).

Export never writes training overrides back (the layer ids come from the draft config file), so after export
the draft directory's `eagle_config` is compared with the draft config's: a drafter that would capture other
layers than it was trained on is refused here, not discovered as a low acceptance rate.

Standard library only: the controller never needs torch; SpecForge runs in a child process.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from patchctl.core.errors import PatchctlError

RUN_CONFIG = "specforge-run.yaml"
DRAFT_MODEL = "draft-model-config.json"
CPU_ENV = {"TRITON_INTERPRET": "1", "TORCHDYNAMO_DISABLE": "1"}
# SpecForge's own example recipes (examples/configs/*eagle3*.yaml): 10 epochs, lr 1e-4, batch 1, 7 TTT steps
DEFAULTS = {"num_epochs": 10, "learning_rate": 1e-4, "batch_size": 1, "max_length": 2048, "log_interval": 10}
_LOSS = re.compile(r"^step (\d+): \{.*'loss': ([-+0-9.eEnaif]+)")


def run_paths(collection: Path) -> dict[str, Path]:
    """Where a collection's training goes: beside it, never inside it (SpecForge trains on every *.ckpt below
    hidden_states_path, and collect refuses files it does not know in its directory)."""
    c = Path(collection).absolute()
    return {"run": c / RUN_CONFIG, "draft_config": c / DRAFT_MODEL, "output": c.with_name(c.name + "-train"),
            "draft": c.with_name(c.name + "-draft")}


def run_config_text(hidden_states_path: str, target_model_path: str, draft_config: Path, output_dir: Path,
                    max_length: int, notes: list[str]) -> str:
    """specforge-run.yaml in SpecForge 0.2.0's schema (strings JSON-quoted: valid YAML double-quoted scalars)."""
    q = json.dumps
    d = DEFAULTS
    head = "".join(f"# {line}\n" for line in notes)
    return (f"{head}"
            "model:\n"
            f"  target_model_path: {q(target_model_path)}\n"
            f"  draft_model_config: {q(str(draft_config))}\n"
            "data:\n"
            f"  hidden_states_path: {q(hidden_states_path)}\n"
            f"  max_length: {int(max_length)}   # longer samples are cut here (SpecForge's default 2048, or the longest collected)\n"
            f"  cache_dir: {q(str(output_dir / 'cache'))}   # SpecForge's vocab map cache (default ./cache)\n"
            "training:\n"
            "  strategy: eagle3\n"
            f"  num_epochs: {d['num_epochs']}\n"
            f"  batch_size: {d['batch_size']}\n"
            f"  learning_rate: {d['learning_rate']}\n"
            "  ttt_length: 7\n"
            "  attention_backend: sdpa   # GPU: flex_attention (SpecForge's default) is faster\n"
            "  fsdp_sharding: NO_SHARD   # one process; several GPUs: deployment.trainer.nproc_per_node=N and SHARD_GRAD_OP\n"
            f"  log_interval: {d['log_interval']}\n"
            f"output_dir: {q(str(output_dir))}\n"
            "run_id: eagle3\n")


def command_line(collection: Path, cpu: bool) -> str:
    """The one line a user types to train and export (SpecForge's own CLI), as collect's summary prints it."""
    p = run_paths(collection)
    env = "".join(f"{k}={v} " for k, v in CPU_ENV.items()) if cpu else ""
    return (f"{env}specforge train --config {shlex.quote(str(p['run']))} && specforge export --to sglang "
            f"--checkpoint {shlex.quote(str(p['output']))} --draft-config {shlex.quote(str(p['draft_config']))} "
            f"--output-dir {shlex.quote(str(p['draft']))}")


class TrainFailed(PatchctlError):
    exit_code = 1


@dataclass
class Trained:
    draft_dir: Path
    checkpoint: Path
    losses: list[tuple[int, float]] = field(default_factory=list)  # (step, loss) as SpecForge logged them
    train_seconds: float = 0.0
    export_seconds: float = 0.0
    config: dict = field(default_factory=dict)  # the exported config.json


def train_and_export(collection: Path, overrides: list[str] = (), cpu: bool | None = None, env: dict | None = None,
                     log=None, timeout: float | None = None) -> Trained:
    """`specforge train --config COLLECTION/specforge-run.yaml [overrides]` then `specforge export --to sglang`
    into COLLECTION-draft, in child processes of this Python (`-m specforge.cli`: the same program as the
    `specforge` script); the exported eagle_config, hidden and vocab sizes checked against the draft config.
    `cpu` None: no CUDA in this Python's torch (asked in the child, torch is not imported here)."""
    p = run_paths(collection)
    for k in ("run", "draft_config"):
        if not p[k].is_file():
            raise TrainFailed(f"{p[k]} is missing: `patchctl capture collect ... --format specforge` writes it")
    out = p["output"]
    for o in overrides:
        if o.startswith("output_dir="):
            out = Path(o.split("=", 1)[1])
    if cpu is None:
        cpu = _no_cuda()
    child_env = dict(os.environ, **(CPU_ENV if cpu else {}), **(env or {}))
    log = log or (lambda line: print(line, flush=True))
    t0 = time.time()
    losses: list[tuple[int, float]] = []
    _run([sys.executable, "-m", "specforge.cli", "train", "--config", str(p["run"]), *overrides], child_env, log,
         timeout, losses)
    t1 = time.time()
    _run([sys.executable, "-m", "specforge.cli", "export", "--to", "sglang", "--checkpoint", str(out),
          "--draft-config", str(p["draft_config"]), "--output-dir", str(p["draft"])], child_env, log, timeout, None)
    t2 = time.time()
    exported = check_export(p["draft"], json.loads(p["draft_config"].read_text()))
    return Trained(p["draft"], out, losses, round(t1 - t0, 1), round(t2 - t1, 1), exported)


def check_export(draft_dir: Path, draft_config: dict) -> dict:
    """The exported config.json against the draft config it was exported with: the fields SGLang reads to
    decide which target layers to capture and how big the draft is (SpecForge writes no override back)."""
    path = Path(draft_dir) / "config.json"
    try:
        got = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise TrainFailed(f"{path}: cannot read the exported config ({e})") from None
    bad = []
    for k in ("architectures", "hidden_size", "vocab_size", "draft_vocab_size", "target_hidden_size"):
        if k in draft_config and got.get(k) != draft_config[k]:
            bad.append(f"{k} {got.get(k)!r}, the draft config has {draft_config[k]!r}")
    want = (draft_config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    have = (got.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    if want is None or have != want:
        bad.append(f"eagle_config.eagle_aux_hidden_state_layer_ids {have!r}, the capture's are {want!r}")
    if not list(Path(draft_dir).glob("*.safetensors")):
        bad.append("no *.safetensors weights")
    if bad:
        raise TrainFailed(f"{path}: the exported draft does not match the capture: " + "; ".join(bad))
    return got


def cannot_train(env: dict | None = None) -> str | None:
    """Why SpecForge's training cannot start in this Python (its last error line), or None: the modules
    `specforge train` loads, imported in a child process as it will import them."""
    r = subprocess.run([sys.executable, "-c", "import accelerate, triton, yaml, specforge.modeling.draft, "
                        "specforge.training.assembly"], capture_output=True, text=True, stdin=subprocess.DEVNULL,
                       env=dict(os.environ, **(env or {})))
    if r.returncode == 0:
        return None
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    return lines[-1] if lines else f"exit {r.returncode}"


def _no_cuda() -> bool:
    r = subprocess.run([sys.executable, "-c", "import torch; print(torch.cuda.is_available())"],
                       capture_output=True, text=True)
    return r.stdout.strip() != "True"


def _run(argv: list[str], env: dict, log, timeout, losses: list | None) -> None:
    """One SpecForge command, its output passed to `log` line by line (loss lines parsed into `losses`)."""
    log("$ " + " ".join(shlex.quote(a) for a in argv))
    tail: list[str] = []
    with subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          stdin=subprocess.DEVNULL) as proc:
        deadline = time.time() + timeout if timeout else None
        for line in proc.stdout:
            line = line.rstrip("\n")
            tail = (tail + [line])[-40:]
            m = _LOSS.match(line)
            if m and losses is not None:
                losses.append((int(m.group(1)), float(m.group(2))))
                log(f"step {m.group(1)}: loss {float(m.group(2)):.4f}")
            elif not line.startswith("step "):
                log(line)
            if deadline and time.time() > deadline:
                proc.kill()
                raise TrainFailed(f"{argv[3]} ran past {timeout}s; its last output:\n" + "\n".join(tail))
        rc = proc.wait()
    if rc != 0:
        raise TrainFailed(f"specforge {argv[3]} exited {rc}; its last output:\n" + "\n".join(tail))
