"""One install of input_guard per test module, for the input guard's tests (tests/test_input_guard*.py).

Why the install is shared: installing the guard with the production installer and undoing it is
what these tests' fixtures spent their CPU on, not the engine objects they build. Each install
and each undo runs the engine's HookRegistry._propagate_patch for every callable the guard wraps
(17), and each of those walks every loaded module's namespace: ~0.8 s of CPU to install, ~0.7 s
to undo, against ~0.05 s for a TokenizerManager and ~0.03 s for the app's lifespan (measured
here). So the guard is installed once per test module (`guard_install_of_the_module`, module
scope) and every test still builds its own engine objects on it (tests/test_input_guard.py's
`manager` and `app_client`: the real TokenizerManager, the real app's lifespan).

What a test can change in the shared install is put back before each test, as a fresh install
has it (`input_guard_installed`, function scope):
- the counters (receipts.counters["input_guard"]) and the logged-once fallback reasons:
  receipts.forget, before and after the test;
- the guard's logged-once rejection reasons (a rejection's first line is logged, later ones only
  counted): emptied;
- the guard's limits: the install's own put back (a TokenizerManager's __init__ resolves the
  text bound on them, a test sets a bound with monkeypatch);
- the grammar compile share (each client's pending grammar requests, the grammars answered):
  emptied.
The rest of the install is fixed when it is made (the wraps on the engine's classes) or is read
only by the engine's scheduler (the grammar step bound's layout), which no test runs on this
install: the grammar-bound tests install with their own keys.

A test that installs with keys of its own (conftest's `install_adapters`) undoes this install
when it starts and ends; the next test that needs the guard finds it gone (the installer's status
or the guard's registration is another object) and installs it again. Tests stay independent of
their order: a test only ever sees this install live and reset, or a fresh one.
"""
import pytest

from adapter import input_guard, installer, receipts

KEYS = {"DSV41_INPUT_GUARD": "1"}


class SharedGuardInstall:
    """The guard installed with KEYS by the production installer (report mode, as conftest's
    `install_adapters` runs it), kept across the tests of one module."""

    def __init__(self):
        self.state = None           # the installer's AdapterState of this install
        self.guard = None           # input_guard's Guard of this install (its hooks close over it)
        self.share = None           # its grammar compile share
        self.limits = None          # its limits as installed (no text bound resolved yet)

    def live(self) -> bool:
        """This install is the one in effect: no install or reset has run since it was made."""
        return (self.state is not None
                and installer.status().get("input_guard") is self.state
                and input_guard.hooks.INSTALLED.get("guard") is self.guard
                and input_guard.hooks.INSTALLED.get("grammar_share") is self.share)

    def install(self) -> None:
        status = installer.install_in_process(KEYS)        # undoes any earlier install first
        assert status["input_guard"].status == "installed", status["input_guard"]
        self.state = status["input_guard"]
        self.guard = input_guard.hooks.INSTALLED["guard"]
        self.share = input_guard.hooks.INSTALLED["grammar_share"]
        self.limits = self.guard.limits

    def reset(self):
        """The install as a fresh one has it (installed again if another test undid it); its Guard."""
        if not self.live():
            self.install()
        receipts.forget("input_guard")
        self.guard._logged.clear()
        self.guard.limits = self.limits
        self.share.pending.clear()
        self.share.answered.clear()
        return self.guard

    def undo(self) -> None:
        """As conftest's `install_adapters` leaves the process after a test."""
        installer.reset_for_tests()
        installer.set_mode("boot")


@pytest.fixture(scope="module")
def guard_install_of_the_module():
    """input_guard installed with KEYS once for this module's tests, undone after its last
    (see the module docstring); tests take `input_guard_installed`."""
    shared = SharedGuardInstall()
    try:
        yield shared
    finally:
        shared.undo()


@pytest.fixture
def input_guard_installed(guard_install_of_the_module):
    """The guard installed with KEYS and reset as a fresh install (the module's shared install);
    its Guard. Its counters are forgotten again after the test."""
    guard = guard_install_of_the_module.reset()
    yield guard
    receipts.forget("input_guard")
