"""dsv41_* series on the real engine's /metrics (--enable-metrics), against the receipt lines.

Three boots of the production keys on the CPU harness (adapter/cpu/server.py): dense and swa with
--enable-metrics (scraped after traffic that makes each adapter act, before the server stops),
and swa without it, with a PROMETHEUS_MULTIPROC_DIR of the test's own set (the directory alone
must not turn exporting on). Every process of each server reports who imports prometheus_client
(DSV41CPU_WATCH_IMPORTS). docs/dashboard.json is checked against what the real server exports.
"""
import collections
import dataclasses
import json
import pathlib
import re

import pytest
from prometheus_client.parser import text_string_to_metric_families

from adapter import __version__, metrics
from adapter.table import ADAPTERS
from adapter.tools import canary
from e2e.e2e_configs import REPO_ROOT

# The session's shared runs this module reads (booted by conftest's lane ahead of it).
SHARED_BOOTS = [("dense", "production"), ("dsv41", "production"), ("dense", "decode_yield")]

WATCH = "prometheus_client"
YIELD_LINE = re.compile(r"\[dsv41\] decode_yield rid=\S+ left chunked prefill: (\d+) chunks yielded, "
                        r"(\d+) decode steps planned, (\d+) run, (\d+) ended early")
FALLBACK_LINE = re.compile(r"\[dsv41\] (\w+) fallback: (.*) \(logged once\)$")


@dataclasses.dataclass
class Scraped:
    model: str
    status: int
    text: str
    samples: dict          # (name, frozenset(labels)) -> value
    logs: dict             # process log name -> text
    boot_s: float
    wall_s: float

    def value(self, name, **labels):
        return self.samples.get((name, frozenset(labels.items())))

    def series(self, name):
        return {labels: v for (n, labels), v in self.samples.items() if n == name}

    def scheduler_lines(self):
        return [ln for role, text in self.logs.items() if role.startswith("sglang::scheduler")
                for ln in text.splitlines()]

    def process_lines(self, process):
        """Lines of the scheduler(s) or of the launcher (canary.install_process names them)."""
        prefix = "sglang::scheduler" if process == "scheduler" else "launcher"
        return [ln for role, text in self.logs.items() if role.startswith(prefix)
                for ln in text.splitlines()]

    def all_lines(self):
        return [ln for text in self.logs.values() for ln in text.splitlines()]


def _parse(text):
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def _scraped(run) -> Scraped:
    """A session boot (canary.ConfigRun) with its /metrics scrape (run.extras)."""
    assert not run.errors, run.errors
    status, text = run.extras["metrics_status"], run.extras["metrics_text"]
    return Scraped(run.model, status, text, _parse(text) if status == 200 else {}, run.logs,
                   run.boot_s, 0.0)


@pytest.fixture(scope="module")
def dense(boots):
    return _scraped(boots.config("dense", "production"))


@pytest.fixture(scope="module")
def dsv4(boots):
    """The tiny DeepSeek-V4.1's production boot (issue 48: the model the line serves; the fixture
    keeps its name for the DeepSeek family)."""
    return _scraped(boots.config("dsv41", "production"))


@pytest.fixture(scope="module")
def metrics_off(boots):
    """decode_yield alone on the dense model: no --enable-metrics, but a PROMETHEUS_MULTIPROC_DIR
    of the session's own (tests/e2e/e2e_configs.py)."""
    run = boots.config("dense", "decode_yield")
    return _scraped(run), pathlib.Path(run.extras["prometheus_dir"])


def _check_against_receipts(run: Scraped):
    """What holds on both models: every series is there and equals what the receipts say."""
    assert run.status == 200, run.text[:500]
    lines = run.scheduler_lines()
    # one exporting line per scheduler; every sample of ours carries its tp_rank
    assert sum("[dsv41] metrics exporting the adapters' counters" in ln for ln in lines) == 1
    ours = {k: v for k, v in run.samples.items() if k[0].startswith("dsv41_")}
    for (name, labels), _ in ours.items():
        if name != "dsv41_adapter_installed":
            # input_guard and admin_guard count in the launcher (no TP rank there); the others
            # in the scheduler
            launcher = name.startswith(("dsv41_input_guard", "dsv41_admin_guard")) or \
                dict(labels).get("adapter") in ("input_guard", "admin_guard")
            assert dict(labels)["tp_rank"] == ("" if launcher else "0"), (name, labels)
    # installed gauge: one per adapter, 1 exactly where the process it acts in logged "installed"
    for adapter in ADAPTERS:
        logged = any(f"[dsv41] {adapter} installed:" in ln
                     for ln in run.process_lines(canary.install_process(adapter)))
        assert logged, adapter               # the production keys enable every adapter
        # a gauge set to 1 and read back from Prometheus text: no arithmetic, but a float all the same
        assert run.value("dsv41_adapter_installed", adapter=adapter, version=__version__) == pytest.approx(1.0, abs=1e-9)
    # every plain series of every adapter is exported (at 0 before its first event)
    names = {n for n, _ in ours}
    for series, (_, labels) in metrics.SERIES.items():
        if not labels:
            assert f"{series}_total" in names, series
    # decode yield: the sums of the receipt lines (one per chunked prompt that yielded)
    got = [tuple(map(int, m.groups())) for ln in lines for m in [YIELD_LINE.search(ln)] if m]
    chunks, planned, ran, early = (sum(col) for col in zip(*got)) if got else (0, 0, 0, 0)
    assert run.value("dsv41_decode_yield_chunks_yielded_total", tp_rank="0") == chunks
    assert run.value("dsv41_decode_yield_steps_planned_total", tp_rank="0") == planned
    assert run.value("dsv41_decode_yield_steps_run_total", tp_rank="0") == ran
    assert sum(run.series("dsv41_decode_yield_early_ends_total").values()) == early
    # fallbacks: the (adapter, reason) pairs counted are exactly the logged ones (each logged once)
    logged = {m.groups() for ln in run.all_lines() for m in [FALLBACK_LINE.search(ln)] if m}
    counted = {(dict(l)["adapter"], dict(l)["reason"]): v
               for l, v in run.series("dsv41_fallbacks_total").items()}
    assert set(counted) == logged and all(v >= 1 for v in counted.values()), (counted, logged)
    assert not any(a == "metrics" for a, _ in counted), counted     # the exporter itself: no error
    # cone: plans / copies are one receipt line each
    assert run.value("dsv41_swa_cone_plans_total", tp_rank="0") == sum(" swa_cone plan " in ln for ln in lines)
    assert run.value("dsv41_swa_cone_copies_total", tp_rank="0") == sum(" swa_cone copy " in ln for ln in lines)
    # autotune_keep: not compared here. On these single-rank CPU boots it has nothing to count
    # (FlashInfer tunes on GPUs only, and the CPU harness's agreement rounds,
    # DSV41CPU_AUTOTUNE_AGREE, need more than one TP rank: tests/e2e/test_e2e_tp2.py), so its
    # series and its receipt lines would both be 0 and the comparison could not fail. Its series
    # are checked above to exist; its counts against its receipt lines are checked where they
    # are produced (tests/test_autotune_keep.py, tests/e2e/test_e2e_tp2.py).
    # thin: one tree-core count per cache built
    cores = {dict(l)["core"]: v for l, v in run.series("dsv41_swa_thin_tree_core_total").items()}
    assert sum(cores.values()) == 1, cores
    return cores, counted, (chunks, planned, ran, early)


def test_dense_series_match_the_receipts(dense):
    cores, counted, yielded = _check_against_receipts(dense)
    assert yielded[0] > 0 and yielded[2] > 0, "the streams beside the chunked prompt got yield steps"
    assert cores == {"rust": 1.0}          # no SWA component: thin keeps Rust, with its fallback
    assert any(a == "swa_thin" and "no SWA component" in r for a, r in counted)
    assert dense.value("dsv41_swa_thin_nodes_moved_total", tp_rank="0") == 0
    # swan: no SM120 decode call on a Llama (torch_native): nothing served, nothing split
    assert not any("[dsv41] swan first in-place decode" in ln for ln in dense.scheduler_lines())
    assert dense.value("dsv41_swan_served_total", tp_rank="0") == 0
    assert not any(a == "swan" for a, _ in counted)
    # cone declines on a model without DeepSeek-V4 attention: no plan
    assert dense.value("dsv41_swa_cone_plans_total", tp_rank="0") == 0


def test_dsv4_series_match_the_receipts(dsv4):
    """The tiny DeepSeek-V4.1 (decoder SWA bounded replay on): every adapter acts, and each count
    equals its receipts."""
    cores, counted, _ = _check_against_receipts(dsv4)
    lines = dsv4.scheduler_lines()
    assert cores == {"dsv41_thin": 1.0}      # thin's own tree core (adapter/swa_thin/core.py)
    assert sum("[dsv41] swa_thin tree core: dsv41_thin instead of rust" in ln for ln in lines) == 1
    inserts = dsv4.value("dsv41_swa_thin_hooked_inserts_total", tp_rank="0")
    passed = dsv4.value("dsv41_swa_thin_checkpoints_passed_total", tp_rank="0")
    moved = dsv4.value("dsv41_swa_thin_nodes_moved_total", tp_rank="0")
    assert 0 < passed <= inserts and moved > 0, (inserts, passed, moved)
    # cone replayed the lost window (its plan / copy lines were counted by _check_against_receipts)
    assert dsv4.value("dsv41_swa_cone_plans_total", tp_rank="0") > 0
    assert dsv4.value("dsv41_swa_cone_replay_tokens_total", tp_rank="0") > 0
    # swan: decode calls served in place by the CPU twin; only prefill calls kept the split
    assert any("[dsv41] swan first in-place decode" in ln for ln in lines)
    assert dsv4.value("dsv41_swan_served_total", tp_rank="0") > 0
    swan_reasons = [r for a, r in counted if a == "swan"]
    assert swan_reasons and all("query rows" in r for r in swan_reasons), swan_reasons


def test_engine_series_and_ours_share_the_one_endpoint(dense):
    names = {n for n, _ in dense.samples}
    assert "sglang:prompt_tokens_total" in names and "sglang:gen_throughput" in names
    assert any(n.startswith("dsv41_") for n in names)


def test_metrics_off_no_series_no_import_nothing_written(metrics_off):
    run, prom_dir = metrics_off
    lines = run.all_lines()
    # the adapter did act and count (receipts) in this boot: decode yield yielded
    assert any(YIELD_LINE.search(ln) for ln in lines)
    assert not any("[dsv41] metrics " in ln for ln in lines)
    assert "dsv41_" not in run.text                      # the engine serves no /metrics at all
    assert run.status == 404, (run.status, run.text[:300])
    assert list(prom_dir.iterdir()) == []
    imports = [ln for ln in lines if f"[dsv41-cpu] imported {WATCH} from" in ln]
    assert not [ln for ln in imports if str(REPO_ROOT / "adapter") in ln], imports
    assert imports == [], imports   # nor does the engine import it with metrics off


def _exprs(node):
    if isinstance(node, dict):
        for k, v in node.items():
            if k == "expr":
                yield v
            else:
                yield from _exprs(v)
    elif isinstance(node, list):
        for v in node:
            yield from _exprs(v)


def test_dashboard_expressions_name_series_the_real_server_exports(dense, dsv4):
    board = json.loads((REPO_ROOT / "docs" / "dashboard.json").read_text())
    exported = {n for run in (dense, dsv4) for n, _ in run.samples}
    exprs = list(_exprs(board))
    assert len(exprs) >= 20
    named = collections.Counter()
    for expr in exprs:
        found = re.findall(r"\b(dsv41_[a-z0-9_]+|sglang:[a-zA-Z0-9_:]+)", expr)
        assert found, expr
        for name in found:
            assert name in exported, (name, expr)
            named[name] += 1
    # one row per adapter, every dsv41 series on the board, the engine's throughput and TTFT too
    rows = [p["title"] for p in board["panels"] if p.get("type") == "row"]
    for adapter in ADAPTERS:
        assert any(adapter in title for title in rows), (adapter, rows)
    for series in list(metrics.SERIES) + [metrics.INSTALLED]:
        shown = series if series == metrics.INSTALLED else f"{series}_total"
        assert named[shown], shown
    assert named["sglang:gen_throughput"] and named["sglang:time_to_first_token_seconds_bucket"]

