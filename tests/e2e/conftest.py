"""Session fixtures of the e2e tests: `boots` (tests/e2e/e2e_configs.py), one boot per
configuration; and the boot count, printed at the end of the session:
`e2e: N server boots, M s booting` (+ the short boots that test a refusal or a bad key).

Two servers at a time at most: the modules that boot servers of their own run first (OWN_BOOTS_
FIRST), one after the other, while a background lane boots the shared configurations that the
selected modules read (their SHARED_BOOTS), one after the other (Boots.prefetch), then the boots
of the modules that hand theirs to it (LANE_JOBS); the modules that only read shared runs come
last. A run on this machine leaves about one core idle with one server
at a time (17 CPU-min in a 20-min e2e run)."""
import time

import pytest

from adapter.cpu.server import CpuServer
from e2e.e2e_configs import SUMMARY_LINES, Boots

_BOOTS: list = []       # (server name, seconds, kind): kind "server" | "failing"
# Modules that boot their own servers, in the order they run (before every other module).
OWN_BOOTS_FIRST = ("test_e2e_gate", "test_e2e_faults", "test_e2e_fuzz", "test_e2e_guard_costs",
                   "test_e2e_guard_grammar", "test_e2e_seed", "test_e2e_tp2",
                   "test_e2e_calibrate", "test_e2e_server", "test_e2e_dsv4_swan_selfcheck")
# The order the lane boots shared configurations in (those some selected module reads).
LANE_ORDER = (("dense", "stock"), ("dense", "decode_yield"), ("dense", "production"),
              ("dense", "autotune_keep"), ("dsv41", "autotune_keep"), ("dsv41", "production"),
              ("dsv41", "cone_no_copy"), ("dsv41", "cone_no_mask"), ("dsv4", "stock"),
              ("dense", "stock_again"))


def pytest_collection_modifyitems(session, config, items):
    def rank(item):
        name = item.module.__name__.rsplit(".", 1)[-1]
        return OWN_BOOTS_FIRST.index(name) if name in OWN_BOOTS_FIRST else len(OWN_BOOTS_FIRST)

    items.sort(key=rank)            # stable: each module keeps its own order
    wanted = {tuple(b) for item in items for b in getattr(item.module, "SHARED_BOOTS", ())}
    unknown = wanted - set(LANE_ORDER)
    assert not unknown, f"SHARED_BOOTS not in conftest.LANE_ORDER: {sorted(unknown)}"
    config._dsv41_lane = [b for b in LANE_ORDER if b in wanted]
    # then the modules' own boots that may run in the lane (LANE_JOBS: {name: callable}), in the
    # main thread's order: the main thread runs one itself if the lane has not started it
    jobs = {}
    for item in items:
        jobs.update(getattr(item.module, "LANE_JOBS", {}))
    config._dsv41_jobs = list(jobs.items())


@pytest.fixture(scope="session", autouse=True)
def boots(request, tmp_path_factory, _count_boots):
    from adapter.cpu import models

    models.resolve_transformers_names()     # in this thread, before the lane's thread starts
    shared = Boots(tmp_path_factory.mktemp("e2e-boots"))
    shared.prefetch(getattr(request.config, "_dsv41_lane", ()))
    for name, fn in getattr(request.config, "_dsv41_jobs", ()):
        shared.submit_job(name, fn)
    yield shared
    shared.close()


@pytest.fixture(scope="session", autouse=True)
def _count_boots():
    real = CpuServer.start

    def start(self, *args, **kwargs):
        began, kind = time.monotonic(), "failing" if kwargs.get("expect_exit") else "server"
        try:
            return real(self, *args, **kwargs)
        except BaseException:
            kind = "failing"
            raise
        finally:
            _BOOTS.append((self.name or self.model, time.monotonic() - began, kind))

    CpuServer.start = start
    yield
    CpuServer.start = real


def pytest_terminal_summary(terminalreporter):
    for line in SUMMARY_LINES:
        terminalreporter.write_line(line)
    if not _BOOTS:
        return
    ok = [s for _, s, kind in _BOOTS if kind == "server"]
    failing = [s for _, s, kind in _BOOTS if kind == "failing"]
    terminalreporter.write_line(
        f"e2e: {len(ok)} server boots, {sum(ok):.0f} s booting"
        + (f" (+{len(failing)} boots that fail on purpose or failed, {sum(failing):.0f} s)" if failing else ""))
    terminalreporter.write_line("e2e boots: " + ", ".join(
        f"{name} {s:.0f}s" + (" (failing)" if kind == "failing" else "") for name, s, kind in _BOOTS))
