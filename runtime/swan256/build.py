"""Build the swan256 decode module ahead of time with the pinned FlashInfer's own JIT build API.

    python runtime/swan256/build.py [--out runtime/build/swan256] [--arch 12.0a --arch 12.1a]
                                    [--heads 8,16,32,64,128,0] [--jobs N] [--dry-run]

Sources: runtime/swan256/swan256.cu (ours) and FlashInfer's installed
csrc/sparse_mla_sm120/attention_resolve.cu (its planner, compiled as a dependency, not copied).
Flags: FlashInfer's gen_jit_spec defaults (-O3, -use_fast_math, its FLASHINFER_ENABLE_* defines,
compressed fatbins) plus the SM12x gencode flags FlashInfer's own sparse_mla_sm120 module uses,
for the arch list given here (default sm_120a and sm_121a). The ninja file is written by
FlashInfer's generate_ninja_build_for_op and run by its run_ninja, in a build directory under
--out. Writes <out>/swan256.so and <out>/manifest.json (module tag, FlashInfer version and git
commit, arch list, sha256 and size of the .so, build flags, sources with sha256, build seconds).

FlashInfer's package __init__ imports pynvml and its GPU runtime stack; the build needs neither,
so only flashinfer.jit.{env,core,cpp_ext} are loaded, with the two package levels registered as
bare namespace modules (their __init__ files are not executed).
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import pathlib
import resource
import shutil
import struct
import subprocess
import sys
import time
import types

HERE = pathlib.Path(__file__).resolve().parent
REPO = HERE.parent.parent
# The page layout, the manifest format and the file hash are the adapter's (it checks them at
# load): one definition.
sys.path.insert(0, str(REPO))
from adapter.swan.layout import (DECODE_MAX_TOKENS, HEAD_KERNELS, MANIFEST_SCHEMA, MODULE_TAG,  # noqa: E402
                                 PAGE_STRIDE, PAGE_TOKENS, ROUTER_KEY_MODULE)
from adapter.swan.module import sha256_file  # noqa: E402

DEFAULT_ARCHS = ("12.0a", "12.1a")
HEAD_SLOTS = HEAD_KERNELS                 # bit order of SWAN_HEAD_MASK in swan256.cu
DEFAULT_HEADS = ",".join(map(str, HEAD_SLOTS))


def load_flashinfer_jit():
    """flashinfer.jit.{env,core,cpp_ext} without running flashinfer/__init__.py."""
    spec = importlib.util.find_spec("flashinfer")
    if spec is None or spec.origin is None:
        raise SystemExit("[swan] flashinfer-python is not installed in this interpreter")
    root = pathlib.Path(spec.origin).parent
    for name, path in (("flashinfer", root), ("flashinfer.jit", root / "jit")):
        if name not in sys.modules:
            module = types.ModuleType(name)
            module.__path__ = [str(path)]
            module.__package__ = name
            sys.modules[name] = module
    from flashinfer.jit import core, cpp_ext
    from flashinfer.jit import env as jit_env
    from flashinfer import _build_meta

    return core, cpp_ext, jit_env, _build_meta


TOOLKIT_LOCK = "requirements/cuda-build.lock"
# What the build runs of a toolkit: the wheels of TOOLKIT_LOCK lay these out under nvidia/cu13/.
TOOLKIT_PARTS = ("bin/nvcc", "bin/ptxas", "bin/fatbinary", "bin/cudafe++", "nvvm/bin/cicc",
                 "include/crt/host_config.h", "include/cuda_runtime.h", "include/nv/target")


def wheel_toolkit() -> pathlib.Path | None:
    """The CUDA toolkit of TOOLKIT_LOCK's wheels in this interpreter (<site-packages>/nvidia/cu13),
    when every part the build runs is there (other nvidia-* wheels lay out parts of the same
    tree: a partial one is not taken)."""
    spec = importlib.util.find_spec("nvidia")
    for root in (spec.submodule_search_locations or []) if spec else []:
        home = pathlib.Path(root) / "cu13"
        if all((home / part).exists() for part in TOOLKIT_PARTS) and any((home / "lib").glob("libcudart.so*")):
            return home.resolve()
    return None


def cuda_home() -> tuple[pathlib.Path, str]:
    """(toolkit root, where it was found): CUDA_HOME; else the pinned wheels' toolkit in this
    interpreter (scripts/setup.sh installs TOOLKIT_LOCK, so every clone builds with the same
    nvcc 13.0.88 whether or not the machine has a CUDA toolkit); else the toolkit root nvcc on
    PATH reports (nvcc may be a wrapper script on PATH; the images build that way)."""
    if os.environ.get("CUDA_HOME"):
        return pathlib.Path(os.environ["CUDA_HOME"]), "CUDA_HOME"
    home = wheel_toolkit()
    if home is not None:
        return home, TOOLKIT_LOCK
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        raise SystemExit(f"[swan] no CUDA compiler: CUDA_HOME is unset, {sys.executable} has no "
                         f"nvidia-cuda-nvcc toolkit ({TOOLKIT_LOCK}: scripts/setup.sh installs it "
                         "into .venv) and no nvcc is on PATH")
    proc = subprocess.run([nvcc, "-dryrun", "-x", "cu", "-c", os.devnull, "-o", os.devnull],
                          capture_output=True, text=True)
    for line in (proc.stdout + proc.stderr).splitlines():
        if line.startswith("#$ TOP="):
            return pathlib.Path(line.split("=", 1)[1].strip()).resolve(), "PATH"
    return pathlib.Path(nvcc).resolve().parent.parent, "PATH"


def link_flags(home: pathlib.Path, out: pathlib.Path) -> list[str]:
    """FlashInfer's link line: -L$cuda_home/lib64 -L$cuda_home/lib64/stubs -lcudart -lcuda. What
    the toolkit lacks of it gets a link-time stand-in in <out>/stubs:
      * libcudart.so: the wheels ship only the versioned libcudart.so.13, in lib/ (not lib64/):
        a symlink to it (the module records the same NEEDED libcudart.so.13 either way);
      * libcuda.so: a compile-only toolkit (no driver, no stubs/) gets a symbol-less libcuda.so
        with the driver's soname, as CUDA's own stubs/ directory provides; the module then binds
        to the real libcuda.so.1 where it is loaded."""
    stub_dir = out / "stubs"
    flags: list[str] = []
    lib_dirs = [home / "lib64", home / "lib", *home.glob("targets/*/lib")]
    if not any((d / "libcudart.so").exists() for d in lib_dirs):
        versioned = sorted(p for d in lib_dirs for p in d.glob("libcudart.so.*"))
        if not versioned:
            raise SystemExit(f"[swan] no libcudart in the toolkit at {home}")
        stub_dir.mkdir(parents=True, exist_ok=True)
        link = stub_dir / "libcudart.so"
        if link.is_symlink() or link.exists():
            link.unlink()
        link.symlink_to(versioned[0])
        flags.append(f"-L{stub_dir}")
    for d in (home / "lib64" / "stubs", *home.glob("targets/*/lib/stubs")):
        if (d / "libcuda.so").exists():
            return flags + [f"-L{d}"]
    stub_dir.mkdir(parents=True, exist_ok=True)
    stub = stub_dir / "libcuda.so"
    if not stub.exists():
        src = stub_dir / "libcuda_stub.c"
        src.write_text("/* link-time stand-in for the CUDA driver (soname libcuda.so.1) */\n")
        subprocess.run([os.environ.get("CC", "cc"), "-shared", "-fPIC", "-Wl,-soname,libcuda.so.1",
                        "-o", str(stub), str(src)], check=True)
    return flags if f"-L{stub_dir}" in flags else flags + [f"-L{stub_dir}"]


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


FATBIN_MAGIC = 0xBA55ED50


def list_cubins(path: pathlib.Path) -> list[dict]:
    """The device code entries of a shared object's fatbins: [{"arch": "sm_121", "kind":
    "cubin"|"ptx", "bytes": uncompressed size}], read from the fatbin container headers (no CUDA
    tools needed). Containers hold 16-byte-aligned entries: u16 kind (1 ptx, 2 elf), u16 version,
    u32 header size, u64 payload size, ..., u32 sm arch at byte 28, u64 uncompressed size at 56."""
    data = pathlib.Path(path).read_bytes()
    entries, pos = [], 0
    while (pos := data.find(struct.pack("<I", FATBIN_MAGIC), pos)) >= 0:
        _, _, header, size = struct.unpack_from("<IHHQ", data, pos)
        off, end = pos + header, pos + header + size
        while off + 64 <= end:
            kind, _, ehdr, payload = struct.unpack_from("<HHIQ", data, off)
            if ehdr < 64 or kind not in (1, 2):
                break
            arch = struct.unpack_from("<I", data, off + 28)[0]
            raw = struct.unpack_from("<Q", data, off + 56)[0] or payload
            entries.append({"arch": f"sm_{arch}", "kind": "cubin" if kind == 2 else "ptx",
                            "bytes": raw})
            off += ehdr + payload
        pos = max(end, pos + 4)
    return entries


def arch_gencode(arch: str) -> str:
    major, minor = arch.split(".")
    return f"-gencode=arch=compute_{major}{minor},code=sm_{major}{minor}"


def build_router_key(out: pathlib.Path, previous: dict) -> dict:
    """The router's native key (runtime/swan256/router_key.cpp): host C++ against the installed
    torch's headers and libraries, no CUDA. Rebuilt when its source, flags or torch changed (the
    previous manifest's entry says what the present file was built from). Returns the manifest
    entry; a failed compile is an error, like the module's."""
    import sysconfig

    import torch
    from torch.utils import cpp_extension

    src = HERE / "router_key.cpp"
    so = out / (ROUTER_KEY_MODULE + sysconfig.get_config_var("EXT_SUFFIX"))
    cxx = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if not cxx:
        raise SystemExit("[swan] no host C++ compiler (c++/g++ on PATH, or CXX) for the router key")
    torch_lib = pathlib.Path(torch.__file__).resolve().parent / "lib"
    flags = ["-O2", "-std=c++20", "-shared", "-fPIC", "-fvisibility=hidden",
             f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
             f"-DSWAN_DECODE_MAX_TOKENS={DECODE_MAX_TOKENS}",
             *[f"-I{p}" for p in cpp_extension.include_paths()],
             f"-I{sysconfig.get_paths()['include']}"]
    libs = ["-ltorch_python", "-ltorch", "-ltorch_cpu", "-lc10"]
    entry = {"so": so.name, "source_sha256": sha256_file(src), "torch_version": torch.__version__,
             "compiler": pathlib.Path(cxx).name,
             "flags": [f for f in flags if not f.startswith("-I")] + libs}
    old = previous.get("router_key") or {}
    if (so.exists() and old.get("sha256") == sha256_file(so)
            and all(old.get(k) == entry[k] for k in ("source_sha256", "torch_version", "flags"))):
        return dict(old)
    start = time.monotonic()
    tmp = so.with_name(so.name + ".tmp")
    proc = subprocess.run([cxx, *flags, str(src), "-o", str(tmp), f"-L{torch_lib}", *libs],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-20:])
        raise SystemExit(f"[swan] the router key failed to compile ({cxx}, exit {proc.returncode}):\n{tail}")
    os.replace(tmp, so)
    entry.update(sha256=sha256_file(so), build_seconds=round(time.monotonic() - start, 1))
    print(f"[swan] built {so.name} (router key, {entry['compiler']}, torch {entry['torch_version']}) "
          f"in {entry['build_seconds']:.0f} s")
    return entry


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(REPO / "runtime" / "build" / MODULE_TAG))
    ap.add_argument("--arch", action="append", help="CUDA arch with suffix, e.g. 12.1a")
    ap.add_argument("--heads", default=os.environ.get("SWAN_HEADS", DEFAULT_HEADS),
                    help="head specialisations to compile (0 = runtime-head kernel)")
    ap.add_argument("--jobs", type=int, default=int(os.environ.get("SWAN_JOBS", "0")) or None)
    ap.add_argument("--dry-run", action="store_true", help="write build.ninja, do not compile")
    args = ap.parse_args(argv)

    archs = tuple(args.arch or DEFAULT_ARCHS)
    heads = tuple(int(h) for h in args.heads.split(","))
    if not set(heads) <= set(HEAD_SLOTS):
        raise SystemExit(f"[swan] --heads {args.heads}: FlashInfer's DSV4 decode specialises "
                         "8, 16, 32, 64, 128 and 0 (runtime) heads only")
    home, toolkit = cuda_home()             # before anything is written: no compiler, no --out
    out = pathlib.Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    # FlashInfer derives its JIT dir from these at import time: keep everything under --out.
    os.environ["FLASHINFER_WORKSPACE_BASE"] = str(out / "ws")
    os.environ["FLASHINFER_CUDA_ARCH_LIST"] = " ".join(archs)
    os.environ["CUDA_HOME"] = str(home)
    if args.jobs:
        os.environ["MAX_JOBS"] = str(args.jobs)
    # nvcc compiles the gencode targets of one source in parallel threads (no effect on code).
    os.environ.setdefault("FLASHINFER_NVCC_THREADS", str(len(archs)))

    core, cpp_ext, jit_env, build_meta = load_flashinfer_jit()
    fi_version = build_meta.__version__
    resolve_src = jit_env.FLASHINFER_CSRC_DIR / "sparse_mla_sm120" / "attention_resolve.cu"
    sources = [HERE / "swan256.cu", resolve_src]
    for src in sources:
        if not src.exists():
            raise SystemExit(f"[swan] missing source {src}")

    # The same arch flags FlashInfer's own sparse_mla_sm120 module gets (supported majors: 12).
    arch_flags = core.current_compilation_context.get_nvcc_flags_list(supported_major_versions=[12])
    want = [arch_gencode(a) for a in archs]
    if sorted(f for f in arch_flags if f.startswith("-gencode=")) != sorted(want):
        raise SystemExit(f"[swan] FlashInfer arch flags {arch_flags} do not match {want}")
    defines = [
        f"-DSWAN_PAGE_TOKENS={PAGE_TOKENS}",
        # ninja runs commands through /bin/sh: single quotes keep the string literal's quotes.
        f"'-DSWAN_MODULE_TAG=\"{MODULE_TAG}\"'",
        f"'-DSWAN_FLASHINFER_VERSION=\"{fi_version}\"'",
        f"-DSWAN_HEAD_MASK={sum(1 << HEAD_SLOTS.index(h) for h in set(heads)):#x}",
    ]
    ldflags = link_flags(home, out)
    spec = core.gen_jit_spec(MODULE_TAG, sources, extra_cuda_cflags=arch_flags + defines,
                             extra_ldflags=ldflags)
    spec.write_ninja()
    ninja = spec.ninja_path
    built_so = spec.jit_library_path
    if args.dry_run:
        print(f"[swan] dry run: wrote {ninja}")
        return 0

    before = built_so.stat().st_mtime_ns if built_so.exists() else None
    start = time.monotonic()
    cpu_start = _children_cpu()
    cpp_ext.run_ninja(spec.build_dir, ninja, verbose=False)
    seconds = time.monotonic() - start
    cpu_seconds = _children_cpu() - cpu_start

    so_path = out / f"{MODULE_TAG}.so"
    previous = {}
    if (out / "manifest.json").exists():
        try:
            previous = json.loads((out / "manifest.json").read_text())
        except ValueError:
            previous = {}
    rebuilt = before is None or built_so.stat().st_mtime_ns != before
    tmp = so_path.with_suffix(".so.tmp")
    shutil.copyfile(built_so, tmp)
    os.replace(tmp, so_path)
    router_key = build_router_key(out, previous)
    manifest = {
        "schema": MANIFEST_SCHEMA,
        "module_tag": MODULE_TAG,
        "so": so_path.name,
        "sha256": sha256_file(so_path),
        "size_bytes": so_path.stat().st_size,
        "flashinfer_version": fi_version,
        "flashinfer_git_commit": getattr(build_meta, "__git_commit__", ""),
        "archs": [f"sm_{a.replace('.', '')}" for a in archs],
        "page_tokens": PAGE_TOKENS,
        "page_stride_bytes": PAGE_STRIDE,
        "heads": [h for h in HEAD_SLOTS if h in heads],
        "nvcc": cpp_ext.get_cuda_version().base_version,
        "cuda_home": str(home),
        "toolkit": toolkit,                 # CUDA_HOME | requirements/cuda-build.lock | PATH
        "build_flags": spec.extra_cuda_cflags,
        "link_flags": ldflags,
        "sources": {
            ("flashinfer:" + str(s.relative_to(jit_env.FLASHINFER_DATA))
             if s.is_relative_to(jit_env.FLASHINFER_DATA) else str(s.relative_to(REPO))): sha256_file(s)
            for s in sources
        },
        "cubins": list_cubins(so_path),
        "router_key": router_key,
        # A no-op (ninja up to date) run keeps the figures of the build that made the .so.
        "build_seconds": round(seconds, 1) if rebuilt else previous.get("build_seconds"),
        "build_cpu_seconds": (round(cpu_seconds, 1) if rebuilt
                              else previous.get("build_cpu_seconds")),
    }
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    verb = "built" if rebuilt else "up to date:"
    print(f"[swan] {verb} {so_path} ({manifest['size_bytes']} bytes, sha256 {manifest['sha256']}) "
          f"for {', '.join(manifest['archs'])} with FlashInfer {fi_version} in {seconds:.0f} s "
          f"({cpu_seconds:.0f} CPU s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
