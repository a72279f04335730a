"""`dsv41 profile diff` on the shipped profile."""
import json

from adapter.tools import profile, profile_diff
from conftest import REPO_ROOT, run_python

PROFILE = str(REPO_ROOT / ".env.tp4.example")


def _by_name(result):
    return {c["name"]: c for c in result["changes"]}


def test_control_to_production_lists_v264_keys_volatile_and_tails_as_retune():
    result = profile_diff.diff(profile.load_line(PROFILE, "control"), profile.load_line(PROFILE, "production"))
    changes = _by_name(result)
    assert set(changes) == {"DSV41_INPUT_GUARD", "DSV41_ADMIN_GUARD", "DSV41_SWA_NATIVE_DECODE", "DSV41_DECODE_YIELD",
                            "DSV41_DECODE_YIELD_ONLINE", "DSV41_SWA_THIN",
                            "DSV41_SWA_CONE_REPLAY", "DSV41_SWA_CONE_TOKENS", "--swa-prefix-tails"}
    assert all(changes[k]["volatile"] for k in changes if k.startswith("DSV41_"))
    assert not changes["--swa-prefix-tails"]["volatile"]
    assert result["retunes"]                       # the tails argument re-tunes once
    assert "--swa-prefix-tails 128" in changes["DSV41_SWA_THIN"]["rollback"]
    line = changes["DSV41_DECODE_YIELD"]["rollback_line"]
    # the word deleted (DSV41_DECODE_YIELD_ONLINE stays: without the yield it does nothing)
    assert "DSV41_DECODE_YIELD=" not in line and "DSV41_SWA_THIN=1" in line


def test_volatile_only_change_keeps_tactics():
    prod = profile.load_line(PROFILE, "production")
    env = {k: v for k, v in prod.env.items() if k != "DSV41_DECODE_YIELD"}
    result = profile_diff.diff(prod, profile.Line("b", env, prod.args))
    assert [c["name"] for c in result["changes"]] == ["DSV41_DECODE_YIELD"]
    assert not result["retunes"]


def test_non_volatile_env_change_retunes():
    prod = profile.load_line(PROFILE, "production")
    env = dict(prod.env, SGLANG_SM120_FLASHMLA_BACKEND="triton")
    assert profile_diff.diff(prod, profile.Line("b", env, prod.args))["retunes"]


CLI = "from adapter.tools.cli import main; raise SystemExit(main())"


def test_cli_json_on_the_shipped_file():
    proc = run_python(CLI, argv=("profile", "diff", "--profile", PROFILE, "--line", "production",
                                 "--against", "control", "--json"))
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["retunes"] is True and len(out["changes"]) == len(_by_name(profile_diff.diff(
        profile.load_line(PROFILE, "control"), profile.load_line(PROFILE, "production"))))


def test_a_missing_profile_file_exits_2_naming_it(tmp_path):
    missing = str(tmp_path / "nonexistent.env")
    for argv in (("--profile", missing), ("--profile", PROFILE, "--against-profile", missing)):
        proc = run_python(CLI, argv=("profile", "diff", *argv))
        assert proc.returncode == 2 and f"{missing}: no such profile file" in proc.stderr, proc.stderr
