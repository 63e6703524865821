"""The drafter a host's server speculates with: its record, its flags, and the rules SGLang 0.5.23 sets.

A deployed EAGLE-3 drafter is part of the server config, as a capture series' profile is: the server
runs the inventory's command plus either the capture profile's flags or the speculative flags with the
host's copy of the draft directory (`artifact`'s store, `<state_dir>/drafters/<digest>/`), never both:
SGLang 0.5.23 refuses a draft path beside `--enable-return-aux-hidden-states`
(`arg_groups/validation_hook.py`: "captures without a draft; drop --speculative-draft-model-path").

`<state_dir>/drafter.json` records what serves: the drafter (digest, where it came from, the capture run
its training data came from), `status` pending (restarted, acceptance not yet measured) or verified (the
canary measured it and let it through), the acceptance measured, the drafter before it (`previous`) and
the exact server config in force before the deploy (`server_before`), so a rollback restarts exactly that.
`chain` is every verified drafter before it, nearest first, each its whole record (its `server_before`
included) without a chain of its own: a flat list, so the file's nesting stays the same however many
deploys it records; `steps` walks it (one `drafter rollback` a step) back to the config before the first.
A record written before the chain (issue 39) holds only a summary as `previous`: its chain ends there, and
the step after it goes to no drafter on the inventory's server config.

The speculative settings (`[server.speculative]` in the inventory) are checked here, once for both sides:
the controller refuses them at load (file and line), the agent builds the flags from them.
Standard library only, Python 3.8 syntax.
"""

import json
import os

from .atomic import write_atomic
from .events import AgentError
from .osutil import read_json

ALGORITHMS = ("EAGLE3", "DFLASH", "DSPARK")
# set all three, the same in both arms of a canary (SGLang's own defaults depend on the target's architecture)
DEFAULTS = {"algorithm": "EAGLE3", "num_steps": 3, "eagle_topk": 1, "num_draft_tokens": 4}
EAGLE_KEYS = ("num_steps", "eagle_topk", "num_draft_tokens")
KEYS = ("algorithm", "num_steps", "eagle_topk", "num_draft_tokens", "block_size", "args")
# the block drafters' own block-size flag (arg_groups/fields/spec.py:70-81): DFLASH's verify window (= its
# --speculative-num-draft-tokens), DSPARK's gamma (tokens proposed per step; verify window gamma + 1)
BLOCK_FLAG = {"DFLASH": "--speculative-dflash-block-size", "DSPARK": "--speculative-dspark-block-size"}
# the draft architectures each block algorithm's worker serves (models/dflash.py:1317, models/dspark.py:995)
BLOCK_ARCHS = {"DFLASH": ("DFlashDraftModel",), "DSPARK": ("DSparkDraftModel", "Qwen3DSparkModel", "LingDSparkModel")}
EAGLE3_DRAFTS = ("LlamaForCausalLMEagle3", "Eagle3DeepseekV2ForCausalLM")
# flags patchctl writes itself from the settings and the deployed drafter; `args` may not carry them
MANAGED_FLAGS = ("--speculative-algorithm", "--speculative-draft-model-path", "--speculative-num-steps",
                 "--speculative-eagle-topk", "--speculative-num-draft-tokens", "--enable-return-aux-hidden-states",
                 "--return-aux-hidden-state-layer-ids") + tuple(BLOCK_FLAG.values())
# SGLANG_SIMULATE_ACC_LEN makes SGLang fake the acceptance (environ.py): a measured canary would be a lie
FAKING_ENV = ("SGLANG_SIMULATE_ACC_LEN",)
STATES = ("pending", "verified")

# Where SGLang 0.5.23 decides what the refusals below name (paths under sglang/srt/ of the 0.5.23 wheel)
SG = {
    "eagle3_aux": "model_executor/model_runner_components/spec_aux_hidden_state.py:185 (`if spec_algorithm.is_eagle3(): "
                  "config.eagle_use_aux_hidden_state = True`)",
    "nextn_alias": "arg_groups/speculative_hook.py:109-116 (NEXTN and EAGLE resolve to EAGLE)",
    "steps_assert": "arg_groups/speculative_hook.py:1159-1163",
    "topk1_tokens": "arg_groups/speculative_hook.py:1255-1266",
    "tree_topk": "speculative/eagle_utils.py:110",
    "trtllm_mha_topk": "arg_groups/speculative_hook.py:1176-1180",
    "page_tree": "arg_groups/speculative_hook.py:1271-1283",
    "draft_backend": "speculative/draft_utils.py:55-64 (the draft runs --speculative-draft-attention-backend, else the "
                     "target's prefill/decode attention backend; one not in its table is a ValueError at start)",
    "mla_only": "speculative/draft_utils.py:335-345, 358-362, 378-382, 512-516, 532-538",
    "mha_only": "speculative/draft_utils.py:346-357, 504-511 (layers/attention/trtllm_mha_backend.py has no MLA path)",
    "block_steps": "arg_groups/speculative_hook.py:329-366 (DFLASH), :767-789 (DSPARK): num_steps and eagle_topk "
                   "overridden to 1 with a warning",
    "dflash_tokens": "arg_groups/speculative_hook.py:368-387 (--speculative-num-draft-tokens must equal the block size)",
    "dspark_tokens": "arg_groups/speculative_hook.py:822-838 (--speculative-num-draft-tokens must equal gamma + 1)",
    "block_mismatch": {"DFLASH": "speculative/dflash_worker_v2.py:511-521", "DSPARK":
                       "speculative/dspark_components/dspark_config.py:108-117"},
    "dflash_backend": "arg_groups/speculative_hook.py:945-983 (trtllm_mha only for an all-sliding or causal draft, "
                      "else a fallback with a warning)",
    "block_worker": "model_executor/model_runner_components/spec_aux_hidden_state.py:199-283",
}
WHY_EAGLE3 = ("an EAGLE-3 draft (LlamaForCausalLMEagle3, Eagle3DeepseekV2ForCausalLM) is fed the target's aux hidden "
              "states, and SGLang 0.5.23 captures them only for EAGLE3 (%s; %s): with EAGLE or NEXTN the draft loads, "
              "serves without an error and accepts nothing (accept length 1.0)" % (SG["eagle3_aux"], SG["nextn_alias"]))
# the attention backends speculative/draft_utils.py:96-143 builds a draft worker on
DRAFT_BACKENDS = ("flashinfer", "triton", "intel_amx", "intel_xpu", "aiter", "fa3", "hybrid_linear_attn", "flashmla",
                  "trtllm_mha", "trtllm_mla", "cutedsl_mla", "dsa", "nsa", "ascend", "fa4", "dsv4")
MLA_ONLY_BACKENDS = ("flashmla", "trtllm_mla", "cutedsl_mla")
MHA_ONLY_BACKENDS = ("trtllm_mha",)
MLA_DRAFTS = ("Eagle3DeepseekV2ForCausalLM",)
PAGE_TREE_BACKENDS = ("flashinfer", "fa3", "triton")
BACKEND_FLAGS = ("--attention-backend", "--prefill-attention-backend", "--decode-attention-backend")


def accept_of(m):
    """A measured arm's acceptance length: SGLang's figure, or 1.0 for a server that does not speculate."""
    return m["accept_length"] if m.get("accept_length") is not None else 1.0


def check_speculative(table):
    """(settings with defaults filled in, [(key, problem)]) for an inventory's `[server.speculative]` table."""
    problems = []
    out = dict(DEFAULTS, args=[])
    for k, v in (table or {}).items():
        if k not in KEYS:
            problems.append((k, "unknown key; expected one of: %s" % ", ".join(KEYS)))
        elif k == "algorithm":
            if v not in ALGORITHMS:
                problems.append((k, "%r: patchctl deploys EAGLE-3, DFlash and DSpark drafters (expected %s): %s" % (
                    v, " or ".join(ALGORITHMS), WHY_EAGLE3)))
            out[k] = v
        elif k == "args":
            if not isinstance(v, list) or not all(isinstance(x, str) for x in v):
                problems.append((k, "expected a list of strings (command-line words)"))
                continue
            clash = [a for a in v if a.split("=", 1)[0] in MANAGED_FLAGS]
            if clash:
                problems.append((k, "%s: set by patchctl from the settings and the deployed drafter" % ", ".join(clash)))
            out[k] = list(v)
        else:
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                problems.append((k, "expected a positive integer, got %r" % (v,)))
            out[k] = v
    given = set((table or {}).keys())
    if out["algorithm"] in BLOCK_FLAG:
        return _block_settings(out, given, problems)
    if "block_size" in given:
        problems.append(("block_size", "a DFLASH or DSPARK setting; EAGLE3 drafts num_steps tokens a step"))
    if given & set(("eagle_topk", "num_draft_tokens")) and "num_steps" not in given:
        problems.append(("num_steps", "SGLang 0.5.23 refuses eagle_topk or num_draft_tokens without num_steps "
                                      "(a bare assert: %s)" % SG["steps_assert"]))
    elif not problems:
        problems += _combination(out)
    return out, problems


def _block_settings(out, given, problems):
    """A DFLASH / DSPARK table: the algorithm, its block size (absent: the deployed draft's own) and args. The
    EAGLE keys are refused: SGLang overrides steps and top-k to 1 and needs draft tokens = the block size
    (DFLASH) or gamma + 1 (DSPARK); patchctl sets the block-size flag itself."""
    for k in EAGLE_KEYS:
        out.pop(k, None)
        if k in given:
            problems.append((k, "not a %s setting: %s; %s; set block_size (or leave it to the draft's config.json)" % (
                out["algorithm"], SG["block_steps"], SG["dflash_tokens" if out["algorithm"] == "DFLASH" else "dspark_tokens"])))
    return out, problems


def _combination(s):
    """[(key, problem)] for the steps / top-k / draft-token combinations SGLang 0.5.23 changes or cannot run."""
    steps, topk, ntok = s["num_steps"], s["eagle_topk"], s["num_draft_tokens"]
    if topk == 1 and ntok != steps + 1:
        return [("num_draft_tokens", "%d: with eagle_topk 1 SGLang 0.5.23 sets num_draft_tokens to num_steps + 1 = %d "
                                     "with only a log warning (%s), so the canary would measure another config than "
                                     "the inventory names; set that" % (ntok, steps + 1, SG["topk1_tokens"]))]
    most = topk + (steps - 1) * topk * topk + 1  # the tree's candidates plus the verified root
    if ntok > most:
        return [("num_draft_tokens", "%d: the draft tree of num_steps %d, eagle_topk %d has %d candidates, so at most %d "
                                     "draft tokens; SGLang 0.5.23 picks num_draft_tokens - 1 of them with torch.topk "
                                     "(%s), which fails at the first decode" % (ntok, steps, topk, most - 1, most,
                                                                               SG["tree_topk"]))]
    return []


def flag_values(words):
    """{flag: last value} of a command line's `--flag value` and `--flag=value` words."""
    out = {}
    for i, w in enumerate(words):
        if w.startswith("--"):
            if "=" in w:
                k, v = w.split("=", 1)
                out[k] = v
            elif i + 1 < len(words) and not words[i + 1].startswith("--"):
                out[w] = words[i + 1]
    return out


def _algorithm_problems(algo, draft_arch):
    """[(flag, problem)] when the algorithm's worker does not serve a draft of this architecture."""
    if not draft_arch:
        return []
    if algo == "EAGLE3" and draft_arch not in EAGLE3_DRAFTS and any(draft_arch in a for a in BLOCK_ARCHS.values()):
        want = [a for a, archs in BLOCK_ARCHS.items() if draft_arch in archs][0]
        return [("--speculative-algorithm", "EAGLE3 for the block draft %s: the EAGLE-3 worker reads eagle_config, "
                 "which it has none of, and silently captures SGLang's default layers (%s); set [server.speculative] "
                 "algorithm = \"%s\"" % (draft_arch, SG["eagle3_aux"], want))]
    if algo in BLOCK_ARCHS and draft_arch not in BLOCK_ARCHS[algo]:
        other = [a for a, archs in BLOCK_ARCHS.items() if draft_arch in archs]
        hint = ("set [server.speculative] algorithm = \"%s\"" % (other[0] if other else "EAGLE3"))
        why = ("the DSPARK worker refuses a draft without a Markov head at start (%s)" % SG["block_worker"]
               if algo == "DSPARK" else "the DFLASH worker builds the draft's own class and feeds it as a DFlash draft "
               "(%s)" % SG["block_worker"])
        return [("--speculative-algorithm", "%s for a %s draft (its worker serves %s): %s; %s" % (
            algo, draft_arch, ", ".join(BLOCK_ARCHS[algo]), why, hint))]
    return []


def _block_problems(s, f, draft_block):
    """[(flag, problem)] for a DFLASH / DSPARK server: the block size against the draft's, the draft backend."""
    algo, out = s.get("algorithm"), []
    flag, bs = BLOCK_FLAG[algo], s.get("block_size")
    if bs is not None and draft_block is not None and bs != draft_block:
        out.append((flag, "%s (the inventory's [server.speculative] block_size) for a draft trained with block_size %s: "
                          "SGLang 0.5.23 serves the flag's size with only a log warning (%s), so the draft would "
                          "propose blocks it was not trained on; set block_size = %s or leave it out (patchctl then "
                          "passes the draft's own)" % (bs, draft_block, SG["block_mismatch"][algo], draft_block)))
    if algo == "DFLASH" and f.get("--speculative-draft-attention-backend") == "trtllm_mha":
        out.append(("--speculative-draft-attention-backend", "trtllm_mha for a DFlash draft (non-causal blocks): SGLang "
                    "0.5.23 serves another backend than named (%s); give fa3, flashinfer or triton" % SG["dflash_backend"]))
    return out


def launch_problems(settings, command_words, draft_arch, draft_block=None):
    """[(flag, problem)]: what the server command (`command_words`, the inventory's `command` split plus
    `[server.speculative] args`) and the settings would start that SGLang 0.5.23 refuses at start, or starts
    and serves wrongly, for a draft of architecture `draft_arch` (a block draft's `block_size`: `draft_block`).
    Only what the words name is judged: a backend SGLang picks itself (none given) is not known here."""
    s = settings or DEFAULTS
    f = flag_values(list(command_words or []) + list(s.get("args") or []))
    algo = s.get("algorithm", "EAGLE3")
    out = _algorithm_problems(algo, draft_arch)
    if algo in BLOCK_FLAG:
        return out + _block_problems(s, f, draft_block)
    if algo != "EAGLE3" and draft_arch:
        out.append(("--speculative-algorithm", "%s for a %s draft: %s" % (algo, draft_arch, WHY_EAGLE3)))
    target = [f[k] for k in BACKEND_FLAGS if k in f]
    explicit = f.get("--speculative-draft-attention-backend")
    topk = s.get("eagle_topk", 1)
    if "trtllm_mha" in target and topk > 1:
        out.append(("--attention-backend", "trtllm_mha with eagle_topk %d: SGLang 0.5.23 refuses it (\"trtllm_mha backend "
                                           "only supports topk = 1\", %s)" % (topk, SG["trtllm_mha_topk"])))
    page = f.get("--page-size")
    main = f.get("--attention-backend")
    if topk > 1 and page and page.isdigit() and int(page) > 1 and main and main not in PAGE_TREE_BACKENDS:
        out.append(("--page-size", "%s with eagle_topk %d on attention backend %s: SGLang 0.5.23 refuses it (only %s "
                                   "draft a tree over pages, %s)" % (page, topk, main, ", ".join(PAGE_TREE_BACKENDS),
                                                                      SG["page_tree"])))
    for b in ([explicit] if explicit else sorted(set(target))):
        how = "--speculative-draft-attention-backend %s" % b if explicit else "the target's attention backend %s (no " \
              "--speculative-draft-attention-backend given, so the draft inherits it)" % b
        flag = "--speculative-draft-attention-backend"
        if b not in DRAFT_BACKENDS:
            out.append((flag, "%s: SGLang 0.5.23 builds no draft worker on it (%s)" % (how, SG["draft_backend"])))
        elif draft_arch in MLA_DRAFTS and b in MHA_ONLY_BACKENDS:
            out.append((flag, "%s for the MLA draft %s: the draft's KV cache is MLA-shaped and SGLang 0.5.23 runs it "
                              "through an MHA-only backend (%s; %s); give --speculative-draft-attention-backend fa3, "
                              "flashinfer or triton in [server.speculative] args" % (how, draft_arch, SG["mha_only"],
                                                                                     SG["draft_backend"])))
        elif draft_arch and draft_arch not in MLA_DRAFTS and b in MLA_ONLY_BACKENDS:
            out.append((flag, "%s for the MHA draft %s: SGLang 0.5.23 builds an MLA-only draft backend (%s), which "
                              "refuses or misreads an MHA draft; give --speculative-draft-attention-backend fa3, "
                              "flashinfer or triton in [server.speculative] args" % (how, draft_arch, SG["mla_only"])))
    return out


def speculative_args(settings, draft_path, drafter=None):
    """The flags a server speculating with the drafter at `draft_path` is started with (`drafter`: its record,
    whose `block_size` a DFLASH / DSPARK server gets where the settings name none: both canary arms and every
    restart then serve the same, named size)."""
    s = settings or DEFAULTS
    algo = s.get("algorithm", "EAGLE3")
    if algo in BLOCK_FLAG:
        bs = s.get("block_size") or (drafter or {}).get("block_size")
        return (["--speculative-algorithm", algo, "--speculative-draft-model-path", draft_path]
                + ([BLOCK_FLAG[algo], str(bs)] if bs else []) + list(s.get("args") or []))
    return (["--speculative-algorithm", s.get("algorithm", "EAGLE3"), "--speculative-draft-model-path", draft_path,
             "--speculative-num-steps", str(s["num_steps"]), "--speculative-eagle-topk", str(s["eagle_topk"]),
             "--speculative-num-draft-tokens", str(s["num_draft_tokens"])] + list(s.get("args") or []))


def record_path(state_dir):
    return os.path.join(state_dir, "drafter.json")


def draft_dir(state_dir, digest):
    return os.path.join(state_dir, "drafters", digest)


def read_record(state_dir):
    """The drafter record, or None (no drafter deployed here)."""
    rec = read_json(record_path(state_dir))
    if rec is not None and rec.get("status") not in STATES:
        raise AgentError("attention", "%s: unknown status %r" % (record_path(state_dir), rec.get("status")))
    return rec


def write_record(state_dir, rec):
    """Write (or, with None, remove) the record; patchctl's own file, replaced atomically."""
    path = record_path(state_dir)
    if rec is None:
        if os.path.exists(path):
            os.unlink(path)
        return
    write_atomic(path, (json.dumps(rec, indent=1, sort_keys=True) + "\n").encode())


def summary(rec):
    """What status, history and the controller show of a record: no server config, no chain."""
    if not rec:
        return None
    keep = ("digest", "source", "data_run", "status", "run_id", "deployed_at", "verified_at", "acceptance", "speculative",
            "path", "algorithm", "block_size")
    return dict((k, rec.get(k)) for k in keep if rec.get(k) is not None)


def _entries(rec):
    """`rec` and every verified drafter before it, nearest first, each without a chain of its own: from the
    record's flat `chain`, or (a record without one) by following `previous`."""
    if rec and "chain" in rec:
        return [rec] + list(rec["chain"] or [])
    out, cur = [], rec
    while cur:
        out.append(cur)
        cur = cur.get("previous")
    return out


def chain_of(prev):
    """The `chain` a record replacing `prev` (the verified drafter serving, or None) keeps: `prev` and every
    drafter before it, flat (a list: the record's nesting stays the same however long the chain)."""
    es = _entries(prev)  # only `prev` itself may hold a chain: the entries of one never do
    return [dict((k, v) for k, v in es[0].items() if k != "chain")] + es[1:] if es else []


def steps(rec):
    """What `drafter rollback`s reach from `rec`, nearest first: [(record restored or None, the server config it
    served with or None: unknown, the inventory's)]. The last step is always to no drafter. Each record
    restored carries the chain after it, so walking the restored records gives the same steps."""
    es = _entries(rec)
    out = []
    for i, e in enumerate(es):
        target = None
        if i + 1 < len(es):
            target = dict(es[i + 1])
            if "chain" in rec:
                target["chain"] = es[i + 2:]
        out.append((target, e.get("server_before")))
    return out


def pick_step(rec, to):
    """The step of `steps(rec)` that `drafter rollback --to TO` goes to: previous, none or a digest (a prefix
    naming one drafter of the chain; its nearest occurrence). A bad_input naming what is reachable else."""
    chain = steps(rec)
    if not chain or to == "previous":
        return chain[0] if chain else (None, None)
    if to == "none":
        return chain[-1]
    hits = [s for s in chain if s[0] and s[0].get("digest", "").startswith(to)]
    if len(set(s[0]["digest"] for s in hits)) == 1:
        return hits[0]
    reach = "".join("%s (%s), " % (s[0]["digest"][:12], s[0].get("source") or "?") for s in chain if s[0])
    raise AgentError("bad_input", "drafter rollback --to %s: %s; a rollback here reaches: %snone" % (
        to, "it names more than one drafter" if hits else "no drafter a rollback reaches here has that digest", reach),
        reachable=[s[0]["digest"] for s in chain if s[0]])


def faking_env(env):
    """The env names that would make SGLang fake its acceptance figures."""
    return sorted(k for k in (env or {}) if k in FAKING_ENV)


def refusal_with_capture(profile, rec):
    """Why a server cannot run this capture profile and this drafter together, or None."""
    if rec and profile and profile.get("dump_dir_env"):
        return ("this host serves the drafter %s (from %s): SGLang 0.5.23 never captures and drafts in one server "
                "(arg_groups/validation_hook.py: \"captures without a draft; drop --speculative-draft-model-path\"); "
                "take the drafter away first: patchctl drafter rollback --to none" % (
                    rec.get("digest", "?")[:12], rec.get("source") or "?"))
    return None
