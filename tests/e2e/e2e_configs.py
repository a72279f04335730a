"""Shared by the e2e tests: real `sglang.launch_server` processes on this CPU machine, HTTP API only.

One boot per configuration per test session: `boots.run(model, keys, args)` boots a server,
runs the canary's traffic through it (adapter/tools/canary.py), stops it (whole process group)
and caches the result; every test that needs that configuration reads the cached run. The canary
test passes `boots.run` to `dsv41 canary`, so its control and production boots are shared too.

Boots that can show something another boot shows too are not made (issue 26): swan alone
(torch_native never calls the SM120 entry), swa_thin / swa_cone alone on the dense model (both
decline at once), decode_yield alone and swa_cone alone on the hybrid-SWA model (the production
boot shows them: the yield lines, cone's decline), decode_yield at another share (the unit test
test_share_50_yields_more_than_33 on the engine's scheduler; the real server's planner answering
its cost model: test_e2e_calibrate). Some boots carry more than the canary traffic:
- the production line boots with --enable-metrics; after the traffic every admin route is sent
  one request with no key (tests/e2e/test_e2e_admin.py: 403, still serving), then /metrics is
  scraped (tests/e2e/test_e2e_metrics.py reads it; the canary report is the same with or without
  it);
- swa_thin on the hybrid-SWA model boots without the flag but with a PROMETHEUS_MULTIPROC_DIR of
  the session's own (metrics off: nothing exported, imported or written);
- decode_yield on the dense model also runs the calibration traffic
  (tests/e2e/test_e2e_calibrate.py fits its scheduler log).
Every process of every boot reports who imports prometheus_client (DSV41CPU_WATCH_IMPORTS).

Configurations come from the production profile (.env.tp4.example): stock = no DSV41 keys with
the control line's CPU launch args; "each adapter on" = that adapter's keys from the production
line with the production line's CPU launch args; production = the whole line.
"""
import concurrent.futures
import functools
import pathlib
import sys
import threading

REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO_ROOT))

from adapter import keys as key_registry  # noqa: E402
from adapter.tools import canary, profile  # noqa: E402

PROFILE = REPO_ROOT / ".env.tp4.example"
# Figures a test measured, printed in the session's summary (tests/e2e/conftest.py) so a run without
# -s shows them: the gate's planted candidate speed ratio (issue 40).
SUMMARY_LINES: list[str] = []
MODELS = ("dense", "dsv41")         # the swa (Mellum) model: the faults test's own boots only;
                                   # dsv4 (DeepSeek-V4): its stock boot (test_e2e_dsv4.py) and
                                   # the swan self-check's own boots


def _lines():
    prod_keys, prod_args, _ = canary.split_line(profile.load_line(PROFILE, "production"))
    ctrl_keys, ctrl_args, _ = canary.split_line(profile.load_line(PROFILE, "control"))
    return prod_keys, prod_args, ctrl_keys, ctrl_args


PROD_KEYS, PROD_ARGS, CTRL_KEYS, CTRL_ARGS = _lines()


def adapter_keys(adapter: str) -> dict:
    names = {k.name for k in key_registry.KEYS if k.adapter == adapter}
    return {k: v for k, v in PROD_KEYS.items() if k in names}


# decode yield alone: its cost model alone, without the production line's online calibration
# (DSV41_DECODE_YIELD_ONLINE), so its plans are the model's own, deterministic in the scheduler's
# state: test_e2e_calibrate compares them with the model's planner, test_e2e_effects with the
# control's chunks. The online plans are the production boots' (test_e2e_effects on dsv4, the
# canary's achieved share, test_e2e_tp2's two ranks).
YIELD_ALONE_KEYS = {k: v for k, v in adapter_keys("decode_yield").items()
                    if k != "DSV41_DECODE_YIELD_ONLINE"}

CONFIGS = {   # name -> (keys, args)
    "stock": ({}, CTRL_ARGS),
    "production": (PROD_KEYS, PROD_ARGS),
    "decode_yield": (YIELD_ALONE_KEYS, PROD_ARGS),
    **{a: (adapter_keys(a), PROD_ARGS) for a in ("swa_thin", "swa_cone")},
    # autotune_keep alone is the control line (its only key): shared with the canary's control.
    "autotune_keep": (CTRL_KEYS, CTRL_ARGS),
    # cone's negative control: the production line with a test-only switch that skips the copy of
    # the resident latents / index keys (the replay rows keep stale ones): must differ.
    "cone_no_copy": ({**PROD_KEYS, "DSV41_SWA_CONE_TEST_NO_COPY": "1"}, PROD_ARGS),
    # and one that skips the write mask (the replay rows write their own latents over the copied
    # ones): must differ too (issue 48: beside the engine's decoder SWA bounded replay)
    "cone_no_mask": ({**PROD_KEYS, "DSV41_SWA_CONE_TEST_NO_MASK": "1"}, PROD_ARGS),
    # a second stock boot with another engine seed (the equality set only): the noise floor
    # (tests/e2e/test_e2e_server.py test_two_stock_boots_are_identical)
    "stock_again": ({}, {**CTRL_ARGS, "--random-seed": "7"}),
}
SCENARIOS = {"cone_no_copy": ("window",), "cone_no_mask": ("window",),
             "stock_again": ("equality",)}   # else the default set
# Which adapter-alone configurations each model boots (T=0 equality with stock and the effects).
# Issue 48: the scenarios that ran on the tiny DeepSeek-V4 run on the tiny V4.1 (the model the
# line serves, with the engine's decoder SWA bounded replay on); dsv4 keeps its stock boot for what
# V4.1 does not have (c4 / c128 layers, the compressor's state ring: test_e2e_dsv4.py).
ALONE = {"dense": ("decode_yield", "autotune_keep", "stock_again"),
         "dsv4": (),
         "dsv41": ("autotune_keep", "cone_no_copy", "cone_no_mask")}
# The T=0 reference each model's configurations are compared with: stock, or on the tiny
# DeepSeek-V4.1 the control line (autotune_keep alone, which has no autotune cache to act on
# here: it computes as stock), one boot fewer.
REFERENCE = {"dense": "stock", "dsv41": "autotune_keep"}
WATCH = "prometheus_client"


@functools.lru_cache(maxsize=1)
def admin_requests() -> tuple:
    """(method, path) of every route the engine marks ADMIN_OPTIONAL, each of its methods, a path
    parameter filled with "x"; /dump_expert_distribution_record (it kills stock) first. The dense
    production boot is the line exactly (its scenarios flush nothing, canary.FLUSHING), so
    /flush_cache is closed there too."""
    import re

    from adapter import admin_guard
    from adapter.cpu import cpu_engine

    cpu_engine.install_torchvision_shim()
    from sglang.srt.entrypoints.http_server import app

    out = [(m, re.sub(r"\{[^}]+\}", "x", r.path)) for r in admin_guard.admin_routes(app)
           if r.level == "admin_optional" for m in r.methods]
    return tuple(sorted(out, key=lambda mp: mp != ("POST", "/dump_expert_distribution_record")))


def _production(server) -> dict:
    """The production boot, after the traffic: every admin route with no key (admin_guard: 403,
    the server still serving: tests/e2e/test_e2e_admin.py), then /metrics (test_e2e_metrics.py),
    so the refusals are on it."""
    return dict(admin=canary.admin_probe(server, admin_requests()), **_scrape(server))


def _scrape(server) -> dict:
    import requests

    resp = requests.get(server.url + "/metrics", timeout=30)
    (server.log_dir / "metrics.txt").write_text(resp.text)       # beside the process logs
    return {"metrics_status": resp.status_code, "metrics_text": resp.text}


# What the engine resolved for a DeepSeek-V4.1 boot (its /server_info: the launcher's resolved
# server args, from which each scheduler's get_exec().features are built).
SERVER_INFO_FIELDS = ("enable_decoder_swa_bounded_replay", "enable_encoder_swa_bounded_replay",
                      "dsv4_attn_backend", "swa_full_tokens_ratio", "page_size", "kv_cache_dtype",
                      "attention_backend", "chunked_prefill_size")


def _with_server_info(inner, server) -> dict:
    """After the traffic: `inner`'s extras (None: nothing) plus the resolved SERVER_INFO_FIELDS."""
    import requests

    out = dict(inner(server) if inner is not None else {})
    info = requests.get(server.url + "/server_info", timeout=30).json()
    out["server_info"] = {k: info.get(k) for k in SERVER_INFO_FIELDS}
    return out


class Boots:
    """The session's shared runs, by configuration key. `prefetch(wanted)` boots the listed
    configurations one at a time in a background lane (one thread, one server at a time) while
    the tests run in the main thread, most of them booting servers of their own (tests/e2e/
    conftest.py orders them so): two servers at once at most. A test that needs a configuration
    waits for the lane's run of it, or runs it itself when the lane has not started it."""

    def __init__(self, tmp_dir=None):
        self.runs = {}
        self.boots = {}
        self.tmp_dir = tmp_dir
        self._lock = threading.Lock()
        self._queued = {}            # key -> Future of the lane's run
        self._lane = None

    def prefetch(self, wanted) -> None:
        """wanted: [(model, config name)] in the order the lane boots them."""
        for model, name in wanted:
            self._queue(*self._config_call(model, name))

    def submit_job(self, name, fn) -> None:
        """A module's own boots (conftest: its LANE_JOBS) run in the lane too, after the configurations."""
        self._queue(("job", name), functools.partial(self._job, name, fn))

    def _queue(self, key, call) -> None:
        with self._lock:
            if self._lane is None:
                self._lane = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="e2e-boot-lane")
            if key not in self.runs and key not in self._queued:
                self._queued[key] = self._lane.submit(call)

    def job(self, name, fn):
        """The result of a module's job: the lane's run (waited for) or one in this thread."""
        return self._get(("job", name), functools.partial(self._job, name, fn))

    def _job(self, name, fn):
        result = fn()
        with self._lock:
            self.runs[("job", name)] = result
        return result

    def close(self) -> None:
        """Cancel what the lane has not started and wait for the run it is in (stopped servers)."""
        if self._lane is not None:
            self._lane.shutdown(wait=True, cancel_futures=True)

    def _extras(self, model, keys, args):
        """(args, extra_env, on_server, scenarios) this session adds to a configuration."""
        env, on_server, add = {"DSV41CPU_WATCH_IMPORTS": WATCH}, None, ()
        if keys == canary.model_keys(model, PROD_KEYS)[0]:
            args, on_server = dict(args, **{"--enable-metrics": ""}), _production
        elif model == "dense" and keys == YIELD_ALONE_KEYS:
            # + the calibration traffic; and the metrics-off boot: no flag, but a
            # PROMETHEUS_MULTIPROC_DIR of the session's own (nothing exported, imported, written)
            add = ("calibration",)
            if self.tmp_dir is not None:
                prom = self.tmp_dir / "prometheus-multiproc-decode-yield"
                prom.mkdir(parents=True, exist_ok=True)
                env["PROMETHEUS_MULTIPROC_DIR"] = str(prom)

                def on_server(server, prom=prom):
                    return dict(_scrape(server), prometheus_dir=str(prom))
        if model == "dsv41":
            on_server = functools.partial(_with_server_info, on_server)
        return args, env, on_server, add

    def run(self, model, keys, args, progress=None, name="", scenarios=None):
        key = canary.config_key(model, keys, args)
        return self._get(key, functools.partial(self._run, key, model, keys, args, progress, name, scenarios))

    def config(self, model, name):
        return self._get(*self._config_call(model, name))

    def _get(self, key, call):
        """The run of `key`: the lane's (waited for), or one in this thread when the lane has not
        started it. Every run of a key goes through one Future in `_queued`, the lane's or one made
        here and marked running before the lock is released, so a second caller (or a queueing
        that comes late) waits for that run instead of starting another: one run per key,
        whatever the threads' interleaving (tests/test_e2e_lane.py)."""
        with self._lock:
            if key in self.runs:
                return self.runs[key]
            queued = self._queued.get(key)
            mine = None
            if queued is None or queued.cancel():
                mine = concurrent.futures.Future()
                mine.set_running_or_notify_cancel()      # cancel() of it now returns False
                self._queued[key] = mine
        if mine is None:
            return queued.result()          # the lane runs it (or ran it): wait for that run
        try:
            result = call()
        except BaseException as exc:
            mine.set_exception(exc)
            raise
        mine.set_result(result)
        return result

    def _run(self, key, model, keys, args, progress, name, scenarios):
        if scenarios is None:
            # Stream cadence only where decode yield is on or for the control it is read
            # against (the canary's report; the effects test's chunk boundaries).
            cadence = (keys == CTRL_KEYS or "DSV41_DECODE_YIELD" in keys or
                       (model in ("dsv4", "dsv41") and not keys))
            scenarios = ("equality", "window", "idle") + (("cadence",) if cadence else ())
        run_args, env, on_server, add = self._extras(model, keys, args)
        run = canary.run_config(model, keys, run_args, scenarios=tuple(scenarios) + add,
                                progress=progress or _progress, name=name or model,
                                extra_env=env, on_server=on_server)
        with self._lock:
            self.boots[key] = self.boots.get(key, 0) + 1
            self.runs[key] = run
        return run

    def _config_call(self, model, name):
        """(key, a call that runs it) of a named configuration (CONFIGS) on a model."""
        assert name in ("stock", "production") or name in ALONE[model], \
            f"{model} {name}: not booted in this session (tests/e2e/e2e_configs.py ALONE)"
        keys, args = CONFIGS[name]
        keys = canary.model_keys(model, keys)[0]
        scenarios = SCENARIOS.get(name)
        key = canary.config_key(model, keys, args)
        return key, functools.partial(self._run, key, model, keys, args, None, f"{model} {name}", scenarios)


def _progress(msg):
    sys.stderr.write(f"[e2e] {msg}\n")
