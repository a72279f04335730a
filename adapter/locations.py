"""Where the package runs from: a source checkout or an installed wheel (site-packages).

Imports nothing of the engine. Every path the package derives from its own location comes from
here, so an installed wheel (`pip install dsv41-*.whl`, not `-e`) finds what a checkout finds:
- PACKAGE_PARENT: the directory that holds the `adapter` and `runtime` packages (the repo root in
  a checkout, site-packages when installed). swan's built module lives under it
  (`runtime/build/swan256`), in both layouts.
- source_tree(): the checkout's root when running from one (its sitecustomize.py arms the line
  through PYTHONPATH), else None: the installed `dsv41.pth` arms it.
- cache_dir(): a writable place for generated files (the CPU harness's tiny models): the
  checkout's `.cache/`, or the user's cache directory when installed.
"""
from __future__ import annotations

import os
import pathlib
from typing import Optional

PACKAGE_PARENT = pathlib.Path(__file__).resolve().parent.parent
# The file the wheel installs into site-packages: its one line arms the installer at startup in
# every Python process of that interpreter when a DSV41_* key is set (adapter/plugin.py).
PTH_NAME = "dsv41.pth"


def source_tree() -> Optional[pathlib.Path]:
    """The checkout's root (it holds sitecustomize.py and pyproject.toml beside `adapter/`), or
    None in an installed package."""
    root = PACKAGE_PARENT
    if (root / "sitecustomize.py").is_file() and (root / "pyproject.toml").is_file():
        return root
    return None


def cache_dir() -> pathlib.Path:
    root = source_tree()
    if root is not None:
        return root / ".cache"
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return pathlib.Path(base) / "dsv41"
