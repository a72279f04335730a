"""`dsv41 canary`: boot a profile line and its control line in a real SGLang server on this CPU
machine, run the same traffic through both, and report per adapter.

For each model (dense Llama-shaped, hybrid-SWA Mellum-shaped: adapter/cpu/models.py) it boots the
control line, runs the traffic, stops it, then does the same for the chosen line
(adapter/cpu/server.py: production install path, one process group, per-process logs). Only the
lines' DSV41_* keys and the launch arguments that mean something on one CPU rank are used; every
other variable and argument is listed as ignored, with the reason. The harness adds no DSV41_*
key; what a boot has that its line has not (a key scaled to a tiny model's pools, the engine's own
--admin-api-key where the harness empties the cache of a line that closes the admin routes:
FLUSHING) is listed as scaled, with the reason.

Per adapter: installed (per process), receipt and fallback lines seen, T=0 equality (n of n
records, token ids equal and logprobs within traffic.LOGPROB_TOL), the measured effect (stream
cadence during a chunked prefill, resume cached tokens, cone plans; input_guard: one request with
a prompt id outside the vocabulary, sent to the line's boot, must get 400 and the server go
on serving; admin_guard: one admin request with no key, POST /dump_expert_distribution_record, sent
to the line's boot last, must get 403 naming --admin-api-key and the server go on serving; not
sent to a boot that carries the harness's admin key),
errors. Exit 0 only when every enabled adapter installed where it acts (the scheduler;
input_guard, admin_guard: the launcher), outputs are equal and no request failed.
"""
from __future__ import annotations

import dataclasses
import json
import pathlib
import re
import sys
import tempfile
import time
from typing import Callable, Optional

from adapter import keys as key_registry
from adapter.table import ADAPTERS, COUNTING_ROLE
# The line helpers live in the leaf module the gate shares; named here too for the canary's callers.
from adapter.tools.lines import (IGNORED_WHY, KEPT_ARGS, MODEL_ARGS, cpu_models,  # noqa: F401
                                 load_checked_lines, split_line)

# The dense cadence prompt: 12,288 tokens, three 4,096-token chunks. Sized so that no chunk it
# yields after is worth more than decode yield's 128-step cap on this 2-core machine (a CPU decode
# step is ~3 ms, a 4,096-token chunk at prefix 4K ~0.4 s; at 24,576 tokens the chunks past prefix
# 8K are worth 150-250 steps, the cap cuts them and the share falls to ~0.25 by design:
# docs/decode_yield.md "On this machine"). On the cluster a chunk is worth 10-25 steps.
CADENCE_PREFILL = {"dense": 12288}
# DeepSeek-V4.1: the engine's own SWA bounded replays, as each boot resolved them, are printed
# (the decoder one is the engine's default on the cluster; the harness sets it: adapter/cpu/server.py).
REPLAY_MODELS = ("dsv41",)
# The T=0 comparison's logprob tolerance where the model's numbers move with the batch's shape
# (else traffic.LOGPROB_TOL). The tiny DeepSeek-V4.1 (bf16 activations, fp32 mHC mixes): torch's
# fp32 linear on CPU takes another kernel for one row than for several (a row alone differed from
# the same row in a batch of two in 4-14 of 4-24 outputs), and decode yield changes the decode
# batches by design, so a logprob moved by up to 1.7e-3 with its ids equal (3 of 9 pairs,
# docs/cpu_server.md); ids must still be equal everywhere.
LOGPROB_TOL = {"dsv41": 1e-2}
BOUNDED_REPLAY_FIELDS = ("enable_decoder_swa_bounded_replay", "enable_encoder_swa_bounded_replay")
# Keys scaled to a CPU model's pools, by model: {key: (value, why)}. The tiny DeepSeek-V4's full
# pool is 8192 tokens, so the profile's cone replay of 8192 would start every replay at 0, never
# past the stock hit, and cone would decline everywhere (traffic.DSV4_CONE_TOKENS says why 512).
SCALED_KEYS = {"dsv4": {"DSV41_SWA_CONE_TOKENS": (
    "512", "the tiny DeepSeek-V4's pool holds 8192 tokens: a replay of the profile's N would "
           "start at 0 (cone declines); 512 = one chunk, past the model's 3-layer receptive cone")}}
SCALED_KEYS["dsv41"] = {"DSV41_SWA_CONE_TOKENS": (
    "512", "the tiny DeepSeek-V4.1's pool holds 8192 tokens: a replay of the profile's N would "
           "start at 0 (cone declines); 512 = one chunk")}
# input_guard's effect: one /generate whose prompt holds an id outside the vocabulary, sent to the
# line's boot after its other traffic (stock 0.5.23's scheduler dies on it; it is not sent to the
# control, whose traffic and logs the report compares; tests/e2e/test_e2e_faults.py shows it).
BAD_PROMPT = [5, 6, 5_000_000]
# admin_guard's effect: one admin request with no key, sent to the line's boot after its other
# traffic (stock 0.5.23's scheduler dies on this one: expert_distribution.py _on_not_implemented;
# it is not sent to the control).
ADMIN_REQUEST = ("POST", "/dump_expert_distribution_record")
# The scenarios that empty the radix cache first (CpuServer.flush_cache, an admin route), by the
# models they flush on. A boot that runs one, of a line that closes the admin routes (admin_guard,
# no --admin-api-key), gets the engine's own --admin-api-key (a random key per boot, CpuServer
# admin_calls), printed as a difference from the line; its admin routes are then keyed, not the
# line's, so admin_guard's probe is not sent there. The dense model's scenarios need no flush: its
# cadence prompt shares no prefix with the equality traffic (page 1: a first token in common
# would) and the pool evicts that traffic as it fills, so a dense boot is the line exactly.
FLUSHING = {"window": ("swa", "dsv4", "dsv41"), "idle": ("swa", "dsv4", "dsv41"),
            "cadence": ("dsv4", "dsv41"),
            "calibration": ("dense", "swa", "dsv4")}
HARNESS_ADMIN_KEY = ("the harness empties the radix cache between its scenarios through the "
                     "engine's admin route /flush_cache with the engine's own admin key, as an "
                     "operator would; admin_guard then leaves the admin routes to the engine (keyed) "
                     "on this boot, so its probe (403 without a key) runs on the boots that add "
                     "nothing (dense)")
AGREE_ENV = "DSV41CPU_AUTOTUNE_AGREE"      # --nodes: adapter/cpu/autotune_agree.py


def install_process(adapter: str) -> str:
    """The process an adapter must install in to act: its counting role's (adapter/table.py
    COUNTING_ROLE): "launcher" (HTTP + tokenizer manager) for "tokenizer", else "scheduler"."""
    return "launcher" if COUNTING_ROLE.get(adapter, "scheduler") == "tokenizer" else "scheduler"


def model_keys(model: str, keys: dict) -> tuple[dict, dict]:
    """(the keys a CPU model boots with, {"KEY a -> b": why} for each one SCALED_KEYS changed):
    a key is scaled only where the line sets it."""
    out, notes = dict(keys), {}
    for key, (value, why) in SCALED_KEYS.get(model, {}).items():
        if key in out and out[key] != value:
            notes[f"{key} {out[key]} -> {value} ({model})"] = why
            out[key] = value
    return out, notes


def config_key(model: str, keys: dict, args: dict) -> tuple:
    return (model, tuple(sorted(keys.items())), tuple(sorted(args.items())))


@dataclasses.dataclass
class ConfigRun:
    """One boot of one configuration and the traffic it served."""
    model: str
    keys: dict
    args: dict
    boot_s: float = 0.0
    exit_code: Optional[int] = None
    records: list = dataclasses.field(default_factory=list)      # traffic.Record
    window: Optional[dict] = None                                 # traffic.window_resume
    beside: Optional[dict] = None             # traffic.decode_beside_chunked_prefill (dsv4)
    idle: Optional[dict] = None                                   # traffic.idle_session_resume
    cadence: Optional[dict] = None                                # traffic.yield_cadence
    logs: dict = dataclasses.field(default_factory=dict)          # "<role> pid N" -> text
    errors: list = dataclasses.field(default_factory=list)
    log_dir: str = ""
    extras: dict = dataclasses.field(default_factory=dict)       # what on_server() returned
    bad_input: Optional[dict] = None                              # bad_input_probe (input_guard)
    admin: Optional[dict] = None                                  # admin_probe (admin_guard)
    harness_args: dict = dataclasses.field(default_factory=dict)  # launch args the harness added
    metrics: str = ""        # the engine's /metrics after the traffic (boots with --enable-metrics)

    def lines(self, role_prefix: str = "") -> list[str]:
        return [ln for role, text in self.logs.items() if role.startswith(role_prefix)
                for ln in text.splitlines()]

    def dsv41_lines(self, adapter: str, role_prefix: str = "") -> list[str]:
        tag = f"[dsv41] {adapter} "
        return [ln[ln.index(tag):] for ln in self.lines(role_prefix) if tag in ln]

    def samples(self, name: str, **labels) -> list:
        """The samples of a series on the scraped /metrics whose labels include `labels`
        (prometheus_client's own text parser); [] when the boot was not scraped."""
        if not self.metrics:
            return []
        from prometheus_client.parser import text_string_to_metric_families

        return [s for family in text_string_to_metric_families(self.metrics) for s in family.samples
                if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())]

    def metric(self, name: str, **labels) -> Optional[float]:
        """Sum of a series' samples (samples()); None when not scraped or the series is absent."""
        found = self.samples(name, **labels)
        return sum(s.value for s in found) if found else None

    def metric_labels(self, name: str, label: str, **labels) -> dict:
        """{value of `label`: summed samples} of a series (e.g. fallbacks by reason)."""
        out: dict = {}
        for s in self.samples(name, **labels):
            out[s.labels.get(label)] = out.get(s.labels.get(label), 0) + s.value
        return out

    def installed_in(self, adapter: str) -> dict[str, bool]:
        out = {}
        for role, text in self.logs.items():
            name = _role(role)
            if name is None:
                continue
            out[name] = out.get(name, False) or f"[dsv41] {adapter} installed:" in text
        return out


def _role(log_name: str) -> Optional[str]:
    """'sglang::scheduler_TP1 pid 9' -> 'scheduler_TP1'; launcher/detokenizer likewise."""
    if log_name.startswith("launcher (HTTP"):
        return "launcher"
    match = re.match(r"sglang::(\S+)", log_name)
    return match.group(1) if match else None


_ERROR_PATTERNS = ("Scheduler hit an exception", "Traceback (most recent call last)")


def _log_errors(logs: dict) -> list[str]:
    """Errors in the engine's own processes (the launcher's benign freeze_gc race is not one:
    with --skip-server-warmup the engine posts /freeze_gc before uvicorn listens)."""
    found = []
    for role, text in logs.items():
        if _role(role) in (None, "launcher"):
            continue
        found += [f"{role}: {ln.strip()[:200]}" for ln in text.splitlines()
                  if any(p in ln for p in _ERROR_PATTERNS)]
    return found


def bad_input_probe(server) -> dict:
    """One /generate with BAD_PROMPT, then /health and one good request: what the server answered
    and whether it kept serving."""
    import requests

    out = {"request": f"/generate input_ids {BAD_PROMPT}"}
    try:
        resp = requests.post(server.url + "/generate", timeout=120, json={
            "input_ids": BAD_PROMPT, "sampling_params": {"max_new_tokens": 4, "temperature": 0.0}})
        out["status"] = resp.status_code
        try:
            out["message"] = str(resp.json().get("error", {}).get("message", ""))[:200]
        except ValueError:
            out["message"] = resp.text[:200]
    except requests.RequestException as exc:
        out["status"] = f"no answer ({type(exc).__name__})"
    return _served_after(server, out)


def _served_after(server, out: dict) -> dict:
    """out + served_after: /health 200 and one greedy request answered in full (after_error: why not)."""
    import requests

    from adapter.cpu.server import output_of

    try:
        healthy = requests.get(server.url + "/health", timeout=30).status_code == 200
        ids, _ = output_of(server.generate([5, 6, 7], max_new_tokens=4, timeout=120))
        out["served_after"] = healthy and len(ids) == 4
    except Exception as exc:  # noqa: BLE001 - a dead server is the finding
        out["served_after"] = False
        out["after_error"] = f"{type(exc).__name__}: {exc}"[:200]
    return out


def admin_probe(server, requests_=(ADMIN_REQUEST,)) -> dict:
    """Admin requests with no key (method, path; in order, stopping at the first one not answered
    403: it acted), then /health and one greedy request: what the server answered and whether it
    kept serving."""
    import requests

    out = {"requests": [], "statuses": {}}
    for method, path in requests_:
        name = f"{method} {path}"
        out["requests"].append(name)
        try:
            resp = requests.request(method, server.url + path, timeout=120)
            out["statuses"][name] = resp.status_code
            if resp.status_code == 403 and "message" not in out:
                try:
                    out["message"] = str(resp.json().get("error", ""))[:300]
                except ValueError:
                    out["message"] = resp.text[:300]
        except requests.RequestException as exc:
            out["statuses"][name] = f"no answer ({type(exc).__name__})"
        if out["statuses"][name] != 403:
            break
    return _served_after(server, out)


def flushes(model: str, scenarios) -> bool:
    """Whether these scenarios empty the radix cache on this model (FLUSHING)."""
    return any(model in FLUSHING.get(name, ()) for name in scenarios)


def harness_arg_why(model: str, flag: str) -> str:
    """Why the harness added `flag` to a boot of `model`: the admin key (HARNESS_ADMIN_KEY), or
    the reason adapter/cpu/server.py MODEL_HARNESS_ARGS gives (the engine's V4.1 defaults)."""
    from adapter.cpu.server import ADMIN_KEY_FLAG, MODEL_HARNESS_ARGS

    if flag == ADMIN_KEY_FLAG:
        return HARNESS_ADMIN_KEY
    return MODEL_HARNESS_ARGS.get(model, {}).get(flag, ("", "added by the CPU harness"))[1]


def run_config(model: str, keys: dict, args: dict, *,
               scenarios=("equality", "window", "idle", "cadence", "bad_input", "admin"),
               progress: Optional[Callable[[str], None]] = None, name: str = "",
               extra_env: Optional[dict] = None,
               on_server: Optional[Callable[[object], dict]] = None, nodes: int = 1,
               cadence_prefill: Optional[int] = None, admin_calls: Optional[bool] = None) -> ConfigRun:
    """Boot, run the traffic, stop; never leaves a process behind.

    scenarios may add "calibration" (traffic.calibration_run, for `dsv41 calibrate yield`);
    "bad_input" (bad_input_probe) runs only where the keys enable input_guard, "admin"
    (admin_probe, last) only where they enable admin_guard;
    extra_env goes to the server's environment (harness switches); on_server(server), called
    after the traffic while the server still runs, returns what lands in run.extras.
    nodes > 1: the production topology on this machine, one launch process per node
    (CpuServer(nodes=...): --nnodes, --node-rank, --dist-init-addr on 127.0.0.1); --tp-size is
    taken from args. cadence_prefill: the cadence prompt's tokens (default CADENCE_PREFILL).
    admin_calls: the harness calls admin routes on this boot (CpuServer admin_calls; default:
    whether the scenarios flush on this model, flushes()); an on_server that calls one passes
    True. What the harness added to the line is in run.harness_args (the key's value masked)."""
    from adapter.cpu.server import ADMIN_KEY_FLAG, DEEPSEEK_MODELS, BootError, CpuServer
    from adapter.tools import traffic

    say = progress or (lambda msg: None)
    merged = dict(MODEL_ARGS[model])
    merged.update(args)
    run = ConfigRun(model, dict(keys), dict(args))
    calls = flushes(model, scenarios) if admin_calls is None else admin_calls
    server = CpuServer(model, keys=keys, args=merged, name=re.sub(r"[^A-Za-z0-9_.-]+", "-", name or model),
                       extra_env=dict(extra_env or {}), nodes=nodes, admin_calls=calls)
    began = time.monotonic()
    try:
        say(f"{name or model}: booting ({model} model, {len(keys)} DSV41 keys)")
        server.start()
        # the admin key's value masked; the harness's per-model args as they are ("" = a switch)
        run.harness_args = {flag: "<random per boot>" if flag == ADMIN_KEY_FLAG else (value or "on")
                            for flag, value in server.harness_args.items()}
        run.boot_s = round(server.boot_s, 1)
        say(f"{name or model}: up in {run.boot_s:.0f}s; equality traffic")
        chunk = int(merged["--chunked-prefill-size"])
        if "equality" in scenarios:
            run.records = traffic.equality_run(server, chunk, one_batch=model in DEEPSEEK_MODELS)
        window = {"swa": traffic.window_resume, "dsv4": traffic.dsv4_window_resume,
                  "dsv41": traffic.dsv41_window_resume}.get(model)
        if "window" in scenarios and window is not None:
            server.flush_cache()
            say(f"{name or model}: lost-window resume")
            run.window = window(server)
        idle = {"swa": traffic.idle_session_resume, "dsv4": traffic.dsv4_idle_session_resume,
                "dsv41": traffic.dsv41_idle_session_resume}.get(model)
        if "idle" in scenarios and idle is not None:
            server.flush_cache()
            say(f"{name or model}: idle session resume after sub-agent turns")
            run.idle = idle(server)
        if "cadence" in scenarios and model in DEEPSEEK_MODELS:
            server.flush_cache()
            say(f"{name or model}: a decode stream beside a chunked prefill")
            run.beside = traffic.decode_beside_chunked_prefill(server)
        if "cadence" in scenarios and model in CADENCE_PREFILL:
            prefill = cadence_prefill or CADENCE_PREFILL[model]
            say(f"{name or model}: stream cadence during a {prefill}-token prefill")
            run.cadence = traffic.yield_cadence(server, prefill)
        if "calibration" in scenarios:
            say(f"{name or model}: calibration traffic")
            calibrate = traffic.dsv4_calibration_run if model == "dsv4" else traffic.calibration_run
            run.extras["calibration_sent"] = calibrate(server)
        if "bad_input" in scenarios and key_registry.parse_env(keys).enabled("input_guard"):
            say(f"{name or model}: one request with a prompt id outside the vocabulary")
            run.bad_input = bad_input_probe(server)
        if "admin" in scenarios and key_registry.parse_env(keys).enabled("admin_guard"):
            if ADMIN_KEY_FLAG in server.harness_args:
                run.admin = {"skipped": "not sent: the boot carries the harness's --admin-api-key "
                                        "(scaled), so its admin routes are keyed, not the line's"}
            else:
                say(f"{name or model}: one admin request with no key")
                run.admin = admin_probe(server)
        if "--enable-metrics" in merged:
            import requests

            run.metrics = requests.get(server.url + "/metrics", timeout=30).text
        if model in REPLAY_MODELS:
            # what the engine resolved for this boot (its /server_info: the launcher's resolved
            # server args, which every scheduler's get_exec().features is built from)
            import requests

            info = requests.get(server.url + "/server_info", timeout=30).json()
            run.extras["bounded_replay"] = {k: info.get(k) for k in BOUNDED_REPLAY_FIELDS}
        if on_server is not None:
            run.extras.update(on_server(server) or {})
    except BootError as exc:
        # the headline with the server's own error lines (the refusal first) and its log dir
        run.errors.append(f"boot failed: {exc.summary()}")
    except Exception as exc:  # noqa: BLE001 - a failed request is a finding, reported
        run.errors.append(f"request failed: {type(exc).__name__}: {exc}")
    finally:
        server.stop()
        run.exit_code = server.returncode
        run.logs = server.process_logs()
        run.log_dir = str(server.log_dir)
        run.errors += _log_errors(run.logs)
        say(f"{name or model}: stopped ({time.monotonic() - began:.0f}s)")
    return run


# --- per-adapter report ----------------------------------------------------------------------

def _ranks(run: ConfigRun) -> list[str]:
    """The scheduler roles of a run with more than one TP rank: scheduler_TP0, scheduler_TP1, ..."""
    return sorted({r for r in (_role(n) for n in run.logs) if r and r.startswith("scheduler_TP")})


def rank_decisions(run: ConfigRun) -> dict:
    """decode_yield's per-prompt lines of each rank, without timestamps."""
    return {r: [ln for ln in run.dsv41_lines("decode_yield", f"sglang::{r}") if " rid=" in ln]
            for r in _ranks(run)}


def rank_agreement(run: ConfigRun) -> dict:
    """Each rank's autotune agreement rounds (adapter/cpu/autotune_agree.py), as "kept"/"absent"."""
    out = {}
    for r in _ranks(run):
        found = [re.search(r"autotune agreement round \d rank \d+: cache (\w+)", ln)
                 for ln in run.lines(f"sglang::{r}")]
        out[r] = [m.group(1) for m in found if m]
    return out


ACHIEVED_RE = re.compile(r"achieved share (\d+\.\d+) \(configured (\d+\.\d+)\) by the engine's "
                         r"step timings: decode (\d+\.\d+) s over \d+ steps, prefill (\d+\.\d+) s")
CAPPED_RE = re.compile(r"; (\d+) of (\d+) chunks capped at (\d+) steps")
CHUNKS_RE = re.compile(r"(\d+) chunks yielded")
SCALES_RE = re.compile(r"online scales at its last arming: chunk x(\S+), decode step x([^;]+);")


def yield_shares(run: ConfigRun) -> dict:
    """decode yield's achieved share by the engine's own step timings (the per-prompt lines of
    the first scheduler: every rank logs the same decisions): over all the boot's yielded prompts,
    decode time / (decode + prefill time) of their windows (a long prompt weighs by its time), each
    prompt's own, and the configured share."""
    share = run.keys.get("DSV41_DECODE_YIELD")
    lines = run.dsv41_lines("decode_yield", "sglang::scheduler")
    ranks = _ranks(run)
    if ranks:
        lines = run.dsv41_lines("decode_yield", f"sglang::{ranks[0]}")
    measured = [(ln, m) for ln, m in ((ln, ACHIEVED_RE.search(ln)) for ln in lines) if m]
    found = [m for _, m in measured]
    decode, prefill = (sum(float(m.group(k)) for m in found) for k in (3, 4))
    capped = [m for m in (CAPPED_RE.search(ln) for ln, _ in measured) if m]
    return {"configured_share": int(share) / 100 if share else None,
            "achieved_share_engine": round(decode / (decode + prefill), 4) if found and decode + prefill > 0 else None,
            "achieved_share_engine_per_prompt": [float(m.group(1)) for m in found],
            "yield_window_s": {"decode": round(decode, 3), "prefill": round(prefill, 3)},
            "not_measured": [ln.split("achieved share not measured ", 1)[1].split("; ", 1)[0]
                             for ln in lines if "achieved share not measured " in ln][:3],
            # the measured prompts' chunks whose plan the 128-step cap cut (the share falls short
            # there by design) and the online scales of each measured prompt's last plan
            "chunks_capped": sum(int(m.group(1)) for m in capped),
            "chunks_yielded_measured": sum(int(CHUNKS_RE.search(ln).group(1)) for ln, _ in measured),
            "online_scales": [[float(m.group(1)), float(m.group(2))] for m in
                              (SCALES_RE.search(ln) for ln, _ in measured) if m]}


def yield_line(model: str, eff: dict) -> Optional[str]:
    """`decode_yield <model>: achieved share 0.31 (configured 0.33)` (achieved first), or why not."""
    if not eff or eff.get("configured_share") is None:
        return None
    got = eff.get("achieved_share_engine")
    if got is None:
        why = "; ".join(eff.get("not_measured") or []) or "(no yielded prompt)"
        return f"decode_yield {model}: achieved share not measured {why} (configured {eff['configured_share']:.2f})"
    line = f"decode_yield {model}: achieved share {got:.2f} (configured {eff['configured_share']:.2f})"
    if eff.get("chunks_capped"):
        line += (f"; {eff['chunks_capped']} of {eff['chunks_yielded_measured']} chunks capped at "
                 f"128 decode steps (worth more: the share falls short there by design)")
    return line


def _effect(adapter: str, line: ConfigRun, control: ConfigRun) -> dict:
    if adapter == "decode_yield" and line.cadence and control.cadence:
        share = line.keys.get("DSV41_DECODE_YIELD")
        out = {"cadence_control": control.cadence["cadence"], "cadence_line": line.cadence["cadence"],
               "configured_share": int(share) / 100 if share else None,
               "achieved_share": line.cadence["cadence"],
               "long_prompt_completed": line.cadence["long_prompt_completed"],
               "yield_lines": len([ln for ln in line.dsv41_lines(adapter) if "yielded" in ln])}
        decisions = rank_decisions(line)
        if len(decisions) > 1:
            out["decisions_alike_on_ranks"] = len({tuple(v) for v in decisions.values()}) == 1
        out.update(yield_shares(line))
        return out
    if adapter == "decode_yield" and line.beside:
        # dsv4: no cadence (CPU prefill of the tiny V4 is too slow for a long prompt); the
        # decisions logged while a stream decoded beside a two-chunk prefill, T=0 equal
        return {"yield_lines": len([ln for ln in line.dsv41_lines(adapter) if "yielded" in ln]),
                "decision_lines": len([ln for ln in line.dsv41_lines(adapter) if " rid=" in ln]),
                "stream_tokens": len(line.beside["stream"].ids), **yield_shares(line)}
    if adapter == "autotune_keep":
        agreement = {r: v for r, v in rank_agreement(line).items() if v}
        if len(agreement) > 1:
            return {"agreement_rounds": agreement,
                    "alike_on_ranks": len({tuple(v) for v in agreement.values()}) == 1,
                    "lines": len([ln for ln in line.dsv41_lines(adapter) if " installed:" not in ln])}
        return {}
    if adapter == "swa_thin" and line.idle and control.idle:
        return {"idle_resume_cached_control": control.idle["resume"].cached_tokens,
                "idle_resume_cached_line": line.idle["resume"].cached_tokens,
                "idle_session_tokens": line.idle["session_tokens"]}
    if adapter == "swan" and line.metrics:
        # The engine's /metrics: calls served in place, and the calls that kept the stock split
        # (a fallback each, by reason: prefill rows are one of them, by design).
        return {"served": int(line.metric("dsv41_swan_served_total") or 0),
                "split": {k: int(v) for k, v in line.metric_labels(
                    "dsv41_fallbacks_total", "reason", adapter="swan").items()},
                # the self-check at first use: keys verified bit-identical to the stock split
                "selfcheck": {"verified": int(line.metric("dsv41_swan_selfcheck_verified_total") or 0),
                              "failed": int(line.metric("dsv41_swan_selfcheck_failed_total") or 0)},
                "kernel": next(("CPU twin" if "; kernel CPU twin" in ln else "swan256.so"
                                for ln in line.dsv41_lines(adapter, "sglang::scheduler")
                                if " installed:" in ln), None)}
    if adapter == "swa_cone":
        out = {"plans": len([ln for ln in line.dsv41_lines(adapter) if " plan " in ln]),
               "copies": len([ln for ln in line.dsv41_lines(adapter) if " copy " in ln])}
        if line.window and control.window:
            out["lost_window_resume_cached_control"] = control.window["resume"].cached_tokens
            out["lost_window_resume_cached_line"] = line.window["resume"].cached_tokens
        if line.window and (control.window or {}).get("hit") is not None:
            # beside the engine's decoder SWA bounded replay (dsv41): the replayed resume against
            # the control's same prompt as a prefix hit at F (the T=0 reference: records_of), and
            # against its cold re-prefill (the distance an operator gives up nothing of)
            from adapter.tools import traffic

            resume, hit = line.window["resume"], control.window["hit"]
            cold = traffic.compare([control.window["resume"]], [resume])
            out["plan_F"] = [int(m.group(1)) for ln in line.dsv41_lines(adapter) if " plan " in ln
                             for m in [re.search(r" F=(\d+) ", ln)] if m]
            out["hit_at_F_cached_control"] = hit.cached_tokens
            out["resume_vs_cold_ids_equal"] = control.window["resume"].ids == resume.ids
            out["resume_vs_cold_max_logprob_diff"] = cold.max_logprob_diff
        return out
    if adapter == "input_guard" and line.bad_input:
        return {"bad_request": line.bad_input["request"], "line_status": line.bad_input["status"],
                "line_served_after": line.bad_input["served_after"],
                "control": "not sent (stock 0.5.23 dies on it: IndexError in the embedding)",
                "rejected_lines": len([ln for ln in line.dsv41_lines(adapter) if " rejected " in ln])}
    if adapter == "admin_guard" and line.admin and "skipped" in line.admin:
        return {"admin_request": line.admin["skipped"],
                "left_to_engine_lines": len([ln for ln in line.dsv41_lines(adapter)
                                             if " left the " in ln])}
    if adapter == "admin_guard" and line.admin:
        request = line.admin["requests"][0]
        return {"admin_request": request, "line_status": line.admin["statuses"][request],
                "names_flag": "--admin-api-key" in line.admin.get("message", ""),
                "line_served_after": line.admin["served_after"],
                "control": "not sent (stock 0.5.23's scheduler dies on it: expert_distribution.py "
                           "_on_not_implemented)",
                "refused_lines": len([ln for ln in line.dsv41_lines(adapter) if " refused " in ln])}
    return {}


def _effect_failed(adapter: str, effect: dict) -> Optional[str]:
    """An adapter whose measured effect is the contract itself (input_guard: 400, still serving;
    admin_guard: 403 naming --admin-api-key, still serving;
    more than one rank: the ranks decided alike)."""
    if adapter == "input_guard" and effect and not (
            effect["line_status"] == 400 and effect["line_served_after"]):
        return (f"input_guard: the bad request got {effect['line_status']}, served after: "
                f"{effect['line_served_after']} (expected 400 and served)")
    if adapter == "admin_guard" and "line_status" in effect and not (
            effect["line_status"] == 403 and effect["names_flag"] and effect["line_served_after"]):
        return (f"admin_guard: {effect['admin_request']} got {effect['line_status']} (names "
                f"--admin-api-key: {effect['names_flag']}), served after: "
                f"{effect['line_served_after']} (expected 403 naming the flag, and served)")
    if adapter == "swa_cone" and "hit_at_F_cached_control" in effect and effect["plans"] and (
            len(set(effect["plan_F"])) != 1 or effect["hit_at_F_cached_control"] != effect["plan_F"][0]):
        return (f"swa_cone: the reference hit (cached {effect['hit_at_F_cached_control']}) is not "
                f"at the replay's F {effect['plan_F']}: the scenario's pool changed "
                "(traffic.DSV4_WINDOW_F)")
    if adapter == "swan" and effect.get("selfcheck", {}).get("failed"):
        return (f"swan: the self-check failed on {effect['selfcheck']['failed']} decode key(s) "
                "(the in-place read differs from the stock split; those keys keep the split)")
    for flag in ("decisions_alike_on_ranks", "alike_on_ranks"):
        if effect.get(flag) is False:
            return f"{adapter}: the ranks decided differently ({flag})"
    return None


def records_of(run: ConfigRun, reference_for: Optional[ConfigRun] = None) -> list:
    """Every compared record of a run: the equality set, then the scenarios' requests.

    reference_for: `run` is the control and these are the answers the line's are held to. Where
    the line's lost-window resume was a cone replay beside the engine's decoder SWA bounded
    replay (dsv41: the window scenario served a prefix hit at F too, traffic.prefix_hit), its
    reference is the control's prefix hit at F, not the control's cold re-prefill: under that
    flag a resume's answer depends on where its passes start, and cone's replay ends its passes
    where a hit at F does (docs/swa_cone.md). The cold distance is cone's effect."""
    out = list(run.records)
    if run.window:
        resume = run.window["resume"]
        hit = run.window.get("hit")
        line_window = reference_for.window if reference_for is not None else None
        if hit is not None and line_window and line_window["resume"].cached_tokens > 0 and any(
                " plan " in ln for ln in reference_for.dsv41_lines("swa_cone")):
            resume = dataclasses.replace(hit, name=resume.name)
        out += [run.window["doc"], resume]
    if run.idle:
        out += [run.idle["session"], run.idle["resume"]]
    if run.beside:
        out += [run.beside["stream"], run.beside["prompt"]]
    return out


def compare_runs(model: str, control: ConfigRun, line: ConfigRun):
    """T=0 comparison of a line's records with the control's (records_of's references), at the
    model's logprob tolerance (LOGPROB_TOL): a traffic.Comparison."""
    from adapter.tools import traffic

    return traffic.compare(records_of(control, reference_for=line), records_of(line),
                           tol=LOGPROB_TOL.get(model, traffic.LOGPROB_TOL))


def model_report(model: str, control: ConfigRun, line: ConfigRun) -> dict:
    from adapter.tools import traffic

    settings = key_registry.parse_env(line.keys)
    eq = compare_runs(model, control, line)
    adapters = {}
    for name in ADAPTERS:
        enabled = settings.enabled(name)
        lines = line.dsv41_lines(name)
        adapters[name] = {
            "enabled": enabled,
            "installed": line.installed_in(name) if enabled else {},
            "receipts": sorted({ln for ln in lines if " installed:" not in ln and " fallback:" not in ln})[:20],
            "fallbacks": sorted({ln for ln in lines if " fallback:" in ln}),
            "equality": f"{eq.equal} of {eq.total}",
            "effect": _effect(name, line, control) if enabled else {},
        }
    errors = [f"control: {e}" for e in control.errors] + [f"line: {e}" for e in line.errors]
    errors += [e for e in (_effect_failed(n, a["effect"]) for n, a in adapters.items()) if e]
    # A differing record that an adapter acted on is named after it: the lost-window resume is
    # the request cone replays (its plan / copy lines), the idle resume the one thin kept.
    acted = {"swa_cone": ([line.window["resume"].name] if line.window else [],
                          adapters["swa_cone"]["effect"].get("plans", 0)),
             "swa_thin": ([line.idle["resume"].name] if line.idle else [],
                          adapters["swa_thin"]["effect"].get("idle_resume_cached_line", 0))}
    for name, (records, evidence) in acted.items():
        differ = [r for r in records if r in eq.mismatches]
        if adapters[name]["enabled"] and evidence and differ:
            errors.append(f"{name}: {', '.join(differ)} differs from the control's, and {name} "
                          f"acted on it ({'plans' if name == 'swa_cone' else 'cached tokens'} "
                          f"{evidence}); roll back with {name}'s key unset")
    not_installed = [n for n, a in adapters.items()
                     if a["enabled"] and not any(v for r, v in a["installed"].items()
                                                 if r.startswith(install_process(n)))]
    ok = not errors and not not_installed and eq.ok and bool(line.records) and bool(control.records)
    replay = {label: run.extras.get("bounded_replay") for label, run in (("control", control), ("line", line))
              if run.extras.get("bounded_replay")}
    return {"ok": ok, "equality": eq.as_json(), "adapters": adapters, "errors": errors,
            "not_installed": not_installed, "bounded_replay": replay,
            "control": {"keys": control.keys, "args": control.args, "boot_s": control.boot_s,
                        "log_dir": control.log_dir},
            "line": {"keys": line.keys, "args": line.args, "boot_s": line.boot_s, "log_dir": line.log_dir}}


def format_report(report: dict) -> str:
    out = [f"dsv41 canary: {report['profile']} line {report['line']} against {report['against']}: "
           f"{'OK' if report['ok'] else 'FAIL'} ({report['elapsed_s']:.0f}s)"]
    if report["ignored"]:
        out.append("ignored on CPU: " + "; ".join(f"{k} ({v})" for k, v in report["ignored"].items()))
    if report.get("scaled"):
        out.append("scaled to the CPU model: " + "; ".join(f"{k} ({v})" for k, v in report["scaled"].items()))
    for model, m in report["models"].items():
        eq = m["equality"]
        out.append(f"\n[{model}] T=0 equality {eq['equal']} of {eq['total']} (max logprob diff "
                   f"{eq['max_logprob_diff']:.2e}); boots control {m['control']['boot_s']}s, line "
                   f"{m['line']['boot_s']}s")
        replay = m.get("bounded_replay") or {}
        if replay:
            out.append("  decoder SWA bounded replay " + ", ".join(
                f"{label} {'on' if r.get('enable_decoder_swa_bounded_replay') else 'off'}"
                for label, r in replay.items()) + " (as the engine resolved it: /server_info; on "
                "the cluster the engine's default for DeepSeek-V4.1)")
        out.append(f"  {'adapter':14s} {'installed (per process)':42s} effect / lines")
        for name, a in m["adapters"].items():
            if not a["enabled"]:
                out.append(f"  {name:14s} off")
                continue
            inst = ", ".join(f"{r} {'yes' if v else 'no'}" for r, v in sorted(a["installed"].items()))
            out.append(f"  {name:14s} {inst:42s} {json.dumps(a['effect']) if a['effect'] else ''}")
            for ln in a["fallbacks"] + a["receipts"][:3]:
                out.append(f"  {'':14s}   {ln[:150]}")
        shown = yield_line(model, (m["adapters"].get("decode_yield") or {}).get("effect") or {})
        if shown:
            out.append(shown)
        for e in m["errors"] + [f"{n} not installed in the {install_process(n)}" for n in m["not_installed"]]:
            out.append(f"  ERROR {e}")
        if eq["mismatches"]:
            out.append(f"  outputs differ: {', '.join(eq['mismatches'])}")
        if "agent_traffic" in m:
            from adapter.tools import agent_traffic

            at = m["agent_traffic"]
            out += [f"  {ln}" for ln in ([f"agent traffic: {at['skipped']}"] if "skipped" in at
                                         else agent_traffic.canary_lines(at))]
    return "\n".join(out)


def main(args, run: Callable = run_config) -> int:
    from adapter.tools import profile

    began = time.monotonic()
    try:
        line, control = load_checked_lines(args.profile, args.line, args.against)
    except (OSError, profile.ProfileError, key_registry.ConfigError) as exc:
        print(f"dsv41 canary: {exc}", file=sys.stderr)
        return 2
    line_keys, line_args, ignored = split_line(line)
    control_keys, control_args, ignored_control = split_line(control)
    ignored.update({f"{k} (control)": v for k, v in ignored_control.items() if k not in ignored})
    models = list(args.model) if isinstance(args.model, (list, tuple)) else cpu_models(args.model)
    phases = 2 * len(models)
    step = 0
    nodes = int(getattr(args, "nodes", 1) or 1)
    topology = {}
    if nodes > 1:
        # The cluster's topology, one TP rank per node, on this machine: both lines boot as
        # --tp-size N over N launch processes; each runs the autotune agreement over its TP group.
        line_args = dict(line_args, **{"--tp-size": str(nodes)})
        control_args = dict(control_args, **{"--tp-size": str(nodes)})
        for name in [n for n in ignored if n.startswith(("--tp-size", "--nnodes"))]:
            ignored[name] = f"booted as --tp-size {nodes} over {nodes} nodes on 127.0.0.1 (--nodes {nodes})"
        agree = pathlib.Path(tempfile.mkdtemp(prefix="dsv41-canary-autotune-"))
        topology = {"nodes": nodes, "agree_dir": agree}

    def progress(msg: str) -> None:
        print(f"[canary {time.monotonic() - began:5.0f}s] {msg}", file=sys.stderr, flush=True)

    traffic_kind = getattr(args, "traffic", "canary") or "canary"
    report = {"profile": str(args.profile), "line": args.line, "against": args.against,
              "ignored": ignored, "scaled": {}, "nodes": nodes, "traffic": traffic_kind, "models": {}}
    agent_dir = pathlib.Path(tempfile.mkdtemp(prefix="dsv41-canary-agent-")) if traffic_kind == "agent" else None
    for model in models:
        runs = {}
        agent = agent_plan(model, agent_dir) if agent_dir is not None else None
        model_line_keys, scaled = model_keys(model, line_keys)
        model_control_keys, scaled_control = model_keys(model, control_keys)
        report["scaled"].update(scaled)
        report["scaled"].update({f"{k} (control)": v for k, v in scaled_control.items()})
        for label, k, a in (("control", model_control_keys, control_args),
                            ("line", model_line_keys, line_args)):
            step += 1
            extra = {} if not topology else {
                "nodes": nodes, "extra_env": {AGREE_ENV: str(topology["agree_dir"] / f"{model}-{label}")}}
            if agent and agent.get("on_server"):
                # the same launch args on both boots; the workload runs after the canary's traffic
                a = dict(a, **agent["args"])
                extra["on_server"] = agent["on_server"]
                extra["admin_calls"] = True            # the workload flushes the cache too
            runs[label] = run(model, k, a, progress=progress,
                              name=f"{step}/{phases} {model} {label if label == 'control' else args.line}",
                              **extra)
            for flag, value in getattr(runs[label], "harness_args", {}).items():
                # what the boot has that the line has not: printed with the scaled keys
                report["scaled"][f"{flag} unset -> {value} ({model} "
                                 f"{'control' if label == 'control' else args.line})"] = harness_arg_why(model, flag)
        report["models"][model] = model_report(model, runs["control"], runs["line"])
        if agent is not None:
            add_agent_report(report["models"][model], agent, runs["control"], runs["line"])
    report["ok"] = all(m["ok"] for m in report["models"].values())
    report["elapsed_s"] = round(time.monotonic() - began, 1)
    print(json.dumps(report, indent=2, default=str) if args.json else format_report(report))
    return exit_code(report)


def agent_plan(model: str, workdir: pathlib.Path) -> dict:
    """`--traffic agent`: {"args", "on_server"} of adapter/tools/agent_traffic.canary_setup for a
    model with a canary-sized agent workload; {"skipped": why} for one without (the dense model:
    no sliding window, nothing for thin or cone to act on)."""
    from adapter.tools import agent_traffic

    if (model, "canary") not in agent_traffic.SCALES:
        have = ", ".join(m for m, s in agent_traffic.SCALES if s == "canary")
        return {"skipped": f"not run on the {model} model (no sliding window for thin or cone to act "
                           f"on; the workload runs on {have})"}
    args, on_server = agent_traffic.canary_setup(model, workdir / model)
    return {"args": args, "on_server": on_server}


def add_agent_report(model_rep: dict, agent: dict, control: ConfigRun, line: ConfigRun) -> None:
    """models.<model>.agent_traffic: the workload's rows line vs control (agent_traffic.
    canary_report); its T=0 output ids must agree (else the model's report fails)."""
    from adapter.tools import agent_traffic

    if "skipped" in agent:
        model_rep["agent_traffic"] = {"ok": True, "skipped": agent["skipped"]}
        return
    rep = agent_traffic.canary_report(control, line)
    model_rep["agent_traffic"] = rep
    if not rep.get("ok"):
        out = rep.get("outputs") or {}
        model_rep["errors"].append(
            f"agent traffic: {rep['error']}" if "error" in rep else
            f"agent traffic: T=0 output ids of the conversations' turns equal on {out.get('equal')} "
            f"of {out.get('total')} prompts")
        model_rep["ok"] = False


def exit_code(report: dict) -> int:
    """exits.OK; REFUSED when a boot stopped because an adapter refused; FAILED otherwise."""
    from adapter.tools import exits

    if report["ok"]:
        return exits.OK
    refused = any("refused to install" in str(err).split("\n", 1)[0]
                  for m in report["models"].values() for err in m.get("errors", ()))
    return exits.REFUSED if refused else exits.FAILED
