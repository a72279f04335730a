"""swan module checks at install: manifest, sha256 of the .so, pinned FlashInfer; default off;
`dsv41 check` installs swan when the module is built and refuses, naming the key, when not."""
import json
import pathlib
import shutil

import pytest

from adapter import keys, swan
from swan_module_dir import write_module

BUILT = swan.module_dir() / "manifest.json"


def test_pinned_flashinfer_is_the_engine_pin():
    assert swan.installed_flashinfer_version() == "0.7.2"


def test_verify_accepts_a_matching_module(tmp_path):
    info = swan.verify_module(write_module(tmp_path), "0.7.2")
    assert info.sha256 == swan.sha256_file(tmp_path / "swan256.so")
    assert info.router_key_path.parent == tmp_path and info.router_key_path.exists()
    assert info.archs == ("sm_120a", "sm_121a") and 0 in info.heads


@pytest.mark.parametrize("case, expected", [
    ("tampered", "sha256 of"),
    ("no manifest", "is not built"),
    ("no so", "is missing (manifest present)"),
    ("other flashinfer", "built against FlashInfer 0.7.1"),
    ("other tag", "not a swan256 manifest"),
    ("other page", "serves pages of 64 tokens"),
    ("bad json", "unreadable"),
    ("no router key", "records no router key"),
    ("router key missing", "the router key"),
    ("router key tampered", "the router key is not the one that was built"),
    ("router key of another torch", "built against torch 2.12.0"),
])
def test_verify_refuses(tmp_path, case, expected):
    d = write_module(tmp_path)
    so, manifest = d / "swan256.so", d / "manifest.json"
    if case == "tampered":
        data = bytearray(so.read_bytes())
        data[100] ^= 0x01                       # one bit of the built file
        so.write_bytes(bytes(data))
    elif case == "no manifest":
        manifest.unlink()
    elif case == "no so":
        so.unlink()
    elif case == "other flashinfer":
        write_module(d, flashinfer_version="0.7.1")
    elif case == "other tag":
        write_module(d, module_tag="swan64")
    elif case == "other page":
        write_module(d, page_tokens=64, page_stride_bytes=37440)
    elif case == "bad json":
        manifest.write_text("{not json")
    elif case == "no router key":
        write_module(d, router_key=None)
    elif case == "router key missing":
        (d / json.loads(manifest.read_text())["router_key"]["so"]).unlink()
    elif case == "router key tampered":
        key = d / json.loads(manifest.read_text())["router_key"]["so"]
        key.write_bytes(key.read_bytes() + b"\x00")
    elif case == "router key of another torch":
        entry = json.loads(manifest.read_text())["router_key"]
        write_module(d, router_key=dict(entry, torch_version="2.12.0"))
    with pytest.raises(swan.ModuleError, match=expected.replace("(", r"\(").replace(")", r"\)")):
        swan.verify_module(d, "0.7.2")


def test_module_default_off(install_adapters):
    key = keys.KEY_BY_NAME["DSV41_SWA_NATIVE_DECODE"]
    assert key.default == 0 and key.adapter == "swan" and key.volatile
    assert install_adapters({})["swan"].status == "off"
    assert install_adapters({"DSV41_SWA_NATIVE_DECODE": "0"})["swan"].status == "off"


def test_tampered_module_refuses_install_and_names_the_key(install_adapters, tmp_path, monkeypatch):
    d = write_module(tmp_path)
    so = d / "swan256.so"
    so.write_bytes(so.read_bytes()[:-1] + b"\x00")
    monkeypatch.setenv(swan.MODULE_DIR_ENV, str(d))
    state = install_adapters({"DSV41_SWA_NATIVE_DECODE": "1"})["swan"]
    assert state.status == "refused" and state.pin_ok is True
    assert "sha256 of" in state.detail
    assert "Unset DSV41_SWA_NATIVE_DECODE to boot without swan" in state.detail


def test_missing_module_refuses_install(install_adapters, tmp_path, monkeypatch):
    monkeypatch.setenv(swan.MODULE_DIR_ENV, str(tmp_path / "nowhere"))
    state = install_adapters({"DSV41_SWA_NATIVE_DECODE": "1"})["swan"]
    assert state.status == "refused"
    assert "is not built" in state.detail and "Unset DSV41_SWA_NATIVE_DECODE" in state.detail


def _check(env_words: str):
    from adapter.tools import check, profile

    line = profile.line_from_text(env_words, name="swan-test")
    code, rows, stderr = check.run(line)
    return code, {r["adapter"]: r for r in rows}, stderr


@pytest.mark.skipif(not BUILT.exists(), reason="swan256 module not built here (scripts/setup.sh "
                    "builds it; test_swan_build fails where a CUDA toolkit exists)")
def test_dsv41_check_installs_the_built_module():
    code, rows, _ = _check("DSV41_SWA_NATIVE_DECODE=1")
    assert code == 0 and rows["swan"]["installed"], rows["swan"]
    manifest = json.loads(BUILT.read_text())
    assert manifest["sha256"][:16] in rows["swan"]["reason"]
    assert "stride(0)=149760" in rows["swan"]["reason"]


def test_dsv41_check_refuses_without_the_module(tmp_path):
    code, rows, stderr = _check(f"DSV41_SWA_NATIVE_DECODE=1 {swan.MODULE_DIR_ENV}={tmp_path}")
    swan_row = rows["swan"]
    assert not swan_row["installed"] and swan_row["status"] == "refused"
    assert "module is not built" in swan_row["reason"]
    assert "Unset DSV41_SWA_NATIVE_DECODE" in swan_row["reason"]


def test_layout_is_the_one_light_source_of_the_page_constants():
    """build.py, reference.py and bench/swan_split_cost.py read adapter/swan/layout.py; importing
    it (and so the package) loads no torch, engine or FlashInfer (a bare device can import it)."""
    from conftest import run_python

    proc = run_python("import sys, adapter.swan.layout\n"
                      "heavy = ('torch', 'sglang', 'flashinfer', 'tvm_ffi', 'wrapt', 'numpy', 'triton')\n"
                      "print(sorted(m for m in sys.modules if m.split('.')[0] in heavy))")
    assert proc.returncode == 0 and proc.stdout.strip() == "[]", proc.stdout + proc.stderr
    from adapter.swan import layout
    from runtime.swan256 import build, reference

    assert reference.page_stride_for is layout.page_stride_for and reference.ROW_BYTES == layout.ROW_BYTES
    assert build.HEAD_SLOTS == layout.HEAD_KERNELS == swan.ModuleCaps().heads
    assert (layout.PAGE_STRIDE, layout.SPLIT_PAGE_STRIDE) == (149_760, 37_440)
