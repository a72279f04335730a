"""swan acts in the real server on CPU: the tiny DeepSeek-V4.1 (CpuServer(model="dsv41"), the
model the line serves, with the engine's decoder SWA bounded replay on) on the engine's production
SM12x backend (`flashinfer`: its 256 -> 4 x 64-token page split before every sparse decode call,
with the CPU stand-ins of adapter/cpu/dsv4/flash_mla.py), on the session's dsv41 control boot
(swan off) and its production-line boot (tests/e2e/e2e_configs.py; both with --enable-metrics,
canary.MODEL_ARGS). Issue 48 moved it from the tiny DeepSeek-V4. The harness's swan module
directory is the built one, runtime/build/swan256, verified at install as in the image; this
process has no CUDA, so the router's kernel is the CPU twin, adapter/swan/twin.py.

What the two boots show:
  * swan installs in the scheduler naming the CPU twin, routes the decode calls (<= 64 query rows)
    to it (the first-served line; /metrics dsv41_swan_served_total) and sends only prefill rows to
    the stock split (the one fallback reason);
  * the control boot's scheduler logs a page split of a decode call; the production boot's logs
    none (its prefill calls still split);
  * T=0 greedy ids are equal and logprobs within the canary's tolerance for the model over every
    record (canary.compare_runs).
What they do not show: the swan256 module's kernel (its bits are the GPU's); see docs/swan.md."""
import re

import pytest

from adapter.tools import canary, traffic

# The session's shared runs this module reads (booted by conftest's lane ahead of it).
SHARED_BOOTS = [("dsv41", "autotune_keep"), ("dsv41", "production")]

NEW_TOKENS = 16                                               # traffic.equality_run
LAYERS = 4                                                    # adapter/cpu/models.py dsv41
SPLIT = "[dsv41-cpu] dsv4 page split: "
SERVED_LINE = re.compile(r"\[dsv41\] swan first in-place decode: (\d+) rows, \d+ heads, topk \d+; "
                         r"kernel CPU twin \(")
PREFILL_REASON = "more than 64 query rows (engine prefill path)"


@pytest.fixture(scope="module")
def runs(boots):
    return {"stock": boots.config("dsv41", "autotune_keep"), "swan": boots.config("dsv41", "production")}


def _splits(lines, path):
    return [ln[ln.index(SPLIT):] for ln in lines if SPLIT + path + "," in ln]


def test_no_scheduler_error(runs):
    for name, run in runs.items():
        assert not run.errors, (name, run.errors)


def test_swan_installs_with_the_cpu_twin_and_serves_decode_calls(runs):
    swan = runs["swan"].lines("sglang::scheduler")
    installed = [ln for ln in swan if "[dsv41] swan installed: " in ln]
    assert len(installed) == 1 and "; kernel CPU twin (no CUDA in this process" in installed[0], installed
    assert "engine SM120 backend flashinfer" in installed[0]
    served = [m for ln in swan for m in [SERVED_LINE.search(ln)] if m]
    assert len(served) == 1 and 1 <= int(served[0].group(1)) <= 64, served
    run = runs["swan"]
    count = run.metric("dsv41_swan_served_total", tp_rank="0")
    # every decode step of every layer is a served call: the short prompt alone decodes 15 steps
    assert count >= LAYERS * (NEW_TOKENS - 1), count
    fallbacks = run.metric_labels("dsv41_fallbacks_total", "reason", adapter="swan")
    assert set(fallbacks) == {PREFILL_REASON}, fallbacks
    print(f"\nswan: {count:.0f} calls served in place, "
          f"{run.metric('dsv41_fallbacks_total', adapter='swan'):.0f} prefill calls split")


def test_decode_calls_split_in_stock_and_not_with_swan(runs):
    """Stock splits every decode call. With swan no decode call falls back to the split (its only
    fallback reason is the prefill rows); the stock split runs on a decode shape only as swan's
    self-check at first use (DSV41_SWAN_SELFCHECK, on by default): once per new key, so the
    decode shapes whose split is logged (once per row count) are at most the keys verified."""
    stock, swan = runs["stock"].lines("sglang::scheduler"), runs["swan"].lines("sglang::scheduler")
    assert _splits(stock, "decode"), "the stock boot logged no page split of a decode call"
    run = runs["swan"]
    fallbacks = run.metric_labels("dsv41_fallbacks_total", "reason", adapter="swan")
    assert set(fallbacks) == {PREFILL_REASON}, fallbacks
    verified = run.metric("dsv41_swan_selfcheck_verified_total", tp_rank="0")
    assert run.metric("dsv41_swan_selfcheck_failed_total", tp_rank="0") == 0
    assert len(_splits(swan, "decode")) <= verified, (_splits(swan, "decode"), verified)
    print(f"\nswan self-check: {verified:.0f} decode keys verified bit-identical to the stock split")
    # prefill rows keep the stock split in both boots
    assert _splits(stock, "prefill") and _splits(swan, "prefill")
    assert not any("stock split was reached" in ln for ln in swan)


def test_greedy_ids_equal_and_logprobs_within_stock_spread(runs):
    cmp = canary.compare_runs("dsv41", runs["stock"], runs["swan"])
    print(f"\nmax logprob diff control vs production (swan's CPU twin): {cmp.max_logprob_diff:.3g} "
          f"(tolerance {canary.LOGPROB_TOL.get('dsv41', traffic.LOGPROB_TOL)})")
    assert cmp.ok and cmp.total > 0, cmp
