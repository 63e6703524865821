"""SGLang in a container: the Docker Engine API (or Podman's Docker-compatible one) over the daemon's unix
socket, the container the operator runs (the *origin*), and the container patchctl runs in its place.

How a deploy stays undoable exactly (docs/design.md "SGLang in containers"):
- The origin is never changed on disk. patchctl copies its `sglang/` package out once (the Engine API's
  archive endpoint) to `<state_dir>/containers/<name>/tree/sglang`: the tree every series is applied to,
  with the usual journal, backups and manifest, on the host, where no recreated container can take them.
- A series' flags and env, a drafter's flags, a patched tree: only a new container can carry them. patchctl
  creates it with the origin's own Config and HostConfig as `docker inspect` reports them (same image id,
  GPUs, IPC, shm, ports, volumes, restart policy) plus the changed command and env and three bind mounts:
  the patched package read-only over the origin's, the capture's dump directory and the draft store
  (read-only), each at the same path as on the host. It takes the origin's name; the origin is stopped,
  renamed `<name>.patchctl-parked` and its restart policy set to "no" while parked (so a reboot starts only
  what serves), all recorded in `containers/<name>/origin.json`.
- Back to the state before the first deploy is the origin itself: patchctl's container removed, the origin
  renamed back, its restart policy restored, started. Same container id, same image, same config, same bytes.
- `docker restart` of patchctl's container keeps its mounts: still deployed. A container recreated by hand
  (`docker rm` + `docker run` from the image) is neither patchctl's nor the origin: `status` says so.

Standard library only, Python 3.8 syntax.
"""

import hashlib
import json
import os
import shutil
import tarfile
import tempfile

from . import plugin_site
from .docker_run import Temporary, check_made, create_origin, would_be
from .engine import Engine, EngineError, _q
from .events import AgentError, event
from .osutil import now, read_json, write_json
from .records import launch_config

MANAGERS = ("docker", "podman")
LABEL = "io.patchctl.managed"
LABEL_ORIGIN = "io.patchctl.origin"
LABEL_CONFIG = "io.patchctl.config"
PARKED = ".patchctl-parked"
# the tail of the in-container find_spec: the directory that contains sglang/ (see tree.locate_tree)
FIND_TREE = ("import importlib.util,os,sys\n"
             "s=importlib.util.find_spec('sglang')\n"
             "p=(os.path.dirname(s.origin) if s and s.origin and s.origin not in ('namespace','built-in') else "
             "(list(s.submodule_search_locations)[0] if s and s.submodule_search_locations else None))\n"
             "print(os.path.dirname(os.path.realpath(p)) if p else '')\n")


def is_container_manager(manager):
    return manager in MANAGERS


def argv_of(doc):
    """The server's whole command line in a container: entrypoint, then command."""
    c = doc.get("Config") or {}
    return list(c.get("Entrypoint") or []) + list(c.get("Cmd") or [])


def env_of(doc):
    out = {}
    for item in (doc.get("Config") or {}).get("Env") or []:
        k, _, v = item.partition("=")
        out[k] = v
    return out


class Containers(object):
    """What patchctl knows of one host's container: the engine, the inventory's name, `containers/<name>/`."""

    def __init__(self, state_dir, srv, made=None, setting=None):
        self.made = made if made is not None else srv.get("made")  # the image form (host/docker_run.py)
        self.setting = setting or srv.get("sglang_root") or "auto"
        self.name = srv.get("container")
        if not self.name:
            raise AgentError("bad_input", "manager = %r needs container = \"<name>\" in [server]" % srv.get("manager"))
        self.engine = Engine(srv.get("manager") or "docker", srv.get("socket"))
        self.state_dir = state_dir
        self.dir = os.path.join(state_dir, "containers", self.name)
        self.origin_path = os.path.join(self.dir, "origin.json")
        self.tree_root = os.path.join(self.dir, "tree")

    # the origin ---------------------------------------------------------
    def serving(self):
        """What serves under the name now, for the history: name, id, image id, and whose it is."""
        try:
            doc = self.named()
        except AgentError:
            return None
        if doc is None:
            return {"name": self.name, "serving": "missing"}
        return {"name": self.name, "id": doc["Id"], "image": doc.get("Image"), "serving": {
            "ours": "patchctl", "origin": "origin", "foreign": "foreign"}[self.kind_of(doc)],
            "running": bool((doc.get("State") or {}).get("Running"))}

    def origin(self):
        """origin.json: the operator's container as first seen (inspect document, restart policy, tree path)."""
        return read_json(self.origin_path)

    def named(self):
        return self.engine.inspect(self.name)

    def origin_doc(self, create=False):
        """The origin's inspect document now (found by id wherever it is parked), else the recorded one. In the
        image form, a container not yet made is made (`create`) or described as it would be."""
        rec = self.origin()
        if rec:
            doc = self.engine.inspect(rec["id"]) or rec["inspect"]
            if self.made:
                check_made(self, doc)
            return doc
        doc = self.named()
        if doc is None and self.made:
            return create_origin(self) if create else would_be(self)
        if doc is None:
            raise AgentError("bad_input", "no container named %r on this host (%s ps -a lists them); set [server] "
                             "container to the one that serves SGLang" % (self.name, self.engine.manager))
        if ((doc.get("Config") or {}).get("Labels") or {}).get(LABEL):
            raise AgentError("attention", "container %r was made by patchctl, but this host has no record of the "
                             "container it replaced (%s is missing)" % (self.name, self.origin_path))
        if self.made:
            check_made(self, doc)
        return doc

    def kind_of(self, doc):
        """'ours' (made by this patchctl state), 'origin', or 'foreign' (neither: recreated by hand?)."""
        if doc is None:
            return None
        rec = self.origin()
        labels = (doc.get("Config") or {}).get("Labels") or {}
        if rec and doc["Id"] == rec["id"]:
            return "origin"
        ours = read_json(self.server_path()) or {}
        if labels.get(LABEL) and ours.get("container_id") == doc["Id"]:
            return "ours"
        if not rec and not labels.get(LABEL):
            return "origin"  # the first look at the operator's container
        return "foreign"

    def server_path(self):
        return os.path.join(self.dir, "server.json")

    def record_origin(self, doc, pkg_dir, made=None):
        if self.origin():
            return
        if not os.path.isdir(self.dir):
            os.makedirs(self.dir, 0o700)
        write_json(self.origin_path, {"id": doc["Id"], "name": self.name, "image": doc.get("Image"),
                                      "restart": (doc.get("HostConfig") or {}).get("RestartPolicy") or {"Name": "no"},
                                      "sglang_root": pkg_dir, "inspect": doc, "seen_at": now(), "made": made})

    # the tree -----------------------------------------------------------
    def container_root(self, doc, setting):
        """The directory inside the container that contains sglang/: the inventory's, or its own Python's answer."""
        if setting and setting != "auto":
            return setting.rstrip("/") or "/"
        rec = self.origin()
        if rec and rec.get("sglang_root"):
            return rec["sglang_root"]
        py = container_python(doc)
        if not (doc.get("State") or {}).get("Running") and self.made:  # not made yet, or never started
            code, out, err = Temporary(self, doc, [py, "-c", FIND_TREE]).run()
        elif not (doc.get("State") or {}).get("Running"):
            raise AgentError("bad_input", "container %r is not running (%s): patchctl finds SGLang through the "
                             "container's own Python; start it (%s start %s) or set sglang_root to the directory "
                             "inside the container that contains sglang/" % (
                                 self.name, (doc.get("State") or {}).get("Status"), self.engine.manager, self.name))
        else:
            code, out, err = self.engine.exec(doc["Id"], [py, "-c", FIND_TREE])
        if code != 0:
            why = (err or out).strip().splitlines()[-1:] or ["exit %s" % code]
            raise AgentError("bad_input", "container %r: cannot run %s in it to find SGLang (%s). The image %s needs "
                             "the Python that runs the server; or set sglang_root" % (
                                 self.name, py, why[0][:200], (doc.get("Config") or {}).get("Image")))
        root = out.strip()
        if not root:
            raise AgentError("bad_input", "container %r: sglang is not installed for %s in it" % (self.name, py))
        return root

    def tree(self, setting, read_only):
        """The host directory that contains the sglang/ every series is applied to. Made once, from the origin,
        as patchctl's own file; a read-only look at a host not yet deployed gets a temporary copy instead."""
        if os.path.isdir(os.path.join(self.tree_root, "sglang")):
            if not self._replaced():
                return self.tree_root
            if not read_only:  # patchctl's own clean copy of a container that is gone: learnt anew
                shutil.rmtree(self.tree_root)
                os.unlink(self.origin_path)
                event("container_tree", container=self.name, copied="(the container it came from is gone)")
        made = not read_only
        doc = self.origin_doc(made) if not self._replaced() else self.named() or self.origin_doc(made)
        root = self.container_root(doc, setting)
        if read_only:
            pid = (doc.get("State") or {}).get("Pid")
            seen = "/proc/%d/root%s" % (pid, root) if pid else None
            if seen and os.access(os.path.join(seen, "sglang"), os.R_OK | os.X_OK):
                return seen  # the running container's own files, read where they are (root may: no copy)
            tmp = tempfile.mkdtemp(prefix="patchctl-look-")
            import atexit

            atexit.register(shutil.rmtree, tmp, True)
            if doc.get("Id") is None:  # the image form, not made yet: a look through a container removed at once
                with Temporary(self, doc) as cid:
                    self._extract(cid, root, tmp)
            else:
                self._extract(doc["Id"], root, tmp)
            return tmp
        self.record_origin(doc, root)
        work = self.tree_root + ".partial"
        shutil.rmtree(work, ignore_errors=True)  # patchctl's own half copy from a cut run
        os.makedirs(work, 0o700)
        self._extract(doc["Id"], root, work)
        os.rename(work, self.tree_root)
        event("container_tree", container=self.name, copied=root)
        return self.tree_root

    def _replaced(self):
        """The operator's container patchctl copied the tree from is gone (replaced, say by a newer image),
        no series is applied to the copy and nothing of patchctl's serves: the copy is stale, not state."""
        rec = self.origin()
        if not rec or self.engine.inspect(rec["id"]) is not None:
            return False
        from .state import TreeState

        if TreeState(self.state_dir, self.tree_root, create=False).manifest():
            return False
        named = self.named()
        return named is None or self.kind_of(named) == "foreign"

    def _extract(self, cid, root, dest):
        path = root.rstrip("/") + "/sglang"
        try:
            conn, resp = self.engine.stream("/containers/%s/archive?path=%s" % (_q(cid), _q(path)))
        except EngineError as e:
            if e.status == 404:
                raise AgentError("bad_input", "container %r has no %s (sglang_root)" % (self.name, path))
            raise
        try:
            with tarfile.open(fileobj=resp, mode="r|") as tar:
                for m in tar:
                    if m.name != "sglang" and not m.name.startswith("sglang/") or ".." in m.name.split("/"):
                        raise AgentError("failed", "container %r: unexpected entry %r in %s" % (self.name, m.name, path))
                    if m.isdev():
                        continue
                    tar.extract(m, dest, set_attrs=True)
        finally:
            conn.close()

    def in_container_tree(self):
        rec = self.origin() or {}
        return rec.get("sglang_root")


def container_python(doc):
    """The Python the server runs: the command's first word when it is a Python, else python3."""
    argv = argv_of(doc)
    if argv and os.path.basename(argv[0]).startswith("python"):
        return argv[0]
    return "python3"


def config_digest(cfg):
    keep = dict((k, cfg.get(k)) for k in ("argv", "env", "mounts"))
    return hashlib.sha256(json.dumps(keep, sort_keys=True).encode()).hexdigest()[:16]


class DockerManager(object):
    """The server is a container: the origin as it was, or one patchctl creates from it (see the module doc)."""

    def __init__(self, state_dir, cfg):
        self.state_dir = state_dir
        self.cfg = cfg
        self.c = Containers(state_dir, cfg)
        self.engine = self.c.engine
        self._started = None

    def server_user(self):
        """The container's user, whom the dump directory must belong to (None: root or unknown)."""
        doc = self.c.named()
        user = (((doc or {}).get("Config") or {}).get("User") or "").split(":")[0]
        if user in ("", "0", "root"):
            return None
        import pwd

        try:
            return pwd.getpwnam(user).pw_name  # the dump directory is chowned to it on the host
        except KeyError:
            return None  # a user of the image only: the directory stays the agent's

    def _origin_cfg(self, doc, running):
        mine = self.cfg.get("env") or {}  # the inventory's env the origin has (the image form: all of it)
        env = dict((k, v) for k, v in env_of(doc).items() if k in mine)
        return dict(self.cfg, argv=argv_of(doc), env=env, extra_args=[], series=None, profile=None,
                    capture_layers=None, drafter=None, mounts=[], origin=True, container_id=doc["Id"],
                    image_id=doc.get("Image"), running=running)

    def current_config(self):
        """What serves under the container's name: patchctl's container (its recorded config), the origin
        (its own command), or a container neither made (recreated by hand: `foreign`, with what differs)."""
        doc = self.c.named()
        if doc is None:
            rec = self.c.origin()
            parked = rec and self.engine.inspect(rec["id"])
            if parked:
                return self._origin_cfg(parked, False)
            return dict(self.cfg, running=False, missing=True, container_id=None)
        running = bool((doc.get("State") or {}).get("Running"))
        kind = self.c.kind_of(doc)
        if kind == "ours":
            rec = read_json(self.c.server_path())
            return dict(launch_config(rec["config"]), running=running, container_id=doc["Id"], image_id=doc.get("Image"))
        if kind == "origin":
            return self._origin_cfg(doc, running)
        rec = self.c.origin() or {}
        return dict(self.cfg, argv=argv_of(doc), env={}, running=running, foreign=True, container_id=doc["Id"],
                    image_id=doc.get("Image"), series=None, profile=None, drafter=None,
                    origin_id=rec.get("id"), mounts=[m.get("Source") for m in doc.get("Mounts") or []])

    def running_pid(self):
        doc = self.c.named()
        pid = ((doc or {}).get("State") or {}).get("Pid") or None
        return pid, None

    def alive(self):
        if self._started:
            doc = self.engine.inspect(self._started["id"])
            st = (doc or {}).get("State") or {}
            # a crash under a restart policy: running again, but RestartCount moved
            return bool(st.get("Running")) and doc.get("RestartCount", 0) == self._started["restarts"]
        doc = self.c.named()
        return bool(((doc or {}).get("State") or {}).get("Running"))

    def log_tail(self, lines=30):
        cid = (self._started or {}).get("id") or self.c.name
        return self.engine.logs(cid, lines)

    def check_restartable(self):
        """Refuse (attention) when the container under the name is neither patchctl's nor the origin."""
        doc = self.c.named()
        if doc is not None and self.c.kind_of(doc) == "foreign":
            self._refuse_foreign(doc)

    def stop(self):
        """Stop what serves under the name. Stopping to the origin's own config (a rollback to a server that was
        not running, as a container patchctl made and never started) also gives the name back to the origin."""
        doc = self.c.named()
        out = {"stopped": None}
        if doc and (doc.get("State") or {}).get("Running"):
            if self.c.kind_of(doc) == "foreign":
                self._refuse_foreign(doc)
            event("server_stop", container=self.c.name, id=doc["Id"][:12])
            self.engine.stop(doc["Id"], self.cfg.get("stop_timeout") or 60)
            out["stopped"] = self.c.name
        if doc and self.cfg.get("origin") and self.c.kind_of(doc) == "ours":
            self._give_back(self.c.origin_doc())
        return out

    def _refuse_foreign(self, doc):
        raise AgentError("attention", "container %r (id %s, image %s) is neither the one patchctl deployed nor the "
                         "one it replaced (recreated by hand?): patchctl does not stop or remove a container it "
                         "did not make. Remove or rename it (%s rm -f %s), then run this again" % (
                             self.c.name, doc["Id"][:12], (doc.get("Config") or {}).get("Image"),
                             self.engine.manager, self.c.name))

    def start(self, cfg):
        cfg = dict(cfg)
        cfg.pop("running", None)
        self.cfg = cfg
        origin = self.c.origin_doc(create=True)
        if cfg.get("origin") or self._is_origin_config(cfg, origin):
            return self._serve_origin(origin)
        return self._serve_ours(cfg, origin)

    def _is_origin_config(self, cfg, origin):
        has = env_of(origin)
        return (list(cfg.get("argv") or []) == argv_of(origin) and not cfg.get("drafter")
                and all(has.get(k) == v for k, v in (cfg.get("env") or {}).items())
                and not self.tree_mount(cfg))

    def tree_mount(self, cfg):
        """The patched package over the origin's, when a series is applied to patchctl's copy."""
        from .state import TreeState

        root = self.c.tree_root
        if not os.path.isdir(os.path.join(root, "sglang")):
            return None
        m = TreeState(self.state_dir, root, create=False).manifest()
        if not m or all(plugin_site.in_site(rel) for rel in m.files):  # a plugin series changes no SGLang file
            return None
        inside = self.c.in_container_tree()
        return {"Source": os.path.join(root, "sglang"), "Target": inside.rstrip("/") + "/sglang", "ro": True}

    def _mounts(self, cfg):
        out = []
        tree = self.tree_mount(cfg)
        if tree:
            out.append(tree)
        profile = cfg.get("profile") or {}
        dump = (cfg.get("env") or {}).get(profile.get("dump_dir_env") or "SGLANG_HIDDEN_DUMP_DIR")
        if dump:
            out.append({"Source": dump, "Target": dump, "ro": False})
        if profile.get("plugin"):  # the plugin site, where PYTHONPATH names it (host/plugin_site.py)
            site = plugin_site.site_dir(self.state_dir)
            out.append({"Source": site, "Target": site, "ro": True})
        if cfg.get("drafter"):
            store = os.path.join(self.state_dir, "drafters")
            out.append({"Source": store, "Target": store, "ro": True})
        return out

    def _serve_origin(self, origin):
        """The operator's own container serving again, as it was: patchctl's removed, the name given back."""
        self._give_back(origin)
        event("server_start", container=self.c.name, id=origin["Id"][:12], origin=True)
        self.engine.start(origin["Id"])
        doc = self.engine.inspect(origin["Id"])
        self._started = {"id": origin["Id"], "restarts": doc.get("RestartCount", 0)}
        write_json(self.c.server_path(), {"config": launch_config(self._origin_cfg(origin, True)), "container_id": None,
                                          "origin_serving": True, "started_at": now()})
        return {"container": self.c.name, "id": origin["Id"], "pid": (doc.get("State") or {}).get("Pid")}

    def _give_back(self, origin):
        """patchctl's container removed, the origin's name and restart policy its own again (not started)."""
        rec = self.c.origin()
        named = self.c.named()
        if named and named["Id"] != origin["Id"]:
            if self.c.kind_of(named) != "ours":
                raise AgentError("attention", "container %r is not patchctl's nor the one it replaced (id %s): not "
                                 "removing it" % (self.c.name, named["Id"][:12]))
            self.engine.remove(named["Id"])
        if origin.get("Name", "").lstrip("/") != self.c.name:
            self.engine.rename(origin["Id"], self.c.name)
        if rec and rec.get("restart"):
            self.engine.set_restart(origin["Id"], rec["restart"])

    def _park(self, origin):
        """The origin stopped, renamed, its restart policy "no" until it serves again."""
        if not self.c.origin():
            root = self.c.in_container_tree()
            if not root and (origin.get("State") or {}).get("Running"):
                root = self.c.container_root(origin, self.cfg.get("sglang_root"))
            self.c.record_origin(origin, root or "")
        if (origin.get("State") or {}).get("Running"):
            self.engine.stop(origin["Id"], self.cfg.get("stop_timeout") or 60)
        if ((origin.get("HostConfig") or {}).get("RestartPolicy") or {}).get("Name") not in (None, "", "no"):
            self.engine.set_restart(origin["Id"], {"Name": "no", "MaximumRetryCount": 0})
        if origin.get("Name", "").lstrip("/") == self.c.name:
            self.engine.rename(origin["Id"], self.c.name + PARKED)
        event("container_parked", container=self.c.name, id=origin["Id"][:12], parked_as=self.c.name + PARKED)

    def _serve_ours(self, cfg, origin):
        mounts = self._mounts(cfg)
        cfg["mounts"] = mounts
        digest = config_digest(cfg)
        named = self.c.named()
        if named and named["Id"] != origin["Id"]:
            if self.c.kind_of(named) != "ours":
                raise AgentError("attention", "container %r is not patchctl's nor the one it replaced (id %s, image "
                                 "%s): not replacing it. Remove or rename it, or roll this host back" % (
                                     self.c.name, named["Id"][:12], (named.get("Config") or {}).get("Image")))
            if (named["Config"].get("Labels") or {}).get(LABEL_CONFIG) == digest:
                return self._run(named["Id"], cfg)  # the same config: the same container, started again
            self.engine.remove(named["Id"])
        self._park(self.engine.inspect(origin["Id"]) or origin)
        body = create_body(origin, cfg["argv"], cfg.get("env") or {}, mounts,
                           {LABEL: "1", LABEL_ORIGIN: origin["Id"], LABEL_CONFIG: digest})
        cid = self.engine.create(self.c.name, body)
        event("container_created", container=self.c.name, id=cid[:12], image=origin.get("Image"))
        return self._run(cid, cfg)

    def _run(self, cid, cfg):
        write_json(self.c.server_path(), {"config": launch_config(cfg), "container_id": cid, "started_at": now()})
        self.engine.start(cid)
        doc = self.engine.inspect(cid)
        self._started = {"id": cid, "restarts": doc.get("RestartCount", 0)}
        event("server_start", container=self.c.name, id=cid[:12], argv=cfg["argv"])
        return {"container": self.c.name, "id": cid, "pid": (doc.get("State") or {}).get("Pid")}


def create_body(origin, argv, env, mounts, labels):
    """The origin's own Config and HostConfig (as inspect reports them) with another command, env and mounts."""
    c = origin.get("Config") or {}
    keep = ("Hostname", "Domainname", "User", "AttachStdin", "AttachStdout", "AttachStderr", "ExposedPorts", "Tty",
            "OpenStdin", "StdinOnce", "WorkingDir", "Volumes", "StopSignal", "StopTimeout", "Healthcheck", "Shell")
    body = dict((k, c[k]) for k in keep if c.get(k) is not None)
    entry = list(c.get("Entrypoint") or [])
    if entry and argv[:len(entry)] == entry:
        body["Entrypoint"], body["Cmd"] = entry, argv[len(entry):]
    else:
        body["Entrypoint"], body["Cmd"] = argv[:1], argv[1:]
    have = env_of(origin)
    image_path = have.get("PYTHONPATH")
    have.update(env)
    if image_path and "PYTHONPATH" in env:  # a plugin site first (host/plugin_site.py), the image's own path after it
        have["PYTHONPATH"] = plugin_site.joined_path(env["PYTHONPATH"], image_path)
    body["Env"] = ["%s=%s" % kv for kv in have.items()]
    body["Image"] = origin.get("Image")  # the image id: the same image, even if its tag moved since
    body["Labels"] = dict(c.get("Labels") or {}, **labels)
    host = json.loads(json.dumps(origin.get("HostConfig") or {}))
    host["Binds"] = list(host.get("Binds") or []) + ["%s:%s:%s" % (m["Source"], m["Target"], "ro" if m["ro"] else "rw")
                                                      for m in mounts]
    body["HostConfig"] = host
    nets = ((origin.get("NetworkSettings") or {}).get("Networks") or {})
    mode = host.get("NetworkMode") or "default"
    if nets and mode not in ("host", "none") and not mode.startswith("container:"):
        body["NetworkingConfig"] = {"EndpointsConfig": dict(
            (n, {"Aliases": v.get("Aliases"), "IPAMConfig": v.get("IPAMConfig")}) for n, v in nets.items())}
    return body


def origin_argv(state_dir, srv, made=None):
    """The command the operator's container runs (its entrypoint and command), the base every deploy adds to."""
    return argv_of(Containers(state_dir, srv, made).origin_doc())


def tree_digest(pkg):
    """sha256 over a package directory: every path, its mode and its bytes, in sorted order (no __pycache__)."""
    h = hashlib.sha256()
    for d, dirs, files in os.walk(pkg):
        dirs[:] = sorted(x for x in dirs if x != "__pycache__")
        for name in sorted(files):
            p = os.path.join(d, name)
            h.update(("%s\0%o\0" % (os.path.relpath(p, pkg), os.lstat(p).st_mode)).encode())
            with open(p, "rb") as f:
                h.update(f.read())
    return h.hexdigest()


IMAGE_PLUGIN_SITE = "/opt/patchctl/plugins/site"  # where a plugin series' site lives in a derived image


def derive_image(c, manifest, repo=None):
    """The Kubernetes step (docs/design.md "SGLang in containers"): a new image = the operator's image with the
    deployed sglang/ over its own, tagged `<repo>:<series>-<version>-<digest12>`, for a team to push to its
    registry and roll out. A container is created from the image (never started), the tree copied into it
    through the archive endpoint, committed with the image's own config, and removed. A plugin series' image has
    the plugin site at IMAGE_PLUGIN_SITE, first on the image's PYTHONPATH, and SGLang's files as they were."""
    rec = c.origin()
    if not rec:
        raise AgentError("bad_input", "container %r: patchctl has not deployed here (no record of the operator's "
                         "container)" % c.name)
    plugin = all(plugin_site.in_site(rel) for rel in manifest.files)
    # a diff series: the patched sglang/ over the image's; a plugin series: the site, first on the image's PYTHONPATH
    pkg = plugin_site.site_dir(c.state_dir) if plugin else os.path.join(c.tree_root, "sglang")
    for rel, f in manifest.files.items():
        if f.applied is None:  # the archive endpoint adds and replaces files; it cannot take one away
            raise AgentError("bad_input", "%s %s removes %s: an image layer made by copying cannot remove it" % (
                manifest.series, manifest.version, rel))
    digest = tree_digest(pkg)
    base = c.engine.image(rec["image"])
    if base is None:
        raise AgentError("bad_input", "the operator's image %s is no longer on this host" % rec["image"])
    repo = repo or "patchctl/%s" % c.name
    tag = "%s-%s-%s" % (manifest.series, manifest.version, digest[:12])
    body = dict((k, v) for k, v in (base.get("Config") or {}).items() if v is not None)
    if plugin:
        env = env_of(base)
        env["PYTHONPATH"] = plugin_site.joined_path(IMAGE_PLUGIN_SITE, env.get("PYTHONPATH"))
        body["Env"] = ["%s=%s" % kv for kv in env.items()]
    body["Image"] = rec["image"]
    body["Labels"] = dict(body.get("Labels") or {}, **{
        "io.patchctl.series": manifest.series, "io.patchctl.version": manifest.version,
        "io.patchctl.tree": digest, "io.patchctl.base": rec["image"]})
    cid = c.engine.create("%s.patchctl-image-%d" % (c.name, os.getpid()), body)
    try:
        buf = tempfile.TemporaryFile()
        with tarfile.open(fileobj=buf, mode="w") as tar:
            tar.add(pkg, arcname=IMAGE_PLUGIN_SITE.lstrip("/") if plugin else "sglang",
                    filter=lambda ti: None if "__pycache__" in ti.name.split("/") else ti)
        buf.seek(0)
        c.engine.put_archive(cid, "/" if plugin else rec["sglang_root"], buf)
        _, made = c.engine.call("POST", "/commit?container=%s&repo=%s&tag=%s&comment=%s" % (
            _q(cid), _q(repo), _q(tag), _q("patchctl: %s %s over %s" % (manifest.series, manifest.version,
                                                                       rec["image"][:19]))), body)
    finally:
        c.engine.remove(cid)
    event("container_image", container=c.name, image=made["Id"][:19], tag="%s:%s" % (repo, tag))
    return {"image": made["Id"], "tag": "%s:%s" % (repo, tag), "base": rec["image"], "series": manifest.series,
            "version": manifest.version, "tree_digest": digest}
