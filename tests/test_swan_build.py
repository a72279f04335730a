"""swan build: the module compiles for sm_120a and sm_121a against the installed FlashInfer.

scripts/setup.sh runs scripts/build_swan.sh (CI and the image do too). Where nvcc is present the
build is required: these tests fail if it is missing. Where nvcc is absent they skip, saying so.
SWAN_TEST_REBUILD=1 also compiles a fresh one-head module for both arches into a temp dir.
"""
import json
import os
import re
import shutil
import subprocess

import pytest

from adapter import swan
from runtime.swan256 import build

NVCC = shutil.which("nvcc")
needs_nvcc = pytest.mark.skipif(NVCC is None, reason="nvcc not on PATH: the swan256 module cannot "
                                "be compiled here (CI and the image have nvcc 13.0)")
MODULE = swan.DEFAULT_MODULE_DIR
REPO = swan.REPO_ROOT
FI_INCLUDE = (REPO / ".venv/lib/python3.11/site-packages/flashinfer/data/include/flashinfer/"
              "attention/sparse_mla_sm120")


def _decode_kernel_symbol(heads: int) -> str:
    # sparse_mla_decode_dsv4_kernel<ModelType::DSV4 (=1), heads, Fp8DecodeGatherSchedule>
    return ("_ZN10flashinfer16sparse_mla_sm12029sparse_mla_decode_dsv4_kernelIL9ModelType1ELi"
            f"{heads}E23Fp8DecodeGatherScheduleE")


def test_build_script_skips_with_one_message_without_nvcc(tmp_path):
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}
    assert shutil.which("nvcc", path=env["PATH"]) is None
    proc = subprocess.run([str(REPO / "scripts/build_swan.sh"), "--out", str(tmp_path / "m")],
                          env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    lines = [ln for ln in (proc.stdout + proc.stderr).splitlines() if ln.strip()]
    assert len(lines) == 1 and "nvcc not found" in lines[0] and "NOT built" in lines[0]
    assert not (tmp_path / "m").exists()


def test_installed_flashinfer_takes_a_run_time_dsv4_page_size():
    """flashinfer #5197 (0.7.1+): DSV4's main page size is a run-time value. The module adds an
    ahead-of-time build with pinned bits and a compile-time 256-token page on top of it."""
    plan_h = (FI_INCLUDE / "execution/attention_plan.h").read_text()
    runtime_page = re.search(r"constexpr bool runtime_page\(ModelType model\) \{(.*?)\}", plan_h, re.S)
    assert runtime_page and "ModelType::DSV4 " in runtime_page.group(1) + " "
    assert "runtime_page(model) ? page > 0" in plan_h
    decode = (FI_INCLUDE / "kernels/fp8_decode/decode.cuh").read_text()
    assert "Dsv4PageDivisors" in decode and "return int(uint32_t(pages.main));" in decode


def test_sources_are_ours_flashinfer_is_a_dependency(tmp_path):
    ours = {p.name for p in (REPO / "runtime/swan256").iterdir() if p.is_file()}
    assert ours == {"swan256.cu", "build.py", "reference.py", "README.md", "__init__.py"}
    if NVCC is None:
        pytest.skip("nvcc not on PATH: build.ninja is not generated without a CUDA toolkit")
    proc = subprocess.run([str(REPO / ".venv/bin/python"), str(REPO / "runtime/swan256/build.py"),
                           "--out", str(tmp_path), "--dry-run"], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    ninja = next(tmp_path.rglob("build.ninja")).read_text()
    for flag in ("-gencode=arch=compute_120a,code=sm_120a", "-gencode=arch=compute_121a,code=sm_121a",
                 "-DSWAN_PAGE_TOKENS=256", "-DSWAN_HEAD_MASK=0x3f", "-O3", "-use_fast_math"):
        assert flag in ninja
    assert "site-packages/flashinfer/data/csrc/sparse_mla_sm120/attention_resolve.cu" in ninja
    assert str(REPO / "runtime/swan256/swan256.cu") in ninja


@needs_nvcc
def test_built_module_matches_its_manifest():
    manifest_path = MODULE / "manifest.json"
    assert manifest_path.exists(), ("nvcc is present but the swan256 module is not built: "
                                    "run scripts/build_swan.sh (scripts/setup.sh does)")
    manifest = json.loads(manifest_path.read_text())
    so = MODULE / manifest["so"]
    assert swan.sha256_file(so) == manifest["sha256"]
    assert so.stat().st_size == manifest["size_bytes"]
    assert manifest["archs"] == ["sm_120a", "sm_121a"]
    assert manifest["flashinfer_version"] == swan.installed_flashinfer_version() == "0.7.2"
    assert (manifest["page_tokens"], manifest["page_stride_bytes"]) == (256, 149760)
    assert "-gencode=arch=compute_121a,code=sm_121a" in manifest["build_flags"]
    assert set(manifest["sources"]) == {"runtime/swan256/swan256.cu",
                                        "flashinfer:csrc/sparse_mla_sm120/attention_resolve.cu"}
    swan.verify_module(MODULE, swan.installed_flashinfer_version())   # what install() runs


@needs_nvcc
def test_built_module_holds_both_arches_and_every_head_kernel():
    manifest = json.loads((MODULE / "manifest.json").read_text())
    data = (MODULE / manifest["so"]).read_bytes()
    cubins = build.list_cubins(MODULE / manifest["so"])
    assert cubins == manifest["cubins"]
    big = {c["arch"] for c in cubins if c["kind"] == "cubin" and c["bytes"] > 100_000}
    assert big == {"sm_120", "sm_121"}      # the decode kernels, once per arch
    for heads in manifest["heads"]:
        assert _decode_kernel_symbol(heads).encode() in data, heads
    for name in (b"__tvm_ffi_swan256_decode", b"__tvm_ffi_swan256_plan", b"__tvm_ffi_swan256_info"):
        assert name in data


@needs_nvcc
@pytest.mark.skipif(os.environ.get("SWAN_TEST_REBUILD") != "1",
                    reason="set SWAN_TEST_REBUILD=1 to compile a fresh module (minutes)")
def test_fresh_compile_for_both_arches(tmp_path):
    proc = subprocess.run([str(REPO / ".venv/bin/python"), str(REPO / "runtime/swan256/build.py"),
                           "--out", str(tmp_path), "--heads", "64"], capture_output=True,
                          text=True, timeout=1800)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    assert {c["arch"] for c in manifest["cubins"]} == {"sm_120", "sm_121"}
    assert _decode_kernel_symbol(64).encode() in (tmp_path / "swan256.so").read_bytes()
