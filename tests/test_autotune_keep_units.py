"""autotune_keep without the engine: launch fingerprint, volatile keys, sidecar and cache checks."""
import contextlib
import io
import json

from hypothesis import given, settings, strategies as st

from adapter import autotune_keep as keep
from adapter import keys
from adapter.tools import cli

STAMP = {"flashinfer_version": "0.7.2", "cuda_version": "13.0", "gpu": "NVIDIA GB10"}
ARGV = ["launch_server", "--tp-size", "4", "--swa-prefix-tails", "384"]
ENV = {"SGLANG_SM120_FLASHMLA_BACKEND": "flashinfer", "NCCL_IB_HCA": "rocep1s0f0",
       "DSV41_SWA_THIN": "1", "SGLANG_RUN_ID": "a", "HOME": "/root"}


def _fp(argv=ARGV, env=ENV):
    return keep.launch(argv, env).fingerprint


def test_volatile_keys_are_every_v264_key_and_per_boot_ids_and_cli_lists_them():
    volatile = set(keys.volatile_keys())
    for name in ("DSV41_INPUT_GUARD", "DSV41_SWA_NATIVE_DECODE", "DSV41_DECODE_YIELD", "DSV41_SWA_THIN",
                 "DSV41_SWA_CONE_REPLAY", "DSV41_SWA_CONE_TOKENS", "SGLANG_RUN_ID"):
        assert name in volatile
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert cli.main(["keys", "--volatile", "--json"]) == 0
    assert json.loads(out.getvalue()) == list(keys.volatile_keys())


def test_fingerprint_covers_argv_and_prefixed_env_minus_volatile():
    base = _fp()
    for name in keys.volatile_keys():           # volatile: toggling changes nothing
        assert _fp(env={**ENV, name: "toggled"}) == base
        assert _fp(env={k: v for k, v in ENV.items() if k != name}) == base
    assert _fp(env={**ENV, "HOME": "/elsewhere", "CUDA_VISIBLE_DEVICES": "1"}) == base
    for name in ("SGLANG_SWA_EVICTION_INTERVAL", "DSV41_NOT_A_REGISTERED_KEY", "SPARK_X",
                 "B12X_TILE", "NCCL_ALGO"):
        assert _fp(env={**ENV, name: "1"}) != base, name
    assert _fp(argv=[*ARGV[:-1], "128"]) != base                  # launch args are never volatile
    assert _fp(argv=[*ARGV, "--dsv41-swa-thin"]) != base
    assert _fp(argv=["/other/argv0", *ARGV[1:]]) == base          # argv[0] is not an argument


_names = st.sampled_from(sorted(set(keys.volatile_keys()) | {
    "SGLANG_A", "DSV41_B", "SPARK_C", "B12X_D", "NCCL_E", "PATH", "OTHER"}))


@settings(max_examples=60, deadline=None)
@given(env=st.dictionaries(_names, st.text(max_size=4), max_size=8), name=_names,
       value=st.text(max_size=4))
def test_property_only_non_volatile_prefixed_keys_move_the_fingerprint(env, name, value):
    changed = {**env, name: value}
    moves = (name.startswith(keep.ENV_PREFIXES) and name not in keys.volatile_keys()
             and env.get(name) != value)
    assert (_fp(env=env) != _fp(env=changed)) == moves


def _cache(tmp_path, stamp=STAMP, entries=None):
    path = tmp_path / "rank_tp0_pp0_dp0.json"
    data = {"_metadata": stamp, **(entries or {"moe|1": ["Runner", [3, 1]]}), "_generation": "x"}
    path.write_text(json.dumps(data))
    return path


def test_assess_stamp_wildcard_and_legacy(tmp_path):
    current = keep.launch(ARGV, ENV)
    path = _cache(tmp_path)
    keep.write_sidecar(path, current)
    assert keep.assess(path, STAMP, current).loadable
    a = keep.assess(path, {**STAMP, "gpu": "NVIDIA H200"}, current)
    assert (a.loadable, a.kind) == (False, "stamp") and "gpu" in a.problem
    _cache(tmp_path, stamp={**STAMP, "gpu": "*"})
    assert keep.assess(path, {**STAMP, "gpu": "NVIDIA H200"}, current).loadable
    _cache(tmp_path, stamp=None)                     # no stamp: load_configs() takes it as is
    assert keep.assess(path, STAMP, current).loadable
    _cache(tmp_path, stamp="garbage")
    assert keep.assess(path, STAMP, current).kind == "corrupt"


def test_reconcile_deletes_stale_or_corrupt_and_records_this_launch(tmp_path):
    old, new = keep.launch(ARGV, ENV), keep.launch([*ARGV[:-1], "128"], ENV)
    path = _cache(tmp_path)
    keep.write_sidecar(path, old)
    a = keep.reconcile(path, STAMP, new)
    assert (a.kind, path.exists()) == ("launch", False)
    assert "--swa-prefix-tails" in a.problem
    record, problem = keep.read_sidecar(path)
    assert problem == "" and record["fingerprint"] == new.fingerprint
    assert record["cache_sha256"] is None                          # unsealed until saved

    path = _cache(tmp_path)
    keep.sidecar_path(path).write_text("[1, 2")
    assert keep.reconcile(path, STAMP, new).kind == "sidecar-corrupt" and not path.exists()
    assert keep.read_sidecar(path)[1] == ""                        # healed

    path = _cache(tmp_path)
    path.write_bytes(b"\xff\xfe")
    assert keep.reconcile(path, STAMP, new).kind == "corrupt" and not path.exists()

    path = _cache(tmp_path)                                        # sealed, then rewritten
    keep.seal(path, new)
    assert keep.reconcile(path, STAMP, new).loadable and path.exists()
    path.write_text(path.read_text().replace("[3, 1]", "[4, 1]"))
    assert keep.reconcile(path, STAMP, new).kind == "sealed-mismatch" and not path.exists()


def test_sidecar_keeps_flag_names_not_values(tmp_path):
    current = keep.launch([*ARGV, "--api-key", "s3cret-value"], {**ENV, "SGLANG_TOKEN": "t0ken"})
    path = _cache(tmp_path)
    keep.write_sidecar(path, current)
    text = keep.sidecar_path(path).read_text()
    assert "--api-key" in text and "SGLANG_TOKEN" in text
    assert "s3cret-value" not in text and "t0ken" not in text
