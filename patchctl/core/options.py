"""What a command was asked to do, as frozen objects the CLI builds once from its arguments.

Nothing below the CLI reads argparse: a command gets one of these, `Run` reads `RunOptions`, the rollout
reads `DeployOptions`' --canary/--batch/--max-fail/--on-fail (already checked by the CLI with
`core.rollout`'s rules), and a test builds them as it builds any value. Field names are the flags'
(--max-fail: max_fail); a field a command has no flag for keeps its default.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class RunOptions:
    """Any command over the fleet: which hosts, how many at once, host keys, where logs and reports go."""

    limit: str | None = None  # --limit: host, group and server names and globs; None: every host
    forks: int | None = None  # None: session.DEFAULT_FORKS
    accept_new_host_keys: bool = False
    log_dir: Path | None = None
    junit: Path | None = None


@dataclass(frozen=True)
class DeployOptions(RunOptions):
    """apply, rollback, smoke and restart/start/stop: the rollout and what each unit goes through."""

    series: str | None = None
    canary: int = 0
    batch: str | None = None  # None: all at once
    max_fail: str = "0"
    on_fail: str = "rollback-failed"
    no_restart: bool = False
    no_smoke: bool = False
    skip_trace: bool = False
    smoke: bool | None = None  # restart/start: None = where a capture series is deployed
    to: str | None = None  # rollback --to
    force: bool = False  # rollback --force


@dataclass(frozen=True)
class QueryOptions(RunOptions):
    """status, history, plan, unlock, image: read-only (unlock: the lock only; image: a new image, nothing else)."""

    series: str | None = None  # plan
    diff: bool = False  # plan --diff
    last: int | None = None  # history --last
    force: bool = False  # unlock --force
    repo: str | None = None  # image --repo


@dataclass(frozen=True)
class CaptureOptions(RunOptions):
    """capture run, regenerate and collect: the extraction run over the fleet."""

    name: str | None = None  # the run (None: from the input file's name)
    dataset: Path | None = None  # capture run
    conversations: Path | None = None  # capture regenerate
    out: Path | None = None
    in_flight: int = 8
    max_fail: str = "0"
    keep_free: int = 2**30
    request_timeout: int = 600
    no_length_check: bool = False
    allow_tokenizer_mismatch: bool = False
    max_new_tokens: int = 512
    temperature: float = 0.0
    drop_original: bool = False
    to: Path | None = None  # collect --to
    format: str = "safetensors"
    in_place: bool = False
    on_host: str | None = None
    streams: int | None = None
    workers: int | None = None


@dataclass(frozen=True)
class DrafterOptions(DeployOptions):
    """drafter check / bench (read-only) and deploy / rollback (the rollout of DeployOptions): a trained EAGLE-3
    draft directory, the data it was trained on, the prompts its acceptance is measured on, the canary's gate
    (`commands/drafter/gate.py`)."""

    dir: Path | None = None  # check, deploy: the draft directory (`specforge export --to sglang`'s output)
    data: Path | None = None  # check --data: the collection the draft was trained on
    prompts: Path | None = None  # bench, deploy --prompts
    tokenizer: Path | None = None  # bench, deploy --tokenizer: renders conversations
    tokenizer_from: str | None = None  # bench, deploy --from HOST: that host's served tokenizer renders them
    max_new_tokens: int = 2048  # specforge benchmark's default
    concurrency: int = 1  # specforge benchmark's default
    request_timeout: int = 600
    min_accept_length: float = 1.5
    min_gain: float = 0.0
    min_category_gain: float = 0.0  # each category of the prompt set: at least its baseline + this
    max_loop_share: float = 0.5  # at most this share of the speculative gain from looping completions
    max_tps_loss: float | None = None  # a fraction: 0.1 = at most 10 % fewer output tokens/s than the baseline
    keep_free: int = 2**30
    pending: bool = False  # rollback --pending: only an unfinished (pending) deploy is taken back
    dry_run: bool = False  # gc --dry-run: what would be freed, nothing touched
