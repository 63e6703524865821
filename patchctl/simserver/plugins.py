"""SGLang's plugin loading, run by the stand-in as `run_scheduler_process` runs it.

The tree's own `sglang/srt/plugins/__init__.py` (`load_plugins`: entry points of the
`sglang.srt.plugins` group found on this process's path, the `SGLANG_PLUGINS` whitelist, a plugin
that fails to load or run logged and skipped) and `plugins/hook_registry.py` (`HookRegistry`,
`apply_hooks`) are imported and run unchanged. What they patch is the stand-in's: stub modules
`sglang.srt.model_executor.model_runner` (`ModelRunner.forward` runs the stand-in's raw forward) and
`sglang.srt.model_executor.forward_batch_info` (`ForwardBatch.init_new` returns the stand-in's forward
batch), so a hook on either runs around the stand-in's forward exactly where it runs in SGLang. A
target the stand-in does not imitate (a model class, a layer) cannot be resolved: `apply_hooks` logs
"Failed to apply hooks" and the server serves without it, as SGLang does with a hook that never fires.

Replaced, and why: `sglang.srt.environ` (its `envs` reads SGLang's whole settings table) by a stub whose
`SGLANG_PLUGINS` / `SGLANG_PLATFORM` read the process's environment as SGLang's `EnvStr` does.
"""

from __future__ import annotations

import importlib
import logging
import os
import sys
import types
from importlib.metadata import entry_points
from pathlib import Path

from patchctl.simserver.ducks import NS

logger = logging.getLogger(__name__)

GROUP = "sglang.srt.plugins"
MODEL_RUNNER = "sglang.srt.model_executor.model_runner"
FORWARD_BATCH_INFO = "sglang.srt.model_executor.forward_batch_info"


class _EnvStr:
    def __init__(self, name):
        self.name = name

    def get(self):
        return os.environ.get(self.name, "")


def _stub(name: str, **attrs) -> types.ModuleType:
    mod = sys.modules.get(name)
    if mod is None:
        mod = types.ModuleType(name)
        mod.__patchctl_stub__ = True
        sys.modules[name] = mod
        parent, _, leaf = name.rpartition(".")
        if parent in sys.modules:
            setattr(sys.modules[parent], leaf, mod)
    for k, v in attrs.items():
        setattr(mod, k, v)
    return mod


class ModelRunner:
    """Stand-in for SGLang's ModelRunner class: only `forward` (the attribute hooks patch)."""

    def forward(self, forward_batch, *args, **kwargs):
        return self._standin_raw()


class ForwardBatch:
    """Stand-in for SGLang's ForwardBatch class: only `init_new`."""

    @classmethod
    def init_new(cls, batch, model_runner):
        return batch._standin_forward_batch


class PluginHooks:
    """The hooks plugins put on ModelRunner.forward / ForwardBatch.init_new, in the engine's hook interface."""

    def __init__(self, names, hooked):
        self.names, self.hooked = names, hooked

    def call(self, module, runner, forward_batch, raw):
        runner._standin_raw = raw
        try:
            return ModelRunner.forward(runner, forward_batch)
        finally:
            runner._standin_raw = None

    def run(self, module, runner, forward_batch, schedule_batch):  # the batch hook
        ForwardBatch.init_new(NS(_standin_forward_batch=forward_batch, reqs=schedule_batch.reqs,
                                 forward_mode=schedule_batch.forward_mode), runner)


def load(root: Path):
    """(PluginHooks or None, the module plugins capture with or None): None when no plugin entry point is
    installed or none of them hooked ModelRunner.forward / ForwardBatch.init_new."""
    found = list(entry_points(group=GROUP))
    if not found:
        return None, None
    env = _stub("sglang.srt.environ")
    env.envs = NS(SGLANG_PLUGINS=_EnvStr("SGLANG_PLUGINS"), SGLANG_PLATFORM=_EnvStr("SGLANG_PLATFORM"))
    _stub("sglang.srt.model_executor")
    _stub(MODEL_RUNNER, ModelRunner=ModelRunner)
    _stub(FORWARD_BATCH_INFO, ForwardBatch=ForwardBatch)
    before = set(sys.modules)
    plugins = importlib.import_module("sglang.srt.plugins")  # the tree's own file
    logger.info("Loading plugins with %s", plugins.__file__)
    plugins.load_plugins()
    hooked = [t for t, fn in (("ModelRunner.forward", ModelRunner.__dict__["forward"]),
                              ("ForwardBatch.init_new", ForwardBatch.__dict__["init_new"].__func__))
              if getattr(fn, "__wrapped__", None) is not None]
    if not hooked:
        logger.info("No plugin hooked ModelRunner.forward or ForwardBatch.init_new")
        return None, None
    logger.info("Plugin hooks on %s", ", ".join(hooked))
    return PluginHooks([e.name for e in found], hooked), _capture_module(set(sys.modules) - before)


def _capture_module(new):
    """The capture module a plugin brought (what the stand-in flushes at shutdown), if any."""
    for name in sorted(new):
        mod = sys.modules.get(name)
        if all(callable(getattr(mod, a, None)) for a in ("on_forward_end", "note_batch", "flush")):
            return mod
    return None
