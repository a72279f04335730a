"""The images' test step (scripts/image_test.sh): the unit suite only, against the image's own
interpreter, with the test tools it lacks pinned as in requirements/cpu.lock and kept out of the
image; .ci/run runs the same step, then the README's test command on the e2e servers only."""
import os
import re
import shutil

import pytest

from conftest import REPO_ROOT, lock_pins


def test_test_tools_are_pinned_as_in_the_cpu_lock():
    tools, cpu = lock_pins("requirements/test-tools.lock"), lock_pins("requirements/cpu.lock")
    assert {"pytest", "pytest-timeout", "hypothesis", "matplotlib"} <= set(tools)
    assert {name: cpu.get(name) for name in tools} == tools


def test_image_test_runs_the_unit_suite_without_e2e_and_keeps_no_tools():
    script = (REPO_ROOT / "scripts/image_test.sh").read_text()
    assert re.search(r'pytest --timeout \d+ -q -p no:cacheprovider -n "\$\{DSV41_TEST_WORKERS:-2\}" '
                     r'--dist loadfile tests --ignore=tests/e2e "\$@"', script)
    assert "--no-deps --target \"$tools\"" in script and "trap 'rm -rf \"$tools\"' EXIT" in script
    assert "lint_dockerfiles" not in script                     # hadolint is CI's (scripts/test.sh)


def test_ci_runs_the_image_step_then_the_e2e_servers_once():
    ci = (REPO_ROOT / ".ci/run").read_text()
    steps = [ln.split("#")[0].strip() for ln in ci.splitlines()
             if "scripts/" in ln and not ln.lstrip().startswith("#")]
    first = lambda text: next(i for i, s in enumerate(steps) if s.startswith(text))  # noqa: E731
    assert first("scripts/image_test.sh") < first("DSV41_TESTS=e2e scripts/test.sh")
    assert first("scripts/wheel_check.sh") < first("DSV41_TESTS=e2e scripts/test.sh")


def _fake_python(tmp_path, fail_on=""):
    """A PYTHON for scripts/test.sh that records each pytest run's arguments (one line per run)
    and fails the one whose arguments contain `fail_on`."""
    calls = tmp_path / "calls.txt"
    fake = tmp_path / "python"
    fake.write_text("#!/usr/bin/env bash\n"
                    f'echo "$*" >> "{calls}"\n'
                    f'if [ -n "{fail_on}" ] && [[ "$*" == *"{fail_on}"* ]]; then exit 3; fi\n')
    fake.chmod(0o755)
    return fake, calls


@pytest.mark.parametrize("which,fail_on,runs,ok", [
    ("e2e", "", ["e2e"], True),
    ("unit", "", ["unit"], True),
    ("all", "", ["unit", "e2e"], True),
    ("all", "--ignore=tests/e2e", ["unit", "e2e"], False),     # a unit failure fails the command
    ("all", "no:cacheprovider tests/e2e", ["unit", "e2e"], False),   # and so does an e2e one
])
def test_the_test_command_runs_the_parts_asked_and_fails_when_either_fails(tmp_path, which, fail_on, runs, ok):
    """scripts/test.sh: DSV41_TESTS=e2e (.ci/run, after the image step) runs the e2e part only;
    the default runs the unit suite beside the e2e servers and fails if either part fails."""
    import subprocess

    if not (REPO_ROOT / ".venv/bin/hadolint").exists() and shutil.which("hadolint") is None:
        pytest.skip("hadolint not installed (requirements/cpu.lock)")
    fake, calls = _fake_python(tmp_path, fail_on)
    env = dict(os.environ, PYTHON=str(fake), DSV41_TESTS=which, TMPDIR=str(tmp_path))
    res = subprocess.run(["scripts/test.sh", "-x"], cwd=REPO_ROOT, env=env, capture_output=True, text=True,
                         timeout=120)
    assert (res.returncode == 0) == ok, res.stdout + res.stderr
    seen = calls.read_text().splitlines()
    kinds = sorted("unit" if "--ignore=tests/e2e" in c else "e2e" for c in seen)
    assert kinds == sorted(runs), seen
    assert all(c.endswith("-x") for c in seen)                  # extra arguments reach both runs
    assert not list(tmp_path.glob("dsv41-unit-*.log"))          # the held unit output is removed


def test_load_switch_starts_busy_processes_and_passes_the_rest_on(tmp_path):
    """scripts/test.sh --load N: N busy processes beside the suite; the arguments after it reach
    pytest, `--load N` does not."""
    import subprocess

    if not (REPO_ROOT / ".venv/bin/hadolint").exists() and shutil.which("hadolint") is None:
        pytest.skip("hadolint not installed (requirements/cpu.lock)")
    fake, calls = _fake_python(tmp_path)
    env = dict(os.environ, PYTHON=str(fake), DSV41_TESTS="unit", TMPDIR=str(tmp_path))
    res = subprocess.run(["scripts/test.sh", "--load", "3", "-x"], cwd=REPO_ROOT, env=env, capture_output=True,
                         text=True, timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "beside 3 busy processes" in res.stdout
    seen = calls.read_text().splitlines()
    busy = [c for c in seen if c == "-c while True: pass"]
    runs = [c for c in seen if "pytest" in c]
    assert len(busy) == 3 and len(runs) == 1, seen
    assert runs[0].endswith("-x") and "--load" not in runs[0]
