"""Installs the enabled adapters into the engine, right after their engine modules import.

Both entry paths call `bootstrap()`: sitecustomize.py (every Python process of the image) and
the SGLang plugin entry point (`load_plugins()` in every engine process). State is per process,
so an adapter installs exactly once whichever path runs first.

Per install group (adapters that share a callable, adapter/table.py): wait until one of its
engine modules has finished importing, import the others, check every pin of every adapter in
the group, let each adapter's install() name its hooks, register them with the engine's
HookRegistry in table order (first row innermost) and apply them. A refusal (pin drift, a
broken install) stops the boot: the message names the key to unset, on stderr and in the log,
and the process exits 3, because the engine's load_plugins() would log and swallow a raised
exception. `dsv41 check` runs the same path in "report" mode, which records instead of exiting.

Other plugins on the same callable: the engine's apply_hooks() skips a target it has patched
already, so a hook another plugin registers after ours would never be applied, and one it applied
before ours would hide ours. The installer therefore guards apply_hooks() (once per process): a
target of ours whose applied chain lacks a registered hook is unpatched first, so the engine
re-applies the whole chain in registration order (the first registered innermost: a plugin loaded
before us runs inside our hook, one loaded after us outside it). One receipt line names each
plugin that shares a callable with us. Our hooks carry nothing else: the engine calls them
directly, with no frame of ours in between.
"""
from __future__ import annotations

import dataclasses
import functools
import importlib
import logging
import os
import sys
import traceback
from typing import Callable, Optional

from adapter import keys, receipts
from adapter.refusal import Refusal
from adapter.table import ADAPTERS, HOOKS, hooks_of, install_groups, modules_of

EXIT_CONFIG = 2
EXIT_REFUSED = 3
PLUGIN_NAME = "dsv41"
HOOK_REGISTRY = "sglang.srt.plugins.hook_registry"
_GUARD_MARK = "__dsv41_apply_guard__"

__all__ = ["Refusal", "bootstrap", "status", "entry", "install_in_process", "reset_for_tests"]


@dataclasses.dataclass
class AdapterState:
    status: str = "waiting"         # off | waiting | installed | refused
    detail: str = ""
    pin_ok: Optional[bool] = None


@dataclasses.dataclass
class _State:
    mode: str = "boot"              # boot: a refusal exits; report: it is recorded (dsv41 check)
    settings: Optional[keys.Settings] = None
    pending: list = dataclasses.field(default_factory=list)
    busy: set = dataclasses.field(default_factory=set)
    ready: set = dataclasses.field(default_factory=set)
    adapters: dict = dataclasses.field(default_factory=dict)
    applied: dict = dataclasses.field(default_factory=dict)   # target -> (owner, attr, raw original)
    entry: Optional[str] = None     # who armed us first: sitecustomize | plugin | direct
    applying: int = 0               # apply_hooks() calls in flight (an import inside one installs)
    deferred: list = dataclasses.field(default_factory=list)  # groups registered during one
    shared: set = dataclasses.field(default_factory=set)      # (target, plugin) lines logged


_state = _State()


def fatal(message: str, code: int) -> None:
    """Make a boot failure impossible to miss: log + stderr, flush, exit the process."""
    receipts.logger().critical("%s FATAL: %s", receipts.PREFIX, message)
    for handler in logging.getLogger().handlers + logging.getLogger(receipts.LOGGER_NAME).handlers:
        handler.flush()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def set_mode(mode: str) -> None:
    assert mode in ("boot", "report")
    _state.mode = mode


def status() -> dict[str, AdapterState]:
    return dict(_state.adapters)


def entry() -> Optional[str]:
    """The entry path that armed the installer in this process (None: not armed)."""
    return _state.entry


def bootstrap(environ=None, entry: str = "direct") -> keys.Settings:
    """Parse the keys (boot error on bad input) and arm the import hooks. Idempotent: the first
    caller's `entry` (sitecustomize, plugin or direct) is recorded."""
    if _state.settings is not None:
        return _state.settings
    _state.entry = entry
    try:
        settings = keys.parse_env(environ)
    except keys.ConfigError as exc:
        fatal(f"configuration error: {exc}", EXIT_CONFIG)
    _state.settings = settings
    for name in settings.unknown:
        receipts.warning("unknown key %s: no dsv41 adapter reads it", name)
    enabled = tuple(a for a in ADAPTERS if settings.enabled(a))
    for name in ADAPTERS:
        _state.adapters[name] = AdapterState("waiting" if name in enabled else "off")
    _state.pending = install_groups(enabled)
    if _state.pending:
        import wrapt

        wrapt.register_post_import_hook(_guard_apply_hooks, HOOK_REGISTRY)
        for module in sorted({m for g in _state.pending for a in g for m in modules_of(a)}):
            wrapt.register_post_import_hook(_on_import, module)
    return settings


def _on_import(module) -> None:
    _state.ready.add(module.__name__)
    _advance()


def _advance() -> None:
    for group in list(_state.pending):
        # A nested import (below) may have installed this group while we looped.
        if group not in _state.pending or group in _state.busy:
            continue
        modules = {m for a in group for m in modules_of(a)}
        if not modules & _state.ready:
            continue
        # A module still executing comes back here through its own hook when it is done.
        if any(m in sys.modules and m not in _state.ready for m in modules):
            continue
        _state.busy.add(group)
        try:
            for m in sorted(modules - _state.ready):
                importlib.import_module(m)
            _install_group(group)
        finally:
            _state.busy.discard(group)
            _state.pending.remove(group)


class InstallContext:
    """What an adapter's install() gets: its settings, its rows, and `around()` to hook them."""

    def __init__(self, name: str, settings: keys.Settings):
        self.name = name
        self.settings = settings
        self.rows = hooks_of(name)
        self.log = receipts.logger(name)
        self.counters = receipts.counters[name]
        self.hooks: dict[str, Callable] = {}

    def value(self, key: str):
        return self.settings.get(key)

    def around(self, qualname: str, hook: Callable) -> None:
        """Wrap a row of this adapter: hook(original, *args, **kwargs) (HookRegistry AROUND)."""
        rows = [r for r in self.rows if qualname in (r.qualname, r.target)]
        if not rows:
            raise Refusal(f"install() hooks {qualname}, which is not a row of the table")
        self.hooks[rows[0].target] = hook

    def fallback(self, reason: str) -> None:
        receipts.fallback(self.name, reason)


def _check_pins(name: str) -> None:
    from adapter import pins

    pinned = pins.load()
    for row in hooks_of(name):
        found = pins.source_hash(pins.resolve(row)[2])
        expected = pinned.get(row.pin_id)
        if found != expected:
            raise Refusal(f"engine callable {row.pin_id} does not match its pin "
                          f"(expected sha256 {expected}, found {found})")
    for owner in (name, "installer"):
        drift = pins.drifted_touches(owner)
        if drift:
            whose = "it touches" if owner == name else "the installer touches"
            raise Refusal(f"engine internal {drift[0]}, which {whose}, does not match its pin")


# ---- HookRegistry: our hooks in, other plugins' hooks kept -------------------------------------

def _registry():
    from sglang.srt.plugins.hook_registry import HookRegistry

    return HookRegistry


def _is_registry_wrapper(fn) -> bool:
    """A wrapper built by the engine's _wrap_fn (functools.wraps copies the wrapped name, so the
    code object tells)."""
    code = getattr(fn, "__code__", None)
    return code is not None and code.co_qualname.startswith("_wrap_fn.") and \
        code.co_filename == sys.modules[HOOK_REGISTRY].__file__


def _plain(raw):
    return raw.__func__ if isinstance(raw, (staticmethod, classmethod)) else raw


def _chain(raw) -> list:
    """The hook callables of the registry wrappers around `raw`, outermost first."""
    fn, out = _plain(raw), []
    while _is_registry_wrapper(fn):
        cells = dict(zip(fn.__code__.co_freevars, fn.__closure__ or ()))
        out.append(cells["hook"].cell_contents if "hook" in cells else None)
        fn = fn.__wrapped__
    return out


def _pristine(raw):
    """`raw` with the registry's wrappers peeled off (decorator type kept)."""
    fn = _plain(raw)
    while _is_registry_wrapper(fn):
        fn = fn.__wrapped__
    return type(raw)(fn) if isinstance(raw, (staticmethod, classmethod)) else fn


def _current(owner, attr):
    return owner.__dict__[attr] if isinstance(owner, type) else getattr(owner, attr)


def _unpatch_stale() -> None:
    """Unpatch each target of ours whose applied chain is not every hook registered on it, so the
    engine's apply_hooks() builds the whole chain again instead of skipping the target."""
    from sglang.srt.plugins.hook_registry import _propagate_patch

    registry = _registry()
    for target, (owner, attr, pristine) in _state.applied.items():
        if target not in registry._patched:
            continue
        current = _current(owner, attr)
        registered = [h for _, h, _ in registry._hooks.get(target, ())]
        if sorted(map(id, _chain(current))) == sorted(map(id, registered)):
            continue
        setattr(owner, attr, pristine)
        _propagate_patch(_plain(current), _plain(pristine), owner)
        registry._patched.discard(target)


def _guard_apply_hooks(module) -> None:
    """Wrap HookRegistry.apply_hooks once per process (see the module docstring)."""
    registry = module.HookRegistry
    raw = registry.__dict__["apply_hooks"]
    if getattr(_plain(raw), _GUARD_MARK, False):
        return
    original = _plain(raw)

    @functools.wraps(original)
    def apply_hooks(cls):
        _unpatch_stale()
        _state.applying += 1
        try:
            return original(cls)
        finally:
            _state.applying -= 1
            if _state.applying == 0:
                _finish_deferred()
                _note_shared()

    setattr(apply_hooks, _GUARD_MARK, True)
    registry.apply_hooks = classmethod(apply_hooks)
    global _engine_apply_hooks
    _engine_apply_hooks = original


_engine_apply_hooks = None      # the engine's own apply_hooks function, once guarded


def _finish_deferred() -> None:
    """Groups that installed during an apply_hooks() call (its import of our engine module):
    apply what that call did not reach, then check and log them."""
    while _state.deferred:
        contexts = _state.deferred.pop(0)
        _unpatch_stale()
        _state.applying += 1
        try:
            _engine_apply_hooks(_registry())
        finally:
            _state.applying -= 1
        _finish_group(contexts)


def _note_shared() -> None:
    """One receipt line per plugin that shares a callable of ours, with the order they run in."""
    registry = _registry()
    for row in HOOKS:
        if row.target not in _state.applied:
            continue
        hooks = registry._hooks.get(row.target, ())
        ours = [i for i, (_, _, src) in enumerate(hooks) if src and src.dist_name == PLUGIN_NAME]
        if not ours or _state.adapters.get(row.adapter, AdapterState()).status != "installed":
            continue
        for i, (kind, _, src) in enumerate(hooks):
            if src is not None and src.dist_name == PLUGIN_NAME:
                continue
            who = f"plugin={src.plugin_name}" + (f", dist={src.dist_name}" if src and src.dist_name
                                                 else "") if src else "an unnamed hook"
            if (row.target, who) in _state.shared:
                continue
            _state.shared.add((row.target, who))
            after = i > max(ours)
            receipts.line(row.adapter, "shares %s with %s: its %s hook runs %s ours (registered %s "
                          "dsv41)", row.qualname, who, kind.value.upper(),
                          "outside" if after else "inside", "after" if after else "before")


def _install_group(group: tuple[str, ...]) -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookSource, HookType

    from adapter import pins

    contexts = {}
    for name in group:
        state = _state.adapters[name]
        try:
            _check_pins(name)
            state.pin_ok = True
            ctx = InstallContext(name, _state.settings)
            state.detail = importlib.import_module(f"adapter.{name}").install(ctx) or ""
            missing = [r.target for r in ctx.rows if r.target not in ctx.hooks]
            if missing:
                raise Refusal(f"install() left table rows unhooked: {', '.join(missing)}")
            contexts[name] = ctx
        except Refusal as exc:
            if state.pin_ok is None:      # refused by the pin check itself
                state.pin_ok = False
            _refuse(name, str(exc))
        except Exception:
            _refuse(name, "install() raised:\n" + traceback.format_exc())
    # Register in table order: for one callable the first row ends up innermost.
    for row in HOOKS:
        ctx = contexts.get(row.adapter)
        if ctx is None:
            continue
        owner, attr, raw = pins.resolve(row)
        _state.applied.setdefault(row.target, (owner, attr, _pristine(raw)))
        HookRegistry.register(row.target, ctx.hooks[row.target], HookType.AROUND,
                              source=HookSource(f"{PLUGIN_NAME}.{row.adapter}", PLUGIN_NAME))
    if _state.applying:
        # We are inside an apply_hooks() whose import of an engine module brought us here: it
        # applies what it has not reached yet; the guard finishes the rest when it returns.
        _state.deferred.append(contexts)
        return
    HookRegistry.apply_hooks()
    _finish_group(contexts)


def _finish_group(contexts: dict) -> None:
    from adapter import pins

    for name, ctx in contexts.items():
        unapplied = [r.target for r in ctx.rows
                     if not any(h is ctx.hooks[r.target] for h in _chain(pins.resolve(r)[2]))]
        if unapplied:  # apply_hooks() logs and swallows; a hook not in place is a refusal
            _refuse(name, f"HookRegistry did not apply: {', '.join(unapplied)}")
            continue
        _state.adapters[name].status = "installed"
        receipts.installed(name, _state.adapters[name].detail)
    _note_shared()


def _refuse(name: str, reason: str) -> None:
    state = _state.adapters[name]
    state.status = "refused"
    state.detail = reason
    set_keys = [k.name for k in keys.KEYS if k.adapter == name and k.name in _state.settings.set_keys]
    message = (f"{name} refused to install: {reason}. "
               f"Unset {' and '.join(set_keys) or 'its key'} to boot without {name}.")
    if _state.mode == "boot":
        fatal(message, EXIT_REFUSED)
    receipts.logger(name).error("%s %s", receipts.PREFIX, message)
    state.detail = message


def install_in_process(environ) -> dict[str, AdapterState]:
    """Sims, benches and tests: undo any earlier install, then install what `environ` enables,
    in report mode (a refusal is recorded, not an exit), importing the engine modules of the
    enabled adapters. Returns status()."""
    reset_for_tests()
    set_mode("report")
    settings = bootstrap(environ=environ)
    for name in ADAPTERS:
        if settings.enabled(name):
            for module in modules_of(name):
                importlib.import_module(module)
    return status()


def reset_for_tests() -> None:
    """Undo every hook we applied and forget the settings (tests switch keys in one process)."""
    from sglang.srt.plugins.hook_registry import HookRegistry, _propagate_patch

    for target, (owner, attr, raw) in _state.applied.items():
        current = _current(owner, attr)
        setattr(owner, attr, raw)
        _propagate_patch(_plain(current), _plain(raw), owner)
        # HookRegistry has no public unregister; drop our entries so a later install re-applies.
        # A target left with no hooks is forgotten: apply_hooks() would "apply" an empty list and
        # mark the target patched, and a later install on it would then be skipped.
        others = [h for h in HookRegistry._hooks.get(target, ())
                  if not (h[2] and h[2].dist_name == PLUGIN_NAME)]
        if others:
            HookRegistry._hooks[target] = others
        else:
            HookRegistry._hooks.pop(target, None)
        HookRegistry._patched.discard(target)
    mode = _state.mode
    _state.__init__()
    _state.mode = mode
