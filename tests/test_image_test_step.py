"""The images' test step (scripts/image_test.sh): the unit suite only, against the image's own
interpreter, with the test tools it lacks pinned as in requirements/cpu.lock and kept out of the
image; .ci/run runs the same step, then the README's test command on the e2e servers only."""
import re

from conftest import REPO_ROOT


def _pins(path):
    return dict(re.findall(r"^([A-Za-z0-9_.-]+)==(\S+)", (REPO_ROOT / path).read_text(), re.M))


def test_test_tools_are_pinned_as_in_the_cpu_lock():
    tools, cpu = _pins("requirements/test-tools.lock"), _pins("requirements/cpu.lock")
    assert {"pytest", "hypothesis", "matplotlib"} <= set(tools)
    assert {name: cpu.get(name) for name in tools} == tools


def test_image_test_runs_the_unit_suite_without_e2e_and_keeps_no_tools():
    script = (REPO_ROOT / "scripts/image_test.sh").read_text()
    assert re.search(r'pytest -q -p no:cacheprovider -n "\$\{DSV41_TEST_WORKERS:-2\}" tests '
                     r'--ignore=tests/e2e "\$@"', script)
    assert "--no-deps --target \"$tools\"" in script and "trap 'rm -rf \"$tools\"' EXIT" in script
    assert "lint_dockerfiles" not in script                     # hadolint is CI's (scripts/test.sh)


def test_ci_runs_the_image_step_then_the_e2e_servers_once():
    ci = (REPO_ROOT / ".ci/run").read_text()
    steps = [ln.split("#")[0].strip() for ln in ci.splitlines()
             if "scripts/" in ln and not ln.lstrip().startswith("#")]
    assert steps.index("scripts/image_test.sh") < steps.index("DSV41_TESTS=e2e scripts/test.sh")
    # scripts/test.sh: DSV41_TESTS=e2e skips the unit part, which otherwise runs before tests/e2e
    test_sh = (REPO_ROOT / "scripts/test.sh").read_text()
    unit = test_sh.index("--ignore=tests/e2e")
    assert 'if [ "${DSV41_TESTS:-all}" != "e2e" ]; then' in test_sh[:unit]
    assert test_sh.index("tests/e2e \"$@\"", unit) > unit
