"""input_guard on the real server (issue 50): no client request costs another client anything, and
every client mistake is a 4xx naming it.

One boot: the production line (tests/e2e/e2e_configs.py PROD_KEYS / PROD_ARGS, the dense model,
`--enable-metrics` as the suite's production boots; the grammar step bound at 20 ms and every
grammar step planted at 50 ms by the harness, below; the grammar pool and caches:
test_e2e_guard_grammar, a boot of its own). The engine honours a sampling seed only under
`--enable-deterministic-inference`, which the production line does not set: here a seed is only
served; its effect (the same seed, the same text on both routes) is measured on a test boot with
the flag, tests/e2e/test_e2e_seed.py (docs/input_guard.md, "Seeds"). On the line:

- seeds: an Ollama client's `options.seed` answers 200 on both Ollama routes (every seeded Ollama
  request was a TypeError 500), streamed too, as a seeded `/generate` does;
- pooling: every `token_indices_to_pool` shape the engine's pooling path cannot serve (each killed
  the stock CPU server: docs/input_guard.md) answers 400, the server healthy after each;
- the grammar step bound: an ambiguous regex grammar ends with 400 saying it exceeded the
  per-step bound, with the bound in ms;
- the review's classes, each refused before its work runs (the 400 names the guard's bound: the
  guard's check sits before that work in the request's path, tests/test_input_guard_routes.py),
  with /health answering after it: a 300 KB `/parse_function_call` of unclosed tags, a 9 MB
  `text`, 200 prompts x n 100; and a duplicate rid on a streamed `/generate`: the refused stream's
  abort leaves the owner's request whole;
- the chat routes' text (a 1.25M-character `messages` on `/v1/chat/completions` and `/api/chat`,
  refused before the template runs) and the log-prob bound over the whole request (a batch
  refused while each of its prompts alone is served), /health and a greedy probe after each.

No wall-clock verdicts: each case asserts what the server answered and what it did (the owner's
tokens, the guard's counters on /metrics), not how fast.
"""
from __future__ import annotations

import json
import re
import threading
import time

import pytest
import requests

from adapter.cpu.server import CpuServer
from adapter.tools import traffic

from e2e.e2e_configs import PROD_ARGS, PROD_KEYS

MODEL = "dense"
ARGS = {**PROD_ARGS, "--enable-metrics": ""}
# The grammar step bound at 20 ms on this boot (the production default is 100), and every grammar
# step planted at 50 ms by the CPU harness (adapter/cpu/grammar_step.py, DSV41CPU_GRAMMAR_STEP_MS:
# each xgrammar accept_token sleeps first), so the grammar test's steps are over the bound on any
# machine, however fast (a real grammar's step time is the machine's). No other test on this boot
# sends a grammar: the compile pool and the caches have their own boot (test_e2e_guard_grammar).
KEYS = {**PROD_KEYS, "DSV41_INPUT_GUARD_GRAMMAR_STEP_MS": "20"}
PLANTED = {"DSV41CPU_GRAMMAR_STEP_MS": "50"}
PROMPT = "The quick brown fox"
P8 = [5, 6, 7, 8, 9, 10, 11, 12]
SCORING = {"return_logprob": True, "logprob_start_len": 0, "token_ids_logprob": [5, 6]}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with CpuServer(MODEL, keys=KEYS, args=ARGS, name="guard-costs", extra_env=dict(PLANTED),
                   log_dir=tmp_path_factory.mktemp("guard-costs")) as srv:
        yield srv


def _post(server, path, body, timeout=120):
    return requests.post(server.url + path, json=body, timeout=timeout)


def test_a_seeded_ollama_request_is_served(server):
    for path, body in (("/api/generate", {"prompt": PROMPT}),
                       ("/api/chat", {"messages": [{"role": "user", "content": PROMPT}]})):
        for stream in (False, True):
            resp = _post(server, path, {"model": "m", "stream": stream, **body,
                                        "options": {"seed": 1234, "temperature": 1.0,
                                                    "num_predict": 8}})
            if path == "/api/chat" and resp.status_code == 500:
                # the dense model has no chat template: the engine's own fault, before the seed
                assert "chat" in resp.text.lower() or resp.text == "Internal Server Error"
                continue
            assert resp.status_code == 200, (path, stream, resp.text[:300])
    resp = _post(server, "/generate", {"text": PROMPT, "sampling_params": {
        "sampling_seed": 1234, "temperature": 1.0, "max_new_tokens": 8}})
    assert resp.status_code == 200, resp.text


POOLING_REFUSED = {
    # each killed the stock CPU server (docs/input_guard.md, "Pooling")
    "without the scoring shape, after a cache hit": dict(input_ids=P8, token_indices_to_pool=[6]),
    "logprob_start_len -1, after a cache hit": dict(input_ids=P8, token_indices_to_pool=[6],
                                                    return_logprob=True, token_ids_logprob=[5]),
    "a list on a single prompt": dict(input_ids=P8, token_indices_to_pool=[[1, 2]], **SCORING),
    "a prompt of two chunks": dict(input_ids=traffic.token_ids(7, 1500), token_indices_to_pool=[10],
                                   **SCORING),
    "empty": dict(input_ids=P8, token_indices_to_pool=[], **SCORING),
    # stock served it, ignoring the field: a client mistake named
    "with max_new_tokens 4": dict(input_ids=P8, token_indices_to_pool=[1], max_new=4, **SCORING),
}


def test_pooling_shapes_the_engine_cannot_serve_answer_400(server):
    warm = _post(server, "/generate", {"input_ids": P8, "sampling_params": {"max_new_tokens": 0},
                                       "token_indices_to_pool": [1, 3], **SCORING})
    assert warm.status_code == 200, warm.text           # the scoring shape: served (and cached)
    for name, body in POOLING_REFUSED.items():
        body = dict(body)
        body["sampling_params"] = {"max_new_tokens": body.pop("max_new", 0)}
        resp = _post(server, "/generate", body)
        assert resp.status_code == 400, (name, resp.status_code, resp.text[:300])
        assert "token_indices_to_pool" in resp.text, (name, resp.text[:300])
        assert server.healthy(), name


def test_a_grammar_over_the_step_bound_ends_with_400_naming_the_bound(server):
    resp = _post(server, "/generate", {"input_ids": traffic.token_ids(3, 16),
                                       "sampling_params": traffic.ambiguous_grammar_sampling(400)},
                 timeout=300)
    assert resp.status_code == 400, resp.text[:300]
    assert ("this request's grammar exceeded the per-step bound of 20 ms "
            "(DSV41_INPUT_GUARD_GRAMMAR_STEP_MS)") in resp.text
    took = re.search(r"one decode step of it took (\d+) ms", resp.text)
    assert took and int(took.group(1)) >= 50, resp.text[:300]   # the planted 50 ms at least
    assert server.healthy()


@pytest.mark.parametrize("path, body, bound", [
    ("/parse_function_call", {"text": "<tool_call>{" * 25_000, "tools": [],
                              "tool_call_parser": "qwen25"}, "DSV41_INPUT_GUARD_MAX_PARSE_CHARS"),
    ("/generate", {"text": "word " * 1_800_000, "sampling_params": {"max_new_tokens": 1}},
     "DSV41_INPUT_GUARD_MAX_TEXT_CHARS"),
    ("/generate", {"text": ["hi"] * 200, "sampling_params": {"n": 100, "max_new_tokens": 8,
                                                             "temperature": 1.0}},
     "DSV41_INPUT_GUARD_MAX_N"),
])
def test_work_a_request_would_do_on_the_loop_is_refused_before_it_runs(server, path, body, bound):
    resp = _post(server, path, body)
    assert resp.status_code == 400, resp.text[:300]
    assert bound in resp.text
    assert server.healthy()
    probe = server.generate(P8, max_new_tokens=4)
    assert probe["meta_info"]["completion_tokens"] == 4


def _stream(server, rid, tokens, out):
    body = {"input_ids": traffic.token_ids(21, 24), "rid": rid, "stream": True,
            "sampling_params": {"temperature": 0.0, "max_new_tokens": tokens, "ignore_eos": True}}
    last = None
    with requests.post(server.url + "/generate", json=body, stream=True, timeout=300) as resp:
        out["status"] = resp.status_code
        for raw in resp.iter_lines():
            if raw.startswith(b"data:") and raw[5:].strip() != b"[DONE]":
                last = json.loads(raw[5:])
    out["last"] = last


def test_a_refused_duplicate_rid_leaves_the_owners_stream_whole(server):
    owner: dict = {}
    thread = threading.Thread(target=_stream, args=(server, "job-dup", 400, owner))
    thread.start()
    deadline = time.monotonic() + 60
    while "status" not in owner and time.monotonic() < deadline:
        time.sleep(0.1)
    dup: dict = {}
    _stream(server, "job-dup", 4, dup)
    assert "error" in dup["last"] and "Duplicate request ID detected: job-dup" in json.dumps(dup["last"])
    thread.join(timeout=300)
    meta = owner["last"]["meta_info"]
    assert meta["completion_tokens"] == 400, meta       # not aborted by the duplicate's abort task
    assert meta["finish_reason"]["type"] == "length"


def test_the_refusals_are_counted(server):
    text = requests.get(server.url + "/metrics", timeout=30).text
    for reason in ("token_indices_to_pool", "parse_chars", "text_chars", "n"):
        line = next((ln for ln in text.splitlines()
                     if ln.startswith("dsv41_input_guard_rejected_total") and f'reason="{reason}"' in ln),
                    None)
        assert line is not None and float(line.rsplit(" ", 1)[1]) >= 1, (reason, line)


# --- issue 50's two remaining bounds: the chat routes' text, the whole request's log-probs -------

HUGE_CHAT = [{"role": "user", "content": "word " * 250_000}]      # 1.25M characters (bound: 8 x 32,768)


@pytest.mark.parametrize("path, body", [
    ("/v1/chat/completions", {"model": "m", "messages": HUGE_CHAT, "max_tokens": 4}),
    ("/api/chat", {"model": "m", "messages": HUGE_CHAT, "stream": False}),
])
def test_a_huge_chat_request_is_refused_before_its_template_runs(server, path, body):
    """The chat handlers render the template over `messages` and tokenize the result before any
    request reaches generate_request (the OpenAI one in the shared default executor, Ollama's on
    the HTTP event loop): refused at the route with 400 naming the bound (on this model /api/chat
    would otherwise be the engine's own 500, no chat template: the guard answers first)."""
    resp = _post(server, path, body)
    assert resp.status_code == 400, resp.text[:300]
    assert "DSV41_INPUT_GUARD_MAX_TEXT_CHARS" in resp.text and "messages holds" in resp.text
    assert server.healthy()
    probe = server.generate(P8, max_new_tokens=4)
    assert probe["meta_info"]["completion_tokens"] == 4


def _logprob_prompt(seed, length):
    return {"input_ids": traffic.token_ids(seed, length), "return_logprob": True,
            "logprob_start_len": 0, "top_logprobs_num": 1000}


def test_a_batch_over_the_log_prob_bound_together_is_refused_while_each_prompt_is_served(server):
    """Two prompts of 520 positions at top-1000 ask for 520,000 prompt log-prob entries each (the
    bound is 1,000,000) and 1,040,000 together, all converted on the HTTP event loop: the batch is
    refused naming the bound, one prompt alone is served."""
    a, b = _logprob_prompt(31, 520), _logprob_prompt(32, 520)
    batch = {**a, "input_ids": [a["input_ids"], b["input_ids"]],
             "sampling_params": {"max_new_tokens": 1}}
    resp = _post(server, "/generate", batch)
    assert resp.status_code == 400, resp.text[:300]
    assert "1,040,000 prompt log-prob entries (2 prompts" in resp.text
    assert "DSV41_INPUT_GUARD_MAX_LOGPROB_ENTRIES" in resp.text
    assert server.healthy()
    alone = _post(server, "/generate", {**a, "sampling_params": {"max_new_tokens": 1}}, timeout=300)
    assert alone.status_code == 200, alone.text[:300]
    assert len(alone.json()["meta_info"]["input_top_logprobs"]) == 520
    probe = server.generate(P8, max_new_tokens=4)
    assert probe["meta_info"]["completion_tokens"] == 4
