"""input_guard's hooks: where the engine calls the rules (adapter/input_guard/rules.py), one
installer per place, each registering its wraps (adapter/table.py rows, pinned) through the
installer's context. The engine's types are read here, at install; the rules stay engine-free."""
from __future__ import annotations

import asyncio
import collections
import functools
import importlib
import os
import sys
import time
import weakref

from adapter import receipts
from adapter.input_guard.rules import (
    CLIENT_HEADER, FIELDS, GRAMMAR_SHARE_STATUS, KEY, LIMIT_KEYS, NAME, SESSIONS_OFF,
    TEXT_CHARS_PER_TOKEN, Limits,
    Re2Search, Unchecked, check, check_embedding_batch, check_grammar_share, check_ollama_options,
    check_parse_size, check_prompt_present, check_samples, check_text_size, check_vertex,
    client_of, compile_workers, grammar_keys, grammar_share, kind_of, re2_module)
from adapter.input_guard.rules import check_body_text, check_chat_messages, check_request_logprobs
from adapter.tp_group import all_reduce_max

SB = "sglang.srt.managers.schedule_batch"
HTTP = "sglang.srt.entrypoints.http_server"
ROUTE_TOUCHES = "input_guard.routes"      # table.INFRA_TOUCHES: checked when the routes are wrapped
# The status of a request the grammar step bound finished: a client's grammar, not a server fault.
GRAMMAR_STATUS = 400
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
        def __init__(self, message: str, status_code: int = 400):
            HTTPException.__init__(self, status_code=status_code, detail=message)
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


@functools.lru_cache(maxsize=1)
def engine_fields_cached():
    return engine_fields()


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

    def reject(self, reason: str, message: str, status: int = 400):
        self.counters[f"rejected:{reason}"] += 1
        self.once(reason, "rejected a request (HTTP %d): %s; further %s rejections are counted, "
                  "not logged", status, message, reason)
        if status != 400 and self.rejected is not ValueError:
            raise self.rejected(message, status)
        raise self.rejected(message)    # without an HTTP layer: the engine's ValueError


def chunked_prefill_size(tokenizer_manager) -> int | None:
    """The line's chunked-prefill size (None or <= 0: prefill not chunked)."""
    size = getattr(tokenizer_manager.server_args, "chunked_prefill_size", None)
    return size if isinstance(size, int) else None


def install_check(ctx, guard: Guard) -> None:
    """The choke point: every tokenized request, checked before it leaves for the scheduler."""
    # the engine's declared types of the guarded fields, read at the first call (install may run
    # while the engine's modules are still importing one another)
    kinds: dict = {}

    def create_tokenized_object(original, self, obj, *args, **kwargs):
        tokenized = original(self, obj, *args, **kwargs)     # the engine's errors propagate as is
        try:
            guard.counters["checked"] += 1
            if not kinds:
                kinds.update(declared_kinds())
            bad = check(tokenized, self.model_config.vocab_size, kinds, ctx.fallback, guard.limits,
                        guard.re2, chunked_prefill_size(self))
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
    """What is spent before the choke point, bounded before it is spent: the engine's
    normalisation (first thing in generate_request) expands the request into prompts x n samples,
    and the tokenizer manager tokenizes text on the HTTP event loop."""
    def generate_request(original, self, obj, *args, **kwargs):
        limits = guard.limits           # read per call: the text bound resolves at the manager's init
        message = check_prompt_present(obj)
        if message is not None:
            guard.reject("input_ids", message)
        if type(obj).__name__ == "EmbeddingReqInput":
            message = check_embedding_batch(obj)
            if message is not None:
                guard.reject("sampling_params" if message.startswith("sampling") else "rid", message)
        message = check_samples(obj, limits)
        if message is not None:
            guard.reject("n", message)
        message = check_text_size(obj, limits)
        if message is not None:
            guard.reject("text_chars", message)
        # the whole request's prompt log-probs (every prompt, every sample), before the engine
        # sends any of it: a text batch is tokenized and sent one prompt at a time
        message = check_request_logprobs(obj, limits)
        if message is not None:
            guard.reject("logprob_entries", message)
        return original(self, obj, *args, **kwargs)

    ctx.around("TokenizerManager.generate_request", generate_request)


def install_own_aborts(ctx, guard: Guard) -> None:
    """A refused request's abort never reaches another request: a streamed /generate schedules an
    abort of its rids when its stream ends (`create_abort_task`); when the engine refused the
    request as a duplicate, those rids are another client's. Each request's abort takes only the
    states that request registered (`_init_req_state`)."""
    def init_req_state(original, self, obj, *args, **kwargs):
        out = original(self, obj, *args, **kwargs)          # a duplicate raises: nothing noted
        try:
            rids = [obj.rid] if obj.is_single else list(obj.rid)
            obj._dsv41_states = {rid: self.rid_to_state.get(rid) for rid in rids}
        except Exception as exc:  # noqa: BLE001 - the engine's abort stays as it is
            ctx.fallback(f"could not note a request's own states ({type(exc).__name__}); its "
                         "stream's abort task aborts its rids as the engine does")
        return out

    def create_abort_task(original, self, obj):
        tasks = original(self, obj)
        try:
            task = tasks.tasks[0]
        except (AttributeError, IndexError):
            ctx.fallback("the engine's abort task has another shape; left as it is")
            return tasks

        async def abort_own():
            await asyncio.sleep(2)                  # as the engine's own task
            own = getattr(obj, "_dsv41_states", None)
            if own is None:                         # refused before it registered: nothing of its own
                if getattr(obj, "rid", None) is not None:
                    guard.once("abort_refused", "kept the abort task of a refused request (rid %r) "
                               "from another client's request with that rid (logged once)", obj.rid)
                return
            for rid, state in own.items():
                if state is not None and self.rid_to_state.get(rid) is state:
                    self.abort_request(rid)

        task.func, task.args, task.kwargs = abort_own, (), {}
        return tasks

    ctx.around("TokenizerManager._init_req_state", init_req_state)
    ctx.around("TokenizerManager.create_abort_task", create_abort_task)


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
        grammar._dsv41_client_message = (
            f"dsv41 input_guard: this request's grammar exceeded the per-step bound of "
            f"{limits.grammar_step_ms} ms ({LIMIT_KEYS['grammar_step_ms']}): one decode step of it "
            f"took {us / 1000:.0f} ms ({ranks}); the request is finished (a grammar or regex that "
            "matches in fewer alternatives per token runs within it)")
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
        accept_token finishes it through the engine's own grammar error path, answered 400."""
        use_re2(guard)                           # before any stop_regex search of this batch
        marked = marked_reqs(batch)              # the engine drops a finished request's grammar
        out = original(self, batch, result)
        for req, grammar in marked:
            client_status(req, grammar)
        try:
            pairs = [(req, g) for req in (batch.reqs or ()) if (g := xgrammar_of(req)) is not None]
            if not pairs:                        # the same batch on every rank: all skip alike
                return out
            grammars = [g for _, g in pairs]
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

    def marked_reqs(batch) -> list:
        try:
            return [(req, g) for req in (batch.reqs or ()) if (g := xgrammar_of(req)) is not None
                    and getattr(g, "_dsv41_over_budget", None) is not None]
        except Exception:  # noqa: BLE001 - never into the scheduler loop
            return []

    def client_status(req, grammar) -> None:
        """The engine answers a grammar that failed to accept a token as its own fault (500): the
        request the bound finished is answered 400 saying so (the FINISH_ABORT the engine has
        just set on it, before the next step hands it to the client)."""
        try:
            finish = getattr(req, "to_finish", None)
            if finish is None or getattr(finish, "status_code", None) is None:
                return
            if grammar._dsv41_over_budget not in str(getattr(finish, "message", "")):
                return                           # another error of the engine's: as it is
            finish.message = grammar._dsv41_client_message
            finish.status_code = GRAMMAR_STATUS
            finish.err_type = "BadRequestError"
        except Exception as exc:  # noqa: BLE001 - never into the scheduler loop
            ctx.fallback(f"grammar step bound could not set the client's status ({type(exc).__name__}); "
                         "the engine's own answer (500) stands")

    ctx.around("XGrammarGrammar.accept_token", accept_token)
    ctx.around("XGrammarGrammar.fill_vocab_mask", fill_vocab_mask)
    ctx.around("Scheduler.process_batch_result", process_batch_result)


TIMED_OUT = "Grammar preprocessing timed out"      # the engine's verdict on a compile past its timeout


def install_grammar_cache(ctx, guard: Guard) -> None:
    """The scheduler's grammar caches, bounded, and a timeout never cached as a grammar's verdict:
    the engine caches a compilation that ran past its timeout (the compile pool busy with another
    client's schemas) as an invalid grammar, refused for every client until a restart."""
    limits = guard.limits

    def set_cache(original, self, key, value):
        message = getattr(value, "error_message", None)
        if isinstance(message, str) and message.startswith(TIMED_OUT):
            guard.once("grammar_timeout", "did not cache a grammar whose compilation timed out "
                       "(%s): the next request with it compiles it again (logged once)",
                       key[0] if isinstance(key, tuple) and key else "grammar")
            return None
        out = original(self, key, value)
        cache = getattr(self, "cache", None)
        if isinstance(cache, dict):
            while len(cache) > limits.grammar_cache:
                cache.pop(next(iter(cache)))            # the oldest first
        return out

    def backend_init(original, self, *args, **kwargs):
        # the xgrammar backend's own: its set_cache (the base class's, which the grammar manager
        # calls on this instance) bounded on the instance, its compiler rebuilt with a byte limit.
        # (Not a row on the base class's module: it loads while io_struct is still importing, and
        # a row there would import this group's other modules at that moment.)
        out = original(self, *args, **kwargs)
        try:
            base_set_cache = type(self).set_cache
            self.set_cache = functools.partial(set_cache, base_set_cache, self)
        except Exception as exc:  # noqa: BLE001 - the engine's cache stays, unbounded
            ctx.fallback(f"the grammar cache left as the engine keeps it ({type(exc).__name__})")
        try:
            from xgrammar import GrammarCompiler

            self.grammar_compiler = GrammarCompiler(
                tokenizer_info=self._tokenizer_info,
                cache_limit_bytes=limits.grammar_cache_mb * 1024 * 1024)
        except Exception as exc:  # noqa: BLE001 - the engine's compiler stays, unbounded
            ctx.fallback(f"xgrammar's compiler cache left unbounded ({type(exc).__name__}: {exc})")
        return out

    ctx.around("XGrammarGrammarBackend.__init__", backend_init)


def also_around(ctx, qualname: str, hook) -> None:
    """Wrap a row another part of this install already wraps (one hook per row): the earlier
    hook runs inside this one, as the engine's call."""
    rows = [r for r in getattr(ctx, "rows", ()) if qualname in (r.qualname, r.target)]
    earlier = getattr(ctx, "hooks", {}).get(rows[0].target) if rows else None
    if earlier is None:
        ctx.around(qualname, hook)
        return

    def both(original, *args, **kwargs):
        return hook(functools.partial(earlier, original), *args, **kwargs)

    ctx.around(qualname, both)


class GrammarShare:
    """Each client's requests with a grammar not yet answered (this tokenizer manager's count),
    and the grammars this line has answered (the scheduler has them compiled and cached)."""

    def __init__(self, remember: int = 128):
        self.pending: collections.Counter = collections.Counter()
        # grammar key -> None, oldest first, at most `remember` (the scheduler's cache bound:
        # one it evicted compiles again uncounted, at most that many)
        self.answered: collections.OrderedDict = collections.OrderedDict()
        self.remember = max(int(remember), 0)

    def hold(self, client: str, n: int):
        """Count n for client; the returned release (idempotent) uncounts them."""
        self.pending[client] += n
        done = []

        def release():
            if not done:
                done.append(True)
                self.pending[client] -= n
                if self.pending[client] <= 0:
                    del self.pending[client]
        return release

    def known(self, key) -> bool:
        return key in self.answered

    def note_answered(self, keys) -> None:
        for key in keys:
            self.answered[key] = None
            self.answered.move_to_end(key)
        while len(self.answered) > self.remember:
            self.answered.popitem(last=False)


def _answered(out) -> bool:
    """An output of the engine's response generator that is not an abort (a grammar that failed
    to compile, timed out or was refused ends its request with FINISH_ABORT)."""
    for item in out if isinstance(out, list) else [out]:
        meta = item.get("meta_info") if isinstance(item, dict) else None
        reason = meta.get("finish_reason") if isinstance(meta, dict) else None
        if not isinstance(meta, dict) or (isinstance(reason, dict) and reason.get("type") == "abort"):
            return False
    return True


async def _held(inner, release, on_answered=None):
    """The engine's response generator, the request counted until its first output (the
    scheduler has compiled its grammar by then) or its end (an error, an abort, a disconnect).
    `on_answered` runs once, at the first output that is not an abort: the grammar is compiled."""
    try:
        async for out in inner:
            release()
            if on_answered is not None:
                if _answered(out):
                    on_answered()
                on_answered = None
            yield out
    finally:
        release()


def install_grammar_share(ctx, guard: Guard) -> None:
    """The grammar compile pool (issue 50): the scheduler compiles every grammar on one thread
    pool, first come first served, and times a request out counting from when it was queued;
    one client's large schemas held every worker and another client's two-field schema timed
    out. Each client may have at most its share of requests with a grammar unanswered (counted
    here, once, before the request is tokenized: no TP rank decides anything); one more is
    answered 429 at once, naming the bound and the count."""
    limits = guard.limits
    workers = compile_workers(os.cpu_count())   # the engine's pool on this node (its default)
    share = grammar_share(limits, os.cpu_count())
    counts = GrammarShare(limits.grammar_cache)
    INSTALLED["grammar_share"] = counts

    def generate_request(original, self, obj, request=None, *args, **kwargs):
        inner = original(self, obj, request, *args, **kwargs)   # the way-in checks raise first
        if request is None:         # the in-process Engine API: the operator's own caller
            return inner
        try:
            # a grammar this line has answered is compiled and cached in the scheduler: its
            # requests take no compile worker and are not counted
            new = [(key, count) for key, count in grammar_keys(obj) if not counts.known(key)]
            adding = sum(count for _, count in new)
            if not adding:
                return inner
            peer = getattr(request, "client", None)
            header = request.headers.get(CLIENT_HEADER) if limits.client_header else None
            client = client_of(getattr(peer, "host", None), header, limits.client_header)
        except Exception as exc:  # noqa: BLE001 - not counted: the engine's pool as stock
            ctx.fallback(f"grammar compile share not counted for a request ({type(exc).__name__}); "
                         "it is sent as the engine would")
            return inner
        message = check_grammar_share(client, counts.pending[client], adding, share, workers)
        if message is not None:
            guard.reject("grammar_compiles", message, GRAMMAR_SHARE_STATUS)
        release = counts.hold(client, adding)
        out = _held(inner, release, functools.partial(counts.note_answered, [key for key, _ in new]))
        weakref.finalize(out, release)          # a response never iterated: uncounted when dropped
        return out

    also_around(ctx, "TokenizerManager.generate_request", generate_request)
    receipts.line(NAME, "bounds each client's unanswered requests with a grammar this line has not "
                  "answered before to %d (%s; the engine's compile pool here: %d workers; the "
                  "last %d grammars answered are not counted); the client is %s", share,
                  LIMIT_KEYS["grammar_compiles"], workers, counts.remember,
                  f"the {CLIENT_HEADER} header when a request has one, else the peer's host"
                  if limits.client_header else "the peer's host")


def use_re2(guard: Guard) -> None:
    """schedule_batch's `re` replaced by Re2Search (once the engine has imported that module)."""
    schedule_batch = sys.modules.get(SB)
    if guard.re2 is not None and schedule_batch is not None and not isinstance(schedule_batch.re, Re2Search):
        import re

        schedule_batch.re = Re2Search(re)


def install_stop_regex(ctx, guard: Guard) -> None:
    """The scheduler's per-step stop_regex search runs on RE2 (schedule_batch's `re`): now when the
    engine has imported schedule_batch, else before the scheduler's first batch result (install
    may run while the engine's modules are still importing one another)."""
    use_re2(guard)


def engine_fields() -> tuple[frozenset, frozenset]:
    """The names the engine's GenerateReqInput and SamplingParams take (read from the engine)."""
    import dataclasses

    import msgspec

    from sglang.srt.managers.io_struct import GenerateReqInput
    from sglang.srt.sampling.sampling_params import SamplingParams

    request = frozenset(f.name for f in dataclasses.fields(GenerateReqInput) if f.init)
    sampling = frozenset(f.name for f in msgspec.structs.fields(SamplingParams))
    return request, sampling


def install_ollama(ctx, guard: Guard) -> None:
    """The Ollama routes: `options.seed` reaches the engine's own field (`sampling_seed`), a value
    its SamplingParams cannot compare is a 400 naming the option, and the engine's ValueError for
    a client's value (its convention: every other route answers it 400) is a 400 here too."""
    def maps_seed() -> bool:            # read at the first call, not at install (import order)
        _, sampling = engine_fields_cached()
        if "sampling_seed" in sampling:
            return True
        ctx.fallback("Ollama options.seed not mapped: this engine's SamplingParams has no "
                     "sampling_seed; the engine's Ollama mapping is left as it is")
        return False

    def convert_options(original, self, options=None):
        bad = check_ollama_options(options)
        if bad is not None:
            guard.reject(*bad)
        out = original(self, options)
        if isinstance(out, dict) and "seed" in out and "sampling_seed" not in out and maps_seed():
            out["sampling_seed"] = out.pop("seed")
            args = getattr(self.tokenizer_manager, "server_args", None)
            honoured = bool(getattr(args, "enable_deterministic_inference", False))
            guard.once("ollama_seed", "mapped Ollama options.seed to the engine's sampling_seed "
                       "(logged once): %s", "honoured, --enable-deterministic-inference is on"
                       if honoured else "this line runs without --enable-deterministic-inference, "
                       "where the engine samples without it, as for a seeded /generate")
        return out

    def answer_400(exc: ValueError):
        from fastapi import HTTPException

        if isinstance(exc, HTTPException):       # ours, or the engine's with its own status
            raise exc
        guard.counters["rejected:engine_value_error"] += 1
        guard.once("engine_value_error", "answered the engine's ValueError on an Ollama route with "
                   "400 (as its other routes do): %s; further ones are counted, not logged", exc)
        raise guard.rejected(str(exc)) from exc

    async def generate_response(original, self, gen_request, raw_request, model_name):
        # only the tokenizer manager's call and the answer built of it: a ValueError here is the
        # engine naming a client's value (the chat template's own errors, before, stay as they are)
        try:
            return await original(self, gen_request, raw_request, model_name)
        except ValueError as exc:
            answer_400(exc)

    ctx.around("OllamaServing._convert_options_to_sampling_params", convert_options)
    async def stream_response(original, self, gen_request, raw_request, model_name):
        # a stream's status goes out with its first chunk: the first chunk is awaited here, so the
        # tokenizer manager's ValueError (raised before any output) is answered 400, not a stream
        # cut after a 200
        response = await original(self, gen_request, raw_request, model_name)
        chunks = getattr(response, "body_iterator", None)
        if chunks is None:
            return response
        try:
            first = await chunks.__anext__()
        except StopAsyncIteration:
            first = None
        except ValueError as exc:
            answer_400(exc)

        async def replay():
            if first is not None:
                yield first
                async for chunk in chunks:
                    yield chunk

        response.body_iterator = replay()
        return response

    ctx.around("OllamaServing._generate_chat_response", generate_response)
    ctx.around("OllamaServing._generate_generate_response", generate_response)
    ctx.around("OllamaServing._stream_chat_response", stream_response)
    ctx.around("OllamaServing._stream_generate_response", stream_response)


def guard_routes(app, guard: Guard, fallback) -> list[str]:
    """Wrap the endpoints of the app's routes whose handler builds a request the engine cannot
    (`/vertex_generate`: `GenerateReqInput(**parameters)`) before the handler runs; the paths
    wrapped. Called once the HTTP module is loaded, before uvicorn serves; the module's internals
    it touches are checked against their pins here (adapter/table.py INFRA_TOUCHES)."""
    from adapter import pins

    drift = pins.drifted_touches(ROUTE_TOUCHES)
    if drift:
        fallback(f"route checks not added: {drift[0]} drifted from its pin; /vertex_generate and "
                 "the parse routes answer as the engine does")
        return []
    http = sys.modules[HTTP]
    request_fields, sampling_fields = engine_fields()
    wrapped = []

    def vertex_generate(original):
        async def guarded(vertex_req, raw_request):
            message = check_vertex(vertex_req.instances, vertex_req.parameters, request_fields,
                                   sampling_fields)
            if message is not None:
                INSTALLED.get("guard", guard).reject("vertex", message)
            return await original(vertex_req=vertex_req, raw_request=raw_request)

        guarded._dsv41_guarded = True
        guarded.__wrapped__ = original
        return guarded

    def parse_route(original, path):
        async def guarded(obj, request):
            current = INSTALLED.get("guard", guard)      # this process's latest install
            message = check_parse_size(getattr(obj, "text", None), path, current.limits)
            if message is not None:
                current.reject("parse_chars", message)
            return await original(obj=obj, request=request)

        guarded._dsv41_guarded = True
        guarded.__wrapped__ = original
        return guarded

    wraps = {http.vertex_generate: lambda call, path: vertex_generate(call),
             http.parse_function_call_request: parse_route,
             http.separate_reasoning_request: parse_route}
    for route in getattr(app, "routes", ()):
        dependant = getattr(route, "dependant", None)
        wrap = wraps.get(getattr(route, "endpoint", None))
        if wrap is not None and dependant is not None:
            if not getattr(dependant.call, "_dsv41_guarded", False):
                dependant.call = wrap(dependant.call, route.path)
            wrapped.append(route.path)
    if not wrapped:
        fallback("/vertex_generate not found among the app's routes: its body is not checked "
                 "before the route builds its request")
    return wrapped


def resolve_text_bound(tokenizer_manager, guard: Guard, fallback) -> None:
    """DSV41_INPUT_GUARD_MAX_TEXT_CHARS 0 (the default) becomes TEXT_CHARS_PER_TOKEN characters per
    token of the context length this tokenizer manager serves (the model's, or --context-length),
    with one line saying so; an operator's value is kept. Unreadable: a fallback line, and the
    rules' bound for an unknown context."""
    if guard.limits.text_chars > 0:
        return
    context_len = getattr(tokenizer_manager, "context_len", None)
    guard.limits = guard.limits.with_context(context_len)
    if guard.limits.text_chars > 0:
        receipts.line(NAME, "bounds a request's text to %d characters (%s unset: %d per token of the "
                      "context length %d, more than fits the context)", guard.limits.text_chars,
                      LIMIT_KEYS["text_chars"], TEXT_CHARS_PER_TOKEN, context_len)
    else:
        fallback(f"the text bound could not read the context length ({context_len!r}); it is "
                 f"{guard.limits.text_limit} characters ({LIMIT_KEYS['text_chars']} sets it)")


def install_routes(ctx, guard: Guard) -> None:
    """The route wraps, where the launcher builds its tokenizer manager: after the engine's HTTP
    module (and its app) exists, before uvicorn serves. (Not a row on the app's setup function:
    admin_guard's row there would make one install group of both adapters, whose modules the
    installer imports together, the HTTP server's in the scheduler too.)"""
    def tokenizer_manager_init(original, self, *args, **kwargs):
        out = original(self, *args, **kwargs)
        resolve_text_bound(self, guard, ctx.fallback)
        http = sys.modules.get(HTTP)
        if http is None:        # an Engine without the HTTP server: no route to wrap
            return out
        try:
            paths = guard_routes(http.app, guard, ctx.fallback)
            if paths:
                receipts.line(NAME, "checks the bodies of %s before their handlers build a request",
                              ", ".join(paths))
        except Exception as exc:  # noqa: BLE001 - never stop the server from starting
            ctx.fallback(f"the route checks could not be added ({type(exc).__name__}: {exc}); "
                         "those routes answer as the engine does")
        install_text_routes(http.app, guard, ctx.fallback)
        return out

    ctx.around("TokenizerManager.__init__", tokenizer_manager_init)


# --- the chat-like routes: their text bounded before their handlers render or tokenize it --------
TEXT_ROUTE_TOUCHES = "input_guard.text_routes"   # table.INFRA_TOUCHES: checked when they are wrapped
# The HTTP module's endpoints whose handlers render a chat template over the body, tokenize or
# decode its text (or validate its tool schemas) before any request reaches generate_request,
# where the text bound of `text` sits (read in the engine: docs/input_guard.md, the classes table).
TEXT_ROUTES = ("openai_v1_chat_completions", "sagemaker_chat_completions", "v1_responses_request",
               "anthropic_v1_messages", "anthropic_v1_count_tokens", "ollama_chat",
               "openai_v1_tokenize", "openai_v1_detokenize", "openai_v1_embeddings",
               "v1_rerank_request", "v1_score_request", "v1_decisions_request",
               "systemone_decisions")


def guard_text_routes(app, guard: Guard, fallback) -> list[str]:
    """Wrap the endpoints of TEXT_ROUTES: the body's text (every string, one per list item; a chat
    request's input_ids and, with them, its messages aside) against DSV41_INPUT_GUARD_MAX_TEXT_CHARS
    before the handler runs; the paths wrapped. The HTTP module's internals this relies on are
    checked against their pins first (drift: a fallback line, the routes left as the engine's)."""
    from adapter import pins

    drift = pins.drifted_touches(TEXT_ROUTE_TOUCHES)
    if drift:
        fallback(f"chat-route text bound not added: {drift[0]} drifted from its pin; those routes "
                 "render and tokenize as the engine does")
        return []
    http = sys.modules[HTTP]
    endpoints = {getattr(http, name): name for name in TEXT_ROUTES}

    def text_route(original, path):
        async def guarded(**values):        # FastAPI calls the endpoint with its parameters by name
            current = INSTALLED.get("guard", guard)      # this process's latest install
            try:
                message = check_body_text(values.get("request"), path, current.limits)
                empty = check_chat_messages(values.get("request"), path)
            except Exception as exc:  # noqa: BLE001 - fail closed, as the choke point
                current.reject("unchecked", f"input_guard could not check this request "
                                            f"({type(exc).__name__}); it is refused rather than "
                                            "rendered unchecked")
            if message is not None:
                current.reject("text_chars", message)
            if empty is not None:
                current.reject("messages", empty)
            return await original(**values)

        guarded._dsv41_guarded = True
        guarded.__wrapped__ = original
        return guarded

    wrapped = []
    for route in getattr(app, "routes", ()):
        dependant = getattr(route, "dependant", None)
        if dependant is None or getattr(route, "endpoint", None) not in endpoints:
            continue
        if not getattr(dependant.call, "_dsv41_guarded", False):
            dependant.call = text_route(dependant.call, route.path)
        wrapped.append(route.path)
    missing = sorted(set(TEXT_ROUTES) - {endpoints[r.endpoint] for r in getattr(app, "routes", ())
                                         if getattr(r, "endpoint", None) in endpoints})
    if missing:
        fallback(f"chat-route text bound: {', '.join(missing)} not among the app's routes; "
                 "the others are bounded")
    return wrapped


def install_text_routes(app, guard: Guard, fallback) -> None:
    """guard_text_routes at the launcher's app setup (install_routes), with its receipt; an
    exception of ours leaves the routes as the engine's (a fallback line), never stops the
    server from starting."""
    try:
        paths = guard_text_routes(app, guard, fallback)
        if paths:
            receipts.line(NAME, "bounds the text of %s to %d characters per request (%s) before "
                          "their handlers render, tokenize or decode it", ", ".join(paths),
                          guard.limits.text_limit, LIMIT_KEYS["text_chars"])
    except Exception as exc:  # noqa: BLE001 - never stop the server from starting
        fallback(f"the chat-route text bound could not be added ({type(exc).__name__}: {exc}); "
                 "those routes render and tokenize as the engine does")


def guard_app_text_routes(app) -> list[str]:
    """guard_text_routes of this process's install on `app` (the unit tests' engine app)."""
    return guard_text_routes(app, INSTALLED["guard"], INSTALLED["guard"].ctx.fallback)


# In this order (the order of their wraps in the installer's registry).
PARTS = (install_check, install_sessions, install_way_in, install_own_aborts, install_exact_aborts,
         install_grammar_bound, install_grammar_cache, install_stop_regex, install_ollama,
         install_routes, install_grammar_share)


# The last install's guard (one install per process): the route wraps use it (guard_app_routes).
INSTALLED: dict = {}


def guard_app_routes(app) -> list[str]:
    """The route wraps of this process's install on `app` (what install_routes does at the
    engine's app setup; the unit tests call it on the engine's app they drive)."""
    return guard_routes(app, INSTALLED["guard"], INSTALLED["guard"].ctx.fallback)


def install(ctx) -> str:
    guard = Guard(ctx)
    INSTALLED["guard"] = guard
    for part in PARTS:
        part(ctx, guard)
    limits, re2 = guard.limits, guard.re2
    receipts.line(NAME, "bounds what a request costs others before its check (issue 50): samples "
                  "(prompts x n) <= %d per request, text <= %s characters before tokenizing, "
                  "/parse_function_call and /separate_reasoning text <= %d characters; a refused "
                  "request's abort takes nothing of another's; grammar caches <= %d entries and "
                  "%d MB (xgrammar), a compile timeout never cached; a grammar over the step "
                  "bound answers 400; Ollama options.seed -> sampling_seed; /vertex_generate "
                  "bodies checked before its handler", limits.n,
                  f"{limits.text_chars}" if limits.text_chars else
                  f"{TEXT_CHARS_PER_TOKEN} x the context length",
                  limits.parse_chars, limits.grammar_cache, limits.grammar_cache_mb)
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
