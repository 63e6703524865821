"""Converting hidden dumps into SpecForge `.ckpt` files (host/ckpt.py, host/convert.py): every converted file is,
byte for byte, `torch.save` of the same tensors, through the agent's `convert` op (its Converter, with forked
worker processes and in one process) and through the controller's `convert_file`; each refusal keeps its status
and leaves nothing behind. The op end to end over sshd: tests/test_capture_collect.py and test_capture_shared.py."""

from __future__ import annotations

import hashlib
import io
import json
import threading
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from patchctl.host import ckpt, convert
from patchctl.host.protocol import EVENT_PREFIX

RUN = "cv"
META = {"format_version": "2", "layers_to_capture": "[2, 4, 5]", "layer_outputs": "[1, 3, 4]",
        "eagle_aux_hidden_state_layer_ids": "null"}
EXPECT = {"layers_to_capture": {"ids": [2, 4, 5], "from": "the test"}}
# (T, H, with a loss mask): T = 1, small and odd shapes, and tensors of several CHUNK-sized pieces
SHAPES = [(1, 8, False), (1, 8, True), (2, 16, True), (7, 64, False), (33, 40, True), (700, 512, False),
          (700, 512, True), (1500, 384, True)]


def tensors(T: int, H: int, seed: int, k: int = 3) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"input_ids": torch.randint(0, 1 << 40, (T,), generator=g, dtype=torch.int64),
            "hidden_states": torch.randn(T, H, generator=g).bfloat16(),
            "aux_hidden_states": torch.randn(T, k * H, generator=g).bfloat16()}


def reference(t: dict, mask) -> bytes:
    """torch.save of SpecForge's sample made of the same tensors, in memory."""
    T = t["input_ids"].shape[0]
    buf = io.BytesIO()
    torch.save({"input_ids": t["input_ids"].clone(),
                "loss_mask": torch.tensor(mask, dtype=torch.int64) if mask is not None else torch.ones(T, dtype=torch.int64),
                "hidden_state": t["hidden_states"][None].clone(), "aux_hidden_state": t["aux_hidden_states"][None].clone()},
               buf)
    return buf.getvalue()


class Host:
    """A state_dir holding run RUN's dumps, and the convert op's samples for them (as the controller sends)."""

    def __init__(self, base: Path):
        self.state = base / "state"
        self.root = self.state / "dumps" / "captures" / RUN
        self.root.mkdir(parents=True)
        self.items: list[dict] = []
        self.want: dict[str, bytes] = {}

    def dump(self, sid: str, t: dict, mask=None, meta=META) -> dict:
        path = self.root / f"{sid}.safetensors"
        save_file(t, str(path), metadata=meta)
        data = path.read_bytes()
        item = {"id": sid, "path": str(path), "sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data),
                "tokens": int(t["input_ids"].shape[0])}
        if mask is not None:
            item["loss_mask"] = mask
        self.items.append(item)
        return item

    def convert(self, out: Path, workers: int, capsys) -> tuple[dict, dict]:
        """The op: (its answer, {id: event}) for every sample sent."""
        stdin = io.BytesIO("".join(json.dumps(it) + "\n" for it in self.items).encode())
        req = {"run": RUN, "out_dir": str(out), "host": "h0", "layers": 3, "workers": workers, "expect": EXPECT}
        res = convert.Converter(str(self.state), req, stdin).run_all([it["id"] for it in self.items])
        evs = [json.loads(l[len(EVENT_PREFIX):]) for l in capsys.readouterr().err.splitlines() if l.startswith(EVENT_PREFIX)]
        return res, {e["id"]: e for e in evs if e.get("event") in ("sample_converted", "sample_failed")}


def mask_for(T: int, seed: int):
    return [int((seed + i) % 3 != 0) for i in range(T)]


@pytest.mark.parametrize("workers,overlap,chunk", [(2, True, 1 << 20), (1, False, 1 << 20), (2, True, 65536 + 24)],
                         ids=["2-workers", "1-worker-inline-hash", "odd-pieces"])
def test_the_convert_op_writes_torch_save_bytes(tmp_path, capsys, monkeypatch, workers, overlap, chunk):
    monkeypatch.setattr(ckpt, "OVERLAP", overlap)
    monkeypatch.setattr(ckpt, "CHUNK", chunk)  # the forked workers inherit both
    h = Host(tmp_path)
    for n, (T, H, with_mask) in enumerate(SHAPES):  # large and small alternate: a worker's kept buffer is reused
        t = tensors(T, H, seed=n)
        mask = mask_for(T, n) if with_mask else None
        h.dump(f"s{n}", t, mask)
        h.want[f"s{n}"] = reference(t, mask)
    out = tmp_path / "out"
    res, evs = h.convert(out, workers, capsys)
    assert (res["converted"], res["failed"], res["workers"]) == (len(SHAPES), 0, workers), (res, evs)
    for sid, want in h.want.items():
        ev = evs[sid]
        got = (out / ev["file"]).read_bytes()
        assert got == want, sid  # byte for byte
        assert (ev["sha256"], ev["bytes"]) == (hashlib.sha256(want).hexdigest(), len(want))
        assert ev["tokens"] == SHAPES[int(sid[1:])][0]
        assert ev["layers"] == {"layers_to_capture": [2, 4, 5], "layer_outputs": [1, 3, 4],
                                "eagle_aux_hidden_state_layer_ids": None}
    recs = [json.loads(l) for l in (out / ".patchctl" / "hosts" / "h0" / "records.jsonl").read_text().splitlines()]
    assert {r["id"]: r["sha256"] for r in recs} == {s: hashlib.sha256(w).hexdigest() for s, w in h.want.items()}
    assert not list(out.rglob("*.patchctl-partial"))
    # resumed: every file recognised from the host's record, none written again
    inodes = {p: p.stat().st_ino for p in out.rglob("*.ckpt")}
    res, evs = h.convert(out, workers, capsys)
    assert (res["converted"], res["present"], res["failed"]) == (0, len(SHAPES), 0)
    assert {p: p.stat().st_ino for p in out.rglob("*.ckpt")} == inodes


def test_each_converted_file_is_fsynced_by_the_op_before_it_is_recorded_and_linked(tmp_path, capsys, monkeypatch):
    """The workers leave the fsync to the op's syncer threads (they go on to their next dump meanwhile): every
    converted file is fsynced there, as its partial, before the host's record names it and before it is linked."""
    h = Host(tmp_path)
    for n, (T, H, with_mask) in enumerate(SHAPES):
        h.dump(f"s{n}", tensors(T, H, seed=n), mask_for(T, n) if with_mask else None)
    out = tmp_path / "out"
    synced, real = [], ckpt.fsync_path

    def fsync_path(path):
        dest = Path(path[:path.index(".h0.patchctl-partial")])
        records = out / ".patchctl" / "hosts" / "h0" / "records.jsonl"
        named = records.exists() and dest.relative_to(out).as_posix() in records.read_text()
        synced.append((dest, dest.exists(), named, threading.current_thread() is threading.main_thread()))
        real(path)

    monkeypatch.setattr(ckpt, "fsync_path", fsync_path)
    res, evs = h.convert(out, 2, capsys)
    assert res["converted"] == len(SHAPES)
    assert sorted(d for d, *_ in synced) == sorted(out / e["file"] for e in evs.values())
    assert not any(exists or named or main for _d, exists, named, main in synced), synced


def test_convert_file_writes_torch_save_bytes_from_several_threads(tmp_path):
    """The controller's path (capture collect --format specforge on pulled files), the same code: each of 4
    threads converting at once (a kept buffer per thread) writes exactly torch.save's bytes."""
    h = Host(tmp_path)
    jobs = []
    for n, (T, H, with_mask) in enumerate(SHAPES * 2):
        t = tensors(T, H, seed=100 + n)
        mask = mask_for(T, n) if with_mask else None
        jobs.append((Path(h.dump(f"c{n}", t, mask)["path"]), tmp_path / f"c{n}.ckpt", mask, reference(t, mask), T))
    errors = []

    def work(mine):
        try:
            for dump, out, mask, want, T in mine:
                got_T, meta, sha, nbytes = convert.convert_file(dump, out, mask, convert.SPECFORGE_K)
                assert (got_T, meta) == (T, META) and out.read_bytes() == want, out
                assert (sha, nbytes) == (hashlib.sha256(want).hexdigest(), len(want))  # hashed as written
        except BaseException as e:  # noqa: BLE001 - reported by the main thread
            errors.append(e)

    threads = [threading.Thread(target=work, args=(jobs[i::4],)) for i in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert errors == []
    loaded = torch.load(jobs[0][1], weights_only=True)  # what SpecForge does with it
    assert loaded["hidden_state"].shape == (1, 1, 8) and loaded["aux_hidden_state"].shape == (1, 1, 24)


def test_each_refusal_keeps_its_status_and_leaves_nothing(tmp_path, capsys):
    h = Host(tmp_path)
    h.dump("good", tensors(4, 8, 1))
    h.want["good"] = reference(tensors(4, 8, 1), None)
    changed = h.dump("changed", tensors(4, 8, 2))  # same size, other bytes, after the journal's record
    p = Path(changed["path"])
    data = bytearray(p.read_bytes())
    data[-1] ^= 1
    p.write_bytes(bytes(data))
    grown = h.dump("grown", tensors(4, 8, 3))
    with open(grown["path"], "ab") as f:
        f.write(b"x")
    h.dump("k4", tensors(4, 8, 4, k=4))
    f32 = tensors(4, 8, 5)
    f32["hidden_states"] = f32["hidden_states"].float()
    h.dump("f32", f32)
    h.dump("mask", tensors(4, 8, 6), mask=[1, 0, 1])
    h.dump("layers", tensors(4, 8, 7), meta=dict(META, layers_to_capture="[2, 3, 5]"))
    short = h.dump("short", tensors(4, 8, 8))
    Path(short["path"]).write_bytes(b"\x10" + b"\x00" * 7 + b"{not json")  # its record says what it now holds
    short.update(sha256=hashlib.sha256(Path(short["path"]).read_bytes()).hexdigest(), bytes=17)
    h.items.append({"id": "gone", "path": str(h.root / "nope.safetensors"), "sha256": "0" * 64, "bytes": 1})
    outside = tmp_path / "elsewhere.safetensors"
    save_file(tensors(2, 8, 9), str(outside), metadata=META)
    h.items.append({"id": "outside", "path": str(outside), "sha256": "0" * 64, "bytes": outside.stat().st_size})
    out = tmp_path / "out"
    res, evs = h.convert(out, 2, capsys)
    status = {sid: e.get("status", "converted") for sid, e in evs.items()}
    assert status == {"good": "converted", "changed": "mismatch", "grown": "mismatch", "k4": "bad dump",
                      "f32": "bad dump", "mask": "bad dump", "layers": "layers mismatch", "short": "bad dump",
                      "gone": "missing", "outside": "refused"}, evs
    assert "changed on the host" in evs["changed"]["reason"] and "changed on the host" in evs["grown"]["reason"]
    assert "aux_hidden_states is 32 wide, 3 layers of 8 expected" in evs["k4"]["reason"]
    assert "hidden_states is F32, expected BF16" in evs["f32"]["reason"]
    assert "loss_mask has 3 values for 4 tokens" in evs["mask"]["reason"]
    assert "layers_to_capture [2, 3, 5], expected [2, 4, 5]" in evs["layers"]["reason"]
    assert "header" in evs["short"]["reason"] and "outside" in evs["outside"]["reason"]
    assert (res["converted"], res["failed"]) == (1, 9)
    assert [p.name for p in out.rglob("*.ckpt")] == [Path(evs["good"]["file"]).name]
    assert (out / evs["good"]["file"]).read_bytes() == h.want["good"]
    assert not list(out.rglob("*.patchctl-partial"))
    recs = (out / ".patchctl" / "hosts" / "h0" / "records.jsonl").read_text().splitlines()
    assert [json.loads(l)["id"] for l in recs] == ["good"]


def test_convert_file_refuses_what_is_not_a_hidden_dump(tmp_path):
    h = Host(tmp_path)
    k4 = Path(h.dump("k4", tensors(3, 8, 1, k=4))["path"])
    with pytest.raises(ValueError, match="aux_hidden_states is 32 wide, 3 layers of 8 expected"):
        convert.convert_file(k4, tmp_path / "k4.ckpt", None, 3)
    t = tensors(3, 8, 2)
    del t["input_ids"]
    missing = Path(h.dump("noids", dict(t, input_ids=torch.zeros(0, dtype=torch.int64)))["path"])
    with pytest.raises(ValueError, match="do not line up"):
        convert.convert_file(missing, tmp_path / "noids.ckpt", None, 3)
    assert not (tmp_path / "k4.ckpt").exists() and not (tmp_path / "noids.ckpt").exists()
