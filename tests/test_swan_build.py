"""swan build: the module compiles for sm_120a and sm_121a against the installed FlashInfer.

scripts/setup.sh installs the pinned CUDA 13.0 compiler wheels (requirements/cuda-build.lock)
and runs scripts/build_swan.sh (the images run it with their own toolkit). Where a toolkit is
found (build.cuda_home(): CUDA_HOME, the wheels in this interpreter, nvcc on PATH) the build is
required: these tests fail if the module is missing. Where none is, they skip, saying so.
SWAN_TEST_REBUILD=1 also compiles a fresh one-head module for both arches into a temp dir.
"""
import importlib.util
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import types

import pytest

from adapter import swan
from runtime.swan256 import build


def _toolkit():
    try:
        return build.cuda_home()
    except SystemExit:
        return None


TOOLKIT = _toolkit()
needs_toolkit = pytest.mark.skipif(TOOLKIT is None, reason="no CUDA toolkit for this interpreter "
                                   "(scripts/setup.sh installs requirements/cuda-build.lock)")
MODULE = swan.module_dir()
REPO = swan.REPO_ROOT
FI_INCLUDE = (pathlib.Path(importlib.util.find_spec("flashinfer").origin).parent
              / "data/include/flashinfer/attention/sparse_mla_sm120")
LOCK = REPO / "requirements/cuda-build.lock"


def _decode_kernel_symbol(heads: int) -> str:
    # sparse_mla_decode_dsv4_kernel<ModelType::DSV4 (=1), heads, Fp8DecodeGatherSchedule>
    return ("_ZN10flashinfer16sparse_mla_sm12029sparse_mla_decode_dsv4_kernelIL9ModelType1ELi"
            f"{heads}E23Fp8DecodeGatherScheduleE")


def test_build_without_any_toolkit_fails_naming_the_lock(tmp_path):
    """No CUDA_HOME, no wheels (python -S: no site-packages), no nvcc on PATH: scripts/build_swan.sh
    fails (it used to print one line and exit 0, and the production line then refused to boot)."""
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}
    assert shutil.which("nvcc", path=env["PATH"]) is None
    python = tmp_path / "python-without-site"
    python.write_text(f"#!/bin/sh\nexec {sys.executable} -S \"$@\"\n")
    python.chmod(0o755)
    proc = subprocess.run([str(REPO / "scripts/build_swan.sh"), "--out", str(tmp_path / "m")],
                          env=dict(env, PYTHON=str(python)), capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0
    assert "[swan] no CUDA compiler" in proc.stderr and "requirements/cuda-build.lock" in proc.stderr
    assert not (tmp_path / "m").exists()


def _fake_toolkit(root, parts=build.TOOLKIT_PARTS, cudart="lib/libcudart.so.13"):
    home = root / "nvidia" / "cu13"
    for part in (*parts, cudart):
        (home / part).parent.mkdir(parents=True, exist_ok=True)
        (home / part).write_text("")
    return home


def _site(monkeypatch, root):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: types.SimpleNamespace(
        submodule_search_locations=[str(root / "nvidia")]) if name == "nvidia" else real(name, *a))


def test_toolkit_order_is_cuda_home_then_the_pinned_wheels_then_path(tmp_path, monkeypatch):
    monkeypatch.delenv("CUDA_HOME", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    home = _fake_toolkit(tmp_path / "site")
    _site(monkeypatch, tmp_path / "site")
    assert build.cuda_home() == (home.resolve(), "requirements/cuda-build.lock")
    monkeypatch.setenv("CUDA_HOME", str(tmp_path / "other"))
    assert build.cuda_home() == (tmp_path / "other", "CUDA_HOME")
    # a partial tree (another nvidia-* wheel's parts, no cicc) is not a toolkit
    monkeypatch.delenv("CUDA_HOME")
    partial = tmp_path / "partial"
    _fake_toolkit(partial, parts=[p for p in build.TOOLKIT_PARTS if "cicc" not in p])
    _site(monkeypatch, partial)
    with pytest.raises(SystemExit, match="no CUDA compiler"):
        build.cuda_home()


def test_link_flags_give_the_wheels_an_unversioned_libcudart(tmp_path):
    home = _fake_toolkit(tmp_path / "site", parts=build.TOOLKIT_PARTS + ("lib64/stubs/libcuda.so",))
    out = tmp_path / "out"
    flags = build.link_flags(home, out)
    link = out / "stubs" / "libcudart.so"
    assert link.is_symlink() and link.resolve() == (home / "lib/libcudart.so.13").resolve()
    assert flags == [f"-L{out / 'stubs'}", f"-L{home / 'lib64/stubs'}"]
    # a system toolkit with lib64/libcudart.so gets no link of ours
    system = tmp_path / "cuda"
    for part in ("lib64/libcudart.so", "lib64/stubs/libcuda.so"):
        (system / part).parent.mkdir(parents=True, exist_ok=True)
        (system / part).write_text("")
    assert build.link_flags(system, tmp_path / "out2") == [f"-L{system / 'lib64/stubs'}"]


def test_the_lock_pins_the_toolkit_wheels_by_hash_and_setup_always_builds():
    text = LOCK.read_text()
    reqs = re.findall(r"^([a-z0-9-]+)==(\S+)((?:\s*\\\n\s*--hash=sha256:[0-9a-f]{64})+)", text, re.M)
    pins = {name: version for name, version, _ in reqs}
    assert pins == {"nvidia-cuda-nvcc": "13.0.88", "nvidia-cuda-crt": "13.0.88",
                    "nvidia-nvvm": "13.0.88", "nvidia-cuda-runtime": "13.0.96",
                    "nvidia-cuda-cccl": "13.0.85"}
    assert all(hashes.count("--hash=") == 2 for _, _, hashes in reqs)    # x86_64 and aarch64
    setup = (REPO / "scripts/setup.sh").read_text()
    assert "--require-hashes" in setup and "-r requirements/cuda-build.lock" in setup
    # unconditionally, with .venv's interpreter (PYTHON is setup's base interpreter: issue 30.6)
    assert re.search(r"^PYTHON=\$VENV_PY scripts/build_swan\.sh$", setup, re.M)


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
    assert ours == {"swan256.cu", "router_key.cpp", "build.py", "reference.py", "README.md", "__init__.py"}
    if TOOLKIT is None:
        pytest.skip("no CUDA toolkit: build.ninja is not generated without one")
    proc = subprocess.run([sys.executable, str(REPO / "runtime/swan256/build.py"),
                           "--out", str(tmp_path), "--dry-run"], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    ninja = next(tmp_path.rglob("build.ninja")).read_text()
    for flag in ("-gencode=arch=compute_120a,code=sm_120a", "-gencode=arch=compute_121a,code=sm_121a",
                 "-DSWAN_PAGE_TOKENS=256", "-DSWAN_HEAD_MASK=0x3f", "-O3", "-use_fast_math"):
        assert flag in ninja
    assert "flashinfer/data/csrc/sparse_mla_sm120/attention_resolve.cu" in ninja
    assert str(REPO / "runtime/swan256/swan256.cu") in ninja


@needs_toolkit
def test_built_module_matches_its_manifest():
    manifest_path = MODULE / "manifest.json"
    assert manifest_path.exists(), ("a CUDA toolkit is present but the swan256 module is not "
                                    "built: run scripts/build_swan.sh (scripts/setup.sh does)")
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
    key = manifest["router_key"]        # the router's native key: host code against this torch
    assert swan.sha256_file(MODULE / key["so"]) == key["sha256"]
    assert key["source_sha256"] == swan.sha256_file(REPO / "runtime/swan256/router_key.cpp")
    assert key["torch_version"] == swan.module.installed_torch_version()
    assert f"-DSWAN_DECODE_MAX_TOKENS={swan.DECODE_MAX_TOKENS}" in key["flags"]
    info = swan.verify_module(MODULE, swan.installed_flashinfer_version())   # what install() runs
    assert info.router_key_path == MODULE / key["so"] and callable(swan.load_router_key(info).lookup)
    # built with the toolkit this interpreter's build picks (setup: the pinned wheels)
    assert manifest["nvcc"] == "13.0" and manifest.get("toolkit", "PATH") == TOOLKIT[1]


@needs_toolkit
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


@needs_toolkit
@pytest.mark.skipif(os.environ.get("SWAN_TEST_REBUILD") != "1",
                    reason="set SWAN_TEST_REBUILD=1 to compile a fresh module (minutes)")
def test_fresh_compile_for_both_arches(tmp_path):
    proc = subprocess.run([sys.executable, str(REPO / "runtime/swan256/build.py"),
                           "--out", str(tmp_path), "--heads", "64"], capture_output=True,
                          text=True, timeout=1800)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    assert {c["arch"] for c in manifest["cubins"]} == {"sm_120", "sm_121"}
    assert _decode_kernel_symbol(64).encode() in (tmp_path / "swan256.so").read_bytes()
