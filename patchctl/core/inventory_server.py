"""The inventory's server tables ([defaults.server], [hosts.X.server]): `ServerConfig`, what the host's agent is
told of it (`to_spec`), and each key's reader, every error with its file:line (`inventory._Loader`)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from patchctl.host.capture_rules import CONVENTIONS
from patchctl.host.docker_run import check_run
from patchctl.host.drafter import check_speculative
from patchctl.host.protocol import ServerSpec

MANAGERS = ("process", "systemd", "docker", "podman")


@dataclass
class ServerConfig:
    """How the host's SGLang server is run. `command` may use {python} {port} {host} {state_dir} {sglang_root}."""

    manager: str = "process"
    command: str = ""  # empty: no server configured (restart/smoke steps refuse)
    host: str = "127.0.0.1"
    port: int = 30000
    env: dict[str, str] = field(default_factory=dict)
    # env names whose values may be shown in logs and output; every other env value is masked
    public_env: list[str] = field(default_factory=list)
    log: str = "~/sglang-server.log"
    start_timeout: float = 1800.0
    stop_timeout: float = 60.0
    unit: str | None = None
    capture_layers: list[int] | None = None
    # the capture convention (SGLang's --speculative-algorithm with --enable-return-aux-hidden-states): which
    # model method picks the captured layers, by that family's rule (host/capture_rules.py); eagle3 by default
    capture_convention: str = "eagle3"
    layer_outputs: list[int] | None = None
    hidden_size: int | None = None
    # [server.speculative]: algorithm, num_steps, eagle_topk, num_draft_tokens, args (host/drafter.py fills defaults)
    speculative: dict | None = None
    container: str | None = None  # docker|podman: the container that serves SGLang (host/docker.py)
    socket: str | None = None  # docker|podman: the engine's API socket; None: /var/run/docker.sock or podman's
    image: str | None = None  # docker|podman: the image patchctl creates the container from (host/docker_run.py)
    run: dict | None = None  # with image: [server.run], the `docker run` options (docker_run.check_run)

    def to_spec(self) -> ServerSpec:
        """What the host's agent is told of this server (every request carries it)."""
        return ServerSpec(manager=self.manager, command=self.command, host=self.host, port=self.port, env=dict(self.env),
                          log=self.log, start_timeout=self.start_timeout, stop_timeout=self.stop_timeout,
                          unit=self.unit, layer_outputs=self.layer_outputs, speculative=self.speculative,
                          container=self.container, socket=self.socket, image=self.image, run=self.run,
                          capture_convention=None if self.capture_convention == "eagle3" else self.capture_convention)


def read_server(L, dserver: dict, hserver: dict, hp: tuple[str, ...]) -> ServerConfig:
    def pick(key):
        if key in hserver:
            return hserver[key], hp + (key,)
        if key in dserver:
            return dserver[key], ("defaults", "server", key)
        return None, None

    s = ServerConfig()
    for key, read in _SERVER_FIELDS:
        v, p = pick(key)
        if p:
            setattr(s, key, read(L, v, p))
    if s.manager == "systemd" and not s.unit:
        _, p = pick("manager")
        L.fail(hp + ("unit",), "manager = \"systemd\" needs unit = \"<name>.service\"",
               line_of=hp if hserver else p)
    if s.capture_convention != "eagle3" and not s.capture_layers:
        v, p = pick("capture_convention")
        L.fail(p, f"capture_convention = \"{s.capture_convention}\" needs capture_layers = [...]: SGLang 0.5.23 "
               f"requires --return-aux-hidden-state-layer-ids with {s.capture_convention.upper()} "
               "(sglang/srt/arg_groups/validation_hook.py:729-734)")
    _image_form(L, s, pick)
    if s.manager in ("docker", "podman") and not s.container:
        _, p = pick("manager")
        L.fail(hp + ("container",), f"manager = \"{s.manager}\" needs container = \"<name>\" (the container that "
               "serves SGLang, as `docker ps` names it) or image = \"NAME:TAG\" (patchctl creates it)",
               line_of=hp if hserver else p)
    return s


def _image_form(L, s: ServerConfig, pick) -> None:
    """image = "NAME:TAG" and [server.run]: the container patchctl creates (named container, default "sglang")."""
    for key in ("image", "run"):
        v, p = pick(key)
        if p and s.manager not in ("docker", "podman"):
            L.fail(p, f"{key} is for manager = \"docker\" or \"podman\" (this server's manager is {s.manager!r})")
    if s.run is not None and not s.image:
        L.fail(pick("run")[1], "needs image = \"NAME:TAG\" (the run options of the container patchctl creates)")
    if not s.image:
        return
    s.container = s.container or "sglang"
    s.run = s.run or {"network": "host"}
    for word in ("{python}", "{sglang_root}"):
        if word in s.command:
            L.fail(pick("command")[1], f"{word} is the host's; in the container's command write its own "
                   "(python3, the directory in the image)")


_IMAGE = re.compile(r"^(?:[A-Za-z0-9.-]+(?::[0-9]+)?/)?[a-z0-9]+(?:[._-]+[a-z0-9]+)*(?:/[a-z0-9]+(?:[._-]+[a-z0-9]+)*)*"
                    r"(?::[A-Za-z0-9_][A-Za-z0-9_.-]{0,127})?(?:@sha256:[0-9a-f]{64})?$")


def _image_ref(L, v, p) -> str:
    ref = L.want_str(v, p)
    if not _IMAGE.match(ref):
        L.fail(p, f"{ref!r} is not an image reference (NAME:TAG, e.g. lmsysorg/sglang:v0.5.3-cu126)")
    if "@" not in ref and ":" not in ref.rsplit("/", 1)[-1]:
        L.fail(p, f"{ref!r} names no tag: give NAME:TAG (or NAME@sha256:...); an implied :latest moves")
    return ref


def _run_options(L, v, p) -> dict:
    """[server.run]: the `docker run` options, each checked (docker_run.check_run), network default "host"."""
    settings, problems = check_run(L.want_table(v, p))
    for key, msg in problems:
        L.fail(p + (key,), msg, line_of=p + (key,) if key in v else p)
    return settings


_CONTAINER_NAME = re.compile(r"^[a-zA-Z0-9][a-zA-Z0-9_.-]*$")  # what docker and podman accept as a name


def _container_name(L, v, p) -> str:
    name = L.want_str(v, p, nonempty=True)
    if not _CONTAINER_NAME.match(name) or name.endswith(".patchctl-parked"):
        L.fail(p, f"{name!r} is not a container name (letters, digits, '_', '.', '-'; first a letter or digit)")
    return name


def _env_names(L, names, p) -> None:
    for k in names:
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", k):
            L.fail(p, f"{k!r} is not an environment variable name")


def _server_env(L, v, p) -> dict:
    if not isinstance(v, dict) or not all(isinstance(x, str) for x in v.values()):
        L.fail(p, "expected a table of strings, e.g. env = { CUDA_VISIBLE_DEVICES = \"0,1\" }")
    _env_names(L, v, p)
    return dict(v)


def _public_env(L, v, p) -> list:
    names = L.want_names(v, p)
    _env_names(L, names, p)
    return list(names)


def _layer_ids(L, v, p) -> list:
    if not isinstance(v, list) or not v or not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in v):
        L.fail(p, "expected a non-empty list of layer ids (integers >= 0)")
    elif any(a >= b for a, b in zip(v, v[1:])):
        L.fail(p, f"expected layer ids in increasing order, each once, got {v}: SGLang's models concatenate the "
                  "captured states in layer order, so the files' layer labels would not say which slice is which")
    return list(v)


def _speculative(L, v, p) -> dict:
    """[server.speculative], checked against what SGLang 0.5.23 accepts; defaults filled in."""
    settings, problems = check_speculative(L.want_table(v, p))
    for key, msg in problems:
        L.fail(p + (key,), msg, line_of=p + (key,) if key in v else p)
    return settings


def _positive(L, v, p) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
        L.fail(p, f"expected a positive integer, got {v!r}")
    return v


# [server] keys in the order they are checked, each with its reader (value, key path) -> the ServerConfig field
_SERVER_FIELDS = (
    ("manager", lambda L, v, p: L.want_choice(v, p, MANAGERS)),
    ("command", lambda L, v, p: L.want_str(v, p, nonempty=False)),
    ("host", lambda L, v, p: L.want_str(v, p, nonempty=True)),
    ("log", lambda L, v, p: L.want_str(v, p, nonempty=True)),
    ("port", lambda L, v, p: L.want_port(v, p)),
    ("start_timeout", lambda L, v, p: L.want_seconds(v, p)),
    ("stop_timeout", lambda L, v, p: L.want_seconds(v, p)),
    ("env", _server_env),
    ("public_env", _public_env),
    ("unit", lambda L, v, p: L.want_str(v, p)),
    ("container", lambda L, v, p: _container_name(L, v, p)),
    ("socket", lambda L, v, p: L.want_str(v, p, nonempty=True)),
    ("capture_layers", _layer_ids),
    ("capture_convention", lambda L, v, p: L.want_choice(v, p, CONVENTIONS)),
    ("layer_outputs", _layer_ids),
    ("hidden_size", _positive),
    ("speculative", _speculative),
    ("image", _image_ref),
    ("run", _run_options),
)
