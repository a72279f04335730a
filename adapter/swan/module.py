"""The built swan256 module: where it lives and the checks install() runs before trusting it
(manifest, sha256 of the .so, page geometry, the FlashInfer it was built against)."""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import pathlib
from typing import Any, Mapping, Optional

from adapter.swan.layout import MANIFEST_SCHEMA, MODULE_TAG, PAGE_STRIDE, PAGE_TOKENS

from adapter.locations import PACKAGE_PARENT

# The directory that holds the `adapter` and `runtime` packages: the repo root in a checkout,
# site-packages for an installed wheel. The module is built beside runtime/swan256's sources in
# both (`python -m runtime.swan256.build`, scripts/build_swan.sh).
REPO_ROOT = PACKAGE_PARENT
DEFAULT_MODULE_DIR = PACKAGE_PARENT / "runtime" / "build" / MODULE_TAG
# Where the built module lives. Not a DSV41_ key: an image-layout override, also the test seam
# for "module not built" without touching the real build.
MODULE_DIR_ENV = "SWAN_RUNTIME_DIR"


class ModuleError(Exception):
    """The swan256 module is missing, tampered with, or was built for other bits."""


@dataclasses.dataclass(frozen=True)
class ModuleInfo:
    directory: pathlib.Path
    so_path: pathlib.Path
    sha256: str
    flashinfer_version: str
    archs: tuple[str, ...]
    heads: tuple[int, ...]
    manifest: Mapping[str, Any]
    router_key_path: Optional[pathlib.Path] = None     # the native key (router_key.cpp), verified


def module_dir(environ: Optional[Mapping[str, str]] = None) -> pathlib.Path:
    env = os.environ if environ is None else environ
    return pathlib.Path(env[MODULE_DIR_ENV]) if env.get(MODULE_DIR_ENV) else DEFAULT_MODULE_DIR


def sha256_file(path: pathlib.Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _installed_version(distribution: str) -> Optional[str]:
    from importlib import metadata

    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None


def installed_flashinfer_version() -> Optional[str]:
    """The installed flashinfer-python version, from its metadata (importing flashinfer itself
    needs its GPU stack)."""
    return _installed_version("flashinfer-python")


def installed_torch_version() -> Optional[str]:
    """The installed torch version, from its metadata (the router key is built against it)."""
    return _installed_version("torch")


def _verify_router_key(directory: pathlib.Path, manifest: Mapping[str, Any],
                       torch_version: Optional[str]) -> pathlib.Path:
    """The router's native key is part of the module (schema 2): present, the file that was
    built, and built against the installed torch (its C++ ABI is that torch's)."""
    entry = manifest.get("router_key")
    if not isinstance(entry, Mapping) or not entry.get("so"):
        raise ModuleError(f"{directory / 'manifest.json'} records no router key "
                          "(rebuild the module: scripts/build_swan.sh)")
    path = directory / str(entry["so"])
    if not path.exists():
        raise ModuleError(f"the router key {path} is missing (manifest present)")
    found = sha256_file(path)
    if found != entry.get("sha256"):
        raise ModuleError(f"sha256 of {path} is {found}, the build manifest records "
                          f"{entry.get('sha256')}: the router key is not the one that was built")
    if torch_version is not None and entry.get("torch_version") != torch_version:
        raise ModuleError(f"{path} was built against torch {entry.get('torch_version')}, the "
                          f"installed one is {torch_version}: rebuild it (scripts/build_swan.sh)")
    return path


def verify_module(directory: pathlib.Path, flashinfer_version: Optional[str]) -> ModuleInfo:
    """Check the built module against its manifest; raise ModuleError saying what is wrong."""
    manifest_path = directory / "manifest.json"
    if not manifest_path.exists():
        raise ModuleError(f"the {MODULE_TAG} module is not built ({manifest_path} is missing; "
                          "scripts/setup.sh builds it, or scripts/build_swan.sh alone)")
    try:
        manifest = json.loads(manifest_path.read_text())
    except (OSError, ValueError) as exc:
        raise ModuleError(f"{manifest_path} is unreadable: {exc}") from None
    if manifest.get("schema") != MANIFEST_SCHEMA or manifest.get("module_tag") != MODULE_TAG:
        raise ModuleError(f"{manifest_path} is not a {MODULE_TAG} manifest of schema "
                          f"{MANIFEST_SCHEMA} (module_tag={manifest.get('module_tag')!r}, "
                          f"schema={manifest.get('schema')!r})")
    so_path = directory / str(manifest.get("so", f"{MODULE_TAG}.so"))
    # Spelled out like the router key's check above, not shared: the refusal text is quoted in
    # docs/swan.md and tests/test_receipt_quotes.py matches it against this format string.
    if not so_path.exists():
        raise ModuleError(f"the {MODULE_TAG} module {so_path} is missing (manifest present)")
    found = sha256_file(so_path)
    if found != manifest.get("sha256"):
        raise ModuleError(f"sha256 of {so_path} is {found}, the build manifest records "
                          f"{manifest.get('sha256')}: the module is not the one that was built")
    if manifest.get("page_tokens") != PAGE_TOKENS or manifest.get("page_stride_bytes") != PAGE_STRIDE:
        raise ModuleError(f"{so_path} serves pages of {manifest.get('page_tokens')} tokens / "
                          f"{manifest.get('page_stride_bytes')} B, not {PAGE_TOKENS} / {PAGE_STRIDE}")
    if flashinfer_version != manifest.get("flashinfer_version"):
        raise ModuleError(f"{so_path} was built against FlashInfer "
                          f"{manifest.get('flashinfer_version')}, the installed one is "
                          f"{flashinfer_version}: rebuild it (scripts/build_swan.sh)")
    router_key = _verify_router_key(directory, manifest, installed_torch_version())
    return ModuleInfo(directory, so_path, found, str(manifest["flashinfer_version"]),
                      tuple(manifest.get("archs", ())), tuple(int(h) for h in manifest.get("heads", ())),
                      manifest, router_key)
