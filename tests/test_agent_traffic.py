"""Agent traffic for the engine's own client (adapter/tools/agent_traffic.py): the trace writer
(read back by the 0.5.23 client's own dataset loaders), the readers of the client's --output-file
JSON and of the engine's request log, and bench/agent_traffic.py's aggregation. No server."""
from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import pathlib

import pytest

from adapter.tools import agent_traffic as at
from conftest import REPO_ROOT


class CharTokenizer:
    """One token per character: enough for the trace writer's token counts."""

    def encode(self, text, add_special_tokens=False):
        return [ord(c) for c in text]

    def decode(self, ids):
        return "".join(chr(i) for i in ids)


@pytest.fixture(scope="module")
def trace(tmp_path_factory):
    return at.write_trace(tmp_path_factory.mktemp("trace"), "swa", "bench", seed=7, tokenizer=CharTokenizer())


def _engine_datasets():
    at.client_stand_ins()      # the client's package imports `datasets` (mmmu) at import time
    from sglang.benchmark.datasets.agentic_trace import AgenticTraceDataset
    from sglang.benchmark.datasets.mooncake import MooncakeDataset, get_mooncake_request_over_time

    return AgenticTraceDataset, MooncakeDataset, get_mooncake_request_over_time


def test_same_seed_same_bytes_other_seed_other_trace(tmp_path, trace):
    again = at.write_trace(tmp_path / "again", "swa", "bench", seed=7, tokenizer=CharTokenizer())
    other = at.write_trace(tmp_path / "other", "swa", "bench", seed=8, tokenizer=CharTokenizer())
    for name in ("agent", "users", "streams"):
        a = pathlib.Path(getattr(trace, name)).read_bytes()
        assert a == pathlib.Path(getattr(again, name)).read_bytes()
    assert pathlib.Path(trace.agent).read_bytes() != pathlib.Path(other.agent).read_bytes()


def test_agent_trace_is_read_by_the_clients_agentic_trace_loader(trace):
    AgenticTraceDataset, _, _ = _engine_datasets()
    sc = at.scale_of("swa", "bench")
    args = argparse.Namespace(dataset_path=trace.agent, num_prompts=sc.sessions + sc.subagents,
                              sharegpt_output_len=sc.turn_output, dataset_offset=0, agentic_max_turns=None)
    rows = AgenticTraceDataset.from_args(args).load(tokenizer=None)
    assert [len(r.prompt) for r in rows] == [sc.session_turns] * sc.sessions + [sc.subagent_turns] * sc.subagents
    assert all(r.output_len == sc.turn_output for r in rows)
    first = rows[0].prompt[0]
    assert [m["role"] for m in first] == ["system", "user"]
    assert len(first[0]["content"]) == sc.session_system      # one token per char with this tokenizer
    # every message differs: no accidental shared prefix between conversations
    contents = [m["content"] for r in rows for turn in r.prompt for m in turn]
    assert len(set(contents)) == len(contents)


def test_mooncake_records_are_read_by_the_client_and_counted_as_it_builds_them(trace):
    _, MooncakeDataset, over_time = _engine_datasets()
    sc = at.scale_of("swa", "bench")
    streams = MooncakeDataset(dataset_path=trace.streams, mooncake_workload="conversation",
                              num_requests=100).load()
    assert [r["timestamp"] for r in streams] == [0] * sc.streams + [sc.long_at_ms]
    assert len(streams[-1]["hash_ids"]) == sc.long_blocks
    users = MooncakeDataset(dataset_path=trace.users, mooncake_workload="conversation", num_requests=100).load()
    shared = sc.users[1][2]
    assert users[0]["hash_ids"][:shared] == users[1]["hash_ids"][:shared]        # a shared system prompt
    assert users[0]["hash_ids"][shared:] != users[1]["hash_ids"][shared:]
    own = users[0]["hash_ids"] + users[1]["hash_ids"][shared:] + [h for r in streams for h in r["hash_ids"]]
    assert len(set(own)) == len(own)                                                # nothing else shared

    async def rows():
        return [r async for r in over_time(list(streams), CharTokenizer(), 0.0, 1)]

    built = asyncio.run(rows())
    assert [r.prompt_len for r in built] == [r["input_length"] for r in sorted(streams, key=lambda r: r["timestamp"])]
    assert [r.output_len for r in built] == [sc.stream_output] * sc.streams + [sc.long_output]
    # the trace's own index of the long prompt in the client's (timestamp-sorted) order
    assert trace.long_index == sc.streams and trace.stream_index == list(range(sc.streams))


def test_chat_template_renders_a_history_as_a_prefix_of_the_next_prompt(tmp_path):
    import jinja2

    args = at.server_args("swa", "bench", tmp_path)
    assert args["--log-requests-level"] == "3" and args["--log-requests-format"] == "json"
    assert args["--max-total-tokens"] == "32768"
    template = jinja2.Template(pathlib.Path(args["--chat-template"]).read_text())
    history = [{"role": "system", "content": "sys"}, {"role": "user", "content": "task"}]
    prompt = template.render(messages=history, add_generation_prompt=True)
    assert prompt == "<s>system\nsys</s><s>user\ntask</s><s>assistant\n"
    later = template.render(messages=history + [{"role": "assistant", "content": "reply"},
                                                {"role": "user", "content": "more"}], add_generation_prompt=True)
    assert later.startswith(prompt + "reply</s>")


def test_resume_holds_the_history_with_the_servers_replies(trace, tmp_path):
    sc = at.scale_of("swa", "bench")
    n = sc.sessions * sc.session_turns + sc.subagents * sc.subagent_turns
    replies = [f"reply{k}" for k in range(n)]
    path = at.write_resume(trace, {"generated_texts": replies}, tmp_path / "resume.json")
    convs = json.loads(pathlib.Path(path).read_text())["conversations"]
    assert len(convs) == sc.sessions and all(len(c) == sc.resume_turns for c in convs)
    for s, conv in enumerate(convs):
        first = conv[0]["messages"]
        assert [m["role"] for m in first] == (["system", "user", "assistant"]
                                              + ["user", "assistant"] * (sc.session_turns - 1) + ["user"])
        assert [m["content"] for m in first if m["role"] == "assistant"] == \
            replies[s * sc.session_turns:(s + 1) * sc.session_turns]
        assert first[-1]["content"] == trace.resume_user[s][0]
        assert [c["messages"][0]["content"] for c in conv[1:]] == trace.resume_user[s][1:sc.resume_turns]


def _multi_turn_result(rounds, ttft=lambda k: 0.1 * (k + 1)):
    n = sum(rounds)
    return {"input_lens": [1000 + k for k in range(n)], "ttfts": [ttft(k) for k in range(n)],
            "cached_tokens": [900 if k % 2 else 0 for k in range(n)], "output_lens": [16] * n,
            "generated_texts": [f"t{k}" for k in range(n)], "itls": [[]] * n, "errors": [""] * n}


def test_turn_records_map_the_clients_flat_outputs_to_conversations_and_rounds():
    result = _multi_turn_result([2, 3])
    turns = at.turn_records(result, [2, 3])
    assert [(t["conversation"], t["round"]) for t in turns] == [(0, 0), (0, 1), (1, 0), (1, 1), (1, 2)]
    assert turns[3]["cached_fraction"] == 900 / 1003 and turns[3]["text"] == "t3"
    with pytest.raises(at.ClientError):
        at.turn_records(result, [2, 2])


def test_resume_rows_read_the_first_round_of_each_session(trace):
    sc = at.scale_of("swa", "bench")
    rows = at.resume_rows(_multi_turn_result([sc.resume_turns] * sc.sessions), trace)
    assert [t["conversation"] for t in rows["resumed"]] == list(range(sc.sessions))
    assert all(t["round"] == 0 for t in rows["resumed"])
    firsts = [k * sc.resume_turns for k in range(sc.sessions)]
    assert rows["ttft_p50_s"] == pytest.approx(sorted(0.1 * (k + 1) for k in firsts)[sc.sessions // 2])
    cached = sum(900 if k % 2 else 0 for k in firsts)
    assert rows["cached_fraction"] == pytest.approx(cached / sum(1000 + k for k in firsts))


def test_stream_rows_take_the_gaps_that_overlap_the_long_prefill(trace):
    sc = at.scale_of("swa", "bench")
    w0 = sc.long_at_ms / 1000
    # stream tokens every 0.05 s until w0 + 0.01, then one 1.0 s stall, then 0.05 s again
    before = int(w0 / 0.05)
    itls = [0.05] * before + [1.0] + [0.05] * 40
    result = {"ttfts": [0.0] * sc.streams + [1.5], "itls": [itls] * sc.streams + [[]],
              "input_lens": [400] * sc.streams + [5000]}
    rows = at.stream_rows(result, trace)
    assert rows["window_s"] == pytest.approx([w0, w0 + 1.5]) and rows["long_ttft_s"] == pytest.approx(1.5)
    times = [0.0]
    for g in itls:
        times.append(times[-1] + g)
    expected = [b - a for a, b in zip(times, times[1:]) if b > w0 and a < w0 + 1.5]
    assert rows["gaps"] == len(expected) * sc.streams
    assert rows["itl_max_s"] == pytest.approx(1.0) and rows["itl_p50_s"] == pytest.approx(0.05)
    assert rows["streams_ended_before_first_token"] == 0
    assert rows["rate_before_tok_s"] == pytest.approx(before / w0, rel=0.05)


def test_read_result_takes_the_last_line_and_refuses_failed_requests(tmp_path):
    path = tmp_path / "r.jsonl"
    path.write_text(json.dumps({"completed": 1, "errors": [""]}) + "\n" + json.dumps({"completed": 2, "errors": ["", ""]}) + "\n")
    assert at.read_result(path)["completed"] == 2
    path.write_text(json.dumps({"completed": 1, "errors": ["", "Bad Request: boom"]}) + "\n")
    with pytest.raises(at.ClientError, match="1 failed requests"):
        at.read_result(path)
    path.write_text("")
    with pytest.raises(at.ClientError):
        at.read_result(path)


def _log_line(ts, rid, ids, out):
    rec = {"timestamp": ts, "event": "request.finished", "rid": rid,
           "obj": {"rid": rid, "text": None, "input_ids": ids}, "out": {"text": "x", "output_ids": out}}
    return f"[{ts[:10]} {ts[11:19]}] {json.dumps(rec)}"


def test_request_outputs_read_the_engines_request_log():
    import datetime

    logs = {"launcher pid 1": "\n".join([
        "[2026-12-05 07:55:37] some other line",
        _log_line("2026-12-05T07:55:37.100000", "HEALTH_CHECK_ab", [0], [95]),
        _log_line("2026-12-05T07:55:38.000000", "r1", [5, 6, 7], [9, 9]),
        _log_line("2026-12-05T07:56:38.000000", "r2", [5, 6, 8], [1]),
        "[2026-12-05 07:57:00] Prefill batch, #new-seq: 1",
    ])}
    out = at.request_outputs(logs)
    assert sorted(out.values()) == [[1], [9, 9]]                 # the health check is left out
    t = datetime.datetime.fromisoformat("2026-12-05T07:56:00").timestamp()
    assert list(at.request_outputs(logs, since=t).values()) == [[1]]
    assert list(at.request_outputs(logs, until=t).values()) == [[9, 9]]
    other = dict(out)
    key = next(k for k, v in other.items() if v == [1])
    other[key] = [2]
    other["extra"] = [3]
    assert at.compare_outputs(out, other) == {"equal": 1, "total": 3, "only_one_side": 1}


def test_pool_sizes_and_receipts_from_the_logs():
    logs = {"a": "[ts] SWAKVPool mem usage: 0.00 GB, swa size: 1638, full size: 32768\n",
            "b": "[ts] [dsv41] swa_thin installed: DSV41_SWA_THIN=1: ...\n[ts] [dsv41] swa_thin installed: DSV41_SWA_THIN=1: ...\n"}
    assert at.pool_sizes(logs) == {"swa": 1638, "full": 32768}
    assert at.dsv41_lines(logs, "swa_thin") == ["[dsv41] swa_thin installed: DSV41_SWA_THIN=1: ..."]


def test_scales_fit_their_pools():
    for (model, scale), sc in at.SCALES.items():
        args = sc.server_args()
        if args.get("--max-total-tokens", "") is None:
            continue        # the engine sizes the pools (scale "knobs": tests/test_agent_traffic_lines.py)
        full = int(args["--max-total-tokens"])
        session = sc.session_system + sc.session_first + sc.session_turns * (sc.turn_output + sc.session_user)
        subagent = sc.subagent_first + sc.subagent_turns * (sc.turn_output + sc.subagent_user)
        users = sum(b - (s if i else 0) for i, (_, b, s) in enumerate(sc.users)) * 400
        # the idle sessions' full KV must stay resident through the other traffic
        assert sc.sessions * (session + sc.resume_user + sc.turn_output) + sc.subagents * subagent + users < full, (model, scale)
        # the streams and the long prompt fit beside each other
        assert sc.streams * (sc.stream_blocks * 400 + sc.stream_output) + sc.long_blocks * 400 < full, (model, scale)
        assert {r["what"] for r in at.scaling_table(model, scale)} >= {"SWA pool", "prefill chunk", "full KV pool"}


def _bench():
    spec = importlib.util.spec_from_file_location("bench_agent_traffic", REPO_ROOT / "bench" / "agent_traffic.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _boot(label, index, resumed_cached, resume_ttft, long_ttft, rps, outputs):
    resumed = [{"ttft_s": t, "cached_tokens": c, "prompt_tokens": 1000, "cached_fraction": c / 1000, "text": "r"}
               for c, t in zip(resumed_cached, resume_ttft)]
    return {"label": label, "index": index, "errors": [], "pool": {"swa": 1, "full": 2},
            "receipts": {"swa_thin": [], "decode_yield": [], "swa_cone": []},
            "outputs_conversations": outputs, "outputs_all": outputs,
            "rows": {"resume": {"resumed": resumed, "later": [], "cached_fraction": 0},
                     "agent": {"turns": [{"text": "a"}]},
                     "streams": {"itl_gaps_s": [0.01, 0.5], "itl_p50_s": 0.2, "itl_p99_s": 0.5, "itl_max_s": 0.5,
                                 "rate_ratio": 0.1, "long_ttft_s": long_ttft, "long_prompt_tokens": 5000,
                                 "streams_ended_before_first_token": 0},
                     "short": {"request_throughput": rps, "output_throughput": rps * 32, "ttft_p50_s": 0.2,
                               "cpu_ms_per_request": {"scheduler": 30.0, "launcher": 10.0}},
                     "profile": None}}


def test_bench_reads_resumed_turns_whose_window_stock_lost_and_states_each_goal():
    bench = _bench()
    same = {"k1": [1, 2]}
    boots = [_boot("stock", 1, [0, 990], [2.0, 0.3], 2.0, 3.0, same),
             _boot("line", 2, [990, 990], [0.3, 0.3], 3.0, 3.0, same),
             _boot("stock", 3, [0, 0], [2.2, 2.0], 2.0, 3.0, same),
             _boot("line", 4, [990, 995], [0.4, 0.3], 3.0, 2.8, {"k1": [1, 3]})]
    res = bench.aggregate(boots)
    assert res["resume_lost"] == [0]            # session 1 kept its window on stock boot 1
    assert res["resume_stock"]["ttft_p50_s"] == pytest.approx(2.1)
    assert res["resume_line"]["ttft_p50_s"] == pytest.approx(0.35)
    assert res["resume_line"]["cached_fraction"] == pytest.approx(0.99)
    goals = {g["goal"]: g for g in bench.goals(res)}
    assert set(goals) == {"resume-ttft", "resume-cached", "stream-itl", "long-ttft", "short-throughput (requests/s)",
                          "short-throughput (output tokens/s)", "short-ttft", "outputs"}
    assert goals["resume-ttft"]["met"] is True and "x6 " in goals["resume-ttft"]["text"]
    assert "pairs [6.667, 5.5]" in goals["resume-ttft"]["text"]
    assert goals["resume-cached"]["met"] is True
    assert goals["long-ttft"]["met"] is True                       # 3.0 / 2.0 = 1.5 in both pairs
    # pooled 2.9 / 3.0 and the second pair 2.8 / 3.0 both short of 0.98
    assert goals["short-throughput (requests/s)"]["met"] is False
    assert goals["outputs"]["met"] is False and "1 of 2 prompts" in goals["outputs"]["text"]
    assert all(g["text"].startswith(f"goal {g['goal']}: {'met' if g['met'] else 'missed'}: ") for g in goals.values())
    rows = dict(bench.table(res))
    assert "cluster 61-64 s" in rows["resume_ttft_p50"] and "stock 2.1 s [2 s, 2.2 s]" in rows["resume_ttft_p50"]
    assert "line/stock 1" in rows["short_scheduler_cpu_ms_per_request"]


def test_a_pair_that_disagrees_misses_the_goal():
    bench = _bench()
    boots = [_boot("stock", 1, [0], [2.0], 2.0, 3.0, {}), _boot("line", 2, [990], [0.2], 2.0, 3.0, {}),
             _boot("stock", 3, [0], [2.0], 2.0, 3.0, {}), _boot("line", 4, [990], [0.8], 2.0, 3.0, {})]
    goals = {g["goal"]: g for g in bench.goals(bench.aggregate(boots))}
    # pooled 2.0 / 0.5 = x4, pairs x10 and x2.5: missed
    assert goals["resume-ttft"]["met"] is False and "pairs [10, 2.5]" in goals["resume-ttft"]["text"]
    assert "line 300%" in goals["resume-ttft"]["text"]


def _boot_rows(resume_ttft, rate_ratio, phases):
    """One boot's agent-traffic rows as run_agent_traffic returns them (the fields
    canary_report / compare read)."""
    return {"phases": phases,
            "resume": {"ttft_p50_s": resume_ttft, "cached_fraction": 0.97 if resume_ttft < 1 else 0.0,
                       "resumed": [{"text": "r"}]},
            "streams": {"itl_p50_s": 0.05, "itl_p99_s": 0.5, "rate_ratio": rate_ratio, "long_ttft_s": 2.0},
            "short": {"request_throughput": 3.0, "ttft_p50_s": 0.2}}


# The engine's request log of one boot: three conversation turns inside the agent..resume phases
# (07:00:10 - 07:00:50), one request after them (the canary's own traffic: not compared).
PHASES = {"agent": [1_900_000_000.0, 1_900_000_020.0], "resume": [1_900_000_030.0, 1_900_000_050.0]}


def _request_log(outputs):
    import datetime

    lines = []
    for k, (t, out) in enumerate(zip((12, 25, 45, 70), outputs)):
        ts = datetime.datetime.fromtimestamp(1_900_000_000 + t).isoformat(timespec="microseconds")
        lines.append(_log_line(ts, f"r{k}", [100 + k, 7, 7], out))
    return "\n".join(lines) + "\n"


@pytest.mark.parametrize("equal", [3, 2])
def test_canary_traffic_agent_runs_the_workload_on_both_boots_of_a_windowed_model(monkeypatch, tmp_path,
                                                                                  capsys, equal):
    """`dsv41 canary --traffic agent`: each model with a canary scale gets the workload's launch
    args and on_server on both its boots, and its rows in models.<m>.agent_traffic; a model
    without one (dense) is reported as skipped; outputs that differ fail the model's report.

    Only the workload itself (canary_setup: it needs a live server) is a stand-in: its on_server
    returns rows of the run_agent_traffic shape, the boot's request log holds the outputs, and
    the report is agent_traffic.canary_report's own (compare of the rows, the T=0 outputs read
    from the logs within the workload's phases)."""
    from adapter.tools import canary, cli

    calls = []
    rows = {"control": _boot_rows(2.0, 0.1, PHASES), "line": _boot_rows(0.5, 0.4, PHASES)}
    control_out = [[1, 2], [3], [4, 4], [9]]
    # the line differs on the last request (outside the phases: not compared), and, when
    # equal == 2, on the second turn
    line_out = [[1, 2], [3] if equal == 3 else [3, 5], [4, 4], [8]]

    def on_server(label):
        return {"agent_traffic": rows[label]}

    monkeypatch.setattr(at, "canary_setup", lambda model, workdir: ({"--agent-arg": model}, on_server))

    def fake_run(model, keys, args, progress=None, name="", **extra):
        calls.append((model, dict(args), extra.get("on_server")))
        run = canary.ConfigRun(model, dict(keys), dict(args))
        label = "control" if "control" in name else "line"
        if extra.get("on_server"):           # what canary.run_config does after its traffic
            run.extras.update(extra["on_server"](label) or {})
            run.logs = {"launcher pid 1": _request_log(control_out if label == "control" else line_out)}
        return run

    profile = REPO_ROOT / ".env.tp4.example"
    args = cli.build_parser().parse_args(["canary", "--profile", str(profile), "--cpu-model", "dense,swa",
                                          "--traffic", "agent", "--json"])
    canary.main(args, run=fake_run)
    report = json.loads(capsys.readouterr().out)
    assert report["traffic"] == "agent"
    assert [(m, a.get("--agent-arg"), s is on_server) for m, a, s in calls] == \
        [("dense", None, False), ("dense", None, False), ("swa", "swa", True), ("swa", "swa", True)]
    assert "skipped" in report["models"]["dense"]["agent_traffic"]
    swa = report["models"]["swa"]
    agent = swa["agent_traffic"]
    assert agent["outputs"] == {"equal": equal, "total": 3, "only_one_side": 0}
    assert agent["ok"] is (equal == 3)
    assert agent["resume_ttft_p50"] == {"control_s": 2.0, "line_s": 0.5, "control_over_line": 4.0}
    assert agent["stream_rate_ratio"] == {"control": 0.1, "line": 0.4}
    agent_errors = [e for e in swa["errors"] if e.startswith("agent traffic")]
    assert agent_errors == ([] if equal == 3 else
                            ["agent traffic: T=0 output ids of the conversations' turns equal on 2 of 3 prompts"])
    # the table carries the rows
    args.json = False
    calls.clear()
    canary.main(args, run=fake_run)
    table = capsys.readouterr().out
    assert "agent traffic (sglang.bench_serving): resumed-turn TTFT p50 control 2 s -> line 0.5 s" in table
    assert f"T=0 output ids of the conversations' turns {equal} of 3" in table


def test_canary_without_traffic_agent_runs_no_workload(monkeypatch, capsys):
    from adapter.tools import canary, cli

    monkeypatch.setattr(at, "canary_setup", lambda *a: pytest.fail("the workload ran without --traffic agent"))
    seen = []

    def fake_run(model, keys, args, progress=None, name="", **extra):
        seen.append(extra)
        return canary.ConfigRun(model, dict(keys), dict(args))

    args = cli.build_parser().parse_args(["canary", "--profile", str(REPO_ROOT / ".env.tp4.example"),
                                          "--cpu-model", "swa", "--json"])
    canary.main(args, run=fake_run)
    report = json.loads(capsys.readouterr().out)
    assert report["traffic"] == "canary" and seen == [{}, {}]
    assert "agent_traffic" not in report["models"]["swa"]


def test_every_canary_scale_keeps_the_canarys_own_pools():
    """The canary's own scenarios are sized for its pools (canary.MODEL_ARGS, the harness's
    defaults): a canary-scale workload must not change them."""
    from adapter.cpu import server
    from adapter.tools import canary

    for (model, scale), sc in at.SCALES.items():
        if scale != "canary":
            continue
        base = {**server.DEFAULT_ARGS, **server.MODEL_DEFAULT_ARGS.get(model, {}), **canary.MODEL_ARGS[model]}
        for flag, value in sc.server_args().items():
            assert base.get(flag) == value, (model, flag, value, base.get(flag))
