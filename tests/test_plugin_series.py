"""The plugin series (core/plugin.py, host/plugin_site.py) deployed to real sshd hosts.

Real: patchctl's CLI and agent over OpenSSH, the SGLang 0.5.23 tree, the stand-in servers' processes and HTTP,
and SGLang's own plugin loading in them (`sglang/srt/plugins/__init__.py` `load_plugins` and
`hook_registry.py` of the host's tree, run by the stand-in as `run_scheduler_process` runs them:
simserver/plugins.py says what the stand-in replaces). The plugin's capture module is the diff series'
hidden_dump.py, byte for byte.
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
from pathlib import Path

import pytest

from fleet import clean_fleet, started_fleet

PLUGIN = "hidden-dump-plugin"
INIT = "patchctl_hidden_dump/__init__.py"


@pytest.fixture(scope="module")
def fleet1m(tmp_path_factory, sglang_tree):
    f = started_fleet(tmp_path_factory.mktemp("plugin"), 1, sglang_tree, light=True)
    yield f
    f.close()


@pytest.fixture
def fleet1(fleet1m):
    yield from clean_fleet(fleet1m)


def site(h) -> Path:
    return h.state / "plugins" / "site"


def server_env(f, h) -> dict:
    raw = Path(f"/proc/{f.server_pid(h)}/environ").read_bytes().split(b"\0")
    return dict(x.decode().split("=", 1) for x in raw if b"=" in x)


def plugin_variant(patches: Path, name: str, *, edit=None, hooks=None) -> str:
    """A copy of the shipped plugin series under another name: `edit` changes its __init__.py's text, `hooks`
    replaces its [[plugin.hook]] tables ([(target, type)]); the recorded sha256 follows the edit."""
    src, dst = patches / PLUGIN, patches / name
    shutil.copytree(src, dst)
    init = dst / INIT
    if edit:
        init.write_text(edit(init.read_text()))
    toml = (dst / "series.toml").read_text().replace(f'name = "{PLUGIN}"', f'name = "{name}"', 1)
    old_sha = hashlib.sha256((src / INIT).read_bytes()).hexdigest()
    toml = toml.replace(old_sha, hashlib.sha256(init.read_bytes()).hexdigest())
    if hooks is not None:
        head, _, rest = toml.partition("[[plugin.hook]]")
        tail = rest[rest.index("[smoke]"):]
        toml = head + "".join(f'[[plugin.hook]]\ntarget = "{t}"\ntype = "{ty}"\n\n' for t, ty in hooks) + tail
    (dst / "series.toml").write_text(toml)
    return name


def retarget(old: str, new: str):
    return lambda text: text.replace(f'"{old}"', f'"{new}"', 1)


MR = "sglang.srt.model_executor.model_runner.ModelRunner.forward"
FB = "sglang.srt.model_executor.forward_batch_info.ForwardBatch.init_new"


def untouched(f, h, digest, pid):
    """Nothing changed: the tree, no manifest, no plugin site, the same server process."""
    assert f.digest(h) == digest, "SGLang's tree changed"
    assert not (h.state / "plugins").exists()
    _, st = f.json("status")
    assert st[0]["series"] is None and st[0]["state"] == "clean" and st[0]["lock"] is None
    assert f.server_pid(h) == pid and f.healthy(h)


def test_plugin_series_deploys_with_sglang_byte_identical_and_rolls_back_byte_for_byte(fleet1):
    from patchctl.core.series import load_series

    f, h = fleet1, fleet1.hosts[0]
    digest = f.digest(h)
    p = f.patchctl("apply", PLUGIN)
    assert p.returncode == 0, p.stdout + p.stderr
    assert re.search(r"smoke passed: 4 prompts", p.stdout + p.stderr), p.stdout + p.stderr
    assert f.digest(h) == digest, "a plugin series must leave SGLang's tree byte-identical"
    series = load_series(f.patches, PLUGIN)
    want = series.plugin.site_files(series.version)
    got = {str(x.relative_to(site(h))): x.read_bytes() for x in site(h).rglob("*") if x.is_file()}
    assert got == want
    # the capture module is the diff series' own, byte for byte
    assert (site(h) / "patchctl_hidden_dump/hidden_dump.py").read_bytes() == \
        next(fl.data for fl in series.plugin.files if fl.path.endswith("hidden_dump.py"))
    env = server_env(f, h)
    assert env["PYTHONPATH"].split(":")[0] == str(site(h)), env.get("PYTHONPATH")
    log = (h.dir / "server.log").read_text()
    assert "Loaded plugin patchctl_hidden_dump from group sglang.srt.plugins" in log
    assert re.search(r"Applied 1 hook\(s\) to sglang\.srt\.model_executor\.model_runner\.ModelRunner\.forward", log)
    _, st = f.json("status")
    assert st[0]["series"] == PLUGIN and st[0]["state"] == "verified" and not st[0]["drift"], st
    # a changed site file is drift, as a changed tree file is
    hd = site(h) / "patchctl_hidden_dump/hidden_dump.py"
    saved = hd.read_bytes()
    hd.write_bytes(saved + b"# edited by hand\n")
    _, st = f.json("status", expect=None)
    assert [d["path"] for d in st[0]["drift"]] == ["patchctl-plugin-site/patchctl_hidden_dump/hidden_dump.py"], st
    hd.write_bytes(saved)
    # the server's Python writes __pycache__ next to the modules; rollback removes what patchctl made, all of it
    (hd.parent / "__pycache__").mkdir(exist_ok=True)
    (hd.parent / "__pycache__" / "hidden_dump.cpython-311.pyc").write_bytes(b"compiled")
    p = f.patchctl("rollback")
    assert p.returncode == 0, p.stdout + p.stderr
    assert not (h.state / "plugins").exists()
    assert f.digest(h) == digest and f.healthy(h)
    assert "PYTHONPATH" not in server_env(f, h) or str(site(h)) not in server_env(f, h)["PYTHONPATH"]
    assert "--enable-return-aux-hidden-states" not in f.server_argv(h)


def test_sglang_plugins_leaving_the_plugin_out_is_refused_before_any_change(fleet1):
    f, h = fleet1, fleet1.hosts[0]
    digest, pid = f.digest(h), f.server_pid(h)
    f.write_inventory(server={"env": {"SGLANG_PLUGINS": "someone_elses_plugin"}, "public_env": ["SGLANG_PLUGINS"]})
    p = f.patchctl("plan", PLUGIN)  # plan names it, as apply refuses it
    assert re.search(r"blocked\s+.*leaves out the plugin patchctl_hidden_dump", p.stdout), p.stdout + p.stderr
    p = f.patchctl("apply", PLUGIN)
    assert p.returncode == 2, p.stdout + p.stderr
    out = p.stdout + p.stderr
    assert "SGLANG_PLUGINS=someone_elses_plugin" in out and "leaves out the plugin patchctl_hidden_dump" in out, out
    assert "sglang/srt/plugins/__init__.py:69" in out
    untouched(f, h, digest, pid)
    # listed, it is kept and the deploy goes ahead
    f.write_inventory(server={"env": {"SGLANG_PLUGINS": "someone_elses_plugin,patchctl_hidden_dump"}})
    p = f.patchctl("apply", PLUGIN)
    assert p.returncode == 0, p.stdout + p.stderr
    assert server_env(f, h)["SGLANG_PLUGINS"] == "someone_elses_plugin,patchctl_hidden_dump"


def test_a_server_python_that_ignores_pythonpath_is_refused_before_any_change(fleet1):
    from fleet import SERVER_COMMAND

    f, h = fleet1, fleet1.hosts[0]
    digest, pid = f.digest(h), f.server_pid(h)
    assert SERVER_COMMAND.startswith("{python} -m ")
    f.write_inventory(server={"command": SERVER_COMMAND.replace("{python} -m ", "{python} -E -m ", 1)})
    p = f.patchctl("apply", PLUGIN)
    assert p.returncode == 2, p.stdout + p.stderr
    out = p.stdout + p.stderr
    assert "does not see the plugin patchctl_hidden_dump" in out and "ignores PYTHONPATH (-E)" in out, out
    untouched(f, h, digest, pid)


def test_a_plugin_that_cannot_be_imported_is_refused_before_any_change(fleet1):
    f, h = fleet1, fleet1.hosts[0]
    name = plugin_variant(f.patches, "plugin-import-error",
                          edit=lambda t: t.replace("from . import hidden_dump\n",
                                                   "from . import hidden_dump\nimport patchctl_no_such_module\n", 1))
    digest, pid = f.digest(h), f.server_pid(h)
    p = f.patchctl("apply", name)
    assert p.returncode == 2, p.stdout + p.stderr
    out = p.stdout + p.stderr
    assert "cannot import the plugin patchctl_hidden_dump" in out and "No module named 'patchctl_no_such_module'" in out
    assert "sglang/srt/plugins/__init__.py:84" in out
    untouched(f, h, digest, pid)


@pytest.mark.parametrize("case,target", [
    ("missing-target", MR.replace(".forward", ".forwardd")),
    ("under-cuda-graph", "sglang.srt.models.llama.LlamaModel.forward"),
])
def test_a_hook_that_never_fires_is_rolled_back_by_the_smoke_verified(fleet1, case, target):
    """Past the trace (--skip-trace): SGLang applies what it can, logs the rest, and serves without a capture;
    the smoke finds no dump and the rollback is verified (tree, site, server)."""
    f, h = fleet1, fleet1.hosts[0]
    name = plugin_variant(f.patches, f"plugin-{case}", edit=retarget(MR, target), hooks=[(target, "around"), (FB, "after")])
    digest = f.digest(h)
    p = f.patchctl("apply", name, "--skip-trace")
    assert p.returncode == 1, p.stdout + p.stderr
    out = p.stdout + p.stderr
    assert "rolled back (verified)" in out and "no dump file" in out, out
    assert f"Failed to apply hooks to {target}" in (h.dir / "server.log").read_text()
    assert f.digest(h) == digest and not (h.state / "plugins").exists() and f.healthy(h)
    _, st = f.json("status")
    assert st[0]["series"] is None and st[0]["state"] == "clean"
    _, hist = f.json("history")
    rb = [e for e in hist[0]["history"] if e["op"] == "rollback" and (e.get("from") or {}).get("series") == name]
    assert len(rb) == 1 and "no dump file" in rb[0]["reason"], json.dumps(hist)[:2000]


def test_switching_between_the_plugin_and_the_diff_series_and_back_is_exact(fleet1):
    """The diff series over the plugin series removes the site and patches the tree; a rollback brings the plugin
    back (files from the journal's blobs, byte for byte) and the tree back to pristine."""
    f, h = fleet1, fleet1.hosts[0]
    digest = f.digest(h)
    assert f.patchctl("apply", PLUGIN).returncode == 0
    site_files = {str(x.relative_to(site(h))): x.read_bytes() for x in site(h).rglob("*") if x.is_file()}
    p = f.patchctl("apply", "hidden-dump")
    assert p.returncode == 0, p.stdout + p.stderr
    assert not (h.state / "plugins").exists() and f.digest(h) != digest
    assert "PYTHONPATH" not in server_env(f, h) or str(site(h)) not in server_env(f, h)["PYTHONPATH"]
    p = f.patchctl("rollback")
    assert p.returncode == 0, p.stdout + p.stderr
    assert f.digest(h) == digest
    assert {str(x.relative_to(site(h))): x.read_bytes() for x in site(h).rglob("*") if x.is_file()} == site_files
    _, st = f.json("status")
    assert st[0]["series"] == PLUGIN and st[0]["state"] == "verified" and not st[0]["drift"], st
    assert server_env(f, h)["PYTHONPATH"].split(":")[0] == str(site(h))


@pytest.mark.parametrize("case,target,exit_code,needle", [
    ("missing-target", MR.replace(".forward", ".forwardd"), 2, "closest: forward"),
    ("under-cuda-graph", "sglang.srt.models.llama.LlamaModel.forward", 2, "--disable-prefill-cuda-graph"),
])
def test_a_hook_that_would_never_fire_is_refused_by_the_trace_before_any_change(fleet1, case, target, exit_code,
                                                                                 needle):
    """apply's reachability preflight (core/trace/plugin.py) on the host's own SGLang tree: a target that does not
    resolve, or that runs inside the prefill CUDA graph, refuses the run before any host step."""
    f, h = fleet1, fleet1.hosts[0]
    name = plugin_variant(f.patches, f"trace-{case}", edit=retarget(MR, target), hooks=[(target, "around"), (FB, "after")])
    digest, pid = f.digest(h), f.server_pid(h)
    p = f.patchctl("--json", "apply", name)
    assert p.returncode == exit_code, p.stdout + p.stderr
    ev = [json.loads(line) for line in p.stdout.splitlines()]
    assert not [e for e in ev if e["event"] == "step_start"], "no host step may start"
    assert needle in p.stdout + p.stderr, p.stdout + p.stderr
    untouched(f, h, digest, pid)


def test_plan_names_the_processes_that_load_plugins(fleet1):
    p = fleet1.patchctl("plan", PLUGIN)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "run_scheduler_process" in p.stdout + p.stderr, p.stdout + p.stderr
