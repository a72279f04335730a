"""Test harness: the pinned engine on CPU, and in-process installs of adapters.

The engine's classes are the real ones wherever they run on CPU: scheduler, PrefillAdder,
UnifiedRadixCache (Python, Rust and thin's tree cores), pools and allocators, Req, ScheduleBatch,
ForwardBatch, the result processor, DeepseekV4AttnBackend over a DeepSeekV4TokenToKVPool (through
the engine kit's MockDSV4ModelRunner, which reads no model), runtime_context.publish(ServerArgs).
What stands in, and why:
- PyPI's torchvision is CUDA-linked and cannot load beside CPU torch: adapter/cpu/cpu_engine.py
  answers its imports with placeholders that raise if called (installed below, for every test).
- GPU kernels (Triton, CUDA-JIT, TileLang, FlashInfer, FlashMLA) have CPU stand-ins in
  adapter/cpu/dsv4/ (checked against the kernels' documented rules, and against the Triton
  kernels under Triton's interpreter where one exists: tests/test_cpu_dsv4_*.py), and swan's
  kernel its CPU twin (tests/test_swan_twin.py).
- NCCL / another TP rank: one process is one rank, so a collective's answer from another rank is
  planted where a test needs one (say so at the stand-in: tests/test_swa_cone_failure.py,
  tests/test_autotune_keep.py); real multi-rank runs are the e2e TP2 boot's.
- Another process or a socket: the scheduler's stream to the tokenizer manager and its metrics
  reporter (tests/test_swa_cone_failure.py, tests/test_hooks_survive_aborts.py and the decode
  yield sim, adapter/tools/sims/decode_yield.py, whose docstring lists its stand-ins), HTTP
  transports in the gate / agent-traffic tests, and workloads that need a live server.
- Engine test kits' own needs: `datasets` (not installed) while the unified-radix-cache kit
  imports, and its Rust inspector (the wheel lacks the mem_cache_inspection build):
  tests/test_swa_thin_core_engine.py.
- A few unit tests drive one function with a namespace holding only the attributes it reads
  (tests/test_swa_thin_core.py, test_cpu_torch_native_fix.py, test_cpu_dsv4_stores.py,
  test_plugin_coexistence.py, test_autotune_keep.py, test_gate_run.py), and the engine's
  Scheduler made with __new__ holding only what the wrapped method reads (a real one is a server
  boot): tests/test_input_guard.py (abort_request). Its grammar step bound runs on the decode
  yield sim's real Scheduler (process_batch_result through the engine's own result processor),
  with xgrammar's matcher stood in by one whose step time is planted on a test clock.
- The input guard's tests build the engine's real TokenizerManager on CPU (its sockets bound, no
  scheduler behind them); the admin guard's run the engine's real app and auth with a stand-in
  tokenizer manager (`Manager`, tests/test_admin_guard.py), because the admin methods await a
  scheduler's answer and none runs in a unit test.
"""
import os
import pathlib
import subprocess
import sys

import pytest

REPO_ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

from adapter.cpu import cpu_engine  # noqa: E402

cpu_engine.install_torchvision_shim()


@pytest.fixture
def install_adapters():
    """install_adapters({"DSV41_SWA_THIN": "1"}) -> installer status; undone after the test.

    Runs the production installer in this process (report mode, so a refusal is recorded rather
    than exiting pytest) and imports the engine modules of the enabled adapters.
    """
    from adapter import installer

    installer.reset_for_tests()
    yield installer.install_in_process
    installer.reset_for_tests()
    installer.set_mode("boot")


def _child_env(env: dict | None) -> dict:
    """A child interpreter's environment: PATH, HOME, PYTHONPATH=<repo root> (as the image has
    it), then `env` on top."""
    return {"PATH": os.environ.get("PATH", ""), "HOME": os.environ.get("HOME", "/root"),
            "PYTHONPATH": str(REPO_ROOT), **(env or {})}


# What every two-rank child starts with: `rank`, `mode`, `out` (its JSON's path) from argv, the
# gloo group of two joined (`dist`), tests/ importable, `json` and `sys` imported.
TWO_RANKS_PREAMBLE = r"""
import json, sys
import torch.distributed as dist

rank, mode, init, out = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
sys.path.insert(0, "tests")
"""


def run_two_ranks(code: str, tmp_path, mode: str, env: dict | None = None, timeout=300) -> list:
    """Run TWO_RANKS_PREAMBLE + `code` in two child interpreters that form a torch.distributed
    group of two (gloo, a file rendezvous in tmp_path); each gets argv: rank, mode, init method,
    output path, and writes its JSON there. Returns both ranks' JSON; fails with both logs when
    either child fails."""
    import json

    child_env = _child_env({"OMP_NUM_THREADS": "1", **(env or {})})
    init = f"file://{tmp_path}/rendezvous-{mode}"
    outs = [tmp_path / f"{mode}-rank{r}.json" for r in (0, 1)]
    code = TWO_RANKS_PREAMBLE + code
    procs = [subprocess.Popen([sys.executable, "-c", code, str(r), mode, init, str(outs[r])],
                              env=child_env, cwd=REPO_ROOT, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for r in (0, 1)]
    try:
        logs = [p.communicate(timeout=timeout)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert all(p.returncode == 0 for p in procs), "\n".join(log[-3000:] for log in logs)
    return [json.loads(o.read_text()) for o in outs]


def run_python(code: str, env: dict | None = None, args=(), argv=(), timeout=300, cwd=REPO_ROOT):
    """Run a child Python with PYTHONPATH=<repo root> (as the image does) and only `env` + PATH.

    `args` go before `-c` (interpreter flags), `argv` after the code (sys.argv[1:]); `env` may
    override PYTHONPATH (e.g. to run without our sitecustomize.py).
    """
    return subprocess.run([sys.executable, *args, "-c", code, *argv], env=_child_env(env), cwd=cwd,
                          capture_output=True, text=True, timeout=timeout)


def lock_pins(path) -> dict[str, str]:
    """{name: version} of the `name==version` lines of a requirements lock under the repo."""
    import re

    return dict(re.findall(r"^([A-Za-z0-9_.-]+)==(\S+)", (REPO_ROOT / path).read_text(), re.M))


def close_zmq_sockets(obj) -> int:
    """Close the zmq sockets an engine object holds (linger 0) and terminate their context; the
    number closed. The engine's TokenizerManager binds its sockets (linger -1: wait forever for
    queued messages) in a context it keeps no handle to. Left to the garbage collector,
    Context.__del__ runs term() inside whatever test allocates next, and term() waits forever for
    a socket with a queued message and no peer: a unit worker hung so in tests/test_swa_thin.py
    (py-spy: Context.term under Tensor.__iter__), which held CI to its time limit."""
    import zmq

    contexts, closed = [], 0
    for value in list(vars(obj).values()):
        if isinstance(value, zmq.Socket) and not value.closed:
            if value.context not in contexts:
                contexts.append(value.context)
            value.close(linger=0)
            closed += 1
    for context in contexts:
        context.term()          # every socket closed: returns at once
    return closed
