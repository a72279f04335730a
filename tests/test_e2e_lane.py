"""The e2e session's background boot lane (tests/e2e/e2e_configs.py Boots): each configuration
runs once, in the lane or in the test's thread, never in both; a test waits for the lane's run of
a configuration it needs. canary.run_config is replaced by a recorder (no server here)."""
import threading

from adapter.tools import canary
from e2e import e2e_configs
from e2e.e2e_configs import Boots


def _recorder(monkeypatch, hold=None):
    """hold: (name, event): that run blocks until the event is set."""
    calls = []

    def run_config(model, keys, args, *, name="", **kw):
        calls.append((name, threading.current_thread().name))
        if hold and name == hold[0]:
            assert hold[1].wait(30)
        return canary.ConfigRun(model, dict(keys), dict(args))

    monkeypatch.setattr(canary, "run_config", run_config)
    return calls


def test_prefetched_configurations_run_once_in_the_lane_and_tests_wait_for_them(monkeypatch, tmp_path):
    release = threading.Event()
    calls = _recorder(monkeypatch, hold=("dense stock", release))
    boots = Boots(tmp_path)
    boots.prefetch([("dense", "stock"), ("dense", "production")])
    threading.Timer(0.2, release.set).start()
    first = boots.config("dense", "stock")           # waits for the lane's run
    assert boots.config("dense", "stock") is first
    assert boots.config("dense", "production") is boots.config("dense", "production")
    boots.close()
    assert sorted(n for n, _ in calls) == ["dense production", "dense stock"]
    assert all(t.startswith("e2e-boot-lane") for _, t in calls), calls


def test_a_queued_configuration_the_lane_has_not_started_runs_in_the_tests_thread(monkeypatch, tmp_path):
    release = threading.Event()
    calls = _recorder(monkeypatch, hold=("dense stock", release))
    boots = Boots(tmp_path)
    boots.prefetch([("dense", "stock"), ("dsv4", "stock")])
    boots.config("dsv4", "stock")                     # queued behind a held one: run here
    release.set()
    boots.close()
    threads = dict(calls)
    assert threads["dsv4 stock"] == threading.current_thread().name
    assert threads["dense stock"].startswith("e2e-boot-lane")
    assert len(calls) == 2


def test_jobs_run_once_and_their_result_is_shared(monkeypatch, tmp_path):
    _recorder(monkeypatch)
    runs = []
    boots = Boots(tmp_path)

    def job():
        runs.append(threading.current_thread().name)
        return {"one": 1}

    boots.submit_job("selfcheck", job)
    assert boots.job("selfcheck", job) == {"one": 1} and boots.job("selfcheck", job) == {"one": 1}
    boots.close()
    assert len(runs) == 1


def test_the_suites_lane_lists_every_shared_configuration_a_module_reads():
    import importlib
    import pathlib

    from e2e import conftest

    for path in sorted(pathlib.Path(e2e_configs.__file__).parent.glob("test_e2e_*.py")):
        mod = importlib.import_module(f"e2e.{path.stem}")
        for b in getattr(mod, "SHARED_BOOTS", ()):
            assert tuple(b) in conftest.LANE_ORDER, (path.name, b)


def test_two_threads_taking_a_queued_configuration_share_one_run(monkeypatch, tmp_path):
    """The lane is busy with a held run; two test threads ask for a configuration queued behind
    it at once: one cancels the lane's future and runs it, the other waits for that run."""
    release, inside = threading.Event(), threading.Event()
    calls = []

    def run_config(model, keys, args, *, name="", **kw):
        calls.append(name)
        if name == "dense stock":
            assert release.wait(30)
        if name == "dsv4 stock":
            inside.set()
            assert release.wait(30)          # still running when the second thread asks
        return canary.ConfigRun(model, dict(keys), dict(args))

    monkeypatch.setattr(canary, "run_config", run_config)
    boots = Boots(tmp_path)
    boots.prefetch([("dense", "stock"), ("dsv4", "stock")])
    got = []
    first = threading.Thread(target=lambda: got.append(boots.config("dsv4", "stock")))
    first.start()
    assert inside.wait(30)
    second = threading.Thread(target=lambda: got.append(boots.config("dsv4", "stock")))
    second.start()
    release.set()
    first.join(30)
    second.join(30)
    boots.close()
    assert calls.count("dsv4 stock") == 1, calls
    assert len(got) == 2 and got[0] is got[1]
