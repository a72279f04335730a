"""swan (DSV41_SWA_NATIVE_DECODE=1): SM12x sparse decode reads the 256-token SWA pages in place.

The stock engine (sglang/kernels/ops/attention/flash_mla_sm120.py) copies every touched 256-token
SWA page into four 64-token pages (`_split_kv_pages_to_64`: mask memset, page mark, masked split)
before FlashInfer's sparse DSV4 decode. This adapter wraps the engine's SM12x decode entry
`flash_mla_with_kvcache_sm120` and sends each call the swan256 module can serve (runtime/swan256,
built ahead of time by scripts/build_swan.sh) to that module, which reads the pool through the 4-D
view [N, 256, 1, 584] with stride(0) = 149,760 B. Every other call goes to the stock function
unchanged (so it keeps the split), with one log line per distinct reason.

The package, by layer:
  * layout: the page layout and decode-shape constants (the one source; build, reference and
    benches import them from here);
  * module: verify_module(): manifest + sha256 of the .so and of the router key + pinned
    FlashInfer and torch versions (install refuses on any mismatch or a missing module);
  * routing: describe_call() / route(): a pure function of the call's tensor metadata (shapes,
    strides, dtypes, device) and the module's capabilities -> None (serve) or a fallback reason;
    tactic_reason(); the router's per-call key;
  * kernel: the thin layer that loads the .so (tvm-ffi), asks FlashInfer's own planner for the
    tactic the stock call would get at 64-token pages, checks that the module resolves the same
    plan at 256-token pages, and launches;
  * twin: the router's kernel in a process without CUDA (the CPU twin: the engine's torch sparse
    decode on the 256-token pages in place, through the same page view; routing takes its caps,
    so it serves CPU tensors and only those). It runs the router in a real server on CPU; it is
    not the module's kernel;
  * selfcheck: the first call of every new decode key runs in place and stock, compares the bits
    and agrees the verdict over the attention TP group before the key is served
    (DSV41_SWAN_SELFCHECK, on by default);
  * here: the router (the hook on the engine entry) and install().
Only the Kernel touches a GPU; everything above it is tested on CPU.

On a contained exception (routing: `internal error in routing (<type>)`; launch: `kernel launch
failed (<type>)`): nothing of the engine's was written (the kernel writes only the output buffers
it allocates itself), and that call runs the stock split function, so its answer is stock's. An
error the GPU reports asynchronously after a launch is not catchable here (a sticky CUDA error).
"""
from __future__ import annotations

import sys
from typing import Optional

from adapter.swan import selfcheck
from adapter.swan.kernel import Kernel, Plan
from adapter.swan.selfcheck import PENDING
from adapter.swan.twin import Twin
from adapter.swan.layout import (D_QK, D_V, DATA_BYTES, DECODE_MAX_TOKENS,
                                 FLASHINFER_HEAD_SPECIALISATIONS, HEAD_KERNELS, MANIFEST_SCHEMA,
                                 MAX_HEADS, MODULE_TAG, PAGE_STRIDE, PAGE_TOKENS, ROUTER_KEY_MODULE,
                                 ROW_BYTES, SCALE_BYTES, SPLIT_PAGE_STRIDE, SPLIT_PAGE_TOKENS, SUPPORTED_ARCHS)
from adapter.swan.module import (DEFAULT_MODULE_DIR, MODULE_DIR_ENV, REPO_ROOT, ModuleError,
                                 ModuleInfo, installed_flashinfer_version, module_dir, sha256_file,
                                 verify_module)
from adapter.swan.routing import (COMPARED_FIELDS, PLAN_FIELDS, CallFacts, ModuleCaps, TensorFacts,
                                  decode_key, describe_call, entry_reason, kernel_heads, route,
                                  tactic_reason)

NAME = "swan"
KEY = "DSV41_SWA_NATIVE_DECODE"
# Counter keys in receipts.counters["swan"] (series: adapter/metrics.py KEYS); split calls are
# counted as fallback:<reason> by receipts.fallback.
COUNTERS = {"served": "SWA decode calls served in place on 256-token pages (no 4x64 split)",
            selfcheck.VERIFIED: "decode keys whose in-place output equalled the stock split's bit "
                                "for bit on every TP rank at first use (then served in place)",
            selfcheck.FAILED: "decode keys whose self-check failed on some TP rank (the key keeps "
                              "the stock split on every rank)"}
ENGINE_MODULE = "sglang.kernels.ops.attention.flash_mla_sm120"
ENTRY = "flash_mla_with_kvcache_sm120"

__all__ = [
    "NAME", "KEY", "COUNTERS", "ENGINE_MODULE", "ENTRY", "ROUTER", "install", "load_router_key",
    # layout
    "D_QK", "D_V", "DATA_BYTES", "DECODE_MAX_TOKENS", "FLASHINFER_HEAD_SPECIALISATIONS",
    "HEAD_KERNELS", "MANIFEST_SCHEMA", "MAX_HEADS", "MODULE_TAG", "PAGE_STRIDE", "PAGE_TOKENS",
    "ROW_BYTES", "SCALE_BYTES", "SPLIT_PAGE_STRIDE", "SPLIT_PAGE_TOKENS", "SUPPORTED_ARCHS",
    # module
    "DEFAULT_MODULE_DIR", "MODULE_DIR_ENV", "REPO_ROOT", "ModuleError", "ModuleInfo",
    "installed_flashinfer_version", "module_dir", "sha256_file", "verify_module",
    # routing
    "COMPARED_FIELDS", "PLAN_FIELDS", "CallFacts", "ModuleCaps", "TensorFacts", "decode_key",
    "describe_call", "entry_reason", "kernel_heads", "route", "tactic_reason",
    # kernel
    "Kernel", "Plan", "Twin",
]


class _Decision:
    """What the router decided for one decode key: the fallback reason, or the plan (and the
    facts its first-served receipt line names). With the self-check on, a new key's reason is
    selfcheck.PENDING until its first call has been checked and agreed; `local` keeps what this
    rank's routing decided meanwhile."""

    __slots__ = ("reason", "plan", "facts", "local")

    def __init__(self, reason: Optional[str], plan: Optional[Plan] = None, facts: Optional[CallFacts] = None):
        self.reason = reason
        self.plan = plan
        self.facts = facts
        self.local = reason


class _Router:
    """The hook on the engine's SM12x decode entry.

    Per call: the module's native lookup of the call's tensor metadata (runtime/swan256/
    router_key.cpp: the decision kept for the call's exact key; None for a call it does not
    describe) and the engine's backend. A call without a native key takes the Python path:
    entry_reason() on the backend and q's row count (a prefill call, another backend or a
    positional call falls back here, unkeyed), else decode_key() -> the cached decision. Only
    the first call of a key is described in full (describe_call) and routed (route, then the
    kernel's plan); its decision is kept, whether serve or fall back. The engine calls `hook`."""

    def __init__(self, ctx, info: ModuleInfo, kernel: Optional[Kernel], native):
        self.ctx = ctx
        self.native = native             # the swan256_router_key module (load_router_key)
        # decisions of natively keyed calls: slot -> (exact key, decision) (router_key.cpp lookup)
        self._native_decisions: dict[int, tuple[bytes, _Decision]] = {}
        self.info = info
        self.kernel = kernel
        self.load_error: Optional[str] = None
        # what routing accepts is the kernel's: the CPU twin brings its own caps (CPU tensors)
        self.caps = getattr(kernel, "caps", None) or ModuleCaps(heads=info.heads, archs=info.archs)
        self.first_served = False
        self._decisions: dict[tuple, _Decision] = {}     # Python-keyed calls (decode_key)
        self._engine_vars: Optional[dict] = None     # the engine module's namespace (its backend)
        # the self-check at first use (selfcheck.py): off, per key, or swan as a whole; the
        # installer's ctx has the keys (a bench's stand-in ctx has none: off)
        value = getattr(ctx, "value", None)
        self.check_mode = selfcheck.OFF if value is None else value(selfcheck.KEY)
        self.checks = 0                   # keys checked on this rank (every rank: the same count)
        self.verified = 0
        self.failed = 0
        self.off_reason: Optional[str] = None     # DSV41_SWAN_SELFCHECK=2 after a failed check
        self.group = selfcheck.engine_group       # () -> (gloo group, world, rank): a test seam
        self.plant = None if value is None else value(selfcheck.PLANT_KEY)
        if self.plant is not None and kernel is not None:
            self._plant_kernel(kernel)
        self.hook = self._make_hook()

    def kernel_name(self) -> str:
        """Which kernel serves: the module ("swan256.so") or the "CPU twin"."""
        kernel = self.kernel
        if kernel is None:
            return f"{Kernel.NAME} (not loaded)"
        return getattr(kernel, "NAME", type(kernel).__name__)

    def backend(self) -> str:
        engine = self._engine_vars or self._bind_engine()
        return str(engine.get("_sm120_default_backend", "unknown"))

    def _kernel(self) -> Optional[Kernel]:
        if self.kernel is None and self.load_error is None:
            try:
                self.kernel = Kernel(self.info)
            except Exception as exc:
                self.load_error = f"module failed to load: {type(exc).__name__}: {exc}"
        return self.kernel

    def _decide(self, args: tuple, kwargs, backend: str) -> _Decision:
        """The decision of a new key. With the self-check on it is PENDING whatever routing
        said: the key's first call checks (if this rank would serve it) and agrees with the
        other ranks (in any case: every rank takes part in one agreement per new key)."""
        if self.off_reason is not None:
            return _Decision(self.off_reason)
        decision = self._route(args, kwargs, backend)
        if self.check_mode:
            decision.reason = PENDING
        return decision

    def _route(self, args: tuple, kwargs, backend: str) -> _Decision:
        facts = describe_call(args, kwargs, backend)
        reason = route(facts, self.caps)
        if reason is not None:
            return _Decision(reason)
        kernel = self._kernel()
        if kernel is None:
            return _Decision(self.load_error)
        plan = kernel.plan(facts, kwargs)
        return _Decision(plan.reason, plan, facts)

    # --- the self-check at first use (selfcheck.py) ----------------------------------------

    def _first_use(self, decision: _Decision, original, args: tuple, kwargs):
        """The first call of a PENDING key: run in place (where this rank's routing serves it)
        and stock on the same inputs, compare the bits, agree over the TP group, settle the
        key's decision for every later call. Returns the stock call's answer (the same bits
        when the key is verified). The stock call is the engine's own: its exceptions are
        stock's; nothing of swan's reaches the engine."""
        try:
            import torch

            capturing = torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()
        except Exception:  # noqa: BLE001 - no CUDA state to ask: not capturing
            capturing = False
        if capturing:
            # no sync and no collective inside a graph capture: the key stays pending, this call
            # is recorded with the stock split (the capture's warm-ups, outside the graph, have
            # checked every key the graph runs)
            self.ctx.fallback(selfcheck.CAPTURE_REASON)
            return original(*args, **kwargs)
        got, detail = None, None
        if decision.local is None:
            try:
                got = self.kernel.run(decision.plan, kwargs)
            except Exception as exc:  # noqa: BLE001 - the in-place path failed: the key differs
                detail = f"in-place kernel launch failed ({type(exc).__name__})"
        want = original(*args, **kwargs)
        try:
            self._settle(decision, kwargs, got, want, detail)
        except Exception as exc:  # noqa: BLE001 - swan's own: this key keeps the stock split
            decision.reason = (f"internal error in the self-check ({type(exc).__name__}); this key "
                               "keeps the stock split")
        if decision.reason is not None:
            self.ctx.fallback(decision.reason)
        return want

    def _settle(self, decision: _Decision, kwargs, got, want, detail: Optional[str]) -> None:
        from adapter import receipts

        self.checks += 1
        serial = self.checks
        local = decision.local
        if local is None and detail is None:
            try:
                detail = selfcheck.compare(got, want)
            except Exception as exc:  # noqa: BLE001 - not compared: not verified
                detail = f"comparison failed ({type(exc).__name__})"
        differs, refused = local is None and detail is not None, local is not None
        try:
            key = selfcheck.key_text(kwargs)
            fp = selfcheck.fingerprint(serial, kwargs)
        except Exception as exc:  # noqa: BLE001 - described without its shape
            key, fp = f"#{serial} (not described: {type(exc).__name__})", [serial, 0, 0, 0, 0]
        try:
            group, world, _rank = self.group()
            any_differs, any_refused, out_of_step = selfcheck.agree(differs, refused, fp, group, world)
        except Exception as exc:  # noqa: BLE001 - no agreement: not verified
            any_differs, any_refused, out_of_step, world = True, refused, False, 0
            if not refused:
                differs, detail = True, detail or f"no TP agreement ({type(exc).__name__})"
        if refused:
            decision.reason = local          # this rank's own routing reason
        elif out_of_step:
            decision.reason = (f"self-check: the TP ranks checked different keys at check {serial} "
                               f"(this rank: {key}); this key keeps the stock split")
        elif any_differs:
            where = detail if differs else "equal on this TP rank, different on another"
            decision.reason = (f"self-check failed for key {key}: {where}; this key keeps the stock "
                               f"split on every TP rank")
        elif any_refused:
            decision.reason = f"another TP rank's routing keeps the stock split for key {key}"
        else:
            decision.reason = None
            self.verified += 1
            self.ctx.counters[selfcheck.VERIFIED] += 1
            receipts.line(NAME, "self-check verified key %d (%s): in-place output bit-identical to "
                          "the stock split's, agreed by the TP group (%d ranks) (%d verified, %d "
                          "failed)", serial, key, world, self.verified, self.failed)
            return
        if any_differs or out_of_step:
            self.failed += 1
            self.ctx.counters[selfcheck.FAILED] += 1
            if self.check_mode == selfcheck.WHOLE:
                self._turn_off(decision.reason)

    def _turn_off(self, reason: str) -> None:
        """DSV41_SWAN_SELFCHECK=2: a failed key turns swan off on every rank (the failure was
        agreed): every kept decision and every new key falls back."""
        self.off_reason = f"swan off after a failed self-check (DSV41_SWAN_SELFCHECK=2): {reason}"
        for decision in list(self._decisions.values()) + [d for _, d in self._native_decisions.values()]:
            decision.reason = self.off_reason

    def _plant_kernel(self, kernel) -> None:
        """Test only (DSV41_SWAN_SELFCHECK_TEST_PLANT=<rank>): on that attention-TP rank every
        in-place call reads a copy of the pool with one byte changed (selfcheck.planted_kwargs);
        the engine's pool is never written. Loud: one TEST ONLY line per process."""
        from adapter import receipts

        run = kernel.run
        state = {"rank": None, "logged": False}

        def planted_run(plan, kwargs):
            if state["rank"] is None:
                state["rank"] = self.group()[2]
            if state["rank"] != self.plant:
                return run(plan, kwargs)
            kwargs, where = selfcheck.planted_kwargs(kwargs)
            if not state["logged"]:
                state["logged"] = True
                receipts.line(NAME, "TEST ONLY %s=%d: the in-place read on this TP rank has a planted "
                              "one-byte error (%s) in every call; this output is not swan's",
                              selfcheck.PLANT_KEY, self.plant, where)
            return run(plan, kwargs)

        kernel.run = planted_run

    def forget(self) -> None:
        """Drop the cached decisions (tests that change routing under a live router)."""
        self._decisions.clear()
        self._native_decisions.clear()

    def decisions(self) -> int:
        """How many call keys have a kept decision (native and Python keyed)."""
        return len(self._decisions) + len(self._native_decisions)

    def _bind_engine(self) -> dict:
        self._engine_vars = vars(sys.modules[ENGINE_MODULE])
        return self._engine_vars

    def _python_decision(self, args: tuple, kwargs) -> tuple[Optional[str], Optional[_Decision]]:
        """The path of a call the native key does not describe (prefill rows, another backend, a
        positional or odd call): entry_reason() names the fallback, or the call is keyed in
        Python (decode_key) and decided like any other."""
        backend = self.backend()
        q = kwargs.get("q")
        shape = q.shape if q is not None else None
        rows = (shape[0] if shape else 0) if q is not None else 0
        reason = entry_reason(bool(args), backend, q is not None and kwargs.get("k_cache") is not None, rows)
        if reason is not None:
            return reason, None
        key = decode_key(shape, kwargs)
        decision = self._decisions.get(key)
        if decision is None:
            decision = self._decisions[key] = self._decide(args, kwargs, backend)
        return decision.reason, decision

    def _first_served(self, decision: _Decision) -> None:
        """The first served call's receipt line, naming the kernel that served it (never raises:
        the call it describes has been served)."""
        from adapter import receipts

        self.first_served = True
        try:
            facts, plan = decision.facts, decision.plan
            shape = (facts.q.shape[0], facts.q.shape[-2], facts.indices.shape[-1])
            if isinstance(self.kernel, Twin):
                receipts.line(NAME, "first in-place decode: %d rows, %d heads, topk %d; kernel CPU "
                              "twin (the engine's torch sparse decode, no split-K chunking)", *shape)
            else:
                receipts.line(NAME, "first in-place decode: %d rows, %d heads, topk %d, cpb %d; "
                              "kernel swan256.so", *shape, plan.facts["cpb"])
        except Exception as exc:  # noqa: BLE001 - a receipt line, not the call
            receipts.line(NAME, "first in-place decode (not described: %s); kernel %s",
                          type(exc).__name__, self.kernel_name())

    def _make_hook(self):
        """The hook installed on the engine entry: a closure over what every call reads (a plain
        function call is cheaper than an instance's __call__, and locals than attributes)."""
        router = self
        lookup = self.native.lookup
        table = self._native_decisions
        counters = self.ctx.counters
        fallback = self.ctx.fallback
        decide = self._decide
        python_decision = self._python_decision
        pending = PENDING

        def swan_router(original, *args, **kwargs):
            # The served path: one native call reads the call's metadata into an exact key and
            # finds the decision kept for it (the key is built as bytes only on a miss), then the
            # engine's backend is checked. A call the native key does not describe takes the
            # Python path (entry_reason, decode_key).
            try:
                found = None if args else lookup(kwargs, table)
                engine = router._engine_vars or router._bind_engine()
                if found is not None and engine.get("_sm120_default_backend") == "flashinfer":
                    if type(found) is tuple:            # a miss: (slot, key)
                        decision = decide(args, kwargs, "flashinfer")
                        table[found[0]] = (found[1], decision)
                    else:
                        decision = found
                    reason = decision.reason
                else:
                    reason, decision = python_decision(args, kwargs)
            except Exception as exc:  # noqa: BLE001 - swan's own routing: this call goes stock
                reason = f"internal error in routing ({type(exc).__name__}); this call keeps the stock split"
            if reason is not None:
                if reason is pending:        # a new key's first call: the self-check
                    return router._first_use(decision, original, args, kwargs)
                fallback(reason)
                return original(*args, **kwargs)
            try:
                out = router.kernel.run(decision.plan, kwargs)
            except Exception as exc:  # noqa: BLE001 - raised before the kernel wrote anything
                # of the engine's: it writes only its own fresh output buffers, so the stock
                # call computes this call's answer as if swan had not been asked.
                fallback(f"kernel launch failed ({type(exc).__name__}); this call keeps the stock split")
                return original(*args, **kwargs)
            counters["served"] += 1
            if not router.first_served:
                router._first_served(decision)
            return out

        return swan_router


ROUTER: Optional[_Router] = None     # the installed router of this process (introspection)


def load_router_key(info: ModuleInfo):
    """The verified native key module: decode_key(kwargs), lookup(kwargs, table) (torch first:
    the extension links its libraries)."""
    import importlib.machinery
    import importlib.util

    import torch  # noqa: F401

    path = info.router_key_path
    if path is None:
        raise ModuleError(f"{info.directory} has no verified router key")
    # the name its PyInit_ function carries, whatever the file's suffix
    loader = importlib.machinery.ExtensionFileLoader(ROUTER_KEY_MODULE, str(path))
    spec = importlib.util.spec_from_file_location(ROUTER_KEY_MODULE, str(path), loader=loader)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    if module.DECODE_MAX_TOKENS != DECODE_MAX_TOKENS:
        raise ModuleError(f"{path} keys decode calls of <= {module.DECODE_MAX_TOKENS} rows, the "
                          f"adapter's limit is {DECODE_MAX_TOKENS}: rebuild it (scripts/build_swan.sh)")
    return module


def install(ctx) -> str:
    from adapter.refusal import Refusal

    try:
        info = verify_module(module_dir(), installed_flashinfer_version())
    except ModuleError as exc:
        raise Refusal(str(exc)) from None
    try:
        native = load_router_key(info)
    except ModuleError as exc:
        raise Refusal(str(exc)) from None
    except Exception as exc:
        raise Refusal(f"{info.router_key_path} failed to load: {type(exc).__name__}: {exc}") from None
    try:
        import torch

        cuda = torch.cuda.is_available()
    except Exception:
        cuda = False
    if cuda:
        try:
            kernel = Kernel(info)
        except Exception as exc:
            raise Refusal(f"{info.so_path} failed to load: {type(exc).__name__}: {exc}") from None
        load = f"{Kernel.NAME} (loaded)"
    else:
        # No CUDA in this process (dsv41 check, tests, the CPU test server): the CPU twin serves
        # the calls routing accepts, which are then CPU tensors only (its caps).
        kernel = Twin(info)
        load = Twin.DETAIL
    global ROUTER
    router = ROUTER = _Router(ctx, info, kernel, native)
    ctx.around(ENTRY, router.hook)
    return (f"{KEY}={ctx.value(KEY)}: decode calls of <= {DECODE_MAX_TOKENS} rows read the "
            f"{PAGE_TOKENS}-token SWA pages in place ([N,{PAGE_TOKENS},1,{ROW_BYTES}], stride(0)="
            f"{PAGE_STRIDE}) via {info.so_path.name} sha256 {info.sha256[:16]} (FlashInfer "
            f"{info.flashinfer_version}, {'/'.join(info.archs)}, heads {','.join(map(str, info.heads))}; "
            f"per-call key {ROUTER_KEY_MODULE}); "
            f"kernel {load}; engine SM120 backend {router.backend()}; {_selfcheck_receipt(router)}; "
            f"other calls keep the stock split")


def _selfcheck_receipt(router: _Router) -> str:
    mode = router.check_mode
    if not mode:
        return f"self-check off ({selfcheck.KEY}=0): new decode keys are served unchecked"
    return (f"self-check on ({selfcheck.KEY}={mode}): each new decode key's first call runs in place "
            f"and stock, bit-compared, the verdict agreed by every TP rank; a key that differs keeps "
            f"the stock split{' and turns swan off' if mode == selfcheck.WHOLE else ''}"
            + (f" (TEST ONLY {selfcheck.PLANT_KEY}={router.plant})" if router.plant is not None else ""))
