"""The adapters' counters as `dsv41_*` series on the engine's own `/metrics` (`--enable-metrics`).

One source: `receipts.counters` (a Counter per adapter). Each increment there is also added, in
the process that counted it, to a prometheus_client Counter in the engine's multiprocess
directory (PROMETHEUS_MULTIPROC_DIR), which the engine's `/metrics` (a MultiProcessCollector in
the launcher) already serves. No collector, no registry and no endpoint of ours.

On or off is settled once per process, when the engine publishes its config
(`runtime_context.publish(server_args, role=...)`, which every engine process calls: the launcher
as "tokenizer", each scheduler, the detokenizer). The entry points call `arm()` once per process;
it wraps `publish` when the engine imports runtime_context (pinned like any engine callable we
wrap, table.INFRA_TOUCHES). Exporting starts when `enable_metrics` is set, the engine's
PROMETHEUS_MULTIPROC_DIR exists, and an installed adapter counts in this process's role
(table.COUNTING_ROLE: the scheduler for most, the launcher for input_guard and admin_guard); otherwise
the process stays off, quietly. Until then nothing is imported: prometheus_client picks its value
class (per-process files or in-memory) at its first import, and the launcher sets the directory
just before it publishes. Off: prometheus_client is never imported from here, nothing is written,
and no sink is registered with receipts, so counting costs what it costs without metrics. The
adapters' hooks carry nothing of ours: no per-call settle check.

When exporting starts, the counts made so far are added, every plain series of each installed
adapter of this role is created at 0 (it is on `/metrics` before its first event), and
`dsv41_adapter_installed{adapter,version}` is set for the adapters of this role (1 installed,
0 off; gauge mode "mostrecent", as the engine's own gauges). Every counter carries `tp_rank`: the engine keeps its own collectors
on attention-TP rank 0 only, ours count on every rank.

Metrics never break serving: an exception here is one fallback line (adapter "metrics") and that
counter is no longer exported; receipts keep counting. Series and what they mean: SERIES below and
docs/metrics.md.
"""
from __future__ import annotations

import functools
import os
import sys

from adapter import input_guard, receipts

NAME = "metrics"
ENGINE_CONTEXT = "sglang.srt.runtime_context"

# Series: prometheus_client Counter name (exposed as <name>_total) -> (help, labels besides tp_rank).
SERIES = {
    "dsv41_fallbacks": ("Adapter decisions that kept the engine's stock path, by adapter and "
                        "reason (receipts.fallback; the line is logged once, counted every time)",
                        ("adapter", "reason")),
    "dsv41_swan_served": ("SWA decode calls served in place on 256-token pages (no 4x64 split); "
                          "split calls are dsv41_fallbacks_total{adapter=\"swan\"}", ()),
    "dsv41_swan_selfcheck_verified": ("Decode keys whose in-place output equalled the stock split's "
                                      "bit for bit at first use, agreed by every TP rank", ()),
    "dsv41_swan_selfcheck_failed": ("Decode keys whose first-use self-check failed on some TP rank "
                                    "(the key keeps the stock split on every rank)", ()),
    "dsv41_decode_yield_chunks_yielded": ("Non-final prefill chunks after which decode streams "
                                          "got yield steps", ()),
    "dsv41_decode_yield_steps_planned": ("Decode steps planned before the next chunk", ()),
    "dsv41_decode_yield_steps_run": ("Planned decode steps that ran (the chunk waited)", ()),
    "dsv41_decode_yield_early_ends": ("Yields ended before their plan, by reason", ("reason",)),
    "dsv41_decode_yield_lone_chunks": ("Non-final chunks with too few decode rows to yield to", ()),
    "dsv41_decode_yield_achieved_share": ("Sum over yielded prompts of the share of time their "
                                          "decode streams got, by the engine's own step timings "
                                          "(a measurement, never a decision input); over "
                                          "dsv41_decode_yield_share_measured_total: the mean", ()),
    "dsv41_decode_yield_share_measured": ("Yielded prompts whose achieved share was measured", ()),
    "dsv41_decode_yield_online_scales_agreed": ("Plans whose chunk and decode step time scales "
                                                "were read from the engine's step timings and "
                                                "agreed over the TP group "
                                                "(DSV41_DECODE_YIELD_ONLINE)", ()),
    "dsv41_decode_yield_online_replans": ("Yield plans redone from the chunk's measured time and "
                                          "the decode steps timed since, agreed over the TP group "
                                          "(DSV41_DECODE_YIELD_ONLINE)", ()),
    "dsv41_swa_thin_hooked_inserts": ("checkpoint_into_tree calls seen", ()),
    "dsv41_swa_thin_checkpoints_passed": ("Checkpoints whose request moved past them", ()),
    "dsv41_swa_thin_nodes_moved": ("SWA LRU nodes moved to the evict-first end", ()),
    "dsv41_swa_thin_kept": ("Nodes of a passed checkpoint left in place, by reason", ("reason",)),
    "dsv41_swa_thin_tree_core": ("Radix caches built, by the tree core serving them", ("core",)),
    "dsv41_swa_cone_candidates": ("Matches whose lost SWA window could be replayed", ()),
    "dsv41_swa_cone_plans": ("Replays planned", ()),
    "dsv41_swa_cone_replay_tokens": ("Tokens replayed by the planned replays", ()),
    "dsv41_swa_cone_copies": ("Replay copies of full-attention latents into the replay rows", ()),
    "dsv41_swa_cone_plans_dropped": ("Replay plans removed before their first pass ran", ()),
    "dsv41_swa_cone_replays_aborted": ("Planned requests failed (HTTP 503): their replay could "
                                       "not be prepared exactly", ()),
    "dsv41_swa_cone_first_pass_cut_at_f": ("First passes cut to end at F beside the engine's "
                                           "decoder SWA bounded replay", ()),
    "dsv41_autotune_keep_kept": ("Autotune caches kept: loadable on every rank", ()),
    "dsv41_autotune_keep_deleted": ("Autotune caches deleted before the rank exchange, by kind; "
                                    "the rank re-tunes", ("kind",)),
    "dsv41_autotune_keep_tuned": ("Ranks that tuned with no cache on disk, by reason", ("reason",)),
    "dsv41_autotune_keep_dropped": ("Caches dropped because another rank could not load its own",
                                    ("reason",)),
    "dsv41_autotune_keep_sealed": ("Launch sidecars sealed after the engine saved its cache", ()),
    "dsv41_input_guard_checked": ("Requests the tokenizer manager checked for fields the stock "
                                  "scheduler dies on", ()),
    "dsv41_input_guard_rejected": ("Requests answered 400 because a field would have killed the "
                                   "scheduler (by field), or the guard could not check them "
                                   "(unchecked)", ("reason",)),
    "dsv41_admin_guard_refused": ("Requests to the engine's admin routes (ADMIN_OPTIONAL) answered "
                                  "403 because no --admin-api-key is configured, by route (its "
                                  "path template)", ("route",)),
    "dsv41_admin_guard_engine_calls": ("The engine's own admin requests let through (its "
                                       "post-warmup POST /freeze_gc)", ()),
}
INSTALLED = "dsv41_adapter_installed"
INSTALLED_HELP = "1 when the dsv41 adapter is installed in this engine, 0 when its key is unset"

# Counter key -> (series, label values). A key "prefix:" maps every "prefix:<value>" key, the
# value filling the series' one label. "fallback:" is common to every adapter.
KEYS = {
    "*": {"fallback:": "dsv41_fallbacks"},
    "swan": {"served": ("dsv41_swan_served", ()),
             "selfcheck_verified": ("dsv41_swan_selfcheck_verified", ()),
             "selfcheck_failed": ("dsv41_swan_selfcheck_failed", ())},
    "decode_yield": {
        "chunks_yielded": ("dsv41_decode_yield_chunks_yielded", ()),
        "steps_planned": ("dsv41_decode_yield_steps_planned", ()),
        "steps_deferred": ("dsv41_decode_yield_steps_run", ()),
        "ended_early_chunked_req_gone": ("dsv41_decode_yield_early_ends", ("chunked_req_gone",)),
        "ended_early_streams_finished": ("dsv41_decode_yield_early_ends", ("streams_finished",)),
        "lone_chunks": ("dsv41_decode_yield_lone_chunks", ()),
        "achieved_share": ("dsv41_decode_yield_achieved_share", ()),
        "share_measured": ("dsv41_decode_yield_share_measured", ()),
        "online_scales_agreed": ("dsv41_decode_yield_online_scales_agreed", ()),
        "online_replans": ("dsv41_decode_yield_online_replans", ()),
    },
    "swa_thin": {
        "hooked_inserts": ("dsv41_swa_thin_hooked_inserts", ()),
        "checkpoints_passed": ("dsv41_swa_thin_checkpoints_passed", ()),
        "nodes_moved": ("dsv41_swa_thin_nodes_moved", ()),
        "kept:": "dsv41_swa_thin_kept",
        "core:": "dsv41_swa_thin_tree_core",
    },
    "swa_cone": {
        "candidates": ("dsv41_swa_cone_candidates", ()),
        "plans": ("dsv41_swa_cone_plans", ()),
        "replay_tokens": ("dsv41_swa_cone_replay_tokens", ()),
        "copies": ("dsv41_swa_cone_copies", ()),
        "plans_dropped": ("dsv41_swa_cone_plans_dropped", ()),
        "replays_aborted": ("dsv41_swa_cone_replays_aborted", ()),
        "first_pass_cut_at_F": ("dsv41_swa_cone_first_pass_cut_at_f", ()),
    },
    "autotune_keep": {
        "kept": ("dsv41_autotune_keep_kept", ()),
        "deleted:": "dsv41_autotune_keep_deleted",
        "tune:": "dsv41_autotune_keep_tuned",
        "dropped:": "dsv41_autotune_keep_dropped",
        "sealed": ("dsv41_autotune_keep_sealed", ()),
    },
    "input_guard": {
        "checked": ("dsv41_input_guard_checked", ()),
        "rejected:": "dsv41_input_guard_rejected",
    },
    "admin_guard": {
        "refused:": "dsv41_admin_guard_refused",
        "engine_calls": ("dsv41_admin_guard_engine_calls", ()),
    },
}
# Keys with a label value that are created at 0 too (every plain key of an installed adapter is).
ZERO_KEYS = {
    "swa_thin": ("kept:in-new-window", "kept:locked", "kept:session"),
    "decode_yield": (),
    "autotune_keep": ("tune:no-cache", "dropped:peer", "deleted:corrupt", "deleted:no-sidecar",
                      "deleted:sidecar-corrupt", "deleted:launch", "deleted:sealed-mismatch",
                      "deleted:stamp"),
    "input_guard": tuple(f"rejected:{reason}" for reason in input_guard.REASONS),
    "admin_guard": ("refused:/dump_expert_distribution_record",),   # the one that kills stock
}

_state: bool | None = None      # None: not settled yet; True: exporting; False: off
_tp_rank = ""
_metrics: dict = {}             # series name -> prometheus_client metric
_children: dict = {}            # (adapter, key) -> labelled child
_dropped: set = set()           # (adapter, key) no longer exported after an error
_armed = False
_roles: list = []               # adapters that count in this process's role (once exporting)
_MARK = "__dsv41_metrics_settle__"


def off() -> bool:
    return _state is False


def on() -> bool:
    return _state is True


def series_of(adapter: str, key: str) -> tuple[str, tuple[str, ...]]:
    """(series name, label values without tp_rank) of a counter key; LookupError if unmapped."""
    table = KEYS.get(adapter, {})
    if key in table and not key.endswith(":"):
        return table[key]
    prefix, sep, value = key.partition(":")
    if sep:
        if prefix + ":" in table:
            return table[prefix + ":"], (value,)
        if prefix + ":" in KEYS["*"]:
            return KEYS["*"][prefix + ":"], (adapter, value)
    raise LookupError(f"no dsv41 series for the {adapter} counter {key!r}")


def arm() -> None:
    """Settle on/off when the engine publishes its config in this process (idempotent)."""
    global _armed
    if _armed:
        return
    _armed = True
    import wrapt

    wrapt.register_post_import_hook(_wrap_publish, ENGINE_CONTEXT)


def _wrap_publish(module) -> None:
    original = module.publish
    if getattr(original, _MARK, False):
        return
    from adapter import pins

    drift = pins.drifted_touches("metrics")
    if drift:
        _turn_off(f"engine internal {drift[0]} does not match its pin; dsv41 series not exported")
        return

    @functools.wraps(original)
    def publish(*args, **kwargs):
        result = original(*args, **kwargs)
        try:
            settle(kwargs.get("role"))
        except Exception as exc:  # noqa: BLE001 - metrics never break serving
            _turn_off(f"settling failed ({type(exc).__name__}: {exc}); dsv41 series not exported")
        return result

    setattr(publish, _MARK, True)
    module.publish = publish
    try:    # modules that did `from runtime_context import publish` before we were armed
        from sglang.srt.plugins.hook_registry import _propagate_patch
    except ImportError:     # (unit tests' stand-in runtime_context)
        _propagate_patch = None
    if _propagate_patch is not None:
        _propagate_patch(original, publish, module)
    role = getattr(module, "publish_role", lambda: None)()
    if role is not None:                            # published before we were armed
        settle(role)


def _roles_adapters(role) -> tuple[list[str], list[str]]:
    """(installed or still to install, all) adapters that count in processes of `role`. An
    adapter installs when the engine imports its module, which may come after publish()."""
    from adapter import installer
    from adapter.table import COUNTING_ROLE

    status = installer.status()
    mine = [n for n in status if COUNTING_ROLE.get(n, "scheduler") == role]
    return [n for n in mine if status[n].status in ("installed", "waiting")], mine


def settle(role=None) -> None:
    """Decide on/off from the engine's published config; a no-op until it is published."""
    if _state is not None:
        return
    context = sys.modules.get(ENGINE_CONTEXT)
    if context is None:
        return
    try:
        if not context.get_context().is_config_namespace_published("observability"):
            return
        enabled = bool(context.get_observability().enable_metrics)
    except Exception as exc:  # noqa: BLE001 - metrics never break serving
        _turn_off(f"could not read the engine's observability config ({type(exc).__name__}: "
                  f"{exc}); dsv41 series not exported")
        return
    installed, mine = _roles_adapters(role)
    if not enabled or not installed:
        _turn_off(None)           # nothing of ours counts here, or metrics are off: quietly
    elif not os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        _turn_off("--enable-metrics without the engine's PROMETHEUS_MULTIPROC_DIR in this "
                  "process; dsv41 series not exported")
    else:
        _start(context, installed, mine)


def _turn_off(reason: str | None) -> None:
    global _state
    _state = False
    receipts.remove_sink(_export)
    receipts.remove_install_sink(_installed_later)
    _metrics.clear()
    _children.clear()
    if reason is not None:
        receipts.fallback(NAME, reason)


def _start(context, installed: list[str], mine: list[str]) -> None:
    global _state, _tp_rank
    try:
        try:
            _tp_rank = str(context.get_parallel().tp_rank)
        except Exception:  # noqa: BLE001 - a process with no rank bundle (the launcher)
            _tp_rank = ""
        import prometheus_client

        from adapter import __version__

        from adapter import installer

        gauge = prometheus_client.Gauge(INSTALLED, INSTALLED_HELP, ("adapter", "version"),
                                        registry=None, multiprocess_mode="mostrecent")
        _metrics[INSTALLED] = gauge
        status = installer.status()
        for name in mine:        # one still waiting for its engine module is set when it installs
            if status[name].status != "waiting":
                gauge.labels(name, __version__).set(1 if status[name].status == "installed" else 0)
        # What was counted before this moment; from here on each increment is exported as made.
        before = [(name, key, value) for name, counts in list(receipts.counters.items())
                  for key, value in list(counts.items()) if value > 0]
        _state = True
        receipts.add_sink(_export)
        receipts.add_install_sink(_installed_later)
        _roles[:] = mine
    except Exception as exc:  # noqa: BLE001 - metrics never break serving
        _turn_off(f"exporter failed to start ({type(exc).__name__}: {exc}); dsv41 series not "
                  "exported, receipts keep counting")
        return
    for name in installed:
        if status[name].status == "installed":
            _zero_series(name)
    for name, key, value in before:
        _export(name, key, value)
    receipts.line(NAME, "exporting the adapters' counters as dsv41_* series on the engine's "
                  "/metrics (tp_rank %s)", _tp_rank or "-")


def _zero_series(name: str) -> None:
    """Every plain series of an installed adapter (and its known label values), at 0."""
    for key in [k for k in KEYS.get(name, {}) if not k.endswith(":")] + list(ZERO_KEYS.get(name, ())):
        _export(name, key, 0)


def _installed_later(name: str) -> None:
    """receipts.installed: an adapter of this role installed after exporting started."""
    if _state is not True or name not in _roles:
        return
    try:
        from adapter import __version__

        _metrics[INSTALLED].labels(name, __version__).set(1)
    except Exception as exc:  # noqa: BLE001 - metrics never break serving
        receipts.fallback(NAME, f"installed gauge of {name} not set ({type(exc).__name__}: {exc})")
    _zero_series(name)


def _child(adapter: str, key: str):
    import prometheus_client

    name, values = series_of(adapter, key)
    metric = _metrics.get(name)
    if metric is None:
        help_text, labels = SERIES[name]
        metric = _metrics[name] = prometheus_client.Counter(name, help_text, labels + ("tp_rank",),
                                                            registry=None)
    return metric.labels(*values, _tp_rank)


def _export(adapter: str, key: str, amount: int) -> None:
    child = _children.get((adapter, key))
    try:
        if child is None:
            if (adapter, key) in _dropped:
                return
            child = _children[(adapter, key)] = _child(adapter, key)
        child.inc(amount)
    except Exception as exc:  # noqa: BLE001 - metrics never break serving
        _children.pop((adapter, key), None)
        _dropped.add((adapter, key))
        if adapter != NAME:   # our own fallback count failing: its cause has its line already
            receipts.fallback(NAME, f"{adapter} counter {key!r} dropped from /metrics "
                                    f"({type(exc).__name__}: {exc}); receipts keep counting")


def reset_for_tests() -> None:
    """Back to "not settled" (unit tests that publish configs of their own)."""
    global _state, _tp_rank
    _state, _tp_rank = None, ""
    receipts.remove_sink(_export)
    receipts.remove_install_sink(_installed_later)
    _roles.clear()
    _metrics.clear()
    _children.clear()
    _dropped.clear()
