"""admin_guard (`DSV41_ADMIN_GUARD=1`): the engine's admin routes answer 403 unless the engine's
own admin key (`--admin-api-key`) is configured.

The stock 0.5.23 HTTP server marks its management routes `AuthLevel.ADMIN_OPTIONAL`
(sglang/srt/utils/auth.py; the `@auth_level` decorators in entrypoints/http_server.py): weight
updates, memory release and resume, profiling, pause / continue, cache flush, LoRA loading,
expert-distribution records, ... With neither `--api-key` nor `--admin-api-key` on the launch line
(the production profile has none) the engine adds no auth middleware at all, so every one of them
is open to any client that reaches the port. One of them kills the server: a single
`POST /dump_expert_distribution_record` takes the scheduler down (expert_distribution.py
`_on_not_implemented`, "Scheduler hit an exception"). With only `--api-key`, anyone holding the
inference key may call them.

With the key set, the launcher's HTTP app gets one ASGI middleware of ours, added where the engine
adds its own auth middleware (`_setup_and_run_http_server`, before uvicorn starts), when the
engine's admin key is NOT configured. It asks the engine's own functions: the route's level
(`_get_auth_level_from_app_and_scope`, the engine's route match) and, for an ADMIN_OPTIONAL route,
the engine's decision for its ADMIN_FORCE level (`decide_request_auth`: without an admin key,
403; health, readiness, `/metrics` and OPTIONS always allowed). So an admin route is closed exactly
as the engine closes its ADMIN_FORCE routes when no admin key is set, and answers 403 with a body
that names `--admin-api-key`. Every other route (NORMAL: /generate, /v1/*, health, readiness,
/metrics, unknown paths) is passed on untouched, as are websocket and lifespan scopes; a path
that no ADMIN_OPTIONAL route's pattern matches is passed after one regex match (the engine's route
match over its whole table costs 50-250 us a request on this CPU, so it runs only for those). The engine's
own auth middleware, where it adds one (a key on the line), runs outside ours and unchanged.

With `--admin-api-key` set the engine keys its admin routes itself (ADMIN_OPTIONAL then accepts
only that key): nothing of ours is added (one line says so). The engine's own post-warmup
`POST /freeze_gc` (`_freeze_gc_after_server_warmup`, which carries no key when none is
configured) is let through: one request of that route while that engine function runs.

Where it cannot act as designed it declines with one fallback line and changes nothing:
`--tokenizer-worker-num` > 1 (the engine serves its app from tokenizer worker processes and adds
no auth middleware there), an app with no ADMIN_OPTIONAL route, a failure to add the middleware.
A failure of the decision itself on a request is a fallback line too, and the request goes on
unchanged: no exception of ours reaches the engine.

Test only: `DSV41_ADMIN_GUARD_TEST=1` leaves `/flush_cache` open (a hole, for this module's unit
tests). No harness sets it: the CPU harness flushes with the engine's own --admin-api-key
(adapter/cpu/server.py `admin_calls`); `dsv41 check` refuses it on a line that is not a test line.

Receipts: `[dsv41] admin_guard installed: ...` at import of the HTTP server module; one line when
the guard is added to the app (how many routes it closes) or left out (admin key set); the first
refusal of each route is logged, later ones are counted (`refused:<route>`, on `/metrics` as
`dsv41_admin_guard_refused_total{route}`); `engine_calls` counts the engine's own requests let
through.
"""
from __future__ import annotations

import dataclasses
import re
import sys

from adapter import receipts

NAME = "admin_guard"
KEY = "DSV41_ADMIN_GUARD"
TEST_KEY = "DSV41_ADMIN_GUARD_TEST"       # test only: the CPU harness's /flush_cache stays open
HARNESS_ROUTES = ("/flush_cache",)
FLAG = "--admin-api-key"
HTTP_SERVER = "sglang.srt.entrypoints.http_server"
# The engine's own admin request after warmup (http_server._freeze_gc_after_server_warmup).
ENGINE_CALL = ("POST", "/freeze_gc")

# Counter keys in receipts.counters["admin_guard"] (series: adapter/metrics.py KEYS).
COUNTERS = {
    "refused:": "admin requests answered 403, by route (the route's path template)",
    "engine_calls": "the engine's own admin requests let through (its post-warmup POST /freeze_gc)",
}

MULTI_TOKENIZER = ("--tokenizer-worker-num {n}: the engine serves its HTTP app from tokenizer "
                   "worker processes and adds no auth middleware there; admin routes left as the "
                   "engine leaves them")
NO_ADMIN_ROUTES = ("the engine's HTTP app marks no route ADMIN_OPTIONAL; nothing to close, app "
                   "left unchanged")


def message(route: str) -> str:
    """The 403 body's text."""
    return (f"Forbidden: {route} is an admin route of this server, which was started without "
            f"{FLAG}. Restart it with {FLAG} <key> to open its admin routes to holders of that "
            f"key (dsv41 admin_guard, {KEY}=1).")


@dataclasses.dataclass(frozen=True)
class Route:
    path: str
    methods: tuple[str, ...]
    level: str            # the engine's AuthLevel value ("admin_optional" | "admin_force"), or
                          # UNMARKED: a state-changing route of an included router / mounted app
    engine_sees: bool = True    # the engine's own route match (its auth middleware) finds its mark
    source: str = "app"         # "app" | "router <prefix>" | "mount <path>"
    reason: str = ""


UNMARKED = "admin_unmarked"
READ_ONLY = frozenset({"GET", "HEAD", "OPTIONS"})


@dataclasses.dataclass(frozen=True)
class _Entry:
    path: str
    methods: frozenset
    regex: object
    level: str | None
    engine_sees: bool
    source: str
    reason: str


def _routes(app) -> list:
    return getattr(getattr(app, "router", None), "routes", None) or getattr(app, "routes", [])


def _walk(routes, prefix: str, source: str, out: list) -> None:
    """Every route of a route list, included routers and mounted apps entered, in match order."""
    from starlette.routing import Mount, compile_path
    from sglang.srt.utils.auth import AuthLevel

    for route in routes:
        original = getattr(route, "original_router", None)
        context = getattr(route, "include_context", None)
        if original is not None and context is not None:        # FastAPI's included router
            _walk(original.routes, prefix + (context.prefix or ""), f"router {prefix + (context.prefix or '') or '/'}", out)
            continue
        if isinstance(route, Mount):
            sub = getattr(route.app, "routes", None)
            if sub is None:
                path = prefix + route.path + "/{path:path}"
                out.append(_Entry(path, frozenset(), compile_path(path)[0], UNMARKED, False,
                                  f"mount {prefix + route.path}",
                                  "a mounted app whose routes cannot be read: closed whole"))
            else:
                _walk(sub, prefix + route.path, f"mount {prefix + route.path}", out)
            continue
        path = getattr(route, "path", None)
        if path is None:
            continue
        methods = frozenset(getattr(route, "methods", None) or ())
        level = getattr(getattr(route, "endpoint", None), "_auth_level", None)
        level = level.value if isinstance(level, AuthLevel) and level != AuthLevel.NORMAL else None
        reason = ""
        if level is None and source != "app" and methods - READ_ONLY:
            level, reason = UNMARKED, (f"added by an included {source} without the engine's admin "
                                       f"mark, and {'/'.join(sorted(methods - READ_ONLY))} changes "
                                       "server state")
        regex = getattr(route, "path_regex", None) if not prefix else None
        out.append(_Entry(prefix + path, methods, regex or compile_path(prefix + path)[0], level,
                          source == "app", source, reason))


def route_entries(app) -> list:
    out: list = []
    _walk(_routes(app), "", "app", out)
    return out


def admin_routes(app) -> list[Route]:
    """The app's admin routes wherever registered: those the engine marks ADMIN_OPTIONAL or
    ADMIN_FORCE (its `_auth_level`), in the app itself or in a router it includes or an app it
    mounts, plus the unmarked state-changing routes of included routers / mounted apps."""
    return [Route(e.path, tuple(sorted(e.methods)), e.level, e.engine_sees, e.source, e.reason)
            for e in route_entries(app) if e.level is not None]


def _match(entries, method: str, path: str):
    """The entry the request reaches (first full match: path and method), else None."""
    for e in entries:
        if e.regex.match(path) and (not e.methods or method in e.methods):
            return e
    return None


def refuses(app, scope, *, method: str, path: str, authorization, api_key, entries=None) -> bool:
    """Whether the guard answers this request 403 (no admin key on the line): the request reaches
    an admin route (wherever registered) and the engine's decision for its ADMIN_FORCE level with
    no admin key refuses it."""
    from sglang.srt.utils.auth import AuthLevel, decide_request_auth

    entry = _match(route_entries(app) if entries is None else entries, method, path)
    if entry is None or entry.level is None:
        return False
    return not decide_request_auth(method=method, path=path, authorization_header=authorization,
                                   api_key=api_key, admin_api_key=None,
                                   auth_level=AuthLevel.ADMIN_FORCE).allowed


def admin_path_regex(app, entries=None):
    """One regex over the path patterns of the app's admin routes (named groups made plain): a
    path it does not match cannot reach such a route, so the guard's own route match runs only
    for paths it matches."""
    entries = route_entries(app) if entries is None else entries
    patterns = [e.regex.pattern for e in entries if e.level is not None]
    if not patterns:
        return None
    return re.compile("|".join(f"(?:{re.sub(r'[(][?]P<[^>]+>', '(?:', p)})" for p in patterns))


class AdminGuard:
    """ASGI middleware (pure ASGI, like the engine's auth middleware: client disconnects reach the
    routes unchanged). Without an admin key on the line: every admin route answers 403. With one:
    the admin routes the engine's own auth does not see (included routers, mounted apps) need it
    (401 without), the others are the engine's."""

    def __init__(self, app, *, fastapi_app, api_key, counters, engine_calls, fallback,
                 harness_routes=(), admin_api_key=None):
        self.app = app
        self.harness_routes = tuple(harness_routes)   # DSV41_ADMIN_GUARD_TEST=1 (test only)
        self.fastapi_app = fastapi_app
        self.api_key = api_key
        self.admin_api_key = admin_api_key
        self.counters = counters
        self.engine_calls = engine_calls      # one token per running engine self-call
        self.fallback = fallback
        self.logged: set = set()
        self._regex = None
        self._entries: list = []
        self._regex_of = -1                   # the route count the regex was built for

    def _candidate(self, scope) -> bool:
        """Could this path reach an admin route? (rebuilt when the app's routes change)"""
        from starlette.routing import get_route_path

        routes = _routes(self.fastapi_app)
        if len(routes) != self._regex_of:
            self._entries = route_entries(self.fastapi_app)
            if self.admin_api_key:      # only the routes the engine's own auth does not see
                self._entries = [e if not e.engine_sees else dataclasses.replace(e, level=None)
                                 for e in self._entries]
            self._regex = admin_path_regex(self.fastapi_app, self._entries)
            self._regex_of = len(routes)
        return self._regex is not None and self._regex.match(get_route_path(scope)) is not None

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        try:
            refused = self._refused_route(scope) if self._candidate(scope) else None
        except Exception as exc:  # noqa: BLE001 - a failing decision never stops a request
            self.fallback(f"the decision itself failed ({type(exc).__name__}); request passed "
                          "unchanged")
            refused = None
        if refused is None:
            await self.app(scope, receive, send)
            return
        from fastapi.responses import ORJSONResponse

        route, status = refused
        text = message(route) if status == 403 else keyed_message(route)
        response = ORJSONResponse(content={"error": text}, status_code=status)
        await response(scope, receive, send)

    def _refused_route(self, scope):
        """(route template, status) when the request is refused, else None."""
        from starlette.requests import Request
        from sglang.srt.utils.auth import AuthLevel, decide_request_auth

        request = Request(scope)
        method, path = request.method, request.url.path
        entry = _match(self._entries, method, path)
        if entry is None or entry.level is None:
            return None
        authorization = request.headers.get("Authorization")
        if self.admin_api_key:
            if decide_request_auth(method=method, path=path, authorization_header=authorization,
                                   api_key=self.api_key, admin_api_key=self.admin_api_key,
                                   auth_level=AuthLevel.ADMIN_OPTIONAL).allowed:
                return None
            status = 401
        else:
            if decide_request_auth(method=method, path=path, authorization_header=authorization,
                                   api_key=self.api_key, admin_api_key=None,
                                   auth_level=AuthLevel.ADMIN_FORCE).allowed:
                return None
            status = 403
        route = entry.path
        if route in self.harness_routes:
            if ("harness", route) not in self.logged:
                self.logged.add(("harness", route))
                receipts.line(NAME, "let %s through: DSV41_ADMIN_GUARD_TEST=1 (test only, the CPU "
                              "harness)", route)
            return None
        if (method, route) == ENGINE_CALL and self.engine_calls:
            try:
                self.engine_calls.pop()
            except IndexError:          # another request took it
                pass
            else:
                self.counters["engine_calls"] += 1
                if "engine_call" not in self.logged:
                    self.logged.add("engine_call")
                    receipts.line(NAME, "let the engine's own post-warmup POST /freeze_gc through")
                return None
        self.counters[f"refused:{route}"] += 1
        if route not in self.logged:
            self.logged.add(route)
            if status == 403:
                receipts.line(NAME, "refused %s %s (HTTP 403): an admin route and no "
                              "--admin-api-key on the line; further refusals of %s are counted, "
                              "not logged", method, path, route)
            else:
                receipts.line(NAME, "refused %s %s (HTTP 401): an admin route the engine's own "
                              "auth does not see, without the --admin-api-key; further refusals "
                              "of %s are counted, not logged", method, path, route)
        return route, status


def keyed_message(route: str) -> str:
    return (f"Unauthorized: {route} is an admin route of this server; send its --admin-api-key "
            f"as a bearer token (dsv41 admin_guard, {KEY}=1: the engine's own auth does not see "
            "this route, which an included router adds)")


def guard_app(ctx, engine_calls: list, harness_routes=()) -> bool:
    """Add the guard to the engine's HTTP app where it acts; True when added."""
    module = sys.modules[HTTP_SERVER]
    serving = module.get_serving()
    app = module.app
    if serving.tokenizer_worker_num != 1:
        ctx.fallback(MULTI_TOKENIZER.format(n=serving.tokenizer_worker_num))
        return False
    routes = admin_routes(app)
    if serving.admin_api_key:
        unseen = [r for r in routes if not r.engine_sees]
        if not unseen:
            receipts.line(NAME, "left the %d admin routes to the engine: --admin-api-key is set, "
                          "so the engine keys them itself (nothing of ours added)", len(routes))
            return False
        app.add_middleware(AdminGuard, fastapi_app=app, api_key=serving.api_key,
                           counters=ctx.counters, engine_calls=engine_calls, fallback=ctx.fallback,
                           harness_routes=harness_routes, admin_api_key=serving.admin_api_key)
        receipts.line(NAME, "left %d admin routes to the engine (--admin-api-key is set) and keyed "
                      "the %d its own auth does not see (%s) with that key: 401 without it",
                      len(routes) - len(unseen), len(unseen), ", ".join(r.path for r in unseen))
        return True
    if not routes:
        ctx.fallback(NO_ADMIN_ROUTES)
        return False
    app.add_middleware(AdminGuard, fastapi_app=app, api_key=serving.api_key,
                       counters=ctx.counters, engine_calls=engine_calls, fallback=ctx.fallback,
                       harness_routes=harness_routes)
    receipts.line(NAME, "closed %d admin routes of the HTTP app (%d the engine marks, %d of them "
                  "in included routers or mounted apps; %d unmarked state-changing): no "
                  "--admin-api-key on the line, they answer 403 naming it; health, readiness, "
                  "/metrics and request routes unchanged", len(routes),
                  sum(r.level != UNMARKED for r in routes),
                  sum(r.level != UNMARKED and not r.engine_sees for r in routes),
                  sum(r.level == UNMARKED for r in routes))
    return True


def exposure(app, *, api_key, admin_api_key, tokenizer_worker_num: int, guarded: bool) -> dict:
    """What a client without a key gets from each admin route of `app` on a launch line with these
    keys (`dsv41 check`): "open", "closed" (403: by admin_guard, or the engine's ADMIN_FORCE rule)
    or "keyed" (401 without the key named in "by"). The engine's own gate and decision decide
    where ours does not."""
    from sglang.srt.utils.auth import AuthLevel, app_has_admin_force_endpoints, decide_request_auth

    single = tokenizer_worker_num == 1
    engine_auth = single and bool(api_key or admin_api_key or app_has_admin_force_endpoints(app))
    ours = guarded and single and not admin_api_key
    routes = []
    for r in admin_routes(app):
        level = AuthLevel.ADMIN_OPTIONAL if r.level == UNMARKED else AuthLevel(r.level)
        engine_level = level if r.engine_sees else AuthLevel.NORMAL
        method = r.methods[0] if r.methods else "GET"
        if ours and level == AuthLevel.ADMIN_OPTIONAL and not decide_request_auth(
                method=method, path=r.path, authorization_header=None, api_key=api_key,
                admin_api_key=None, auth_level=AuthLevel.ADMIN_FORCE).allowed:
            state, by = "closed", NAME
        elif guarded and single and admin_api_key and not r.engine_sees:
            state, by = "keyed", FLAG          # ours: the engine's own auth does not see it
        elif not engine_auth:
            state, by = "open", None
        else:
            decision = decide_request_auth(method=method, path=r.path, authorization_header=None,
                                           api_key=api_key, admin_api_key=admin_api_key,
                                           auth_level=engine_level)
            if decision.allowed:
                state, by = "open", None
            elif decision.error_status_code == 403:
                state, by = "closed", "engine"
            else:
                state, by = "keyed", FLAG if (admin_api_key and engine_level != AuthLevel.NORMAL
                                              or engine_level == AuthLevel.ADMIN_FORCE) \
                    else "--api-key"
        routes.append({"path": r.path, "methods": list(r.methods), "level": r.level,
                       "exposure": state, "by": by, "source": r.source})
    counts = {k: sum(x["exposure"] == k for x in routes) for k in ("open", "closed", "keyed")}
    return {"api_key": bool(api_key), "admin_api_key": bool(admin_api_key),
            "tokenizer_worker_num": tokenizer_worker_num, "guarded": ours, **counts,
            "routes": routes}


REDACTED = "<redacted by dsv41 admin_guard>"
SECRET_FIELDS = ("api_key", "admin_api_key")


def redact_keys(value, secrets=()):
    """`value` with every api_key / admin_api_key field (at any depth) and every occurrence of a
    key's value in a string (the launch command) replaced by REDACTED; `value` itself unchanged."""
    if isinstance(value, dict):
        return {k: (REDACTED if k in SECRET_FIELDS and v is not None else redact_keys(v, secrets))
                for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(redact_keys(v, secrets) for v in value)
    if isinstance(value, str):
        for secret in secrets:
            if secret and secret in value:
                value = value.replace(secret, REDACTED)
        return value
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        names = [f.name for f in dataclasses.fields(value) if f.name in SECRET_FIELDS
                 and getattr(value, f.name) is not None]
        if names:
            import copy

            value = copy.copy(value)
            for name in names:
                object.__setattr__(value, name, REDACTED)
    return value


def _line_secrets() -> tuple:
    try:
        serving = sys.modules[HTTP_SERVER].get_serving()
        return tuple(k for k in (serving.api_key, serving.admin_api_key) if k)
    except Exception:  # noqa: BLE001 - no serving config here: the field names still redact
        return ()


def install(ctx) -> str:
    engine_calls: list = []
    harness = HARNESS_ROUTES if ctx.value(TEST_KEY) else ()

    def setup_and_run_http_server(original, *args, **kwargs):
        try:
            guard_app(ctx, engine_calls, harness)
        except Exception as exc:  # noqa: BLE001 - never stop the server from starting
            ctx.fallback(f"the guard could not be added to the HTTP app ({type(exc).__name__}: "
                         f"{exc}); admin routes left as the engine leaves them")
        return original(*args, **kwargs)

    def freeze_gc_after_server_warmup(original, *args, **kwargs):
        token = object()
        engine_calls.append(token)
        try:
            return original(*args, **kwargs)
        finally:
            try:
                engine_calls.remove(token)
            except ValueError:          # the guard let it through (popped)
                pass

    def redact_watermark_secrets(original, value, *args, **kwargs):
        # what /server_info and /get_server_info return passes here whole (server args, the
        # scheduler's internal state with its own copy of them, the launch command)
        return redact_keys(original(value, *args, **kwargs), _line_secrets())

    ctx.around("_setup_and_run_http_server", setup_and_run_http_server)
    ctx.around("redact_watermark_secrets", redact_watermark_secrets)
    ctx.around("_freeze_gc_after_server_warmup", freeze_gc_after_server_warmup)
    return (f"{KEY}=1: unless {FLAG} is set, the admin routes of the HTTP app wherever registered "
            "(marked ADMIN_OPTIONAL by the engine, in the app, its included routers and mounted "
            "apps, and unmarked state-changing routes of those) answer HTTP 403 naming "
            f"{FLAG} (the engine's ADMIN_FORCE rule, in a middleware of the launcher's HTTP app); "
            f"with {FLAG} set, the ones the engine's own auth does not see need that key; "
            "/server_info and /get_server_info never show --api-key / --admin-api-key values; "
            "health, readiness, /metrics and request routes unchanged"
            + (f"; {TEST_KEY}=1 (test only): {', '.join(harness)} left open for the CPU harness"
               if harness else ""))
