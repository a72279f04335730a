"""Pins: what each adapter relies on in the pinned engine, checked before anything is wrapped.

Two kinds, both in adapter/pins.json:
- `pins`: sha256 of the source of every engine callable an adapter wraps (table.HOOKS);
- `touches`: every engine (or FlashInfer) internal an adapter, the installer or the metrics
  exporter reads or calls without wrapping it (Hook.touches, table.INFRA_TOUCHES). A callable is
  pinned by the sha256 of its source; anything else by presence and kind: "attr:class",
  "attr:<type>" for a module or class attribute, "attr:instance" for an attribute the class's
  own source assigns on `self` (or annotates as a field), found on its MRO.
FlashInfer's Python package imports only beside a GPU driver (pynvml), so its internals are pinned
from its installed files without importing them: sha256 of the definition's AST dump (the same
rule on every machine, importable or not).
`dsv41 pins --update` regenerates the file from the table; the installer refuses an adapter on
drift of either kind, naming the key to unset.
"""
from __future__ import annotations

import ast
import functools
import hashlib
import importlib
import importlib.util
import inspect
import json
import pathlib
import re

from adapter.table import HOOKS, INFRA_TOUCHES, Hook, hooks_of

PINS_FILE = pathlib.Path(__file__).with_name("pins.json")
ENGINE = "sglang==0.5.23"
MISSING = "missing"
READ_FROM_FILES = ("flashinfer",)   # top-level packages pinned from their files, not imported


def resolve(hook: Hook):
    """(owner, attribute name, raw attribute) of a table row; raw = as stored on its owner."""
    owner = importlib.import_module(hook.module)
    *path, attr = hook.qualname.split(".")
    for part in path:
        owner = getattr(owner, part)
    raw = owner.__dict__[attr] if isinstance(owner, type) else getattr(owner, attr)
    return owner, attr, raw


def original_callable(raw):
    if isinstance(raw, property):
        raw = raw.fget
    func = raw.__func__ if isinstance(raw, (staticmethod, classmethod)) else raw
    return inspect.unwrap(func)


def source_hash(raw) -> str:
    return hashlib.sha256(inspect.getsource(original_callable(raw)).encode()).hexdigest()


@functools.lru_cache(maxsize=None)
def _class_source(klass: type) -> str:
    """inspect.getsource of a class parses its whole module: once per class and process."""
    try:
        return inspect.getsource(klass)
    except (OSError, TypeError):
        return ""


def _assigned_on_self(cls: type, name: str) -> bool:
    """`self.<name> = ...` / `self.<name>: T = ...` in the source of a class on cls's MRO, or a
    class-level annotation `<name>: T` (dataclass / msgspec fields)."""
    assign = re.compile(rf"\bself\.{re.escape(name)}\s*(?::[^=\n]+)?=[^=]")
    field = re.compile(rf"^\s+{re.escape(name)}\s*:", re.M)
    for klass in cls.__mro__:
        if klass is object or name in getattr(klass, "__annotations__", {}):
            if klass is not object:
                return True
            continue
        src = _class_source(klass)
        if assign.search(src) or field.search(src):
            return True
    return False


def _module_file(module_name: str):
    top, *rest = module_name.split(".")
    spec = importlib.util.find_spec(top)        # a top-level spec does not run the package
    if spec is None or not spec.origin:
        return None
    base = pathlib.Path(spec.origin).parent.joinpath(*rest)
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path
    return None


def _fingerprint_from_file(module_name: str, qualname: str) -> str:
    path = _module_file(module_name)
    if path is None:
        return MISSING
    body = ast.parse(path.read_text()).body
    node = None
    for part in qualname.split("."):
        node = next((n for n in body if getattr(n, "name", None) == part or any(
            isinstance(t, ast.Name) and t.id == part for t in getattr(n, "targets", ()))), None)
        if node is None:
            return MISSING
        body = getattr(node, "body", [])
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return hashlib.sha256(ast.dump(node).encode()).hexdigest()
    return "attr:class" if isinstance(node, ast.ClassDef) else "attr:value"


def fingerprint(pin_id: str) -> str:
    """What `pins.json` records for a touched internal "module:qualname" in this engine."""
    module_name, _, qualname = pin_id.partition(":")
    if module_name.split(".")[0] in READ_FROM_FILES:
        return _fingerprint_from_file(module_name, qualname)
    try:
        owner = importlib.import_module(module_name)
    except ImportError:
        return MISSING
    *path, attr = qualname.split(".")
    for part in path:
        owner = getattr(owner, part, None)
        if owner is None:
            return MISSING
    if isinstance(owner, type):
        raw = next((k.__dict__[attr] for k in owner.__mro__ if attr in k.__dict__), None)
        if raw is None:
            return "attr:instance" if _assigned_on_self(owner, attr) else MISSING
    elif hasattr(owner, attr):
        raw = getattr(owner, attr)
    else:
        return MISSING
    if isinstance(raw, type):
        return "attr:class"
    if isinstance(raw, (staticmethod, classmethod, property)) or inspect.isfunction(inspect.unwrap(raw)):
        try:
            return source_hash(raw)
        except (OSError, TypeError):
            return f"attr:{type(raw).__name__}"
    return f"attr:{type(raw).__name__}"


def touches_of(name: str) -> tuple[str, ...]:
    """Touched internals of an adapter (its rows' touches) or of "installer" / "metrics"."""
    if name in INFRA_TOUCHES:
        return INFRA_TOUCHES[name]
    return tuple(dict.fromkeys(t for row in hooks_of(name) for t in row.touches))


@functools.lru_cache(maxsize=1)
def _load_all_cached(mtime_ns: int) -> dict:
    return json.loads(PINS_FILE.read_text())


def load_all() -> dict:
    return _load_all_cached(PINS_FILE.stat().st_mtime_ns)


def load() -> dict[str, str]:
    return load_all()["pins"]


def load_touches() -> dict[str, str]:
    return load_all().get("touches", {})


def drifted_touches(name: str) -> list[str]:
    """'<pin id> (expected X, found Y)' for every touched internal of `name` that drifted."""
    pinned = load_touches()
    out = []
    for pin_id in touches_of(name):
        found, expected = fingerprint(pin_id), pinned.get(pin_id)
        if found != expected:
            out.append(f"{pin_id} (expected {expected}, found {found})")
    return out


def all_touches() -> tuple[str, ...]:
    names = [*dict.fromkeys(h.adapter for h in HOOKS), *INFRA_TOUCHES]
    return tuple(dict.fromkeys(t for n in names for t in touches_of(n)))


def current() -> dict[str, str]:
    return {h.pin_id: source_hash(resolve(h)[2]) for h in HOOKS}


def current_touches() -> dict[str, str]:
    return {t: fingerprint(t) for t in all_touches()}


def update() -> dict[str, str]:
    """Regenerate pins.json; a touched internal that cannot be found is an error, not a pin."""
    pins, touches = current(), current_touches()
    missing = [t for t, v in touches.items() if v == MISSING]
    if missing:
        raise LookupError(f"touched internals not found in the installed engine: {', '.join(missing)}")
    PINS_FILE.write_text(json.dumps({"engine": ENGINE, "pins": pins, "touches": touches},
                                    indent=2, sort_keys=True) + "\n")
    return pins
