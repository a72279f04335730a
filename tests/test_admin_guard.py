"""admin_guard on the engine's real HTTP app, auth functions and `_setup_and_run_http_server`
(installed by the production installer; uvicorn's server stubbed so the engine's function returns
instead of serving). Requests go through the app the engine built, with a stand-in tokenizer
manager that records what reached it. The real server: tests/e2e/test_e2e_admin.py."""
import asyncio
import collections
import types

import pytest

from adapter import admin_guard, keys, receipts

KEYS = {"DSV41_ADMIN_GUARD": "1"}


class Manager:
    """What the admin endpoints under test call on the engine's tokenizer manager. Not the engine's
    TokenizerManager (tests/test_input_guard.py builds that one on CPU): its admin methods send a
    control request through its communicators and await the scheduler's answer, and no scheduler
    runs here; this stand-in records that the route reached the manager, which is what the guard
    decides."""

    def __init__(self):
        self.calls = []

    async def dump_expert_distribution_record(self):
        self.calls.append("dump_expert_distribution_record")

    async def freeze_gc(self):
        self.calls.append("freeze_gc")

    async def flush_cache(self, timeout_s=0.0):
        self.calls.append("flush_cache")
        return types.SimpleNamespace(success=True)

    def set_server_stop_hook(self, fn):
        pass


@pytest.fixture
def serve(monkeypatch):
    """serve(environ, **server_args) -> (TestClient of the engine's app, Manager): the adapters
    of `environ` installed, then the engine's own _setup_and_run_http_server run (its gate, its
    auth middleware, our hook) with uvicorn's server stubbed; the app's middleware restored after."""
    import uvicorn
    from sglang.srt import runtime_context as rc
    from sglang.srt.entrypoints import http_server as hs
    from sglang.srt.server_args import ServerArgs
    from starlette.testclient import TestClient

    from adapter import installer

    saved = list(hs.app.user_middleware)
    monkeypatch.setattr(uvicorn, "Server", lambda config: types.SimpleNamespace(run=lambda: None))
    monkeypatch.setattr(uvicorn, "Config", lambda app, **kw: None)
    contexts = []

    def start(environ, **server_args):
        status = installer.install_in_process(environ)
        if environ:
            assert status["admin_guard"].status == "installed", status["admin_guard"]
        receipts.forget("admin_guard")
        args = ServerArgs(model_path="dummy", **server_args)
        ctx = rc.use_context(rc.create_context(args, role="tokenizer"))
        ctx.__enter__()
        contexts.append(ctx)
        manager = Manager()
        hs._setup_and_run_http_server(args, manager, None, None, [{}], None)
        return TestClient(hs.app), manager

    yield start
    for ctx in contexts:
        ctx.__exit__(None, None, None)
    hs.app.user_middleware[:] = saved
    hs.app.middleware_stack = None
    installer.reset_for_tests()
    installer.set_mode("boot")
    receipts.forget("admin_guard")


def _app():
    from sglang.srt.entrypoints.http_server import app

    return app


def _url(path):
    """A concrete URL of a route path template ({param} -> x)."""
    import re

    return re.sub(r"\{[^}]+\}", "x", path)


def _lines(caplog, text):
    return [r.getMessage() for r in caplog.records if text in r.getMessage()]


def test_every_admin_optional_route_answers_403_naming_the_flag_and_reaches_nothing(serve, caplog):
    client, manager = serve(KEYS)
    routes = [r for r in admin_guard.admin_routes(_app()) if r.level == "admin_optional"]
    assert len(routes) >= 40 and any(r.path == "/dump_expert_distribution_record" for r in routes)
    for route in routes:
        for method in route.methods:
            resp = client.request(method, _url(route.path))
            assert resp.status_code == 403, (method, route.path, resp.text)
            assert "--admin-api-key" in resp.json()["error"], resp.text
    assert manager.calls == []
    # counted by path template (/hicache/storage-backend: three routes, one per method)
    want = collections.Counter()
    for r in routes:
        want[f"refused:{r.path}"] += len(r.methods)
    assert dict(receipts.counters["admin_guard"]) == dict(want)
    # the first refusal of each path template is logged, the others counted
    assert len(_lines(caplog, "[dsv41] admin_guard refused ")) == len(want)
    closed = _lines(caplog, "[dsv41] admin_guard closed ")
    unseen = sum(not r.engine_sees for r in routes)
    assert unseen >= 2         # /scale_elastic_ep, /is_scaling_elastic_ep: the elastic-EP router's
    assert closed == [f"[dsv41] admin_guard closed {len(routes)} admin routes of the HTTP app "
                      f"({len(routes)} the engine marks, {unseen} of them in included routers or "
                      "mounted apps; 0 unmarked state-changing): no --admin-api-key on the line, "
                      "they answer 403 naming it; health, readiness, /metrics and request routes "
                      "unchanged"]


def test_negative_control_without_the_adapter_the_same_route_reaches_the_scheduler_path(serve):
    client, manager = serve({})
    resp = client.post("/dump_expert_distribution_record")
    assert resp.status_code == 200 and manager.calls == ["dump_expert_distribution_record"]
    # the engine's own rule: no key on the line, no auth middleware, ADMIN_OPTIONAL allowed
    from sglang.srt.utils.auth import AuthLevel, app_has_admin_force_endpoints, decide_request_auth

    assert not app_has_admin_force_endpoints(_app())
    assert decide_request_auth(method="POST", path="/dump_expert_distribution_record",
                               authorization_header=None, api_key=None, admin_api_key=None,
                               auth_level=AuthLevel.ADMIN_OPTIONAL).allowed


def _scope(method, path):
    return {"type": "http", "method": method, "path": path, "raw_path": path.encode(),
            "root_path": "", "query_string": b"", "headers": [], "scheme": "http",
            "server": ("127.0.0.1", 1), "client": ("127.0.0.1", 2)}


def _through(guard_kwargs, method, path):
    """(status, reached inner app) of one request through an AdminGuard over the engine's app."""
    reached, sent = [], []

    async def inner(scope, receive, send):
        reached.append(scope["path"])
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message):
        sent.append(message)

    guard = admin_guard.AdminGuard(inner, fastapi_app=_app(),
                                   **dict(guard_kwargs, fallback=guard_kwargs["fallback"].append))
    asyncio.run(guard(_scope(method, path), receive, send))
    return sent[0]["status"], bool(reached)


@pytest.fixture
def guard_kwargs(install_adapters):
    install_adapters({})        # the engine's http_server imported, nothing of ours installed
    return {"api_key": None, "counters": receipts.Counts(), "engine_calls": [], "fallback": []}


@pytest.mark.parametrize("method, path", [
    ("GET", "/health"), ("GET", "/health_generate"), ("GET", "/ready"), ("GET", "/metrics"),
    ("POST", "/generate"), ("POST", "/v1/chat/completions"), ("POST", "/v1/completions"),
    ("GET", "/v1/models"), ("GET", "/get_model_info"), ("POST", "/no/such/route"),
    ("OPTIONS", "/dump_expert_distribution_record"),      # the engine's rule: OPTIONS always allowed
])
def test_health_metrics_request_routes_and_unknown_paths_pass_untouched(guard_kwargs, method, path):
    assert _through(guard_kwargs, method, path) == (200, True)
    assert not admin_guard.refuses(_app(), _scope(method, path), method=method, path=path,
                                   authorization=None, api_key=None)
    assert dict(guard_kwargs["counters"]) == {}


def test_the_engine_levels_of_health_readiness_metrics_and_request_routes_are_normal(install_adapters):
    install_adapters({})
    from sglang.srt.utils.auth import AuthLevel, _get_auth_level_from_app_and_scope

    for method, path in [("GET", "/health"), ("GET", "/ready"), ("POST", "/generate"),
                         ("POST", "/v1/chat/completions")]:
        assert _get_auth_level_from_app_and_scope(_app(), _scope(method, path)) == AuthLevel.NORMAL
    assert not [r for r in admin_guard.admin_routes(_app()) if r.level == "admin_force"]


def test_the_path_prefilter_matches_exactly_the_admin_optional_routes(install_adapters):
    install_adapters({})
    regex = admin_guard.admin_path_regex(_app())
    for route in admin_guard.admin_routes(_app()):
        assert regex.match(_url(route.path)), route.path
    for path in ("/generate", "/v1/chat/completions", "/health", "/flush_cache/x", "/dumper"):
        assert not regex.match(path), path


def test_a_failing_decision_is_one_fallback_line_and_the_request_passes(guard_kwargs, monkeypatch):
    def broken(*a, **k):
        raise RuntimeError("boom")

    monkeypatch.setattr(admin_guard, "_match", broken)      # the guard's route match
    assert _through(guard_kwargs, "POST", "/dump_expert_distribution_record") == (200, True)
    assert guard_kwargs["fallback"] == ["the decision itself failed (RuntimeError); request "
                                        "passed unchanged"]


def test_with_the_admin_key_the_engine_keys_its_routes_and_ours_keys_what_it_misses(serve, caplog):
    client, manager = serve(KEYS, admin_api_key="sekret")
    assert client.post("/dump_expert_distribution_record").status_code == 401     # the engine's
    ok = client.post("/dump_expert_distribution_record", headers={"Authorization": "Bearer sekret"})
    assert ok.status_code == 200 and manager.calls == ["dump_expert_distribution_record"]
    # the elastic-EP router's admin route: the engine's own match does not see its mark
    refused = client.post("/scale_elastic_ep", json={})
    assert refused.status_code == 401 and "--admin-api-key" in refused.json()["error"]
    assert client.post("/scale_elastic_ep", json={},
                       headers={"Authorization": "Bearer sekret"}).status_code != 401   # its handler
    # counted from the engine's own route table as its auth reads it (the app's routes whose
    # endpoint carries an ADMIN mark; an included router's routes it does not see)
    from sglang.srt.entrypoints import http_server as hs
    from sglang.srt.utils.auth import AuthLevel

    seen = [r for r in hs.app.router.routes if getattr(getattr(r, "endpoint", None), "_auth_level", None)
            in (AuthLevel.ADMIN_OPTIONAL, AuthLevel.ADMIN_FORCE)]
    assert seen and "/scale_elastic_ep" not in {r.path for r in seen}
    assert len(_lines(caplog, f"[dsv41] admin_guard left {len(seen)} admin routes to the engine")) == 1
    assert dict(receipts.counters["admin_guard"]) == {"refused:/scale_elastic_ep": 1}


def test_without_the_guard_an_included_routers_admin_route_is_open_even_with_the_admin_key(serve):
    client, manager = serve({}, admin_api_key="sekret")
    assert client.post("/scale_elastic_ep", json={}).status_code not in (401, 403)     # stock


def test_server_info_never_shows_the_keys(serve, monkeypatch):
    client, manager = serve(KEYS, api_key="inference-key", admin_api_key="admin-key")
    from sglang.srt.entrypoints import http_server as hs

    async def internal_state():
        return [{"api_key": "inference-key", "admin_api_key": "admin-key", "tp_size": 1}]

    manager.get_internal_state = internal_state
    monkeypatch.setattr(hs, "_global_state", types.SimpleNamespace(
        tokenizer_manager=manager, scheduler_info={}), raising=False)
    manager.server_args = hs.get_context().server_args if hasattr(hs, "get_context") else None
    from sglang.srt.server_args import ServerArgs

    args = ServerArgs(model_path="dummy", api_key="inference-key", admin_api_key="admin-key")
    args._launch_command = "python -m sglang.launch_server --api-key inference-key --admin-api-key admin-key"
    manager.server_args = args
    manager.startup_time = 0.0
    for path in ("/server_info", "/get_server_info"):
        resp = client.get(path, headers={"Authorization": "Bearer inference-key"})
        assert resp.status_code == 200, resp.text[:300]
        text = resp.text
        assert "inference-key" not in text and "admin-key" not in text, text[:500]
        body = resp.json()
        assert body["api_key"] == body["admin_api_key"] == admin_guard.REDACTED
        assert body["internal_states"][0]["admin_api_key"] == admin_guard.REDACTED
        assert admin_guard.REDACTED in body["launch_command"]


def test_an_included_routers_unmarked_state_changing_route_is_an_admin_route(install_adapters):
    install_adapters({})
    from fastapi import APIRouter, FastAPI

    router = APIRouter()
    router.add_api_route("/reshard", lambda: None, methods=["POST"])
    router.add_api_route("/shards", lambda: None, methods=["GET"])
    app = FastAPI()
    app.include_router(router, prefix="/ops")
    routes = {r.path: r for r in admin_guard.admin_routes(app)}
    assert set(routes) == {"/ops/reshard"}              # GET /ops/shards: read-only, stays open
    assert routes["/ops/reshard"].level == admin_guard.UNMARKED and not routes["/ops/reshard"].engine_sees
    assert admin_guard.refuses(app, _scope("POST", "/ops/reshard"), method="POST", path="/ops/reshard",
                               authorization=None, api_key=None)


def test_with_only_the_api_key_the_engine_checks_it_first_and_the_guard_still_closes(serve):
    client, manager = serve(KEYS, api_key="inference")
    assert client.post("/dump_expert_distribution_record").status_code == 401     # the engine's
    resp = client.post("/dump_expert_distribution_record",
                       headers={"Authorization": "Bearer inference"})
    assert resp.status_code == 403 and "--admin-api-key" in resp.json()["error"]
    assert manager.calls == []


def test_the_engine_post_warmup_freeze_gc_passes_once_and_only_while_it_runs(serve, monkeypatch):
    client, manager = serve(KEYS)
    from sglang.srt.entrypoints import http_server as hs
    from sglang.srt.server_args import ServerArgs

    answers = []

    def post(url, headers=None, **kw):          # the engine's request, through the app
        resp = client.post("/freeze_gc", headers=headers)
        answers.append(resp.status_code)
        return types.SimpleNamespace(raise_for_status=lambda: None)

    monkeypatch.setattr(hs.requests, "post", post)
    hs._freeze_gc_after_server_warmup(ServerArgs(model_path="dummy"))
    assert answers == [200] and manager.calls == ["freeze_gc"]
    assert receipts.counters["admin_guard"]["engine_calls"] == 1
    assert client.post("/freeze_gc").status_code == 403           # a client's, afterwards
    assert manager.calls == ["freeze_gc"]


def test_multi_tokenizer_mode_declines_with_one_fallback_line(install_adapters, caplog):
    install_adapters(KEYS)
    from sglang.srt import runtime_context as rc
    from sglang.srt.entrypoints.http_server import app
    from sglang.srt.server_args import ServerArgs

    ctx = types.SimpleNamespace(counters=receipts.Counts(),
                                fallback=lambda reason: receipts.fallback("admin_guard", reason))
    receipts.forget("admin_guard")
    before = list(app.user_middleware)
    args = ServerArgs(model_path="dummy", tokenizer_worker_num=2)
    with rc.use_context(rc.create_context(args, role="tokenizer")):
        assert admin_guard.guard_app(ctx, []) is False
    assert app.user_middleware == before
    assert _lines(caplog, "admin_guard fallback") == [
        "[dsv41] admin_guard fallback: " + admin_guard.MULTI_TOKENIZER.format(n=2) + " (logged once)"]
    receipts.forget("admin_guard")


@pytest.mark.parametrize("line, open_, closed, keyed, by", [
    ({}, "all", 0, 0, None),                                              # stock, no keys
    ({"guarded": True}, 0, "all", 0, "admin_guard"),                      # production
    ({"api_key": "k"}, 0, 0, "all", "--api-key"),                         # stock, inference key
    ({"api_key": "k", "guarded": True}, 0, "all", 0, "admin_guard"),
    ({"admin_api_key": "a", "guarded": True}, 0, 0, "all", "--admin-api-key"),
    ({"guarded": True, "tokenizer_worker_num": 2}, "all", 0, 0, None),    # declined: no middleware
])
def test_exposure_of_a_line(install_adapters, line, open_, closed, keyed, by):
    install_adapters({})
    kw = {"api_key": None, "admin_api_key": None, "tokenizer_worker_num": 1, "guarded": False, **line}
    out = admin_guard.exposure(_app(), **kw)
    n = len(out["routes"])
    assert n >= 40
    want = {k: (n if v == "all" else v) for k, v in (("open", open_), ("closed", closed), ("keyed", keyed))}
    assert {k: out[k] for k in want} == want
    assert {r["by"] for r in out["routes"]} == {by}


def test_the_key_is_a_volatile_flag_off_by_default_and_a_bad_value_is_a_boot_error():
    key = keys.KEY_BY_NAME["DSV41_ADMIN_GUARD"]
    assert (key.kind, key.adapter, key.default, key.volatile, key.enables) == (
        "flag", "admin_guard", 0, True, True)
    assert not keys.parse_env({}).enabled("admin_guard")
    assert keys.parse_env(KEYS).enabled("admin_guard")
    with pytest.raises(keys.ConfigError, match="DSV41_ADMIN_GUARD='2': expected 0 or 1"):
        keys.parse_env({"DSV41_ADMIN_GUARD": "2"})
    with pytest.raises(keys.ConfigError, match="did you mean DSV41_ADMIN_GUARD"):
        keys.parse_env({"DSV41_ADMIN_GAURD": "1"})


@pytest.mark.parametrize("argv, guarded, summary", [
    ([], False, "42 open, 0 closed, 0 keyed"),
    ([], True, "0 open, 42 closed (by admin_guard), 0 keyed"),
    (["--api-key", "k"], False, "0 open, 0 closed, 42 keyed (by --api-key)"),
    (["--admin-api-key", "a"], True, "0 open, 0 closed, 42 keyed (by --admin-api-key)"),
])
def test_check_reads_the_line_with_the_engine_parser_and_prints_the_exposure(
        install_adapters, argv, guarded, summary):
    install_adapters({})
    from adapter.tools import check

    admin = check._admin_exposure(["--tp-size", "4", *argv], guarded)
    n = len(admin["routes"])
    text = check.format_exposure(admin)
    assert text.splitlines()[0].endswith(summary.replace("42", str(n))), text
    assert ("\n  open: /abort_request " in text) == (admin["open"] > 0)


def test_the_test_only_switch_leaves_only_flush_cache_open_for_the_cpu_harness(serve, caplog):
    client, manager = serve({**KEYS, "DSV41_ADMIN_GUARD_TEST": "1"})
    assert client.post("/flush_cache").status_code == 200 and manager.calls == ["flush_cache"]
    assert client.post("/dump_expert_distribution_record").status_code == 403
    assert manager.calls == ["flush_cache"]
    assert _lines(caplog, "[dsv41] admin_guard let /flush_cache through") == [
        "[dsv41] admin_guard let /flush_cache through: DSV41_ADMIN_GUARD_TEST=1 (test only, the CPU "
        "harness)"]
    assert keys.KEY_BY_NAME["DSV41_ADMIN_GUARD_TEST"].test_only
