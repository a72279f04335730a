"""admin_guard on the real CPU server: the production boot (shared, tests/e2e/e2e_configs.py) is
sent one request with no key on every route the engine marks ADMIN_OPTIONAL, after its traffic
(`_production`, the boot's on_server hook). The dense boot is the production line exactly: its
scenarios never empty the cache (canary.FLUSHING), so the harness adds no admin key and no switch.
Stock's answer to the same requests is not sent here:
one of them (POST /dump_expert_distribution_record) kills the stock scheduler; the unit tests show
stock's path reaching the manager (tests/test_admin_guard.py, negative control)."""
import re

from e2e.e2e_configs import admin_requests

# The session's shared runs this module reads (booted by conftest's lane ahead of it).
SHARED_BOOTS = [("dense", "production")]


def test_every_admin_route_answers_403_on_the_production_line_and_the_server_lives(boots):
    run = boots.config("dense", "production")
    assert not run.errors, run.errors
    probe = run.extras["admin"]
    sent = [f"{m} {p}" for m, p in admin_requests()]
    assert len(sent) >= 40 and sent[0] == "POST /dump_expert_distribution_record"
    assert probe["requests"] == sent                     # none stopped the probe early
    assert probe["statuses"] == {r: 403 for r in sent}, {
        r: s for r, s in probe["statuses"].items() if s != 403}
    assert "--admin-api-key" in probe["message"]
    assert probe["served_after"], probe                  # /health 200 and a greedy /generate
    # the launcher logged the guard and the first refusal of each route; no scheduler died
    launcher = "\n".join(t for role, t in run.logs.items() if role.startswith("launcher"))
    assert re.search(r"\[dsv41\] admin_guard closed \d+ admin routes", launcher)
    assert launcher.count("[dsv41] admin_guard refused ") == len(_per_template())
    scheduler = [t for role, t in run.logs.items() if role.startswith("sglang::scheduler")]
    assert scheduler and all("[dsv41] decode_yield installed:" in t for t in scheduler)   # read
    assert not any("Scheduler hit an exception" in t for t in run.logs.values())


def test_the_refusals_are_on_metrics_by_route(boots):
    run = boots.config("dense", "production")
    from prometheus_client.parser import text_string_to_metric_families

    assert run.extras["metrics_status"] == 200
    refused = {s.labels["route"]: s.value for f in text_string_to_metric_families(run.extras["metrics_text"])
               for s in f.samples if s.name == "dsv41_admin_guard_refused_total"}
    assert refused == _per_template(), refused


def _per_template():
    """Requests sent per route path template (the counter's label), as admin_requests() sends."""
    from sglang.srt.entrypoints.http_server import app

    from adapter import admin_guard

    want = {}
    for route in admin_guard.admin_routes(app):
        if route.level == "admin_optional":
            want[route.path] = want.get(route.path, 0) + len(route.methods)
    return want
