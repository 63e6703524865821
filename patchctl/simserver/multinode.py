"""Multi-node (`--nnodes K --node-rank R --dist-init-addr HOST:PORT`), as SGLang's process group behaves.

Rank 0 serves HTTP and stays 503 until ranks 1..K-1 have joined at the
dist-init address; ranks >= 1 run no HTTP server (as in SGLang) and live as
long as the head; if any node dies the others exit 1 (a broken NCCL group).
"""

from __future__ import annotations

import logging
import os
import socket
import threading

logger = logging.getLogger("patchctl.simserver")


class DistInitError(RuntimeError):
    """The head cannot listen at --dist-init-addr: start-up fails, as SGLang's does."""


def _split_addr(addr: str) -> tuple[str, int]:
    host, _, port = addr.rpartition(":")
    return host.strip("[]") or "127.0.0.1", int(port)


def head_rendezvous(args, stop, state) -> bool:
    """Node rank 0 of a multi-node server: wait until every other node joined at
    --dist-init-addr (SGLang's torch.distributed init); a node that leaves later kills
    the head (as a broken NCCL group does). False when stopped while waiting."""
    host, port = _split_addr(args.dist_init_addr)
    try:
        srv = socket.create_server((host, port))
    except OSError as e:
        raise DistInitError(f"torch.distributed.DistStoreError: cannot listen on {args.dist_init_addr}: {e}") from None
    joined: dict[int, socket.socket] = {}
    all_in = threading.Event()

    def watch(rank, conn):
        try:
            while conn.recv(64):
                pass
        except OSError:
            pass
        if not state.shutting_down:
            logger.error("RuntimeError: node rank %d left the process group (connection to it closed); "
                         "NCCL communicator aborted, exiting", rank)
            logging.shutdown()
            os._exit(1)

    def accept():
        while True:
            conn, _ = srv.accept()
            try:
                conn.settimeout(10)
                line = conn.makefile("r").readline().split()
                rank = int(line[1]) if len(line) == 2 and line[0] == "rank" else -1
                conn.settimeout(None)
            except (OSError, ValueError):
                conn.close()
                continue
            if rank < 1 or rank >= args.nnodes or rank in joined:
                conn.close()
                continue
            joined[rank] = conn
            conn.sendall(b"ok\n")
            logger.info("node rank %d joined (%d/%d nodes)", rank, len(joined) + 1, args.nnodes)
            threading.Thread(target=watch, args=(rank, conn), daemon=True).start()
            if len(joined) == args.nnodes - 1:
                all_in.set()

    threading.Thread(target=accept, name="dist-init", daemon=True).start()
    logger.info("Init torch distributed begin: waiting for %d other node(s) at %s",
                args.nnodes - 1, args.dist_init_addr)
    while not all_in.wait(0.2):
        if stop.is_set():
            return False
    logger.info("Init torch distributed ends: %d nodes", args.nnodes)
    return True


def follow_head(args, stop, shutdown):
    """Node rank >= 1: join the head at --dist-init-addr (retrying like torch.distributed
    does), then live as long as the head does."""
    host, port = _split_addr(args.dist_init_addr)
    logger.info("Init torch distributed begin: node rank %d joining %s", args.node_rank, args.dist_init_addr)
    while True:
        if stop.is_set():
            shutdown()
        try:
            conn = socket.create_connection((host, port), timeout=2)
            conn.sendall(f"rank {args.node_rank}\n".encode())
            if conn.makefile("r").readline().strip() == "ok":
                break
            conn.close()
        except OSError:
            pass
        stop.wait(0.2)
    conn.settimeout(None)
    logger.info("Init torch distributed ends: joined the head at %s", args.dist_init_addr)

    def watch():
        try:
            while conn.recv(64):
                pass
        except OSError:
            pass
        if not stop.is_set():
            logger.error("RuntimeError: connection to the head node %s lost; NCCL communicator "
                         "aborted, exiting", args.dist_init_addr)
            logging.shutdown()
            os._exit(1)
    threading.Thread(target=watch, daemon=True).start()
