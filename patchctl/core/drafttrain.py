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
# Fewer samples than this is a small set: SpecForge's recipe (10 epochs at lr 1e-4, 7 TTT steps) gave 80 steps on
# 8 samples and a drafter just above the canary's gate (acceptance 1.65 on a 3-host fleet, issue 37), where the
# demo's settings (64 steps at lr 0.02, 2 TTT steps) gave 2.70 on the same fleet. Measured at 8 samples only.
SMALL_SET = 256
SMALL_STEPS = 64


def settings_for(samples: int) -> tuple[dict, str]:
    """The training settings for a collection of `samples` samples (SpecForge's field names), and why."""
    if 0 < samples < SMALL_SET:
        epochs = max(1, -(-SMALL_STEPS // samples))
        return ({"num_epochs": epochs, "learning_rate": 0.02, "ttt_length": 2},
                f"{samples} samples is a small set (< {SMALL_SET}): the demo's settings, {epochs} epochs (at least "
                f"{SMALL_STEPS} steps), learning rate 0.02, 2 TTT steps (at 8 samples: acceptance 2.70 where "
                "SpecForge's recipe gave 1.65); from "
                f"{SMALL_SET} samples on, SpecForge's recipe: 10 epochs, learning rate 1e-4, 7 TTT steps")
    return ({"num_epochs": DEFAULTS["num_epochs"], "learning_rate": DEFAULTS["learning_rate"], "ttt_length": 7},
            f"{samples} samples: SpecForge's own recipe (examples/configs/*eagle3*.yaml): 10 epochs, learning rate "
            f"1e-4, 7 TTT steps (fewer than {SMALL_SET} samples get the demo's small-set settings)")


def overrides_of(settings: dict | None) -> list[str]:
    return [f"training.{k}={v}" for k, v in (settings or {}).items()]


def run_paths(collection: Path) -> dict[str, Path]:
    """Where a collection's training goes: beside it, never inside it (SpecForge trains on every *.ckpt below
    hidden_states_path, and collect refuses files it does not know in its directory)."""
    c = Path(collection).absolute()
    return {"run": c / RUN_CONFIG, "draft_config": c / DRAFT_MODEL, "output": c.with_name(c.name + "-train"),
            "draft": c.with_name(c.name + "-draft")}


def run_config_text(hidden_states_path: str, target_model_path: str, draft_config: Path, output_dir: Path,
                    max_length: int, notes: list[str], settings: dict | None = None, strategy: str = "eagle3") -> str:
    """specforge-run.yaml in SpecForge 0.2.0's schema (strings JSON-quoted: valid YAML double-quoted scalars);
    `settings` (settings_for): the epochs, learning rate and TTT steps for the data's size; `strategy`: SpecForge's
    training.strategy (eagle3, dflash, dspark: the collection's capture convention)."""
    q = json.dumps
    d = {**DEFAULTS, "ttt_length": 7, **(settings or {})}
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
            f"  strategy: {strategy}\n"
            f"  num_epochs: {d['num_epochs']}\n"
            f"  batch_size: {d['batch_size']}\n"
            f"  learning_rate: {d['learning_rate']}\n"
            + (f"  ttt_length: {d['ttt_length']}\n" if strategy == "eagle3" else "") +
            "  attention_backend: sdpa   # GPU: flex_attention (SpecForge's default) is faster\n"
            "  fsdp_sharding: NO_SHARD   # one process; several GPUs: deployment.trainer.nproc_per_node=N and SHARD_GRAD_OP\n"
            f"  log_interval: {d['log_interval']}\n"
            f"output_dir: {q(str(output_dir))}\n"
            f"run_id: {strategy}\n")


def export_to(strategy: str) -> str:
    """SpecForge 0.2.0's exporter for a strategy: its SGLang exporter takes EAGLE-3 checkpoints only
    (export/to_sglang.py: "use --to hf for DFlash-family ... draft model directories")."""
    return "sglang" if strategy == "eagle3" else "hf"


def command_line(collection: Path, cpu: bool, settings: dict | None = None, strategy: str = "eagle3") -> str:
    """The one line a user types to train and export (SpecForge's own CLI), as collect's summary prints it;
    `settings` (settings_for, also in the run config) shown as overrides, so the line says what it trains with."""
    p = run_paths(collection)
    env = "".join(f"{k}={v} " for k, v in CPU_ENV.items()) if cpu else ""
    extra = "".join(" " + shlex.quote(o) for o in overrides_of(settings))
    return (f"{env}specforge train --config {shlex.quote(str(p['run']))}{extra} && specforge export --to {export_to(strategy)} "
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
    (a DFlash/DSpark draft config: `--to hf`, export_to) into COLLECTION-draft, in child processes of this Python (`-m specforge.cli`: the same program as the
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
    total = planned_steps(p["run"], overrides, collection)
    log(f"training: SpecForge starts (its imports, the target's embedding and head, the draft: tens of seconds on a "
        f"small CPU before its first step){f'; {total} steps' if total else ''}")
    _run([sys.executable, "-m", "specforge.cli", "train", "--config", str(p["run"]), *overrides], child_env, log,
         timeout, losses, total=total)
    t1 = time.time()
    draft_config = json.loads(p["draft_config"].read_text())
    to = export_to("eagle3" if draft_config.get("dflash_config") is None else "dflash")
    _run([sys.executable, "-m", "specforge.cli", "export", "--to", to, "--checkpoint", str(out),
          "--draft-config", str(p["draft_config"]), "--output-dir", str(p["draft"])], child_env, log, timeout, None)
    t2 = time.time()
    exported = check_export(p["draft"], draft_config)
    return Trained(p["draft"], out, losses, round(t1 - t0, 1), round(t2 - t1, 1), exported)


def planned_steps(run_config: Path, overrides, collection: Path) -> int | None:
    """How many steps `specforge train` will take: training.max_steps where set, else num_epochs x the samples
    (the *.ckpt files below the collection) / batch_size; None where it cannot be told."""
    fields = {}
    try:
        for m in re.finditer(r"^\s+(num_epochs|batch_size|max_steps):\s*(\d+)", Path(run_config).read_text(), re.M):
            fields[m.group(1)] = int(m.group(2))
    except OSError:
        return None
    for o in overrides:
        m = re.match(r"^training\.(num_epochs|batch_size|max_steps)=(\d+)$", o)
        if m:
            fields[m.group(1)] = int(m.group(2))
    samples = sum(1 for _ in Path(collection).rglob("*.ckpt"))
    per_epoch = -(-samples // max(1, fields.get("batch_size", 1))) if samples else 0
    by_epochs = per_epoch * fields["num_epochs"] if per_epoch and "num_epochs" in fields else None
    steps = [n for n in (fields.get("max_steps"), by_epochs) if n]
    return min(steps) if steps else None


def _eta(seconds: float) -> str:
    s = int(round(seconds))
    return f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s"


class StepProgress:
    """One line per step SpecForge logs: step/total, loss, s/step and the ETA (from the steps since the first)."""

    def __init__(self, total: int | None, clock=time.monotonic):
        self.total, self.clock = total, clock
        self.first: tuple[int, float] | None = None

    def line(self, step: int, loss: float) -> str:
        now = self.clock()
        if self.first is None:
            self.first = (step, now)
        of = f"/{self.total}" if self.total else ""
        pct = f" ({100 * step // self.total}%)" if self.total else ""
        out = f"training: step {step}{of}{pct}, loss {loss:.4f}"
        s0, t0 = self.first
        if step > s0:
            rate = (now - t0) / (step - s0)
            out += f", {rate:.2f} s/step"
            if self.total and self.total >= step:
                out += f", ETA {_eta(rate * (self.total - step))}"
        return out


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
    block = draft_config.get("dflash_config") is not None  # a DFlash / DSpark draft: its own keys
    keys = (("dflash_config", "target_layer_ids"), ("dflash_config", "mask_token_id"), ("block_size",)) if block \
        else (("eagle_config", "eagle_aux_hidden_state_layer_ids"),)
    for key in keys:
        want, have = _at(draft_config, key), _at(got, key)
        if want is None or have != want:
            bad.append(f"{'.'.join(key)} {have!r}, the capture's are {want!r}")
    if not list(Path(draft_dir).glob("*.safetensors")):
        bad.append("no *.safetensors weights")
    if bad:
        raise TrainFailed(f"{path}: the exported draft does not match the capture: " + "; ".join(bad))
    return got


def _at(d: dict, key: tuple):
    for k in key:
        d = d.get(k) if isinstance(d, dict) else None
    return d


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


def _run(argv: list[str], env: dict, log, timeout, losses: list | None, total: int | None = None) -> None:
    """One SpecForge command, its output passed to `log` line by line (loss lines parsed into `losses` and said
    as a progress line: step/total, loss, ETA; SpecForge's own dict of each logged step is not repeated)."""
    log("$ " + " ".join(shlex.quote(a) for a in argv))
    tail: list[str] = []
    progress = StepProgress(total)
    with subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          stdin=subprocess.DEVNULL) as proc:
        deadline = time.time() + timeout if timeout else None
        for line in proc.stdout:
            line = line.rstrip("\n")
            tail = (tail + [line])[-40:]
            m = _LOSS.match(line)
            if m and losses is not None:
                losses.append((int(m.group(1)), float(m.group(2))))
                log(progress.line(int(m.group(1)), float(m.group(2))))
            elif not line.startswith("step "):
                log(line)
            if deadline and time.time() > deadline:
                proc.kill()
                raise TrainFailed(f"{argv[3]} ran past {timeout}s; its last output:\n" + "\n".join(tail))
        rc = proc.wait()
    if rc != 0:
        raise TrainFailed(f"specforge {argv[3]} exited {rc}; its last output:\n" + "\n".join(tail))
