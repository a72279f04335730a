"""The canary boots the line it names (issue 42): the CPU harness adds no DSV41_* key of its own;
where it empties the cache of a line that closes the admin routes it uses the engine's own admin
key, and the report lists that as a difference from the line. No server is booted here (the real
boots: tests/e2e/test_e2e_canary.py, test_e2e_admin.py)."""
import json

from adapter.cpu import server as cpu_server
from adapter.tools import canary, cli, profile
from conftest import REPO_ROOT

PROFILE = REPO_ROOT / ".env.tp4.example"
PROD_KEYS, PROD_ARGS, _ = canary.split_line(profile.load_line(PROFILE, "production"))


def test_the_server_environment_carries_exactly_the_lines_keys(monkeypatch, tmp_path):
    monkeypatch.setenv("DSV41_ADMIN_GUARD_TEST", "1")          # the caller's own env is not passed on
    for model in ("dense", "dsv4"):
        server = cpu_server.CpuServer(model, keys=PROD_KEYS, args=PROD_ARGS, log_dir=tmp_path,
                                      admin_calls=True)
        env = server.environment()
        assert {k: v for k, v in env.items() if k.startswith("DSV41_")} == PROD_KEYS


def test_the_harness_admin_key_only_where_the_line_closes_the_routes_and_it_is_sent():
    assert cpu_server.closes_admin_routes(PROD_KEYS, PROD_ARGS)
    assert not cpu_server.closes_admin_routes({}, {})                       # stock: open
    assert not cpu_server.closes_admin_routes(PROD_KEYS, {"--admin-api-key": "k"})   # the line's own
    server = cpu_server.CpuServer("dense", keys=PROD_KEYS, args=PROD_ARGS, admin_calls=True)
    assert server.harness_args == {} and server.admin_headers() == {}
    server.harness_args = {"--admin-api-key": "per-boot"}                    # what start() sets
    argv = server.command()
    assert argv[argv.index("--admin-api-key") + 1] == "per-boot"
    assert server.admin_headers() == {"Authorization": "Bearer per-boot"}


def test_only_scenarios_that_empty_the_cache_ask_for_admin_calls():
    default = ("equality", "window", "idle", "cadence", "bad_input", "admin")
    assert not canary.flushes("dense", default)       # the dense production boot is the line exactly
    assert canary.flushes("dsv4", default) and canary.flushes("swa", default)
    assert canary.flushes("dsv41", default)
    assert canary.flushes("dense", default + ("calibration",))
    assert not canary.flushes("dsv4", ("equality", "bad_input", "admin"))


def test_the_report_lists_the_harness_admin_key_as_a_difference_and_skips_the_probe(capsys):
    def fake_run(model, keys, args, progress=None, name="", **extra):
        run = canary.ConfigRun(model, dict(keys), dict(args))
        if model == "dsv41" and keys.get("DSV41_ADMIN_GUARD"):
            run.harness_args = {"--admin-api-key": "<random per boot>"}
            run.admin = {"skipped": "not sent: the boot carries the harness's --admin-api-key"}
        return run

    args = cli.build_parser().parse_args(["canary", "--profile", str(PROFILE), "--json"])
    canary.main(args, run=fake_run)
    report = json.loads(capsys.readouterr().out)
    added = [k for k in report["scaled"] if k.startswith("--admin-api-key")]
    assert added == ["--admin-api-key unset -> <random per boot> (dsv41 production)"]
    effect = report["models"]["dsv41"]["adapters"]["admin_guard"]["effect"]
    assert effect["admin_request"].startswith("not sent")
    assert canary._effect_failed("admin_guard", effect) is None
    args.json = False
    canary.main(args, run=fake_run)
    table = capsys.readouterr().out
    scaled = next(ln for ln in table.splitlines() if ln.startswith("scaled to the CPU model:"))
    assert "--admin-api-key unset -> <random per boot> (dsv41 production)" in scaled
    assert "DSV41_ADMIN_GUARD_TEST" not in table
