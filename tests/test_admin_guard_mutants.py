"""admin_guard's route rule: tests added for the mutation check's survivors (bench/mutation.py
admin_guard; docs/testing.md lists each survivor left and why).

The engine's own HTTP app has no mounted app, no ADMIN_FORCE route and no included router without a
prefix, so its route table alone leaves parts of the walk and of `exposure` unexercised: `_ops_app`
is a real FastAPI app with each of them, its routes marked with the engine's own `auth_level`. The
guard runs over it as the launcher runs it (an ASGI middleware in front of the app), with the
engine's own `decide_request_auth`."""
import asyncio
import dataclasses

import pytest

from adapter import admin_guard, receipts
from test_admin_guard import _app, _scope


async def _plain(scope, receive, send):
    """An ASGI app with no route table (a mounted app whose routes cannot be read)."""
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b""})


def _endpoint(level=None):
    from sglang.srt.utils.auth import AuthLevel, auth_level

    def endpoint():
        return {}
    return endpoint if level is None else auth_level(AuthLevel(level))(endpoint)


def _ops_app():
    from fastapi import APIRouter, FastAPI
    from starlette.applications import Starlette
    from starlette.routing import Host, Mount, Route

    app = FastAPI()
    app.add_api_route("/opt", _endpoint("admin_optional"), methods=["POST"])
    app.add_api_route("/force", _endpoint("admin_force"), methods=["POST"])
    app.add_api_route("/freeze_gc", _endpoint("admin_optional"), methods=["POST"])
    app.add_api_route("/plain", _endpoint(), methods=["POST"])        # the app's own: NORMAL
    router = APIRouter()                                                 # included without a prefix
    router.add_api_route("/cfg", _endpoint(), methods=["POST", "DELETE"])
    router.add_api_route("/cfg_read", _endpoint(), methods=["GET"])
    app.include_router(router)
    ops = APIRouter()
    ops.add_api_route("/reshard", _endpoint(), methods=["PATCH"])
    app.include_router(ops, prefix="/ops")
    sub = FastAPI()
    sub.add_api_route("/reload/{name}", _endpoint("admin_optional"), methods=["POST"])
    app.mount("/sub", sub)
    app.mount("/static", _plain)
    app.mount("/a", Starlette(routes=[Host("h.example", app=_plain), Mount("/b", app=_plain),
                                      Route("/c", _endpoint(), methods=["PUT"])]))
    # after the mounts, with the same parameter name as /sub/reload/{name}
    app.add_api_route("/late/{name}", _endpoint("admin_optional"), methods=["POST"])
    return app


WHOLE = "a mounted app whose routes cannot be read: closed whole"
OPS_ADMIN = [   # (path, methods, level, engine_sees, source, reason), in match order
    ("/opt", ("POST",), "admin_optional", True, "app", ""),
    ("/force", ("POST",), "admin_force", True, "app", ""),
    ("/freeze_gc", ("POST",), "admin_optional", True, "app", ""),
    ("/cfg", ("DELETE", "POST"), admin_guard.UNMARKED, False, "router /",
     "added by an included router / without the engine's admin mark, and DELETE/POST changes "
     "server state"),
    ("/ops/reshard", ("PATCH",), admin_guard.UNMARKED, False, "router /ops",
     "added by an included router /ops without the engine's admin mark, and PATCH changes server "
     "state"),
    ("/sub/reload/{name}", ("POST",), "admin_optional", False, "mount /sub", ""),
    ("/static/{path:path}", (), admin_guard.UNMARKED, False, "mount /static", WHOLE),
    ("/a/b/{path:path}", (), admin_guard.UNMARKED, False, "mount /a/b", WHOLE),
    ("/a/c", ("PUT",), admin_guard.UNMARKED, False, "mount /a",
     "added by an included mount /a without the engine's admin mark, and PUT changes server state"),
    ("/late/{name}", ("POST",), "admin_optional", True, "app", ""),
]


def test_the_walk_enters_included_routers_and_mounted_apps_in_match_order():
    app = _ops_app()
    routes = admin_guard.admin_routes(app)
    assert [(r.path, r.methods, r.level, r.engine_sees, r.source, r.reason) for r in routes] == OPS_ADMIN
    entries = admin_guard.route_entries(app)
    paths = [e.path for e in entries]
    assert "/plain" in paths and "/cfg_read" in paths            # read-only / the app's own: not admin
    assert paths.index("/a/c") > paths.index("/a/b/{path:path}")  # the walk goes on after a mount
    assert paths[-1] == "/late/{name}"
    for e in entries:                                             # each entry matches its own URL
        assert e.regex.match(e.path.replace("{name}", "x").replace("{path:path}", "x/y")), e.path


def test_a_mounted_app_without_a_route_table_is_closed_for_every_method_but_options():
    app = _ops_app()
    for method in ("POST", "GET", "DELETE"):
        assert admin_guard.refuses(app, _scope(method, "/static/x"), method=method,
                                   path="/static/x", authorization=None, api_key=None), method
    assert not admin_guard.refuses(app, _scope("OPTIONS", "/static/x"), method="OPTIONS",
                                   path="/static/x", authorization=None, api_key=None)
    # the entries given are the ones matched (the guard's own, with the admin key: fewer)
    assert not admin_guard.refuses(app, _scope("POST", "/static/x"), method="POST", path="/static/x",
                                   authorization=None, api_key=None, entries=[])


def test_an_app_without_a_router_attribute_and_one_without_routes():
    from starlette.routing import Mount, Route, Router

    router = Router(routes=[Route("/x", _endpoint("admin_optional"), methods=["POST"]),
                            Mount("/m", app=_plain)])
    assert [e.path for e in admin_guard.route_entries(router)] == ["/x", "/m/{path:path}"]
    assert admin_guard.route_entries(_plain) == [] and admin_guard.admin_routes(_plain) == []
    assert admin_guard.admin_path_regex(_plain) is None


def test_the_prefilter_takes_the_entries_given_and_routes_sharing_a_parameter_name():
    app = _ops_app()
    regex = admin_guard.admin_path_regex(app)
    for path in ("/sub/reload/x", "/late/x", "/static/x/y", "/a/b/x", "/a/c", "/cfg", "/opt"):
        assert regex.match(path), path
    for path in ("/plain", "/cfg_read", "/late", "/sub/other"):
        assert not regex.match(path), path
    only = [e for e in admin_guard.route_entries(app) if e.path == "/opt"]
    regex = admin_guard.admin_path_regex(app, only)
    assert regex.match("/opt") and not regex.match("/force")


# --- the middleware --------------------------------------------------------------------------

class Guarded:
    """One AdminGuard in front of an app's stand-in inner ASGI callable (records what reached it)."""

    def __init__(self, app, **kwargs):
        self.reached, self.fallback, self.counters = [], [], receipts.Counts()

        async def inner(scope, receive, send):
            self.reached.append((scope["method"], scope["path"]))
            await _plain(scope, receive, send)

        kw = {"api_key": None, "engine_calls": [], "harness_routes": (), "admin_api_key": None, **kwargs}
        self.guard = admin_guard.AdminGuard(inner, fastapi_app=app, counters=self.counters,
                                            fallback=self.fallback.append, **kw)

    def __call__(self, method, path, key=None):
        sent = []
        scope = _scope(method, path)
        if key is not None:
            scope["headers"] = [(b"authorization", f"Bearer {key}".encode())]

        async def receive():
            return {"type": "http.request", "body": b"", "more_body": False}

        async def send(message):
            sent.append(message)

        asyncio.run(self.guard(scope, receive, send))
        return sent[0]["status"]


@pytest.fixture
def log(caplog):
    caplog.set_level("INFO", logger=receipts.LOGGER_NAME)
    return lambda text: [r.getMessage() for r in caplog.records if text in r.getMessage()]


def test_an_app_without_admin_routes_passes_everything_without_a_fallback():
    from fastapi import FastAPI

    app = FastAPI()
    app.add_api_route("/x", _endpoint(), methods=["POST"])
    g = Guarded(app)
    assert g("POST", "/x") == 200 and g("POST", "/y") == 200
    assert g.reached == [("POST", "/x"), ("POST", "/y")] and g.fallback == []


def test_the_guard_follows_routes_added_after_its_first_request():
    from fastapi import FastAPI

    app = FastAPI()
    g = Guarded(app)
    assert g("POST", "/later") == 200
    app.add_api_route("/later", _endpoint("admin_optional"), methods=["POST"])
    assert g("POST", "/later") == 403 and g.reached == [("POST", "/later")]


def test_a_method_the_admin_route_does_not_take_passes_without_a_fallback():
    g = Guarded(_ops_app())
    assert g("GET", "/opt") == 200 and g.fallback == [] and g.reached == [("GET", "/opt")]


def test_with_the_admin_key_only_the_routes_the_engine_does_not_see_are_keyed(log):
    g = Guarded(_ops_app(), admin_api_key="adm")
    assert g("POST", "/opt") == 200             # the engine's own auth keys it (outside ours)
    assert g("POST", "/late/x") == 200
    assert g("POST", "/static/x") == 401 and g("POST", "/static/y") == 401
    assert g("POST", "/static/x", key="wrong") == 401
    assert g("POST", "/static/x", key="adm") == 200
    assert g("OPTIONS", "/static/x") == 200     # the engine's rule: OPTIONS always allowed
    assert g("POST", "/sub/reload/x") == 401
    assert g.reached == [("POST", "/opt"), ("POST", "/late/x"), ("POST", "/static/x"),
                         ("OPTIONS", "/static/x")]
    assert dict(g.counters) == {"refused:/static/{path:path}": 3, "refused:/sub/reload/{name}": 1}
    assert log("admin_guard refused") == [
        "[dsv41] admin_guard refused POST /static/x (HTTP 401): an admin route the engine's own "
        "auth does not see, without the --admin-api-key; further refusals of /static/{path:path} "
        "are counted, not logged",
        "[dsv41] admin_guard refused POST /sub/reload/x (HTTP 401): an admin route the engine's own "
        "auth does not see, without the --admin-api-key; further refusals of /sub/reload/{name} "
        "are counted, not logged"]


def test_without_the_admin_key_each_route_is_logged_once_and_every_refusal_counted(log):
    g = Guarded(_ops_app(), api_key="inference")
    assert g("POST", "/opt") == 403 and g("POST", "/opt", key="inference") == 403
    assert g("OPTIONS", "/static/x") == 200 and g("DELETE", "/static/x") == 403
    assert g.reached == [("OPTIONS", "/static/x")]
    assert dict(g.counters) == {"refused:/opt": 2, "refused:/static/{path:path}": 1}
    assert log("admin_guard refused") == [
        "[dsv41] admin_guard refused POST /opt (HTTP 403): an admin route and no --admin-api-key on "
        "the line; further refusals of /opt are counted, not logged",
        "[dsv41] admin_guard refused DELETE /static/x (HTTP 403): an admin route and no "
        "--admin-api-key on the line; further refusals of /static/{path:path} are counted, not "
        "logged"]


def test_the_test_only_harness_route_is_logged_once(log):
    g = Guarded(_ops_app(), harness_routes=("/opt",))
    assert g("POST", "/opt") == 200 and g("POST", "/opt") == 200 and g("POST", "/force") == 403
    assert log("admin_guard let") == [
        "[dsv41] admin_guard let /opt through: DSV41_ADMIN_GUARD_TEST=1 (test only, the CPU harness)"]
    assert dict(g.counters) == {"refused:/force": 1}


def test_an_engine_call_token_opens_only_post_freeze_gc_once_per_token(log):
    tokens = [object(), object()]
    g = Guarded(_ops_app(), engine_calls=tokens)
    assert g("POST", "/opt") == 403 and len(tokens) == 2         # another admin route: no token
    assert g("POST", "/freeze_gc") == 200 and g("POST", "/freeze_gc") == 200
    assert tokens == [] and g("POST", "/freeze_gc") == 403
    assert g.counters["engine_calls"] == 2
    assert log("admin_guard let") == [
        "[dsv41] admin_guard let the engine's own post-warmup POST /freeze_gc through"]


# --- exposure (`dsv41 check`) ------------------------------------------------------------------

def _states(out):
    return {r["path"]: (r["exposure"], r["by"]) for r in out["routes"]}


def test_exposure_of_every_kind_of_admin_route():
    app = _ops_app()
    kw = dict(api_key=None, admin_api_key=None, tokenizer_worker_num=1)
    stock = admin_guard.exposure(app, guarded=False, **kw)
    # the ADMIN_FORCE route puts the engine's auth middleware on: it closes that one itself
    assert _states(stock) == {p[0]: ("open", None) for p in OPS_ADMIN} | {"/force": ("closed", "engine")}
    guarded = admin_guard.exposure(app, guarded=True, **kw)
    assert guarded == {
        "api_key": False, "admin_api_key": False, "tokenizer_worker_num": 1, "guarded": True,
        "open": 0, "closed": len(OPS_ADMIN), "keyed": 0,
        "routes": [{"path": p, "methods": list(m), "level": level, "source": source,
                    "exposure": "closed", "by": "engine" if p == "/force" else "admin_guard"}
                   for p, m, level, _, source, _ in OPS_ADMIN]}


def test_exposure_with_only_the_admin_key_unguarded_leaves_included_routes_open(install_adapters):
    install_adapters({})
    out = admin_guard.exposure(_app(), api_key=None, admin_api_key="a", tokenizer_worker_num=1,
                               guarded=False)
    unseen = {r.path for r in admin_guard.admin_routes(_app()) if not r.engine_sees}
    assert unseen and out["admin_api_key"] is True and out["api_key"] is False
    for path, state in _states(out).items():
        assert state == (("open", None) if path in unseen else ("keyed", "--admin-api-key")), path


def test_exposure_with_several_tokenizer_workers_is_stock_open_even_with_a_key(install_adapters):
    install_adapters({})
    out = admin_guard.exposure(_app(), api_key="k", admin_api_key=None, tokenizer_worker_num=2,
                               guarded=True)
    assert out["guarded"] is False and out["tokenizer_worker_num"] == 2 and out["api_key"] is True
    assert set(_states(out).values()) == {("open", None)} and out["open"] == len(out["routes"])


# --- redact_keys -------------------------------------------------------------------------------

def test_redact_keys_at_any_depth_and_in_strings_keeping_types_and_unset_keys():
    value = {"api_key": "not-on-the-line", "admin_api_key": None, "port": 30000,
             "internal_states": [{"api_key": "inference-key", "launch": "--admin-api-key admin-key"}],
             "argv": ("--api-key", "inference-key"), "nested": {"admin_api_key": "admin-key"}}
    out = admin_guard.redact_keys(value, ("", "inference-key", "admin-key"))
    R = admin_guard.REDACTED
    assert out == {"api_key": R, "admin_api_key": None, "port": 30000,
                   "internal_states": [{"api_key": R, "launch": f"--admin-api-key {R}"}],
                   "argv": ("--api-key", R), "nested": {"admin_api_key": R}}
    assert type(out["argv"]) is tuple and type(out["internal_states"]) is list
    assert value["internal_states"][0]["api_key"] == "inference-key"       # the input unchanged
    assert admin_guard.redact_keys("no secret here", ("",)) == "no secret here"


@dataclasses.dataclass(frozen=True)
class _Keys:
    """A frozen dataclass carrying the two key fields (the engine's ServerArgs is not a dataclass
    in 0.5.23: it reaches redact_keys as a dict; the dataclass branch is for any that is)."""
    model_path: str
    api_key: str | None = None
    admin_api_key: str | None = None


def test_redact_keys_of_a_dataclass_is_a_redacted_copy():
    args = _Keys("dummy", api_key="inference-key")
    out = admin_guard.redact_keys(args)
    assert out == _Keys("dummy", api_key=admin_guard.REDACTED) and out is not args
    assert args.api_key == "inference-key"                                  # the input unchanged
    bare = _Keys("dummy")
    assert admin_guard.redact_keys(bare) is bare                            # nothing to redact
    assert admin_guard.redact_keys(_Keys) is _Keys                          # the class itself
