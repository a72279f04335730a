"""A swan module directory for tests: a stand-in .so (nothing loads it on CPU) beside the real
router key that scripts/setup.sh built (runtime/build/swan256: the key is host code, it runs
here), with a manifest that verify_module() accepts."""
import json
import pathlib
import shutil

from adapter import swan

BUILT_MANIFEST = swan.module_dir() / "manifest.json"


def built_router_key() -> dict:
    """The built module's router key entry (fails, naming setup, where the module is not built)."""
    assert BUILT_MANIFEST.exists(), ("the swan256 module is not built here: scripts/setup.sh "
                                     "builds it (scripts/build_swan.sh alone)")
    entry = json.loads(BUILT_MANIFEST.read_text()).get("router_key")
    assert entry, f"{BUILT_MANIFEST} has no router key: rebuild it (scripts/build_swan.sh)"
    return entry


def write_module(directory: pathlib.Path, payload=b"\x7fELF" + bytes(range(256)) * 8, **overrides):
    directory.mkdir(parents=True, exist_ok=True)
    so = directory / "swan256.so"
    so.write_bytes(payload)
    key = built_router_key()
    shutil.copyfile(swan.module_dir() / key["so"], directory / key["so"])
    manifest = {"schema": swan.MANIFEST_SCHEMA, "module_tag": "swan256", "so": so.name,
                "sha256": swan.sha256_file(so), "size_bytes": len(payload), "page_tokens": 256,
                "page_stride_bytes": 149760, "flashinfer_version": swan.installed_flashinfer_version(),
                "archs": ["sm_120a", "sm_121a"], "heads": [8, 16, 32, 64, 128, 0], "router_key": key}
    manifest.update(overrides)
    (directory / "manifest.json").write_text(json.dumps(manifest))
    return directory
