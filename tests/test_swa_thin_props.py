"""Property tests: random turn / step / match / evict / lock sequences on the real UnifiedRadixCache
(page 256, window 128), thin on and off. After every operation the engine's own sanity_check()
(tree structure, leaf sets, LRU membership and links, evictable / protected sizes against a
recount, lock-ref hierarchy) must hold; every token of a matched prefix must be resident (full
slot allocated, SWA slot mapped and allocated for the window); at the end, with every request
finished and every lock released, nothing is protected and every slot is either free or held by
the tree (no leak, no double free)."""
from __future__ import annotations

from array import array

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from adapter.tools.sims.swa_thin import Driver, Tokens

PAGE = 256
CHUNK = 1024
FULL_PAGES, SWA_PAGES = 600, 40
MAX_LIVE, MAX_LOCKS, MAX_CONTEXT = 3, 3, 40 * PAGE

OPS = st.one_of(
    st.tuples(st.just("turn"), st.integers(0, 4), st.integers(0, 9), st.integers(0, 255),
              st.integers(0, 400), st.booleans()),
    st.tuples(st.just("step"), st.integers(0, 5), st.integers(1, 6)),
    st.tuples(st.just("match"), st.integers(0, 4), st.floats(0, 1)),
    st.tuples(st.just("evict"), st.integers(0, 8), st.integers(0, 8)),
    st.tuples(st.just("lock"), st.integers(0, 4), st.floats(0, 1)),
    st.tuples(st.just("unlock"), st.integers(0, 5)),
)


def _free_pages(sub_allocator) -> set[int]:
    return set(sub_allocator.get_all_free_pages().tolist())


def _check_match_resident(cpu, result):
    cache, alloc = cpu.cache, cpu.allocator
    n = result.device_prefix_len
    if n == 0:
        return
    idx = cache.path_device_indices(result.last_device_node)[:n]
    assert len(idx) == n
    assert not ({int(i) // PAGE for i in idx} & _free_pages(alloc.full_attn_allocator))
    tail = idx[-min(n, cpu.window):]
    swa = alloc.full_to_swa_index_mapping[tail]
    assert bool((swa > 0).all()), "matched window without SWA slots"
    assert not ({int(i) // PAGE for i in swa} & _free_pages(alloc.swa_attn_allocator))


def _run(ops, backend):
    from adapter.cpu import cpu_engine
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams, MatchPrefixParams
    from sglang.srt.mem_cache.radix_cache import RadixKey

    cpu = cpu_engine.build_swa_cache(full_tokens=FULL_PAGES * PAGE, swa_tokens=SWA_PAGES * PAGE,
                                     backend=backend, req_slots=MAX_LIVE + 2,
                                     max_context_len=MAX_CONTEXT + 16 * PAGE,
                                     chunked_prefill_size=CHUNK)
    cache, alloc = cpu.cache, cpu.allocator
    full0, swa0 = alloc.full_available_size(), alloc.swa_available_size()
    drv = Driver(cpu, concurrency=MAX_LIVE, chunk=CHUNK)
    tok = Tokens()
    contexts = [array("q") for _ in range(5)]
    live, locks = [], []

    def job(conv, prompt, out, fork):
        yield from drv.turn(f"c{conv}", prompt, out)
        if not fork:
            contexts[conv] = prompt + out

    def prefix(conv, frac):
        ctx = contexts[conv]
        return ctx[: int(len(ctx) * frac)] + array("q", [3])

    for op in ops:
        kind = op[0]
        if kind == "turn" and len(live) < MAX_LIVE:
            _, conv, pages, partial, out_len, fork = op
            base = contexts[conv]
            if fork and len(base):
                base = base[: len(base) // 2]
            if len(base) + pages * PAGE + partial + out_len > MAX_CONTEXT:
                base = array("q")              # start the conversation over
            prompt = base + tok.fresh(pages * PAGE + partial + 1)
            live.append(job(conv, prompt, tok.fresh(out_len), fork))
            next(live[-1])                     # admission: match + lock + first chunk
        elif kind == "step" and live:
            _, k, n = op
            gen = live[k % len(live)]
            for _ in range(n):
                try:
                    next(gen)
                except StopIteration:
                    live.remove(gen)
                    break
        elif kind == "match":
            _, conv, frac = op
            _check_match_resident(cpu, cache.match_prefix(MatchPrefixParams(key=RadixKey(prefix(conv, frac)))))
        elif kind == "evict":
            _, full_pages, swa_pages = op
            cache.evict(EvictParams(num_tokens=full_pages * PAGE, swa_num_tokens=swa_pages * PAGE))
        elif kind == "lock" and len(locks) < MAX_LOCKS:
            _, conv, frac = op
            m = cache.match_prefix(MatchPrefixParams(key=RadixKey(prefix(conv, frac))))
            _check_match_resident(cpu, m)
            locks.append(cache.lock(m.last_device_node))
        elif kind == "unlock" and locks:
            cache.unlock(locks.pop(op[1] % len(locks)))
        cache.sanity_check()

    for gen in live:                            # drain: every request finishes
        for _ in gen:
            pass
        cache.sanity_check()
    for lock in locks:
        cache.unlock(lock)
    cache.sanity_check()
    assert cache.full_protected_size() == 0 and cache.swa_protected_size() == 0
    assert alloc.full_available_size() + cache.full_evictable_size() == full0
    assert alloc.swa_available_size() + cache.swa_evictable_size() == swa0
    for ctx in contexts:                        # whatever is still cached is fully resident
        if len(ctx):
            _check_match_resident(cpu, cache.match_prefix(MatchPrefixParams(key=RadixKey(ctx))))
    cache.evict(EvictParams(num_tokens=full0, swa_num_tokens=swa0))
    cache.sanity_check()
    assert alloc.full_available_size() == full0 and alloc.swa_available_size() == swa0
    return drv


VARIANTS = [("control", "rust", {}), ("control", "python", {}), ("thin", "rust", {"DSV41_SWA_THIN": "1"})]


@pytest.mark.parametrize("name,backend,env", VARIANTS, ids=[f"{v[0]}-{v[1]}" for v in VARIANTS])
def test_tree_invariants_hold(install_adapters, name, backend, env):
    status = install_adapters(env)
    assert (status["swa_thin"].status == "installed") == (name == "thin")
    from adapter import swa_thin

    swa_thin.reset_counts()

    @settings(max_examples=12, deadline=None, derandomize=True,
              suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
    @given(st.lists(OPS, min_size=5, max_size=40))
    def prop(ops):
        drv = _run(ops, backend)
        if name == "thin":
            assert type(drv.cache.tree_core).__name__ == "ThinTreeCore"

    prop()
    if name == "thin":
        assert swa_thin.summary()["nodes_moved"] > 0        # the sequences did exercise the adapter
    else:
        assert swa_thin.summary()["hooked_inserts"] == 0
