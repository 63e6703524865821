"""`patchctl drafter`: a trained EAGLE-3 drafter judged before it serves (check) and measured while it does
(bench). Both are read-only; the lead's `drafter deploy` builds on commands/drafter/checks.py and `bench.measure`."""
