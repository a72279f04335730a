"""`dsv41 check` on the shipped production profile, in a child Python, as the image build runs it."""
import json

import pytest

from conftest import REPO_ROOT, run_python

PROFILE = str(REPO_ROOT / ".env.tp4.example")
CLI = "from adapter.tools.cli import main; raise SystemExit(main())"


def test_production_line_installs_every_enabled_adapter_once():
    proc = run_python(CLI, argv=("check", "--profile", PROFILE, "--json"), timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    rows = {r["adapter"]: r for r in json.loads(proc.stdout)}
    assert set(rows) == {"swan", "decode_yield", "swa_thin", "swa_cone", "autotune_keep", "input_guard",
                         "admin_guard"}
    for name, row in rows.items():
        assert {"adapter", "keys", "pin_ok", "installed", "reason"} <= set(row)
        assert row["installed"] and row["pin_ok"], row
    assert rows["decode_yield"]["keys"] == {"DSV41_DECODE_YIELD": "33", "DSV41_DECODE_YIELD_ONLINE": "1"}
    assert rows["swa_cone"]["keys"] == {"DSV41_SWA_CONE_REPLAY": "1", "DSV41_SWA_CONE_TOKENS": "8192"}
    admin = rows["admin_guard"]["admin_exposure"]          # no key on the line: all closed by us
    assert admin["open"] == admin["keyed"] == 0 and admin["closed"] == len(admin["routes"]) >= 40
    # which kernel swan serves with: no CUDA in the child here, so the CPU twin, named in the
    # install receipt too (the module where CUDA is: tests/test_swan_twin.py)
    assert rows["swan"]["kernel"] == "CPU twin"
    assert "; kernel CPU twin (no CUDA in this process" in rows["swan"]["reason"]
    # issue 48: what the engine resolves for DeepSeek-V4.1 on the cluster, and each adapter's
    # verdict there: the decoder SWA bounded replay resolves on by the engine's own default, and
    # every enabled adapter of the line acts beside it (cone included)
    cluster = rows["swan"]["cluster"]
    assert cluster["model_type"] == "deepseek_v41" and cluster["platform"].startswith("CUDA")
    assert cluster["enable_decoder_swa_bounded_replay"] is True
    assert cluster["decoder_replay_set_on_line"] is False and "error" not in cluster
    assert all(row["on_cluster"]["acts"] for row in rows.values()), rows
    assert "decoder SWA bounded replay" in rows["swa_cone"]["on_cluster"]["why"]


def test_control_line_installs_only_autotune_keep(tmp_path):
    proc = run_python(CLI, argv=("check", "--profile", PROFILE, "--line", "control", "--json"),
                      timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {r["adapter"]: r for r in json.loads(proc.stdout)}
    assert [n for n, r in rows.items() if r["installed"]] == ["autotune_keep"]
    assert rows["swan"]["kernel"] is None
    assert all(not r["enabled"] for n, r in rows.items() if n != "autotune_keep")
    admin = rows["admin_guard"]["admin_exposure"]          # stock: every admin route open
    assert admin["open"] == len(admin["routes"]) >= 40 and admin["closed"] == admin["keyed"] == 0


def test_bad_key_fails_the_check_with_the_key_named(tmp_path):
    bad = tmp_path / "bad.env"
    bad.write_text('EXTRA_CONTAINER_ENV="DSV41_DECODE_YIELD=150 DSV41_SWA_THIN=1"\n'
                   'EXTRA_SGLANG_ARGS="--swa-prefix-tails 384"\n')
    proc = run_python(CLI, argv=("check", "--profile", str(bad)), timeout=600)
    assert proc.returncode == 2             # exits.USAGE: a bad key is a configuration error
    assert "DSV41_DECODE_YIELD=150: out of range 1..99" in proc.stdout + proc.stderr


def test_unknown_line_is_a_clear_error():
    proc = run_python(CLI, argv=("check", "--profile", PROFILE, "--line", "nosuch"))
    assert proc.returncode == 2 and "no line 'nosuch'" in proc.stderr


ONE_KEY = 'EXTRA_CONTAINER_ENV="DSV41_DECODE_YIELD=33"\nEXTRA_SGLANG_ARGS=""\n'


def _repo_copy(dst, sitecustomize=None):
    """The tracked files of this repo, as a fresh clone has them, optionally with another
    sitecustomize.py (untracked build outputs such as the swan module are not copied)."""
    import shutil
    import subprocess

    files = subprocess.run(["git", "ls-files"], cwd=REPO_ROOT, capture_output=True, text=True,
                           check=True).stdout.split()
    for name in files:
        src = REPO_ROOT / name
        if src.is_file():
            (dst / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dst / name)
    if sitecustomize is not None:
        (dst / "sitecustomize.py").write_text(sitecustomize)
    (dst / "one.env").write_text(ONE_KEY)
    return dst


def _check_in(copy):
    # The copy's own CLI, with the copy on PYTHONPATH: check's child then runs the copy's files.
    return run_python(CLI, argv=("check", "--profile", str(copy / "one.env"), "--json"),
                      env={"PYTHONPATH": str(copy)}, cwd=copy, timeout=600)


def test_check_runs_the_repos_sitecustomize_and_reports_the_entry(tmp_path):
    proc = _check_in(_repo_copy(tmp_path))
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    rows = {r["adapter"]: r for r in json.loads(proc.stdout)}
    assert rows["decode_yield"]["installed"]
    assert {(r["entry"], r["entry_path"]) for r in rows.values()} == {("sitecustomize", "sitecustomize.py")}


@pytest.mark.parametrize("broken, cause", [
    ("raise RuntimeError('sitecustomize broken by the test')\n",
     "RuntimeError: sitecustomize broken by the test"),
    ("import os  # the bootstrap call was lost\n",
     "the installer was never armed in the child: sitecustomize.py did not run it"),
])
def test_a_broken_sitecustomize_fails_the_check_naming_the_cause(tmp_path, broken, cause):
    proc = _check_in(_repo_copy(tmp_path, sitecustomize=broken))
    assert proc.returncode != 0, proc.stdout
    rows = {r["adapter"]: r for r in json.loads(proc.stdout)}
    assert not rows["decode_yield"]["installed"] and cause in rows["decode_yield"]["reason"], rows


def _profile_copy(tmp_path, env_var, add):
    """A copy of the shipped profile with `add` appended to the line variable `env_var`."""
    from adapter.tools import profile

    text = (REPO_ROOT / ".env.tp4.example").read_text()
    value = profile.read_vars(REPO_ROOT / ".env.tp4.example").get(env_var)
    lines = [ln for ln in text.splitlines() if not ln.startswith(f"{env_var}=")]
    lines.append(f'{env_var}="{(value + " ") if value else ""}{add}"')
    path = tmp_path / "profile.env"
    path.write_text("\n".join(lines) + "\n")
    return str(path)


@pytest.mark.parametrize("key", ["DSV41_ADMIN_GUARD_TEST", "DSV41_SWA_CONE_TEST_NO_COPY"])
def test_a_test_only_key_on_the_production_line_is_refused_naming_it(tmp_path, key):
    """The issue's copy of the profile: a test-only key on the production line stops `dsv41 check`
    with exit 2 (exits.USAGE, a bad key) naming the key, before any child runs."""
    path = _profile_copy(tmp_path, "EXTRA_CONTAINER_ENV", f"{key}=1")
    proc = run_python(CLI, argv=("check", "--profile", path), timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert f"{key}=1" in proc.stderr and "test-only" in proc.stderr and "'production'" in proc.stderr
    assert "enabled adapters installed" not in proc.stdout         # refused before the child


def test_a_test_only_key_is_refused_on_every_line_that_is_not_a_test_line():
    from adapter import keys
    from adapter.tools import profile

    env = {"DSV41_ADMIN_GUARD": "1", "DSV41_ADMIN_GUARD_TEST": "1"}
    for name in ("production", "control", "canary", "testing", "pretest"):
        with pytest.raises(keys.ConfigError, match="DSV41_ADMIN_GUARD_TEST=1"):
            profile.refuse_test_only(profile.Line(name, env, ()))
    for name in ("test", "test_cone", "TEST_ADMIN"):                 # test lines may carry one
        profile.refuse_test_only(profile.Line(name, env, ()))
    profile.refuse_test_only(profile.Line("production", {"DSV41_ADMIN_GUARD": "1"}, ()))
    assert [k.name for k in keys.test_only_keys(env)] == ["DSV41_ADMIN_GUARD_TEST"]


def _row(name, installed=True, enabled=True, reason="", keys_=None, entry="sitecustomize",
         entry_path="sitecustomize.py"):
    return {"adapter": name, "keys": keys_ or {}, "enabled": enabled, "pin_ok": True if enabled else None,
            "installed": installed, "status": "installed" if installed else ("refused" if enabled else "off"),
            "reason": reason, "entry": entry, "entry_path": entry_path}


def test_text_report_shows_the_entry_and_each_receipt_once():
    """Issue 51: the installing entry is printed; an installed adapter's receipt is not repeated in
    the table (it follows once, below); a reason no receipt carries stays in the table."""
    from adapter.tools import check

    receipt = ("[dsv41] decode_yield installed: DSV41_DECODE_YIELD=33: after a non-final chunk "
               "with decode rows running, the next chunk waits")
    stderr = "\n".join([receipt, "[2026-12-07 11:28:54] " + receipt, "engine line", receipt])
    receipts = check.receipt_lines(stderr)
    assert receipts == [receipt]
    rows = [_row("decode_yield", reason=receipt.split("installed: ", 1)[1], keys_={"DSV41_DECODE_YIELD": "33"}),
            _row("swa_thin", installed=False, reason="child exited 1: something broke"),
            _row("swan", installed=False, enabled=False, reason="")]
    text = check.format_table(rows, receipts)
    assert "after a non-final chunk" not in text
    assert "receipt below" in text and "child exited 1: something broke" in text
    assert "installed by: sitecustomize (sitecustomize.py)" in text
    assert "reason" not in text.splitlines()[0]
    pth = check.format_entry([_row("swan", entry="dsv41.pth", entry_path="/x/site-packages/dsv41.pth")])
    assert pth == "installed by: dsv41.pth (/x/site-packages/dsv41.pth)"
    assert check.format_entry([_row("swan", entry=None, entry_path=None)]).startswith("installed by: nothing")
    assert check.format_entry([_row("swan", entry="plugin", entry_path=None)]) == "installed by: plugin"


def test_text_output_names_the_entry_prints_receipts_once_and_shows_progress():
    proc = run_python(CLI, argv=("check", "--profile", PROFILE), timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    out = proc.stdout
    assert "installed by: sitecustomize (sitecustomize.py)" in out
    for adapter in ("swan", "decode_yield", "swa_thin", "swa_cone", "autotune_keep", "input_guard",
                    "admin_guard"):
        assert out.count(f"[dsv41] {adapter} installed: ") == 1, adapter
    assert "a lost resume point replays" in out and out.count("a lost resume point replays") == 1
    assert proc.stderr.startswith("dsv41 check: starting a child Python") and " done in " in proc.stderr
