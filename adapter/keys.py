"""The one registry of every DSV41_* key this package reads.

Each key says its type, its range, its default, the adapter that reads it and whether it is
*volatile*: a switch that changes neither tuned shapes nor kernels, so autotune_keep leaves it
out of the launch fingerprint. Parsing is strict: a bad value is a boot error, never a default.
"""
from __future__ import annotations

import dataclasses
import os
from typing import Mapping, Optional

PREFIX = "DSV41_"


class ConfigError(Exception):
    """A DSV41_* key has a value we refuse to guess about."""


@dataclasses.dataclass(frozen=True)
class Key:
    name: str
    kind: str                 # "flag" (0/1), "int", or "ints" (comma-separated, one per field)
    adapter: str
    doc: str
    default: Optional[int] = None   # value when the key is unset (flags: 0 = off)
    lo: Optional[int] = None
    hi: Optional[int] = None
    multiple_of: Optional[int] = None
    volatile: bool = True
    enables: bool = False     # setting this key (to non-zero) turns its adapter on
    test_only: bool = False   # on no profile line but a test line (`dsv41 check` refuses it)
    fields: tuple = ()        # "ints": ((name, lo, hi), ...) in value order
    min_fields: Optional[int] = None   # "ints": fewer values accepted, the rest 0 (default: all)


KEYS: tuple[Key, ...] = (
    Key("DSV41_SWA_NATIVE_DECODE", "flag", "swan", enables=True, default=0,
        doc="decode reads 256-token SWA pages in place (no split to 64-token pages)"),
    Key("DSV41_SWAN_SELFCHECK", "int", "swan", default=1, lo=0, hi=2,
        doc="swan's self-check at first use: each new decode key runs in place and stock once, "
            "bit-compared, verdict agreed by every TP rank; 1 = a differing key keeps the stock "
            "split, 2 = swan as a whole falls back, 0 = off"),
    Key("DSV41_SWAN_SELFCHECK_TEST_PLANT", "int", "swan", lo=0, hi=1023, test_only=True,
        doc="test-only negative control of swan's self-check: the in-place read on this "
            "attention-TP rank has a planted one-byte error; in no profile"),
    Key("DSV41_DECODE_YIELD", "int", "decode_yield", enables=True, lo=1, hi=99,
        doc="decode share (percent) of a chunked prefill's modelled time; unset = stock"),
    Key("DSV41_DECODE_YIELD_MODEL", "ints", "decode_yield", fields=(
            ("CHUNK_FIXED_US", 0, 60_000_000), ("CHUNK_TOKEN_NS", 0, 1_000_000_000),
            ("CHUNK_PAIR_PS", 0, 1_000_000_000), ("STEP_FIXED_US", 1, 60_000_000),
            ("STEP_ROW_US", 0, 60_000_000), ("STEP_CTX_PS", 0, 1_000_000_000),
            ("CHUNK_PREFIX_SQ_PS", 0, 1_000_000_000)), min_fields=6,
        doc="decode yield's cost model fitted by `dsv41 calibrate yield` (six integers, or seven "
            "with the squared-prefix term); unset = the cluster constants"),
    Key("DSV41_DECODE_YIELD_ONLINE", "flag", "decode_yield", default=0,
        doc="decode yield's cost model scaled online: chunk and decode step time scales read from "
            "the engine's own step timings and agreed over the attention-TP group (MAX) at each "
            "planned chunk, so the share holds on the machine it runs on; 0 = the model as given"),
    Key("DSV41_SWA_THIN", "flag", "swa_thin", enables=True, default=0,
        doc="moved-past SWA checkpoints go to the evict-first end of the SWA LRU"),
    Key("DSV41_SWA_CONE_REPLAY", "flag", "swa_cone", enables=True, default=0,
        doc="resume a session whose SWA window was evicted by replaying one chunk"),
    Key("DSV41_SWA_CONE_TOKENS", "int", "swa_cone", default=8192, lo=256, hi=65536,
        multiple_of=256, doc="replay length N in tokens (page aligned)"),
    Key("DSV41_SWA_CONE_TEST", "flag", "swa_cone", default=0, test_only=True,
        doc="test-only switch of cone replay; in no profile"),
    Key("DSV41_SWA_CONE_TEST_NO_FLOOR", "flag", "swa_cone", default=0, test_only=True,
        doc="test-only negative control of cone replay: no window floor at the replay start, so "
            "replay rows read evicted window slots (the padding slot); in no profile"),
    Key("DSV41_SWA_CONE_TEST_NO_COPY", "flag", "swa_cone", default=0, test_only=True,
        doc="test-only negative control of cone replay: no copy of the resident latents / index "
            "keys, so the replay rows' pages keep stale ones; in no profile"),
    Key("DSV41_SWA_CONE_TEST_NO_MASK", "flag", "swa_cone", default=0, test_only=True,
        doc="test-only negative control of cone replay: no write mask, so the replay rows write "
            "their own latents / index keys over the copied ones; in no profile"),
    Key("DSV41_AUTOTUNE_KEEP", "flag", "autotune_keep", enables=True, default=0,
        doc="ranks agree on the autotune cache; a launch sidecar drops stale caches"),
    Key("DSV41_INPUT_GUARD", "flag", "input_guard", enables=True, default=0,
        doc="a request whose fields the scheduler, the sampling batch or the model cannot hold "
            "(ids outside the vocabulary, values outside their tensor's range, sessions, "
            "unbounded costs) gets HTTP 400 in the tokenizer manager instead of reaching the "
            "scheduler; stop_regex runs on RE2, grammar steps are time-bounded, aborts match "
            "rids exactly"),
    Key("DSV41_INPUT_GUARD_MAX_N", "int", "input_guard", default=128, lo=1, hi=1_000_000,
        doc="input_guard: the most samples one request may ask for, all its prompts together "
            "(prompts x sampling_params.n); more gets HTTP 400 naming this key (OpenAI's own API "
            "caps n at 128)"),
    Key("DSV41_INPUT_GUARD_MAX_LOGPROB_ENTRIES", "int", "input_guard", default=1_000_000, lo=1,
        hi=10**12, doc="input_guard: the most prompt log-prob entries one request may ask for "
                       "((top_logprobs_num + len(token_ids_logprob)) x prompt positions from "
                       "logprob_start_len, summed over its prompts and samples); more gets HTTP "
                       "400 naming this key"),
    Key("DSV41_INPUT_GUARD_MAX_STOP_CHARS", "int", "input_guard", default=4096, lo=1, hi=10**9,
        doc="input_guard: the most characters a request's stop strings may have in total; more "
            "gets HTTP 400 naming this key"),
    Key("DSV41_INPUT_GUARD_GRAMMAR_STEP_MS", "int", "input_guard", default=100, lo=1, hi=600_000,
        doc="input_guard: a constrained-decoding request whose grammar takes longer than this in "
            "one decode step (xgrammar mask or accept) is finished with that reason; the batch "
            "goes on"),
    Key("DSV41_INPUT_GUARD_MAX_TEXT_CHARS", "int", "input_guard", default=0, lo=0,
        hi=10**10, doc="input_guard: the most prompt text characters one request may send (all its "
                       "prompts), and the text of a chat-like route's body (every string, one "
                       "per list item) before its handler renders, tokenizes or decodes it; the "
                       "engine does that work on the HTTP server, so more gets HTTP 400 naming "
                       "this key before any of it (send input_ids). 0 (the default): 8 "
                       "characters per token of the line's context length (8,388,608 at "
                       "--context-length 1048576): a text longer than that does not fit the "
                       "context"),
    Key("DSV41_INPUT_GUARD_MAX_PARSE_CHARS", "int", "input_guard", default=32_768, lo=1,
        hi=10**9, doc="input_guard: the most text characters /parse_function_call and "
                      "/separate_reasoning parse on the HTTP event loop; more gets HTTP 400 "
                      "naming this key before the parser runs"),
    Key("DSV41_INPUT_GUARD_GRAMMAR_CACHE", "int", "input_guard", default=128, lo=1, hi=10**6,
        doc="input_guard: the most compiled grammars the scheduler's grammar cache keeps (the "
            "oldest go first); xgrammar's own compiler cache is bounded by "
            "DSV41_INPUT_GUARD_GRAMMAR_CACHE_MB; a grammar compilation that timed out is never "
            "cached as the grammar's verdict"),
    Key("DSV41_INPUT_GUARD_GRAMMAR_CACHE_MB", "int", "input_guard", default=256, lo=1, hi=10**6,
        doc="input_guard: the most memory xgrammar's compiler cache keeps, in MB (the engine "
            "builds it unbounded)"),
    Key("DSV41_INPUT_GUARD_GRAMMAR_COMPILES_PER_CLIENT", "int", "input_guard", default=0, lo=0,
        hi=10**4,
        doc="input_guard: the most requests with a grammar (json_schema, regex, ebnf, "
            "structural_tag) one client may have unanswered at once (streamed: until its first "
            "chunk); one more gets HTTP 429 naming this key and the count; 0 = half the engine's "
            "grammar compile pool (min(32, CPUs + 4) workers), so one client never holds all of "
            "it. The client: DSV41_INPUT_GUARD_CLIENT_HEADER"),
    Key("DSV41_INPUT_GUARD_CLIENT_HEADER", "flag", "input_guard", default=0,
        doc="input_guard: 1 = a request's client (for DSV41_INPUT_GUARD_GRAMMAR_COMPILES_PER_CLIENT) "
            "is its X-DSV41-Client header when it has one, which the gateway in front must set "
            "and overwrite; 0 = the peer's host (behind a gateway: one client, the whole line)"),
    Key("DSV41_ADMIN_GUARD", "flag", "admin_guard", enables=True, default=0,
        doc="the engine's admin routes (ADMIN_OPTIONAL) answer HTTP 403 naming --admin-api-key "
            "unless that key is configured"),
    Key("DSV41_ADMIN_GUARD_TEST", "flag", "admin_guard", default=0, test_only=True,
        doc="test-only: admin_guard leaves /flush_cache open (a hole in the guard, for its unit "
            "tests; the CPU harness flushes with the engine's --admin-api-key); on no line but a "
            "test line"),
)

KEY_BY_NAME = {k.name: k for k in KEYS}

# Per-boot identifiers outside our prefix that change neither shapes nor kernels.
EXTRA_VOLATILE = ("SGLANG_RUN_ID", "SGLANG_HOST_IP", "SGLANG_PORT", "NCCL_DEBUG", "NCCL_DEBUG_FILE")

_TRUE = {"1", "true", "on", "yes"}
_FALSE = {"0", "false", "off", "no"}


def test_only_keys(environ: Mapping[str, str]) -> list[Key]:
    """The test-only keys (Key.test_only) set in `environ`, in registry order: no profile line but
    a test line may carry one (adapter/tools/profile.py refuse_test_only)."""
    return [k for k in KEYS if k.test_only and k.name in environ]


def volatile_keys() -> tuple[str, ...]:
    return tuple(k.name for k in KEYS if k.volatile) + EXTRA_VOLATILE


def edit_distance(a: str, b: str) -> int:
    prev = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        cur = [i]
        for j, cb in enumerate(b, 1):
            cur.append(min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (ca != cb)))
        prev = cur
    return prev[-1]


def _parse_ints(key: Key, raw: str) -> tuple[int, ...]:
    names = ",".join(name for name, _, _ in key.fields)
    parts = [p.strip() for p in raw.split(",")]
    least = key.min_fields or len(key.fields)
    if not least <= len(parts) <= len(key.fields):
        count = str(least) if least == len(key.fields) else f"{least} or {len(key.fields)}"
        raise ConfigError(f"{key.name}={raw!r}: expected {count} comma-separated integers "
                          f"{names} ({key.doc})")
    values = []
    for text, (name, lo, hi) in zip(parts, key.fields):
        try:
            value = int(text, 10)
        except ValueError:
            raise ConfigError(f"{key.name}={raw!r}: {name}={text!r} is not an integer (expected "
                              f"{names})") from None
        if not lo <= value <= hi:
            raise ConfigError(f"{key.name}={raw!r}: {name}={value} out of range {lo}..{hi}")
        values.append(value)
    return tuple(values) + (0,) * (len(key.fields) - len(values))


def _parse(key: Key, raw: str):
    if key.kind == "ints":
        return _parse_ints(key, raw)
    text = raw.strip().lower()
    if key.kind == "flag":
        if text in _TRUE:
            return 1
        if text in _FALSE:
            return 0
        raise ConfigError(f"{key.name}={raw!r}: expected 0 or 1 ({key.doc})")
    try:
        value = int(text, 10)
    except ValueError:
        raise ConfigError(f"{key.name}={raw!r}: expected an integer in {key.lo}..{key.hi} "
                          f"({key.doc})") from None
    if (key.lo is not None and value < key.lo) or (key.hi is not None and value > key.hi):
        raise ConfigError(f"{key.name}={value}: out of range {key.lo}..{key.hi} ({key.doc})")
    if key.multiple_of and value % key.multiple_of:
        raise ConfigError(f"{key.name}={value}: must be a multiple of {key.multiple_of} ({key.doc})")
    return value


@dataclasses.dataclass(frozen=True)
class Settings:
    values: Mapping[str, Optional[int]]     # every registered key -> parsed value (or default)
    set_keys: tuple[str, ...]               # registered keys present in the environment
    unknown: tuple[str, ...]                # unregistered DSV41_* keys (warned about)

    def get(self, name: str) -> Optional[int]:
        return self.values[name]

    def enabled(self, adapter: str) -> bool:
        return any(self.values[k.name] for k in KEYS if k.adapter == adapter and k.enables)

    def keys_of(self, adapter: str) -> dict[str, Optional[int]]:
        return {k.name: self.values[k.name] for k in KEYS if k.adapter == adapter}


def parse_env(environ: Optional[Mapping[str, str]] = None) -> Settings:
    """Parse every DSV41_* key; raise ConfigError on a bad value or a likely typo."""
    env = os.environ if environ is None else environ
    values: dict[str, Optional[int]] = {}
    set_keys, unknown, errors = [], [], []
    for key in KEYS:
        raw = env.get(key.name)
        if raw is None:
            values[key.name] = key.default
            continue
        set_keys.append(key.name)
        try:
            values[key.name] = _parse(key, raw)
        except ConfigError as exc:
            errors.append(str(exc))
    for name in sorted(n for n in env if n.startswith(PREFIX) and n not in KEY_BY_NAME):
        near = min(KEY_BY_NAME, key=lambda k: edit_distance(name, k))
        if edit_distance(name, near) <= 2:
            errors.append(f"{name}: unknown key; did you mean {near}? ({KEY_BY_NAME[near].doc})")
        else:
            unknown.append(name)
    if errors:
        raise ConfigError("; ".join(errors))
    return Settings(values, tuple(set_keys), tuple(unknown))
