"""`patchctl capture prepare`: conversations -> {id, input_ids, loss_mask} with SpecForge 0.2.0's own code.

The reference is SpecForge itself, called here the way its online training pipeline calls it
(`preprocess_conversations` per conversation, and `build_eagle3_dataset` over an HF dataset), on
tokenizers the tests build with the `tokenizers` library (patchctl.simserver.tokenizer: byte-level BPE,
each family's special tokens and chat template; nothing downloaded). Templates of SpecForge's two main
parser types: general (llama3, qwen, deepseek-v3) and thinking (kimi-k2-thinking).
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
from specforge.data.preprocessing import build_eagle3_dataset, preprocess_conversations
from specforge.data.template import TEMPLATE_REGISTRY
from transformers import AutoTokenizer

from patchctl import cli
from patchctl.commands.capture.dataset import load_dataset
from patchctl.host.tokenizer import listing
from patchctl.simserver.tokenizer import FAMILIES, write_tokenizer

TEMPLATES = ["llama3", "qwen", "deepseek-v3", "kimi-k2-thinking"]

CONVERSATIONS = [
    # ShareGPT, one turn, the template's default system prompt
    {"id": "one-turn", "conversations": [{"from": "human", "value": "hello world, how are you today?"},
                                         {"from": "gpt", "value": "I am fine, thank you."}]},
    # OpenAI messages, a system prompt of its own, three turns
    {"id": "multi", "messages": [
        {"role": "system", "content": "Answer briefly and precisely."},
        {"role": "user", "content": "what is the capital of France?"},
        {"role": "assistant", "content": "Paris is the capital of France."},
        {"role": "user", "content": "and the quick brown fox?"},
        {"role": "assistant", "content": "it jumps over the lazy dog"},
        {"role": "user", "content": "def add(a, b)?"},
        {"role": "assistant", "content": "return a + b"}]},
    # no id: line-N; a reasoning model's turn (kept by the thinking parser)
    {"messages": [{"role": "user", "content": "question: 7 + 8"},
                  {"role": "assistant", "content": "15", "reasoning_content": "seven and eight"}]},
    # ShareGPT with a system turn of its own
    {"id": 42, "conversations": [{"from": "system", "value": "You are a helpful assistant."},
                                 {"from": "human", "value": "the cat sleeps"},
                                 {"from": "gpt", "value": "while the fox jumps"}]},
]


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    """The tokenizer cache (~/.cache/patchctl/tokenizers) of this test only."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    return tmp_path / "cache" / "patchctl" / "tokenizers"


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    base = tmp_path_factory.mktemp("tok")
    return {t: write_tokenizer(base / t, t) for t in TEMPLATES}


def write_jsonl(path: Path, rows) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def prepare(*args, expect=0, capsys=None):
    code = cli.main(["capture", "prepare", *map(str, args)])
    out = capsys.readouterr() if capsys else None
    assert code == expect, out
    return out


def conv_of(row: dict):
    return row.get("conversations") or row.get("messages")


def read(path: Path) -> list[dict]:
    return [json.loads(l) for l in path.read_text().splitlines()]


def reference(tok_dir: Path, template: str, conv, max_length: int, last_turn: bool = False):
    tok = AutoTokenizer.from_pretrained(str(tok_dir))
    r = preprocess_conversations(tok, [conv], TEMPLATE_REGISTRY.get(template), max_length,
                                 train_only_last_turn=last_turn, tools=[[]])
    return r["input_ids"][0][0].tolist(), r["loss_mask"][0][0].tolist()


@pytest.mark.parametrize("template", TEMPLATES)
def test_prepare_equals_specforge_id_for_id_and_mask_for_mask(template, tokenizers, tmp_path, capsys):
    src = write_jsonl(tmp_path / "conv.jsonl", CONVERSATIONS)
    out = tmp_path / "ds.jsonl"
    prepare(src, "--template", template, "--tokenizer", tokenizers[template], "--out", out, "--workers", "2",
            capsys=capsys)
    got = read(out)
    assert [g["id"] for g in got] == ["one-turn", "multi", "line-3", "42"]
    for row, g in zip(CONVERSATIONS, got):
        ids, mask = reference(tokenizers[template], template, conv_of(row), 2048)
        assert g["input_ids"] == ids and g["loss_mask"] == mask, (template, g["id"])
        assert 0 < sum(mask) < len(mask)  # some prompt, some answer: a mask that could be wrong
    # the multi-turn sample trains on each of its three answers and on none of the prompts
    multi = got[1]
    tok = AutoTokenizer.from_pretrained(str(tokenizers[template]))
    trained = tok.decode([i for i, m in zip(multi["input_ids"], multi["loss_mask"]) if m])
    for answer in ("Paris is the capital of France.", "it jumps over the lazy dog", "return a + b"):
        assert answer in trained
    for prompt in ("capital of France?", "quick brown fox?", "precisely"):
        assert prompt not in trained
    # capture run reads it as it is
    ds = load_dataset(out)
    assert len(ds.samples) == 4 and ds.has_loss_mask


@pytest.mark.parametrize("template", ["llama3", "kimi-k2-thinking"])
def test_prepare_equals_specforges_online_pipeline_build_eagle3_dataset(template, tokenizers, tmp_path, capsys):
    """SpecForge's own online path over an HF dataset (it shuffles: compared as a multiset)."""
    from datasets import Dataset

    rows = [r for r in CONVERSATIONS if "conversations" in r]  # the column SpecForge's pipeline reads
    src = write_jsonl(tmp_path / "conv.jsonl", rows)
    out = tmp_path / "ds.jsonl"
    cut = max(len(reference(tokenizers[template], template, r["conversations"], 4096)[0]) for r in rows) - 3
    prepare(src, "--template", template, "--tokenizer", tokenizers[template], "--out", out, "--max-length", cut,
            "--truncate", capsys=capsys)
    tok = AutoTokenizer.from_pretrained(str(tokenizers[template]))
    hf = Dataset.from_list([{"id": str(r["id"]), "conversations": r["conversations"]} for r in rows])
    online = build_eagle3_dataset(hf, tok, template, max_length=cut, num_proc=None)
    want = sorted((online[i]["input_ids"][0].tolist(), online[i]["loss_mask"][0].tolist()) for i in range(len(online)))
    got = sorted((g["input_ids"], g["loss_mask"]) for g in read(out))
    assert got == want and max(len(ids) for ids, _ in got) == cut and all(any(mask) for _, mask in got)


@pytest.mark.parametrize("template", ["qwen", "deepseek-v3"])
def test_truncation_and_last_turn_only_as_specforge_does(template, tokenizers, tmp_path, capsys):
    src = write_jsonl(tmp_path / "conv.jsonl", CONVERSATIONS)
    full = reference(tokenizers[template], template, conv_of(CONVERSATIONS[1]), 4096)[0]
    cut = len(full) - 2  # inside the last answer: its first tokens trained, the rest gone
    out = tmp_path / "ds.jsonl"
    prepare(src, "--template", template, "--tokenizer", tokenizers[template], "--out", out, "--max-length", cut,
            "--truncate", "--train-only-last-turn", "--workers", "1", capsys=capsys)
    got = {g["id"]: g for g in read(out)}
    for row in CONVERSATIONS:
        sid = str(row.get("id", f"line-{CONVERSATIONS.index(row) + 1}"))
        ids, mask = reference(tokenizers[template], template, conv_of(row), cut, last_turn=True)
        if not any(mask):
            assert sid not in got
            continue
        assert got[sid]["input_ids"] == ids and got[sid]["loss_mask"] == mask
    assert len(got["multi"]["input_ids"]) == cut
    # without --truncate the same limit is refused, naming the line, and nothing is written
    out2 = tmp_path / "ds2.jsonl"
    err = prepare(src, "--template", template, "--tokenizer", tokenizers[template], "--out", out2, "--max-length", cut,
                  expect=2, capsys=capsys).err
    assert f"{src}:2: longer than --max-length {cut} tokens" in err
    assert not out2.exists() and not list(tmp_path.glob(".ds2*"))


def test_bad_conversations_all_named_at_once_nothing_written(tokenizers, tmp_path, capsys):
    good = CONVERSATIONS[0]
    src = write_jsonl(tmp_path / "bad.jsonl", [
        good,                                                                      # 1 fine
        "{not json",                                                               # 2
        {"id": "x", "conversations": []},                                          # 3 empty
        {"id": "y", "text": "hi"},                                                 # 4 no conversation
        {"id": "z", "messages": [{"role": "robot", "content": "beep"}]},           # 5 unknown role
        {"id": "w", "messages": [{"role": "assistant", "content": "first"},        # 6 SpecForge would drop it
                                 {"role": "user", "content": "then"}]},
        {"id": "v", "messages": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"},   # 7 template
                                 {"role": "assistant", "content": "c"}]},                             #   refuses
        {"id": "u", "messages": [{"role": "user", "content": 5}]},                 # 8 content not a string
        {"id": "one-turn", "messages": conv_of(good)},                             # 9 the same id again
        {"id": "t", "messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"},
                                 {"role": "assistant", "content": "b"}]},           # 10 assistant after assistant
    ])
    out = tmp_path / "ds.jsonl"
    err = prepare(src, "--template", "llama3", "--tokenizer", tokenizers["llama3"], "--out", out, "--workers", "2",
                  expect=2, capsys=capsys).err
    for line, what in [(2, "not valid JSON"), (3, "conversations []: expected a non-empty list of messages"),
                       (4, 'no "conversations"'), (5, "message 1: \"role\" is 'robot'; expected one of system, user"),
                       (6, "SpecForge would cut this conversation short: Dropping leading 'assistant'"),
                       (7, "the chat template or tokenizer refused it: Conversation roles must alternate"),
                       (8, "message 1 (user): \"content\" is 5; expected a string"), (9, "id 'one-turn' again (first on line 1)"),
                       (10, "SpecForge would cut this conversation short: An 'assistant' message must follow")]:
        assert f"{src}:{line}: {what}" in err, (line, err.replace(str(src), "F"))
    assert f"{src}:1:" not in err and "9 problems" in err and "nothing was written" in err
    assert not out.exists() and not list(tmp_path.glob(".ds.jsonl*"))


def test_a_message_without_speaker_or_text_reads_the_same_in_prepare_and_regenerate(tokenizers, tmp_path, capsys):
    """One wording per problem, naming the key the line's format uses (ShareGPT from/value, OpenAI
    role/content): before, a missing role read "no role" in prepare and "role null" in regenerate, even for a
    ShareGPT line, which has no role at all."""
    answer = {"role": "assistant", "content": "yo"}
    src = write_jsonl(tmp_path / "c.jsonl", [
        {"id": "a", "messages": [{"content": "hi"}, answer]},                              # 1
        {"id": "b", "conversations": [{"value": "hi"}, {"from": "gpt", "value": "yo"}]},     # 2
        {"id": "c", "messages": [{"role": None, "content": "hi"}, answer]},                # 3
        {"id": "d", "conversations": [{"from": "human"}, {"from": "gpt", "value": "yo"}]},  # 4
        {"id": "e", "messages": [{"role": "user", "content": None}, answer]},              # 5
    ])
    roles = "expected one of system, user, human, assistant, gpt, tool"
    want = [(1, f'message 1: no "role"; {roles}'), (2, f'message 1: no "from"; {roles}'),
            (3, f'message 1: "role" is null; {roles}'), (4, 'message 1 (human): no "value"; expected a string'),
            (5, 'message 1 (user): "content" is null; expected a string')]
    err_prepare = prepare(src, "--template", "llama3", "--tokenizer", tokenizers["llama3"], "--out", tmp_path / "o.jsonl",
                          expect=2, capsys=capsys).err
    assert cli.main(["capture", "regenerate", str(src), "--out", str(tmp_path / "r.jsonl")]) == 2
    err_regenerate = capsys.readouterr().err
    for err in (err_prepare, err_regenerate):
        rows = sorted(l.split(f"{src}:", 1)[1] for l in err.splitlines() if re.search(re.escape(f"{src}:") + r"\d", l))
        assert rows == [f"{line}: {what}" for line, what in want], err
    assert not (tmp_path / "o.jsonl").exists() and not (tmp_path / "r.jsonl").exists()


def test_another_models_template_names_the_markers_the_tokenizer_lacks(tokenizers, tmp_path, capsys):
    """--template qwen on a Llama 3 tokenizer: SpecForge finds no assistant turn (its loss mask starts at the
    template's assistant header, which this tokenizer's chat template never writes); said as such, not only
    "no conversation has a trainable token"."""
    src = write_jsonl(tmp_path / "c.jsonl", CONVERSATIONS)
    err = prepare(src, "--template", "qwen", "--tokenizer", tokenizers["llama3"], "--out", tmp_path / "o.jsonl",
                  "--workers", "1", expect=2, capsys=capsys).err
    assert "no conversation has a trainable token (template qwen)" in err, err
    assert ("the tokenizer's chat template does not write the template's assistant_header '<|im_start|>assistant\\n' "
            "(<|im_start|> not in its vocabulary) nor its end_of_turn_token '<|im_end|>\\n' (<|im_end|> not in its "
            "vocabulary): --template qwen is not this tokenizer's model's") in err, err
    assert not (tmp_path / "o.jsonl").exists()
    # its own template: no such words, a dataset
    prepare(src, "--template", "llama3", "--tokenizer", tokenizers["llama3"], "--out", tmp_path / "o.jsonl",
            "--workers", "1", capsys=capsys)
    assert (tmp_path / "o.jsonl").exists()


def test_unknown_template_lists_the_known_ones(tokenizers, tmp_path, capsys):
    src = write_jsonl(tmp_path / "c.jsonl", CONVERSATIONS[:1])
    err = prepare(src, "--template", "llama-3", "--tokenizer", tokenizers["llama3"], "--out", tmp_path / "o.jsonl",
                  expect=2, capsys=capsys).err
    assert "--template 'llama-3': not one of SpecForge 0.2.0's templates:" in err
    for name in TEMPLATE_REGISTRY.get_all_template_names():
        assert name in err
    assert not (tmp_path / "o.jsonl").exists()


def test_provenance_sidecar_and_only_its_own_output_overwritten(tokenizers, tmp_path, capsys):
    src = write_jsonl(tmp_path / "conv.jsonl", CONVERSATIONS + [
        {"id": "no-answer", "messages": [{"role": "user", "content": "hello"}]}])
    out = tmp_path / "ds.jsonl"
    err = prepare(src, "--template", "qwen", "--tokenizer", tokenizers["qwen"], "--out", out, capsys=capsys).err
    assert f"{src}:5: id 'no-answer': no trainable token" in err  # reported, left out
    meta = json.loads((tmp_path / "ds.jsonl.meta.json").read_text())
    import hashlib

    assert meta["tokenizer"]["digest"] == listing(str(tokenizers["qwen"]))["digest"]
    assert set(meta["tokenizer"]["files"]) == {"tokenizer.json", "tokenizer_config.json"}
    assert meta["source"]["sha256"] == hashlib.sha256(src.read_bytes()).hexdigest() and meta["source"]["lines"] == 5
    assert meta["dataset"]["sha256"] == hashlib.sha256(out.read_bytes()).hexdigest()
    assert meta["dataset"]["samples"] == 4 and meta["left_out"]["no_trainable_token"] == 1
    assert (meta["template"], meta["max_length"], meta["specforge"]) == ("qwen", 2048, "0.2.0")
    # prepare's own output is prepared again in place; a file it did not write is never overwritten
    prepare(src, "--template", "llama3", "--tokenizer", tokenizers["llama3"], "--out", out, capsys=capsys)
    assert json.loads((tmp_path / "ds.jsonl.meta.json").read_text())["template"] == "llama3"
    mine = tmp_path / "mine.jsonl"
    mine.write_text("precious\n")
    err = prepare(src, "--template", "qwen", "--tokenizer", tokenizers["qwen"], "--out", mine, expect=2,
                  capsys=capsys).err
    assert "exists and was not written by `capture prepare`" in err and mine.read_text() == "precious\n"
    # a tokenizer directory without tokenizer files, or without SpecForge's needs, is bad input
    empty = tmp_path / "empty"
    empty.mkdir()
    err = prepare(src, "--template", "qwen", "--tokenizer", empty, "--out", tmp_path / "x.jsonl", expect=2,
                  capsys=capsys).err
    assert "no tokenizer files there" in err


def test_the_stand_in_families_are_what_specforge_templates_expect(tokenizers):
    """Each built tokenizer keeps its family's special tokens whole and stays inside the stand-in's vocab."""
    for t, d in tokenizers.items():
        tok = AutoTokenizer.from_pretrained(str(d))
        assert len(tok) <= 512
        for s in FAMILIES[t]["specials"]:
            assert len(tok.encode(s, add_special_tokens=False)) == 1, (t, s)
        assert os.path.getsize(d / "tokenizer.json") > 0


def test_the_shipped_conversations_example_prepares_for_the_demo_model(tokenizers, tmp_path, capsys):
    src = Path(__file__).resolve().parent.parent / "examples" / "conversations.jsonl"
    out = tmp_path / "ds.jsonl"
    prepare(src, "--template", "llama3", "--tokenizer", tokenizers["llama3"], "--out", out, "--workers", "2",
            capsys=capsys)
    rows = [json.loads(l) for l in src.read_text().splitlines()]
    got = read(out)
    assert [g["id"] for g in got] == [r["id"] for r in rows]  # every conversation has a trainable token
    assert all(max(g["input_ids"]) < 512 for g in got)  # the demo model's vocabulary
