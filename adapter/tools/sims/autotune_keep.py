"""`dsv41 sim autotune [--json] [--ranks N]`: multi-rank boots through the engine's real helpers.

Each boot forks one process per TP rank; the ranks join a torch.distributed gloo group on a free
loopback port and run the pinned engine's own `_drop_diverged_autotune_cache` (stock, or wrapped
by autotune_keep through the production installer) on their per-rank cache files, exactly as
`flashinfer_autotune_context` does before tuning. Then each rank does what the engine does next:
load its file if it is there, tune otherwise.

Faked, and only this: FlashInfer's autotuner (GPU only; adapter/cpu/flashinfer_cache.py). "Tuning" writes a per-rank cache file
in FlashInfer 0.7.2's save_configs() layout (`_metadata` stamp, [runner, tactic] entries,
`_generation`), with rank-specific entries as under expert parallelism and tactics that depend on
the boot (the timing noise that makes stock tactics drift); "loading" parses it as load_configs()
would. The environment stamp the engine would get from FlashInfer's `_collect_metadata()` is a
fixed dict. Also not the engine: the process group is gloo over loopback, not the TP CPU group.

The boot sequence: first boot, identical relaunch, volatile toggle (DSV41_SWA_THIN off and a new
SGLANG_RUN_ID), launch-argument change (--swa-prefix-tails 384 -> 128).
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import multiprocessing
import os
import pathlib
import socket
import sys
import tempfile
from typing import Optional

# The stand-in for FlashInfer's autotuner cache files lives with the CPU stand-ins (the CPU
# server's agreement rounds use it too: adapter/cpu/autotune_agree.py); named here for callers.
from adapter.cpu.flashinfer_cache import (SHAPES, STAMP, _damage, _fake_tune,  # noqa: F401
                                          _load_like_flashinfer, cache_file)

ENGINE_MODULE = "sglang.srt.model_executor.runner.flashinfer_autotune"

BASE_ARGS = ("--model-path", "/models/DeepSeek-V4.1-Flash", "--tp-size", "4", "--nnodes", "4",
             "--page-size", "256", "--chunked-prefill-size", "8192", "--dsv4-attn-backend",
             "flashmla", "--swa-prefix-tails", "384")
BASE_ENV = {"SGLANG_SM120_FLASHMLA_BACKEND": "flashinfer", "SGLANG_FLASHINFER_AUTOTUNE_CACHE": "1",
            "NCCL_SOCKET_IFNAME": "enp1s0f0np0", "NCCL_IB_HCA": "rocep1s0f0",
            "NCCL_IB_GID_INDEX": "3", "DSV41_SWA_NATIVE_DECODE": "1", "DSV41_DECODE_YIELD": "33",
            "DSV41_SWA_THIN": "1", "DSV41_SWA_CONE_REPLAY": "1", "DSV41_SWA_CONE_TOKENS": "8192",
            "SGLANG_RUN_ID": "run-1"}
_PREFIXES = ("SGLANG_", "DSV41_", "SPARK_", "B12X_", "NCCL_")


@dataclasses.dataclass
class Boot:
    label: str
    args: tuple = BASE_ARGS
    env: dict = dataclasses.field(default_factory=lambda: dict(BASE_ENV))
    # rank -> damage done to that rank's files before the boot:
    # cache-json | cache-entry | cache-delete | sidecar-json | sidecar-delete
    damage: dict = dataclasses.field(default_factory=dict)
    stamp: Optional[dict] = None       # env stamp for this boot (default STAMP)


def default_boots() -> list[Boot]:
    first = Boot("first boot")
    relaunch = Boot("identical relaunch")
    toggle = Boot("volatile toggle", env={**BASE_ENV, "DSV41_SWA_THIN": "0", "SGLANG_RUN_ID": "run-3"})
    args = list(BASE_ARGS)
    args[args.index("--swa-prefix-tails") + 1] = "128"
    launch_change = Boot("launch-arg change", args=tuple(args),
                         env={**BASE_ENV, "DSV41_SWA_THIN": "0", "SGLANG_RUN_ID": "run-4"})
    return [first, relaunch, toggle, launch_change]


# --- one rank of one boot (runs in a forked child) --------------------------------------------

def _rank_main(rank: int, world: int, port: int, boot: Boot, boot_index: int,
               workdir: str, result_dir: str) -> None:
    import logging
    from datetime import timedelta

    import torch.distributed as dist

    lines: list[str] = []

    class _Collect(logging.Handler):
        def emit(self, record):
            lines.append(record.getMessage())

    logging.getLogger("sglang.dsv41").addHandler(_Collect())
    result = {"rank": rank, "boot": boot.label}
    try:
        # The launch this rank runs under: argv and the container env.
        sys.argv = ["sglang.launch_server", *boot.args]
        for name in [n for n in os.environ if n.startswith(_PREFIXES)]:
            del os.environ[name]
        os.environ.update(boot.env)
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo")
        mod = sys.modules[ENGINE_MODULE]
        path = cache_file(pathlib.Path(workdir), rank)
        if rank in boot.damage and (path.exists() or boot.damage[rank].startswith("sidecar")):
            _damage(path, boot.damage[rank])
        result["had_cache"] = path.is_file()
        stamp = dict(boot.stamp or STAMP)
        dist.init_process_group("gloo", rank=rank, world_size=world,
                                timeout=timedelta(seconds=60))
        group = dist.new_group(list(range(world)), backend="gloo")
        # The engine's own helper (wrapped by autotune_keep when it is installed).
        mod._drop_diverged_autotune_cache(path, group, stamp)
        if path.is_file():
            result["action"] = "load"
            tactics = _load_like_flashinfer(path)   # raises on a corrupt file, as the engine does
        else:
            result["action"] = "tune"
            tactics = _fake_tune(path, rank, boot_index, stamp)
        result["tactics"] = {k: list(v) if isinstance(v, tuple) else v for k, v in tactics.items()}
        actions = [None] * world
        dist.all_gather_object(actions, result["action"], group=group)
        result["all_actions"] = actions
        dist.destroy_process_group()
    except BaseException as exc:  # reported, never swallowed: the parent fails the boot
        result["error"] = f"{type(exc).__name__}: {exc}"
    result["lines"] = lines
    pathlib.Path(result_dir, f"rank{rank}.json").write_text(json.dumps(result))


# --- the parent ------------------------------------------------------------------------------

def _free_port() -> int:
    with contextlib.closing(socket.socket()) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_boot(boot: Boot, boot_index: int, world: int, workdir: pathlib.Path,
             timeout: float = 90.0) -> list[dict]:
    ctx = multiprocessing.get_context("fork")
    with tempfile.TemporaryDirectory() as result_dir:
        port = _free_port()
        procs = [ctx.Process(target=_rank_main,
                             args=(r, world, port, boot, boot_index, str(workdir), result_dir))
                 for r in range(world)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout)
        results = []
        for r, p in enumerate(procs):
            if p.is_alive():
                p.kill()
                p.join()
            f = pathlib.Path(result_dir, f"rank{r}.json")
            results.append(json.loads(f.read_text()) if f.exists()
                           else {"rank": r, "boot": boot.label, "error": f"exit {p.exitcode}"})
    return results


def run_boots(boots: list[Boot], world: int, workdir) -> list[list[dict]]:
    """Run the boots in order on one cache directory; the adapters as installed right now."""
    workdir = pathlib.Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    return [run_boot(b, i, world, workdir) for i, b in enumerate(boots)]


def summarize(boots: list[Boot], runs: list[list[dict]]) -> dict:
    per_boot, previous = [], None
    for boot, ranks in zip(boots, runs):
        errors = [r.get("error") for r in ranks if r.get("error")]
        actions = [r.get("action") for r in ranks]
        dropped = any(r.get("had_cache") and r.get("action") == "tune" for r in ranks)
        tactics = [r.get("tactics") for r in ranks]
        outcome = ("DROPPED" if dropped else "tuned" if "tune" in actions else "kept")
        per_boot.append({"boot": boot.label, "outcome": outcome, "actions": actions,
                         "dropped": dropped,
                         "ranks_agree": len(set(actions)) == 1 and not errors,
                         "tactics_changed": previous is not None and tactics != previous,
                         "errors": errors})
        previous = tactics
    return {"dropped_boots": sum(b["dropped"] for b in per_boot),
            "dropped_on": [b["boot"] for b in per_boot if b["dropped"]],
            "retuned_rank_boots": sum(a == "tune" for b in per_boot for a in b["actions"]),
            "tactic_drift_boots": sum(b["tactics_changed"] for b in per_boot),
            "disagreeing_boots": sum(not b["ranks_agree"] for b in per_boot),
            "per_boot": per_boot}


def prepare_engine() -> None:
    """Import the pinned engine's autotune module (CPU: with the torchvision stand-in)."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from adapter.cpu import cpu_engine

    cpu_engine.install_torchvision_shim()
    __import__(ENGINE_MODULE)


@contextlib.contextmanager
def installed(keep: bool):
    """Stock (nothing installed) or autotune_keep through the production installer."""
    from adapter import installer

    try:
        state = installer.install_in_process({"DSV41_AUTOTUNE_KEEP": "1"} if keep else {})
        if keep and state["autotune_keep"].status != "installed":
            raise RuntimeError(f"autotune_keep did not install: {state['autotune_keep'].detail}")
        yield
    finally:
        installer.reset_for_tests()
        installer.set_mode("boot")


def simulate(world: int = 4, boots: Optional[list[Boot]] = None) -> dict:
    boots = default_boots() if boots is None else boots
    prepare_engine()
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        for mode in ("stock", "keep"):
            with installed(mode == "keep"):
                runs = run_boots(boots, world, pathlib.Path(tmp, mode))
            out[mode] = summarize(boots, runs)
    out["boots"] = len(boots)
    out["ranks"] = world
    out["sequence"] = [b.label for b in boots]
    out["faked"] = "FlashInfer tuning/save (writes per-rank cache files) and its env stamp"
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="dsv41 sim autotune", description=__doc__.split("\n\n")[0])
    p.add_argument("--json", action="store_true", help="print the result as one JSON object")
    p.add_argument("--ranks", type=int, default=4, choices=range(2, 9),
                   help="ranks of the simulated launch, 2..8 (default %(default)s)")
    args = p.parse_args(argv)
    result = simulate(args.ranks)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(f"{result['boots']} boots x {result['ranks']} ranks: {', '.join(result['sequence'])}")
        for mode in ("stock", "keep"):
            r = result[mode]
            print(f"{mode:5s}: dropped_boots={r['dropped_boots']} retuned_rank_boots="
                  f"{r['retuned_rank_boots']} tactic_drift_boots={r['tactic_drift_boots']} "
                  f"disagreeing_boots={r['disagreeing_boots']}")
            for b in r["per_boot"]:
                print(f"       {b['boot']:20s} {b['outcome']:8s} "
                      f"{','.join(str(a) for a in b['actions'])}{'  ' + '; '.join(b['errors']) if b['errors'] else ''}")
    ok = result["keep"]["disagreeing_boots"] == 0 and result["stock"]["disagreeing_boots"] == 0
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
