"""`dsv41 sim cone [--json]`: a 300,000-token document is cached, 800 distinct 1K prompts push its
SWA window out, then the document + 2,048 tokens arrives. Prefill and cached tokens are reported
with and without cone replay.

Everything the scheduler does to the cache runs on the engine's own objects on CPU: the real
UnifiedRadixCache (FULL + SWA, page 256, window 128) with its pools and allocators, real `Req`s
matched by `Req.init_next_round_input`, admitted by the real `PrefillAdder` (8192-token chunks),
their chunks checkpointed with `UnifiedRadixCache.checkpoint` and released by the engine's
`release_kv_cache`. What this driver stands in for is the forward pass and ScheduleBatch's slot
allocation: each pass gets fresh page-aligned FULL+SWA slots (evicting through the cache's own
`evict` when short), written into the request's req_to_token row, as alloc_for_extend does.
Cone replay is installed through the production installer (DSV41_SWA_CONE_REPLAY=1).
"""
from __future__ import annotations

import argparse
import json
import sys
from array import array

PAGE = 256
WINDOW = 128
CHUNK = 8192
LAST_CACHE = None   # the cache of the last scenario() run (tests read its tree core)


class Driver:
    """One scheduler's view of the cache: admit, allocate, checkpoint, release (no forward)."""

    def __init__(self, cpu, *, chunk: int = CHUNK):
        self.cpu = cpu
        self.cache = cpu.cache
        self.chunk = chunk
        self.n = 0
        self.passes = []        # (rid, prefix_len, extend_end) per pass

    def _req(self, tokens, max_new_tokens=1):
        from sglang.srt.managers.schedule_batch import Req
        from sglang.srt.sampling.sampling_params import SamplingParams

        self.n += 1
        return Req(rid=f"r{self.n}", origin_input_text="", origin_input_ids=array("q", tokens),
                   sampling_params=SamplingParams(temperature=0, max_new_tokens=max_new_tokens))

    def adder(self):
        from sglang.srt.managers.schedule_policy import PrefillAdder

        return PrefillAdder(page_size=PAGE, tree_cache=self.cache,
                            token_to_kv_pool_allocator=self.cpu.allocator, running_batch=None,
                            new_token_ratio=0.5, rem_input_tokens=1 << 22,
                            rem_chunk_tokens=self.chunk)

    def _alloc(self, n: int):
        from sglang.srt.mem_cache.base_prefix_cache import EvictParams

        aligned = -(-n // PAGE) * PAGE
        alloc = self.cpu.allocator
        short_full = aligned - alloc.full_available_size()
        short_swa = aligned - alloc.swa_available_size()
        if short_full > 0 or short_swa > 0:
            self.cache.evict(EvictParams(num_tokens=max(0, short_full),
                                         swa_num_tokens=max(0, short_swa)))
        return self.cpu.alloc(n)

    def _extend(self, req, end: int):
        """Give the pass [req.prefix_len, end) fresh slots in the request's row."""
        r2t = self.cpu.req_to_token_pool
        if req.kv.req_pool_idx is None:
            r2t.alloc([req])
            prefix = self.cache.prefix_device_indices(req)
            r2t.write((req.kv.req_pool_idx, slice(0, req.prefix_len)), prefix)
        start = req.prefix_len
        fresh = self._alloc(end - start)
        r2t.write((req.kv.req_pool_idx, slice(start, end)), fresh)
        req.kv.kv_allocated_len = end
        req.kv.kv_committed_len = end
        self.passes.append((req.rid, start, end))

    def prefill(self, tokens, *, output_tokens=(), adder=None):
        """Run one request through admission, its chunks and its release. Returns
        (req, first-pass prefix_len, prefill tokens over all passes)."""
        from sglang.srt.mem_cache.common import checkpoint_kv_cache, release_kv_cache

        req = self._req(tokens, max_new_tokens=max(1, len(output_tokens)))
        req.init_next_round_input(self.cache)
        adder = adder or self.adder()
        verdict = adder.add_one_req(req, has_chunked_req=False, truncation_align_size=None)
        if not any(r is req for r in adder.can_run_list):
            raise RuntimeError(f"{req.rid} not admitted: {verdict}")
        first_prefix = req.prefix_len
        spent = 0
        while True:
            end = req.extend_end
            spent += end - req.prefix_len
            self._extend(req, end)
            if end >= len(req.full_untruncated_fill_ids):
                break
            checkpoint_kv_cache(req, self.cache)   # Scheduler.stash_chunked_request
            adder = self.adder()
            adder.add_chunked_req(req)
            if not any(r is req for r in adder.can_run_list):
                raise RuntimeError(f"{req.rid}: next chunk not admitted")
        if output_tokens:
            req.output_ids.extend(output_tokens)
            req.refresh_fill_ids()
            total = len(req.full_untruncated_fill_ids)
            fresh = self._alloc(total - req.kv.kv_allocated_len)
            self.cpu.req_to_token_pool.write(
                (req.kv.req_pool_idx, slice(req.kv.kv_allocated_len, total)), fresh)
            req.kv.kv_allocated_len = req.kv.kv_committed_len = total
        req.finished_len = req.kv.kv_committed_len
        req.finished_reason = _finished()
        release_kv_cache(req, self.cache, checkpoint=True)
        return req, first_prefix, spent


def _finished():
    from sglang.srt.managers.schedule_batch import FINISH_LENGTH

    return FINISH_LENGTH(length=1)


def build(full_tokens: int, swa_tokens: int, backend: str, attention_backend: str = "dsv4",
          server_args: dict | None = None, **cache_params):
    from adapter.cpu import cpu_engine

    return cpu_engine.build_swa_cache(full_tokens=full_tokens, swa_tokens=swa_tokens,
                                      page_size=PAGE, window=WINDOW, backend=backend,
                                      req_slots=8, max_context_len=full_tokens,
                                      chunked_prefill_size=CHUNK, attention_backend=attention_backend,
                                      server_args=server_args, **cache_params)


def scenario(*, doc_tokens=300_000, prompts=800, prompt_tokens=1024, tail_tokens=2048,
             backend="python", full_tokens=1_200_000, swa_tokens=131_072):
    """Run the scenario once on a fresh cache (with whatever adapters are installed)."""
    global LAST_CACHE
    cpu = build(full_tokens, swa_tokens, backend)
    LAST_CACHE = cpu.cache
    drv = Driver(cpu)
    doc = list(range(1, doc_tokens + 1))
    drv.prefill(doc, output_tokens=[7] * 64)
    base = 10_000_000
    for i in range(prompts):
        start = base + i * prompt_tokens
        drv.prefill(list(range(start, start + prompt_tokens)), output_tokens=[5] * 16)
    tail = list(range(9_000_000, 9_000_000 + tail_tokens))
    prompt = doc + tail
    req, first_prefix, spent = drv.prefill(prompt)
    return {"prefill_tokens": spent, "cached_tokens": first_prefix, "prompt_tokens": len(prompt)}


def run(args) -> dict:
    from adapter import installer
    from adapter.cpu import cpu_engine

    cpu_engine.install_torchvision_shim()
    installer.install_in_process({})
    stock = scenario(backend=args.backend, prompts=args.prompts)
    state = installer.install_in_process({"DSV41_SWA_CONE_REPLAY": "1",
                                          "DSV41_SWA_CONE_TOKENS": str(args.tokens)})["swa_cone"]
    if state.status != "installed":
        raise SystemExit(f"swa_cone did not install: {state.detail}")
    cone = scenario(backend=args.backend, prompts=args.prompts)
    installer.reset_for_tests()
    return {"stock_prefill_tokens": stock["prefill_tokens"],
            "cone_prefill_tokens": cone["prefill_tokens"],
            "cached_tokens": cone["cached_tokens"],
            "prompt_tokens": cone["prompt_tokens"]}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="dsv41 sim cone", description=__doc__.split("\n\n")[0])
    p.add_argument("--json", action="store_true", help="print the result as one JSON object")
    p.add_argument("--tokens", type=int, default=8192, help="DSV41_SWA_CONE_TOKENS (default %(default)s)")
    p.add_argument("--prompts", type=int, default=800, help="distinct 1K prompts (default %(default)s)")
    p.add_argument("--backend", choices=("python", "rust"), default="rust",
                   help="tree core (default %(default)s, the engine default)")
    args = p.parse_args(argv)
    out = run(args)
    if args.json:
        print(json.dumps(out))
    else:
        for k, v in out.items():
            print(f"{k:>22}: {v:,}")
        print(f"{'prompt tokens cached':>22}: {out['cached_tokens']:,} of {out['prompt_tokens']:,}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
