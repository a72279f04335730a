"""Fuzzing the request routes (issues 30, 41): schemathesis against the production line, stock reported.

One boot of the production line (the dense model, the suite's production configuration:
tests/e2e/e2e_configs.py PROD_KEYS / PROD_ARGS, --enable-metrics). schemathesis reads the server's
own /openapi.json and generates request bodies for every request route and the session routes
(ROUTES) that fit each route's schema, biased to the sampling path (temperature > 0 with top-k,
top-p and min-p, where the route takes them; issue 41; each generating route also gets valid
sampled requests and prompted schema bodies: FORMS), while a second client streams plain
requests beside the fuzz (each must get all its tokens), through its Hypothesis strategies: the fuzzing phase only, with a fixed seed (its
examples and coverage phases spend minutes generating for the engine's request schemas before they
send anything; its negative mode up to a minute per body). Each body is sent on its own, one after the
other, to 127.0.0.1 only, with a time limit per request (a stream still answering then is cut and
recorded, not failed), route by route, until PER_ROUTE bodies went to every route (a request
count, the same on any machine: no wall-clock budget), or the server dies. Then, asserted:

  every process of the boot (launcher, scheduler, detokenizer) alive, /health 200, every route
  got its PER_ROUTE bodies, every "served" body (a valid sampled request) answered 200, each
  plain stream beside the fuzz got all its tokens (a stream still
  in flight is waited for while the server is alive and holds a request; one the server no longer
  holds is a hang: server state, not a read timeout), the greedy probes (token ids and logprobs)
  equal to the ones before the fuzz, no scheduler exception in its log.

Reported, not asserted: the same bodies, in the same order, replayed on stock (no DSV41 keys, the
control line's launch args) within STOCK_S seconds and STOCK_BOOTS boots (a dead stock is booted
again to go on; a body sent before is not sent again), each body that killed it with its
scheduler's exception line; then, the last thing sent to a stock boot, one
`POST /dump_expert_distribution_record` with no body (an admin route; whether stock died on it).
Every body that killed a boot or got a 5xx from production is listed with the server's own
exception line. The test prints

  fuzz: production alive after N requests over M routes; stock died on K distinct bodies

(or `...; stock survived`), and a second line on the stock run and the admin request.
"""
from __future__ import annotations

import collections
import contextlib
import dataclasses
import json
import os
import pathlib
import random
import re
import time

import hypothesis
import psutil
import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, Phase, Verbosity
from schemathesis import GenerationMode
from schemathesis.core import NotSet

from adapter.cpu.server import LAUNCHER_ROLE, BootError, CpuServer, error_lines
from adapter.tools import traffic

from e2e.e2e_configs import CTRL_ARGS, PROD_ARGS, PROD_KEYS

MODEL = "dense"
ROUTES = ("/generate", "/v1/completions", "/v1/chat/completions", "/v1/messages", "/v1/score",
          "/encode", "/classify",
          # issue 41: every request route (input_guard.ROUTES) and the session routes
          "/vertex_generate", "/invocations", "/api/generate", "/api/chat", "/v1/embeddings",
          "/v1/classify", "/v1/rerank", "/open_session", "/close_session")
# Sampling-biased bodies (issue 41): the engine's sampling path runs only at temperature > 0, so
# every body that takes sampling fields gets temperature > 0 with top-k, top-p and min-p drawn
# (ordinary values and each tensor's edges), where that route takes them.
TOP_K_EDGES = (-1, 0, 2**31 - 1, 2**31, 2**40)
# The sampling values are drawn per body from a generator seeded by (SEED, route, index), not by
# Hypothesis: a Hypothesis run begins at its simplest example and stays near it for its first
# examples, and a route gets only PER_ROUTE of them (measured on 2026-12-07: 110 of 128 bodies had
# temperature 0.05, top_k 1, top_p 0.01, min_p 0 -- greedy in effect -- and no /generate,
# /v1/completions, /v1/chat/completions or /v1/messages body carried a prompt, so none of them
# reached the sampling path). The bodies' structure stays Hypothesis's (schemathesis, from the
# server's own schema); each generating route gets its bodies in FORMS' order:
#   "served":   the route's smallest valid request (SERVED) and valid sampling values: asserted 200,
#               the guard passing a valid sampled request and the engine sampling it;
#   "prompted": Hypothesis's body with SERVED's fields put over it: the sampling path with the
#               schema's other fields beside it (any answer but a 5xx);
#   "drawn":    Hypothesis's body as drawn, sampling values with the tensors' edges (any but a 5xx).
FORMS = ("served", "drawn", "prompted", "drawn")
PROMPT = "The quick brown fox"
SERVED_TOKENS = 8
_CONVERSATION = [{"role": "user", "content": PROMPT}]
SERVED = {
    "/generate": {"text": PROMPT, "sampling_params": {"max_new_tokens": SERVED_TOKENS}},
    "/v1/completions": {"model": "m", "prompt": PROMPT, "max_tokens": SERVED_TOKENS},
    "/v1/chat/completions": {"model": "m", "messages": _CONVERSATION, "max_tokens": SERVED_TOKENS},
    "/invocations": {"model": "m", "messages": _CONVERSATION, "max_tokens": SERVED_TOKENS},
    "/v1/messages": {"model": "m", "messages": _CONVERSATION, "max_tokens": SERVED_TOKENS},
    "/api/generate": {"model": "m", "prompt": PROMPT, "stream": False,
                      "options": {"num_predict": SERVED_TOKENS}},
    "/api/chat": {"model": "m", "messages": _CONVERSATION, "stream": False,
                  "options": {"num_predict": SERVED_TOKENS}},
    "/vertex_generate": {"instances": [{"text": PROMPT}],
                         "parameters": {"sampling_params": {"max_new_tokens": SERVED_TOKENS}}},
}
BESIDE_TOKENS = 48          # the plain stream beside the fuzz: each must get all its tokens
SEED = 20261230
PER_ROUTE = 8               # bodies sent to each route, route by route (16 x 8 requests)
REQUESTS = PER_ROUTE * len(ROUTES)
REQUEST_S = 20.0            # one request: connect + the whole answer (a stream is cut there)
DEATH_WAIT_S = 3.0          # after no answer: how long a dying server gets to show it (its
                            # scheduler's death takes the launcher down: the request gets no
                            # answer); a 5xx answered by the launcher gets HANDLED_WAIT_S
HANDLED_WAIT_S = 0.5
STOCK_S = 40.0              # the stock replay, its boots included (no new boot after this)
# The stock replay costs 1-2 boots and is reported, not asserted: run by DSV41_FUZZ_STOCK=1
# (the suite's time budget, README); without it the report says it was not run.
STOCK_REPLAY = os.environ.get("DSV41_FUZZ_STOCK") == "1"
STOCK_BOOTS = 2             # boots for the replay; one more for the admin request if stock is dead
ADMIN = "/dump_expert_distribution_record"
SCHED_ERRORS = ("Scheduler hit an exception", "Traceback (most recent call last)")
# 5xx that are the server's own faults, by the server's exception line (issue 50): none since the
# boot has a chat template (below). The dense CPU model's tokenizer has none of its own (the served
# DeepSeek-V4.1 has), and without one every `/api/chat` body ended in the engine's 500 ("Cannot
# use chat template functions") before its sampling path: the boot gives it CHAT_TEMPLATE with the
# engine's own `--chat-template`, so `/api/chat` and the other chat routes reach their sampling path.
SERVER_FAULTS: tuple = ()
CHAT_TEMPLATE = pathlib.Path(__file__).with_name("chat_template.jinja")
PROBES = ((11, 40), (12, 1300))     # (seed, tokens): a short prompt and a chunked one (1024 chunks)
JSON = {"Content-Type": "application/json"}


@dataclasses.dataclass
class Sent:
    route: str
    body: bytes | None
    status: int | str           # HTTP status, or "no answer (...)"
    text: str = ""              # the answer's first bytes
    cut: bool = False           # still answering after REQUEST_S: the client closed it
    seconds: float = 0.0
    exception: str = ""         # on a 5xx: the server's last exception line
    form: str = "drawn"         # FORMS: how the fuzz built the body

    @property
    def key(self) -> tuple:
        return self.route, self.body

    def show(self, limit: int = 400) -> str:
        body = "(no body)" if self.body is None else self.body.decode("utf-8", "replace")
        return f"POST {self.route} {body[:limit]}{' ...' if len(body) > limit else ''}"


@dataclasses.dataclass
class Death:
    sent: Sent
    exception: str              # the server's own exception line (scheduler first)
    boot: int


def wire(body) -> bytes | None:
    """The bytes a body puts on the wire (a JSON body, raw bytes, or none: schemathesis's NotSet)."""
    if isinstance(body, NotSet):
        return None
    if isinstance(body, (bytes, bytearray)):
        return bytes(body)
    return json.dumps(body).encode()


def send(server: CpuServer, route: str, body: bytes | None) -> Sent:
    url = server.url + route
    assert url.startswith("http://127.0.0.1:"), url      # loopback only
    began = time.monotonic()
    try:
        with requests.post(url, data=body, headers=JSON if body is not None else {}, stream=True,
                           timeout=(10, REQUEST_S)) as resp:
            deadline, head, cut = time.monotonic() + REQUEST_S, b"", False
            for chunk in resp.iter_content(65536):
                head = head if len(head) >= 600 else head + chunk
                if time.monotonic() > deadline:
                    cut = True
                    break
            return Sent(route, body, resp.status_code, head[:600].decode("utf-8", "replace"), cut,
                        time.monotonic() - began)
    except requests.RequestException as exc:
        return Sent(route, body, f"no answer ({type(exc).__name__})", seconds=time.monotonic() - began)


class Boot:
    """One server and the processes it booted with."""

    def __init__(self, name: str, keys: dict, args: dict, log_dir: pathlib.Path):
        self.server = CpuServer(MODEL, keys=keys, args=args, name=name, log_dir=log_dir)
        self.pids: dict[int, str] = {}

    # The processes whose loss takes the server down: the launcher (HTTP + tokenizer manager), the
    # schedulers and the detokenizer. Other processes titled sglang::* may be short-lived helpers
    # that end on their own after the boot (one such, with an empty log, ended ~8 s after a boot
    # in a full run on 2026-12-07 while the server went on answering): their exit is not a death.
    VITAL = ("sglang::scheduler", "sglang::detokenizer", "sglang::tokenizer")

    def start(self) -> "Boot":
        self.server.start()
        self.pids = {pid: role for pid, role in self.server.roles.items()
                     if pid == self.server.proc.pid or role.startswith(self.VITAL)}
        return self

    def dead(self) -> list[str]:
        """The boot's processes that are gone (or zombies)."""
        out = []
        for pid, role in self.pids.items():
            try:
                if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                    out.append(f"{role} pid {pid}")
            except psutil.NoSuchProcess:
                out.append(f"{role} pid {pid}")
        return out

    def healthy(self) -> bool:
        return self.server.healthy()

    def died_on(self, sent: Sent) -> bool:
        """Whether `sent` took the server down (checked after every request; a 5xx or no answer
        gets a moment to show it)."""
        if not self.dead() and (isinstance(sent.status, int) and sent.status < 500):
            return False
        deadline = time.monotonic() + (DEATH_WAIT_S if isinstance(sent.status, str) else HANDLED_WAIT_S)
        while not self.dead() and time.monotonic() < deadline:
            time.sleep(0.25)
        if not self.dead():
            sent.exception = self.exception(f"[{LAUNCHER_ROLE}")
            return False
        with contextlib.suppress(Exception):        # let the launcher finish its crash path (logs)
            self.server.proc.wait(timeout=DEATH_WAIT_S)
        return True

    def exception(self, first: str = "[sglang::scheduler") -> str:
        """The server's own exception line: the last traceback's, of the processes whose role
        starts with `first` if any (the scheduler; the launcher for a 5xx it answered)."""
        lines = error_lines(self.server.process_logs())
        chosen = [ln for ln in lines if ln.startswith(first)]
        return (chosen or lines or ["no exception line in the server's logs"])[0]

    def sched_log(self) -> str:
        return "\n".join(t for r, t in self.server.process_logs().items()
                         if r.startswith("sglang::scheduler"))

    def probes(self) -> list:
        out = []
        for seed, n in PROBES:
            ids = traffic.token_ids(seed, n)
            out.append(traffic._record(f"probe-{n}", ids, self.server.generate(ids, max_new_tokens=16)))
        return out


def drawn_sampling(rng: random.Random, edges: bool) -> dict:
    """temperature > 0 with top-k, top-p and min-p: valid values, and with `edges` one of the
    top-k tensor's edges in about one body of four (the engine stores top_k as int32)."""
    if edges and rng.random() < 0.25:
        top_k = rng.choice(TOP_K_EDGES)
    else:
        top_k = -1 if rng.random() < 0.125 else rng.randint(2, 2048)      # -1: top-k off
    return {"temperature": round(rng.uniform(0.05, 2.0), 3), "top_k": top_k,
            "top_p": round(rng.uniform(0.01, 1.0), 3), "min_p": round(rng.uniform(0.0, 1.0), 3)}


def merged(base: dict, over: dict) -> dict:
    """`base` with `over`'s fields put over it, one level into the objects both hold."""
    out = dict(base)
    for k, v in over.items():
        out[k] = {**out[k], **v} if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def body_for(route: str, index: int, drawn) -> tuple[str, object]:
    """(form, body) of the route's index-th body (FORMS; "drawn" on a route without sampling),
    its sampling values and option names seeded by (route, index). `drawn`: schemathesis's body."""
    if route not in SERVED:
        return "drawn", drawn
    form = FORMS[index % len(FORMS)]
    rng = random.Random(f"{SEED}:{route}:{index}")
    if form == "served":
        return form, with_sampling(route, SERVED[route], drawn_sampling(rng, False))
    if not isinstance(drawn, dict):
        return "drawn", drawn
    body = merged(drawn, SERVED[route]) if form == "prompted" else drawn
    return form, with_sampling(route, body, drawn_sampling(rng, True), drawn_options(rng))


# Ollama's documented options (github.com/ollama/ollama docs/modelfile.md, api.md) and Vertex AI's
# documented generation parameters, beside random keys (issue 50): each value drawn from valid and
# wrong types, so the routes meet the names their clients really send. Drawn with the body's
# sampling values (the same seeded generator): Hypothesis's first examples here were all `{}`.
OLLAMA_OPTIONS = ("seed", "num_predict", "stop", "temperature", "top_k", "top_p", "min_p",
                  "repeat_penalty", "repeat_last_n", "presence_penalty", "frequency_penalty",
                  "num_ctx", "mirostat", "mirostat_eta", "mirostat_tau", "tfs_z", "typical_p",
                  "num_keep", "penalize_newline")
VERTEX_PARAMETERS = ("temperature", "maxOutputTokens", "topK", "topP", "candidateCount",
                     "stopSequences", "seed", "presencePenalty", "frequencyPenalty",
                     "max_new_tokens", "stream", "return_logprob", "sampling_params")


def drawn_value(rng: random.Random):
    """One option value: an integer (small, or anywhere in [-2^63, 2^64]), a float, a bool, a short
    text, None, or a list of short texts."""
    def text():
        return "".join(rng.choice("ab \u00e9\n1") for _ in range(rng.randint(0, 8)))
    return rng.choice((
        lambda: rng.randint(-2, 64), lambda: rng.randint(-2**63, 2**64), lambda: rng.uniform(-2.0, 2.0),
        lambda: rng.random() < 0.5, text, lambda: None, lambda: [text() for _ in range(rng.randint(0, 2))],
    ))()


def drawn_options(rng: random.Random) -> dict:
    """{"ollama": {...}, "vertex": {...}}: 1-4 names each, documented mostly, a random key sometimes."""
    def names(documented):
        return {(rng.choice(documented) if rng.random() < 0.75 else
                 "".join(rng.choice("abcdefgh_") for _ in range(rng.randint(1, 8)))): drawn_value(rng)
                for _ in range(rng.randint(1, 4))}
    return {"ollama": names(OLLAMA_OPTIONS), "vertex": names(VERTEX_PARAMETERS)}


def with_sampling(path: str, body: dict, sampling: dict, named: dict | None = None) -> dict:
    """The body with the sampling fields put where its route takes them, and (issue 50) the
    documented / random option names where the Ollama and Vertex routes take them."""
    body = json.loads(json.dumps(body))
    if path == "/generate":
        sp = body.get("sampling_params")
        body["sampling_params"] = {**(sp if isinstance(sp, dict) else {}), **sampling}
    elif path in ("/v1/completions", "/v1/chat/completions", "/invocations"):
        body.update(sampling)
    elif path == "/v1/messages":
        body.update({k: v for k, v in sampling.items() if k != "min_p"})
    elif path in ("/api/generate", "/api/chat"):
        opts = body.get("options")
        body["options"] = {**(opts if isinstance(opts, dict) else {}), **(named or {}).get("ollama", {}),
                           **{k: v for k, v in sampling.items() if k != "min_p"}}
    elif path == "/vertex_generate":
        params = body.get("parameters")
        params = {**(params if isinstance(params, dict) else {}), **(named or {}).get("vertex", {})}
        sp = params.get("sampling_params")
        body["parameters"] = {**params, "sampling_params": {**(sp if isinstance(sp, dict) else {}),
                                                            **sampling}}
    return body


def fuzz_strategy(openapi: dict) -> dict:
    """One strategy per route, bodies that fit the route's schema: schemathesis's negative mode
    spends up to a minute generating one body for these schemas, and what does not fit the schema
    gets the engine's own 400 before any handler runs."""
    schema = schemathesis.openapi.from_dict(openapi, config=schemathesis.Config())
    found = {op.ok().path: op.ok() for op in schema.include(path=list(ROUTES), method="POST")
             .get_all_operations()}
    assert sorted(found) == sorted(ROUTES), sorted(found)   # every route is in the server's schema
    return {r: found[r].as_strategy(GenerationMode.POSITIVE) for r in ROUTES}


class _Stop(Exception):
    """Ends the Hypothesis run: every route got its bodies or the server died."""


def fuzz(boot: Boot, strategies: dict) -> tuple[list[Sent], Death | None]:
    """Generate and send, route by route, until each route got PER_ROUTE bodies or the server
    dies: a request count, so a loaded machine sends the same bodies as an idle one, only slower.
    One Hypothesis run per route (its own seed): the strategy a run draws from must not depend on
    what was sent before (Hypothesis replays its examples and refuses data that does)."""
    sent: list[Sent] = []
    state: dict = {"death": None}

    def run(i: int, route: str) -> None:
        @hypothesis.seed(SEED + i)
        @hypothesis.settings(max_examples=10 * PER_ROUTE, deadline=None, database=None,
                             phases=[Phase.generate], suppress_health_check=list(HealthCheck),
                             verbosity=Verbosity.quiet, report_multiple_bugs=False)
        @hypothesis.given(case=strategies[route])
        def one(case):
            index = sum(s.route == route for s in sent)
            if state["death"] or index >= PER_ROUTE:
                raise _Stop
            form, body = body_for(route, index, case.body)
            s = send(boot.server, case.formatted_path, wire(body))
            s.form = form
            sent.append(s)
            if boot.died_on(s):
                state["death"] = Death(s, boot.exception(), 1)
                raise _Stop

        with contextlib.suppress(_Stop):
            one()

    for i, route in enumerate(ROUTES):
        run(i, route)
        if state["death"]:
            break
    return sent, state["death"]


def replay_on_stock(bodies: list[tuple], tmp: pathlib.Path) -> dict:
    """The production run's bodies in order on stock, booted again after a death; then the admin
    request on a live stock boot. Reported only: a stock boot that fails is reported too."""
    began, deaths, sent, seen = time.monotonic(), [], [], set()
    out: dict = {"admin": None, "boot_error": None, "boots": 0}
    boot = None

    def new_boot():
        out["boots"] += 1
        try:
            args = {**CTRL_ARGS, "--chat-template": str(CHAT_TEMPLATE)}
            return Boot(f"fuzz-stock-{out['boots']}", {}, args, tmp / f"stock-{out['boots']}").start()
        except BootError as exc:        # the boot stopped its processes before raising
            out["boot_error"] = exc.summary()
            return None

    try:
        for route, body in bodies:
            if time.monotonic() - began > STOCK_S or out["boot_error"]:
                break
            if (route, body) in seen:
                continue
            if boot is None:
                if out["boots"] >= STOCK_BOOTS:
                    break
                boot = new_boot()
                if boot is None:
                    break
            seen.add((route, body))
            s = send(boot.server, route, body)
            sent.append(s)
            if boot.died_on(s):
                deaths.append(Death(s, boot.exception(), out["boots"]))
                boot.server.stop()
                boot = None
        if boot is None and not out["boot_error"]:
            boot = new_boot()
        if boot is not None:
            s = send(boot.server, ADMIN, None)
            died = boot.died_on(s)
            out["admin"] = (s, died, boot.exception() if died else "")
    finally:
        if boot is not None:
            boot.server.stop()
    out.update(sent=sent, deaths=deaths, seconds=time.monotonic() - began)
    return out


def holds_requests(boot: "Boot") -> bool:
    """Whether the server reports a request running or queued (the engine's own gauges,
    --enable-metrics); False when it does not answer."""
    try:
        text = requests.get(boot.server.url + "/metrics", timeout=(10, 60)).text
    except requests.RequestException:
        return False
    return any(float(m.group(1)) > 0 for m in re.finditer(
        r"^sglang:num_(?:running|queue)_reqs(?:\{[^}]*\})? ([-+0-9.eE]+)$", text, re.M))


IDLE_POLLS = 20             # a stream in flight while the server holds no request for this many
                            # polls in a row (one a second) is a hang: its end is not coming


class Beside:
    """A second client streaming plain greedy requests back to back while the fuzz runs: each
    must get all its tokens (a fuzz body must not kill, hang or cut another client's stream).
    A stream has no read timeout: the one in flight when the fuzz ends is waited for while the
    server is alive and reports a request running or queued (server state, whatever the
    machine's speed); it is a hang once the server holds no request and the stream has not
    ended, and a failure when the server died."""

    def __init__(self, server: CpuServer):
        import threading

        self.server = server
        self.results: list = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="fuzz-beside", daemon=True)

    def start(self):
        self._thread.start()

    def _run(self):
        seed = 0
        while not self._stop.is_set():
            seed += 1
            body = {"input_ids": traffic.token_ids(900 + seed, 24), "stream": True,
                    "sampling_params": {"temperature": 0.0, "max_new_tokens": BESIDE_TOKENS,
                                        "ignore_eos": True}}
            try:
                got, last = 0, None
                with requests.post(self.server.url + "/generate", json=body, stream=True,
                                   timeout=(10, None)) as resp:
                    for raw in resp.iter_lines():
                        if raw.startswith(b"data:") and raw[5:].strip() != b"[DONE]":
                            last = json.loads(raw[5:])
                    got = (last.get("meta_info", {}).get("completion_tokens", 0)
                           if isinstance(last, dict) else 0)
                    self.results.append((resp.status_code, got))
            except (requests.RequestException, ValueError) as exc:
                self.results.append((f"no answer ({type(exc).__name__})", 0))
                if self._stop.wait(1.0):
                    return

    def stop(self, boot: "Boot") -> list:
        self._stop.set()
        idle = 0
        while self._thread.is_alive():
            self._thread.join(timeout=1.0)
            if not self._thread.is_alive():
                break
            if boot.dead():
                self._thread.join(timeout=DEATH_WAIT_S)     # its connection error, if it comes
                if self._thread.is_alive():
                    self.results.append((f"no answer (server died: {boot.dead()})", 0))
                break
            idle = 0 if holds_requests(boot) else idle + 1
            if idle >= IDLE_POLLS:
                self.results.append(("hung: in flight while the server held no request", 0))
                break
        return list(self.results)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fuzz")
    prod = Boot("fuzz-production", PROD_KEYS,
                {**PROD_ARGS, "--enable-metrics": "", "--chat-template": str(CHAT_TEMPLATE)},
                tmp / "production")
    out: dict = {"tmp": tmp}
    try:
        prod.start()
        openapi = requests.get(prod.server.url + "/openapi.json", timeout=60).json()
        out["before"] = prod.probes()
        began = time.monotonic()
        beside = Beside(prod.server)
        beside.start()
        try:
            out["sent"], out["death"] = fuzz(prod, fuzz_strategy(openapi))
        finally:
            out["beside"] = beside.stop(prod)
        out["fuzz_s"] = time.monotonic() - began
        out["dead"] = prod.dead()
        out["healthy"] = not out["dead"] and prod.healthy()
        out["after"] = prod.probes() if out["healthy"] else []
        out["sched_log"] = prod.sched_log()
        out["prod_exception"] = prod.exception()
    finally:
        prod.server.stop()
    (tmp / "bodies.json").write_text(json.dumps(
        [{"route": s.route, "body": None if s.body is None else s.body.decode("utf-8", "replace"),
          "production": s.status, "answer": s.text[:300], "seconds": round(s.seconds, 3)}
         for s in out["sent"]], indent=1))
    # stock: the bodies production got, in order (the one that killed production included)
    out["stock"] = (replay_on_stock([s.key for s in out["sent"]], tmp) if STOCK_REPLAY else
                    {"admin": None, "boot_error": None, "boots": 0, "sent": [], "deaths": [],
                     "seconds": 0.0, "skipped": True})
    return out


def _report(runs) -> list[str]:
    sent, stock = runs["sent"], runs["stock"]
    routes = {s.route for s in sent}
    deaths = stock["deaths"]
    lines = [f"fuzz: production {'alive' if runs['healthy'] else 'DEAD'} after {len(sent)} requests "
             f"over {len(routes)} routes; "
             + ("stock not replayed" if stock.get("skipped") else
                f"stock died on {len(deaths)} distinct bodies" if deaths else "stock survived")]
    if stock["admin"] is None:
        admin = "not sent (no live stock boot)"
    else:
        s, died, exc = stock["admin"]
        admin = f"{s.status}, stock {'died: ' + exc if died else 'alive'}"
    if stock.get("skipped"):
        lines.append("fuzz: stock replay not run (DSV41_FUZZ_STOCK=1 runs it: 1-2 more boots)")
    else:
        lines.append(f"fuzz: stock replayed {len(stock['sent'])} distinct bodies of {len({s.key for s in sent})} "
                     f"on {stock['boots']} boots in {stock['seconds']:.0f} s; then POST {ADMIN} (no body): "
                     f"{admin}" + (f"; stock boot failed: {stock['boot_error']}" if stock["boot_error"] else ""))
    lines.append(f"fuzz: the stream beside got all {BESIDE_TOKENS} tokens in "
                 f"{sum(r == (200, BESIDE_TOKENS) for r in runs.get('beside', []))} of "
                 f"{len(runs.get('beside', []))} streams")
    statuses = collections.Counter(str(s.status) + (" cut" if s.cut else "") for s in sent)
    lines.append(f"fuzz: production answers {dict(sorted(statuses.items()))} in {runs['fuzz_s']:.0f} s; "
                 f"bodies: {runs['tmp'] / 'bodies.json'}")
    for form in dict.fromkeys(FORMS):
        of = [s for s in sent if s.form == form and s.route in SERVED]
        lines.append(f"fuzz: {form} bodies on the {len(SERVED)} generating routes: "
                     f"{dict(sorted(collections.Counter(str(s.status) for s in of).items()))}")
    if runs["death"] is not None:
        d = runs["death"]
        lines.append(f"  production DIED on {d.sent.show()}\n    {d.exception}")
    shown = set()
    for s in sent:
        if (isinstance(s.status, str) or s.status >= 500) and s.key not in shown:
            shown.add(s.key)
            times = sum(1 for o in sent if o.key == s.key)
            lines.append(f"  production {s.status} on {s.show()}{f' ({times} times)' if times > 1 else ''}"
                         f"\n    answer: {s.text[:200]}\n    {s.exception}")
    for d in deaths:
        lines.append(f"  stock (boot {d.boot}) died on {d.sent.show()}\n    {d.exception}")
    return lines


def test_production_survives_the_fuzz_stock_reported(runs, capsys):
    with capsys.disabled():
        print("\n" + "\n".join(_report(runs)))
    assert runs["death"] is None, (runs["death"].sent.show(), runs["death"].exception)
    assert not runs["dead"], runs["dead"]
    assert runs["healthy"]
    per_route = collections.Counter(s.route for s in runs["sent"])
    assert per_route == {r: PER_ROUTE for r in ROUTES}, per_route
    beside = runs["beside"]
    assert beside and all(r == (200, BESIDE_TOKENS) for r in beside), beside
    # every generating route served its valid sampled bodies (temperature > 0 with top-k, top-p,
    # min-p): the guards pass them and the engine's sampling path ran
    served = [s for s in runs["sent"] if s.form == "served"]
    assert {s.route for s in served} == set(SERVED), served
    assert all(s.status == 200 and not s.cut for s in served), [
        (s.status, s.show(300), s.text[:300]) for s in served if s.status != 200 or s.cut]
    cmp = traffic.compare(runs["before"], runs["after"])
    assert cmp.ok, cmp
    errors = [ln for ln in runs["sched_log"].splitlines() if any(p in ln for p in SCHED_ERRORS)]
    assert not errors, (errors, runs["prod_exception"])
    # issue 50: no 5xx but the server's own faults, counted per route
    fives = [s for s in runs["sent"] if isinstance(s.status, int) and s.status >= 500]
    per_route = collections.Counter(s.route for s in fives)
    with capsys.disabled():
        print(f"fuzz: 5xx per route {dict(sorted(per_route.items())) or 0} of "
              f"{dict(sorted(collections.Counter(s.route for s in runs['sent']).items()))}")
    client_faults = [s for s in fives if not any(f in s.exception for f in SERVER_FAULTS)]
    assert not client_faults, [(s.route, s.status, s.show(200), s.exception) for s in client_faults[:5]]
