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
    # decode yield's words deleted together (the online key does nothing without the yield)
    assert "DSV41_DECODE_YIELD=" not in line and "DSV41_DECODE_YIELD_ONLINE" not in line
    assert "DSV41_SWA_THIN=1" in line
    # the one word's edit alone is still there
    assert changes["DSV41_SWA_CONE_TOKENS"]["rollback_key"] == (
        "delete DSV41_SWA_CONE_TOKENS=8192 from EXTRA_CONTAINER_ENV")


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


# --- one rollback per adapter (issue 51) ------------------------------------------------------

def _keys_json():
    proc = run_python(CLI, argv=("keys", "--json"))
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def _on_by_registry(rows, env, adapter):
    """Is `adapter` on under `env`, read from `dsv41 keys --json` alone: one of its on switches
    set to a value other than 0 / false / off (an unset switch takes its default)."""
    off = {"0", "false", "off", "no"}
    for r in rows:
        if r["adapter"] == adapter and r["enables"]:
            value = env.get(r["key"], None if r["default"] is None else str(r["default"]))
            if value is not None and value.strip().lower() not in off:
                return True
    return False


def _apply_rollback(tmp_path, group):
    """The shipped profile with the production line replaced by the group's rollback lines."""
    lines = []
    for ln in (REPO_ROOT / ".env.tp4.example").read_text().splitlines():
        if ln.startswith(f"{profile.ENV_VAR}="):
            ln = group["rollback_env_line"]
        elif ln.startswith(f"{profile.ARGS_VAR}="):
            ln = group["rollback_args_line"]
        lines.append(ln)
    path = tmp_path / f"rollback_{group['adapter']}.env"
    path.write_text("\n".join(lines) + "\n")
    return profile.load_line(path, "production")


def test_each_adapters_rollback_turns_that_adapter_off_and_no_other(tmp_path):
    from adapter import keys
    from adapter.table import ADAPTERS

    control, prod = profile.load_line(PROFILE, "control"), profile.load_line(PROFILE, "production")
    result = profile_diff.diff(control, prod)
    groups = {g["adapter"]: g for g in result["adapters"]}
    # the adapters the v2.6.4 line adds, one rollback each (autotune_keep is on both lines)
    assert set(groups) == set(ADAPTERS) - {"autotune_keep"}
    rows = _keys_json()
    for adapter, group in groups.items():
        line = _apply_rollback(tmp_path, group)
        settings = keys.parse_env(line.env)
        assert not settings.enabled(adapter), (adapter, group["rollback"])
        assert not _on_by_registry(rows, line.env, adapter), adapter
        # nothing of the adapter's is left on the line (an inert key is a rollback half done)
        assert not [k for k in line.env if keys.KEY_BY_NAME.get(k) and keys.KEY_BY_NAME[k].adapter == adapter]
        for other in ADAPTERS:              # every other adapter stays as the production line has it
            if other != adapter:
                assert settings.enabled(other) == keys.parse_env(prod.env).enabled(other), (adapter, other)
        # after the rollback the line no longer differs from control in anything of the adapter's
        assert adapter not in [g["adapter"] for g in profile_diff.diff(control, line)["adapters"]]
    # thin's rollback puts the tails back with it and re-tunes once; the others keep the tactics
    thin = _apply_rollback(tmp_path, groups["swa_thin"])
    assert thin.arg_value("--swa-prefix-tails") == "128"
    assert groups["swa_thin"]["args"] == ["--swa-prefix-tails"] and groups["swa_thin"]["retunes"]
    assert "re-tunes once" in groups["swa_thin"]["note"]
    assert not any(g["retunes"] for name, g in groups.items() if name != "swa_thin")
    assert groups["swa_cone"]["keys"] == ["DSV41_SWA_CONE_REPLAY", "DSV41_SWA_CONE_TOKENS"]
    assert groups["decode_yield"]["keys"] == ["DSV41_DECODE_YIELD", "DSV41_DECODE_YIELD_ONLINE"]


def test_deleting_cone_tokens_alone_leaves_cone_on():
    """Why cone's two keys go together: the per-key edit alone does nothing (8192 is the default)."""
    from adapter import keys

    prod = profile.load_line(PROFILE, "production")
    env = {k: v for k, v in prod.env.items() if k != "DSV41_SWA_CONE_TOKENS"}
    assert keys.parse_env(env).enabled("swa_cone")
    group = {g["adapter"]: g for g in profile_diff.diff(profile.load_line(PROFILE, "control"), prod)["adapters"]}
    assert "alone would leave swa_cone on (8192 is its default)" in group["swa_cone"]["together"]
    assert "does nothing without DSV41_DECODE_YIELD" in group["decode_yield"]["together"]


def test_text_report_groups_by_adapter_prints_no_none_and_the_env_line_once():
    proc = run_python(CLI, argv=("profile", "diff", "--profile", PROFILE, "--line", "production",
                                 "--against", "control"))
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "None" not in out
    assert out.count(f"{profile.ENV_VAR}=") == 1 and out.count(f"{profile.ARGS_VAR}=\"") == 1
    for adapter in ("swan", "decode_yield", "swa_thin", "swa_cone", "input_guard", "admin_guard"):
        assert f"\n{adapter}  (on in production, off in control)" in out
    assert out.count("  rollback: ") == 6
    assert ("rollback: delete DSV41_SWA_CONE_REPLAY=1 DSV41_SWA_CONE_TOKENS=8192 from "
            "EXTRA_CONTAINER_ENV") in out
    assert ("rollback: delete DSV41_SWA_THIN=1 from EXTRA_CONTAINER_ENV; set --swa-prefix-tails 128 "
            "in EXTRA_SGLANG_ARGS") in out
    assert "no image rebuild" in out


def test_json_keeps_its_fields_and_adds_the_groups():
    proc = run_python(CLI, argv=("profile", "diff", "--profile", PROFILE, "--json"))
    out = json.loads(proc.stdout)
    assert {"a", "b", "changes", "retunes", "fingerprint_a", "fingerprint_b", "adapters"} <= set(out)
    for c in out["changes"]:
        assert {"kind", "name", "a", "b", "volatile", "rollback", "rollback_line", "adapter"} <= set(c)
    for g in out["adapters"]:
        assert {"adapter", "keys", "args", "rollback", "rollback_env_line", "rollback_args_line",
                "retunes", "note", "restart"} <= set(g)


def test_a_launch_argument_of_no_adapter_is_its_own_group():
    prod = profile.load_line(PROFILE, "production")
    other = profile.Line("b", dict(prod.env, SGLANG_FOO="1"), (*prod.args, "--enable-metrics"))
    result = profile_diff.diff(prod, other)
    assert [g["adapter"] for g in result["adapters"]] == ["other"]
    assert result["adapters"][0]["rollback"] == ("delete SGLANG_FOO=1 from EXTRA_CONTAINER_ENV; "
                                                 "delete --enable-metrics from EXTRA_SGLANG_ARGS")


def test_a_bad_key_on_a_line_exits_2_naming_it(tmp_path):
    bad = tmp_path / "bad.env"
    bad.write_text('EXTRA_CONTAINER_ENV="DSV41_DECODE_YIELD=150"\nEXTRA_SGLANG_ARGS=""\n'
                   'EXTRA_CONTAINER_ENV_CONTROL=""\nEXTRA_SGLANG_ARGS_CONTROL=""\n')
    proc = run_python(CLI, argv=("profile", "diff", "--profile", str(bad)))
    assert proc.returncode == 2 and "DSV41_DECODE_YIELD=150: out of range 1..99" in proc.stderr, proc.stderr
