"""`dsv41 calibrate yield`: the parser on log lines the real engine printed, the fit, the errors.

tests/data/calibrate/dense_scheduler.log: the scheduler log of a real CPU server (dense tiny
model, 4096-token chunks, DSV41_DECODE_YIELD=33): the yield scenario, then
traffic.calibration_run (two lone long prompts, decode runs of 1/2/4 rows and 2 long rows).
tests/data/calibrate/swa_iters_ms.log: a hybrid-SWA server booted with SGLANG_LOG_MS=1 and
SGLANG_LOG_FORWARD_ITERS=1 (ms timestamps, iteration numbers, the SWA pool's usage fields).
"""
from __future__ import annotations

import json
import pathlib
import re
import subprocess
import sys

import pytest

from adapter import decode_yield, keys
from adapter.tools import calibrate as C
from conftest import REPO_ROOT

DATA = pathlib.Path(__file__).parent / "data" / "calibrate"
DENSE = DATA / "dense_scheduler.log"
SWA = DATA / "swa_iters_ms.log"


def _batch_lines(path):
    return [ln for ln in path.read_text().splitlines() if " batch" in ln and ("Prefill" in ln or "Decode" in ln)]


def test_prefill_line_fields():
    raw = next(ln for ln in _batch_lines(DENSE) if "#pending-token: 20480" in ln and "#running-req: 0," in ln)
    line = C.parse_line(raw, "x:1")
    assert line.kind == "Prefill" and line.iter is None and line.who == ""
    assert line.num("#new-token") == 4096 and line.num("#cached-token") == 0
    assert line.num("#running-req") == 0 and line.num("#queue-req") == 0
    assert line.num("input throughput (token/s)") > 0
    assert "#replay-token" not in line.fields and line.num("#replay-token", -1.0) < 0   # default returned


def test_decode_line_fields_dense():
    raw = next(ln for ln in _batch_lines(DENSE) if ln.split("] ", 1)[1].startswith("Decode batch"))
    line = C.parse_line(raw)
    assert line.kind == "Decode" and line.num("#running-req") >= 1
    assert "#token" in line.fields and line.num("gen throughput (token/s)") >= 0


def test_hybrid_swa_lines_with_iters_and_ms():
    lines = [C.parse_line(ln) for ln in _batch_lines(SWA)]
    assert lines and all(ln is not None for ln in lines)
    assert all(ln.iter is not None for ln in lines)                 # SGLANG_LOG_FORWARD_ITERS=1
    assert all(ln.ts.microsecond % 1000 == 0 for ln in lines) and any(ln.ts.microsecond for ln in lines)
    decode = [ln for ln in lines if ln.kind == "Decode"]
    assert decode and all("#full token" in ln.fields and "#swa token" in ln.fields for ln in decode)
    assert C._context(decode[0]) == decode[0].num("#full token")
    iters = [ln.iter for ln in lines]
    assert iters == sorted(iters)


def test_other_lines_are_not_batch_lines():
    for raw in ("[2026-12-03 18:36:39] Init parallel ends. elapsed=0.02 s",
                "[2026-12-03 18:36:39] [dsv41] decode_yield installed: DSV41_DECODE_YIELD=33",
                "Prefill batch, #new-seq: 1", ""):
        assert C.parse_line(raw) is None


def test_chunk_samples_follow_one_prompt_alone():
    """Only chunks that continue the previous line's prompt with no decode row running count; the
    prefix is rebuilt from the chain (the engine logs #cached-token only at admission)."""
    (stream,) = C.read_lines([DENSE])
    chains = C.chunk_chains(stream)
    assert [len(c) for c in chains] == [6, 6]
    assert C.logged_after(chains) == (0, "2 of 2 prompts' last chunk")
    samples = C.chunk_samples(chains, 0)
    by_zero = [(L, P) for L, P, _, _ in samples]
    # the two lone prompts: 24,576 (chunks 2..6) and 22,528 (chunks 2..5 of 4096, then 2048)
    assert by_zero == [(4096, 4096), (4096, 8192), (4096, 12288), (4096, 16384), (4096, 20480),
                       (4096, 4096), (4096, 8192), (4096, 12288), (4096, 16384), (2048, 20480)]
    # the yield scenario's chunks ran beside 2 decode rows: none of them is a sample
    assert all(P > 0 for _, P, _, _ in samples)
    # each later chunk of a prompt sees a longer prefix and takes longer
    first = [t for _, _, t, _ in samples[:5]]
    assert first == sorted(first)


def test_the_swa_servers_loop_logs_a_chunk_after_the_next_forward():
    """Hybrid-SWA CPU server: the last chunk's line comes 1 ms after the one before it, so each
    gap timed the next chunk's forward; the last gap is no sample."""
    (stream,) = C.read_lines([SWA])
    chains = C.chunk_chains(stream)
    assert [[(L, P) for L, P, _, _ in c] for c in chains] == [[(1024, 0), (1024, 1024), (952, 2048)]]
    assert C.logged_after(chains)[0] == 1
    assert [(L, P) for L, P, _, _ in C.chunk_samples(chains, 1)] == [(952, 2048)]
    # decode lines [46] [86] [126]: the first follows a prefill line; steps per line from the iters
    steps = C.step_samples(stream, 1000)          # the interval is not used when iters are logged
    decode = [ln for ln in stream if ln.kind == "Decode"]
    assert [s[3] for s in steps] == [decode[1].source, decode[2].source]
    for s, ln in zip(steps, decode[1:]):
        assert s[0] == 2 and s[2] == pytest.approx(2 / ln.num("gen throughput (token/s)"))


def test_step_samples_skip_windows_with_a_prefill_or_a_row_change():
    (stream,) = C.read_lines([DENSE])
    steps = C.step_samples(stream, 40)
    assert {int(r) for r, *_ in steps} == {1, 2, 4}
    for rows, ctx, per_step, src, by_ts, by_thr in steps:
        i = next(j for j, ln in enumerate(stream) if ln.source == src)
        assert stream[i - 1].kind == "Decode" and stream[i - 1].num("#running-req") == rows
        assert 0 < per_step < 0.1


def test_fit_on_a_real_server_log_gives_a_value_the_boot_accepts():
    r = C.fit([DENSE])
    assert r["chunk"]["samples"] == 10
    assert r["step"]["samples"] >= 10
    parsed = keys.parse_env({"DSV41_DECODE_YIELD": "33", "DSV41_DECODE_YIELD_MODEL": r["value"]})
    model = decode_yield.CostModel(*parsed.get("DSV41_DECODE_YIELD_MODEL"))
    assert model._asdict() == r["model"]
    assert r["profile_line"] == f"DSV41_DECODE_YIELD_MODEL={r['value']}"
    # the fit reproduces the log's own chunk durations within its reported residual
    for p in r["chunk"]["points"]:
        fitted = decode_yield.pass_cost_us([int(p["L"])], [int(p["P"])], model) / 1e6
        assert abs(fitted - p["s"]) <= (r["chunk"]["max_rel_residual"] + 0.01) * p["s"]
    for p in r["step"]["points"]:
        fitted = decode_yield.step_cost_us(int(p["rows"]), int(p["context"]), model) / 1e6
        assert abs(fitted - p["s"]) <= (r["step"]["max_rel_residual"] + 0.01) * p["s"]
    # the CPU engine's chunk is far cheaper next to its decode step than the cluster's model says
    assert r["plans"][33] > decode_yield.yield_steps(
        33, decode_yield.pass_cost_us([4096], [0]), decode_yield.step_cost_us(2, 8192), 1)


def test_a_constant_feature_is_reported_not_identifiable(tmp_path):
    """Decode lines of one row count only: the per-row term cannot be told from the fixed one."""
    one_row = [ln for ln in DENSE.read_text().splitlines()
               if "Prefill batch" in ln or ("Decode batch" in ln and "#running-req: 1," in ln)]
    log = tmp_path / "one_row.log"
    log.write_text("\n".join(one_row) + "\n")
    r = C.fit([log])
    assert "per row" in r["step"]["not_identifiable"] and r["model"]["step_row_us"] == 0


@pytest.mark.parametrize("keep, needle", [
    (lambda ln: False, "no 'Prefill batch' / 'Decode batch' lines"),
    (lambda ln: "Decode batch" in ln, "chunk samples (need 3)"),
    (lambda ln: "Prefill batch" in ln, "decode step samples (need 3)"),
])
def test_logs_that_cannot_give_a_fit_say_what_to_send(tmp_path, keep, needle):
    log = tmp_path / "part.log"
    log.write_text("\n".join(ln for ln in DENSE.read_text().splitlines() if keep(ln)) + "\n")
    with pytest.raises(C.CalibrationError, match=re.escape(needle)):
        C.fit([log])


def test_wrong_decode_log_interval_is_caught_by_the_timestamps(tmp_path):
    """Long decode runs logged every 40 steps, read as every 10: the throughputs then account for a
    quarter of the time the timestamps show."""
    head = "[2026-12-03 10:00:{:02d}] Decode batch, #running-req: 2, #token: 500, token usage: 0.01, " \
           "cpu graph: False, gen throughput (token/s): 80.00, #queue-req: 0"
    pre = ("[2026-12-03 09:59:00] Prefill batch, #new-seq: 1, #new-token: 4096, #cached-token: 0, token usage: "
           "0.1, #running-req: 0, #queue-req: 0, #pending-token: {p}, cpu graph: False, input throughput "
           "(token/s): 4000.00")
    lines = [pre.format(p=p) for p in (16384, 12288, 8192, 4096, 0)]
    lines += [head.format(s) for s in range(0, 60, 1)]          # 2 x 40 / 80 = 1 s per line
    log = tmp_path / "interval.log"
    log.write_text("\n".join(lines) + "\n")
    # whole-second timestamps 0..59 s; the tool rounds to 1 ms, so 1 ms is the tolerance
    assert C.fit([log])["step"]["seconds_by_timestamps"] == pytest.approx(59.0, abs=1e-3)
    with pytest.raises(C.CalibrationError, match="pass its --decode-log-interval"):
        C.fit([log], decode_log_interval=10)


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "adapter.tools.cli", "calibrate", "yield", *args],
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)


def test_cli_json_and_plot(tmp_path):
    png = tmp_path / "fit.png"
    proc = _cli("--log", str(DENSE), "--json", "--plot", str(png))
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    for field in ("model", "value", "profile_line", "chunk", "step", "logs", "plot"):
        assert field in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    text = _cli("--log", str(DENSE))
    assert text.returncode == 0 and out["profile_line"] in text.stdout


def test_cli_errors_are_one_line_and_exit_2(tmp_path):
    proc = _cli("--log", str(tmp_path / "missing.log"))
    assert proc.returncode == 2 and "cannot read" in proc.stderr and "Traceback" not in proc.stderr
