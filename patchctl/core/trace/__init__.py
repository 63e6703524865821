"""Static reachability: does the code a series changes run for a given model architecture?

A capture patch that is never executed costs a 5-30 minute restart to discover.
This package answers, with `ast` only (SGLang is never imported), whether each
function a series changes is reachable from the served model's entry class
`forward`, and whether it sits in a body the CUDA graphs replay without running
Python. Its parts, each building on the one before:

    changes   the functions a series changes (unified diff -> changed lines -> defs)
    plugin    a plugin series' changed functions: its hook targets resolved in the tree; who loads plugins
    index     the source index: lazily parsed modules, imports, classes, MRO, attribute types
    graph     the call graph over the index: one node per function as executed, BFS walks
    tracer    the CUDA-graph rule: entry classes, the prefill body, a trace per architecture
    report    `patchctl trace` and `check --arch`: stage a series, sweep architectures, report

The names below are the public API (`patchctl trace`, in commands.listing, runs `cached_check`; `plan` runs `check_series`).
"""

from patchctl.core.trace.changes import ChangedFunction, changed_functions
from patchctl.core.trace.graph import CallGraph
from patchctl.core.trace.index import SourceIndex
from patchctl.core.trace.plugin import HookTarget, PluginLoader, plugin_loaders, plugin_targets, resolve_target
from patchctl.core.trace.report import check_reachability, check_series, series_targets
from patchctl.core.trace.tracer import GraphWarning, Tracer, TraceResult, arch_from_model_config, entry_classes, trace

__all__ = ["CallGraph", "ChangedFunction", "GraphWarning", "HookTarget", "PluginLoader", "SourceIndex", "TraceResult",
           "Tracer", "arch_from_model_config", "changed_functions", "check_reachability", "check_series", "entry_classes",
           "plugin_loaders", "plugin_targets", "resolve_target", "series_targets", "trace"]
