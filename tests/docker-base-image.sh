#!/usr/bin/env bash
# The test suite's base image, made locally from Debian packages (no registry is reachable): a minimal
# bookworm with the Python SGLang's stand-in runs on. Built once per machine; .ci/run and the test
# fixtures (tests/docker_util.py) both call this. Usage: tests/docker-base-image.sh IMAGE:TAG
set -euo pipefail
image="${1:-patchctl-test-base:bookworm}"
if docker image inspect "$image" >/dev/null 2>&1; then exit 0; fi
work="$(mktemp -d /tmp/patchctl-rootfs.XXXXXX)"
trap 'rm -rf "$work"' EXIT
debootstrap --variant=minbase --include=python3,libstdc++6,libgomp1 bookworm "$work/root" >"$work/log" 2>&1 \
  || { tail -20 "$work/log" >&2; exit 1; }
tar -C "$work/root" -c . | docker import - "$image" >/dev/null
