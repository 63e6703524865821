"""Real containers for tests: a real dockerd (started by .ci/run), images made here from Debian packages.

No registry is reachable, so the base image is a debootstrapped bookworm with python3
(tests/docker-base-image.sh, which .ci/run runs once per machine; a fixture runs it too when the image is
missing). On it, `patchctl-test-sglang:0.5.23` lays the pristine 0.5.23 tree where the project's own images
keep theirs (`/sgl-workspace/sglang/python`, found by the container's Python through a .pth, as their
editable install is). The stand-in server and its packages reach a container by read-only bind mounts of
the repository and the test venv's site-packages: nothing is pulled, nothing of the host is copied in.

Every container a test makes carries LABEL (patchctl's own containers copy their origin's labels, so they
carry it too); `remove_test_containers` removes them all, and the session fixture checks none is left.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import subprocess
import sys
import sysconfig
import tarfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
BASE_IMAGE = os.environ.get("PATCHCTL_TEST_BASE_IMAGE", "patchctl-test-base:bookworm")
SGLANG_IMAGE = "patchctl-test-sglang:0.5.23"
NOPYTHON_IMAGE = "patchctl-test-nopython:bookworm"
IN_ROOT = "/sgl-workspace/sglang/python"  # where lmsysorg/sglang images keep the tree (an editable install)
LABEL = "io.patchctl.test"
SITE = sysconfig.get_paths()["purelib"]


def docker(*args: str, check: bool = True, input: bytes | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    p = subprocess.run(["docker", *args], input=input, capture_output=True, timeout=timeout)
    if check and p.returncode != 0:
        raise AssertionError(f"docker {' '.join(args)}: exit {p.returncode}: {p.stderr.decode(errors='replace')}")
    return p


def image_exists(ref: str) -> bool:
    return docker("image", "inspect", ref, check=False).returncode == 0


def ensure_images(sglang_tree: Path) -> None:
    """The base image (built here if .ci/run did not), the SGLang image on it, an image without Python."""
    if not image_exists(BASE_IMAGE):
        subprocess.run(["bash", str(REPO / "tests" / "docker-base-image.sh"), BASE_IMAGE], check=True, timeout=900)
    want = hashlib.sha256(str(sglang_tree).encode() + BASE_IMAGE.encode()).hexdigest()[:12]
    have = docker("image", "inspect", "-f", "{{ index .Config.Labels \"io.patchctl.test.src\" }}", SGLANG_IMAGE,
                  check=False).stdout.decode().strip()
    if have != want:
        _commit(SGLANG_IMAGE, _tree_tar(sglang_tree), f"LABEL io.patchctl.test.src={want}")
    if not image_exists(NOPYTHON_IMAGE):
        cid = docker("create", BASE_IMAGE, "true").stdout.decode().strip()
        try:
            docker("commit", "--change", 'CMD ["sleep", "infinity"]', cid, "patchctl-test-tmp:1")
        finally:
            docker("rm", "-f", cid)
        run = docker("run", "--name", "patchctl-nopython-build", "patchctl-test-tmp:1", "sh", "-c",
                     "rm -f /usr/bin/python3*", check=False)
        try:
            assert run.returncode == 0, run.stderr
            docker("commit", "--change", 'CMD ["sleep", "infinity"]', "patchctl-nopython-build", NOPYTHON_IMAGE)
        finally:
            docker("rm", "-f", "patchctl-nopython-build", check=False)
            docker("rmi", "patchctl-test-tmp:1", check=False)


def _tree_tar(sglang_tree: Path) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        tar.add(sglang_tree / "sglang", arcname=IN_ROOT.lstrip("/") + "/sglang")
        pth = f"{IN_ROOT}\n".encode()
        info = tarfile.TarInfo("usr/local/lib/python3.11/dist-packages/sglang-editable.pth")
        info.size = len(pth)
        info.mode = 0o644
        tar.addfile(info, io.BytesIO(pth))
    return buf.getvalue()


def _commit(image: str, tar: bytes, change: str) -> None:
    cid = docker("create", BASE_IMAGE, "true").stdout.decode().strip()
    try:
        docker("cp", "-", f"{cid}:/", input=tar)
        docker("commit", "--change", change, "--change", 'CMD ["python3"]', cid, image)
    finally:
        docker("rm", "-f", cid)


def server_args(model: Path, port: int, host: str = "127.0.0.1") -> list[str]:
    return ["python3", "-m", "patchctl.simserver", "--model-path", str(model), "--sglang-root", IN_ROOT,
            "--host", host, "--port", str(port)]


def code_volumes() -> list[str]:
    """The repository and the test venv's site-packages, read-only (the venv is outside a git worktree's root)."""
    out = [f"{REPO}:{REPO}:ro"]
    if not Path(SITE).resolve().is_relative_to(REPO):
        out.append(f"{SITE}:{SITE}:ro")
    return out


def run_server_container(name: str, model: Path, port: int, *, image: str = SGLANG_IMAGE, restart: str = "no",
                         env: dict | None = None, start: bool = True, cmd: list[str] | None = None) -> str:
    """The operator's container: the stand-in as `docker run ... lmsysorg/sglang python3 -m sglang.launch_server`
    would run SGLang (host network, IPC, shm, a restart policy, the model mounted read-only)."""
    args = ["run" if start else "create"] + (["-d"] if start else []) + [
        "--name", name, "--label", f"{LABEL}=1", "--network", "host", "--ipc", "host", "--shm-size", "64m",
        "--restart", restart, "--ulimit", "nofile=4096:8192",
        *[w for v in code_volumes() for w in ("-v", v)], "-v", f"{model}:{model}:ro",
        "-e", f"PYTHONPATH={REPO}:{SITE}", "-e", "OPERATOR_SETTING=kept"]
    for k, v in (env or {}).items():
        args += ["-e", f"{k}={v}"]
    return docker(*args, image, *(cmd if cmd is not None else server_args(model, port))).stdout.decode().strip()


def inspect(ref: str) -> dict | None:
    p = docker("inspect", ref, check=False)
    return json.loads(p.stdout)[0] if p.returncode == 0 else None


def config_of(doc: dict) -> dict:
    """What "the same container" means: id, name, image id, Config, HostConfig (state and run-time counters aside)."""
    out = {k: doc[k] for k in ("Id", "Name", "Image", "Config", "HostConfig")}
    out["Mounts"] = sorted(doc.get("Mounts") or [], key=lambda m: m["Destination"])  # inspect's order varies
    return out


def differences(a, b, path: str = "") -> list[str]:
    """Where two inspect documents differ, as key paths (for a failing assertion's message)."""
    if isinstance(a, dict) and isinstance(b, dict):
        return [d for k in sorted(set(a) | set(b)) for d in differences(a.get(k), b.get(k), f"{path}.{k}")]
    return [] if a == b else [f"{path}: {a!r} -> {b!r}"[:300]]


def fs_digest(ref: str) -> str:
    """The container's SGLang tree and its writable layer's changes, read from the container itself (stopped or not)."""
    h = hashlib.sha256()
    p = subprocess.run(["docker", "cp", f"{ref}:{IN_ROOT}/sglang", "-"], capture_output=True, timeout=300)
    assert p.returncode == 0, p.stderr
    with tarfile.open(fileobj=io.BytesIO(p.stdout)) as tar:
        for m in sorted(tar.getmembers(), key=lambda m: m.name):
            h.update(f"{m.name}\0{m.mode}\0{m.uid}\0{m.gid}\0{m.type}\0{m.linkname}\0".encode())
            if m.isfile():
                h.update(tar.extractfile(m).read())
    h.update(b"\n".join(sorted(docker("diff", ref).stdout.splitlines())))
    return h.hexdigest()


def file_in(ref: str, path: str) -> bytes | None:
    p = subprocess.run(["docker", "cp", f"{ref}:{path}", "-"], capture_output=True, timeout=60)
    if p.returncode != 0:
        return None
    with tarfile.open(fileobj=io.BytesIO(p.stdout)) as tar:
        m = tar.getmembers()[0]
        return tar.extractfile(m).read() if m.isfile() else None


def remove_test_containers() -> list[str]:
    ids = docker("ps", "-aq", "--filter", f"label={LABEL}").stdout.decode().split()
    if ids:
        docker("rm", "-f", *ids)
    return ids


def containers_named(prefix: str) -> list[str]:
    out = docker("ps", "-a", "--format", "{{.Names}}", "--filter", f"name={prefix}").stdout.decode().split()
    return sorted(n for n in out if n.startswith(prefix))


if __name__ == "__main__":  # .ci/run: `python tests/docker_util.py` builds the images once, before the suite
    from patchctl.core.release import fetch_release

    ensure_images(fetch_release("0.5.23"))
    print("images ready", file=sys.stderr)
