"""autotune_keep on the pinned engine's real autotune helpers, several ranks on CPU.

Every boot forks one process per rank; the ranks join a gloo group on a loopback port and run the
engine's own `_drop_diverged_autotune_cache` (stock, or wrapped through the production installer),
then load their per-rank file or "tune". Faked, and only this: FlashInfer's tuning + save_configs
(a small function writing a per-rank cache file in FlashInfer's layout, entries differing by rank
as under expert parallelism) and FlashInfer's env stamp (a fixed dict); both need a GPU.
See adapter/tools/sims/autotune_keep.py.
"""
import json
import types

import pytest

from adapter.tools.sims import autotune_keep as sim
from adapter.tools.sims.autotune_keep import BASE_ARGS, BASE_ENV, Boot


@pytest.fixture(scope="module")
def engine():
    sim.prepare_engine()
    import sys

    return sys.modules[sim.ENGINE_MODULE]


def _run(keep, boots, world, tmp_path):
    with sim.installed(keep):
        runs = sim.run_boots(boots, world, tmp_path / ("keep" if keep else "stock"))
    for ranks in runs:
        for r in ranks:
            assert "error" not in r, r
            assert len(set(r["all_actions"])) == 1, f"ranks disagree: {r['all_actions']}"
    return runs


def _actions(ranks):
    return [r["action"] for r in ranks]


def _lines(ranks):
    return [" | ".join(r["lines"]) for r in ranks]


def test_default_sequence_stock_drops_every_boot_keep_only_on_the_launch_arg(engine, tmp_path):
    boots = sim.default_boots()
    stock = _run(False, boots, 4, tmp_path)
    keep = _run(True, boots, 4, tmp_path)

    # Expert parallelism: the per-rank files differ after the first boot.
    files = [p.read_text() for p in sorted((tmp_path / "stock").glob("rank_tp*_pp0_dp0.json"))]
    assert len(files) == 4 and len(set(files)) == 4

    assert [_actions(b) for b in stock] == [["tune"] * 4] * 4           # stock drops every boot
    assert [_actions(b) for b in keep] == [["tune"] * 4, ["load"] * 4, ["load"] * 4, ["tune"] * 4]
    # relaunch and volatile toggle reuse exactly the first boot's tactics on every rank
    assert keep[1] and all(keep[i][r]["tactics"] == keep[0][r]["tactics"]
                           for i in (1, 2) for r in range(4))
    # stock's re-tunes drift (boot-dependent timing noise in the fake tuner)
    assert any(stock[1][r]["tactics"] != stock[0][r]["tactics"] for r in range(4))
    # the launch-arg change is named on every rank
    assert all("launch changed (--swa-prefix-tails)" in ln for ln in _lines(keep[3])), _lines(keep[3])
    assert all("kept rank_tp" in ln for ln in _lines(keep[1]))

    summary = {"stock": sim.summarize(boots, stock), "keep": sim.summarize(boots, keep)}
    assert summary["stock"]["dropped_boots"] == 3
    assert summary["keep"]["dropped_boots"] == 1
    assert [b["dropped"] for b in summary["keep"]["per_boot"]] == [False, False, False, True]


def test_non_volatile_key_or_launch_arg_change_retunes_every_rank(engine, tmp_path):
    args = list(BASE_ARGS) + ["--kv-cache-dtype", "fp8_e4m3"]
    boots = [Boot("first"),
             Boot("per-boot id only", env={**BASE_ENV, "SGLANG_RUN_ID": "run-9"}),
             Boot("non-volatile engine key", env={**BASE_ENV, "SGLANG_SM120_FLASHMLA_BACKEND": "cutlass"}),
             Boot("new NCCL key", env={**BASE_ENV, "SGLANG_SM120_FLASHMLA_BACKEND": "cutlass",
                                       "NCCL_ALGO": "Ring"}),
             Boot("volatile DSV41 keys off", env={**BASE_ENV, "SGLANG_SM120_FLASHMLA_BACKEND": "cutlass",
                                                  "NCCL_ALGO": "Ring", "DSV41_SWA_NATIVE_DECODE": "0",
                                                  "DSV41_DECODE_YIELD": "50"}),
             Boot("added launch arg", args=tuple(args),
                  env={**BASE_ENV, "SGLANG_SM120_FLASHMLA_BACKEND": "cutlass", "NCCL_ALGO": "Ring"})]
    runs = _run(True, boots, 2, tmp_path)
    assert [_actions(b) for b in runs] == [["tune"] * 2, ["load"] * 2, ["tune"] * 2, ["tune"] * 2,
                                           ["load"] * 2, ["tune"] * 2]
    assert all("launch changed (SGLANG_SM120_FLASHMLA_BACKEND)" in ln for ln in _lines(runs[2]))
    assert all("launch changed (NCCL_ALGO)" in ln for ln in _lines(runs[3]))
    assert all("launch changed (--kv-cache-dtype)" in ln for ln in _lines(runs[5]))
    # a deleted cache was re-tuned and written again on every rank
    assert all((tmp_path / "keep" / f"rank_tp{r}_pp0_dp0.json").is_file() for r in range(2))


DAMAGE = [  # (rank, damage before the boot, words on that rank's receipt line)
    (1, "cache-json", "cache unreadable (JSONDecodeError)"),
    (2, "cache-entry", "cache corrupt (entry"),
    (0, "sidecar-json", "launch sidecar unreadable"),
    (1, "sidecar-delete", "no launch sidecar"),
    (2, "cache-delete", "no cache"),
]


def test_one_damaged_rank_makes_every_rank_retune_alike(engine, tmp_path):
    boots = [Boot("first")] + [Boot(f"rank {r}: {d}", damage={r: d}) for r, d, _ in DAMAGE] \
        + [Boot("relaunch")]
    runs = _run(True, boots, 3, tmp_path)
    # No rank loads while another tunes: the damaged rank's peers drop theirs too; no crash.
    assert [_actions(b) for b in runs] == [["tune"] * 3] * (1 + len(DAMAGE)) + [["load"] * 3]
    for (rank, damage, words), ranks in zip(DAMAGE, runs[1:]):
        assert words in " | ".join(ranks[rank]["lines"]), (damage, ranks[rank]["lines"])
        for peer in (r for r in ranks if r["rank"] != rank):
            assert "another rank cannot load its cache; every rank re-tunes" in \
                " | ".join(peer["lines"]), (damage, peer["lines"])


def test_stock_with_one_corrupt_rank_also_drops_all(engine, tmp_path):
    # Ground truth for the comparison: stock never loads while another rank tunes either.
    boots = [Boot("first"), Boot("relaunch, rank 0 corrupt", damage={0: "cache-json"})]
    runs = _run(False, boots, 2, tmp_path)
    assert [_actions(b) for b in runs] == [["tune"] * 2, ["tune"] * 2]


def test_digest_is_of_loadability_not_of_the_per_rank_file(engine, install_adapters, tmp_path):
    from adapter import autotune_keep as keep

    paths = [tmp_path / f"rank_tp{r}_pp0_dp0.json" for r in range(2)]
    for r, p in enumerate(paths):
        sim._fake_tune(p, r, 0, sim.STAMP)
    assert paths[0].read_text() != paths[1].read_text()
    stock = [engine._autotune_cache_digest(p, sim.STAMP) for p in paths]
    assert stock[0] != stock[1] and "" not in stock

    state = install_adapters({"DSV41_AUTOTUNE_KEEP": "1"})["autotune_keep"]
    assert (state.status, state.pin_ok) == ("installed", True), state.detail
    # the count the line states, counted from the key registry's definition (each key marked
    # volatile, and the per-boot identifiers outside our prefix), and each of them left out of
    # the launch a sidecar records, where an engine key is not
    from adapter import keys

    volatile = {k.name for k in keys.KEYS if k.volatile} | set(keys.EXTRA_VOLATILE)
    assert f"{len(volatile)} volatile keys" in state.detail, state.detail
    recorded = dict(keep.launch(["x"], {**{name: "1" for name in volatile}, "SGLANG_X": "1"}).env)
    assert recorded == {"SGLANG_X": "1"}
    for p in paths:
        keep.write_sidecar(p, keep.launch())
    wrapped = [engine._autotune_cache_digest(p, sim.STAMP) for p in paths]
    assert wrapped[0] == wrapped[1]
    # ... but it still sees a stamp for another environment or a missing sidecar
    assert engine._autotune_cache_digest(paths[0], {**sim.STAMP, "gpu": "NVIDIA H200"}) != \
        engine._autotune_cache_digest(paths[1], sim.STAMP)
    keep.sidecar_path(paths[1]).unlink()
    assert engine._autotune_cache_digest(paths[1], sim.STAMP) != wrapped[0]


def test_single_rank_context_reconciles_and_seals(engine, install_adapters, tmp_path, monkeypatch):
    """TP=1: the engine skips the drop helper; the context hook reconciles and seals.

    The engine's context itself needs CUDA; here `original` stands in for it (load if present,
    else tune + save). The engine's own _autotune_tactic_sync_group and envs decide single-rank.
    """
    import contextlib

    from adapter import autotune_keep as keep

    state = install_adapters({"DSV41_AUTOTUNE_KEEP": "1"})["autotune_keep"]
    assert state.status == "installed", state.detail
    path = tmp_path / "rank_tp0_pp0_dp0.json"
    monkeypatch.setattr(engine, "flashinfer_autotune_cache_path", lambda mr: path)
    monkeypatch.setattr(engine, "get_parallel",
                        lambda: types.SimpleNamespace(tp_group=types.SimpleNamespace(world_size=1)))
    monkeypatch.setattr(keep, "_current_stamp", lambda: dict(sim.STAMP))
    monkeypatch.setattr("sys.argv", ["sglang.launch_server", *BASE_ARGS])
    events = []

    @contextlib.contextmanager
    def engine_context(mr, *, run_lm_head):
        events.append("load" if path.is_file() else "tune")
        yield
        if events[-1] == "tune":
            sim._fake_tune(path, 0, len(events), sim.STAMP)

    def boot():
        with keep._context_hook(engine_context, object(), run_lm_head=False):
            pass

    boot()
    sealed = json.loads(keep.sidecar_path(path).read_text())["cache_sha256"]
    assert sealed == keep._file_sha(path)
    boot()
    assert events == ["tune", "load"]
    # A boot without keep (rollback) rewrites the cache; keep must not take it for its own.
    sim._fake_tune(path, 0, 99, sim.STAMP)
    boot()
    assert events[-1] == "tune"
    path.write_text("{truncated")
    boot()                           # corrupt cache on a single rank: deleted, re-tuned, no crash
    assert events[-1] == "tune" and json.loads(path.read_text())["_metadata"] == sim.STAMP
    counters = keep.receipts.counters["autotune_keep"]
    assert counters["deleted:sealed-mismatch"] >= 1 and counters["deleted:corrupt"] >= 1
