"""`dsv41 gate run` / `gate boot` without a server: clear errors (exit 2), the plan, the CLI wiring;
the planted step work of the CPU harness (adapter/cpu/step_work.py) on a stand-in class."""
import time
import types

import pytest

from adapter.cpu import step_work
from adapter.cpu.server import free_port
from adapter.tools import cli
from adapter.tools.gate import cells as C
from adapter.tools.gate import run as gate_run


def test_unreachable_endpoint_exits_2(tmp_path, capsys):
    url = f"http://127.0.0.1:{free_port()}"
    began = time.monotonic()
    code = cli.main(["gate", "run", "--endpoint", url, "--label", "A", "--out", str(tmp_path)])
    err = capsys.readouterr().err
    assert code == 2 and f"{url}/v1/models did not answer" in err and "Traceback" not in err
    assert time.monotonic() - began < 30
    assert not any((tmp_path).rglob("meta.json"))


@pytest.mark.parametrize("label", ["", "a/b", ".hidden"])
def test_bad_label(tmp_path, label):
    with pytest.raises(C.GateError, match="bad label"):
        gate_run.run_gate("http://127.0.0.1:1", label, str(tmp_path))


def test_unknown_suite():
    with pytest.raises(C.GateError, match="unknown suite"):
        C.plan_for("huge", 8192)


def test_plans_follow_the_context_length():
    quick = C.plan_for("quick", 8192)
    assert quick["pad"] == {"0.05": 409, "0.25": 2048, "0.5": 4096} and quick["needle"] == int(0.9 * 8192) - 256
    full = C.plan_for("full", 1048576)              # the cluster: no caps, needle at 92 %
    assert full["needle"] == int(0.92 * 1048576) - 256 and full["pad"]["0.5"] == 524288
    assert full["soak_s"] == pytest.approx(720.0, abs=1e-9) and full["t1_samples"] * 3 == 12000  # 12 min
    assert C.requests_in("soak", full, 12) == 720


def test_base_url():
    assert C.base_url("http://h:30000/v1/") == C.base_url("http://h:30000") == "http://h:30000"


def test_boot_with_a_bad_profile_exits_2(tmp_path, capsys):
    code = cli.main(["gate", "boot", "--profile", str(tmp_path / "missing.env"), "--out", str(tmp_path)])
    assert code == 2 and "dsv41 gate boot:" in capsys.readouterr().err


def test_resume_refuses_another_suite(tmp_path):
    d = tmp_path / "r" / "A"
    d.mkdir(parents=True)
    gate_run._write_json(d / "meta.json", {"suite": "full", "model": "m", "context_length": 8192})
    with pytest.raises(C.GateError, match="measured with suite='full'"):
        gate_run._check_resume(d / "meta.json", {"suite": "quick", "model": "m", "context_length": 8192})


def test_step_work_is_proportional_to_the_batch_cpu_time(monkeypatch, capsys):
    """The extra work is `factor` x the CPU time the batch took, on a CPU clock the test drives
    (no real time read): a batch of 2 CPU-s gets 6 CPU-s more at factor 3, one of 5 gets 15."""
    cpu = {"now": 100.0}
    step = {"cost": 0.0}

    class Scheduler:
        def run_batch(self, batch):
            cpu["now"] += step["cost"]
            return ("ran", batch)

    burnt = []

    def fake_burn(cpu_s, clock=None):
        burnt.append(cpu_s)

    module = types.SimpleNamespace(Scheduler=Scheduler)
    monkeypatch.setenv(step_work.ENV, "3")
    monkeypatch.setattr(step_work.time, "thread_time", lambda: cpu["now"])
    monkeypatch.setattr(step_work, "burn", fake_burn)
    step_work.apply(module)
    step_work.apply(module)                         # idempotent: one wrap, not two
    for cost in (2.0, 5.0):
        step["cost"] = cost
        assert Scheduler().run_batch(7) == ("ran", 7)
    assert burnt == [pytest.approx(6.0), pytest.approx(15.0)]
    assert capsys.readouterr().err.count("step extra work armed") == 1


def test_burn_runs_until_the_clock_advanced():
    ticks = iter(range(0, 100))
    reads = []

    def clock():
        reads.append(next(ticks))
        return reads[-1]

    step_work.burn(5, clock=clock)
    assert reads[0] == 0 and reads[-1] == 5          # started at 0, stopped at the first read >= 5


@pytest.mark.parametrize("raw", ["abc", "-5", "nan", "inf"])
def test_step_work_bad_value(monkeypatch, raw):
    monkeypatch.setenv(step_work.ENV, raw)
    with pytest.raises(ValueError, match="DSV41CPU_STEP_EXTRA_WORK"):
        step_work.factor()


# --- cells through a stand-in transport (httpx.MockTransport): resume, server failures -----------

import json as _json  # noqa: E402

import httpx  # noqa: E402
import openai  # noqa: E402

USAGE = {"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6}


def fake_target(handler) -> C.Target:
    http = httpx.Client(base_url="http://fake", transport=httpx.MockTransport(handler))
    client = openai.OpenAI(base_url="http://fake/v1", api_key="none", max_retries=0,
                           http_client=httpx.Client(transport=httpx.MockTransport(handler)))
    return C.Target("http://fake", client, http, "m", 8192, 16384, [100] * 5)


def answering(calls: list, fail: bool = False):
    def handler(request: httpx.Request) -> httpx.Response:
        calls.append(request.url.path)
        if fail:
            return httpx.Response(500, json={"error": {"message": "scheduler died"}})
        if request.url.path.endswith("/chat/completions"):
            return httpx.Response(200, json={
                "id": "x", "object": "chat.completion", "created": 0, "model": "m", "usage": USAGE,
                "choices": [{"index": 0, "finish_reason": "length", "message": {"role": "assistant", "content": " hi"},
                             "logprobs": {"content": [{"token": " hi", "logprob": -0.1, "top_logprobs": []}]}}]})
        body = _json.loads(request.content)
        return httpx.Response(200, json={
            "id": "x", "object": "text_completion", "created": 0, "model": "m", "usage": USAGE,
            "choices": [{"index": 0, "text": f" {len(body['prompt'])}", "finish_reason": "length",
                         "logprobs": {"tokens": ["a"], "token_logprobs": [-0.1], "top_logprobs": None,
                                      "text_offset": [0]}}]})
    return handler


def test_cells_resume_and_server_failures(tmp_path, monkeypatch, capsys):
    calls = []
    monkeypatch.setattr(C, "connect", lambda *a, **k: fake_target(answering(calls)))
    d = gate_run.run_gate("http://fake", "A", str(tmp_path), run_id="r", cells=("t0",))
    samples = [_json.loads(x) for x in (d / "t0.samples.jsonl").read_text().splitlines()]
    assert [s["id"] for s in samples] == [p["id"] for p in C.prompt_set()["t0"]]
    assert len(calls) == 12 and _json.loads((d / "t0.json").read_text())["prompts"] == 12
    gate_run.run_gate("http://fake", "A", str(tmp_path), run_id="r", cells=("t0",))
    assert len(calls) == 12 and "t0: measured already, skipped" in capsys.readouterr().err
    # The server fails in the middle of a cell: a clear error, nothing written for that cell.
    monkeypatch.setattr(C, "connect", lambda *a, **k: fake_target(answering(calls, fail=True)))
    with pytest.raises(C.GateError, match="A needle: the server failed: InternalServerError"):
        gate_run.run_gate("http://fake", "A", str(tmp_path), run_id="r", cells=("t0", "needle"))
    assert not (d / "needle.json").exists() and (d / "t0.json").exists()


def test_free_port_is_outside_the_ephemeral_range_and_held_until_released(tmp_path):
    """CPU servers bind their ports tens of seconds after the harness picks them: a port is taken
    below the kernel's ephemeral range and held (flock) until released, so another harness
    process cannot pick it meanwhile."""
    import fcntl
    import os
    import tempfile

    from adapter.cpu import server

    port = free_port()
    try:
        assert port < server._ephemeral_low()
        lock = os.path.join(tempfile.gettempdir(), "dsv41-cpu-ports", f"{port}.lock")
        fd = os.open(lock, os.O_RDWR)
        try:
            with pytest.raises(OSError):             # another process's attempt fails while held
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        finally:
            os.close(fd)
        other = free_port()
        assert other != port
        server.release_port(other)
    finally:
        server.release_port(port)
