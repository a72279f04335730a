"""An ambiguous regex grammar (adapter/tools/traffic.py AMBIGUOUS_REGEX) beside a plain stream,
for the single-rank faults boot (tests/e2e/test_e2e_faults.py) and the two-node TP boot
(tests/e2e/test_e2e_tp2.py)."""
from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import time

import requests

from adapter.tools import traffic

GRAMMAR_TOKENS = 400
STREAM_TOKENS = 64
# What the client of a request the step bound finished reads (issue 50: a 400 naming the bound;
# its fallback line in the scheduler's log still says "took N ms").
BOUND_MESSAGE = "dsv41 input_guard: this request's grammar exceeded the per-step bound of "


@dataclasses.dataclass
class Beside:
    stream_status: int
    stream_tokens: int
    stream_s: float
    grammar_status: int
    grammar_reason: str          # the finish reason's text (or the error body)

    @property
    def stream_ok(self) -> bool:
        return self.stream_status == 200 and self.stream_tokens == STREAM_TOKENS

    @property
    def finished_by_bound(self) -> bool:
        return BOUND_MESSAGE in self.grammar_reason

    def outcome(self) -> str:
        return (f"stream: {self.stream_status}, {self.stream_tokens} of {STREAM_TOKENS} tokens in "
                f"{self.stream_s:.1f} s; grammar: {self.grammar_status} {self.grammar_reason[:160]}")


def grammar_beside_stream(server) -> Beside:
    """The grammar request first, a plain greedy stream a moment later; both awaited."""
    with cf.ThreadPoolExecutor(2) as pool:
        grammar = pool.submit(requests.post, server.url + "/generate", json={
            "input_ids": traffic.token_ids(44, 16),
            "sampling_params": traffic.ambiguous_grammar_sampling(GRAMMAR_TOKENS)}, timeout=900)
        time.sleep(2.0)
        began = time.monotonic()
        stream = pool.submit(requests.post, server.url + "/generate", json={
            "input_ids": traffic.token_ids(43, 32), "sampling_params": {
                "temperature": 0.0, "max_new_tokens": STREAM_TOKENS, "ignore_eos": True}},
            timeout=900)
        s = stream.result(timeout=900)
        took = time.monotonic() - began
        g = grammar.result(timeout=900)
    got = len(s.json().get("output_ids", [])) if s.ok else 0
    reason = g.json().get("meta_info", {}).get("finish_reason") if g.ok else g.text
    return Beside(s.status_code, got, took, g.status_code, str(reason))
