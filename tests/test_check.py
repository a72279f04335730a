"""`dsv41 check` on the shipped production profile, in a child Python, as the image build runs it."""
import json

from conftest import REPO_ROOT, run_python

PROFILE = str(REPO_ROOT / ".env.tp4.example")
CLI = "from adapter.tools.cli import main; raise SystemExit(main())"


def test_production_line_installs_every_enabled_adapter_once():
    proc = run_python(CLI, argv=("check", "--profile", PROFILE, "--json"), timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    rows = {r["adapter"]: r for r in json.loads(proc.stdout)}
    assert set(rows) == {"swan", "decode_yield", "swa_thin", "swa_cone", "autotune_keep"}
    for name, row in rows.items():
        assert {"adapter", "keys", "pin_ok", "installed", "reason"} <= set(row)
        assert row["installed"] and row["pin_ok"], row
    assert rows["decode_yield"]["keys"] == {"DSV41_DECODE_YIELD": "33"}
    assert rows["swa_cone"]["keys"] == {"DSV41_SWA_CONE_REPLAY": "1", "DSV41_SWA_CONE_TOKENS": "8192"}


def test_control_line_installs_only_autotune_keep(tmp_path):
    proc = run_python(CLI, argv=("check", "--profile", PROFILE, "--line", "control", "--json"),
                      timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {r["adapter"]: r for r in json.loads(proc.stdout)}
    assert [n for n, r in rows.items() if r["installed"]] == ["autotune_keep"]
    assert all(not r["enabled"] for n, r in rows.items() if n != "autotune_keep")


def test_bad_key_fails_the_check_with_the_key_named(tmp_path):
    bad = tmp_path / "bad.env"
    bad.write_text('EXTRA_CONTAINER_ENV="DSV41_DECODE_YIELD=150 DSV41_SWA_THIN=1"\n'
                   'EXTRA_SGLANG_ARGS="--swa-prefix-tails 384"\n')
    proc = run_python(CLI, argv=("check", "--profile", str(bad)), timeout=600)
    assert proc.returncode == 1
    assert "DSV41_DECODE_YIELD=150: out of range 1..99" in proc.stdout + proc.stderr


def test_unknown_line_is_a_clear_error():
    proc = run_python(CLI, argv=("check", "--profile", PROFILE, "--line", "nosuch"))
    assert proc.returncode == 2 and "no line 'nosuch'" in proc.stderr
