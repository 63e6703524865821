"""The capture run's routing (fleetjob.CaptureRun), driven event by event so each order of results is
played exactly, not left to the timing of real hosts (test_capture_run.py runs the whole thing over
real sshd hosts; a server killed there at one moment rather than another once left samples pending).

Real: the dataset file and its loader, the run's journal on disk, the routing code, the Run (over an
inventory of local hosts it never contacts). Replaced: the
hosts (each is a stream whose lines the test reads, and events the test plays back as an agent would
send them) and the live progress display (a recorder: it draws nothing here).
"""

from __future__ import annotations

import json

from patchctl.commands.capture import dataset as datasets
from patchctl.commands.capture.journal import Journal
from patchctl.commands.capture.fleetjob import CaptureRun, Item, Lane, Stream
from patchctl.core.console import App
from patchctl.core.options import CaptureOptions
from patchctl.core.session import Run


class Progress:
    noun = "samples"

    def __init__(self):
        self.said = []

    def announce(self, msg):
        self.said.append(msg)

    def sample_done(self, *a, **kw):
        pass

    def sample_failed(self, *a):
        pass


def setup(tmp_path, n, hosts=("a", "b", "c"), max_fail="1", in_flight=1):
    path = tmp_path / "ds.jsonl"
    path.write_text("".join(json.dumps({"id": f"s{i}", "input_ids": [1, 2, 3 + i]}) + "\n" for i in range(n)))
    ds = datasets.load_dataset(path, "patchctl-cap-t-")
    inv = tmp_path / "inventory.toml"  # local hosts: the Run is real, no host is ever contacted
    inv.write_text("".join(f'[hosts.{h}]\nconnection = "local"\nsglang_root = "{tmp_path}"\n' for h in hosts))
    opts = CaptureOptions(in_flight=in_flight, max_fail=max_fail)
    run = Run(App(patches_dir=tmp_path, inventory_path=inv), opts, "capture run")
    cr = CaptureRun(run.app, opts, run, "t", "patchctl-cap-t", ds, Journal(tmp_path), Progress())
    lanes = [Lane(h, {}, stream=Stream()) for h in run.hosts]
    cr.lanes = {l.host.name: l for l in lanes}
    cr.max_fail = 1
    cr.pending.extend(Item(s) for s in ds.samples)
    with cr.lock:
        cr._fill_all()
    return cr, {l.host.name: l for l in lanes}


def sent(lane) -> list[str]:
    """The sample ids written to a host's stream so far (without waiting: only what is queued)."""
    with lane.stream._cv:
        chunks = list(lane.stream._items)
        lane.stream._items.clear()
    return [json.loads(line)["id"] for c in chunks for line in c.decode().splitlines()]


def done(cr, lane, sid):
    cr.on_event(lane, {"event": "sample_done", "id": sid, "path": f"/d/{sid}", "sha256": "0" * 64, "bytes": 1,
                       "tokens": 3})


def test_hosts_stay_open_while_a_sample_is_out_elsewhere_and_take_its_retry(tmp_path):
    cr, L = setup(tmp_path, 6)  # 2 per host (PREFETCH x in-flight 1)
    out = {h: sent(l) for h, l in L.items()}
    assert sorted(sum(out.values(), [])) == [f"s{i}" for i in range(6)]
    for h in ("b", "c"):
        for sid in out[h]:
            done(cr, L[h], sid)
    done(cr, L["a"], out["a"][0])
    # nothing queued, b and c hold nothing: but a still holds one that may come back, so none is closed
    assert not any(l.closed for l in L.values())
    cr.on_event(L["a"], {"event": "sample_failed", "id": out["a"][1], "reason": "NaN in the dump"})
    # the retry avoids the host it failed on
    retried = sent(L["b"]) + sent(L["c"])
    assert retried == [out["a"][1]] and sent(L["a"]) == []
    holder = L["b"] if L["b"].outstanding else L["c"]
    done(cr, holder, out["a"][1])
    assert all(l.closed for l in L.values())  # settled: every stream ends, every agent answers


def test_a_host_that_dies_holding_samples_hands_them_to_hosts_still_open(tmp_path):
    cr, L = setup(tmp_path, 6)
    out = {h: sent(l) for h, l in L.items()}
    for h in ("b", "c"):
        for sid in out[h]:
            done(cr, L[h], sid)
    cr.on_event(L["a"], {"event": "host_stopped", "reason": "the server does not answer"})
    assert L["a"].closed and not L["b"].closed and not L["c"].closed
    # the agent hands back what it held, one by one, as it does when its server is gone
    for sid in out["a"]:
        cr.on_event(L["a"], {"event": "sample_returned", "id": sid, "reason": "the server died"})
    again = sent(L["b"]) + sent(L["c"])
    assert sorted(again) == sorted(out["a"]) and sent(L["a"]) == []
    for h in ("b", "c"):
        for sid in list(L[h].outstanding):
            done(cr, L[h], sid)
    assert all(l.closed for l in L.values())
    recs = [json.loads(x) for x in (tmp_path / "journal.jsonl").read_text().splitlines()]
    assert {r["id"] for r in recs if r["rec"] == "done"} == {f"s{i}" for i in range(6)}
    assert not any(r["rec"] == "done" and r["host"] == "a" and r["id"] in out["a"] for r in recs)


def test_a_retry_goes_back_to_the_host_it_failed_on_when_no_other_is_open(tmp_path):
    cr, L = setup(tmp_path, 4, hosts=("a", "b"))
    out = {h: sent(l) for h, l in L.items()}
    for sid in out["b"]:
        done(cr, L["b"], sid)
    cr.on_event(L["b"], {"event": "host_stopped", "reason": "disk reserve reached"})
    cr.on_event(L["a"], {"event": "sample_failed", "id": out["a"][0], "reason": "NaN in the dump"})
    assert sent(L["a"]) == out["a"][:1]  # its second attempt, on the one host left
    assert cr.lanes["a"].outstanding[out["a"][0]].attempt == 2


def test_a_run_smaller_than_the_window_reaches_every_host(tmp_path):
    """8 samples, 3 hosts, --in-flight 8 (the default): the first host's window (16) would take all of them before
    the others start; each host takes its share of what is left instead (issue 37 item 11)."""
    cr, L = setup(tmp_path, 8, in_flight=8)
    out = {h: sent(l) for h, l in L.items()}
    assert sorted(sum(out.values(), [])) == sorted(f"s{i}" for i in range(8))
    assert sorted(len(v) for v in out.values()) == [2, 3, 3], out
    # a host that finishes early takes what another hands back, up to the window: none is kept idle
    for sid in out["a"]:
        done(cr, L["a"], sid)
    cr.on_event(L["b"], {"event": "host_stopped", "reason": "the server does not answer"})
    for sid in out["b"]:
        cr.on_event(L["b"], {"event": "sample_returned", "id": sid, "reason": "the server died"})
    again = {h: sent(L[h]) for h in ("a", "c")}
    assert sorted(again["a"] + again["c"]) == sorted(out["b"]) and again["a"], again


def test_a_large_run_fills_each_host_to_its_whole_window(tmp_path):
    cr, L = setup(tmp_path, 100, in_flight=4)
    assert [len(sent(L[h])) for h in ("a", "b", "c")] == [8, 8, 8]  # PREFETCH x --in-flight each
