"""A stand-in for `python -m sglang.launch_server` (NOT SGLang) for tests and the local demo.

Real SGLang needs GPUs; patchctl only needs what it can observe of a server.
This process keeps that surface: the same kind of command line, SGLang's HTTP
endpoints (`/health`, `/health_generate` 503 until ready, `/get_model_info`,
`/get_server_info`, `POST /generate`), a start-up that fails when the SGLang
tree it serves does not compile or import, and a tiny deterministic torch model
whose layer outputs go through the tree's own `hidden_dump.on_forward_end` hook,
found in and executed from `ModelRunner.forward` of the tree's
`model_runner.py` (a hook placed anywhere else never fires, as under SGLang's
CUDA graphs); the tree's `hidden_dump.note_batch` call in `ForwardBatch.init_new`
(`forward_batch_info.py`) runs on every batch the same way. With `--speculative-algorithm EAGLE3
--speculative-draft-model-path DIR` it serves an EAGLE-3 draft as SGLang 0.5.23 does (chain drafting,
top-k 1 only), its acceptance counted from real draft and target forwards and reported in SGLang's fields.

Run it as `python -m patchctl.simserver` or `patchctl-simserver`; `--help` lists
the flags and knobs. Its parts, each with what it owns:

    cli        the command line and the start-up sequence (in SGLang's order), shutdown
    knobs      the PATCHCTL_SIM_* environment knobs (slow start, crash, hang, die, stall, NaN, light)
    tree       the served SGLang tree: where it is, its version, what a patch changed, compiling
               it, importing its hidden_dump.py under stub parent packages
    hook       the hook statements extracted from the tree's ModelRunner.forward and
               ForwardBatch.init_new, and the namespaces they run in
    ducks      duck-typed SGLang objects the hooks read (ForwardMode, the runtime-context stub)
    model      the tiny deterministic torch model, its config.json, the capture layer ids
    engine     the scheduler: batches requests into extend/decode forwards, runs the hooks
    spec       speculative decoding: SGLang's flag validation, draft-and-verify, the spec_* figures
    draft      an EAGLE-3 draft directory loaded as SGLang's LlamaForCausalLMEagle3 loads it; its forward
    api        SGLang's HTTP surface (/health, /health_generate, /get_model_info,
               /get_server_info, POST /generate, POST /flush_cache)
    multinode  --nnodes/--node-rank/--dist-init-addr: the head waits for the others;
               a node that dies takes the others down
"""


def main(argv=None):
    """The `patchctl-simserver` entry point (pyproject names `patchctl.simserver:main`)."""
    from patchctl.simserver.cli import main as run

    return run(argv)
