"""The container engine's API: the Docker Engine API (or Podman's Docker-compatible one) over the daemon's
unix socket, standard library HTTP (inspect, exec, archive, create, start, stop, rename, update, remove).
Used by host/docker.py and host/docker_run.py. Standard library only, Python 3.8 syntax.
"""

import http.client
import json
import os
import socket
import struct

from .events import AgentError

DEFAULT_SOCKETS = {"docker": "/var/run/docker.sock", "podman": "/run/podman/podman.sock"}
API = "/v1.41"  # Docker 20.10 and every later daemon; Podman's compatible API answers it too


class _UnixHTTP(http.client.HTTPConnection):
    def __init__(self, path, timeout):
        http.client.HTTPConnection.__init__(self, "localhost", timeout=timeout)
        self._path = path

    def connect(self):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(self.timeout)
        s.connect(self._path)
        self.sock = s


def _demux(data):
    """The Engine API's multiplexed stream (8-byte frame headers: stream, 0, 0, 0, size) -> (stdout, stderr)."""
    out, err, i = [], [], 0
    while i + 8 <= len(data):
        kind, size = data[i], struct.unpack(">I", data[i + 4:i + 8])[0]
        (err if kind == 2 else out).append(data[i + 8:i + 8 + size])
        i += 8 + size
    if i < len(data) and not out and not err:  # a TTY container's logs are not framed
        return data, b""
    return b"".join(out), b"".join(err)


class Engine(object):
    """The container engine of one host, reached through its unix socket."""

    def __init__(self, manager="docker", socket_path=None):
        self.manager = manager
        self.socket = socket_path or DEFAULT_SOCKETS.get(manager, DEFAULT_SOCKETS["docker"])

    def _fail_reach(self, e):
        if isinstance(e, PermissionError):
            raise AgentError("bad_input", "uid %d may not use %s: permission denied on %s. Give this host become = "
                             "\"sudo\" in the inventory, or add the SSH user to the %s group" % (
                                 os.geteuid(), self.manager, self.socket, self.manager))
        raise AgentError("bad_input", "%s is not installed or its daemon is not running on this host: no answer on "
                         "%s (%s). Install and start it, or set [server] socket to where its API listens" % (
                             self.manager, self.socket, e.__class__.__name__ if not str(e) else e))

    def call(self, method, path, body=None, timeout=120.0, want=(200, 201, 204, 304), raw=False):
        """(status, decoded JSON or raw bytes). A status outside `want` raises, with the daemon's message."""
        conn = _UnixHTTP(self.socket, timeout)
        try:
            data = json.dumps(body).encode() if body is not None else None
            headers = {"Content-Type": "application/json"} if data is not None else {}
            try:
                conn.request(method, API + path, body=data, headers=headers)
                resp = conn.getresponse()
                payload = resp.read()
            except (FileNotFoundError, ConnectionRefusedError, PermissionError) as e:
                self._fail_reach(e)
            if resp.status not in want:
                try:
                    msg = json.loads(payload.decode() or "{}").get("message") or payload.decode(errors="replace")
                except ValueError:
                    msg = payload.decode(errors="replace")
                raise EngineError(resp.status, "%s %s: HTTP %d: %s" % (method, path.split("?")[0], resp.status, msg.strip()))
            if raw:
                return resp.status, payload
            try:
                return resp.status, json.loads(payload.decode() or "null")
            except ValueError:
                return resp.status, payload.decode(errors="replace")
        finally:
            conn.close()

    def stream(self, path, timeout=600.0):
        """A GET whose body is read by the caller (an archive); returns (connection, response)."""
        conn = _UnixHTTP(self.socket, timeout)
        try:
            conn.request("GET", API + path)
            resp = conn.getresponse()
        except (FileNotFoundError, ConnectionRefusedError, PermissionError) as e:
            conn.close()
            self._fail_reach(e)
        if resp.status != 200:
            msg = resp.read().decode(errors="replace")
            conn.close()
            raise EngineError(resp.status, "GET %s: HTTP %d: %s" % (path.split("?")[0], resp.status, msg.strip()))
        return conn, resp

    def inspect(self, ref):
        """The container's `docker inspect` document, or None when there is no such container."""
        try:
            return self.call("GET", "/containers/%s/json" % _q(ref))[1]
        except EngineError as e:
            if e.status == 404:
                return None
            raise

    def image(self, ref):
        try:
            return self.call("GET", "/images/%s/json" % _q(ref))[1]
        except EngineError as e:
            if e.status == 404:
                return None
            raise

    def exec(self, cid, argv, timeout=120.0):
        """(exit code, stdout, stderr) of argv run in the running container."""
        _, made = self.call("POST", "/containers/%s/exec" % _q(cid), {
            "Cmd": list(argv), "AttachStdout": True, "AttachStderr": True, "Tty": False})
        _, out = self.call("POST", "/exec/%s/start" % made["Id"], {"Detach": False, "Tty": False}, timeout=timeout,
                           raw=True)
        _, info = self.call("GET", "/exec/%s/json" % made["Id"])
        stdout, stderr = _demux(out)
        return info.get("ExitCode"), stdout.decode(errors="replace"), stderr.decode(errors="replace")

    def logs(self, cid, lines=30):
        try:
            _, data = self.call("GET", "/containers/%s/logs?stdout=1&stderr=1&tail=%d" % (_q(cid), lines), raw=True)
        except (EngineError, AgentError):
            return ""
        out, err = _demux(data)
        return (out + err).decode(errors="replace")

    def start(self, cid):
        self.call("POST", "/containers/%s/start" % _q(cid))

    def stop(self, cid, seconds):
        self.call("POST", "/containers/%s/stop?t=%d" % (_q(cid), int(seconds)), timeout=seconds + 60)

    def rename(self, cid, name):
        self.call("POST", "/containers/%s/rename?name=%s" % (_q(cid), _q(name)))

    def set_restart(self, cid, policy):
        self.call("POST", "/containers/%s/update" % _q(cid), {"RestartPolicy": policy})

    def remove(self, cid):
        self.call("DELETE", "/containers/%s?force=1&v=1" % _q(cid), want=(204, 404))

    def put_archive(self, cid, path, fileobj):
        """A tar stream unpacked at path inside the container (created or stopped)."""
        conn = _UnixHTTP(self.socket, 600)
        try:
            data = fileobj.read()
            conn.request("PUT", API + "/containers/%s/archive?path=%s" % (_q(cid), _q(path)), body=data,
                         headers={"Content-Type": "application/x-tar"})
            resp = conn.getresponse()
            msg = resp.read().decode(errors="replace")
            if resp.status != 200:
                raise EngineError(resp.status, "PUT archive %s: HTTP %d: %s" % (path, resp.status, msg.strip()))
        finally:
            conn.close()

    def create(self, name, body):
        return self.call("POST", "/containers/create?name=%s" % _q(name), body)[1]["Id"]


class EngineError(AgentError):
    def __init__(self, status, msg):
        AgentError.__init__(self, "failed", msg)
        self.status = status


def _q(s):
    import urllib.parse

    return urllib.parse.quote(str(s), safe="")
