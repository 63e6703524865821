"""Extraction runs (`patchctl capture run|status|collect`): a tokenized dataset pushed through every
verified capture server of the fleet exactly once, every dump verified on its host, the run journalled
on the controller so that it resumes after any crash, and the verified files collected into a dataset a
drafter trainer reads.

    dataset   the JSONL dataset: validated line by line before anything is sent
    journal   the run directory on the controller: run.json and the append-only, fsynced journal
    runner    `capture run`: probe, route samples over the hosts' SSH connections, journal results
    status    `capture status`: the journal read back (a capture run and/or a regeneration)
    collect   `capture collect`: files pulled (or indexed in place) into a collection directory
    onhost    `capture collect --on-host DIR`: every host converts its own files
    collection  the collection directory both write: what to do with each sample, index, summary

The host side is `patchctl/host/capture.py` (one long-running agent op per host and run).
"""
