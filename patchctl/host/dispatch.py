"""The ops' handler registry: which function answers each op of `protocol.OPS`.

A module of its own so that each module of `ops/` can bind its ops with `@handles` without importing
`agent` (which imports them all); `agent.handle` looks each request's op up in `HANDLERS`. Standard
library only.
"""

from .protocol import OPS


HANDLERS = {}  # op name -> (its function of an agent.Context, check of the request run before any lock)


def handles(op, check=None):
    """Bind an op's function (`op_<name>(ctx)`, ops/) to its op of protocol.OPS (which says what locks it needs and whether it
    streams); `check(req)` refuses a bad request before any lock is taken."""
    if op not in OPS:
        raise AssertionError("op %r is not declared in protocol.OPS" % op)

    def bind(fn):
        HANDLERS[op] = (fn, check)
        return fn
    return bind
