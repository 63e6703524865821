"""The capture run's dataset (patchctl/commands/capture/dataset.py): every bad input refused with exit 2 naming the
file and line, all problems (up to 20) in one error; file names as the capture module makes them."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from hidden_dump_util import MODULE, load_module, patched_tree
from patchctl.commands.capture import dataset as dsmod
from patchctl.commands.capture.dataset import MAX_PROBLEMS, check_against_model, load_dataset, safe_name
from patchctl.core.errors import BadInput


def write(tmp_path: Path, lines: list) -> Path:
    p = tmp_path / "data.jsonl"
    p.write_text("".join((l if isinstance(l, str) else json.dumps(l)) + "\n" for l in lines))
    return p


def refused(path: Path, rid_prefix: str = "") -> BadInput:
    with pytest.raises(BadInput) as e:
        load_dataset(path, rid_prefix)
    assert e.value.exit_code == 2
    return e.value


def test_a_good_dataset(tmp_path):
    p = write(tmp_path, [{"id": "a", "input_ids": [1, 2, 3]}, "", "   ",
                         {"id": "b/ü", "input_ids": [0], "loss_mask": [1]},
                         {"id": "c", "input_ids": [5, 6], "loss_mask": [0, 1]}])
    ds = load_dataset(p)
    assert [(s.id, s.line, s.tokens, s.max_id, s.has_loss_mask) for s in ds.samples] == [
        ("a", 1, 3, 3, False), ("b/ü", 4, 1, 0, True), ("c", 5, 2, 6, True)]
    assert ds.tokens == 6 and ds.has_loss_mask and ds.path == p.absolute()
    assert ds.sha256 == hashlib.sha256(p.read_bytes()).hexdigest() and ds.bytes == p.stat().st_size
    assert ds.read(ds.samples[2]) == {"id": "c", "input_ids": [5, 6], "loss_mask": [0, 1]}
    assert [r["input_ids"] for _, r in ds.records()] == [[1, 2, 3], [0], [5, 6]]
    assert ds.read(ds.samples[0])["loss_mask"] is None
    assert ds.by_id == {"a": 0, "b/ü": 1, "c": 2}
    # a file changed since it was validated is noticed when a sample is read back
    p.write_text(json.dumps({"id": "zz", "input_ids": [1]}) + "\n" * 10)
    with pytest.raises(BadInput, match=r"data.jsonl:1: sample 'a' is no longer on this line: the file changed"):
        ds.read(ds.samples[0])


BAD = [
    ("bad json", '{"id": "a", "input_ids": [1,', "not valid JSON"),
    ("not an object", "[1, 2, 3]", "a JSON list, expected an object"),
    ("missing id", {"input_ids": [1]}, "missing id"),
    ("id not a string", {"id": 7, "input_ids": [1]}, "id 7: expected a non-empty string"),
    ("empty id", {"id": "", "input_ids": [1]}, "id '': expected a non-empty string"),
    ("missing input_ids", {"id": "a"}, "missing input_ids"),
    ("empty input_ids", {"id": "a", "input_ids": []}, "input_ids []: expected a non-empty list"),
    ("input_ids not a list", {"id": "a", "input_ids": "1 2 3"}, "expected a non-empty list of token ids"),
    ("bool id", {"id": "a", "input_ids": [1, True]}, "input_ids holds a bool (true)"),
    ("float id", {"id": "a", "input_ids": [1, 2.0]}, "input_ids holds a float (2.0)"),
    ("string id", {"id": "a", "input_ids": [1, "2"]}, "input_ids holds a str ('2')"),
    ("negative id", {"id": "a-b", "input_ids": [1, -4]}, "input_ids holds a negative id (-4)"),
    ("nested list", {"id": "a", "input_ids": [[1, 2]]}, "input_ids holds a list"),
    ("mask length", {"id": "a", "input_ids": [1, 2], "loss_mask": [1]}, "loss_mask has 1 values for 2 input_ids"),
    ("mask value", {"id": "a", "input_ids": [1, 2], "loss_mask": [1, 2]}, "loss_mask holds 2: expected only 0 and 1"),
    ("mask bool", {"id": "a", "input_ids": [1, 2], "loss_mask": [1, True]}, "loss_mask holds true"),
    ("mask float", {"id": "a", "input_ids": [1, 2], "loss_mask": [1.0, 0]}, "loss_mask holds 1.0"),
    ("mask null", {"id": "a", "input_ids": [1], "loss_mask": None}, "loss_mask null: expected a list of 0 and 1"),
    ("unknown key", {"id": "a", "input_ids": [1], "loss_masks": [1]}, "unknown key 'loss_masks'; allowed: id, input_ids, loss_mask"),
    ("nan", '{"id": "a", "input_ids": [1, NaN]}', "input_ids holds a float (NaN)"),
]


@pytest.mark.parametrize("case,line,expect", BAD, ids=[b[0] for b in BAD])
def test_each_bad_line_is_refused_naming_file_and_line(tmp_path, case, line, expect):
    p = write(tmp_path, [{"id": "ok", "input_ids": [1]}, "", line, {"id": "ok2", "input_ids": [2]}])
    e = refused(p)
    msg = str(e)
    assert msg.startswith(f"{p.absolute()}:3: ") and expect in msg and msg.endswith("; nothing was sent"), msg
    assert "\n" not in msg and (e.file, e.line) == (str(p.absolute()), 3)


def test_duplicate_ids_name_both_lines(tmp_path):
    p = write(tmp_path, [{"id": "a", "input_ids": [1]}, {"id": "b", "input_ids": [1]}, {"id": "a", "input_ids": [2]}])
    assert f"{p.absolute()}:3: id 'a' again (first on line 1); ids must be unique" in str(refused(p))


def test_every_problem_up_to_the_bound_in_one_error(tmp_path):
    lines = [{"id": f"s{i}", "input_ids": [1, -1]} for i in range(MAX_PROBLEMS + 5)] + ["nope"]
    e = refused(write(tmp_path, lines))
    rows = str(e).splitlines()
    assert len(rows) == MAX_PROBLEMS + 1 and e.problem_count == MAX_PROBLEMS + 6
    assert [r.split(":")[1] for r in rows[:-1]] == [str(i) for i in range(1, MAX_PROBLEMS + 1)]
    assert rows[-1].endswith(f"{MAX_PROBLEMS + 6} problems (the first {MAX_PROBLEMS} shown); nothing was sent")


def test_unreadable_and_empty_files(tmp_path):
    assert "cannot read the dataset" in str(refused(tmp_path / "missing.jsonl"))
    assert ":1: no samples" in str(refused(write(tmp_path, ["", " "])))


@pytest.fixture(scope="module")
def module_safe_name(tmp_path_factory, sglang_tree):
    """The capture module's own safe_name, from the series' patch applied to a copy of the 0.5.23 files."""
    tree = patched_tree(sglang_tree, tmp_path_factory.mktemp("hd"))
    return load_module(tree / MODULE, "hidden_dump_for_names").safe_name


RIDS = ["a", "A.b_c-9", ".hidden", "rid-x", "rid-", "ri", "with space", "a/b", "../x", "ü", "日本", "\ud800x", "x" * 150,
        "x" * 151, "y" * 400, "é" * 200, "-", "..", "a\nb", "patchctl-cap-run-s1", "rid-" + "z" * 200, "tab\t", "%2F"]


def test_safe_name_is_the_capture_modules_rule(module_safe_name):
    for rid in RIDS:
        assert safe_name(rid) == module_safe_name(rid), rid
    names = [safe_name(r) for r in RIDS]
    assert len(set(names)) == len(names) and all("/" not in n and n not in (".", "..") for n in names)


def test_ids_that_would_share_a_file_name_are_refused(tmp_path, monkeypatch):
    # The module's rule is injective; a rule that is not (a future change) must be caught, naming both lines.
    monkeypatch.setattr(dsmod, "safe_name", lambda rid: rid.lower())
    p = write(tmp_path, [{"id": "Ab", "input_ids": [1]}, {"id": "x", "input_ids": [1]}, {"id": "aB", "input_ids": [1]}])
    msg = str(refused(p, "p-"))
    assert f"{p.absolute()}:3: id 'aB' and id 'Ab' (line 1) would be dumped to the same file p-ab.safetensors" in msg


def test_check_against_model_names_the_line_the_host_and_the_bound(tmp_path):
    p = write(tmp_path, [{"id": "a", "input_ids": [1, 511]}, {"id": "b", "input_ids": [512]},
                         {"id": "c", "input_ids": list(range(100))}, {"id": "d", "input_ids": list(range(99))}])
    ds = load_dataset(p)
    facts = {"gpu-a": {"vocab_size": 512, "max_req_input_len": 4090, "model_path": "/m/a"},
             "gpu-b": {"vocab_size": 1000, "max_req_input_len": 100}}
    with pytest.raises(BadInput) as e:
        check_against_model(ds, facts)
    rows = str(e.value).splitlines()
    assert rows[0] == (f"{p.absolute()}:2: id 'b': token id 512 >= vocab_size 512 of the model served on gpu-a (/m/a); "
                       "expected ids below 512")
    # SGLang aborts len(ids) >= max_req_input_len: 100 tokens are one too many for gpu-b, 99 go
    assert rows[1] == (f"{p.absolute()}:3: id 'c': 100 tokens; SGLang on gpu-b aborts prompts of 100 tokens or more "
                       "(max_req_input_len 100 from its /server_info); expected at most 99")
    assert rows[2].endswith("2 problems; nothing was sent") and len(rows) == 3 and e.value.exit_code == 2
    fine = load_dataset(write(tmp_path, [{"id": "d", "input_ids": list(range(99))}]))
    said = check_against_model(fine, facts)
    assert said == ("prompt length: at most 99 tokens (gpu-b: max_req_input_len 100 from its /server_info; "
                    "the smallest of 2 hosts)")


def test_without_the_servers_bound_the_config_rule_applies_and_says_so(tmp_path):
    ds = load_dataset(write(tmp_path, [{"id": "a", "input_ids": [1] * 93}, {"id": "b", "input_ids": [1] * 94}]))
    # min(context - 1, KV - 1) - 5 with the KV pool unknown: 94 is aborted at context 100, 93 is not
    facts = {"h": {"vocab_size": 10, "config_context_len": 100, "config_context_from": "max_position_embeddings=100",
                   "server_info_error": "/server_info answered HTTP 404"}}
    with pytest.raises(BadInput) as e:
        check_against_model(ds, facts)
    msg = str(e.value)
    assert msg.startswith(f"{ds.path}:2: id 'b': 94 tokens; SGLang on h aborts prompts of 94 tokens or more "
                          "(SGLang's rule min(context - 1, KV pool - 1) - 5 on context length 100 from config.json "
                          "max_position_embeddings=100; its server reported no max_req_input_len (/server_info "
                          "answered HTTP 404), so a KV pool smaller than the context is not accounted for); "
                          "expected at most 93"), msg
    # the server's --context-length wins over config.json's; its own max_req_input_len over both
    check_against_model(ds, {"h": dict(facts["h"], context_length=101)})
    with pytest.raises(BadInput, match="max_req_input_len 90 from its /server_info"):
        check_against_model(ds, {"h": dict(facts["h"], context_length=1000, max_req_input_len=90)})


def test_no_bound_known_is_refused_unless_the_length_check_is_off(tmp_path):
    ds = load_dataset(write(tmp_path, [{"id": "a", "input_ids": [1] * 200_000}]))
    facts = {"ok": {"vocab_size": 10, "max_req_input_len": 300_000},
             "h": {"vocab_size": 10, "model_path": "/m", "num_hidden_layers": 2, "max_req_input_len": None}}
    with pytest.raises(BadInput) as e:
        check_against_model(ds, facts)
    msg = str(e.value)
    assert e.value.exit_code == 2 and "\n" not in msg and "ok:" not in msg
    assert msg.startswith(f"{ds.path}: no prompt length bound is known for h: its server reports no max_req_input_len "
                          "in /server_info, and its config.json has none of max_sequence_length, seq_length, "
                          "max_seq_len, model_max_length, max_position_embeddings"), msg
    assert msg.endswith("nothing was sent (--no-length-check sends without a bound)")
    said = check_against_model(ds, facts, length_check=False)
    assert said.startswith("prompt length: not checked (--no-length-check)")
    # the vocabulary is checked all the same
    with pytest.raises(BadInput, match="vocab_size 1 "):
        check_against_model(ds, {"h": {"vocab_size": 1}}, length_check=False)


def sglang_get_context_length(tree: Path):
    """SGLang 0.5.23's own get_context_length and CONTEXT_LENGTH_KEYS, taken from the tree's source (the
    module imports half of SGLang; the function itself needs nothing)."""
    import ast

    src = (tree / "sglang/srt/utils/hf_transformers/common.py").read_text()
    keep = [n for n in ast.parse(src).body if (isinstance(n, ast.FunctionDef) and n.name == "get_context_length")
            or (isinstance(n, ast.Assign) and any(getattr(t, "id", None) == "CONTEXT_LENGTH_KEYS" for t in n.targets))]
    ns: dict = {}
    exec(compile(ast.Module(body=keep, type_ignores=[]), "common.py", "exec"), ns)
    assert len(keep) == 2 and ns["CONTEXT_LENGTH_KEYS"]
    return ns["get_context_length"], ns["CONTEXT_LENGTH_KEYS"]


def test_the_config_rule_is_sglangs_get_context_length(sglang_tree):
    from types import SimpleNamespace

    from patchctl.host.limits import CONTEXT_LENGTH_KEYS, config_context_len, max_req_input_len

    theirs, keys = sglang_get_context_length(sglang_tree)
    assert tuple(keys) == CONTEXT_LENGTH_KEYS
    for cfg in ({"max_position_embeddings": 4096}, {"seq_length": 100, "max_position_embeddings": 4096},
                {"max_position_embeddings": 4096, "rope_scaling": {"factor": 4.0}},
                {"max_position_embeddings": 4096, "rope_scaling": {"factor": 4.0, "original_max_position_embeddings": 1}},
                {"max_position_embeddings": 8192, "rope_scaling": {"factor": 8.0, "rope_type": "llama3"}},
                {"model_max_length": 77, "rope_scaling": {"factor": 2}}):
        assert config_context_len(cfg)[0] == theirs(SimpleNamespace(**cfg)), cfg

    assert config_context_len({"max_position_embeddings": 4096}) == (4096, "max_position_embeddings=4096")
    # the first key of SGLang's list wins; a rope factor multiplies, except with original_max_position_embeddings
    assert config_context_len({"seq_length": 100, "max_position_embeddings": 4096})[0] == 100
    assert config_context_len({"max_position_embeddings": 4096, "rope_scaling": {"factor": 4.0}}) == (
        16384, "max_position_embeddings=4096 x rope factor 4.0")
    assert config_context_len({"max_position_embeddings": 4096, "rope_scaling": {
        "factor": 4.0, "original_max_position_embeddings": 1024}})[0] == 4096
    assert config_context_len({"max_position_embeddings": 8192, "rope_scaling": {
        "factor": 8.0, "rope_type": "llama3"}})[0] == 8192
    # a multimodal config's text part; none of the keys: unknown (SGLang would use transformers' default)
    assert config_context_len({"text_config": {"num_hidden_layers": 2, "max_position_embeddings": 32}})[0] == 32
    assert config_context_len({"num_hidden_layers": 2}) == (None, None)
    # tp_worker.py:568-572
    assert max_req_input_len(4096, 10 ** 6) == 4090 and max_req_input_len(4096, 1000) == 994


# --- the cached index (dataset.IndexCache, issue 41): a file validated without a problem is not validated again ---

def _index(ds) -> tuple:
    return (list(ds.ids), *(list(getattr(ds, k)) for k in ("lines", "offsets", "lengths", "ntokens", "max_ids")),
            bytes(ds.masks), ds.tokens, ds.has_loss_mask, ds.ok, len(ds))


def _no_validation(monkeypatch):
    def validate(self):
        raise AssertionError("validated although its index is cached")

    monkeypatch.setattr(dsmod.Dataset, "validate", validate)


def _lines(n: int, mask_at: int = 2) -> list:
    return [{"id": f"s{i}", "input_ids": [10 + i, 20 + i, 3], **({"loss_mask": [0, 1, 1]} if i == mask_at else {})}
            for i in range(n)] + [""]


def test_a_cached_index_is_used_for_the_same_file_and_the_models_checks_still_run(tmp_path, monkeypatch):
    p, idx = write(tmp_path, _lines(40)), tmp_path / "index"
    first = load_dataset(p, "p-", index_dir=idx)
    assert not first.cached and len(list(idx.glob("*.idx"))) == 1
    _no_validation(monkeypatch)
    for again in (dsmod.open_dataset(p, "p-", index_dir=idx), load_dataset(p, "p-", index_dir=idx)):
        assert again.cached and again.finished.is_set() and _index(again) == _index(first)
        assert again.sha256 == first.sha256 and again.info() == first.info()
        assert again.count == 40 and again.maybe_mask  # (only the sha256 was taken: the rest is the index's)
        feed = dsmod.DatasetFeed(again, {"s0": "h", "s1": "h"})
        assert feed.take().id == "s2" and again.read(again.get("s2")) == {"id": "s2", "input_ids": [12, 22, 3], "loss_mask": [0, 1, 1]}
    # the model's checks run on the cached index as on a validated one: a token id >= vocab, a prompt too long
    with pytest.raises(BadInput) as e:
        check_against_model(dsmod.open_dataset(p, "p-", index_dir=idx), {"h": {"vocab_size": 59, "max_req_input_len": 4}})
    assert str(e.value).startswith(f"{p.absolute()}:40: id 's39': token id 59 >= vocab_size 59") and e.value.problem_count == 1
    with pytest.raises(BadInput) as e:
        check_against_model(dsmod.open_dataset(p, "p-", index_dir=idx), {"h": {"vocab_size": 60, "max_req_input_len": 3}})
    assert str(e.value).startswith(f"{p.absolute()}:1: id 's0': 3 tokens; SGLang on h aborts") and e.value.problem_count == 40
    check_against_model(dsmod.open_dataset(p, "p-", index_dir=idx), {"h": {"vocab_size": 60, "max_req_input_len": 4}})


def test_a_file_changed_by_one_byte_never_uses_the_stale_index(tmp_path, monkeypatch):
    p, idx = write(tmp_path, _lines(30)), tmp_path / "index"
    load_dataset(p, "p-", index_dir=idx)
    raw = p.read_bytes()
    # one byte, same size: a token id of line 5 made larger than the index recorded
    at = raw.index(b"[14, 24, 3]")
    p.write_bytes(raw[:at + 1] + b"9" + raw[at + 2:])
    ds = dsmod.open_dataset(p, "p-", index_dir=idx)
    ds.finished.wait(30)
    assert not ds.cached and ds.get("s4").max_id == 94 and len(list(idx.glob("*.idx"))) == 2  # validated, indexed anew
    assert ds.count == 30 and ds.maybe_mask and ds.failure() is None  # (the sha256 missed: the full prescan's)
    # one byte that makes it bad: validated, refused (nothing cached for it)
    p.write_bytes(raw[:at] + b"{" + raw[at + 1:])
    assert ":5: not valid JSON" in str(refused(p, "p-"))
    with pytest.raises(BadInput, match=":5: not valid JSON"):
        load_dataset(p, "p-", index_dir=idx)
    assert len(list(idx.glob("*.idx"))) == 2
    # the original file again: its index; another rid prefix: validated (file names are judged on the rids)
    p.write_bytes(raw)
    _no_validation(monkeypatch)
    assert dsmod.open_dataset(p, "p-", index_dir=idx).cached
    with pytest.raises(AssertionError, match="validated although"):
        load_dataset(p, "q-", index_dir=idx)


def test_a_corrupt_or_foreign_index_is_ignored_and_the_file_validated(tmp_path, monkeypatch):
    p, idx = write(tmp_path, _lines(20)), tmp_path / "index"
    good = load_dataset(p, "p-", index_dir=idx)
    (path,) = idx.glob("*.idx")
    raw = path.read_bytes()
    magic, head, payload = raw.split(b"\n", 2)
    header = json.loads(head)

    def with_header(**kw):
        return magic + b"\n" + json.dumps(dict(header, **kw)).encode() + b"\n" + payload

    flipped = bytearray(raw)
    flipped[-30] ^= 1
    cases = {"a payload byte changed": bytes(flipped), "torn": raw[:-7], "empty": b"",
             "another version": with_header(version=dsmod.INDEX_VERSION + 1),
             "another file": with_header(sha256="0" * 64), "another byte order": with_header(byteorder="other"),
             "more samples than the file": with_header(n=21), "not an index": b"{}\n"}
    for case, data in cases.items():
        path.write_bytes(data)
        ds = load_dataset(p, "p-", index_dir=idx)
        assert not ds.cached and _index(ds) == _index(good), case
        assert path.read_bytes() == raw, case  # validated again without a problem: the index written anew
    # a file with a problem leaves no index
    bad = write(tmp_path, _lines(3) + ['{"id": "x", "input_ids": [-1]}'])
    refused(bad)
    with pytest.raises(BadInput):
        load_dataset(bad, "p-", index_dir=idx)
    assert list(idx.glob("*.idx")) == [path]


def test_a_line_read_back_with_other_tokens_than_the_index_says_is_refused(tmp_path):
    p = write(tmp_path, [{"id": "a", "input_ids": [1, 2, 3]}, {"id": "b", "input_ids": [7]}])
    ds = load_dataset(p)
    raw = p.read_bytes()
    p.write_bytes(raw.replace(b"[1, 2, 3]", b"[1, 2, 9]"))  # same id, same size, another largest id
    with pytest.raises(BadInput, match=r"sample 'a' is no longer what was validated \(3 tokens, largest id 3\)"):
        ds.read(ds.get("a"))
    p.write_bytes(raw.replace(b"[1, 2, 3]", b"[1,2,  3]"))  # the same tokens, spelled otherwise: still what was checked
    assert ds.read(ds.get("a"))["input_ids"] == [1, 2, 3]
