"""input_guard's hooks: where the engine calls the rules (adapter/input_guard/rules.py), one
installer per place, each registering its wraps (adapter/table.py rows, pinned) through the
installer's context. The engine's types are read here, at install; the rules stay engine-free."""
from __future__ import annotations

import functools
import importlib
import time

from adapter import receipts
from adapter.input_guard.rules import (
    FIELDS, KEY, LIMIT_KEYS, NAME, SESSIONS_OFF, Limits, Re2Search, Unchecked, _is_int, check,
    kind_of, re2_module)
from adapter.tp_group import all_reduce_max

SB = "sglang.srt.managers.schedule_batch"
XG = "sglang.srt.constrained.xgrammar_backend"


def rejection_class():
    """The exception a refused request raises: the engine's own ValueError (its routes answer it
    with 400 naming the message), and an HTTP 400 too, for the routes that catch nothing (the
    Ollama-compatible ones: the app's HTTPException handler answers it)."""
    try:
        from fastapi import HTTPException
    except ImportError:         # no HTTP layer in this process: the engine's ValueError
        return ValueError

    class Rejected(ValueError, HTTPException):
        def __init__(self, message: str):
            HTTPException.__init__(self, status_code=400, detail=message)
            ValueError.__init__(self, message)

        def __str__(self):
            return self.detail

        __repr__ = ValueError.__repr__

    return Rejected


def declared_kinds() -> dict:
    """(struct, field) -> (kind, optional), from the engine's own struct declarations."""
    import msgspec

    from sglang.srt.managers.io_struct import TokenizedGenerateReqInput
    from sglang.srt.sampling.sampling_params import SamplingParams

    types_of = {"request": {f.name: f.type for f in msgspec.structs.fields(TokenizedGenerateReqInput)},
                "sampling_params": {f.name: f.type for f in msgspec.structs.fields(SamplingParams)}}
    return {(f.struct, f.name): kind_of(types_of[f.struct][f.name]) for f in FIELDS}

def live_reqs(scheduler) -> list:
    """Every request the scheduler's abort_request matches against, where it looks for them
    (the chunked request, the waiting queue, the running / last batches, the grammar queue)."""
    out, seen = [], set()
    groups = ([scheduler.chunked_req], scheduler.waiting_queue, scheduler.collect_inflight_reqs(),
              scheduler.grammar_manager.grammar_queue)
    for group in groups:
        for req in (group.values() if isinstance(group, dict) else group):
            if req is not None and id(req) not in seen:
                seen.add(id(req))
                out.append(req)
    return out



# --- the grammar step bound: time per grammar call on this rank, verdict agreed per batch --------
def note_step_time(grammar, began: float) -> None:
    """Keep the slowest call (microseconds, this rank's clock) of a grammar since the last batch's
    agreement. A measurement only: the verdict is taken from the TP group's agreed value."""
    spent = int((time.perf_counter() - began) * 1e6)
    if spent > getattr(grammar, "_dsv41_step_us", 0):
        grammar._dsv41_step_us = spent


@functools.lru_cache(maxsize=None)
def _xgrammar_class():
    """The engine's XGrammarGrammar (looked up once: the check runs after every batch)."""
    return importlib.import_module(XG).XGrammarGrammar


def xgrammar_of(req):
    """The engine's XGrammarGrammar behind a request's grammar, or None: a reasoning parser wraps
    it in a ReasonerGrammarObject whose `grammar` is the backend's."""
    grammar = getattr(req, "grammar", None)
    for _ in range(3):
        if grammar is None or isinstance(grammar, _xgrammar_class()):
            return grammar
        grammar = getattr(grammar, "grammar", None)
    return None


def agreed_step_us(grammars, group, world: int, reduce=all_reduce_max) -> list[int]:
    """Each grammar's slowest call since the last agreement, MAX over the TP group (every rank
    gets the same list, in the batch's order, which is the same on every rank); one rank: its own."""
    local = [int(getattr(g, "_dsv41_step_us", 0)) for g in grammars]
    if world <= 1 or group is None:
        return local
    return reduce(local, group)



class Guard:
    """What every hook of one install shares: the counters, the bounds, the refusal."""

    def __init__(self, ctx):
        self.ctx = ctx
        self.counters = ctx.counters
        self.limits = Limits.from_ctx(ctx)
        self.re2 = re2_module()
        self.rejected = rejection_class()
        self._logged: set = set()

    def once(self, key, fmt, *args) -> None:
        if key not in self._logged:
            self._logged.add(key)
            receipts.line(NAME, fmt, *args)

    def reject(self, reason: str, message: str):
        self.counters[f"rejected:{reason}"] += 1
        self.once(reason, "rejected a request (HTTP 400): %s; further %s rejections are counted, "
                  "not logged", message, reason)
        raise self.rejected(message)


def install_check(ctx, guard: Guard) -> None:
    """The choke point: every tokenized request, checked before it leaves for the scheduler."""
    kinds = declared_kinds()        # the engine's declared types of the guarded fields

    def create_tokenized_object(original, self, obj, *args, **kwargs):
        tokenized = original(self, obj, *args, **kwargs)     # the engine's errors propagate as is
        try:
            guard.counters["checked"] += 1
            bad = check(tokenized, self.model_config.vocab_size, kinds, ctx.fallback, guard.limits,
                        guard.re2)
        except Exception as exc:  # noqa: BLE001 - fail closed: what we could not check is refused
            detail = str(exc) if isinstance(exc, Unchecked) else type(exc).__name__
            guard.reject("unchecked", f"input_guard could not check this request ({detail}); it "
                                      "is refused rather than sent to the scheduler unchecked")
        if bad is None:
            return tokenized
        guard.reject(*bad)

    ctx.around("TokenizerManager._create_tokenized_object", create_tokenized_object)


def install_sessions(ctx, guard: Guard) -> None:
    """Sessions off: opening and closing one is refused where the tokenizer manager would send it."""
    async def _refuse_session(what: str):
        guard.reject("sessions", SESSIONS_OFF.format(what=what))

    def open_session(original, self, obj, *args, **kwargs):
        return _refuse_session("/open_session")

    def close_session(original, self, obj, *args, **kwargs):
        return _refuse_session("/close_session")

    ctx.around("TokenizerControlMixin.open_session", open_session)
    ctx.around("TokenizerControlMixin.close_session", close_session)


def install_way_in(ctx, guard: Guard) -> None:
    """What is spent before the choke point: the engine's normalisation (first thing in
    generate_request) expands the request n times."""
    limits = guard.limits

    def generate_request(original, self, obj, *args, **kwargs):
        sp = getattr(obj, "sampling_params", None)
        items = [sp] if isinstance(sp, dict) else sp if isinstance(sp, list) else ()
        for item in items:
            n = item.get("n", 1) if isinstance(item, dict) else 1
            if _is_int(n) and n > limits.n:
                guard.reject("n", f"sampling_params.n = {n} is over this line's limit of {limits.n} "
                                  f"parallel samples per request ({LIMIT_KEYS['n']})")
        return original(self, obj, *args, **kwargs)

    ctx.around("TokenizerManager.generate_request", generate_request)


def install_exact_aborts(ctx, guard: Guard) -> None:
    """The engine matches an abort's rid as a prefix of every request's rid: the others whose rid
    merely starts with it are hidden for the duration of the engine's own abort."""
    def abort_request(original, self, recv_req):
        rid = recv_req.rid
        if recv_req.abort_all or not isinstance(rid, str) or not rid:
            return original(self, recv_req)
        if (getattr(self, "mm_receiver", None) is not None or self.dllm_config is not None
                or str(getattr(self.disaggregation_mode, "value", self.disaggregation_mode)) != "null"):
            ctx.fallback("abort_request in a disaggregated, dLLM or EPD scheduler: its other "
                         "queues are matched by rid prefix as the engine does")
            return original(self, recv_req)
        mark = "\x01" if rid[0] == "\x00" else "\x00"
        hidden = [(req, req.rid) for req in live_reqs(self)
                  if isinstance(req.rid, str) and req.rid != rid and req.rid.startswith(rid)]
        for req, own in hidden:
            req.rid = mark + own
        try:
            return original(self, recv_req)
        finally:
            for req, own in hidden:
                req.rid = own
            if hidden:
                guard.once("abort_exact", "kept an abort exact: the abort of rid %r left %d "
                           "running request(s) whose rid starts with it untouched (logged once)",
                           rid, len(hidden))

    ctx.around("Scheduler.abort_request", abort_request)


def install_grammar_bound(ctx, guard: Guard) -> None:
    """A grammar step is time-bounded per request: each xgrammar call timed on this rank, the
    verdict agreed over the TP group after each batch, the request finished through the engine's
    own grammar error path."""
    limits = guard.limits
    budget_us = limits.grammar_step_ms * 1000
    layout: dict = {}

    def bound_layout(scheduler) -> tuple[bool, object, int]:
        """(acts, gloo group, ranks) of the grammar step bound in this scheduler process, decided
        once from the engine's parallel layout. Every rank of the scheduler's DP-local TP group
        runs each request's grammar (the group the engine itself agrees grammar readiness over,
        `GrammarManager.grammar_sync_group`), so each step's verdict is agreed over it. Context-
        and pipeline-parallel ranks follow other paths: the bound stays off there, said once."""
        if "acts" not in layout:
            reason, group, world = None, None, 1
            try:
                from sglang.srt.runtime_context import get_parallel

                parallel = get_parallel()
                others = parallel.attn_cp_size * parallel.pp_size
                if others != 1:
                    reason = (f"{others} context- / pipeline-parallel ranks (attention CP x PP) run "
                              "each request's grammar; the bound agrees over the TP group only")
                else:
                    world = int(scheduler.dp_tp_group.world_size)
                    group = scheduler.dp_tp_cpu_group if world > 1 else None
            except Exception as exc:  # noqa: BLE001 - an unknown layout: stay off, say why
                reason = f"the parallel layout is unknown here ({type(exc).__name__})"
            layout.update(acts=reason is None, group=group, world=world)
            if reason is not None:
                ctx.fallback(f"grammar step bound off: {reason}; a request finished on one rank's "
                             "clock would split the ranks' batches (grammar compilation stays "
                             "bounded by the engine's grammar timeout)")
        return layout["acts"], layout["group"], layout["world"]

    def over_budget(grammar, us: int, world: int) -> None:
        ranks = "this rank's" if world == 1 else f"the slowest of {world} TP ranks"
        grammar._dsv41_over_budget = (
            f"dsv41 input_guard: this request's grammar took {us / 1000:.0f} ms in one decode step "
            f"({ranks}), over this line's limit of {limits.grammar_step_ms} ms "
            f"({LIMIT_KEYS['grammar_step_ms']}); the request is finished, the batch goes on")
        guard.once("grammar_step", "finished a request whose grammar took %.0f ms in one decode "
                   "step (%s), over %d ms (logged once)", us / 1000, ranks, limits.grammar_step_ms)

    def accept_token(original, self, token):
        message = getattr(self, "_dsv41_over_budget", None)
        if message is not None:
            raise ValueError(message)            # the engine finishes that request (FINISH_ABORT)
        began = time.perf_counter()
        out = original(self, token)
        note_step_time(self, began)
        return out

    def fill_vocab_mask(original, self, vocab_mask, idx):
        if getattr(self, "_dsv41_over_budget", None) is not None:
            return None                          # no more grammar work: accept_token finishes it
        began = time.perf_counter()
        out = original(self, vocab_mask, idx)
        note_step_time(self, began)
        return out

    def process_batch_result(original, self, batch, result):
        """After each batch's result, on every rank at the same point of its loop: the slowest
        grammar call of each of the batch's grammar requests since the last batch, agreed (MAX)
        over the TP group; a request over the bound is marked on every rank alike, and its next
        accept_token finishes it through the engine's own grammar error path."""
        out = original(self, batch, result)
        try:
            grammars = [g for g in map(xgrammar_of, batch.reqs or ()) if g is not None]
            if not grammars:                     # the same batch on every rank: all skip alike
                return out
            acts, group, world = bound_layout(self)
            agreed = agreed_step_us(grammars, group, world) if acts else [0] * len(grammars)
        except Exception as exc:  # noqa: BLE001 - never into the scheduler loop; nothing marked
            ctx.fallback(f"grammar step bound skipped a batch: {type(exc).__name__} while agreeing "
                         "its grammar step times; no request finished by the bound there")
            return out
        for grammar, us in zip(grammars, agreed):
            grammar._dsv41_step_us = 0
            if us > budget_us and getattr(grammar, "_dsv41_over_budget", None) is None:
                over_budget(grammar, us, world)
        return out

    ctx.around("XGrammarGrammar.accept_token", accept_token)
    ctx.around("XGrammarGrammar.fill_vocab_mask", fill_vocab_mask)
    ctx.around("Scheduler.process_batch_result", process_batch_result)


def install_stop_regex(ctx, guard: Guard) -> None:
    """The scheduler's per-step stop_regex search runs on RE2 (schedule_batch's `re`)."""
    if guard.re2 is None:
        return
    import re

    schedule_batch = importlib.import_module(SB)
    if not isinstance(schedule_batch.re, Re2Search):
        schedule_batch.re = Re2Search(re)


# In this order (the order of their wraps in the installer's registry).
PARTS = (install_check, install_sessions, install_way_in, install_exact_aborts,
         install_grammar_bound, install_stop_regex)


def install(ctx) -> str:
    guard = Guard(ctx)
    for part in PARTS:
        part(ctx, guard)
    limits, re2 = guard.limits, guard.re2
    return (f"{KEY}=1: every request's tokenized fields are checked in the tokenizer manager before "
            "the scheduler (prompt ids, logprob_start_len, top_logprobs_num, lora_id, "
            "positional_embed_overrides, stop_token_ids; each sampling number against its tensor's "
            "type and range, logit_bias, rid, sessions (off), prompt index fields) and bounded "
            f"(n <= {limits.n}, prompt log-prob entries <= {limits.logprob_entries}, stop strings "
            f"<= {limits.stop_chars} characters); a bad request gets HTTP 400 naming the field or "
            "the limit; a request the guard cannot check gets 400 too; "
            + ("stop_regex runs on RE2 (linear time)" if re2 is not None else
               "stop_regex refused (RE2, google-re2, not installed)")
            + f"; a grammar step over {limits.grammar_step_ms} ms (the slowest TP rank's, agreed "
              "after each batch) finishes its request; aborts "
              "match rids exactly")
