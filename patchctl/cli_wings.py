"""The parsers of the command line's two wings, `capture …` and `drafter …` (cli.build_parser adds them):
their flags, help and epilogs, from the shared pieces in `cliargs`."""

from __future__ import annotations

from pathlib import Path

from patchctl.cliargs import (Commands, fraction, hostkeys_args, limit_arg, max_fail_spec, positive_int, rollback_target,
                              rollout_flags, run_log_flags, run_name_arg, size_spec)

CAPTURE_EPILOG = """exit codes of capture run: 0 every sample done and verified; 1 samples failed (reasons in
`capture status`) or the run stopped with samples pending (--max-fail); 2 bad dataset or no host
takes part, nothing sent; 3 a host's state is unknown; 130 Ctrl-C (in-flight samples finished,
the journal flushed: run the same command again to go on)."""


def _capture_regenerate(cmd: Commands) -> None:
    cp = cmd("regenerate", "every assistant turn answered anew by the served model, across the fleet; resumable",
              "Replace every assistant turn of a conversations file by the served model's own answer, turn by turn\n"
              "(each turn's context holds the regenerated earlier turns), across every healthy server of the fleet\n"
              "through the hosts' SSH connections; journalled, resumed by running the same command again.")
    cp.add_argument("conversations", type=Path, metavar="CONVERSATIONS",
                    help='JSONL, one conversation a line: {"conversations": [{"from", "value"}, ...]} (ShareGPT) or '
                         '{"messages": [{"role", "content"}, ...]} (OpenAI); optional "id"')
    run_name_arg(cp, required=False)
    cp.add_argument("--out", type=Path, required=True, metavar="FILE",
                    help="the regenerated conversations (JSONL, the input's shape; `capture prepare` reads it)")
    limit_arg(cp)
    hostkeys_args(cp)
    cp.add_argument("--max-new-tokens", type=positive_int, default=512, metavar="N",
                    help="tokens an answer may have (default 512)")
    cp.add_argument("--temperature", type=float, default=0.0, metavar="T", help="sampling temperature (default 0: greedy)")
    cp.add_argument("--in-flight", type=positive_int, default=8, metavar="N",
                    help="conversations in flight per server (default 8); a faster server finishes more and so gets more")
    cp.add_argument("--max-fail", type=max_fail_spec, default="0", metavar="N|P%",
                    help="hosts that may stop (server dead, host lost) before the run stops (default 0)")
    cp.add_argument("--request-timeout", type=positive_int, default=600, metavar="S",
                    help="seconds a server may take to answer one turn before it is taken for hung (default 600)")
    cp.add_argument("--drop-original", action="store_true",
                    help="do not keep each original turn beside the regenerated one (original_content / original_value)")


def _capture_prepare(cmd: Commands) -> None:
    cp = cmd("prepare", "conversations -> a tokenized dataset, with SpecForge's own chat template and loss mask",
              "Tokenize and mask conversations exactly as SpecForge's online preprocessing does (its\n"
              "preprocess_conversations and TEMPLATE_REGISTRY), with the served model's tokenizer; record the\n"
              "tokenizer, template and source in DATASET.meta.json (`capture run` refuses another tokenizer).\n"
              "Needs: pip install -e '.[prepare]' (from the repository) && pip install --no-deps specforge==0.2.0")
    cp.add_argument("conversations", type=Path, metavar="CONVERSATIONS",
                    help='JSONL, one conversation a line: {"conversations": [{"from", "value"}, ...]} (ShareGPT) or '
                         '{"messages": [{"role", "content"}, ...]} (OpenAI); optional "id", "tools"')
    cp.add_argument("--template", required=True, metavar="NAME", help="SpecForge's chat template (llama3, qwen, "
                    "deepseek-v3, kimi-k2-thinking, ...; an unknown name lists them)")
    cp.add_argument("--out", type=Path, required=True, metavar="DATASET", help="the dataset to write (JSONL)")
    src = cp.add_mutually_exclusive_group(required=True)
    src.add_argument("--tokenizer", type=Path, metavar="DIR", help="a local directory with the model's tokenizer files")
    src.add_argument("--from", dest="from_host", metavar="HOST",
                     help="the tokenizer files of the model served on HOST (inventory name), fetched over its SSH "
                          "connection and cached by sha256 under ~/.cache/patchctl/tokenizers")
    hostkeys_args(cp)
    cp.add_argument("--max-length", type=positive_int, default=2048, metavar="N",
                    help="tokens a sample may have (SpecForge's max_length; default 2048); longer ones are refused")
    cp.add_argument("--truncate", action="store_true",
                    help="cut conversations longer than --max-length as SpecForge does, instead of refusing them")
    cp.add_argument("--train-only-last-turn", action="store_true",
                    help="only the last assistant turn is trained on (SpecForge's train_only_last_turn)")
    cp.add_argument("--workers", type=positive_int, default=None, metavar="N",
                    help="tokenizing processes (default: one per core)")


def _capture_run(cmd: Commands) -> None:
    cp = cmd("run", "send every sample of a dataset to the fleet's capture servers, verified; resumable")
    cp.add_argument("dataset", type=Path, metavar="DATASET",
                    help='JSONL, one sample a line: {"id": str, "input_ids": [int, ...], "loss_mask": [0|1, ...]?}')
    run_name_arg(cp, required=False)
    limit_arg(cp)
    hostkeys_args(cp, forks="hosts probed at once before the run, 1 or more (default 256); every host that takes part "
                     "is then fed samples at the same time, --in-flight each")
    cp.add_argument("--in-flight", type=positive_int, default=8, metavar="N",
                    help="requests in flight per server (default 8); a faster server finishes more and so gets more")
    cp.add_argument("--max-fail", type=max_fail_spec, default="0", metavar="N|P%",
                    help="hosts that may stop (server dead, host lost, disk reserve) before the run stops; "
                         "P%% of the taking-part hosts, rounded down (default 0: the run stops sending at the first)")
    cp.add_argument("--keep-free", type=size_spec, default=2**30, metavar="SIZE",
                    help="free space each host keeps on its dump file system, on top of what the samples in flight "
                         "will write ((K+1)*H*2 + 8 bytes per token); a host that would go under stops taking work "
                         "(default 1GiB; units: B, KB, MB, GB, KiB, MiB, GiB)")
    cp.add_argument("--request-timeout", type=positive_int, default=600, metavar="S",
                    help="seconds a server may take to answer one sample before it is taken for hung: the host stops "
                         "taking work and its samples go to the others (default 600)")
    cp.add_argument("--no-length-check", action="store_true",
                    help="do not check prompt lengths (by default a sample as long as a server's max_req_input_len "
                         "is refused before anything is sent, and so is a run where no host's bound can be known); "
                         "a sample too long then fails on its host")
    cp.add_argument("--log-dir", type=Path, default=None, metavar="DIR",
                    help="where run logs go (default: the run's directory under ~/.local/state/patchctl/captures)")
    cp.add_argument("--allow-tokenizer-mismatch", action="store_true",
                    help="capture a prepared dataset even where the server's tokenizer files differ from the ones "
                         "it was prepared with (DATASET.meta.json)")


def _capture_status(cmd: Commands) -> None:
    cp = cmd("status", "a capture run's or regeneration's progress: done, failed (with reasons), pending, per host "
                       "and in total; the command that resumes it")
    cp.add_argument("name", metavar="RUN",
                    help="the run's name (as given to `capture run --name` or `capture regenerate --name`; "
                         "a name that is both shows both)")


def _capture_collect(cmd: Commands) -> None:
    cp = cmd("collect", "pull a run's verified files over the hosts' SSH connections and index them")
    run_name_arg(cp, required=True)
    limit_arg(cp)
    hostkeys_args(cp, forks="hosts collected from at once, 1 or more (default 256)")
    cp.add_argument("--to", type=Path, default=None, metavar="DIR",
                    help="where the dataset goes (created if missing); with --on-host, where the index, draft-config.json "
                         "and summary go (default: the run's directory, on-host/)")
    cp.add_argument("--format", choices=["safetensors", "specforge"], default="safetensors",
                    help="safetensors (default): the dump files as written, verified by sha256; specforge: one "
                         "torch.save dict per sample (*.ckpt) in SpecForge's offline training format (needs torch)")
    cp.add_argument("--in-place", action="store_true",
                    help="pull nothing: write only the index, with each file's host and path (TB-scale runs)")
    cp.add_argument("--on-host", default=None, metavar="DIR",
                    help="with --format specforge: every host converts its own dumps into DIR on that host (its disk, "
                         "or a mount all hosts share); only the index, draft-config.json and a summary come back")
    cp.add_argument("--streams", type=positive_int, default=None, metavar="N",
                    help="pulls in flight per host, each over its own SSH connection (default: up to 4, one per "
                         "64 MiB or 4096 files of the host's: a connection costs more than a few small files)")
    cp.add_argument("--workers", type=positive_int, default=None, metavar="N",
                    help="--on-host: conversion processes per host (default: the host's cores - 1)")


def capture_parsers(cmd: Commands) -> None:
    sp = cmd("capture", "extraction runs: a tokenized dataset through the fleet's verified capture servers",
             "Extraction runs: push a tokenized JSONL dataset through every host whose capture series is deployed\n"
             "and verified, each sample exactly once, every dump verified on its host; resume after any crash;\n"
             "collect the verified files as safetensors or SpecForge's offline training format.",
             epilog=CAPTURE_EPILOG)
    ccmd = cmd.nested(sp, "capture_command", "ACTION", "actions", "run `patchctl capture ACTION --help` for its options")
    for add in (_capture_regenerate, _capture_prepare, _capture_run, _capture_status, _capture_collect):
        add(ccmd)


def _drafter_check(cmd: Commands) -> None:
    dp = cmd("check", "is a trained EAGLE-3 draft directory one SGLang 0.5.23 serves right for this target?",
             "Check a trained EAGLE-3 draft directory (what `specforge export --to sglang` writes) before any server\n"
             "loads it: architecture, config fields, every tensor's name, dtype and shape (truncated files named), the\n"
             "vocab map; with --data the capture layers, sizes and tokenizer of the data it was trained on; with\n"
             "--limit, read-only, each host's served model (hidden and vocab sizes, layer range, context length,\n"
             "tokenizer). Exit 0: no problem; 2: every problem listed; 3: a host could not be read.")
    dp.add_argument("dir", type=Path, metavar="DIR", help="the draft directory: config.json and *.safetensors")
    dp.add_argument("--data", type=Path, default=None, metavar="COLLECTED_DIR",
                    help="the `capture collect` directory the draft was trained on (its draft-config.json, index.json)")
    dp.add_argument("--limit", default=None, metavar="PATTERN",
                    help="also check against the models these hosts serve (host, group, server names and globs; "
                         "'*' for every host); without it only the local checks run")
    hostkeys_args(dp)


def _measure_flags(sp) -> None:
    """The prompt set and how it is sent: `drafter bench`'s one measurement, `drafter deploy`'s two arms."""
    sp.add_argument("--prompts", type=Path, required=True, metavar="FILE",
                    help='JSONL, one prompt a line: {"input_ids": [...]}, {"text": "..."}, or a conversation '
                         '{"messages": [{"role", "content"}, ...]} / {"conversations": [{"from", "value"}, ...]} '
                         "(its turns before the last assistant turn, rendered with --tokenizer's chat template)")
    tok = sp.add_mutually_exclusive_group()
    tok.add_argument("--tokenizer", type=Path, default=None, metavar="DIR",
                     help="the served tokenizer's files, to render conversations (its digest must be each host's)")
    tok.add_argument("--from", dest="tokenizer_from", default=None, metavar="HOST",
                     help="render conversations with the tokenizer of the model served on HOST (inventory name), fetched "
                          "over its SSH connection and cached by sha256, as `capture prepare --from` does")
    sp.add_argument("--max-new-tokens", type=positive_int, default=2048, metavar="N",
                    help="tokens each answer is allowed (default 2048, as specforge benchmark)")
    sp.add_argument("--concurrency", type=positive_int, default=1, metavar="N",
                    help="requests in flight per server, and warm-up requests (default 1, as specforge benchmark)")
    sp.add_argument("--request-timeout", type=positive_int, default=600, metavar="S",
                    help="seconds one request may take (default 600)")


def _drafter_bench(cmd: Commands) -> None:
    bp = cmd("bench", "acceptance length and tokens/s of what each host serves, on a fixed prompt set; read-only",
             "Measure, on each selected host's running server, the speculative acceptance length (sum of\n"
             "completion_tokens / sum of spec_verify_ct, and the mean of per-request spec_accept_length as\n"
             "`specforge benchmark` reports it) and output tokens/s, on the same prompts at temperature 0 with the same\n"
             "max_new_tokens (flush_cache, warm-up, then the set). A server without speculation shows acceptance\n"
             "'off'; one whose env sets SGLANG_SIMULATE_ACC_LEN is refused. Exit 0 measured; 1 requests failed;\n"
             "2 bad prompt set or refused server, nothing sent; 3 a host could not be reached.")
    _measure_flags(bp)
    limit_arg(bp)
    hostkeys_args(bp)


def _drafter_deploy(cmd: Commands) -> None:
    dp = cmd("deploy", "send a trained EAGLE-3 drafter, restart with it, keep it only where its measured acceptance passes",
             "Deploy a trained EAGLE-3 draft directory: checked on its own, against --data and against every host's\n"
             "served model, and a host where a capture series is deployed (exit 2, nothing sent). Then per unit,\n"
             "through the rollout (--canary, --batch, --max-fail; a batch's units at once): the draft sent to the\n"
             "unit's host, content-addressed (what a host has is not sent again; hosts after the canary receive it\n"
             "only once the canary passed, a host the run never reaches receives nothing), the prompt set measured\n"
             "on what serves now (baseline), the server restarted with the drafter and the inventory's\n"
             "[server.speculative] settings, the same prompts measured again (canary), and the gate: verified, or\n"
             "rolled back to the drafter (or none) and the exact server config before, proven ready.\n"
             "Ctrl-C: the first stops every send at once (what arrived is kept on the host; the next deploy resumes\n"
             "it) and restarts no other unit; the second aborts and prints each host's state and its command.\n"
             "Exit 0 deployed (or already serving it); 1 a unit rolled back; 2 refused, nothing sent; 3 attention;\n"
             "130 interrupted.")
    dp.add_argument("dir", type=Path, metavar="DIR", help="the draft directory (`specforge export --to sglang`'s output)")
    dp.add_argument("--data", type=Path, default=None, metavar="COLLECTED_DIR",
                    help="the `capture collect` directory the draft was trained on (layer ids, sizes, tokenizer)")
    _measure_flags(dp)  # the same prompts, tokens and concurrency in both arms
    dp.add_argument("--min-accept-length", type=float, default=1.5, metavar="X",
                    help="the new arm's acceptance length must be at least X (default 1.5)")
    dp.add_argument("--min-gain", type=float, default=0.0, metavar="X",
                    help="... and at least the baseline's + X (default 0: never less than what serves)")
    dp.add_argument("--min-category-gain", type=float, default=0.0, metavar="X",
                    help="... and, for each category of the prompt set, at least that category's baseline + X (default "
                         "0: no category below what serves; negative relaxes it)")
    dp.add_argument("--max-loop-share", type=fraction, default=0.5, metavar="P%",
                    help="... and at most P%% of the speculative gain from completions that degenerate into a loop "
                         "(default 50%%)")
    dp.add_argument("--max-tps-loss", type=fraction, default=None, metavar="P%",
                    help="... and output tokens/s at most P%% below the baseline's (default: not checked)")
    dp.add_argument("--keep-free", type=size_spec, default=2**30, metavar="SIZE",
                    help="free disk to leave on a host's state_dir after the draft arrives (default 1G)")
    limit_arg(dp)
    hostkeys_args(dp)
    rollout_flags(dp, "deploy to")
    run_log_flags(dp)


def _drafter_rollback(cmd: Commands) -> None:
    rp = cmd("rollback", "back to the drafter before (or none): its record and the exact server config, proven ready",
             "Back one step of the host's chain of verified drafters: the drafter that served before the last deploy\n"
             "and the exact server config it served with, restarted and proven ready; run again, the one before it,\n"
             "and so on back to the config before the first drafter (none). --to goes there in one step.\n"
             "Exit 0 rolled back (or nothing to roll back); 2 --to names no drafter the chain reaches (it lists them).")
    rp.add_argument("--to", type=rollback_target, default="previous", metavar="previous|none|DIGEST",
                    help="previous (default): one step back; none: the config before the first drafter; DIGEST (a "
                         "unique prefix, 4+ hex digits): that drafter of the chain, with the config it served with")
    rp.add_argument("--pending", action="store_true",
                    help="only an unfinished deploy (recorded pending: cut off before its canary's verdict) is taken "
                         "back; a verified drafter is left as it is (what an aborted drafter deploy prints)")
    limit_arg(rp)
    hostkeys_args(rp)
    rollout_flags(rp, "roll back")
    run_log_flags(rp)


def _drafter_gc(cmd: Commands) -> None:
    gp = cmd("gc", "free the host's draft store of drafters no server uses and no rollback reaches",
             "Per host, the draft store (<state_dir>/drafters/: content-addressed objects and the draft directories\n"
             "linked to them) kept to the drafter serving, every drafter `drafter rollback` can reach, and any a\n"
             "process names or has open (/proc/PID/cmdline, fd, maps); the other drafters, objects no kept drafter\n"
             "names and .part files no send is writing are deleted. Only files patchctl created; the rest is listed\n"
             "as left. Exit 0 done; 3 a host could not be reached; 4 locked by another run (a deploy in progress).")
    gp.add_argument("--dry-run", action="store_true",
                    help="list what would be freed, with sizes, and touch nothing (no lock either)")
    limit_arg(gp)
    hostkeys_args(gp)


def drafter_parsers(cmd: Commands) -> None:
    sp = cmd("drafter", "trained EAGLE-3 drafters: check, measure acceptance, deploy with a canary, roll back",
             "Trained EAGLE-3 drafters for the served models: check a draft directory against its target and its\n"
             "training data, and measure the acceptance length each host's server achieves.")
    dcmd = cmd.nested(sp, "drafter_command", "ACTION", "actions", "run `patchctl drafter ACTION --help` for its options")
    for add in (_drafter_check, _drafter_bench, _drafter_deploy, _drafter_rollback, _drafter_gc):
        add(dcmd)
