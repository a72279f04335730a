"""Real servers: receipts per process, boot errors (bad key, drifted pin), T=0 equality with stock
on both models for each adapter and for the production line, and no process left behind."""
import pytest

from adapter import keys as key_registry
from adapter.cpu.server import BootError, CpuServer
from adapter.table import ADAPTERS
from adapter.tools import canary, traffic

from e2e.e2e_configs import ALONE, CONFIGS, MODELS, REFERENCE

# The session's shared runs this module reads (booted by conftest's lane ahead of it).
SHARED_BOOTS = [(m, c) for m in MODELS for c in (REFERENCE[m], "production", *ALONE[m])
                if c not in ("cone_no_copy", "cone_no_mask")]


@pytest.mark.parametrize("model", MODELS)
def test_production_line_installs_every_adapter_where_it_acts(boots, model):
    run = boots.config(model, "production")
    assert not run.errors, run.errors
    for adapter in ADAPTERS:
        installed = run.installed_in(adapter)
        # the scheduler for most; input_guard in the launcher's tokenizer manager (table.COUNTING_ROLE)
        assert installed.get(canary.install_process(adapter)), (adapter, installed, run.log_dir)
        # The detokenizer imports the tokenizer manager's module, where input_guard acts; since
        # input_guard also hooks the scheduler (exact aborts, grammar steps) and the installer
        # imports an adapter's modules together, the detokenizer now imports the scheduler's module
        # too and the scheduler-side adapters install there, where nothing calls them (noticed at
        # issue 41's merge; splitting input_guard's two sides would end it).
        if adapter == "input_guard" or run.keys.get("DSV41_INPUT_GUARD", "0") not in ("", "0"):
            continue
        assert not installed.get("detokenizer"), (adapter, installed)
    # The launcher imports the scheduler's modules too (not swan's SM120 kernel module).
    assert run.installed_in("decode_yield")["launcher"]
    assert run.installed_in("swa_thin")["launcher"]
    # One receipt per adapter per process that loads it: never twice (sitecustomize + plugin).
    for adapter in ADAPTERS:
        for role, text in run.logs.items():
            assert text.count(f"[dsv41] {adapter} installed:") <= 1, (adapter, role)


def test_two_stock_boots_are_identical(boots):
    """The weights are deterministic (written once as safetensors): T=0 ids and logprobs agree.
    One model: this is the noise floor the equality tolerance (1e-4) is set against; both models
    load their weights the same way (adapter/cpu/models.py)."""
    first = boots.config("dense", "stock")
    again = boots.config("dense", "stock_again")
    cmp = traffic.compare(first.records, again.records, tol=1e-5)
    assert cmp.ok and cmp.total == len(first.records) > 0, cmp


# Each model: the production line and the adapters booted alone there (e2e_configs.ALONE).
T0_CASES = [(m, c) for m in MODELS for c in ("production", *ALONE[m])
            if c not in ("cone_no_copy", "cone_no_mask", "stock_again", REFERENCE[m])]


@pytest.mark.parametrize("model, config", T0_CASES)
def test_t0_outputs_equal_stock(boots, model, config):
    stock = boots.config(model, REFERENCE[model])
    run = boots.config(model, config)
    assert not run.errors and not stock.errors, (run.errors, stock.errors)
    settings = key_registry.parse_env(CONFIGS[config][0])
    for adapter in ADAPTERS:
        if settings.enabled(adapter):
            assert run.installed_in(adapter).get(canary.install_process(adapter)), (adapter, run.log_dir)
    reference = canary.records_of(stock)
    cmp = canary.compare_runs(model, stock, run)       # the canary's references and tolerance
    assert cmp.ok, (config, model, cmp)
    names = {r.name for r in reference}
    assert {"chunked", "cache-hit", "resume", "concurrent-0"} <= names
    hits = {r.name: r.cached_tokens for r in stock.records}
    assert hits["cache-hit"] > 0 and hits["resume"] > 0    # the prompt set does hit the cache


@pytest.mark.parametrize("keys, needle", [
    ({"DSV41_DECODE_YIELD": "abc"}, "DSV41_DECODE_YIELD='abc'"),
    ({"DSV41_DECODE_YIELD": "33", "DSV41_DECODE_YIELD_MODEL": "20000,65000,277,0,3000,52000"},
     "DSV41_DECODE_YIELD_MODEL='20000,65000,277,0,3000,52000': STEP_FIXED_US=0 out of range"),
])
def test_bad_key_stops_the_real_boot_with_the_key_named(tmp_path, keys, needle):
    server = CpuServer("dense", keys=keys, name="bad-key", log_dir=tmp_path)
    server.start(timeout=120, expect_exit=True)
    assert server.returncode == 2
    text = server.log()
    assert needle in text and "FATAL: configuration error" in text
    assert server.group_alive() == []


def test_drifted_pin_stops_the_real_boot_naming_the_key(tmp_path):
    target = "sglang.srt.managers.scheduler:Scheduler._should_defer_prefill"
    server = CpuServer("dense", keys={"DSV41_DECODE_YIELD": "33"}, name="drift", log_dir=tmp_path,
                       extra_env={"DSV41CPU_DRIFT": target})
    server.start(timeout=180, expect_exit=True)
    text = server.log()
    assert server.returncode == 3, server.tail()
    assert "[dsv41-cpu] drifted " + target in text
    fatal = [ln for ln in text.splitlines() if "FATAL" in ln]
    assert fatal and "decode_yield refused to install" in fatal[0], fatal
    assert "does not match its pin" in fatal[0] and "Unset DSV41_DECODE_YIELD" in fatal[0]
    assert server.group_alive() == []


def test_a_boot_that_times_out_leaves_no_process(tmp_path, monkeypatch):
    """A boot that never turns healthy is stopped whole when its time is up. /health is made to
    answer 503 here (as while the engine loads), so the boot times out on any machine, a fast one
    too, and the group is stopped wherever its boot got to by then (launcher alone, or with the
    scheduler and detokenizer)."""
    import requests

    from adapter.cpu import server as server_module

    real_get = requests.get

    def loading(url, *args, **kwargs):
        if url.endswith("/health"):
            response = requests.Response()
            response.status_code = 503
            return response
        return real_get(url, *args, **kwargs)

    monkeypatch.setattr(server_module.requests, "get", loading)
    server = CpuServer("dense", name="timeout", log_dir=tmp_path)
    with pytest.raises(BootError, match="not healthy after 15s"):
        server.start(timeout=15)
    assert server.returncode is not None
    assert server.group_alive() == []
