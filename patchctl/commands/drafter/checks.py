"""A trained EAGLE-3 draft directory, read and judged before any server loads it (`drafter check`, and the
lead's `drafter deploy` before it ships one).

Why here and not at start-up: SGLang 0.5.23 starts a draft that does not fit its target without a word in
most of the ways that matter. Its loader (`sglang/srt/models/llama_eagle3.py`) drops weight names it does
not know (`load_weights`, the `if param_name in params_dict` branches), takes the capture layers from
`eagle_config.eagle_aux_hidden_state_layer_ids` and silently falls back to its default layers when that is
missing (`model_runner_components/spec_aux_hidden_state.py:185-196`), and a start fails minutes into a
Kimi-class load when the draft's context is shorter than the target's (`configs/model_config.py:1295-1316`).
So every fact is read here, without torch: safetensors headers by hand (8-byte little-endian length, a JSON
header, data offsets checked against the file's size), `d2t`/`t2d` values with `struct`.

The format is what SpecForge 0.2.0's `specforge export --to sglang` writes (`export/to_sglang.py`:
`save_pretrained` of `modeling/draft/llama3_eagle.py`'s `LlamaForCausalLMEagle3` in bf16, embeddings
dropped; the names `midlayer.*`, `fc`, `norm`, `lm_head`, `d2t` int64 [draft_vocab], `t2d` bool [vocab],
optionally `fc_norm.{0,1,2}`), judged by what SGLang 0.5.23 loads. Kimi-K2.x's MLA drafter
(`Eagle3DeepseekV2ForCausalLM`, models/kimi_k25_eagle3.py) is judged as that file builds and loads it:
core/drafter_mla.py. Every Problem names the field, the value found and where, the value expected and where
that came from.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass, field
from pathlib import Path

from patchctl.commands.drafter import checks_block as drafter_block
from patchctl.commands.drafter.checks_block import _show  # one rendering of a field's value
from patchctl.core import datasetmeta, drafter_mla, layerids
from patchctl.core.errors import BadInput
from patchctl.host import limits
from patchctl.host.protocol import DrafterProbeAnswer

# SGLang 0.5.23's EAGLE-3 draft architectures (EntryClass of sglang/srt/models/*eagle3*.py): the first is what
# SpecForge exports (models/llama_eagle3.py, checked below); the MLA one (models/kimi_k25_eagle3.py) is checked
# as that file builds and loads it by core/drafter_mla.py.
EAGLE3_ARCHS = ("LlamaForCausalLMEagle3", drafter_mla.ARCH)
LOADER = "SGLang 0.5.23's LlamaForCausalLMEagle3 (models/llama_eagle3.py)"

# safetensors dtype -> bytes per element
DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "U16": 2,
               "U32": 4, "U64": 8, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1}
FLOAT_DTYPES = ("BF16", "F16", "F32")
MAX_HEADER = 100 << 20  # safetensors' own limit on a header
# SGLang's loader renames these (load_weights' legacy_name_map) before looking a name up
LEGACY = {"midlayer": "layers.0", "aux_norm_low": "fc_norm.0", "aux_norm_mid": "fc_norm.1", "aux_norm_high": "fc_norm.2"}


@dataclass
class Problem:
    """One way the draft does not fit: `where` holds `field` = `found`; `expected_from` says `expected`."""

    field: str
    found: object
    expected: object
    where: str
    expected_from: str
    why: str = ""
    verb: str = "is"  # "<expected_from> <verb> <expected>"

    def message(self) -> str:
        text = f"{self.where} {self.field} {_show(self.found)}, {self.expected_from} {self.verb} {_show(self.expected)}"
        return text + (f": {self.why}" if self.why else "")

    def to_dict(self) -> dict:
        return {"field": self.field, "found": self.found, "expected": self.expected, "where": self.where,
                "expected_from": self.expected_from, "why": self.why, "message": self.message()}


@dataclass
class Tensor:
    name: str
    dtype: str
    shape: list
    file: str
    begin: int  # absolute offset of its data in the file
    end: int


@dataclass
class DraftFacts:
    """What a draft directory holds: its config.json, every tensor's header entry, and what could not be read."""

    dir: Path
    config: dict
    tensors: dict = field(default_factory=dict)  # name as written -> Tensor
    files: list = field(default_factory=list)  # the *.safetensors read
    unreadable: list = field(default_factory=list)  # Problems found while reading (truncated, bad header)
    d2t: list | None = None
    t2d_true: int | None = None  # how many target ids t2d marks
    t2d_bad: list | None = None  # target ids of d2t that t2d does not mark (first few)


# --- reading ------------------------------------------------------------------------------------------

def read_header(path: Path) -> tuple[dict, int, list[Problem]]:
    """(header entries, data start, problems) of one safetensors file; entries whose data lies outside the
    file, or whose size is not shape x dtype, are named as problems."""
    size = path.stat().st_size
    name = path.name
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            return {}, 0, [Problem("header length", f"{size} bytes of file", "8 bytes", name, "a safetensors file",
                                   "the file is truncated")]
        n = struct.unpack("<Q", head)[0]
        if n > MAX_HEADER or 8 + n > size:
            return {}, 0, [Problem("header length", n, f"at most {size - 8} (the file's size - 8)", name,
                                   "the file's size", "the file is truncated or not safetensors")]
        raw = f.read(n)
    try:
        header = json.loads(raw.decode("utf-8"))
        if not isinstance(header, dict):
            raise ValueError("not an object")
    except (ValueError, UnicodeDecodeError) as e:
        return {}, 0, [Problem("header", f"unreadable JSON ({e})", "a JSON object", name, "the safetensors format")]
    start, out, problems = 8 + n, {}, []
    for key, ent in header.items():
        if key == "__metadata__":
            continue
        try:
            dtype, shape, (b, e) = ent["dtype"], [int(x) for x in ent["shape"]], ent["data_offsets"]
            b, e = int(b), int(e)
        except (KeyError, TypeError, ValueError):
            problems.append(Problem(f"tensor {key}", ent, "dtype, shape, data_offsets", name, "the safetensors format"))
            continue
        numel = 1
        for d in shape:
            numel *= d
        if dtype not in DTYPE_BYTES:
            problems.append(Problem(f"tensor {key} dtype", dtype, "one of " + ", ".join(DTYPE_BYTES), name,
                                    "the safetensors format"))
        elif e - b != numel * DTYPE_BYTES[dtype]:
            problems.append(Problem(f"tensor {key} data size", e - b, numel * DTYPE_BYTES[dtype], name,
                                    f"its shape {shape} x {dtype}"))
        if not 0 <= b <= e or start + e > size:
            problems.append(Problem(f"tensor {key} data end", start + e, size, name, "the file's size",
                                    "the file is truncated"))
            continue
        out[key] = Tensor(key, dtype, shape, name, start + b, start + e)
    return out, start, problems


# What SGLang 0.5.23 reads from a draft directory (--speculative-draft-model-path): the config (configs/model_config.py:
# config.json through transformers, generation_config.json, hf_quant_config.json where present) and the weights
# (model_loader/loader.py _prepare_weights, load format auto: the top level's *.safetensors when there are any, and
# then no *.bin or *.pt; with model.safetensors.index.json only the files its weight_map names,
# weight_utils.filter_duplicate_safetensors_files). No tokenizer: a draft worker loads none, the target's serves
# (managers/tp_worker.py:326). A deploy sends exactly these; every other file is named and left out.
LOADER_CONFIGS = ("config.json", "generation_config.json", "hf_quant_config.json")
INDEX = "model.safetensors.index.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "special_tokens_map.json",
                   "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja", "chat_template.json")


def what_sglang_reads(dir) -> tuple[list[str], dict[str, str]]:
    """(the files of the draft directory SGLang's draft loader reads, {every other file: why it is left out}),
    relative paths. Only what it reads is sent by `drafter deploy`; `drafter check` names the rest."""
    d = Path(dir)
    index_names = None
    if (d / INDEX).is_file():
        try:
            index_names = set((json.loads((d / INDEX).read_text()).get("weight_map") or {}).values())
        except (OSError, ValueError, AttributeError):
            index_names = None  # read_draft names the unreadable index as a problem
    send, left = [], {}
    for p in sorted(d.rglob("*")):
        if p.is_dir() and not p.is_symlink():
            continue
        rel = p.relative_to(d).as_posix()
        name = p.name
        if "/" in rel:
            left[rel] = "in a subdirectory: SGLang's loader reads only the draft directory's top level"
        elif name in LOADER_CONFIGS or name == INDEX:
            send.append(rel)
        elif name.endswith(".safetensors"):
            if index_names is not None and name not in index_names:
                left[rel] = (f"not in {INDEX}'s weight_map: SGLang skips it "
                             "(model_loader/weight_utils.py filter_duplicate_safetensors_files)")
            else:
                send.append(rel)
        elif name.endswith((".bin", ".pt")):
            left[rel] = ("SGLang's loader reads the *.safetensors weights and then no *.bin or *.pt "
                         "(model_loader/loader.py _prepare_weights)")
        elif name in TOKENIZER_FILES or name.startswith("tokenizer"):
            left[rel] = "a draft worker loads no tokenizer: the target's serves (managers/tp_worker.py:326)"
        else:
            left[rel] = ("not a file SGLang's draft loader reads (it reads " + ", ".join(LOADER_CONFIGS)
                         + f", {INDEX} and the *.safetensors weights)")
    return send, left


def read_draft(dir) -> DraftFacts:
    """The draft directory's facts. BadInput (exit 2) only when there is nothing to judge: no directory, no
    config.json, config.json not JSON. Everything else becomes a Problem for check_draft to list."""
    d = Path(dir)
    if not d.is_dir():
        raise BadInput(f"{d}: not a directory (expected a draft directory: config.json and *.safetensors)")
    try:
        config = json.loads((d / "config.json").read_text())
    except OSError as e:
        raise BadInput(f"{d / 'config.json'}: cannot be read ({e.strerror or e}); a draft directory has one") from None
    except ValueError as e:
        raise BadInput(f"{d / 'config.json'}: not JSON ({e})") from None
    if not isinstance(config, dict):
        raise BadInput(f"{d / 'config.json'}: expected a JSON object")
    facts = DraftFacts(d, config)
    for p in sorted(d.glob("*.safetensors")):
        facts.files.append(p.name)
        entries, _, problems = read_header(p)
        facts.unreadable += problems
        for k, t in entries.items():
            if k in facts.tensors:
                facts.unreadable.append(Problem(f"tensor {k}", f"also in {facts.tensors[k].file}", "in one file only",
                                                p.name, "the draft's weight files"))
            facts.tensors[k] = t
    _read_index(d, facts)
    _read_vocab_maps(d, facts)
    return facts


def _read_index(d: Path, facts: DraftFacts) -> None:
    idx = d / "model.safetensors.index.json"
    if not idx.exists():
        return
    try:
        wm = json.loads(idx.read_text()).get("weight_map") or {}
    except (OSError, ValueError, AttributeError) as e:
        facts.unreadable.append(Problem("weight_map", f"unreadable ({e})", "a JSON weight_map", idx.name, "the index format"))
        return
    for name, fname in sorted(wm.items()):
        t = facts.tensors.get(name)
        if t is None or t.file != fname:
            facts.unreadable.append(Problem(f"weight_map {name}", fname, t.file if t else "absent", idx.name,
                                            "the safetensors files' headers: where the tensor is"))


def _tensor_bytes(d: Path, t: Tensor) -> bytes:
    with open(d / t.file, "rb") as f:
        f.seek(t.begin)
        return f.read(t.end - t.begin)


def _read_vocab_maps(d: Path, facts: DraftFacts) -> None:
    """d2t's values and t2d's marks (a few hundred KB at most): the draft -> target id map SGLang uses
    (`hot_token_id = d2t + arange`, llama_eagle3.py load_weights)."""
    t = facts.tensors.get("d2t")
    if t is not None and t.dtype == "I64" and len(t.shape) == 1:
        raw = _tensor_bytes(d, t)
        facts.d2t = [d_ + off for d_, off in enumerate(struct.unpack(f"<{t.shape[0]}q", raw))]
    m = facts.tensors.get("t2d")
    if m is not None and m.dtype == "BOOL" and len(m.shape) == 1:
        marks = _tensor_bytes(d, m)
        facts.t2d_true = sum(1 for b in marks if b)
        if facts.d2t is not None:
            facts.t2d_bad = [x for x in facts.d2t if not (0 <= x < len(marks) and marks[x])][:5]


# --- what the data and the target say -------------------------------------------------------------

def read_data(dir) -> dict:
    """The facts `capture collect` recorded in a collection DIR: draft-config.json (the capture's layer ids,
    layers_to_capture, target_hidden_size, vocab_size, the target's architecture and layer count) and, from
    index.json's dataset, the prepared dataset's sidecar (tokenizer digest, template). BadInput when DIR holds
    no draft-config.json."""
    d = Path(dir)
    path = d / "draft-config.json"
    try:
        dc = json.loads(path.read_text())
    except OSError:
        raise BadInput(f"{path}: missing (--data is a directory `patchctl capture collect` wrote)") from None
    except ValueError as e:
        raise BadInput(f"{path}: not JSON ({e})") from None
    pc = dc.get("_patchctl") or {}
    out = {"source": str(path), "run": pc.get("run"),
           "ids": (dc.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids"),
           "layers": pc.get("layers_to_capture"), "target_hidden_size": dc.get("target_hidden_size"),
           "vocab_size": dc.get("vocab_size"), "architectures": pc.get("target_architectures"),
           "num_hidden_layers": pc.get("target_num_hidden_layers"), "target_model": pc.get("target_model"),
           "tokenizer": None, "template": None, "tokenizer_why": None, **drafter_block.data_fields(dc)}
    try:
        ds = (json.loads((d / "index.json").read_text()).get("dataset") or {})
    except (OSError, ValueError, AttributeError):
        ds = {}
    meta = datasetmeta.read(ds["path"], ds.get("sha256")) if ds.get("path") and os.path.isfile(ds["path"]) else None
    if meta:
        out.update(train_length=meta.get("max_length"))  # capture prepare --max-length: the longest sample trained on
        out.update(tokenizer=(meta.get("tokenizer") or {}).get("digest"), template=meta.get("template"),
                   tokenizer_source=str(datasetmeta.meta_path(ds["path"])))
    else:
        out["tokenizer_why"] = (f"the dataset {ds.get('path')} of index.json has no sidecar describing it "
                                "(prepared by hand, moved or changed since)" if ds.get("path")
                                else f"{d / 'index.json'} names no dataset")
    return out


def target_from_probe(host: str, r: DrafterProbeAnswer) -> dict:
    """The target model's facts as check_draft takes them (`target`), from a host's `drafter_probe` answer."""
    return {"source": f"the served model's ({host}: {r.config_path or r.model_path})",
            "architectures": r.architectures, "hidden_size": r.hidden_size,
            "vocab_size": r.vocab_size, "num_hidden_layers": r.num_hidden_layers,
            **{k: getattr(r, k) for k in drafter_mla.SHARED}}


def served_from_probe(host: str, r: DrafterProbeAnswer) -> dict:
    """What the server on a host serves with (`served`): its context length, the env that lets a shorter
    draft context start, its tokenizer's digest."""
    ctx, ctx_from = r.context_length, f"the server's context length ({host}: /server_info)"
    if not ctx:
        ctx, ctx_from = r.config_context_len, (f"the served model's context ({host}: "
                                               f"{r.config_path}: {r.config_context_from})")
    env = r.env or {}
    tok = r.tokenizer or {}
    return {"host": host, "context_length": ctx, "context_from": ctx_from,
            "allow_longer_context": str(env.get("SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN", "")).lower() in ("1", "true"),
            "tokenizer": tok.get("digest"), "tokenizer_path": tok.get("path"), "tokenizer_why": tok.get("why")}


# --- the checks -------------------------------------------------------------------------------------

def _int(v) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) and v > 0 else None


class _Checks:
    """One judgement of a draft: the config's own fields, its tensors, then what the target, the training data
    and the server add. Each check appends Problems; none stops the others."""

    def __init__(self, facts: DraftFacts, target: dict | None, data: dict | None, served: dict | None):
        self.f, self.c = facts, facts.config
        self.target, self.data, self.served = target, data, served
        self.out: list[Problem] = list(facts.unreadable)

    def add(self, field, found, expected, where="config.json", expected_from=LOADER, why="", verb="is"):
        self.out.append(Problem(field, found, expected, where, expected_from, why, verb))

    def run(self) -> list[Problem]:
        arch = (self.c.get("architectures") or [None])[0] if isinstance(self.c.get("architectures"), list) else None
        if arch in drafter_block.ARCHS:  # DFlash / DSpark: commands/drafter/checks_block.py
            drafter_block.BlockChecks(self, arch).run()
            return self.out
        if arch not in EAGLE3_ARCHS:
            self.add("architectures[0]", arch, " or ".join(EAGLE3_ARCHS + tuple(drafter_block.ARCHS)), expected_from=
                     "what SGLang 0.5.23 loads as a draft (the EntryClass of models/llama_eagle3.py, kimi_k25_eagle3.py, "
                     + drafter_block.WHERE_ARCH + ")")
        mla = arch == drafter_mla.ARCH
        sizes = drafter_mla.config_sizes(self.c, self.add) if mla else self.config_fields()
        ids = self.layer_ids()
        if mla and sizes is not None:  # as models/kimi_k25_eagle3.py builds and loads it
            drafter_mla.check_tensors(self.f, self.c, sizes, self.add, _show)
            self.vocab_map(sizes)
        elif arch == "LlamaForCausalLMEagle3" and sizes is not None:
            self.tensors(sizes, ids)
        if mla:
            drafter_mla.against_target(self.c, self.target, self.add)
        self.against_target(ids)
        self.against_data(ids)
        self.against_served()
        return self.out

    # config.json on its own
    def config_fields(self):
        c, bad = self.c, False
        for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size"):
            if _int(c.get(key)) is None:
                self.add(key, c.get(key), "a whole number of 1 or more", expected_from="what SpecForge's export writes")
                bad = True
        dv = c.get("draft_vocab_size")
        if _int(dv) is None:
            self.add("draft_vocab_size", dv, "a whole number, at most vocab_size", why="SGLang reads it without a "
                     "default (llama_eagle3.py:302): absent fails at start, null loads the target's lm_head instead of "
                     "the trained one; SpecForge's export always writes it")
            bad = True
        elif _int(c.get("vocab_size")) and dv > c["vocab_size"]:
            self.add("draft_vocab_size", dv, f"at most vocab_size {c['vocab_size']}", expected_from="config.json")
        if c.get("tie_word_embeddings"):
            self.add("tie_word_embeddings", True, False, why="SGLang then uses the target's embedding as the draft's "
                     "lm_head and the trained lm_head.weight is never loaded")
        if bad:
            return None
        h, nh = c["hidden_size"], c["num_attention_heads"]
        nkv = _int(c.get("num_key_value_heads")) or nh
        hd = _int(c.get("head_dim")) or h // nh
        return {"H": h, "Ht": _int(c.get("target_hidden_size")) or h, "nh": nh, "nkv": nkv, "hd": hd,
                "I": c["intermediate_size"], "L": c["num_hidden_layers"], "V": c["vocab_size"],
                "DV": c["draft_vocab_size"]}

    def layer_ids(self):
        ec = self.c.get("eagle_config")
        ids = ec.get("eagle_aux_hidden_state_layer_ids") if isinstance(ec, dict) else None
        if ids is None:
            self.add("eagle_config.eagle_aux_hidden_state_layer_ids", None, "the 3 layer ids the training data was "
                     "captured at", expected_from="SpecForge's draft config",
                     why="without it SGLang silently captures its default layers [2, N//2, N-3] "
                     "(model_runner_components/spec_aux_hidden_state.py:185-196)")
            return None
        if not (isinstance(ids, list) and len(ids) == 3 and all(isinstance(i, int) and not isinstance(i, bool) and i >= 0
                                                                for i in ids) and len(set(ids)) == 3):
            self.add("eagle_config.eagle_aux_hidden_state_layer_ids", ids, "3 distinct whole numbers >= 0",
                     expected_from="SpecForge's EAGLE-3 drafter (modeling/draft/llama3_eagle.py: fc takes 3 layers)")
            return None
        return ids

    # the weights
    def _wanted(self, s: dict, ids):
        """The tensors SGLang 0.5.23's llama_eagle3.py loads for this config, each with its shape and where the
        shape comes from: (required, optional)."""
        c = self.c
        H, Ht, hd, I = s["H"], s["Ht"], s["hd"], s["I"]
        naux = _int(c.get("num_aux_hidden_states")) or (len(ids) if ids else 3)
        want = {"fc.weight": ([H, naux * Ht], f"config.json (hidden_size {H}, {naux} x target_hidden_size {Ht})"),
                "norm.weight": ([H], f"config.json (hidden_size {H})")}
        if not c.get("tie_word_embeddings"):
            want["lm_head.weight"] = ([s["DV"], H], f"config.json (draft_vocab_size {s['DV']}, hidden_size {H})")
        for i in range(s["L"]):
            inp = 2 * H if i == 0 else H
            src = f"config.json (hidden_size {H}, heads {s['nh']}/{s['nkv']} x head_dim {hd}, intermediate_size {I})"
            p = f"layers.{i}."
            want.update({p + "self_attn.q_proj.weight": ([s["nh"] * hd, inp], src),
                         p + "self_attn.k_proj.weight": ([s["nkv"] * hd, inp], src),
                         p + "self_attn.v_proj.weight": ([s["nkv"] * hd, inp], src),
                         p + "self_attn.o_proj.weight": ([H, s["nh"] * hd], src),
                         p + "mlp.gate_proj.weight": ([I, H], src), p + "mlp.up_proj.weight": ([I, H], src),
                         p + "mlp.down_proj.weight": ([H, I], src), p + "input_layernorm.weight": ([H], src),
                         p + "post_attention_layernorm.weight": ([H], src), p + "hidden_norm.weight": ([H], src)})
        optional = {"embed_tokens.weight": ([s["V"], H], "config.json (vocab_size, hidden_size)")}
        if c.get("bias"):
            want["fc.bias"] = ([H], f"config.json (hidden_size {H})")
        if (c.get("eagle_config") or {}).get("norm_before_fc", c.get("norm_before_fc")):
            want["input_norm.weight"] = ([naux * Ht], "config.json (norm_before_fc)")
        if c.get("fc_norm") or c.get("use_aux_norm"):
            want.update({f"fc_norm.{k}.weight": ([Ht], "config.json (fc_norm)") for k in range(naux)})
        return want, optional

    def tensors(self, s: dict, ids):
        if not self.f.files:
            self.add("weights", None, "*.safetensors", where=str(self.f.dir), why="no weight file: SGLang would serve "
                     "an untrained draft")
            return
        want, optional = self._wanted(s, ids)
        vocab = {"d2t": ("I64", [s["DV"]]), "t2d": ("BOOL", [s["V"]])}
        seen = set()
        for raw, t in sorted(self.f.tensors.items()):
            name = raw[len("model."):] if raw.startswith("model.") else raw
            for old, new in LEGACY.items():
                name = name.replace(old, new)
            where = f"{t.file} tensor {raw}"
            if name in vocab:
                seen.add(name)
                dt, shape = vocab[name]
                if t.dtype != dt or t.shape != shape:
                    self.add("dtype/shape", f"{t.dtype} {_show(t.shape)}", f"{dt} {_show(shape)}", where,
                             f"SpecForge's export ({name} of draft_vocab_size {s['DV']} / vocab_size {s['V']})")
                continue
            spec = want.get(name) or optional.get(name)
            if spec is None:
                self.add("name", raw, "one of the names SGLang loads", where=t.file, why="SGLang 0.5.23 drops an "
                         "unknown weight without a word (llama_eagle3.py load_weights)")
                continue
            seen.add(name)
            if t.shape != spec[0]:
                self.add("shape", _show(t.shape), _show(spec[0]), where, spec[1])
            if t.dtype not in FLOAT_DTYPES:
                self.add("dtype", t.dtype, " or ".join(FLOAT_DTYPES), where, "what SpecForge's export writes (bf16)")
        missing = [n for n in want if n not in seen]
        if s["DV"] < s["V"]:
            missing += [n for n in ("d2t", "t2d") if n not in seen]
        for n in missing:
            shown = n.replace("layers.0.", "midlayer.")
            self.add(f"tensor {shown}", None, _show((want.get(n) or (None, None))[0] or vocab[n][1]),
                     where=", ".join(self.f.files), expected_from="config.json", verb="gives it the shape", why="required by " + ("the draft vocab map: draft_vocab_size "
                     f"{s['DV']} < vocab_size {s['V']}" if n in vocab else LOADER + "; a missing weight is served "
                     "as whatever the memory held"))
        self.vocab_map(s)

    def vocab_map(self, s: dict):
        if self.f.d2t is None:
            return
        ids = self.f.d2t
        if s["DV"] < s["V"] and ids == list(range(len(ids))):
            self.add("d2t", "all zeros", "the offsets of the vocab map the draft was trained with", "d2t",
                     "SpecForge's load_vocab_mapping", why="SpecForge's initial buffer: no vocab mapping was loaded, so "
                     f"draft token d is served as target token d (the first {len(ids)} ids of the vocabulary)")
            return
        out = [x for x in ids if not 0 <= x < s["V"]]
        if out:
            self.add("d2t", f"target ids {out[:5]}", f"ids in [0, {s['V']})", "d2t", "config.json vocab_size",
                     "target = d + d2t[d] must name a token of the target")
        elif len(set(ids)) != len(ids):
            self.add("d2t", "repeated target ids", f"{len(ids)} distinct target ids", "d2t", "SpecForge's vocab map")
        if self.f.t2d_true is not None and self.f.t2d_true != len(ids):
            self.add("t2d", f"{self.f.t2d_true} tokens marked", f"{len(ids)} (draft_vocab_size)", "t2d", "d2t")
        elif self.f.t2d_bad:
            self.add("t2d", f"target ids {self.f.t2d_bad} unmarked", "every target id of d2t marked", "t2d", "d2t")

    # against the target model, the training data, the server
    def against_target(self, ids):
        t = self.target
        if not t:
            return
        c = self.c
        for key, draft_val in (("hidden_size", c.get("hidden_size")),
                               ("target_hidden_size", c.get("target_hidden_size", c.get("hidden_size")))):
            if t.get("hidden_size") and draft_val != t["hidden_size"]:
                self.add(key + ("" if key in c else " (absent: hidden_size)"), draft_val, t["hidden_size"],
                         expected_from=t["source"] + " hidden_size")
        if t.get("vocab_size") and c.get("vocab_size") != t["vocab_size"]:
            self.add("vocab_size", c.get("vocab_size"), t["vocab_size"], expected_from=t["source"] + " vocab_size")
        n, arch = t.get("num_hidden_layers"), (t.get("architectures") or [None])[0]
        if ids and n:
            rule = layerids.RULES.get(arch)
            if rule:
                layers = layerids.sglang_layers(rule, ids, n)
                top = n if rule == "gpt_oss" else n - 1
                if not all(0 <= x <= top for x in layers):
                    self.add("eagle_config.eagle_aux_hidden_state_layer_ids", f"{_show(ids)} (layers {_show(layers)} on {arch})",
                             f"layers 0 to {top}", expected_from=f"{t['source']} num_hidden_layers {n}", verb="allows",
                             why=f"{arch} captures layers {_show(layers)} for these ids ({layerids.WHERE[rule]}); a layer "
                                 "it does not have is never captured")

    def against_data(self, ids):
        d = self.data
        if not d:
            return
        src = f"the training data's ({d['source']})"
        c = self.c
        if d.get("target_hidden_size") and c.get("target_hidden_size", c.get("hidden_size")) != d["target_hidden_size"]:
            self.add("target_hidden_size", c.get("target_hidden_size", c.get("hidden_size")), d["target_hidden_size"],
                     expected_from=src + " target_hidden_size")
        if d.get("vocab_size") and c.get("vocab_size") != d["vocab_size"]:
            self.add("vocab_size", c.get("vocab_size"), d["vocab_size"], expected_from=src + " vocab_size")
        if not ids:
            return
        arch = (d.get("architectures") or (self.target or {}).get("architectures") or [None])[0]
        n = d.get("num_hidden_layers") or (self.target or {}).get("num_hidden_layers")
        rule = layerids.RULES.get(arch)
        if d.get("layers") and rule:
            got = layerids.sglang_layers(rule, ids, n)
            if got != list(d["layers"]):
                want = layerids.ids_for(rule, d["layers"], n)
                self.add("eagle_config.eagle_aux_hidden_state_layer_ids", ids, _show(want or d.get("ids")),
                         expected_from=src + f" eagle_aux_hidden_state_layer_ids (captured at layers {_show(d['layers'])})",
                         why=f"{arch} would capture layers {_show(got)} for these ids ({layerids.WHERE[rule]}): "
                             "the drafter would be fed other layers than it was trained on")
        elif d.get("ids") and list(ids) != list(d["ids"]):
            self.add("eagle_config.eagle_aux_hidden_state_layer_ids", ids, d["ids"],
                     expected_from=src + " eagle_aux_hidden_state_layer_ids")

    def against_served(self):
        sv, d = self.served, self.data
        if not sv:
            return
        c = self.c
        ctx = sv.get("context_length")
        own, own_from = limits.config_context_len(c)
        own = own or limits.DEFAULT_CONTEXT_LEN
        if ctx and own < ctx and not sv.get("allow_longer_context"):
            self.add("max_position_embeddings", f"{c.get('max_position_embeddings')} (context {own})", ctx,
                     expected_from=sv["context_from"], why="SGLang refuses to start a draft whose context is shorter "
                     "than the target's (configs/model_config.py:1295-1316) unless the server's env sets "
                     "SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN=1")
        if d and d.get("tokenizer") and sv.get("tokenizer") != d["tokenizer"]:
            self.add("tokenizer digest", (sv.get("tokenizer") or "unknown")[:12] + f" ({sv.get('tokenizer_path') or sv.get('tokenizer_why')})",
                     d["tokenizer"][:12] + (f", template {d['template']}" if d.get("template") else ""),
                     where=f"the server on {sv['host']}", expected_from=f"the training data's ({d.get('tokenizer_source')})",
                     why="the drafter learned token ids and the chat template of another tokenizer")


def check_draft(facts: DraftFacts, *, target: dict | None = None, data: dict | None = None,
                served: dict | None = None) -> list[Problem]:
    """Every problem of the draft: on its own; against `target` (the target model's config facts:
    target_from_probe); against `data` (read_data of the collection it was trained on); against `served`
    (served_from_probe: the server's context length, env and tokenizer). [] when it fits."""
    return _Checks(facts, target, data, served).run()


def summary(facts: DraftFacts) -> dict:
    """The draft's key facts for a report."""
    c = facts.config
    return {"dir": str(facts.dir), "architectures": c.get("architectures"), "hidden_size": c.get("hidden_size"),
            "target_hidden_size": c.get("target_hidden_size"), "vocab_size": c.get("vocab_size"),
            "draft_vocab_size": c.get("draft_vocab_size"),
            "layer_ids": (c.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
            if isinstance(c.get("eagle_config"), dict) else drafter_block.layer_ids(c),
            "algorithm": drafter_block.algorithm_of(c) or "EAGLE3", "block_size": drafter_block.block_size(c),
            "files": facts.files, "tensors": len(facts.tensors)}
