"""Pins: sha256 of the source of every engine callable an adapter wraps, in the pinned engine.

`dsv41 pins --update` regenerates adapter/pins.json from the table; the installer checks a pin
before wrapping and refuses the adapter on drift.
"""
from __future__ import annotations

import hashlib
import importlib
import inspect
import json
import pathlib

from adapter.table import HOOKS, Hook

PINS_FILE = pathlib.Path(__file__).with_name("pins.json")
ENGINE = "sglang==0.5.23"


def resolve(hook: Hook):
    """(owner, attribute name, raw attribute) of a table row; raw = as stored on its owner."""
    owner = importlib.import_module(hook.module)
    *path, attr = hook.qualname.split(".")
    for part in path:
        owner = getattr(owner, part)
    raw = owner.__dict__[attr] if isinstance(owner, type) else getattr(owner, attr)
    return owner, attr, raw


def original_callable(raw):
    func = raw.__func__ if isinstance(raw, (staticmethod, classmethod)) else raw
    return inspect.unwrap(func)


def source_hash(raw) -> str:
    return hashlib.sha256(inspect.getsource(original_callable(raw)).encode()).hexdigest()


def load() -> dict[str, str]:
    data = json.loads(PINS_FILE.read_text())
    return data["pins"]


def current() -> dict[str, str]:
    return {h.pin_id: source_hash(resolve(h)[2]) for h in HOOKS}


def update() -> dict[str, str]:
    pins = current()
    PINS_FILE.write_text(json.dumps({"engine": ENGINE, "pins": pins}, indent=2, sort_keys=True) + "\n")
    return pins
