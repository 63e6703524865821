# Owns: which SGLang server configurations the capture series cannot serve (standard library
# only). The agent applies it to the exact command line and model a restart would use, before
# any file or server is touched; `check --arch` and `plan` apply it on the controller.
"""Server configurations under which the hidden-dump capture would write nothing or garbage.

Each rule names the flag or architecture and the SGLang 0.5.23 code that makes it so. A
deploy that passed its smoke and then wrote nothing for real traffic is the worst outcome
this tool can have, so these are refused up front rather than discovered after a restart.
The capture convention (`--speculative-algorithm EAGLE3|DFLASH|DSPARK` beside
`--enable-return-aux-hidden-states`) is judged by capture_rules: what SGLang's validation
refuses, an architecture without that convention's method (Kimi-K3 with EAGLE3), the
method's own checks on the ids, and where the hidden-dump module would mislabel the layers.
"""

from .capture_rules import (DRAFT_FLAG, WHERE_SGLANG, convention_of, dump_refusal, flag_values, judge,
                            layer_ids_of)

REFUSED_FLAGS = {
    "--enable-pdmux": (
        "split prefill (PD multiplexing) returns no aux hidden states from its intermediate "
        "splits (sglang/srt/models/llama.py:640-675): prompts would not be dumped; "
        "remove --enable-pdmux"),
}

REFUSED_ARCHS = {
    "DeepseekV4ForCausalLM": (
        "its bounded SWA replay returns hidden states only for the rows in "
        "hidden_states_token_indices (sglang/srt/models/deepseek_v4.py:4997-5001): no whole "
        "prompt can be dumped"),
}

# EAGLE-3 aux capture runs on the last pipeline stage only and SGLang's capture mode
# requires pipeline parallel = 1.
PIPELINE_FLAGS = ("--pp-size", "--pipeline-parallel-size")


def refusals(argv, arch=None, num_layers=None):
    """Why the capture cannot work for a server started with `argv` serving `arch` (of
    `num_layers` layers, when known): a list of messages, empty when nothing is known to be wrong."""
    argv = [str(a) for a in argv or ()]
    out = []
    for flag, why in REFUSED_FLAGS.items():
        if flag_values(argv, flag):
            out.append("%s: %s" % (flag, why))
    for flag in PIPELINE_FLAGS:
        vals = flag_values(argv, flag)
        if vals:
            try:
                pp = int(vals[-1])
            except ValueError:
                continue
            if pp > 1:
                out.append("%s %d: EAGLE-3 aux hidden-state capture needs pipeline parallel = 1 "
                           "(SGLang captures on the last stage only: %s); serve with %s 1" % (
                               flag, pp, WHERE_SGLANG["pp"], flag))
    if arch and arch in REFUSED_ARCHS:
        out.append("%s: %s" % (arch, REFUSED_ARCHS[arch]))
    return out + convention_refusals(argv, arch, num_layers)


def convention_refusals(argv, arch=None, num_layers=None):
    """What SGLang 0.5.23 refuses at start, or the dump would get wrong, for the capture convention
    and layer ids this command line names (none when it does not capture)."""
    conv = convention_of(argv)
    if conv is None:
        return []
    ids = layer_ids_of(argv)
    if ids == "bad":
        return ["--return-aux-hidden-state-layer-ids: not a list of integers"]
    out = []
    if ids and any(a >= b for a, b in zip(ids, ids[1:])):
        out.append("--return-aux-hidden-state-layer-ids %s: not in increasing order (SGLang's models concatenate "
                   "the captured states in layer order; the dump's labels would keep this order)" % (ids,))
    if flag_values(argv, DRAFT_FLAG):
        out.append("%s: --enable-return-aux-hidden-states captures without a draft (%s)" % (
            DRAFT_FLAG, WHERE_SGLANG["no_draft"]))
    layers, why = judge(conv, arch, ids, num_layers)
    out += why
    dump = dump_refusal(conv, arch, ids, num_layers)
    if dump:
        out.append(dump)
    return out
