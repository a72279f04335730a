"""The shipped production profile, the canary Dockerfiles and .ci/run agree with each other."""
import argparse
import re

import pytest

from adapter import keys
from adapter.tools import profile
from adapter.table import ADAPTERS
from conftest import REPO_ROOT

PROFILE = REPO_ROOT / ".env.tp4.example"
V264 = ("DSV41_INPUT_GUARD=1", "DSV41_ADMIN_GUARD=1", "DSV41_SWA_NATIVE_DECODE=1",
        "DSV41_DECODE_YIELD=33", "DSV41_DECODE_YIELD_ONLINE=1", "DSV41_SWA_THIN=1", "DSV41_SWA_CONE_REPLAY=1",
        "DSV41_SWA_CONE_TOKENS=8192")
V264_KEYS = tuple(w.split("=")[0] for w in V264)


def _words(var):
    return profile.read_vars(PROFILE)[var].split()


def test_production_line_ends_with_the_v264_keys_in_order_each_once():
    words = _words(profile.ENV_VAR)
    assert tuple(words[-len(V264):]) == V264
    for key in V264_KEYS:
        assert sum(w.startswith(key + "=") for w in words) == 1


def test_v264_keys_only_on_the_production_line_and_test_switch_nowhere():
    for var, value in profile.read_vars(PROFILE).items():
        if var != profile.ENV_VAR:
            assert not any(k in value for k in V264_KEYS), var
        for key in (k.name for k in keys.KEYS if k.test_only):    # DSV41_SWA_CONE_TEST, ...
            assert key not in value, (var, key)


def test_every_line_parses_with_the_key_registry():
    for name in profile.line_names(PROFILE):
        line = profile.load_line(PROFILE, name)
        settings = keys.parse_env(line.env)
        assert settings.unknown == ()


def test_every_v264_key_is_volatile_for_autotune_keep():
    assert set(V264_KEYS) <= set(keys.volatile_keys())


def test_module_defaults_are_off():
    settings = keys.parse_env({})
    assert [a for a in ADAPTERS if settings.enabled(a)] == []
    for key in keys.KEYS:
        assert not (key.enables and key.default), key.name


def test_tails_384_once_on_production_and_128_on_control():
    prod = profile.load_line(PROFILE, "production")
    assert prod.arg_value("--swa-prefix-tails") == "384"
    assert sum(a == "--swa-prefix-tails" for a in prod.args) == 1
    assert sum(v.count("--swa-prefix-tails 384") for v in profile.read_vars(PROFILE).values()) == 1
    assert profile.load_line(PROFILE, "control").arg_value("--swa-prefix-tails") == "128"


@pytest.mark.parametrize("name", ["production", "control"])
def test_launch_args_are_real_flags_of_the_pinned_engine(name):
    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser(exit_on_error=False)
    ServerArgs.add_cli_args(parser)
    line = profile.load_line(PROFILE, name)
    ns = parser.parse_args(["--model-path", "/models/x", *line.args])
    assert ns.swa_prefix_tails == int(line.arg_value("--swa-prefix-tails"))
    assert ns.page_size == 256 and ns.chunked_prefill_size == 8192


def _run_steps(dockerfile):
    return re.findall(r"^RUN (.+)$", (REPO_ROOT / dockerfile).read_text(), re.M)


@pytest.mark.parametrize("dockerfile", ["Dockerfile.canary", "Dockerfile.canary-roce"])
def test_dockerfile_builds_verifies_checks_and_tests_with_scripts_ci_runs(dockerfile):
    steps = _run_steps(dockerfile)
    # .ci/run runs the install, the module build and the check through scripts/wheel_check.sh, in
    # a new venv with the wheel installed, as the images do
    ci = (REPO_ROOT / ".ci/run").read_text()
    assert "scripts/wheel_check.sh" in ci
    ci += (REPO_ROOT / "scripts/wheel_check.sh").read_text()
    assert steps, dockerfile
    for step in steps:
        assert re.fullmatch(r"scripts/[a-z_]+\.sh", step), step       # a script of ours ...
        assert (REPO_ROOT / step).exists(), step
    for step in steps:
        assert step in ci, step                                          # ... that CI runs too
    setup = (REPO_ROOT / "scripts/setup.sh").read_text()
    assert "scripts/build_swan.sh" in setup                              # setup (in CI) builds it
    for needed in ("scripts/build_swan.sh", "scripts/image_check.sh", "scripts/image_test.sh"):
        assert needed in steps, needed
    assert steps[-1] == "scripts/image_test.sh" and "scripts/test.sh" not in steps   # no e2e servers
    text = (REPO_ROOT / dockerfile).read_text()
    assert "SWAN_ARCHS=sm_121a" in text and "v0.5.23" in text
    # the wheel, installed, arms the line: no PYTHONPATH to the source copy, the module built into
    # the installed package
    assert not re.search(r"^ENV .*PYTHONPATH", text, re.M) and "SWAN_BUILD_INSTALLED=1" in text


def test_ci_runs_the_readme_commands():
    readme = (REPO_ROOT / "README.md").read_text()
    ci = (REPO_ROOT / ".ci/run").read_text()
    assert "scripts/setup.sh" in readme and "scripts/setup.sh" in ci
    assert "scripts/test.sh" in readme and "scripts/test.sh" in ci
