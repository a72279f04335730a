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
fallback line and the stock match; so does every lost resume point while the engine's encoder SWA
bounded replay is in effect (`engine_replay()`: --enable-encoder-swa-bounded-replay, resolved: it
caches no SWA window and folds its own replay rows into the compress rows cone masks).
Beside the engine's decoder SWA bounded replay (--enable-decoder-swa-bounded-replay, which the
engine resolves on for DeepSeek-V4.1 on CUDA: the cluster's line) cone acts. Under that flag the
layers from the last KV-source layer on run over each pass's last 128 rows only, with their window
floored at the pass's end - 128, so what rows >= F compute depends on where the passes end. A hit
at F runs passes [F, F + chunk), ...; so cone's first pass ends exactly at F (`select_admission`
cuts it there, the engine's own chunk split: the replay alone) unless it is the request's only
pass (then both end at L). With N = the chunk (production: 8192 and 8192) the cut never moves
anything. The engine's match limit under the flag (the last 128 prompt tokens always re-prefill)
keeps F <= L - 128, so the last pass's tail rows are all >= F (docs/swa_cone.md, "Beside the
engine's decoder bounded replay"). Every decision reads replicated state only (server arguments,
tree, request, budgets): all TP ranks plan alike. DSV41_SWA_CONE_TEST=1 (test only) re-reads each copy and checks it byte for byte.
Negative controls (test only, never in a profile; install and every replay say so loudly):
DSV41_SWA_CONE_TEST_NO_COPY=1 plans, masks and floors as usual but skips the copy (the replay rows'
pages keep stale latents / index keys); DSV41_SWA_CONE_TEST_NO_MASK=1 copies and floors but sets no
write mask (the replay rows write their own latents / index keys over the copied ones); DSV41_SWA_CONE_TEST_NO_FLOOR=1 copies and masks but sets
no window floor (the replay rows whose window reaches below s read the evicted slots, i.e. the
padding slot). Rows >= F depend on the floor only through the model's receptive cone, which N
covers, so the latter leaves them as they are (measured: docs/swa_cone.md).

Failures (issue 30). A pool the copy cannot address (unified_kv, HiSparse C4) is found at the
match, from the pool's layout: no plan, stock match kept. Once a request is admitted as a hit at
s, floor and mask alone do not make its answer right: a copy that did not land (an exception in
copy_resident, which may already have moved some buffers: torch.OutOfMemoryError, a ValueError of
its page checks, any RuntimeError, the DSV41_SWA_CONE_TEST check) leaves stale or half-copied
latents / index keys in the replay rows' pages, which rows >= F read; with the mask off they would
hold the replay rows' own latents, computed from a floored window. So any failure after a plan is
taken (plan step, store drop, copy, mask / floor building, a pass shorter than the replay) fails
that request through the engine's own path for a forward that ran on KV that never landed (as its
external-linker load failure does): `Req.discard_output_reason` = FINISH_ABORT (HTTP 503, the
message names the replay and the reason) and `Req.skip_radix_cache_insert`. Its pass still runs
floored and masked (its rows neither overwrite shared bytes nor read evicted slots); the engine's
result processor then drops its output, finishes it with that error and releases its KV without
inserting any (middle chunks are stashed without an insert too). Forward-side failures are
agreed across TP ranks (MIN over the cache's attention TP groups) so every rank fails the same
requests. State left by a contained exception: the stock match (match, admission steps), or the
request failed as above with the tree and every other request as stock (plan and forward steps);
no exception of cone's reaches the scheduler loop or the model worker.
"""
from __future__ import annotations

import collections
import dataclasses
import weakref
from typing import Any, Optional

from adapter import receipts

ADAPTER = "swa_cone"
CAND_ATTR = "_dsv41_cone_candidate"
FLOOR_ATTR = "_dsv41_cone_floor"
# Plans wait in the store from admission to their first pass (the same scheduler step), so
# the store normally holds one round's replays (<= one chunk of rows, 8 B each). Entries of
# requests that left before their pass are pruned at each plan; the byte bound is the backstop.
MAX_PLAN_BYTES = 64 << 20

# Counter keys in receipts.counters["swa_cone"] (series: adapter/metrics.py KEYS).
COUNTERS = {
    "candidates": "matches whose lost SWA window could be replayed",
    "plans": "replays planned",
    "replay_tokens": "tokens replayed by the planned replays",
    "copies": "replay copies of full-attention latents into the replay rows",
    "plans_dropped": "plans removed before their first pass ran (request gone or finished, rid "
                     "reused, store over MAX_PLAN_BYTES); a still-pending request among them is "
                     "failed (replays_aborted)",
    "replays_aborted": "planned requests failed with HTTP 503 because their replay could not be "
                       "prepared exactly (copy, mask or floor failed, on any TP rank)",
    "first_pass_cut_at_F": "first passes cut to end at F beside the engine's decoder SWA bounded "
                           "replay (so later passes fall where a hit at F puts them)",
}
NO_FLOOR_KEY = "DSV41_SWA_CONE_TEST_NO_FLOOR"   # test only: negative control, no window floor
NO_COPY_KEY = "DSV41_SWA_CONE_TEST_NO_COPY"     # test only: negative control, no copy
NO_MASK_KEY = "DSV41_SWA_CONE_TEST_NO_MASK"     # test only: negative control, no write mask
ABORT_STATUS = 503          # HTTPStatus.SERVICE_UNAVAILABLE: the engine's status for KV that never landed

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
    req: Any = None         # weakref.ref to the admitted Req (what a failed replay aborts)
    tree: Any = None        # the request's UnifiedRadixCache (its TP groups agree on a verdict)

    @property
    def nbytes(self) -> int:
        return int(self.src_loc.numel()) * 8 + 256

    def pending(self):
        """The request, while it still waits for its first pass (alive, not finished); else None."""
        req = self.req() if self.req is not None else None
        return None if req is None or req.finished() else req


class Cone:
    def __init__(self, tokens: int, test: bool, no_floor: bool = False, no_copy: bool = False,
                 no_mask: bool = False):
        self.tokens = tokens
        self.test = bool(test)
        self.no_floor = bool(no_floor)     # DSV41_SWA_CONE_TEST_NO_FLOOR: test-only negative control
        self.no_copy = bool(no_copy)       # DSV41_SWA_CONE_TEST_NO_COPY: test-only negative control
        self.no_mask = bool(no_mask)       # DSV41_SWA_CONE_TEST_NO_MASK: test-only negative control
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
        engine_flag = engine_replay()
        if engine_flag is not None:
            receipts.fallback(ADAPTER, f"the engine's {engine_flag} is on: it caches no SWA "
                                       "window and folds its own replay rows into the compress "
                                       "rows cone masks (docs/swa_cone.md); stock match kept")
            return None
        if result.host_hit_length or result.swa_host_hit_length:
            receipts.fallback(ADAPTER, "host (HiCache) hit on the match; stock match kept")
            return None
        page = cache.page_size
        from adapter import swa_cone_copy as cc

        try:
            # Decided here, before admission, from the pool's layout (alike on every rank): a
            # replay whose copy cannot run is never planned.
            cc.check_pool(cache.token_to_kv_pool_allocator.get_kvcache(), page)
        except cc.UnsupportedPool as exc:
            receipts.fallback(ADAPTER, f"{exc}: the copy cannot run; stock match kept")
            return None
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
        if self.plans and req.rid in self.plans:
            # A plan is consumed by its request's first pass, right after the admission that made
            # it; one still here for this rid belongs to an earlier admission whose pass never ran
            # (aborted first; a client reusing the rid): it must not meet this request's pass.
            try:
                self._drop(req.rid, "rid admitted again before its planned pass", keep=req)
            except Exception as exc:  # noqa: BLE001 - cone's own logic only
                self.plans.pop(req.rid, None)
                _contained("stale plan", exc)
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
        except Exception as exc:  # noqa: BLE001 - cone's own logic only
            # Admitted as a prefix hit at s with no plan: nothing would copy, mask and floor its
            # first pass, so the request is failed (its KV kept out of the tree), not served.
            self._abort(req, req.rid, cand.s, cand.F,
                        f"internal error in the plan step ({type(exc).__name__})")
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
            if end > cand.F and admission.is_chunked and decoder_replay():
                admission = self._end_first_pass_at_F(admission, cand)
                end = cand.F
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

    def _end_first_pass_at_F(self, admission, cand: Candidate):
        """Beside the engine's decoder SWA bounded replay: a first pass that is not the request's
        last ends at F, so every later pass (and the late layers' 128-row tail at its end) falls
        where a prefix hit at F puts it. The engine's own chunked shape, shorter: the budget it
        checked covers it. A single pass ([s, L)) ends where a hit's does and is left whole."""
        self.counters["first_pass_cut_at_F"] += 1
        return dataclasses.replace(admission, extend_len=cand.F - cand.s, is_chunked=True, max_new_tokens=0)

    def _commit(self, tree, req, cand: Candidate, root) -> None:
        import torch

        # Everything that can fail runs before the lock moves; the plan is stored last.
        src = tree.tree_core.collect_full_device_indices(cand.node_F, root)[cand.s:cand.F]
        plan = Plan(rid=req.rid, F=cand.F, s=cand.s, L=len(req.full_untruncated_fill_ids),
                    src_loc=src.to(device="cpu", dtype=torch.int64, copy=True),
                    req=weakref.ref(req), tree=tree)
        old = req.lock
        new = tree.lock(cand.node_F)        # keeps [s, F) resident until the first checkpoint
        try:
            tree.unlock(old)
        except BaseException:
            tree.unlock(new)                # the request keeps its admission lock
            raise
        req.lock = new
        self._store(plan)
        self.counters["plans"] += 1
        self.counters["replay_tokens"] += cand.F - cand.s
        receipts.line(ADAPTER, "plan request=%s F=%d s=%d L=%d replay=%d first_pass=[%d,%d) "
                      "stock_prefix=%d", req.rid, plan.F, plan.s, plan.L, plan.F - plan.s,
                      plan.s, req.extend_end, cand.stock_len)

    # ---- plan store ----------------------------------------------------------------------------

    def _store(self, plan: Plan) -> None:
        """Add `plan`; prune plans whose request left before its pass; keep the store under
        MAX_PLAN_BYTES by dropping the oldest (failing its request if it still waits)."""
        for rid in [r for r, p in self.plans.items() if p.pending() is None]:
            self._drop(rid, None)
        self.plans[plan.rid] = plan
        while len(self.plans) > 1 and self.plan_bytes() > MAX_PLAN_BYTES:
            self._drop(next(iter(self.plans)), f"plan store over {MAX_PLAN_BYTES >> 20} MiB")

    def plan_bytes(self) -> int:
        return sum(p.nbytes for p in self.plans.values())

    def _take(self, rid: str) -> Plan:
        return self.plans.pop(rid)

    def _drop(self, rid: str, reason: Optional[str], keep=None) -> None:
        """Remove a plan whose pass has not run. A request still waiting for that pass (other
        than `keep`, the one being admitted) would run it unfloored: it is failed."""
        plan = self._take(rid)
        self.counters["plans_dropped"] += 1
        req = plan.pending()
        if req is not None and req is not keep and reason is not None:
            self._abort(req, plan.rid, plan.s, plan.F, f"plan dropped: {reason}")

    def _abort(self, req, rid: str, s: int, F: int, reason: str) -> None:
        """Fail one admitted request through the engine's own path for a forward that ran on KV
        that never landed (the external-linker load failure does the same): its output is
        dropped, it finishes with FINISH_ABORT (HTTP 503) at the end of its prefill, and none of
        its KV is inserted into the tree (checkpoint_kv_cache / release_kv_cache skip it)."""
        from sglang.srt.managers.schedule_batch import FINISH_ABORT

        self.counters["replays_aborted"] += 1
        receipts.fallback(ADAPTER, f"{reason}: request failed (HTTP 503), its KV kept out of "
                                   "the tree")
        receipts.line(ADAPTER, "abort request=%s rows=[%d,%d): %s", rid, s, F, reason)
        if req is None or req.finished():
            return                          # gone: nothing will read its output
        req.skip_radix_cache_insert = True
        if req.discard_output_reason is None:
            req.discard_output_reason = FINISH_ABORT(
                f"swa_cone: the replay of tokens [{s}, {F}) could not be prepared ({reason}); "
                "the request was failed rather than answered from unprepared KV; retry it",
                ABORT_STATUS)

    # ---- forward side -----------------------------------------------------------------------

    def build_forward_metadata(self, original, backend, forward_batch, *args, **kwargs):
        if self.plans and not getattr(backend, "is_dspark_draft", False):
            try:
                self.apply(forward_batch, pool=backend.token_to_kv_pool,
                           req_to_token=backend.req_to_token, page_size=backend.page_size)
            except Exception as exc:  # noqa: BLE001 - cone's own logic only (apply fails its
                _contained("copy", exc)  # taken plans itself; this is its last resort)
        return original(backend, forward_batch, *args, **kwargs)

    def init_prefill_metadata(self, original, backend, *args, **kwargs):
        fb = kwargs.get("forward_batch")
        floor = getattr(fb, FLOOR_ATTR, None) if fb is not None else None
        if floor is not None and kwargs.get("swa_replay_start") is None:
            try:
                paged = backend.token_to_kv_pool.request_window is None
                if paged:
                    floor = _pad_to(floor, kwargs["out_cache_loc"].shape[0])
            except Exception as exc:  # noqa: BLE001 - cone's own logic only
                _contained("window floor", exc)     # the unpadded floor still covers every row
                paged = True
            if paged:
                kwargs["swa_replay_start"] = floor
        return original(backend, *args, **kwargs)

    def apply(self, fb, *, pool, req_to_token, page_size) -> list:
        """Copy, mask and floor for the rows of the planned requests in this forward batch.

        Once a plan is taken from the store its request's fate is settled here: either its copy,
        mask and floor are all in place on every TP rank, or it is failed (`_abort`) with its
        mask and floor kept for this pass. Nothing in between is served."""
        rids = getattr(fb, "rids", None) or ()
        if not rids or not any(r in self.plans for r in rids):
            return []
        if not fb.forward_mode.is_extend():
            return []
        try:
            prefix = list(fb.extend_prefix_lens_cpu)
            rows = [i for i, rid in enumerate(rids)
                    if rid in self.plans and prefix[i] == self.plans[rid].s]
        except Exception as exc:  # noqa: BLE001 - the batch does not say which pass this is
            rows = [i for i, rid in enumerate(rids) if rid in self.plans]
            for i in rows:
                plan = self._take(rids[i])
                self._abort(plan.pending(), plan.rid, plan.s, plan.F,
                            f"batch without readable prefix lengths ({type(exc).__name__})")
            return []
        taken = [(i, self._take(rids[i])) for i in rows]
        if not taken:
            return []
        applied, failed = self._prepare(fb, taken, pool=pool, req_to_token=req_to_token,
                                        page_size=page_size)
        failed = self._agree(taken, failed)
        for (i, plan), reason in zip(taken, failed):
            if reason is not None:
                self._abort(plan.pending(), plan.rid, plan.s, plan.F, reason)
        return [a for a, reason in zip(applied, failed) if a is not None and reason is None]

    def _prepare(self, fb, taken: list, *, pool, req_to_token, page_size) -> tuple:
        """Copy each taken plan's resident rows, then set the mask and the floor for all of them
        (failed ones too: their rows then neither overwrite shared bytes nor read evicted slots).
        Returns ([(plan, report) or None], [failure reason or None]) per taken plan; never raises."""
        from adapter import swa_cone_copy as cc

        applied = [None] * len(taken)
        failed: list = [None] * len(taken)
        try:
            extend = list(fb.extend_seq_lens_cpu)
            slots = (fb.req_pool_indices_cpu if fb.req_pool_indices_cpu is not None
                     else fb.req_pool_indices.cpu()).tolist()
            replay, floors = [0] * len(extend), [0] * len(extend)
            for j, (i, plan) in enumerate(taken):
                n = plan.F - plan.s
                floors[i] = plan.s
                if extend[i] < n:
                    failed[j] = "forward pass shorter than the planned replay"
                    continue
                replay[i] = n
                if self.no_copy:
                    # Test-only negative control: the replay rows' fresh pages keep whatever
                    # latents / index keys they held (stale). Loud, per replay.
                    receipts.line(ADAPTER, "TEST ONLY copy SKIPPED request=%s rows=[%d,%d): %s=1, "
                                  "the replay rows' pages keep stale latents / index keys; this "
                                  "output is not cone's", plan.rid, plan.s, plan.F, NO_COPY_KEY)
                    continue
                try:
                    dst = req_to_token[slots[i], plan.s:plan.F]
                    src = plan.src_loc.to(dst.device)
                    report = cc.copy_resident(pool, src, dst, page_size=page_size)
                    if self.test:
                        _verify_copy(pool, src, dst, page_size)
                except Exception as exc:  # noqa: BLE001 - may have moved some buffers already
                    failed[j] = f"replay copy failed ({type(exc).__name__})"
                    continue
                applied[j] = (plan, report)
                self.counters["copies"] += 1
                receipts.line(ADAPTER, "copy request=%s rows=[%d,%d) pages=%d buffers=%d bytes=%d",
                              plan.rid, plan.s, plan.F, report.full_pages, report.buffers,
                              report.bytes)
            device = fb.out_cache_loc.device
            if any(replay) and self.no_mask:
                # Test-only negative control: the replay rows write their own latents / index
                # keys over the copied ones. Loud, per replay.
                for _, plan in taken:
                    receipts.line(ADAPTER, "TEST ONLY write mask REMOVED request=%s rows=[%d,%d): "
                                  "%s=1, the replay rows write their own latents / index keys over "
                                  "the copied ones; this output is not cone's", plan.rid, plan.s,
                                  plan.F, NO_MASK_KEY)
            elif any(replay):
                if fb.encoder_swa_compress_rows is not None or fb.encoder_swa_replay:
                    receipts.fallback(ADAPTER, "engine encoder-replay fold owns the compress rows; "
                                               "replay rows keep their own latent writes")
                else:
                    fb.encoder_swa_compress_rows = cc.keep_rows(extend, replay, device=device)
            if self.no_floor:
                # Test-only negative control: no floor, so the replay rows whose window reaches
                # below s read the evicted slots (the padding slot). Loud, per replay.
                for _, plan in taken:
                    receipts.line(ADAPTER, "TEST ONLY window floor REMOVED request=%s rows=[%d,%d): "
                                  "%s=1, replay rows read window slots below s=%d (evicted, the "
                                  "padding slot); this output is not cone's", plan.rid, plan.s,
                                  plan.F, NO_FLOOR_KEY, plan.s)
            else:
                floor = cc.row_floor(extend, floors, device=device)
                if fb.encoder_swa_row_floor is None:
                    fb.encoder_swa_row_floor = floor
                setattr(fb, FLOOR_ATTR, floor)
        except Exception as exc:  # noqa: BLE001 - mask or floor not in place: fail them all
            failed = [r or f"replay mask/floor failed ({type(exc).__name__})" for r in failed]
        return applied, failed

    @staticmethod
    def _agree(taken: list, failed: list) -> list:
        """Every TP rank fails the same requests: a copy can fail on one rank alone (its own
        memory), and a request failed on one rank but served on another would leave the ranks'
        trees and batches apart. The verdict is reduced (MIN) over the cache's attention TP
        groups, as the engine does for its external-linker loads; every rank reaches this call
        for the same batch, since the plans and the batch are the same on every rank."""
        import torch

        tree = taken[0][1].tree
        if tree is None:
            return failed
        ok = torch.tensor([int(r is None) for r in failed], dtype=torch.int32)
        try:
            tree._all_reduce_attn_groups(ok, torch.distributed.ReduceOp.MIN)
        except Exception as exc:  # noqa: BLE001 - no verdict: fail them all
            return [r or f"TP verdict failed ({type(exc).__name__})" for r in failed]
        return [r if r is not None or ok[j] else "replay not prepared on another TP rank"
                for j, r in enumerate(failed)]


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


# The engine's own SWA bounded replays (DeepSeek-V4.1): ExecFeatures field -> launch flag. Cone
# declines beside the encoder one and acts beside the decoder one (module docstring).
ENGINE_REPLAY_FLAGS = (("enable_encoder_swa_bounded_replay", "--enable-encoder-swa-bounded-replay"),)
DECODER_REPLAY_FIELD = "enable_decoder_swa_bounded_replay"


def engine_replay() -> Optional[str]:
    """The launch flag of an engine SWA bounded replay that cone declines beside, or None.

    The encoder flag caches no SWA window at all and folds its own replay rows into the compress
    rows cone masks (docs/swa_cone.md, "Beside the engine's bounded replay"). Read from the
    resolved server arguments (`get_exec().features`), which every TP rank has alike."""
    from sglang.srt.runtime_context import get_exec

    features = get_exec().features
    for field, flag in ENGINE_REPLAY_FLAGS:
        if getattr(features, field):
            return flag
    return None


def decoder_replay() -> bool:
    """Whether the engine's decoder SWA bounded replay is in effect (resolved: on by default
    for DeepSeek-V4.1 on CUDA). Cone then ends a first pass that is not the last at F."""
    from sglang.srt.runtime_context import get_exec

    return bool(getattr(get_exec().features, DECODER_REPLAY_FIELD))


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
    no_floor, no_copy, no_mask = ctx.value(NO_FLOOR_KEY), ctx.value(NO_COPY_KEY), ctx.value(NO_MASK_KEY)
    cone = _cone = Cone(tokens, test, no_floor, no_copy, no_mask)
    ctx.around("UnifiedRadixCache.match_prefix", cone.match_prefix)
    ctx.around("PrefillAdder.add_one_req", cone.add_one_req)
    ctx.around("PrefillAdder._select_prefill_admission", cone.select_admission)
    ctx.around("DeepseekV4AttnBackend._build_forward_metadata", cone.build_forward_metadata)
    ctx.around("DeepseekV4AttnBackend.init_forward_metadata_prefill", cone.init_prefill_metadata)
    removed = [f"{key}=1 ({what})" for key, what, on in (
        (NO_FLOOR_KEY, "no window floor: the replay rows read window slots below s, evicted, the "
                       "padding slot", no_floor),
        (NO_COPY_KEY, "no copy of the resident latents / index keys: the replay rows' pages keep "
                      "stale ones", no_copy),
        (NO_MASK_KEY, "no write mask: the replay rows write their own latents / index keys over "
                      "the copied ones", no_mask)) if on]
    return (f"DSV41_SWA_CONE_TOKENS={tokens}: a lost resume point replays {tokens} tokens in the "
            f"first pass (plan/copy lines per replay)"
            + ("; DSV41_SWA_CONE_TEST=1 (copy self-check)" if test else "")
            + ("; TEST ONLY, NEGATIVE CONTROL: " + "; ".join(removed) + "; outputs are not "
               "cone's; never in a profile" if removed else ""))
