"""A whole tiny DeepSeek-V4 in the real server on CPU (CpuServer(model="dsv4")): the engine's
DeepSeek-V4 pool, its dsv4 attention backend on the GB10 (SM120) route with production's
`flashinfer` backend (its page split and FlashInfer call stood in: adapter/cpu/dsv4/flash_mla.py),
torch top-k, the UnifiedRadixCache, every layer kind (compress ratios 0 / 4 / 128), prompts
prefilled in 1024-token chunks (the compressor's state ring crosses chunks), a radix hit, and
decode.

The session's boots (tests/e2e/e2e_configs.py): stock, and the control line (autotune_keep alone:
its cache agreement has no autotune cache to act on here, so the two boots compute alike). Their
T=0 ids equal and logprobs within 1e-5 over the whole traffic is this model's noise floor for the
equality tolerance (traffic.LOGPROB_TOL = 1e-4; two stock boots measured 0 difference)."""
import re

import pytest

from adapter.tools import canary, traffic

# The session's shared runs this module reads (booted by conftest's lane ahead of it).
SHARED_BOOTS = [("dsv4", "stock"), ("dsv4", "autotune_keep")]

# What the scheduler's log must show (engine lines, then the CPU stand-ins' receipts).
LOG_LINES = ("Initialize DeepSeekV4TokenToKVPool", "Using DeepseekV4AttnBackend",
             "Init Unified Radix Cache. Components: (<ComponentType.FULL: 0>, <ComponentType.SWA: 1>)",
             "impl=UnifiedRadixCache",
             "KVCacheConfigurator.configure (CPU fp8 KV refusal, V4 pool only)",
             "stand-ins in sglang.srt.layers.attention.dsv4.compressor_v2: create_paged_compressor_data",
             "stand-ins in sglang.kernels.ops.layernorm.mhc_head: fused_hc_head",
             # the engine's production SM12x backend (flashinfer): its page split ran in decode
             "stand-ins in sglang.kernels.ops.attention.flash_mla_sm120: _page_mark_kernel, _page_split_kernel",
             "[dsv41-cpu] dsv4 page split: decode, 1 rows: ")
CHUNK = 1024                                              # canary.MODEL_ARGS["dsv4"]


@pytest.fixture(scope="module")
def runs(boots):
    return [boots.config("dsv4", "stock"), boots.config("dsv4", "autotune_keep")]


def test_log_shows_v4_pool_backend_and_unified_radix_cache(runs):
    for run in runs:
        log = "\n".join(run.lines("sglang::scheduler"))
        missing = [line for line in LOG_LINES if line not in log]
        assert not missing, missing


def test_chunked_prompt_ran_in_chunks(runs):
    for run in runs:
        log = "\n".join(run.lines("sglang::scheduler"))
        # equality_run's 2,560-token prompt: 1024 + 1024 + 512
        assert re.search(rf"Prefill batch, #new-seq: 1, #new-token: {CHUNK}, .*#pending-token: 1536", log)
        assert re.search(r"Prefill batch, #new-seq: 1, #new-token: 512, ", log)


def test_stock_and_control_give_the_same_greedy_tokens(runs):
    first, again = runs
    assert not first.errors and not again.errors, (first.errors, again.errors)
    cmp = traffic.compare(canary.records_of(first), canary.records_of(again), tol=1e-5)
    print(f"\nmax logprob diff stock vs control: {cmp.max_logprob_diff:.3g} over {cmp.total} records")
    assert cmp.ok and cmp.total >= len(first.records) > 0, cmp
    hits = {r.name: r.cached_tokens for r in first.records}
    assert hits["cache-hit"] > 0 and hits["resume"] > 0      # the radix cache served hits
