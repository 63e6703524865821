# Owns: which SGLang server configurations the capture series cannot serve (standard library
# only). The agent applies it to the exact command line and model a restart would use, before
# any file or server is touched; `check --arch` and `plan` apply it on the controller.
"""Server configurations under which the hidden-dump capture would write nothing or garbage.

Each rule names the flag or architecture and the SGLang 0.5.23 code that makes it so. A
deploy that passed its smoke and then wrote nothing for real traffic is the worst outcome
this tool can have, so these are refused up front rather than discovered after a restart.
"""

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


def flag_values(argv, name):
    """Every value given to `name` in argv (`--x v` or `--x=v`), in order; [] if absent.
    A flag given without a value (a switch) yields ''."""
    out = []
    for i, a in enumerate(argv):
        if a == name:
            nxt = argv[i + 1] if i + 1 < len(argv) else ""
            out.append("" if nxt.startswith("--") else nxt)
        elif a.startswith(name + "="):
            out.append(a[len(name) + 1:])
    return out


def refusals(argv, arch=None):
    """Why the capture cannot work for a server started with `argv` serving `arch`: a list of
    messages, empty when nothing is known to be wrong."""
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
                           "(SGLang captures on the last stage only); serve with %s 1" % (flag, pp, flag))
    if arch and arch in REFUSED_ARCHS:
        out.append("%s: %s" % (arch, REFUSED_ARCHS[arch]))
    return out
