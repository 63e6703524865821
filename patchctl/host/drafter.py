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

ALGORITHMS = ("EAGLE3",)
# set all three, the same in both arms of a canary (SGLang's own defaults depend on the target's architecture)
DEFAULTS = {"algorithm": "EAGLE3", "num_steps": 3, "eagle_topk": 1, "num_draft_tokens": 4}
KEYS = ("algorithm", "num_steps", "eagle_topk", "num_draft_tokens", "args")
# flags patchctl writes itself from the settings and the deployed drafter; `args` may not carry them
MANAGED_FLAGS = ("--speculative-algorithm", "--speculative-draft-model-path", "--speculative-num-steps",
                 "--speculative-eagle-topk", "--speculative-num-draft-tokens", "--enable-return-aux-hidden-states",
                 "--return-aux-hidden-state-layer-ids")
# SGLANG_SIMULATE_ACC_LEN makes SGLang fake the acceptance (environ.py): a measured canary would be a lie
FAKING_ENV = ("SGLANG_SIMULATE_ACC_LEN",)
STATES = ("pending", "verified")


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
                problems.append((k, "%r: patchctl deploys EAGLE-3 drafters (expected %s)" % (v, " or ".join(ALGORITHMS))))
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
    if given & set(("eagle_topk", "num_draft_tokens")) and "num_steps" not in given:
        # arg_groups/speculative_hook.py:1159-1163 asserts exactly this
        problems.append(("num_steps", "SGLang 0.5.23 refuses eagle_topk or num_draft_tokens without num_steps "
                                      "(arg_groups/speculative_hook.py)"))
    elif not problems and out["eagle_topk"] == 1 and out["num_draft_tokens"] != out["num_steps"] + 1:
        problems.append(("num_draft_tokens", "%d: with eagle_topk 1 SGLang 0.5.23 sets num_draft_tokens to num_steps "
                                             "+ 1 = %d (arg_groups/speculative_hook.py); set that"
                                             % (out["num_draft_tokens"], out["num_steps"] + 1)))
    elif not problems and out["num_draft_tokens"] > out["num_steps"] * out["eagle_topk"] + 1:
        problems.append(("num_draft_tokens", "%d: more than num_steps x eagle_topk + 1 = %d draft tokens can be proposed"
                                             % (out["num_draft_tokens"], out["num_steps"] * out["eagle_topk"] + 1)))
    return out, problems


def speculative_args(settings, draft_path):
    """The flags a server speculating with the drafter at `draft_path` is started with."""
    s = settings or DEFAULTS
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
            "path")
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
