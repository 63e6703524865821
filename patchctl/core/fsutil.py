"""The controller's file primitives: a file's sha256 and atomic replacement (temporary name beside the
target, fsync, rename). One implementation for both sides: the host package's, which is standard
library and shipped to hosts, so the controller and the agent hash and replace files the same way."""

from patchctl.host.atomic import write_atomic
from patchctl.host.osutil import sha256_bytes, sha256_file

__all__ = ["sha256_bytes", "sha256_file", "write_atomic"]
