"""The two files beside a SpecForge collection that make it train with one command, as they are:
draft-model-config.json (the complete draft config: capture/draftconfig.py `draft_model_config`) and
specforge-run.yaml (SpecForge 0.2.0's run config: core/drafttrain.py), and the command line that uses them.

The target's model directory is the path the host's server was started with (`--model-path`, from its
/get_model_info, in run.json). SpecForge's trainer reads the target's config.json, and its embedding and
lm_head through the weights' index file, from there: on the demo's host (this machine) the path works as
it is; on a fleet the directory is on the hosts, and the file and the summary say so.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from patchctl.commands.capture import draftconfig
from patchctl.core import drafttrain


def target_is_here(facts: dict) -> bool:
    """The served model's directory exists on this machine with the same config.json facts."""
    path = facts.get("model_path") or ""
    try:
        c = json.loads((Path(os.path.expanduser(path)) / "config.json").read_text())
    except (OSError, ValueError):
        return False
    c = c.get("text_config") if isinstance(c.get("text_config"), dict) and "hidden_size" not in c else c
    return c.get("hidden_size") == facts.get("hidden_size") and c.get("vocab_size") == facts.get("vocab_size")


def write(out: Path, fields: dict, host_facts: dict, hosts: list[str], hidden_states_path: str, longest: int,
          write_atomic, samples: int = 0) -> dict:
    """Write both files into `out` (the run config's epochs, learning rate and TTT steps fit `samples`,
    drafttrain.settings_for); {"draft_model_config", "run_config", "command", "target_here", "settings",
    "settings_why", "problems"} for the summary."""
    strategy = (fields.get("_patchctl") or {}).get("capture_convention") or "eagle3"
    settings, why = drafttrain.settings_for(samples)
    if strategy != "eagle3":  # TTT steps are EAGLE-3's; a block draft predicts a block in one pass
        settings.pop("ttt_length", None)
        why = why.replace(", 2 TTT steps", "").replace(", 7 TTT steps", "")
    host = hosts[0] if hosts else next(iter(host_facts), None)
    facts = host_facts.get(host) or {}
    cfg, problems = draftconfig.draft_model_config(fields, facts)
    paths = drafttrain.run_paths(out)
    here = target_is_here(facts)
    model_path = facts.get("model_path") or ""
    notes = [f"SpecForge 0.2.0 run config for capture run {fields.get('_patchctl', {}).get('run')!r}, written by "
             "patchctl capture collect.",
             "Train and export (on a machine without CUDA prefix the first command with "
             f"{' '.join(f'{k}={v}' for k, v in drafttrain.CPU_ENV.items())}):",
             "  " + drafttrain.command_line(out, cpu=False, settings=settings, strategy=strategy),
             "Training settings: " + why + ".",
             "Any field can be overridden on the command line: specforge train --config THIS training.max_steps=100"]
    if not here:
        notes.append(f"target_model_path is the served --model-path on host {host} ({model_path}): it is not on this "
                     "machine; train where it is, or point model.target_model_path at a copy (config.json, tokenizer "
                     "files, the weights holding embed_tokens and lm_head with their index file)")
    text = drafttrain.run_config_text(hidden_states_path, os.path.expanduser(model_path) if here else model_path,
                                      paths["draft_config"], paths["output"], max(drafttrain.DEFAULTS["max_length"],
                                                                                   longest), notes, settings,
                                      strategy)
    write_atomic(paths["draft_config"], (json.dumps(cfg, indent=2) + "\n").encode())
    write_atomic(paths["run"], text.encode())
    return {"draft_model_config": str(paths["draft_config"]), "run_config": str(paths["run"]),
            "command": drafttrain.command_line(out, cpu=_no_cuda_here(), settings=settings, strategy=strategy),
            "strategy": strategy, "target_here": here,
            "settings": settings, "settings_why": why,
            "target_model_path": model_path, "target_host": host, "problems": problems}


def _no_cuda_here() -> bool:
    """Whether training on this machine is on CPU (torch imported only where collect already needs it)."""
    try:
        import torch
    except ImportError:
        return True
    return not torch.cuda.is_available()
