"""The capture ops (`patchctl capture run | regenerate | prepare | collect`): capture, regenerate, tokenizer,
pull_raw, convert.

`capture` and `regenerate` answer their probe first (a `probed` event, `agent.Context.probed`), then
take work on stdin until it closes (host/capture.py, host/regenerate.py); `tokenizer` reads the served
model's tokenizer files, `pull_raw` a run's verified dumps (host/pull.py), `convert` turns them into
SpecForge files on the host (host/convert.py). Each op is one function of the request's context
(`agent.Context`), bound with `dispatch.handles`. Standard library only, Python 3.8 syntax.
"""

import socket

from .. import capture, convert, regenerate, tokenizer
from ..answers import CaptureAnswer, ConvertAnswer, PullRawAnswer, StreamedAnswer, TokenizerAnswer
from ..dispatch import handles
from ..drafter import read_record
from ..pull import pull_raw


@handles("capture", check=capture.check_request)
def op_capture(ctx):
    """One host's share of an extraction run. First its probe (`_capture_probe`), answered as a `probed`
    event; a host that does not take part ends there. Then samples on stdin until it closes
    (`capture.Capture`): nothing is created on the host before the first one arrives, so a run the
    controller refuses after the probes (it closes the stream unsent) leaves every host as it was.
    Holds the agent lock throughout: no deploy restarts this server under a running capture."""
    cfg = _capture_server(ctx)
    info = _capture_probe(ctx, cfg)
    if not ctx.probed(info):
        return CaptureAnswer(ready=False)
    return CaptureAnswer.from_wire(capture.Capture(cfg, info, ctx.req, ctx.stdin).run_all())


def _capture_probe(ctx, cfg):
    """Does this host take part in an extraction run (`capture.probe`); reads only. A server that
    speculates does not: SGLang refuses a capture and a drafter together."""
    info = capture.probe(ctx.tree.manifest(), cfg, ctx.req)
    rec = read_record(ctx.state_dir)
    if rec and info.get("ready"):
        info = dict(info, ready=False, why="its server speculates with the drafter %s (from %s): take it away first "
                    "with patchctl drafter rollback --to none" % (rec["digest"][:12], rec.get("source")))
    return dict(info, hostname=socket.gethostname())


def _capture_server(ctx):
    """The config of the server running now (what the capture ops read and send work to)."""
    mgr, _ = ctx.base_manager()
    return mgr.current_config()


@handles("regenerate")
def op_regenerate(ctx):
    """One host's share of a regeneration: first its probe (`regenerate.probe`), answered as a `probed`
    event (a host that does not take part ends there), then conversations on stdin until it closes
    (`regenerate.Regenerate`; it writes nothing on the host). Holds the agent lock throughout: no deploy
    restarts this server under it."""
    cfg = _capture_server(ctx)
    if not ctx.probed(dict(regenerate.probe(cfg), hostname=socket.gethostname())):
        return StreamedAnswer(ready=False)
    return StreamedAnswer.from_wire(regenerate.Regenerate(cfg, ctx.req, ctx.stdin).run_all())


@handles("tokenizer")
def op_tokenizer(ctx):
    """The served model's tokenizer files (`tokenizer.served`), their bytes with `with_data`; reads only."""
    return TokenizerAnswer.from_wire(tokenizer.served(_capture_server(ctx), bool(ctx.req.get("with_data"))))


@handles("pull_raw")
def op_pull_raw(ctx):
    """A capture run's verified dumps, raw and framed on stdout before the answer (`capture collect`);
    read-only, no lock (pull)."""
    return PullRawAnswer.from_wire(pull_raw(ctx.state_dir, ctx.req.get("run"), ctx.req.get("files")))


@handles("convert")
def op_convert(ctx):
    """A capture run's verified dumps -> SpecForge files in a directory on this host (`capture collect
    --on-host`); samples on stdin; reads only the run's dumps, writes only below that directory (convert)."""
    conv = convert.Converter(ctx.state_dir, ctx.req, ctx.stdin)
    return ConvertAnswer.from_wire(conv.run_all(ctx.req.get("ids") or []))
