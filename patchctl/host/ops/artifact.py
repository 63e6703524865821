"""The artifact ops (`patchctl drafter send`, and `drafter deploy` before it deploys): artifact_probe,
artifact_receive: what a host holds of a content-addressed drafter artifact, and its missing bytes from
stdin, verified (host/artifact.py). Each op is one function of the request's context (`agent.Context`),
bound with `dispatch.handles`. Standard library only, Python 3.8 syntax.
"""

from .. import artifact
from ..answers import ArtifactProbeAnswer, ArtifactReceiveAnswer
from ..dispatch import handles


@handles("artifact_probe")
def op_artifact_probe(ctx):
    """What this host holds of a drafter artifact; read only (artifact.probe)."""
    return ArtifactProbeAnswer.from_wire(artifact.probe(ctx.state_dir, ctx.req.get("digest"), ctx.req.get("files")))


@handles("artifact_receive")
def op_artifact_receive(ctx):
    """The missing bytes of a drafter artifact from stdin, verified, then its directory (artifact.receive)."""
    return ArtifactReceiveAnswer.from_wire(artifact.receive(ctx.state_dir, ctx.req, ctx.stdin))
