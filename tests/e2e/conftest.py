"""Session fixtures of the e2e tests: `boots` (tests/e2e/e2e_configs.py), one boot per
configuration; and the boot count, printed at the end of the session:
`e2e: N server boots, M s booting` (+ the short boots that test a refusal or a bad key)."""
import time

import pytest

from adapter.cpu.server import CpuServer
from e2e.e2e_configs import Boots

_BOOTS: list = []       # (server name, seconds, kind): kind "server" | "failing"


@pytest.fixture(scope="session")
def boots(tmp_path_factory):
    return Boots(tmp_path_factory.mktemp("e2e-boots"))


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
    if not _BOOTS:
        return
    ok = [s for _, s, kind in _BOOTS if kind == "server"]
    failing = [s for _, s, kind in _BOOTS if kind == "failing"]
    terminalreporter.write_line(
        f"e2e: {len(ok)} server boots, {sum(ok):.0f} s booting"
        + (f" (+{len(failing)} boots that fail on purpose or failed, {sum(failing):.0f} s)" if failing else ""))
    terminalreporter.write_line("e2e boots: " + ", ".join(
        f"{name} {s:.0f}s" + (" (failing)" if kind == "failing" else "") for name, s, kind in _BOOTS))
