"""The ops' handler registry: which function answers each op of `protocol.OPS`.

A module of its own so that any host module can bind an op with `@handles` without importing
`agent` (which imports them all): `deploy_ops` binds the deploy and series ops here, `agent` the
rest, and `agent.handle` looks each request's op up in `HANDLERS`. Standard library only.
"""

from .protocol import OPS


HANDLERS = {}  # op name -> (Agent method, check of the request run before any lock)


def handles(op, check=None):
    """Bind an Agent method to its op of protocol.OPS (which says what locks it needs and whether it
    streams); `check(req)` refuses a bad request before any lock is taken."""
    if op not in OPS:
        raise AssertionError("op %r is not declared in protocol.OPS" % op)

    def bind(fn):
        HANDLERS[op] = (fn, check)
        return fn
    return bind
