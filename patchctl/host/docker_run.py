"""A container patchctl creates itself: `image = "NAME:TAG"` and `[server.run]` in the inventory instead of a
container the operator started (docs/design.md "SGLang in containers").

The inventory's image, command, env and run options (`check_run`: gpus, ipc, shm_size, volumes, restart,
network, ulimits, labels) are the *made spec*. The first op that changes the host creates the origin from it
(`create_origin`: created, not started, labelled `io.patchctl.made` with the spec's digest and recorded in
`containers/<name>/origin.json` with `made: true`); from then on it is the origin exactly as an operator's
container is (parked while patchctl's serves, given back on rollback). A read-only op creates nothing that
stays: `would_be` describes the container from the image, and the tree is read through a temporary container
that is removed. A container under the name that was not made from this spec is refused (`check_made`):
patchctl never changes or removes a container it did not create.

Standard library only, Python 3.8 syntax.
"""

import difflib
import hashlib
import json
import os
import re

from .engine import EngineError, _demux
from .events import AgentError, event

LABEL_MADE = "io.patchctl.made"  # on an origin patchctl created: the digest of the spec it was made from
LABEL_TEMP = "io.patchctl.temporary"  # a look at an image's tree: removed at once
OWN_LABELS = ("io.patchctl.managed", "io.patchctl.origin", "io.patchctl.config", LABEL_MADE, LABEL_TEMP)
RUN_KEYS = ("gpus", "ipc", "shm_size", "volumes", "restart", "network", "ulimits", "labels")
RESTART = ("no", "always", "unless-stopped", "on-failure")
ULIMITS = ("core", "cpu", "data", "fsize", "locks", "memlock", "msgqueue", "nice", "nofile", "nproc", "rss",
           "rtprio", "rttime", "sigpending", "stack")
VOLUME_OPTS = ("ro", "rw", "z", "Z", "nocopy", "shared", "slave", "private", "rshared", "rslave", "rprivate")
_SIZE = re.compile(r"^([0-9]+)([bkmgt]?)b?$", re.I)
_NAME = re.compile(r"^[a-zA-Z0-9][a-zA-Z0-9_.-]*$")


def _size(v):
    """"16g" (binary units, as docker run's --shm-size) or a number of bytes -> bytes; None when not a size."""
    if isinstance(v, int) and not isinstance(v, bool):
        return v if v > 0 else None
    m = _SIZE.match(v) if isinstance(v, str) else None
    if not m or int(m.group(1)) <= 0:
        return None
    return int(m.group(1)) * 1024 ** "bkmgt".index((m.group(2) or "b").lower())


def _gpus(v):
    if v == "all":
        return {"Count": -1}
    if isinstance(v, int) and not isinstance(v, bool) and v > 0:
        return {"Count": v}
    if isinstance(v, list) and v and all(isinstance(x, str) and _NAME.match(x) for x in v):
        return {"DeviceIDs": list(v)}
    return None


def _volume(v):
    parts = v.split(":") if isinstance(v, str) else []
    if len(parts) not in (2, 3) or not parts[0] or not parts[1].startswith("/"):
        return False
    if not (parts[0].startswith("/") or _NAME.match(parts[0])):
        return False
    return len(parts) == 2 or all(o in VOLUME_OPTS for o in parts[2].split(","))


def _ulimit(v):
    """4096 (soft = hard), "4096:8192" or [4096, 8192]; -1 is unlimited -> (soft, hard), or None."""
    if isinstance(v, str):
        try:
            v = [int(x) for x in v.split(":")]
        except ValueError:
            return None
    if isinstance(v, int) and not isinstance(v, bool):
        v = [v, v]
    if (not isinstance(v, list) or len(v) != 2 or not all(isinstance(x, int) and not isinstance(x, bool) and x >= -1
                                                           for x in v)):
        return None
    if -1 not in v and v[0] > v[1]:
        return None
    return v[0], v[1]


def check_run(table):
    """[server.run] -> (settings, [(key, problem)]): what `docker run` options patchctl gives the container."""
    out, problems = {"network": "host"}, []
    for key in table:
        if key not in RUN_KEYS:
            near = difflib.get_close_matches(key, RUN_KEYS, n=1, cutoff=0.6)
            problems.append((key, "unknown key%s; expected one of: %s" % (
                " (did you mean %r?)" % near[0] if near else "", ", ".join(RUN_KEYS))))
    v = table.get("gpus")
    if v is not None:
        if _gpus(v) is None:
            problems.append(("gpus", "expected \"all\", a number of GPUs, or a list of device ids "
                                     "([\"0\", \"1\"] or GPU UUIDs), got %r" % (v,)))
        out["gpus"] = v
    for key, ok, want in (("ipc", lambda x: x in ("host", "private", "shareable", "none") or (
            x.startswith("container:") and _NAME.match(x[10:])), "host, private, shareable, none or container:<name>"),
                          ("network", lambda x: bool(_NAME.match(x)) or (x.startswith("container:") and _NAME.match(
                              x[10:])), "host (the default), none, bridge or a network's name"),
                          ("restart", lambda x: x in RESTART or re.match(r"^on-failure:[0-9]+$", x),
                           "no, always, unless-stopped, on-failure or on-failure:N")):
        v = table.get(key)
        if v is not None:
            if not isinstance(v, str) or not ok(v):
                problems.append((key, "expected %s, got %r" % (want, v)))
            out[key] = v
    v = table.get("shm_size")
    if v is not None:
        if _size(v) is None:
            problems.append(("shm_size", "expected a size such as \"16g\", \"512m\" or a number of bytes, got %r" % (v,)))
        out["shm_size"] = v
    v = table.get("volumes")
    if v is not None:
        bad = [x for x in v if not _volume(x)] if isinstance(v, list) else [v]
        if bad:
            problems.append(("volumes", "expected a list of \"SOURCE:/target[:ro]\" (SOURCE a host path or a volume "
                                        "name, options %s), got %r" % (",".join(VOLUME_OPTS), bad[0])))
        out["volumes"] = v
    problems += _check_tables(table, out)
    return out, problems


def _check_tables(table, out):
    problems = []
    v = table.get("ulimits")
    if v is not None:
        if not isinstance(v, dict):
            problems.append(("ulimits", "expected a table such as { nofile = \"65536:65536\", memlock = -1 }"))
        else:
            for name, lim in v.items():
                if name not in ULIMITS:
                    problems.append(("ulimits", "%r is not a ulimit (one of: %s)" % (name, ", ".join(ULIMITS))))
                elif _ulimit(lim) is None:
                    problems.append(("ulimits", "%s: expected SOFT:HARD, one number or [SOFT, HARD] (-1: unlimited), "
                                                "got %r" % (name, lim)))
        out["ulimits"] = v
    v = table.get("labels")
    if v is not None:
        if not isinstance(v, dict) or not all(isinstance(x, str) for x in v.values()):
            problems.append(("labels", "expected a table of strings"))
        elif set(v) & set(OWN_LABELS):
            problems.append(("labels", "%s is patchctl's own label" % sorted(set(v) & set(OWN_LABELS))[0]))
        out["labels"] = v
    return problems


def host_config(run):
    """The run options as the engine's HostConfig (what `docker run --gpus --ipc --shm-size -v --restart
    --network --ulimit` sends)."""
    run = run or {}
    host = {"NetworkMode": run.get("network") or "host", "Binds": list(run.get("volumes") or [])}
    if run.get("gpus") is not None:
        host["DeviceRequests"] = [dict({"Driver": "", "Count": 0, "DeviceIDs": None, "Capabilities": [["gpu"]],
                                        "Options": {}}, **_gpus(run["gpus"]))]
    if run.get("ipc"):
        host["IpcMode"] = run["ipc"]
    if run.get("shm_size") is not None:
        host["ShmSize"] = _size(run["shm_size"])
    restart = (run.get("restart") or "no").split(":")
    host["RestartPolicy"] = {"Name": restart[0], "MaximumRetryCount": int(restart[1]) if len(restart) > 1 else 0}
    if run.get("ulimits"):
        host["Ulimits"] = [{"Name": n, "Soft": _ulimit(v)[0], "Hard": _ulimit(v)[1]}
                           for n, v in sorted(run["ulimits"].items())]
    return host


def made_spec(req):
    """The inventory's image form as the agent renders it (the same placeholders as the server's command), or
    None for a host that names a container the operator runs."""
    from .server import render_command, server_values, expand_placeholders

    srv = req.get("server") or {}
    if not srv.get("image"):
        return None
    values = server_values(req)
    argv = render_command(srv["command"], values) if srv.get("command") else None
    env = dict((k, expand_placeholders(str(v), values)) for k, v in (srv.get("env") or {}).items())
    return {"image": srv["image"], "argv": argv, "env": env, "run": srv.get("run") or {"network": "host"}}


def made_digest(made):
    return hashlib.sha256(json.dumps(made, sort_keys=True).encode()).hexdigest()[:16]


def would_be(c):
    """The container the spec makes, described as `docker inspect` would (no Id: it does not exist)."""
    made = c.made
    image = c.engine.image(made["image"])
    if image is None:
        raise AgentError("bad_input", "image %s is not on this host (%s images lists them): pull or load it "
                         "first; patchctl never pulls" % (made["image"], c.engine.manager))
    ic = image.get("Config") or {}
    env = dict(x.partition("=")[::2] for x in ic.get("Env") or [])
    env.update(made["env"])
    argv = made["argv"]
    config = {"Image": made["image"], "Env": ["%s=%s" % kv for kv in env.items()],
              "Entrypoint": argv[:1] if argv else ic.get("Entrypoint"), "Cmd": argv[1:] if argv else ic.get("Cmd"),
              "WorkingDir": ic.get("WorkingDir") or "", "User": ic.get("User") or "",
              "Labels": dict(ic.get("Labels") or {}, **dict(made["run"].get("labels") or {},
                                                            **{LABEL_MADE: made_digest(made)}))}
    return {"Id": None, "Name": "/" + c.name, "Image": image["Id"], "Config": config,
            "HostConfig": host_config(made["run"]), "State": {"Running": False, "Status": "not created"}}


def _body(doc):
    c = doc["Config"]
    body = dict((k, c[k]) for k in ("Env", "Entrypoint", "Cmd", "WorkingDir", "User", "Labels") if c.get(k) is not None)
    body["Image"] = c["Image"]
    body["HostConfig"] = json.loads(json.dumps(doc["HostConfig"]))
    return body


def create_origin(c):
    """The origin made from the spec: created (never started here), recorded as the operator's would be."""
    doc = would_be(c)
    root = c.container_root(doc, c.setting)
    cid = c.engine.create(c.name, _body(doc))
    event("container_created", container=c.name, id=cid[:12], image=c.made["image"])
    doc = c.engine.inspect(cid)
    c.record_origin(doc, root, made=c.made)
    return doc


def check_made(c, doc):
    """A container under the name (or the recorded origin) must be the one made from this spec."""
    labels = (doc.get("Config") or {}).get("Labels") or {}
    if labels.get(LABEL_MADE) == made_digest(c.made):
        return
    was = (c.origin() or {}).get("made")
    if labels.get(LABEL_MADE) and was:
        differ = sorted(k for k in set(was) | set(c.made) if was.get(k) != c.made.get(k))
        why = "patchctl made it from another %s (the inventory changed since)" % "/".join(differ)
    else:
        why = "it was not created by patchctl (image %s)" % (doc.get("Config") or {}).get("Image")
    raise AgentError("bad_input", "container %r (id %s) is not the one image = %r and these run options make: %s. "
                     "patchctl never changes or removes a container it did not create: roll this host back to "
                     "clean and remove it (%s rm -f %s) to have it created anew, or drop image = to serve it as "
                     "it is" % (c.name, (doc.get("Id") or "")[:12], c.made["image"], why, c.engine.manager, c.name))


class Temporary(object):
    """A container from doc's image that lives only inside a `with` (a look at its tree, its Python's answer)."""

    def __init__(self, c, doc, argv=None):
        self.engine = c.engine
        body = _body(doc)
        body["Labels"] = dict(body.get("Labels") or {}, **{LABEL_TEMP: "1"})
        body["Labels"].pop(LABEL_MADE, None)
        body["HostConfig"] = {"Binds": doc["HostConfig"].get("Binds") or [], "NetworkMode": "none"}
        if argv:
            body["Entrypoint"], body["Cmd"] = argv[:1], argv[1:]
        self.body, self.name = body, "%s.patchctl-look-%d" % (c.name, os.getpid())
        self.id = None

    def __enter__(self):
        self.id = self.engine.create(self.name, self.body)
        return self.id

    def __exit__(self, *exc):
        self.engine.remove(self.id)

    def run(self):
        """(exit code, stdout) of the container's command, run to its end."""
        with self as cid:
            try:
                self.engine.start(cid)
            except EngineError as e:  # no such program in the image
                return 127, "", str(e)
            _, res = self.engine.call("POST", "/containers/%s/wait" % cid, timeout=300)
            _, logs = self.engine.call("GET", "/containers/%s/logs?stdout=1&stderr=1" % cid, raw=True)
        out, err = _demux(logs)
        return res.get("StatusCode"), out.decode(errors="replace"), err.decode(errors="replace")
