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


# Several runs of one child script that import the same engine modules: one interpreter runs
# `preload` (the imports, ~8 s of CPU each time a fresh interpreter does them), then forks one child
# per case, one at a time; each child runs `code` with its case as sys.argv[1:], as
# `python -c code *case` would, with its own stdout, stderr and exit code (os._exit included: a boot
# stopped by installer.fatal). What a fresh interpreter does at startup (sitecustomize and the
# DSV41_* keys it reads) happens once, in the parent, with `env`: only cases that set their keys
# themselves (installer.bootstrap(environ=...), install_in_process) can share a parent.
FORK_DRIVER = r"""
import json, os, sys, traceback
code_path, cases_path, out_dir = sys.argv[1:4]
exec(compile(open(os.path.join(out_dir, "preload.py")).read(), "<preload>", "exec"), {})
code = compile(open(code_path).read(), "<string>", "exec")
codes = []
for i, case in enumerate(json.load(open(cases_path))):
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        rc = 1
        try:
            for fd, ext in ((1, "out"), (2, "err")):
                os.dup2(os.open(os.path.join(out_dir, f"{i}.{ext}"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC), fd)
            sys.argv = ["-c", *case]
            exec(code, {"__name__": "__main__", "__builtins__": __builtins__})
            rc = 0
        except SystemExit as e:
            rc = e.code if isinstance(e.code, int) else 0 if e.code is None else 1
        except BaseException:
            traceback.print_exc()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(rc)
    codes.append(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))
json.dump(codes, open(os.path.join(out_dir, "codes.json"), "w"))
"""


def _start_forked(code: str, cases, preload: str, out_dir: pathlib.Path, env: dict | None):
    import json

    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "code.py").write_text(code)
    (out_dir / "cases.json").write_text(json.dumps([[str(a) for a in case] for case in cases]))
    (out_dir / "preload.py").write_text(preload)
    return subprocess.Popen([sys.executable, "-c", FORK_DRIVER, str(out_dir / "code.py"),
                             str(out_dir / "cases.json"), str(out_dir)], env=_child_env(env),
                            cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)


def _stop_driver(proc) -> None:
    """Kill a fork driver and the case it is running (its own session: one process group)."""
    import signal

    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()


def _forked_results(proc, out_dir: pathlib.Path, n: int, timeout) -> list:
    import json

    try:
        log = proc.communicate(timeout=timeout)[0]
    except subprocess.TimeoutExpired:
        _stop_driver(proc)
        raise
    assert proc.returncode == 0, f"the fork driver failed: {log[-3000:]}"
    codes = json.loads((out_dir / "codes.json").read_text())
    return [subprocess.CompletedProcess(["<forked>", str(i)], codes[i], (out_dir / f"{i}.out").read_text(),
                                        (out_dir / f"{i}.err").read_text()) for i in range(n)]


def run_forked(code: str, cases, preload: str, out_dir, env: dict | None = None,
               timeout=600) -> list:
    """`run_python(code, env, argv=case)` for each case, the imports paid once (FORK_DRIVER):
    one CompletedProcess per case, in order."""
    cases = list(cases)
    proc = _start_forked(code, cases, preload, pathlib.Path(out_dir), env)
    return _forked_results(proc, pathlib.Path(out_dir), len(cases), timeout)


def run_two_ranks_modes(code: str, tmp_path, modes, preload: str, env: dict | None = None,
                        timeout=600) -> dict:
    """TWO_RANKS_PREAMBLE + `code` in two ranks that form a torch.distributed group of two (gloo, a
    file rendezvous in tmp_path), once per mode, one mode after the other, each rank's modes forked
    from one driver (FORK_DRIVER: the imports paid once per rank). Each child gets argv: rank, mode,
    init method, output path, and writes its JSON there. {mode: [rank 0's JSON, rank 1's JSON]};
    fails with the child's output when a rank fails."""
    import json

    tmp_path = pathlib.Path(tmp_path)
    outs = {m: [tmp_path / f"{m}-rank{r}.json" for r in (0, 1)] for m in modes}
    cases = {r: [(r, m, f"file://{tmp_path}/rendezvous-{m}", outs[m][r]) for m in modes] for r in (0, 1)}
    dirs = {r: tmp_path / f"rank{r}" for r in (0, 1)}
    procs = {r: _start_forked(TWO_RANKS_PREAMBLE + code, cases[r], preload, dirs[r],
                              {"OMP_NUM_THREADS": "1", **(env or {})}) for r in (0, 1)}
    try:
        results = {r: _forked_results(procs[r], dirs[r], len(modes), timeout) for r in (0, 1)}
    finally:                        # one rank failed: the other may wait for it in a collective
        for proc in procs.values():
            _stop_driver(proc)
    for r in (0, 1):
        for m, res in zip(modes, results[r]):
            assert res.returncode == 0, f"rank {r}, {m}: {res.stdout[-2000:]}{res.stderr[-3000:]}"
    return {m: [json.loads(o.read_text()) for o in outs[m]] for m in modes}


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
