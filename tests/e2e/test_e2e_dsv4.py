"""A whole tiny DeepSeek-V4 in the real server on CPU (CpuServer(model="dsv4")): the engine's
DeepSeek-V4 pool, its dsv4 attention backend on the GB10 (SM120) route with the torch sparse
decode and torch top-k, the UnifiedRadixCache, every layer kind (compress ratios 0 / 4 / 128),
a prompt prefilled in chunks (> the 512-token chunk: the compressor's state ring crosses chunks)
and decode. Two stock boots, one after the other, must give the same greedy ids and logprobs
within a small tolerance (the weights are seeded safetensors, adapter/cpu/models.py).

Cost: two boots (~1 min each on 2 cores) and ~30 s of prefill each."""
import re

import psutil
import pytest

from adapter.cpu.server import CpuServer, output_of

SHORT = [(i * 37 + 11) % 1000 + 3 for i in range(40)]
CHUNKED = [(i * 53 + 7) % 1000 + 3 for i in range(600)]   # 512 + 88: two chunks
PROMPTS = {"short": SHORT, "chunked": CHUNKED}
NEW_TOKENS = 4
LOGPROB_TOL = 1e-4
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


def _peak_rss_mb(pid: int) -> float:
    """VmHWM of a live process (psutil reads /proc; the peak is not in its portable API)."""
    with open(f"/proc/{pid}/status") as status:
        return int(re.search(r"VmHWM:\s+(\d+)", status.read()).group(1)) / 1024


def _boot_and_serve(name: str) -> dict:
    server = CpuServer(model="dsv4", name=name)
    try:
        server.start()
        outputs = {label: output_of(server.generate(ids, max_new_tokens=NEW_TOKENS))
                   for label, ids in PROMPTS.items()}
        schedulers = [pid for pid, role in server.roles.items() if str(role).startswith("sglang::scheduler")]
        rss = [round(_peak_rss_mb(pid)) for pid in schedulers if psutil.pid_exists(pid)]
        print(f"\n{name}: boot {server.boot_s:.1f} s, scheduler peak RSS {rss} MB, logs {server.log_dir}")
        return {"outputs": outputs, "log": server.log(), "boot_s": server.boot_s}
    finally:
        server.stop()
        assert not server.group_alive()


@pytest.fixture(scope="module")
def two_boots():
    return [_boot_and_serve("dsv4 stock"), _boot_and_serve("dsv4 stock again")]


def test_log_shows_v4_pool_backend_and_unified_radix_cache(two_boots):
    for boot in two_boots:
        missing = [line for line in LOG_LINES if line not in boot["log"]]
        assert not missing, missing


def test_chunked_prompt_ran_in_chunks(two_boots):
    for boot in two_boots:
        # The 600-token prompt: a 512-token chunk with 88 tokens pending, then the rest.
        assert re.search(r"Prefill batch, #new-seq: 1, #new-token: 512, .*#pending-token: 88", boot["log"])
        assert re.search(r"Prefill batch, #new-seq: 1, #new-token: 88, ", boot["log"])


def test_two_stock_boots_give_the_same_greedy_tokens(two_boots):
    first, again = (boot["outputs"] for boot in two_boots)
    worst = 0.0
    for label in PROMPTS:
        ids, logprobs = first[label]
        ids2, logprobs2 = again[label]
        assert len(ids) == NEW_TOKENS and ids == ids2, (label, ids, ids2)
        worst = max([worst] + [abs(a - b) for a, b in zip(logprobs, logprobs2)])
    print(f"\nmax logprob diff across boots: {worst:.3g} (tolerance {LOGPROB_TOL})")
    assert worst <= LOGPROB_TOL
