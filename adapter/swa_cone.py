"""Cone replay (DSV41_SWA_CONE_REPLAY=1): resume a request whose SWA window at its resume point was
evicted while its full KV is still resident, by replaying one chunk instead of the whole context.

Match side (scheduler):
- UnifiedRadixCache.match_prefix: the stock match stops at the last node whose sliding window
  still holds SWA slots (F_stock). When the full KV runs further, the engine's own walk reports
  the page-aligned resident end as `swa_branching_seqlen` (F). We re-walk the tree on the key cut
  at s = F - N (N = DSV41_SWA_CONE_TOKENS, page aligned; the walk splits the node at s) and keep
  a *candidate* on the request: prefix [0, s) on full KV, node at s, node at F. The request keeps
  the stock match until the adder decides.
- PrefillAdder.add_one_req: with a candidate, the request enters admission as a prefix hit of s
  tokens. PrefillAdder._select_prefill_admission keeps that shape only if the first pass
  ([s, s + chunk)) covers the whole replay [s, F); otherwise the stock match is restored and
  selected instead, with a fallback line saying why. On commit the request's tree lock moves to
  the node at F (protecting the resident [s, F) until the first checkpoint unlocks it), and one
  `plan` line is logged.
Forward side (model worker, same process):
- DeepseekV4AttnBackend._build_forward_metadata: before the first pass's metadata is built, the
  resident latents / index keys of [s, F) are copied into the replay rows' fresh pages (one `copy`
  line), `encoder_swa_compress_rows` routes the replay rows' own latent / index-key writes to the
  padding slot (the engine's _compressor_out_loc), `encoder_swa_row_floor` floors their window at
  s (request-window and late-layer-tail paths), and
- DeepseekV4AttnBackend.init_forward_metadata_prefill gets the same floor as `swa_replay_start`
  (paged SWA path).
Cone plans only where that forward side will run (`forward_side()`: the dsv4 prefill backend off
HIP and NPU, from the published server arguments); anywhere else a lost resume point gets the
fallback line and the stock match. Every decision reads replicated state only (server arguments, tree,
request, budgets): all TP ranks plan alike. DSV41_SWA_CONE_TEST=1 (test only) re-reads each copy and checks it byte for byte.
"""
from __future__ import annotations

import collections
import dataclasses
from typing import Any, Optional

from adapter import receipts

ADAPTER = "swa_cone"
CAND_ATTR = "_dsv41_cone_candidate"
FLOOR_ATTR = "_dsv41_cone_floor"
MAX_PENDING_PLANS = 4096

# Counter keys in receipts.counters["swa_cone"] (series: adapter/metrics.py KEYS).
COUNTERS = {
    "candidates": "matches whose lost SWA window could be replayed",
    "plans": "replays planned",
    "replay_tokens": "tokens replayed by the planned replays",
    "copies": "replay copies of full-attention latents into the replay rows",
}

_PLAN_FIELDS = ("prefix_len", "last_node", "last_host_node", "best_match_node", "host_hit_length",
                "swa_host_hit_length", "num_matched_prefix_tokens", "swa_branching_seqlen")


@dataclasses.dataclass
class Candidate:
    F: int                  # page-aligned resident end of the full KV (the lost resume point)
    s: int                  # replay start F - N (page aligned)
    stock_len: int          # the stock match's prefix length
    stock_node: Any
    node_s: Any             # tree node ending at s (the re-match on full KV)
    node_F: Any             # deepest node of the walk, ending at >= F
    saved: dict = dataclasses.field(default_factory=dict)
    active: bool = False


@dataclasses.dataclass
class Plan:
    rid: str
    F: int
    s: int
    L: int
    src_loc: Any            # resident full slots of [s, F) (CPU int64)


class Cone:
    def __init__(self, tokens: int, test: bool):
        self.tokens = tokens
        self.test = bool(test)
        self.plans: "collections.OrderedDict[str, Plan]" = collections.OrderedDict()
        self.counters = receipts.counters[ADAPTER]

    # ---- match side -------------------------------------------------------------------------

    def match_prefix(self, original, cache, params):
        result = original(cache, params)        # the engine's exceptions propagate unchanged
        req = getattr(params, "req", None)
        if req is None:
            return result
        if getattr(req, CAND_ATTR, None) is not None:
            setattr(req, CAND_ATTR, None)
        try:
            cand = self.candidate(cache, params, result)
        except Exception as exc:  # noqa: BLE001 - cone's own logic only: the stock match stands
            _contained("candidate", exc)
            cand = None
        if cand is not None:
            setattr(req, CAND_ATTR, cand)
        return result

    def candidate(self, cache, params, result) -> Optional[Candidate]:
        """A replay candidate for this match, or None (stock match stands)."""
        F = result.swa_branching_seqlen
        if F is None or getattr(cache, "disable", False) or not cache.supports_swa():
            return None  # resume point intact (or nothing resident past it)
        stock = result.device_prefix_len
        served_by = forward_side()
        if served_by is not None:
            receipts.fallback(ADAPTER, f"prefill attention served by {served_by}, not DeepseekV4AttnBackend: "
                                       "nothing would copy, mask and floor the replay rows; stock "
                                       "match kept")
            return None
        if result.host_hit_length or result.swa_host_hit_length:
            receipts.fallback(ADAPTER, "host (HiCache) hit on the match; stock match kept")
            return None
        page = cache.page_size
        s = max(0, F - self.tokens) // page * page
        if s <= stock:
            receipts.fallback(ADAPTER, "replay start F-N is not past the stock hit; stock match kept")
            return None
        from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams
        from sglang.srt.mem_cache.radix_cache import RadixKey

        key = params.key
        cut = RadixKey(key.token_ids, key.extra_key, is_bigram=key.is_bigram,
                       limit=s + int(key.is_bigram), cache_salt=key.cache_salt)
        # The engine's own tree walk on the key cut at s: it splits the node holding s, and
        # reports the node it ended on even though the SWA validator rejects it.
        rematch = cache._match_tree(MatchPrefixParams(key=cut))
        node_s, node_F = rematch.last_visited_node_id, result.last_visited_node_id
        root = cache.root_node_handle(key.extra_key)
        if node_s is None or node_F is None:
            receipts.fallback(ADAPTER, "re-match on full KV found no node; stock match kept")
            return None
        if _path_len(cache, node_s, root) != s or _path_len(cache, node_F, root) < F:
            receipts.fallback(ADAPTER, "re-match on full KV did not end at s; stock match kept")
            return None
        self.counters["candidates"] += 1
        return Candidate(F=F, s=s, stock_len=stock, stock_node=result.last_device_node,
                         node_s=node_s, node_F=node_F)

    def add_one_req(self, original, adder, req, *args, **kwargs):
        if self.plans:
            # A plan is consumed by its request's first pass, right after the admission that made
            # it; one still here for this rid belongs to an earlier admission whose pass never ran
            # (aborted first; a client reusing the rid): it must not meet this request's pass.
            self.plans.pop(req.rid, None)
        cand = getattr(req, CAND_ATTR, None)
        if cand is None:
            return original(adder, req, *args, **kwargs)
        setattr(req, CAND_ATTR, None)
        tree = adder.tree_cache
        try:
            root = tree.root_node_handle(req.extra_key)
            changed = (req.prefix_len != cand.stock_len or req.last_node != cand.stock_node
                       or _path_len(tree, cand.node_s, root) != cand.s
                       or _path_len(tree, cand.node_F, root) < cand.F)
        except Exception as exc:  # noqa: BLE001 - cone's own logic only: the stock match stands
            _contained("admission check", exc)
            return original(adder, req, *args, **kwargs)
        if changed:
            receipts.fallback(ADAPTER, "tree changed between match and admission; stock match kept")
            return original(adder, req, *args, **kwargs)
        cand.saved = _swap_in(req, cand)
        cand.active = True
        setattr(req, CAND_ATTR, cand)
        try:
            verdict = original(adder, req, *args, **kwargs)
        except BaseException:
            if cand.active:
                _restore(req, cand.saved)
            setattr(req, CAND_ATTR, None)
            raise
        setattr(req, CAND_ATTR, None)
        committed = any(r is req for r in adder.can_run_list)
        if not cand.active:
            return verdict          # the selection fell back to the stock match
        if not committed:
            _restore(req, cand.saved)   # not admitted this round: it waits with the stock match
            return verdict
        try:
            self._commit(tree, req, cand, root)
        except Exception as exc:  # noqa: BLE001 - cone's own logic only; admitted as a hit at s
            _contained("plan", exc)
        return verdict

    def select_admission(self, original, adder, req, *args, **kwargs):
        cand = getattr(req, CAND_ATTR, None)
        if cand is None or not cand.active:
            return original(adder, req, *args, **kwargs)
        admission = original(adder, req, *args, **kwargs)
        if not hasattr(admission, "extend_len"):
            return admission            # no shape this round (budget); add_one_req restores
        try:
            end = admission.prefix_len + admission.extend_len
        except Exception as exc:  # noqa: BLE001 - cone's own logic only: the shape stands
            _contained("admission shape", exc)
            return admission
        if end >= cand.F:
            return admission
        receipts.fallback(ADAPTER, "first pass does not cover the replay (chunk budget below N); "
                                   "stock match kept")
        _restore(req, cand.saved)
        cand.active = False
        kwargs["total_tokens"] = kwargs["total_tokens"] + (cand.s - cand.stock_len)
        kwargs["host_hit_length"] = req.host_hit_length
        kwargs["swa_host_hit_length"] = req.swa_host_hit_length
        return original(adder, req, *args, **kwargs)

    def _commit(self, tree, req, cand: Candidate, root) -> None:
        import torch

        old = req.lock
        req.lock = tree.lock(cand.node_F)   # keeps [s, F) resident until the first checkpoint
        tree.unlock(old)
        src = tree.tree_core.collect_full_device_indices(cand.node_F, root)[cand.s:cand.F]
        plan = Plan(rid=req.rid, F=cand.F, s=cand.s, L=len(req.full_untruncated_fill_ids),
                    src_loc=src.to(device="cpu", dtype=torch.int64, copy=True))
        self.plans[req.rid] = plan
        while len(self.plans) > MAX_PENDING_PLANS:
            self.plans.popitem(last=False)
        self.counters["plans"] += 1
        self.counters["replay_tokens"] += cand.F - cand.s
        receipts.line(ADAPTER, "plan request=%s F=%d s=%d L=%d replay=%d first_pass=[%d,%d) "
                      "stock_prefix=%d", req.rid, plan.F, plan.s, plan.L, plan.F - plan.s,
                      plan.s, req.extend_end, cand.stock_len)

    # ---- forward side -----------------------------------------------------------------------

    def build_forward_metadata(self, original, backend, forward_batch, *args, **kwargs):
        if self.plans and not getattr(backend, "is_dspark_draft", False):
            try:
                self.apply(forward_batch, pool=backend.token_to_kv_pool,
                           req_to_token=backend.req_to_token, page_size=backend.page_size)
            except Exception as exc:  # noqa: BLE001 - cone's own logic only
                _contained("copy", exc)
        return original(backend, forward_batch, *args, **kwargs)

    def init_prefill_metadata(self, original, backend, *args, **kwargs):
        fb = kwargs.get("forward_batch")
        try:
            floor = getattr(fb, FLOOR_ATTR, None) if fb is not None else None
            if (floor is not None and kwargs.get("swa_replay_start") is None
                    and backend.token_to_kv_pool.request_window is None):
                kwargs["swa_replay_start"] = _pad_to(floor, kwargs["out_cache_loc"].shape[0])
        except Exception as exc:  # noqa: BLE001 - cone's own logic only
            _contained("window floor", exc)
        return original(backend, *args, **kwargs)

    def apply(self, fb, *, pool, req_to_token, page_size) -> list:
        """Copy, mask and floor for the rows of the planned requests in this forward batch."""
        from adapter import swa_cone_copy as cc

        rids = getattr(fb, "rids", None) or ()
        if not rids or not any(r in self.plans for r in rids):
            return []
        if not fb.forward_mode.is_extend() or fb.extend_prefix_lens_cpu is None:
            return []
        prefix = list(fb.extend_prefix_lens_cpu)
        extend = list(fb.extend_seq_lens_cpu)
        slots = (fb.req_pool_indices_cpu if fb.req_pool_indices_cpu is not None
                 else fb.req_pool_indices.cpu()).tolist()
        applied, replay, floors = [], [0] * len(rids), [0] * len(rids)
        for i, rid in enumerate(rids):
            plan = self.plans.get(rid)
            if plan is None or prefix[i] != plan.s:
                continue
            self.plans.pop(rid)
            n = plan.F - plan.s
            if extend[i] < n:
                receipts.fallback(ADAPTER, "forward pass shorter than the planned replay; "
                                           "replay rows compute their own latents")
                floors[i] = plan.s
                continue
            dst = req_to_token[slots[i], plan.s:plan.F]
            src = plan.src_loc.to(dst.device)
            try:
                report = cc.copy_resident(pool, src, dst, page_size=page_size)
            except cc.UnsupportedPool as exc:
                receipts.fallback(ADAPTER, f"{exc}: replay rows compute their own latents")
                floors[i] = plan.s
                continue
            if self.test:
                _verify_copy(pool, src, dst, page_size)
            replay[i], floors[i] = n, plan.s
            applied.append((plan, report))
            self.counters["copies"] += 1
            receipts.line(ADAPTER, "copy request=%s rows=[%d,%d) pages=%d buffers=%d bytes=%d",
                          rid, plan.s, plan.F, report.full_pages, report.buffers, report.bytes)
        if not any(floors):
            return applied
        device = fb.out_cache_loc.device
        if any(replay):
            if fb.encoder_swa_compress_rows is not None or fb.encoder_swa_replay:
                receipts.fallback(ADAPTER, "engine encoder-replay fold owns the compress rows; "
                                           "replay rows keep their own latent writes")
            else:
                fb.encoder_swa_compress_rows = cc.keep_rows(extend, replay, device=device)
        floor = cc.row_floor(extend, floors, device=device)
        if fb.encoder_swa_row_floor is None:
            fb.encoder_swa_row_floor = floor
        setattr(fb, FLOOR_ATTR, floor)
        return applied


def forward_side() -> Optional[str]:
    """None when cone's forward side will serve the first pass, else what serves it instead.

    The replay is correct only if DeepseekV4AttnBackend (or a subclass) runs the prefill: its
    metadata hooks copy the resident latents, mask the replay rows' writes and floor their window.
    The engine builds that class for the `dsv4` backend everywhere but HIP and NPU (CUDA and CPU
    alike; attention_registry: HIP and NPU get classes of their own, without these hooks). Read from the published server arguments and the platform,
    which every TP rank has alike: no rank decides differently.
    """
    from sglang.srt.layers.attention import attention_registry
    from sglang.srt.runtime_context import attention_backends

    prefill, _ = attention_backends()
    if prefill not in ("dsv4", "compressed"):
        return f"backend {prefill!r}"
    if attention_registry._is_hip or attention_registry._is_npu:
        return f"the {'HIP' if attention_registry._is_hip else 'NPU'} dsv4 backend"
    return None


def _contained(step: str, exc: BaseException) -> None:
    """An exception of cone's own logic at `step`: one fallback line per (step, type); the engine's
    call goes on (no exception of cone's reaches the scheduler or the model worker)."""
    receipts.fallback(ADAPTER, f"internal error in the {step} step ({type(exc).__name__}); that "
                               "step left to the engine")


def _pad_to(t, n: int):
    import torch

    return t if t.shape[0] >= n else torch.nn.functional.pad(t, (0, n - t.shape[0]))


def _path_len(cache, node, root) -> int:
    return int(cache.tree_core.collect_full_device_indices(node, root).numel())


def _swap_in(req, cand: Candidate) -> dict:
    saved = {f: getattr(req, f) for f in _PLAN_FIELDS}
    saved["cache_protected_len"] = req.kv.cache_protected_len
    req.prefix_len = cand.s
    req.last_node = req.last_host_node = req.best_match_node = cand.node_s
    req.host_hit_length = req.swa_host_hit_length = 0
    req.num_matched_prefix_tokens = cand.s
    req.swa_branching_seqlen = None     # the first pass re-fills [s, F) itself
    req.kv.cache_protected_len = cand.s
    return saved


def _restore(req, saved: dict) -> None:
    for f in _PLAN_FIELDS:
        setattr(req, f, saved[f])
    req.kv.cache_protected_len = saved["cache_protected_len"]


def _verify_copy(pool, src, dst, page_size) -> None:
    from adapter import swa_cone_copy as cc

    for ratio, pool_page, views in cc._page_buffers(pool):
        a = cc._pool_pages(cc.full_pages(src, page_size), page_size, ratio, pool_page)
        b = cc._pool_pages(cc.full_pages(dst, page_size), page_size, ratio, pool_page)
        for view in views:
            if not bool((view[a.to(view.device)] == view[b.to(view.device)]).all()):
                raise AssertionError(f"DSV41_SWA_CONE_TEST: ratio {ratio} copy differs")


_cone: Optional[Cone] = None


def state() -> Optional[Cone]:
    return _cone


def install(ctx) -> str:
    global _cone
    tokens = ctx.value("DSV41_SWA_CONE_TOKENS")
    test = ctx.value("DSV41_SWA_CONE_TEST")
    cone = _cone = Cone(tokens, test)
    ctx.around("UnifiedRadixCache.match_prefix", cone.match_prefix)
    ctx.around("PrefillAdder.add_one_req", cone.add_one_req)
    ctx.around("PrefillAdder._select_prefill_admission", cone.select_admission)
    ctx.around("DeepseekV4AttnBackend._build_forward_metadata", cone.build_forward_metadata)
    ctx.around("DeepseekV4AttnBackend.init_forward_metadata_prefill", cone.init_prefill_metadata)
    return (f"DSV41_SWA_CONE_TOKENS={tokens}: a lost resume point replays {tokens} tokens in the "
            f"first pass (plan/copy lines per replay)" + ("; DSV41_SWA_CONE_TEST=1 (copy self-check)"
                                                           if test else ""))
