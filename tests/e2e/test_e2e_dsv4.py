"""A whole tiny DeepSeek-V4 in the real server on CPU (CpuServer(model="dsv4")): the engine's
DeepSeek-V4 pool, its dsv4 attention backend on the GB10 (SM120) route with production's
`flashinfer` backend (its page split and FlashInfer call stood in: adapter/cpu/dsv4/flash_mla.py),
torch top-k, the UnifiedRadixCache, every layer kind (compress ratios 0 / 4 / 128), prompts
prefilled in 1024-token chunks (the compressor's state ring crosses chunks), a radix hit, and
decode.

The session's boot (tests/e2e/e2e_configs.py): stock. Issue 48 moved the adapters' scenarios to
the tiny DeepSeek-V4.1 (tests/e2e/test_e2e_dsv41.py, test_e2e_effects.py), the model the line
serves; this boot keeps what V4.1 does not have: c4 / c128 layers and the compressor's state ring
across chunks. (Until then a second boot, the control line, compared with it: T=0 ids equal,
logprobs within 1e-5, this model's noise floor; the DeepSeek noise floor is now dsv41's control
against its production line.)"""
import re

import pytest

from adapter.tools import canary

# The session's shared runs this module reads (booted by conftest's lane ahead of it).
SHARED_BOOTS = [("dsv4", "stock")]

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
    return [boots.config("dsv4", "stock")]


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


def test_stock_serves_the_traffic_with_radix_hits(runs):
    (stock,) = runs
    assert not stock.errors, stock.errors
    assert stock.records and all(r.ids for r in canary.records_of(stock))
    hits = {r.name: r.cached_tokens for r in stock.records}
    assert hits["cache-hit"] > 0 and hits["resume"] > 0      # the radix cache served hits
