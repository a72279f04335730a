"""Traffic for a real server, through its HTTP API only: what `dsv41 canary` and tests/e2e run.

Prompts are token ids from a seeded generator (no tokenizer round trip), all requests greedy
(temperature 0, ignore_eos) with logprobs, so two servers given the same sequence can be compared
token for token:
  - `equality_run`: a short prompt, a chunked prompt (> the chunk size), its exact repeat (cache
    hit), a resume (prompt + output + a new turn), four concurrent prompts, the short one again;
  - `window_resume`: (hybrid SWA) a document, concurrent traffic that evicts its sliding window
    while its full KV stays resident, then the document plus a new turn (a lost resume point);
  - `idle_session_resume`: (hybrid SWA) an idle session, sub-agent turns and new prompts, then
    the idle session's next turn;
  - `yield_cadence`: running streams' token rate while a long prompt prefills in chunks, over
    their rate before it;
  - the tiny DeepSeek-V4 (`model="dsv4"`): `dsv4_window_resume`, `dsv4_idle_session_resume` (the
    two scenarios above sized for its pools, DSV4_WINDOW / DSV4_IDLE) and
    `decode_beside_chunked_prefill` (one stream decoding while a chunked prompt prefills: the
    records to compare, and decode yield's decision line in the scheduler log).
"""
from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import functools
import json
import random
import threading
import time
from typing import Optional

import requests

from adapter.cpu.server import CpuServer, output_of

VOCAB_LO, VOCAB_HI = 3, 1024      # token ids of the tiny models' vocabulary past the specials
LOGPROB_TOL = 1e-4                # two stock boots agree within ~2e-6; batching moves the last bits


def token_ids(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(VOCAB_LO, VOCAB_HI) for _ in range(n)]


# An ambiguous regex grammar (input_guard's grammar step bound: bench/beside_ratio.py,
# tests/e2e/grammar_traffic.py): xgrammar's matching grows with every "a" (on this CPU ~1 ms a
# step at 80 tokens, ~45 ms at 200); the logit_bias keeps the dense model producing "a".
AMBIGUOUS_REGEX = "(a|aa|a*)*(a|aa)*b"


@functools.lru_cache(maxsize=None)
def dense_token(text: str) -> int:
    """The dense tiny model's token id that decodes to `text`."""
    from transformers import AutoTokenizer

    from adapter.cpu import models

    tok = AutoTokenizer.from_pretrained(str(models.ensure_model("dense")))
    return next(i for i in range(models.VOCAB) if tok.decode([i]) == text)


def ambiguous_grammar_sampling(max_new_tokens: int) -> dict:
    """Greedy sampling params of a request held on AMBIGUOUS_REGEX, its letter biased."""
    return {"max_new_tokens": max_new_tokens, "temperature": 0.0, "regex": AMBIGUOUS_REGEX,
            "logit_bias": {str(dense_token("a")): 100.0}}


@dataclasses.dataclass
class Record:
    name: str
    prompt_len: int
    ids: list
    logprobs: list
    cached_tokens: int

    def as_json(self) -> dict:
        return dataclasses.asdict(self)


def _record(name: str, prompt: list, response: dict) -> Record:
    ids, lps = output_of(response)
    return Record(name, len(prompt), ids, lps, int(response["meta_info"].get("cached_tokens", 0)))


def equality_run(server: CpuServer, chunk: int, new_tokens: int = 16,
                 one_batch: bool = False) -> list[Record]:
    """The prompt set every configuration gets, in one fixed order. `chunk`: the server's
    --chunked-prefill-size (the chunked prompt is 2.5 chunks long). one_batch: the four
    concurrent prompts go as one /generate with a batch of input_ids, which the tokenizer manager
    hands to the scheduler as one message (BatchTokenizedGenerateReqInput), so every boot admits
    them in the same rounds; sent as four requests at once, their batching follows arrival times.
    The tiny DeepSeek-V4 (bfloat16) needs it: its logprobs move with the batch's composition."""
    out = []

    def one(name, prompt):
        rec = _record(name, prompt, server.generate(prompt, max_new_tokens=new_tokens))
        out.append(rec)
        return rec

    short = token_ids(11, 40)
    long = token_ids(12, chunk * 5 // 2)
    one("short", short)
    first = one("chunked", long)
    one("cache-hit", long)
    one("resume", long + first.ids + token_ids(13, 40))
    batch = [token_ids(20 + i, n) for i, n in enumerate((300, chunk * 3 // 4, chunk + 200, 60))]
    if one_batch:
        responses = server.generate(batch, max_new_tokens=new_tokens)
        assert isinstance(responses, list) and len(responses) == len(batch), responses
    else:
        with cf.ThreadPoolExecutor(len(batch)) as pool:
            responses = list(pool.map(lambda p: server.generate(p, max_new_tokens=new_tokens), batch))
    out += [_record(f"concurrent-{i}", p, r) for i, (p, r) in enumerate(zip(batch, responses))]
    one("short-again", short)
    return out


@dataclasses.dataclass
class Comparison:
    equal: int
    total: int
    max_logprob_diff: float
    mismatches: list            # names of records whose ids differ or logprobs exceed LOGPROB_TOL

    @property
    def ok(self) -> bool:
        return self.equal == self.total

    def as_json(self) -> dict:
        return dataclasses.asdict(self)


def compare(reference: list[Record], other: list[Record], tol: float = LOGPROB_TOL) -> Comparison:
    equal, worst, bad = 0, 0.0, []
    for a, b in zip(reference, other):
        same = a.name == b.name and a.ids == b.ids and len(a.logprobs) == len(b.logprobs)
        diff = max((abs(x - y) for x, y in zip(a.logprobs, b.logprobs)), default=0.0)
        worst = max(worst, diff)
        if same and diff <= tol:
            equal += 1
        else:
            bad.append(a.name)
    if len(reference) != len(other):
        bad.append(f"record count {len(reference)} vs {len(other)}")
    return Comparison(equal, max(len(reference), len(other)), worst, bad)


# --- hybrid SWA: a resume point lost to SWA eviction --------------------------------------------

def window_resume(server: CpuServer, doc_tokens: int = 1300, turn_tokens: int = 44,
                  other_tokens: int = 500, others: int = 8, new_tokens: int = 16,
                  one_batch: bool = False, hit_at: Optional[int] = None) -> dict:
    """Cache a document, evict its sliding window with concurrent traffic (its full KV stays),
    resume it with a new turn. Needs a small SWA pool (--swa-full-tokens-ratio). one_batch: the
    traffic goes as one /generate with a batch of input_ids (one scheduler message, so every
    boot admits it in the same rounds: equality_run says why) instead of 4 requests at a time.
    hit_at: then serve the same prompt as a prefix hit at that F (prefix_hit; "hit")."""
    doc = token_ids(31, doc_tokens)
    cold = _record("doc", doc, server.generate(doc, max_new_tokens=4))
    traffic = [token_ids(40 + i, other_tokens) for i in range(others)]
    if one_batch:
        server.generate(traffic, max_new_tokens=4)
    else:
        with cf.ThreadPoolExecutor(4) as pool:
            list(pool.map(lambda p: server.generate(p, max_new_tokens=4), traffic))
    prompt = doc + token_ids(32, turn_tokens)
    resume = _record("doc+turn", prompt, server.generate(prompt, max_new_tokens=new_tokens))
    out = {"doc": cold, "resume": resume, "prompt_len": len(prompt)}
    if hit_at is not None:
        out["hit"] = prefix_hit(server, doc, prompt, hit_at, new_tokens)
    return out


def prefix_hit(server: CpuServer, doc: list, prompt: list, F: int, new_tokens: int) -> Record:
    """What the engine computes for `prompt` as a prefix hit at F (issue 48): the cache is
    emptied, the document's first F tokens are served (the tree then holds [0, F) with its window
    at F), and the prompt comes again (its record's cached_tokens shows the hit). The reference
    for cone's resume beside the engine's decoder SWA bounded replay, whose late layers make a
    resume's answer depend on where its passes start (docs/swa_cone.md): a hit at F and cone's
    replay from F - N end their passes alike, a cold re-prefill does not."""
    server.flush_cache(wait_s=30)
    server.generate(doc[:F], max_new_tokens=1)
    return _record("doc+turn@F", prompt, server.generate(prompt, max_new_tokens=new_tokens))


def idle_session_resume(server: CpuServer, session_tokens: int = 600, agents: int = 4, turns: int = 4,
                        turn_tokens: int = 150, new_prompts: int = 1, new_tokens_each: int = 900,
                        resume_tokens: int = 40) -> dict:
    """(hybrid SWA) An idle session's resume after other traffic: a session is cached, sub-agents
    run `turns` growing turns each (every turn moves past the previous turn's checkpoint), then
    a new 900-token prompt needs more SWA slots than are free; then the idle session comes back.
    With a small SWA pool (--swa-full-tokens-ratio 0.15: 1,228 slots) the stock LRU evicts the
    idle session's window first (it is the oldest); `cached_tokens` of its resume shows whether it
    survived. One new prompt, not concurrent ones: the SWA demand must not depend on whether two
    requests happen to share a batch (two concurrent 400-token prompts did, or did not, evict)."""
    session = token_ids(81, session_tokens)
    first = _record("session", session, server.generate(session, max_new_tokens=4))
    prompts = [token_ids(90 + a, 200) for a in range(agents)]
    for k in range(turns):
        for a in range(agents):
            r = server.generate(prompts[a], max_new_tokens=8)
            prompts[a] = prompts[a] + output_of(r)[0] + token_ids(300 + 10 * k + a, turn_tokens)
    with cf.ThreadPoolExecutor(new_prompts) as pool:
        list(pool.map(lambda i: server.generate(token_ids(400 + i, new_tokens_each), max_new_tokens=4),
                      range(new_prompts)))
    prompt = session + token_ids(82, resume_tokens)
    resume = _record("session+turn", prompt, server.generate(prompt, max_new_tokens=16))
    agent_cached = [int(server.generate(p, max_new_tokens=2)["meta_info"]["cached_tokens"]) for p in prompts]
    return {"session": first, "resume": resume, "session_tokens": session_tokens,
            "agent_resume_cached": agent_cached}


# --- the tiny DeepSeek-V4 (model="dsv4"): the scenarios sized for its pools -----------------------
# Its server (adapter/cpu/server.py MODEL_DEFAULT_ARGS): page 256, SWA window 128, full pool 8192
# tokens, SWA pool 2048 (8 pages of 256). Every cached page keeps its SWA slots until SWA eviction
# takes it, in LRU order (thin: passed checkpoints first); eviction of a leaf takes its full KV
# page too. Every size below is the smallest that shows the effect. The scenarios work at the
# server's 512-token chunks and at DSV4_CHUNK.
#
# DSV4_CHUNK: cone's first pass then holds the replay [s, F) and the resume's new tokens, so rows
# >= F read the replay rows' pages (the copied latents / index keys) in that pass: the path cone's
# copy serves, where a skipped copy changes the answer. With 512-token chunks (= N) the first
# pass is exactly [s, F), and the engine's checkpoint after it repoints [s, F) of the request at
# the resident pages (checkpoint_into_tree's insert dedup), so rows >= F never read the replay
# rows' latents: measured, even DSV41_SWA_CONE_TEST_NO_COPY=1 then gives stock's answer.
DSV4_CHUNK = 1024
# Lost window (cone): a 1024-token document (4 pages: the smallest for a replay of N = 512, see
# DSV4_CONE_TOKENS), then 4 260-token prompts in one batch (each holds 2 SWA pages while it runs):
# SWA eviction takes the document's 4 pages (its last leaf with its full page), its full KV
# [0, 768) stays. The resume (document + 40) then has F = 768: stock matches 0 and re-prefills
# 1,064 tokens; cone replays [256, 768) and reuses 256.
DSV4_WINDOW = dict(doc_tokens=1024, turn_tokens=40, other_tokens=260, others=4, new_tokens=10,
                   one_batch=True)
# Cone's N for this model: the first pass must cover the replay (N <= the chunk) and N must cover
# the model's receptive cone (layers x 127 rows: 381 at 3 layers), so 512. The profile's 8192
# exceeds every resume point this pool holds (F <= 8192): s = F - N clamps to 0, which is never
# past the stock hit, and cone declines ("replay start F-N is not past the stock hit; stock match
# kept"), changing nothing. A CPU run of the profile's cone keys on this model therefore sets
# DSV41_SWA_CONE_TOKENS=512 (and says so).
DSV4_CONE_TOKENS = 512
# Idle session (thin): a 512-token session (2 SWA pages, the oldest), then one new 3072-token
# prompt in chunks. Each chunk checkpoint keeps its window's 2 pages; the last pass's pages
# overflow the 8 SWA pages by 3 (at DSV4_CHUNK). Stock LRU evicts the session's 2 pages first
# (its last leaf with its full page): its resume re-prefills. Thin moved the prompt's passed
# checkpoint (2 pages) to the evict-first end, so only the session's first page goes (a
# tombstone: its last window, [256, 512), still holds SWA) and the session resumes in full.
# Then the session + 40 tokens.
DSV4_IDLE = dict(session_tokens=512, agents=0, new_prompts=1, new_tokens_each=3072)
# Decode yield: one stream decoding while a 2054-token prompt prefills in chunks. The stream's
# 32-token prompt rides in the first pass with the prompt's first 768 tokens (one scheduler
# message; the chunk page-aligned), so the stream is a decode row only from the end of that pass:
# the second pass (1024) is the non-final chunk it yields to (one yield decision), then the final
# 262. (Issue 43: at 1030
# the only non-final chunk was the first pass, with no decode row yet: the yield never acted, and
# the canary had no achieved share to show for dsv4.) DSV4_YIELD_STREAM tokens outlast a yield of
# a fitted model on this machine (~50 steps after a 1024-token chunk).
DSV4_YIELD_PROMPT = 2054
DSV4_YIELD_STREAM = 96


def dsv4_window_resume(server: CpuServer) -> dict:
    """window_resume sized for the tiny DeepSeek-V4 (DSV4_WINDOW)."""
    return window_resume(server, **DSV4_WINDOW)


# The lost window's resume point on this pool (DSV4_WINDOW's comment: the document's full KV
# [0, 768) stays): where cone's plan puts F, and where the reference hit is served.
DSV4_WINDOW_F = 768


# The idle session's resume on the tiny DeepSeek-V4.1: beside the engine's decoder SWA bounded
# replay every match stops 128 tokens short of the prompt (`_req_radix_key`), so a resume of the
# 512-token session + 40 could match at most [0, 256), whose window (the session's first page)
# thin lets go; with a turn of 200 tokens the match can reach the session's end, the window thin
# keeps (an agent's turn on the cluster is longer still).
DSV41_IDLE = dict(DSV4_IDLE, resume_tokens=200)


def dsv41_idle_session_resume(server: CpuServer) -> dict:
    """idle_session_resume sized for the tiny DeepSeek-V4.1 (DSV41_IDLE)."""
    return idle_session_resume(server, **DSV41_IDLE)


def dsv41_window_resume(server: CpuServer) -> dict:
    """window_resume sized as for the tiny DeepSeek-V4 (DSV4_WINDOW), then the same prompt as a
    prefix hit at F (prefix_hit): beside the engine's decoder SWA bounded replay, cone's resume is
    shown against what the engine computes for a hit at F, a cold re-prefill beside it."""
    return window_resume(server, **DSV4_WINDOW, hit_at=DSV4_WINDOW_F)


def dsv4_idle_session_resume(server: CpuServer) -> dict:
    """idle_session_resume sized for the tiny DeepSeek-V4 (DSV4_IDLE): no sub-agents; the new
    prompt's own passed chunk checkpoints are what thin evicts first."""
    return idle_session_resume(server, **DSV4_IDLE)


def decode_beside_chunked_prefill(server: CpuServer, prompt_tokens: int = DSV4_YIELD_PROMPT,
                                  stream_tokens: int = DSV4_YIELD_STREAM, started: int = 4,
                                  stream_cap: int = 1024,
                                  timeout: float = 600) -> dict:
    """One greedy stream (32-token prompt, logprobs) decodes while a `prompt_tokens` prompt (longer
    than one chunk) prefills in chunks with max_new_tokens 1, sent once the stream has `started`
    tokens. Every decode batch holds the stream alone (the long prompt finishes at its prefill), so
    both records are comparable across servers at T=0.

    The stream asks for `stream_cap` tokens, far more than the prompt's passes take however loaded
    the machine (the stream and the prompt's chunks share it), and the client closes it once the
    prompt has finished and the stream has `stream_tokens`; its record is its first
    `stream_tokens` tokens, the same on every boot wherever the close came. (A 48-token stream
    could end before a prompt that a loaded client sent late: issue 40.) Returns {"stream": Record,
    "prompt": Record}; raises if the stream fails or reaches its cap before the prompt finished."""
    stream_prompt = token_ids(60, 32)
    last: dict = {}
    seen: list = []
    errors: list = []
    prompt_done = threading.Event()

    def run() -> None:
        payload = {"input_ids": stream_prompt, "return_logprob": True,
                   "sampling_params": {"temperature": 0.0, "max_new_tokens": stream_cap,
                                       "ignore_eos": True}}
        try:
            for event in stream_events(server.url, payload, timeout=timeout):
                last["event"] = event
                seen.append(int(event["meta_info"]["completion_tokens"]))
                if prompt_done.is_set() and seen[-1] >= stream_tokens:
                    break           # closing the stream aborts it on the server
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(f"{type(exc).__name__}: {exc}")

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout
    while not seen or seen[-1] < started:
        if errors or not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError(f"decode stream did not start: {errors or 'no tokens'}")
        time.sleep(0.02)
    long_prompt = token_ids(70, prompt_tokens)
    try:
        prompt = _record("chunked-beside-stream", long_prompt,
                         server.generate(long_prompt, max_new_tokens=1, timeout=timeout))
    finally:
        prompt_done.set()
    running_after = seen[-1] < stream_cap
    thread.join(timeout=timeout)
    if errors or "event" not in last:
        raise RuntimeError(f"decode stream failed: {errors}")
    if not running_after:
        raise RuntimeError(f"the stream reached its {stream_cap} tokens before the chunked prompt finished")
    event = last["event"]
    entries = event["meta_info"]["output_token_logprobs"]
    if len(entries) < stream_tokens:
        raise RuntimeError(f"the stream's last event holds {len(entries)} of {stream_tokens} tokens")
    first = {**event, "meta_info": {**event["meta_info"], "output_token_logprobs": entries[:stream_tokens]}}
    return {"stream": _record("stream-beside-chunked", stream_prompt, first), "prompt": prompt}


# --- decode yield: stream cadence during a chunked prefill --------------------------------------

def stream_events(url: str, payload: dict, timeout: float = 600):
    """POST a streaming /generate (payload gets "stream": True) and yield each event's JSON until
    [DONE]; an event carrying "error" raises RuntimeError."""
    with requests.post(url + "/generate", json={**payload, "stream": True}, stream=True,
                       timeout=timeout) as resp:
        resp.raise_for_status()
        for raw in resp.iter_lines():
            if not raw.startswith(b"data:"):
                continue
            body = raw[5:].strip()
            if body == b"[DONE]":
                return
            event = json.loads(body)
            if "error" in event:
                raise RuntimeError(f"stream error: {event['error']}")
            yield event


def _stream(url: str, prompt: list, max_new_tokens: int, stamps: list, stop: threading.Event,
            errors: list) -> None:
    """Stream one greedy request; append a client timestamp per received token."""
    payload = {"input_ids": prompt,
               "sampling_params": {"temperature": 0.0, "max_new_tokens": max_new_tokens,
                                   "ignore_eos": True}}
    seen = 0
    try:
        for event in stream_events(url, payload):
            done = int(event["meta_info"]["completion_tokens"])
            now = time.monotonic()
            stamps.extend([now] * (done - seen))
            seen = done
            if stop.is_set():
                break
    except Exception as exc:  # noqa: BLE001 - reported by the caller
        errors.append(f"{type(exc).__name__}: {exc}")


STREAM_TOKENS = 6000      # enough to outlast the prefill; the KV pool holds 2 x 6K + the prompt


def yield_cadence(server: CpuServer, prefill_tokens: int, streams: int = 2,
                  warmup_s: float = 1.5) -> dict:
    """Rate of `streams` running decode streams while a `prefill_tokens` prompt prefills in
    chunks, over their rate in the `warmup_s` before it. Returns the figures and the long
    prompt's completion."""
    stop = threading.Event()
    stamps = [[] for _ in range(streams)]
    errors: list = []
    threads = [threading.Thread(target=_stream, daemon=True,
                                args=(server.url, token_ids(60 + i, 32), STREAM_TOKENS, stamps[i],
                                      stop, errors))
               for i in range(streams)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 60
    while sum(len(s) for s in stamps) < 20 * streams:
        if errors or time.monotonic() > deadline:
            stop.set()
            raise RuntimeError(f"decode streams did not start: {errors or 'no tokens in 60s'}")
        time.sleep(0.05)
    before_start = time.monotonic()
    time.sleep(warmup_s)
    long_prompt = token_ids(70, prefill_tokens)
    began = time.monotonic()
    response = server.generate(long_prompt, max_new_tokens=1)
    ended = time.monotonic()
    stop.set()
    for t in threads:
        t.join(timeout=60)
    if errors:
        raise RuntimeError(f"decode stream failed during the prefill: {errors}")
    if any(len(s) >= STREAM_TOKENS for s in stamps):
        raise RuntimeError("a decode stream finished before the prefill did: raise STREAM_TOKENS")

    def rate(lo, hi):
        return sum(lo <= x < hi for s in stamps for x in s) / max(hi - lo, 1e-9)

    before = rate(before_start, began)
    during = rate(began, ended)
    return {"prefill_tokens": prefill_tokens, "prefill_s": round(ended - began, 3),
            "rate_before_tok_s": round(before, 2), "rate_during_tok_s": round(during, 2),
            "cadence": round(during / before, 4) if before else None,
            "long_prompt_completed": len(output_of(response)[0]) == 1}


# --- decode yield calibration: forwards the engine's log can time cleanly -----------------------

CALIBRATION_PROMPTS = (24576, 22528)          # lone chunked prompts: chunk cost over prefix/length
CALIBRATION_DECODE = ((1, 32), (2, 32), (4, 32), (2, 6144))   # (rows, prompt tokens) decode runs
CALIBRATION_DECODE_TOKENS = 240               # per row: 6 decode log lines at the default interval 40
# The tiny DeepSeek-V4 (8K context, 8192-token pool, 1024-token chunks: traffic.DSV4_CHUNK): lone
# prompts of 6 and 5 chunks, the long-context decode rows at 1536 tokens.
DSV4_CALIBRATION_PROMPTS = (6144, 5120)
DSV4_CALIBRATION_DECODE = ((1, 32), (2, 32), (4, 32), (2, 1536))


def calibration_run(server: CpuServer, seed: int = 900, prompts=CALIBRATION_PROMPTS,
                    decode=CALIBRATION_DECODE) -> dict:
    """Traffic whose scheduler log lines `dsv41 calibrate yield` can fit: each long prompt alone
    (its chunks follow each other with no decode forward in between), then decode runs of 1, 2
    and 4 rows and 2 long-context rows, each alone. The radix cache is flushed before each part
    so that the decode lines' #token is the rows' own context. Returns what was sent."""
    sent = {"prompts": [], "decode": []}
    for i, n in enumerate(prompts):
        server.flush_cache(wait_s=60)
        server.generate(token_ids(seed + i, n), max_new_tokens=1)
        sent["prompts"].append(n)
    for j, (rows, prompt_tokens) in enumerate(decode):
        server.flush_cache(wait_s=60)
        prompts = [token_ids(seed + 100 + 10 * j + r, prompt_tokens) for r in range(rows)]
        with cf.ThreadPoolExecutor(rows) as pool:
            list(pool.map(lambda p: server.generate(p, max_new_tokens=CALIBRATION_DECODE_TOKENS),
                          prompts))
        sent["decode"].append({"rows": rows, "prompt_tokens": prompt_tokens,
                               "new_tokens": CALIBRATION_DECODE_TOKENS})
    return sent


def dsv4_calibration_run(server: CpuServer) -> dict:
    """calibration_run sized for the tiny DeepSeek-V4 (DSV4_CALIBRATION_PROMPTS / _DECODE)."""
    return calibration_run(server, prompts=DSV4_CALIBRATION_PROMPTS, decode=DSV4_CALIBRATION_DECODE)
