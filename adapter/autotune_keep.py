"""autotune_keep (`DSV41_AUTOTUNE_KEEP=1`): keep the tuned FlashInfer tactics across boots.

Stock 0.5.23 (runner/flashinfer_autotune.py) has every TP rank hash the file it would load and
drops the cache on all ranks when the hashes differ. Each rank keeps its own file
(rank_tp{r}_pp{p}_dp{d}.json), and under expert parallelism those files always differ, so every
boot re-tunes and the tactics drift from boot to boot.

This adapter wraps three engine callables (rows in adapter/table.py):

* `_autotune_cache_digest(cache_path, env)`: the digest the ranks compare becomes a hash of
  (loadable, stamp, env): whether this rank's cache is one the engine can load for this launch,
  the FlashInfer `_metadata` stamp inside it, and the environment stamp passed in by the engine.
  The per-rank tactics themselves are no longer part of it.
* `_drop_diverged_autotune_cache(cache_path, group, env)`: before the engine's own all_gather,
  each rank reconciles its cache with the launch sidecar `<cache>.launch` and deletes a cache
  that is stale (another launch), corrupt, stamped for another environment, or without a valid
  sidecar, with a receipt line naming why. Then the stock helper exchanges the (wrapped) digests
  and unlinks the cache on every rank when any rank differs: either every rank loads its own
  file, or every rank tunes from scratch.
* `flashinfer_autotune_context(model_runner, *, run_lm_head)`: with a single TP rank the engine
  never calls the drop helper, so the context hook reconciles there; after the engine's context
  has saved the cache it seals the sidecar with the sha256 of the saved file, so a cache written
  by a boot without this adapter (rollback and back) is not taken for this launch's.

The launch fingerprint is sha256 over the launch arguments (sys.argv[1:], which the engine's
spawned scheduler processes inherit from the launcher) and every environment variable whose name
starts with SGLANG_ / DSV41_ / SPARK_ / B12X_ / NCCL_, minus the volatile keys of the key registry
(adapter/keys.py: every DSV41 v2.6.4 key, and per-boot ids such as SGLANG_RUN_ID). Launch
arguments are never volatile.

Rank agreement: what each rank reads here (argv, env, its files) is rank-local, but nothing is
decided on it alone: a rank whose cache is not loadable says so in its digest, and the stock
all_gather turns any difference into "every rank tunes".
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Mapping, Optional, Sequence

from adapter import keys, receipts

NAME = "autotune_keep"
ENGINE_MODULE = "sglang.srt.model_executor.runner.flashinfer_autotune"
ENV_PREFIXES = ("SGLANG_", "DSV41_", "SPARK_", "B12X_", "NCCL_")
SIDECAR_SUFFIX = ".launch"
SIDECAR_FORMAT = "dsv41.autotune_keep.launch/1"

# Keys FlashInfer 0.7.2's save_configs() writes beside the tactic entries (load_configs() pops
# them before reading the entries).
_META_KEY = "_metadata"
_RECORDS_KEY = "_records"
_GENERATION_KEY = "_generation"

# Counter keys in receipts.counters["autotune_keep"] (series: adapter/metrics.py KEYS).
COUNTERS = {
    "kept": "autotune caches kept: loadable on every rank",
    "deleted:": "caches deleted before the rank exchange, by kind",
    "tune:": "ranks that tuned with no cache on disk, by reason",
    "dropped:": "caches dropped because another rank could not load its own",
    "sealed": "launch sidecars sealed after the engine saved its cache",
}
_WILDCARD = "*"


# --- launch fingerprint -------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Launch:
    args: tuple[str, ...]          # launch arguments (argv[1:])
    env: tuple[tuple[str, str], ...]   # fingerprinted env items, sorted by name

    @property
    def fingerprint(self) -> str:
        payload = {"args": list(self.args), "env": dict(self.env)}
        return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()


def launch(argv: Optional[Sequence[str]] = None,
           environ: Optional[Mapping[str, str]] = None) -> Launch:
    """This process's launch: its arguments and its non-volatile engine/package env keys."""
    argv = sys.argv if argv is None else argv
    environ = os.environ if environ is None else environ
    volatile = set(keys.volatile_keys())
    env = tuple(sorted((k, v) for k, v in environ.items()
                       if k.startswith(ENV_PREFIXES) and k not in volatile))
    return Launch(tuple(argv[1:]), env)


def _short(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _launch_record(current: Launch) -> dict:
    # Values are stored as short hashes (argv may carry an --api-key); flag names stay readable
    # so a mismatch can name what changed.
    return {"format": SIDECAR_FORMAT, "fingerprint": current.fingerprint,
            "args": [a if a.startswith("-") else _short(a) for a in current.args],
            "env": {k: _short(v) for k, v in current.env}}


def _changed(record: dict, current: Launch) -> list[str]:
    """Names of what differs between a sidecar record and this launch (best effort)."""
    out = []
    old_env, new_env = record.get("env") or {}, _launch_record(current)["env"]
    if isinstance(old_env, dict):
        out += [k for k in sorted(set(old_env) | set(new_env)) if old_env.get(k) != new_env.get(k)]
    old_args, new_args = record.get("args") or [], _launch_record(current)["args"]
    if old_args != new_args:
        flags = set()
        for seq_a, seq_b in ((old_args, new_args), (new_args, old_args)):
            flag = "argv"
            for i, tok in enumerate(seq_a):
                if isinstance(tok, str) and tok.startswith("-"):
                    flag = tok
                if i >= len(seq_b) or seq_b[i] != tok:
                    flags.add(flag)
        out += sorted(flags) or ["argv"]
    return out


# --- the files -----------------------------------------------------------------------------

def sidecar_path(cache_path) -> Path:
    cache_path = Path(cache_path)
    return cache_path.with_name(cache_path.name + SIDECAR_SUFFIX)


def _file_sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def read_sidecar(cache_path) -> tuple[Optional[dict], str]:
    """(record, problem): problem is "" for a valid record, else why there is none."""
    path = sidecar_path(cache_path)
    if not path.is_file():
        return None, "no launch sidecar"
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        return None, f"launch sidecar unreadable ({type(exc).__name__})"
    if (not isinstance(record, dict) or record.get("format") != SIDECAR_FORMAT
            or not isinstance(record.get("fingerprint"), str)):
        return None, "launch sidecar corrupt"
    return record, ""


def _write_json_atomic(path: Path, data: dict) -> None:
    fd, tmp = tempfile.mkstemp(dir=str(path.parent), prefix=".dsv41_", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=1, sort_keys=True)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def write_sidecar(cache_path, current: Launch, cache_sha: Optional[str] = None) -> None:
    record = _launch_record(current)
    record["cache_sha256"] = cache_sha
    _write_json_atomic(sidecar_path(cache_path), record)


def _stamp_mismatch(saved, env: Mapping[str, str]) -> list[str]:
    """Stamp keys on which load_configs() would reject the file (wildcard "*" matches)."""
    saved = saved if isinstance(saved, dict) else {}
    return sorted(k for k, v in env.items() if saved.get(k) not in (v, _WILDCARD))


@dataclasses.dataclass(frozen=True)
class Assessment:
    present: bool            # a cache file exists
    loadable: bool           # the engine can load it for this launch
    kind: str                # ok | missing | corrupt | no-sidecar | sidecar-corrupt | launch
                             # | sealed-mismatch | stamp
    problem: str = ""        # operator words for a cache that is not loadable
    stamp: Optional[dict] = None


def assess(cache_path, env: Mapping[str, str], current: Optional[Launch] = None) -> Assessment:
    """Is this rank's cache loadable for this launch? Reads only; never raises on bad files."""
    cache_path = Path(cache_path)
    current = launch() if current is None else current
    if not cache_path.is_file():
        return Assessment(False, False, "missing", "no cache")
    try:
        raw = cache_path.read_bytes()
        configs = json.loads(raw)
    except (OSError, ValueError) as exc:
        return Assessment(True, False, "corrupt", f"cache unreadable ({type(exc).__name__})")
    problem = _structure_problem(configs)
    if problem:
        return Assessment(True, False, "corrupt", f"cache corrupt ({problem})")
    record, side_problem = read_sidecar(cache_path)
    if record is None:
        kind = "no-sidecar" if side_problem == "no launch sidecar" else "sidecar-corrupt"
        return Assessment(True, False, kind, side_problem)
    if record["fingerprint"] != current.fingerprint:
        what = ", ".join(_changed(record, current)) or "fingerprint"
        return Assessment(True, False, "launch", f"launch changed ({what})")
    sealed = record.get("cache_sha256")
    if sealed is not None and sealed != hashlib.sha256(raw).hexdigest():
        return Assessment(True, False, "sealed-mismatch",
                          "cache rewritten since this launch sealed it (a boot without keep?)")
    stamp = configs.get(_META_KEY)
    bad = _stamp_mismatch(stamp, env) if stamp is not None else []
    if bad:
        return Assessment(True, False, "stamp", f"stamped for another environment ({', '.join(bad)})")
    return Assessment(True, True, "ok", "", stamp)


def _structure_problem(configs) -> str:
    """What would make FlashInfer's load_configs() raise on this JSON ("" when nothing)."""
    if not isinstance(configs, dict):
        return "not a JSON object"
    if configs.get(_META_KEY) is not None and not isinstance(configs[_META_KEY], dict):
        return f"{_META_KEY} is not an object"
    if _RECORDS_KEY in configs and not isinstance(configs[_RECORDS_KEY], dict):
        return f"{_RECORDS_KEY} is not an object"
    for key, value in configs.items():
        if key in (_META_KEY, _RECORDS_KEY, _GENERATION_KEY):
            continue
        if not (isinstance(value, list) and len(value) >= 2 and isinstance(value[0], str)):
            return f"entry {key[:60]!r} is not [runner, tactic, ...]"
    return ""


def agreement_digest(a: Assessment, env: Mapping[str, str]) -> str:
    """What the ranks compare: loadable, stamp, env. Not the per-rank tactics."""
    payload = {"loadable": a.loadable, "stamp": a.stamp if a.loadable else None, "env": dict(env)}
    return hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()


def _delete(path: Path) -> bool:
    try:
        path.unlink(missing_ok=True)
        return True
    except OSError as exc:
        receipts.fallback(NAME, f"could not delete {path.name}: {type(exc).__name__}")
        return False


def reconcile(cache_path, env: Mapping[str, str], current: Optional[Launch] = None) -> Assessment:
    """Rank-local: delete a cache that is not loadable for this launch; record the launch.

    After this, the cache on disk is either loadable for this launch or gone, and the sidecar
    names this launch (unsealed until the engine's context has saved the tuned file).
    """
    cache_path = Path(cache_path)
    current = launch() if current is None else current
    a = assess(cache_path, env, current)
    counters = receipts.counters[NAME]
    if a.present and not a.loadable:
        _delete(cache_path)
        counters[f"deleted:{a.kind}"] += 1
        receipts.line(NAME, "deleted %s: %s; re-tuning", cache_path.name, a.problem)
    elif not a.present:
        counters["tune:no-cache"] += 1
        receipts.line(NAME, "no cache %s: tuning", cache_path.name)
    record, _ = read_sidecar(cache_path)
    if record is None or record["fingerprint"] != current.fingerprint or not a.loadable:
        try:
            write_sidecar(cache_path, current)
        except OSError as exc:
            receipts.fallback(NAME, f"could not write {sidecar_path(cache_path).name}: "
                                    f"{type(exc).__name__}")
    return a


def seal(cache_path, current: Optional[Launch] = None) -> bool:
    """After the engine saved the cache: bind the sidecar to the saved file's sha256."""
    cache_path = Path(cache_path)
    current = launch() if current is None else current
    if not cache_path.is_file():
        return False
    write_sidecar(cache_path, current, _file_sha(cache_path))
    return True


# --- hooks -----------------------------------------------------------------------------------

def _digest_hook(original, cache_path, env, *args, **kwargs):
    try:
        return agreement_digest(assess(Path(cache_path), env or {}), env or {})
    except Exception as exc:  # never leave a rank out of the exchange with a raise
        receipts.fallback(NAME, f"digest failed ({type(exc).__name__}); treating cache as unloadable")
        _delete(Path(cache_path))
        return agreement_digest(Assessment(False, False, "error"), env or {})


def _drop_hook(original, cache_path, group, env, *args, **kwargs):
    path = Path(cache_path)
    try:
        a = reconcile(path, env or {})
    except Exception as exc:
        receipts.fallback(NAME, f"reconcile failed ({type(exc).__name__}); cache deleted")
        _delete(path)
        a = Assessment(False, False, "error")
    # The stock exchange: all_gather of the (wrapped) digests, unlink on every rank on a difference.
    result = original(cache_path, group, env, *args, **kwargs)
    counters = receipts.counters[NAME]
    if path.is_file():
        counters["kept"] += 1
        receipts.line(NAME, "kept %s (%s tactics): loadable on every rank, sidecar matches "
                      "this launch", path.name, _entry_count(path))
    elif a.loadable:
        counters["dropped:peer"] += 1
        receipts.line(NAME, "dropped %s: another rank cannot load its cache; every rank re-tunes",
                      path.name)
    return result


def _entry_count(path: Path) -> str:
    try:
        data = json.loads(path.read_text())
        return str(sum(1 for k in data if k not in (_META_KEY, _RECORDS_KEY, _GENERATION_KEY)))
    except (OSError, ValueError, TypeError):
        return "?"


def _current_stamp() -> dict:
    from flashinfer.autotuner import _collect_metadata  # what the engine passes as env

    return _collect_metadata()


def _context_hook(original, model_runner, *args, **kwargs):
    cache_path = None
    try:
        mod = sys.modules[ENGINE_MODULE]
        if mod.envs.SGLANG_FLASHINFER_AUTOTUNE_CACHE.get():
            cache_path = Path(mod.flashinfer_autotune_cache_path(model_runner))
            if mod._autotune_tactic_sync_group(mod.get_parallel().tp_group) is None:
                # Single rank: the engine skips the drop helper; reconcile here.
                reconcile(cache_path, _current_stamp())
    except Exception as exc:
        receipts.fallback(NAME, f"single-rank check skipped ({type(exc).__name__}: {exc})")
    inner = original(model_runner, *args, **kwargs)
    if cache_path is None:
        return inner
    return _Sealing(inner, cache_path)


class _Sealing:
    """The engine's context manager, plus: seal the sidecar once it has saved the cache."""

    def __init__(self, inner, cache_path: Path):
        self._inner, self._path = inner, cache_path

    def __enter__(self):
        return self._inner.__enter__()

    def __exit__(self, *exc_info):
        suppress = self._inner.__exit__(*exc_info)
        if exc_info[0] is None or suppress:
            try:
                if seal(self._path):
                    receipts.counters[NAME]["sealed"] += 1
            except OSError as exc:
                receipts.fallback(NAME, f"could not seal {sidecar_path(self._path).name}: "
                                        f"{type(exc).__name__}")
        return suppress


def install(ctx) -> str:
    ctx.around("_autotune_cache_digest", _digest_hook)
    ctx.around("_drop_diverged_autotune_cache", _drop_hook)
    ctx.around("flashinfer_autotune_context", _context_hook)
    volatile = keys.volatile_keys()
    return (f"DSV41_AUTOTUNE_KEEP={ctx.value('DSV41_AUTOTUNE_KEEP')}: ranks compare "
            f"(loadable, stamp, env); sidecar <cache>{SIDECAR_SUFFIX} = sha256(argv + "
            f"{'/'.join(p.rstrip('_') for p in ENV_PREFIXES)} env minus {len(volatile)} "
            f"volatile keys)")
