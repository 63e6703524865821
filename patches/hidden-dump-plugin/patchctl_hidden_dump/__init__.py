"""The hidden-state capture as an SGLang plugin (patchctl series `hidden-dump-plugin`).

SGLang 0.5.23 runs the `sglang.srt.plugins` entry points of every installed distribution in the processes
that run the model (`plugins/__init__.py` `load_plugins`, called by `run_scheduler_process` among others),
then `HookRegistry.apply_hooks()`. `register` adds the two hooks the diff series `hidden-dump` patches in:

* around `ModelRunner.forward`: the forward mode as scheduled is read before the forward (the eager runner
  rewrites MIXED), and `hidden_dump.on_forward_end` runs after it with the forward's `logits_output`
  (patch 0002 calls it at the end of the same method's `with` block; nothing after that block changes
  `logits_output`);
* after `ForwardBatch.init_new`: `hidden_dump.note_batch` records each request's prompt length and abort
  state on the forward batch (patch 0003).

`hidden_dump` is the very module the diff series adds as `sglang/srt/hidden_dump.py` (patchctl builds it from
that series' patch 0001): same files, same bytes.
"""

from . import hidden_dump

MODEL_RUNNER_FORWARD = "sglang.srt.model_executor.model_runner.ModelRunner.forward"
FORWARD_BATCH_INIT_NEW = "sglang.srt.model_executor.forward_batch_info.ForwardBatch.init_new"


def _forward(original, self, forward_batch, *args, **kwargs):
    mode = forward_batch.forward_mode
    output = original(self, forward_batch, *args, **kwargs)
    if hidden_dump.enabled() and not self.is_draft_worker:
        hidden_dump.on_forward_end(self, forward_batch, output.logits_output, mode=mode)
    return output


def _init_new(ret, cls, batch, *args, **kwargs):
    model_runner = args[0] if args else kwargs.get("model_runner")
    if hidden_dump.enabled() and not model_runner.is_draft_worker:
        hidden_dump.note_batch(ret, batch)


def register():
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(MODEL_RUNNER_FORWARD, _forward, HookType.AROUND)
    HookRegistry.register(FORWARD_BATCH_INIT_NEW, _init_new, HookType.AFTER)
