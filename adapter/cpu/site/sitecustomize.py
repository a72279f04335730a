"""CPU harness sitecustomize: first on PYTHONPATH in every process of a CPU test server only.

Python imports a single `sitecustomize`, so this one arms what stands in for the GPU machine and
then runs the next sitecustomize on sys.path: the repo's own, exactly as production runs it.
  1. DSV41CPU_LOG_DIR set: this process writes its stdout/stderr to <dir>/<pid>.log (the harness
     names each pid's role from the engine's process titles).
  2. the torchvision and sgl_kernel stand-ins (adapter/cpu/cpu_engine.py);
  3. the torch_native SWA read-index fix, once its engine module imports (an engine bug in a
     backend production never uses: adapter/cpu/torch_native_swa_fix.py);
  4. DSV41CPU_DRIFT=<module>:<qualname> (tests only): that engine callable is altered on import,
     before our installer checks its pin;
  5. DSV41CPU_STEP_EXTRA_WORK=<factor> (tests only): after each batch the scheduler works that
     factor of the batch's CPU time, a planted speed regression for `dsv41 gate`
     (adapter/cpu/step_work.py);
  5a. DSV41CPU_GRAMMAR_STEP_MS=<ms> (tests only): each xgrammar GrammarMatcher.accept_token
     sleeps that long first, a planted slow grammar step for the input guard's step bound
     (adapter/cpu/grammar_step.py);
  5b. DSV41CPU_LOG_IDLE_PASSES=1 (tests only): the scheduler logs each idle pass after work, once
     the engine's idle checks ran (adapter/cpu/idle_passes.py);
  5c. DSV41CPU_DETERMINISTIC=1 (test boots only): the engine's --enable-deterministic-inference
     on CPU torch_native: torch_native registered through the engine's own deterministic backend
     hook, the CPU sgl_kernel murmur hash of its seeded sampler and its batch-invariant mode
     (Triton GPU kernels) stood in (adapter/cpu/deterministic.py);
  6. DSV41CPU_WATCH_IMPORTS=<module>[,<module>] (tests only): when one of them is imported, the
     process writes "[dsv41-cpu] imported <module> from <file>:<line>" (the importing frame);
  7. DSV41CPU_AUTOTUNE_AGREE=<dir> (tests only): each scheduler runs the engine's autotune cache
     agreement over its TP group once it is up (adapter/cpu/autotune_agree.py).
  8. DSV41CPU_DSV4=1 (model="dsv4"): the DeepSeek-V4 stand-ins for the GPU kernels, rebound in
     each engine module as it imports, the GB10 (SM120) platform, and the engine's CPU fp8-KV
     refusal lifted for the V4 pool only (adapter/cpu/dsv4/).
  8b. DSV41CPU_DSV41=1 (model="dsv41", beside DSV41CPU_DSV4=1): the stand-ins for the kernels
     only the DeepSeek-V4.1 forward reaches (fp4 index-K store, compressed-KV store, fp4 index
     decode logits), rebound as their engine modules import (adapter/cpu/dsv41/).
  9. DSV41CPU_FREE_MEMORY_MB=<MB> / DSV41CPU_DSV4_CAP_SIZING=1 (benches only): a fixed KV budget
     for the engine's own pool sizing, and its cap-mode SWA sizing on the tiny V4 model
     (adapter/cpu/pool_budget.py).
Failures end the process loudly: `site` would swallow them.
"""
import os
import sys


def _redirect_output(log_dir):
    fd = os.open(os.path.join(log_dir, f"{os.getpid()}.log"), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)


def _arm():
    if os.environ.get("DSV41CPU_LOG_DIR"):
        _redirect_output(os.environ["DSV41CPU_LOG_DIR"])
    from adapter.cpu import cpu_engine, torch_native_swa_fix

    cpu_engine.install_torchvision_shim()
    cpu_engine.install_sgl_kernel_stand_in()
    import wrapt

    wrapt.register_post_import_hook(lambda module: torch_native_swa_fix.apply(), torch_native_swa_fix.MODULE)
    if os.environ.get("DSV41CPU_DRIFT"):
        # Test of the refusal path: registered before ours, so the installer sees the drift.
        target, _, qualname = os.environ["DSV41CPU_DRIFT"].partition(":")

        def drift(module):
            sha = cpu_engine.drift_callable(module, qualname)
            sys.stderr.write(f"[dsv41-cpu] drifted {target}:{qualname} (sha256 {sha})\n")

        wrapt.register_post_import_hook(drift, target)
    if os.environ.get("DSV41CPU_STEP_EXTRA_WORK"):
        from adapter.cpu import step_work

        step_work.factor()          # a bad value ends the process here, not in the scheduler
        wrapt.register_post_import_hook(step_work.apply, step_work.MODULE)
    if os.environ.get("DSV41CPU_GRAMMAR_STEP_MS"):
        from adapter.cpu import grammar_step

        grammar_step.step_ms()      # a bad value ends the process here, not in the scheduler
        wrapt.register_post_import_hook(grammar_step.apply, grammar_step.MODULE)
    if os.environ.get("DSV41CPU_LOG_IDLE_PASSES") == "1":
        from adapter.cpu import idle_passes

        wrapt.register_post_import_hook(idle_passes.apply, idle_passes.MODULE)
    if os.environ.get("DSV41CPU_DETERMINISTIC") == "1":
        from adapter.cpu import deterministic

        deterministic.install()
    if os.environ.get("DSV41CPU_AUTOTUNE_AGREE"):
        from adapter.cpu import autotune_agree

        wrapt.register_post_import_hook(autotune_agree.apply, autotune_agree.MODULE)
    if os.environ.get("DSV41CPU_DSV4") == "1":
        from adapter.cpu import dsv4

        dsv4.install()
    if os.environ.get("DSV41CPU_DSV41") == "1":
        from adapter.cpu import dsv41

        dsv41.install()
    if os.environ.get("DSV41CPU_FREE_MEMORY_MB") or os.environ.get("DSV41CPU_DSV4_CAP_SIZING") == "1":
        from adapter.cpu import pool_budget

        if os.environ.get(pool_budget.FREE_MEMORY_ENV):
            pool_budget.free_memory_bytes()     # a bad value ends the process here
            wrapt.register_post_import_hook(pool_budget.apply_free_memory, pool_budget.MEMORY_MODULE)
        if os.environ.get(pool_budget.CAP_SIZING_ENV) == "1":
            wrapt.register_post_import_hook(pool_budget.apply_cap_sizing, pool_budget.OVERRIDE_MODULE)
    for name in filter(None, os.environ.get("DSV41CPU_WATCH_IMPORTS", "").split(",")):
        wrapt.register_post_import_hook(_report_import, name)


def _report_import(module):
    import traceback

    machinery = ("importlib", "<frozen", "wrapt", os.path.abspath(__file__))
    frames = [f for f in traceback.extract_stack()[:-1] if not any(m in f.filename for m in machinery)]
    where = f"{frames[-1].filename}:{frames[-1].lineno}" if frames else "?"
    sys.stderr.write(f"[dsv41-cpu] imported {module.__name__} from {where}\n")


def _chain():
    here = os.path.dirname(os.path.abspath(__file__))
    for entry in sys.path:
        path = os.path.join(entry or os.getcwd(), "sitecustomize.py")
        if os.path.abspath(entry or os.getcwd()) != here and os.path.isfile(path):
            import importlib.util

            spec = importlib.util.spec_from_file_location("_dsv41_next_sitecustomize", path)
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            return


try:
    _arm()
except BaseException:  # noqa: BLE001 - site would print one line and carry on
    import traceback

    traceback.print_exc()
    sys.stderr.write("[dsv41-cpu] FATAL: the CPU harness sitecustomize failed (traceback above)\n")
    sys.stderr.flush()
    os._exit(2)
_chain()
