"""adapter/metrics.py: receipts' counters as dsv41_* series, settled from the engine's config.

Each scenario runs in a child interpreter (metrics settles once per process, and
prometheus_client picks its value class at its first import) on the engine's real
runtime_context: `publish(ServerArgs(...), role=..., ranks=SpawnRanks(world_rank=3))` at TP 4, as
the engine's processes publish. The model directory holds a config.json only: publish resolves
the arguments (it reads the model's config), it loads no weights.
tests/e2e/test_e2e_metrics.py runs the whole engine with --enable-metrics.
"""
import importlib
import json

from conftest import REPO_ROOT, run_python

from adapter import metrics
from adapter.table import ADAPTERS

ENGINE = r"""
import os, sys
from adapter.cpu import cpu_engine
cpu_engine.install_torchvision_shim()
from adapter import installer, metrics, pins, receipts
if os.environ.get("TEST_DRIFT_PUBLISH") == "1":
    # a planted drift: runtime_context.publish is no longer the pinned engine function
    import sglang.srt.runtime_context as rc_drift
    engine_publish = rc_drift.publish
    def publish(server_args, *, role, **kwargs):
        return engine_publish(server_args, role=role, **kwargs)
    rc_drift.publish = publish
metrics.arm()
import sglang.srt.runtime_context as rc
from sglang.srt.server_args import ServerArgs
for name in ("swa_thin", "decode_yield"):
    installer._state.adapters[name] = installer.AdapterState("installed")
installer._state.adapters["swan"] = installer.AdapterState("off")

def publish(role):
    args = ServerArgs(model_path=os.environ["TEST_MODEL_DIR"], device="cpu", tp_size=4,
                      enable_metrics=os.environ["TEST_ENABLE_METRICS"] == "1")
    rc.publish(args, role=role, ranks=rc.SpawnRanks(world_rank=3))
    assert rc.get_parallel().tp_rank == 3 and rc.publish_role() == role

def scrape():
    from prometheus_client import CollectorRegistry, generate_latest, multiprocess
    registry = CollectorRegistry()
    multiprocess.MultiProcessCollector(registry)
    return generate_latest(registry).decode()
"""


TINY_CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
               "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2,
               "intermediate_size": 128, "vocab_size": 1024, "max_position_embeddings": 2048}


def _env(tmp_path, enable, **extra):
    """The child's env: the multiprocess directory (empty) and a model directory beside it."""
    prom, model = tmp_path / "prom", tmp_path / "model"
    prom.mkdir(exist_ok=True)
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text(json.dumps(TINY_CONFIG))
    return {"PROMETHEUS_MULTIPROC_DIR": str(prom), "TEST_MODEL_DIR": str(model),
            "TEST_ENABLE_METRICS": enable, **extra}


def _child(body, tmp_path, enable):
    proc = run_python(ENGINE + body, env=_env(tmp_path, enable))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


ON_CHILD = r"""
c = receipts.counters["swa_thin"]
c["hooked_inserts"] += 2                 # before the engine published its config
assert "prometheus_client" not in sys.modules and metrics._state is None and not receipts._sinks
publish("scheduler")       # settles: on; adds what was counted before
c["nodes_moved"] += 5
c["kept:locked"] += 1
receipts.fallback("swa_thin", "reason A")
receipts.fallback("swa_thin", "reason A")
receipts.counters["decode_yield"]["steps_deferred"] += 4
print(scrape())
"""


def test_on_exports_every_count_once_with_the_catch_up(tmp_path):
    out = _child(ON_CHILD, tmp_path, "1").stdout
    series = {ln.rsplit(" ", 1)[0]: float(ln.rsplit(" ", 1)[1]) for ln in out.splitlines()
              if ln.startswith("dsv41_")}
    assert series['dsv41_swa_thin_hooked_inserts_total{tp_rank="3"}'] == 2
    assert series['dsv41_swa_thin_nodes_moved_total{tp_rank="3"}'] == 5
    assert series['dsv41_swa_thin_kept_total{reason="locked",tp_rank="3"}'] == 1
    assert series['dsv41_fallbacks_total{adapter="swa_thin",reason="reason A",tp_rank="3"}'] == 2
    assert series['dsv41_decode_yield_steps_run_total{tp_rank="3"}'] == 4
    # plain series of installed adapters exist at 0; off adapters have none, only the gauge at 0
    assert series['dsv41_swa_thin_checkpoints_passed_total{tp_rank="3"}'] == 0
    assert series['dsv41_decode_yield_chunks_yielded_total{tp_rank="3"}'] == 0
    assert not any(k.startswith("dsv41_swan_served") for k in series)
    assert series['dsv41_adapter_installed{adapter="swa_thin",version="2.6.4"}'] == 1
    assert series['dsv41_adapter_installed{adapter="swan",version="2.6.4"}'] == 0


OFF_CHILD = r"""
publish(sys.argv[1])
c = receipts.counters["swa_thin"]
c["nodes_moved"] += 5
receipts.fallback("swa_thin", "reason A")
c["nodes_moved"] += 1
print("IMPORTED", "prometheus_client" in sys.modules, "STATE", metrics._state,
      "SINKS", len(receipts._sinks), "COUNT", c["nodes_moved"])
"""


def test_off_imports_nothing_writes_nothing_and_keeps_counting(tmp_path):
    """The flag decides, not the directory: PROMETHEUS_MULTIPROC_DIR is set, enable_metrics is not."""
    proc = run_python(ENGINE + OFF_CHILD, argv=("scheduler",), env=_env(tmp_path, "0"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "IMPORTED False STATE False SINKS 0 COUNT 6" in proc.stdout
    assert list((tmp_path / "prom").iterdir()) == []
    # the child's receipt lines reach stderr (this one is the child's own fallback) ...
    assert "[dsv41] swa_thin fallback: reason A" in proc.stderr, proc.stderr[-3000:]
    # ... and metrics wrote none: settled off quietly
    assert "[dsv41] metrics" not in proc.stderr


def test_a_process_where_no_installed_adapter_counts_stays_off_quietly(tmp_path):
    """--enable-metrics on, but the detokenizer publishes: none of our adapters counts there."""
    proc = run_python(ENGINE + OFF_CHILD, argv=("detokenizer",), env=_env(tmp_path, "1"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "IMPORTED False STATE False SINKS 0 COUNT 6" in proc.stdout
    assert list((tmp_path / "prom").iterdir()) == []
    assert "[dsv41] swa_thin fallback: reason A" in proc.stderr, proc.stderr[-3000:]
    assert "[dsv41] metrics" not in proc.stderr


def test_a_drifted_publish_turns_exporting_off(tmp_path):
    """A publish that is not the pinned engine function (planted): exporting never starts."""
    proc = run_python(ENGINE + OFF_CHILD, argv=("scheduler",),
                      env=_env(tmp_path, "1", TEST_DRIFT_PUBLISH="1"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "IMPORTED False STATE False SINKS 0" in proc.stdout
    lines = [ln for ln in proc.stderr.splitlines() if "[dsv41] metrics fallback:" in ln]
    assert len(lines) == 1 and "sglang.srt.runtime_context:publish" in lines[0], proc.stderr


ERROR_CHILD = r"""
publish("scheduler")
c = receipts.counters["swa_thin"]
c["nodes_moved"] += 1
c["no such key"] += 1                     # no series: dropped, one fallback line
c["no such key"] += 1
c["nodes_moved"] += 1
print("COUNTS", c["no such key"], c["nodes_moved"])
print(scrape())
"""


def test_an_exporter_error_is_one_fallback_line_and_the_counter_dropped(tmp_path):
    proc = _child(ERROR_CHILD, tmp_path, "1")
    assert "COUNTS 2 2" in proc.stdout
    lines = [ln for ln in proc.stderr.splitlines() if "[dsv41] metrics fallback:" in ln]
    assert len(lines) == 1 and "'no such key' dropped from /metrics (LookupError" in lines[0], proc.stderr
    scraped = [ln for ln in proc.stdout.splitlines() if ln.startswith("dsv41_")]
    assert 'dsv41_swa_thin_nodes_moved_total{tp_rank="3"} 2.0' in scraped
    # the dropped key has no series; the exporter's own fallback is counted like any other
    [named] = [ln for ln in scraped if "no such key" in ln]
    assert named.startswith('dsv41_fallbacks_total{adapter="metrics",reason="swa_thin counter ')
    assert named.endswith(" 1.0")


START_FAIL_CHILD = r"""
import builtins
real_import = builtins.__import__
def broken(name, *a, **k):
    if name == "prometheus_client":
        raise ImportError("planted")
    return real_import(name, *a, **k)
builtins.__import__ = broken
publish("scheduler")
c = receipts.counters["swa_thin"]
c["nodes_moved"] += 1
c["nodes_moved"] += 1
print("STATE", metrics._state, "COUNT", c["nodes_moved"])
"""


def test_a_failed_start_is_one_fallback_line_and_serving_goes_on(tmp_path):
    proc = _child(START_FAIL_CHILD, tmp_path, "1")
    assert "STATE False COUNT 2" in proc.stdout
    lines = [ln for ln in proc.stderr.splitlines() if "[dsv41] metrics fallback:" in ln]
    assert len(lines) == 1 and "exporter failed to start (ImportError: planted)" in lines[0]


def test_every_declared_counter_key_has_a_series_and_every_series_key_is_declared():
    """Each adapter declares its counter keys (module-level COUNTERS); metrics maps exactly those."""
    for adapter in ADAPTERS:
        declared = set(importlib.import_module(f"adapter.{adapter}").COUNTERS)
        assert declared == set(metrics.KEYS.get(adapter, {})), adapter
        for key in declared:
            name, values = metrics.series_of(adapter, key + ("x" if key.endswith(":") else ""))
            assert name in metrics.SERIES and len(values) == len(metrics.SERIES[name][1]), (adapter, key)
    assert metrics.series_of("swan", "fallback:why") == ("dsv41_fallbacks", ("swan", "why"))


def test_the_docs_list_every_series():
    doc = (REPO_ROOT / "docs" / "metrics.md").read_text()
    for name in list(metrics.SERIES) + [metrics.INSTALLED]:
        shown = name if name == metrics.INSTALLED else f"{name}_total"
        assert f"`{shown}" in doc, shown
