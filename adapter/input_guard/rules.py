"""input_guard's rules: what a request the engine would die on, hang on or spend on for everyone
looks like, as pure checks on normalized values, and the bounds with their defaults.

No engine import here (an import-linter contract in pyproject.toml keeps it so): the checks take
the tokenized request (any object with the engine's field names), plain values and the bounds,
and return a message naming the field, the value and what the engine accepts, or None. Where the
engine calls them, and what the engine's types are at install, is adapter/input_guard/hooks.py.
The measurements behind each row: docs/input_guard.md.
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import typing
from array import array

import numpy as np

NAME = "input_guard"
KEY = "DSV41_INPUT_GUARD"


@dataclasses.dataclass(frozen=True)
class Field:
    """A field of the tokenized request where a bad value kills the stock scheduler."""
    struct: str         # "request": TokenizedGenerateReqInput; "sampling_params": SamplingParams
    name: str
    low: int | None     # smallest valid value (each element, for a set of ids); None: no bound
    high: str | None    # "vocab": below vocab_size (an id); "vocab_size": at most vocab_size
    dies: str           # what stock does with a bad value (measured, docs/input_guard.md)


# The rows of docs/input_guard.md's table where stock died, measured by
# bench/input_guard_fields.py on the real CPU server; their types are the engine's (read at install).
FIELDS = (
    Field("request", "logprob_start_len", -1, None,
          "a list: TypeError comparing it with the prompt length (scheduler.py); below -1: "
          "AssertionError in the logprob processor"),
    Field("request", "top_logprobs_num", None, "vocab_size",
          "a list: TypeError in the logits processor's `x > 0`; above the vocabulary: "
          "`topk` selected index k out of range (the batch takes every request's k)"),
    Field("request", "lora_id", None, None,
          "a list: TypeError concatenating it into the scheduler's LoRA key (str + list)"),
    Field("request", "positional_embed_overrides", None, None,
          "anything JSON can carry (a string, a list, a number): AttributeError `.reconstruct` in "
          "the scheduler (the engine's own API passes a PositionalEmbeds object)"),
    Field("sampling_params", "stop_token_ids", 0, "vocab",
          "an id outside the vocabulary: the min-new-tokens penalizer's scatter into a "
          "vocabulary-sized row (every request of the batch)"),
)
INT32_MAX = 2**31 - 1
FLOAT32_MAX = float(np.finfo(np.float32).max)


@dataclasses.dataclass(frozen=True)
class Number:
    """A SamplingParams number the scheduler stores in a tensor: its type and the range that tensor
    (and the sampler reading it) holds. int: an int (bool is an int to the engine); float: an int
    or float, finite in float32 (the sampling batch's dtype)."""
    name: str
    kind: str                   # "int" | "float"
    low: float | None
    high: float | None
    low_open: bool = False      # low itself not valid (after rounding to float32)
    optional: bool = False
    tensor: str = ""


# What the sampling batch (sampling/sampling_batch_info.py) and the penalizers build from each
# request's SamplingParams, one tensor row per request: a value outside its dtype's range or not
# finite poisons every request of the batch (the int32 top_ks overflow; a NaN into the sampler).
SAMPLING_NUMBERS = (
    Number("max_new_tokens", "int", 0, INT32_MAX, optional=True, tensor="the scheduler's budgets (int32)"),
    Number("min_new_tokens", "int", 0, INT32_MAX, tensor="the min-new-tokens penalizer (int32)"),
    Number("top_k", "int", 1, INT32_MAX, tensor="top_ks (torch.int32)"),
    Number("n", "int", 1, None, tensor="parallel samples"),
    Number("beam_width", "int", 1, INT32_MAX, optional=True, tensor="beam search width"),
    Number("temperature", "float", 0.0, FLOAT32_MAX, tensor="temperatures (torch.float32)"),
    Number("top_p", "float", 0.0, 1.0, low_open=True, tensor="top_ps (torch.float32)"),
    Number("min_p", "float", 0.0, 1.0, tensor="min_ps (torch.float32)"),
    Number("frequency_penalty", "float", -2.0, 2.0, tensor="the frequency penalizer (float32)"),
    Number("presence_penalty", "float", -2.0, 2.0, tensor="the presence penalizer (float32)"),
    Number("repetition_penalty", "float", 0.0, 2.0, low_open=True,
           tensor="the repetition penalizer (float32, divides by it)"),
)
# Index fields: positions into the prompt (the logits / hidden rows of this request's prefill).
PROMPT_INDEX_FIELDS = ("token_indices_to_pool", "multi_item_delimiter_indices")
GRAMMAR_FIELDS = ("json_schema", "regex", "ebnf", "structural_tag")
SESSIONS_OFF = ("sessions are off on this line (dsv41 input_guard): the engine's sessions let any "
                "client that knows a session id use or close it, so {what} is refused; send the "
                "whole conversation in the request instead (the radix cache reuses its prefix)")
LIMIT_KEYS = {"n": "DSV41_INPUT_GUARD_MAX_N",
              "logprob_entries": "DSV41_INPUT_GUARD_MAX_LOGPROB_ENTRIES",
              "stop": "DSV41_INPUT_GUARD_MAX_STOP_CHARS",
              "grammar_step_ms": "DSV41_INPUT_GUARD_GRAMMAR_STEP_MS",
              "text_chars": "DSV41_INPUT_GUARD_MAX_TEXT_CHARS",
              "parse_chars": "DSV41_INPUT_GUARD_MAX_PARSE_CHARS",
              "grammar_cache": "DSV41_INPUT_GUARD_GRAMMAR_CACHE",
              "grammar_cache_mb": "DSV41_INPUT_GUARD_GRAMMAR_CACHE_MB",
              "grammar_compiles": "DSV41_INPUT_GUARD_GRAMMAR_COMPILES_PER_CLIENT",
              "client_header": "DSV41_INPUT_GUARD_CLIENT_HEADER"}


# DSV41_INPUT_GUARD_MAX_TEXT_CHARS 0 (the default) is this many characters per token of the line's
# context length: a text longer than that does not fit the context (a token of a byte-level BPE
# averages 3-4 characters of prose or code; 8 leaves room for runs a token covers more of), so
# the bound refuses no request the line could serve, and its tokenizing on the HTTP event loop
# is bounded by what the line serves anyway.
TEXT_CHARS_PER_TOKEN = 8
# The text bound before the line's context length is known (no tokenizer manager built yet: the
# rules' own tests), or when it cannot be read (a fallback line says so).
TEXT_CHARS_UNKNOWN_CONTEXT = 1_000_000


@dataclasses.dataclass(frozen=True)
class Limits:
    """Per-request cost bounds an operator sets (adapter/keys.py); defaults no ordinary client hits."""
    n: int = 128
    logprob_entries: int = 1_000_000
    stop_chars: int = 4096
    grammar_step_ms: int = 100
    text_chars: int = 0             # 0: TEXT_CHARS_PER_TOKEN x the line's context length (with_context)
    parse_chars: int = 32_768
    grammar_cache: int = 128
    grammar_cache_mb: int = 256
    grammar_compiles: int = 0       # 0: half the engine's compile pool (grammar_share)
    client_header: int = 0          # 1: the client is CLIENT_HEADER's value when a request has one

    @property
    def text_limit(self) -> int:
        """The text bound the checks apply: the line's, or TEXT_CHARS_UNKNOWN_CONTEXT while 0 is
        not yet resolved against a context length."""
        return self.text_chars if self.text_chars > 0 else TEXT_CHARS_UNKNOWN_CONTEXT

    def with_context(self, context_len) -> "Limits":
        """text_chars 0 resolved to TEXT_CHARS_PER_TOKEN x context_len (an operator's value kept;
        an unreadable context length leaves it to text_limit's)."""
        if self.text_chars > 0 or not _is_int(context_len) or context_len <= 0:
            return self
        return dataclasses.replace(self, text_chars=TEXT_CHARS_PER_TOKEN * context_len)

    @classmethod
    def from_ctx(cls, ctx) -> "Limits":
        value = getattr(ctx, "value", None)
        if value is None:
            return cls()
        return cls(n=value(LIMIT_KEYS["n"]), logprob_entries=value(LIMIT_KEYS["logprob_entries"]),
                   stop_chars=value(LIMIT_KEYS["stop"]),
                   grammar_step_ms=value(LIMIT_KEYS["grammar_step_ms"]),
                   text_chars=value(LIMIT_KEYS["text_chars"]),
                   parse_chars=value(LIMIT_KEYS["parse_chars"]),
                   grammar_cache=value(LIMIT_KEYS["grammar_cache"]),
                   grammar_cache_mb=value(LIMIT_KEYS["grammar_cache_mb"]),
                   grammar_compiles=value(LIMIT_KEYS["grammar_compiles"]),
                   client_header=value(LIMIT_KEYS["client_header"]))


REASONS = ("input_ids", *(f.name for f in FIELDS), *(n.name for n in SAMPLING_NUMBERS),
           "logit_bias", "stop", "stop_regex", "grammar", "sessions", "rid",
           *PROMPT_INDEX_FIELDS, "logprob_entries", "sampling_seed", "options", "vertex",
           "engine_value_error", "text_chars", "parse_chars", "sampling_params",
           "grammar_compiles", "unchecked")

# Counter keys in receipts.counters["input_guard"] (series: adapter/metrics.py KEYS).
COUNTERS = {
    "checked": "requests checked",
    "rejected:": "requests answered 400, by the field that would have killed the scheduler "
                 f"({', '.join(REASONS[:-1])}) or `unchecked` (the guard could not check it)",
}

MULTIMODAL = ("multimodal request: its ids carry the processor's placeholder tokens; prompt ids "
              "not checked, request passed unchanged")
EMBEDS = ("input_embeds request: the model reads the given embeddings and the scheduler makes up "
          "the ids; prompt ids not checked, request passed unchanged")



class Unchecked(Exception):
    """The guard could not check a value (a shape it does not know): the request is refused."""


def int64_view(ids):
    """The ids as a 1-D numpy integer array without copying where the engine's int64 array allows;
    None when they are not a flat integer sequence."""
    if isinstance(ids, array):
        if ids.typecode == "q":
            return np.frombuffer(ids, np.int64) if len(ids) else np.zeros(0, np.int64)
        ids = ids.tolist()
    try:
        a = ids if isinstance(ids, np.ndarray) else np.asarray(ids)
    except (ValueError, TypeError, OverflowError):      # ragged, mixed
        return None
    if a.ndim != 1 or (a.size and a.dtype.kind not in "iu"):
        return None
    return a


def first_out_of_range(a, vocab: int):
    """(position, id, count) of the first id outside [0, vocab), or None. One pass: as unsigned
    64-bit a negative id is above any vocabulary."""
    if a.size == 0:
        return None
    u = np.asarray(a, np.int64).view(np.uint64)     # no copy when already int64
    if u[u.argmax()] < vocab:           # argmax: a third of max()'s fixed cost on short prompts
        return None
    bad = u >= vocab
    pos = int(bad.argmax())
    return pos, int(a[pos]), int(np.count_nonzero(bad))


def kind_of(declared) -> tuple[str, bool]:
    """("int" | "str" | "ids" | an engine class, optional) for a field type the engine declares;
    Unchecked otherwise."""
    args = [a for a in typing.get_args(declared) if a is not type(None)]
    optional = type(None) in typing.get_args(declared)
    if typing.get_origin(declared) is typing.Union and len(args) == 1:
        declared = args[0]
    if declared is int:
        return "int", optional
    if declared is str:
        return "str", optional
    if typing.get_origin(declared) in (list, set, frozenset) and typing.get_args(declared) == (int,):
        return "ids", optional
    if isinstance(declared, type) and typing.get_origin(declared) is None:
        return declared, optional       # an engine class: the value must be one of its instances
    raise Unchecked(f"engine type {declared!r}")


def _is_int(v) -> bool:
    # bool is an int to every comparison and index the engine makes: stock serves it
    return isinstance(v, (int, np.integer))


def _bounds(field: Field, vocab: int) -> tuple[int | None, int | None]:
    high = {"vocab": vocab - 1, "vocab_size": vocab, None: None}[field.high]
    return field.low, high


def _range_text(low, high) -> str:
    if high is None:
        return f"an integer >= {low}"
    if low is None:
        return f"an integer <= {high}"
    return f"an integer in {low}..{high}"


def check_field(field: Field, kind: str, optional: bool, value, vocab: int):
    """A message when `value` is not what the engine expects for `field`, else None."""
    if value is None:
        return None if optional else f"{field.name} is missing: this engine expects {kind}"
    if isinstance(kind, type):
        if isinstance(value, kind):
            return None
        return (f"{field.name} = {_short(value)} is not a {kind.__name__}: this field is set by the "
                "engine's own API, not by an HTTP client")
    if kind == "str":
        if isinstance(value, str):
            return None
        shape = "a list" if isinstance(value, (list, tuple)) else type(value).__name__
        return (f"{field.name} = {_short(value)} is {shape}, not a string: this engine expects one "
                "string per request (a list is only the batch form, one value per prompt)")
    low, high = _bounds(field, vocab)
    expect = _range_text(low, high)
    if kind == "int":
        if not _is_int(value):
            shape = "a list" if isinstance(value, (list, tuple)) else type(value).__name__
            return (f"{field.name} = {_short(value)} is {shape}, not an integer: this engine expects "
                    f"{expect} per request (a list is only the batch form, one value per prompt)")
        if (low is not None and value < low) or (high is not None and value > high):
            return f"{field.name} = {value} is out of range: this engine expects {expect}" + (
                f" (vocabulary size {vocab})" if field.high else "")
        return None
    if not isinstance(value, (list, tuple, set, frozenset)):
        raise Unchecked(f"{field.name} is a {type(value).__name__}")
    for v in value:
        if not _is_int(v):
            return f"{field.name} contains {_short(v)}, not a token id: this engine expects {expect}"
    if not value:
        return None
    lo, hi = min(value), max(value)
    if lo < low or (high is not None and hi > high):
        v = lo if lo < low else hi
        return (f"{field.name} contains {v}, which is not a token id of this model: valid ids are "
                f"{low}..{high} (vocabulary size {vocab})")
    return None


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def check_ids(tokenized, vocab: int, fallback):
    """The prompt ids: a message when one is outside [0, vocab), else None."""
    if getattr(tokenized, "mm_inputs", None) is not None:
        fallback(MULTIMODAL)
        return None
    if getattr(tokenized, "input_embeds", None) is not None:
        fallback(EMBEDS)
        return None
    ids = tokenized.input_ids
    if ids is None:
        return None
    if len(ids) == 0 and hasattr(tokenized, "top_logprobs_num"):
        # a text prompt that tokenizes to nothing ("" on a tokenizer without BOS): the
        # scheduler's prefill of 0 tokens dies reshaping its logits (found by fuzzing)
        return ("the prompt has no tokens (its text tokenizes to nothing): this engine needs at "
                "least one prompt token")
    if type(ids) is array and ids.typecode == "q":      # what the engine builds
        # the common case in one numpy pass over the engine's buffer (no copy)
        if not ids:
            return None
        u = np.frombuffer(ids, np.uint64)
        if u[u.argmax()] < vocab:
            return None
        a = np.frombuffer(ids, np.int64)
    else:
        a = int64_view(ids)
        if a is None:
            raise Unchecked(f"prompt ids are not a flat integer sequence ({type(ids).__name__})")
    bad = first_out_of_range(a, vocab)
    if bad is None:
        return None
    pos, token, count = bad
    more = f" ({count} of the {a.size} prompt ids are out of range)" if count > 1 else ""
    return (f"input_ids[{pos}] = {token} is not a token id of this model: valid ids are "
            f"0..{vocab - 1} (vocabulary size {vocab}){more}")


def _is_real(v) -> bool:
    return isinstance(v, (int, float, np.integer, np.floating))


def _shape(value) -> str:
    return "a list" if isinstance(value, (list, tuple)) else (
        "an object" if isinstance(value, dict) else type(value).__name__)


def check_number(num: Number, value, limits: Limits):
    """A message when a SamplingParams number cannot be held by the tensor it ends up in."""
    name = f"sampling_params.{num.name}"
    if value is None:
        return None if num.optional else f"{name} is missing: this engine expects a number"
    high = limits.n if num.name == "n" else num.high
    if num.kind == "int":
        if not _is_int(value):
            return (f"{name} = {_short(value)} is {_shape(value)}, not an integer: the scheduler "
                    f"stores it in {num.tensor}")
        if num.name == "n" and value > limits.n:
            return (f"{name} = {value} is over this line's limit of {limits.n} parallel samples "
                    f"per request ({LIMIT_KEYS['n']})")
        if value < num.low or (high is not None and value > high):
            return (f"{name} = {value} is out of range: the scheduler stores it in {num.tensor}; "
                    f"this engine expects an integer in {num.low}..{high}")
        return None
    if not _is_real(value):
        return (f"{name} = {_short(value)} is {_shape(value)}, not a number: the sampling batch "
                f"stores it in {num.tensor}")
    v = float(value)
    bad = not np.isfinite(v) or abs(v) > FLOAT32_MAX
    if not bad:
        v32 = float(np.float32(v))
        bad = v32 < num.low or v32 > high or (num.low_open and v32 <= num.low)
    if bad:
        low = f"({num.low}" if num.low_open else f"[{num.low}"
        return (f"{name} = {_short(value)} is out of range: the sampling batch stores it in "
                f"{num.tensor}; this engine expects a finite number in {low}, {high:g}] "
                "(as float32)")
    return None


def check_logit_bias(bias, vocab: int):
    if bias is None:
        return None
    if not isinstance(bias, dict):
        return (f"sampling_params.logit_bias = {_short(bias)} is {_shape(bias)}: this engine "
                "expects an object of token id -> bias")
    for key, value in bias.items():
        try:
            token = int(key)
        except (TypeError, ValueError):
            return f"sampling_params.logit_bias has the key {_short(key)}, which is not a token id"
        if not 0 <= token < vocab:
            return (f"sampling_params.logit_bias has the key {_short(key)}, which is not a token id "
                    f"of this model: valid ids are 0..{vocab - 1}")
        if not _is_real(value) or not np.isfinite(float(value)) or abs(float(value)) > FLOAT32_MAX:
            return (f"sampling_params.logit_bias[{_short(key)}] = {_short(value)} is not a finite "
                    "float32: the sampling batch adds it to the logits in float32 (an overflow is "
                    f"inf, then NaN in the sampler); this engine expects a number in "
                    f"[-{FLOAT32_MAX:g}, {FLOAT32_MAX:g}]")
    return None


def _strings(value, name: str):
    """The strings of a str-or-list field, or a message."""
    items = [] if value is None else [value] if isinstance(value, str) else value
    if not isinstance(items, (list, tuple)) or not all(isinstance(x, str) for x in items):
        return None, f"sampling_params.{name} = {_short(value)}: this engine expects strings"
    return items, None


def check_stops(sp, limits: Limits, re2):
    """(reason, message) for stop strings over the line's limit or a stop_regex RE2 cannot run."""
    stops, message = _strings(getattr(sp, "stop_strs", None), "stop")
    if message:
        return "stop", message
    total = sum(len(x) for x in stops)
    if total > limits.stop_chars:
        return "stop", (f"sampling_params.stop has {total} characters in {len(stops)} strings, over "
                        f"this line's limit of {limits.stop_chars} ({LIMIT_KEYS['stop']}): the "
                        "scheduler matches every stop string against the output at every step")
    regexes, message = _strings(getattr(sp, "stop_regex_strs", None), "stop_regex")
    if message:
        return "stop_regex", message
    for pattern in regexes:
        if re2 is None:
            return "stop_regex", ("stop_regex is refused on this line: its linear-time regex engine "
                                  "(RE2, the google-re2 package) is not installed")
        try:
            re2_compile(pattern)
        except re2.error as exc:
            why = exc.args[0].decode() if exc.args and isinstance(exc.args[0], bytes) else str(exc)
            return "stop_regex", (f"stop_regex {_short(pattern)} uses a construct RE2 cannot run in "
                                  f"linear time ({why}); this line runs stop_regex on RE2 only")
    return None


def check_grammar_fields(sp):
    for name in GRAMMAR_FIELDS:
        value = getattr(sp, name, None)
        if value is not None and not isinstance(value, str):
            return (f"sampling_params.{name} = {_short(value)} is {_shape(value)}: this engine "
                    "expects one string")
    return None


def _prompt_len(tokenized) -> int | None:
    if getattr(tokenized, "input_embeds", None) is not None:
        return len(tokenized.input_embeds)
    ids = getattr(tokenized, "input_ids", None)
    return None if ids is None else len(ids)


def check_prompt_indices(tokenized, prompt_len):
    """(field, message) for an index field outside the prompt (its prefill's rows)."""
    for name in PROMPT_INDEX_FIELDS:
        value = getattr(tokenized, name, None)
        if value is None:
            continue
        if not isinstance(value, (list, tuple)) or not all(_is_int(i) for i in value):
            return name, (f"{name} = {_short(value)} is not a list of integers: this engine expects "
                          "positions in the prompt")
        if prompt_len is None:
            raise Unchecked(f"{name} without prompt ids")
        bad = next((i for i in value if not 0 <= i < prompt_len), None)
        if bad is not None:
            return name, (f"{name} contains {bad}, which is not a position of this request's "
                          f"prompt: valid positions are 0..{prompt_len - 1} ({prompt_len} prompt "
                          "tokens)")
    return None


POOL = "token_indices_to_pool"


def check_pooling(tokenized, prompt_len, chunk: int | None):
    """(field, message) for a `token_indices_to_pool` the engine's pooling path cannot serve.

    The path (read in the engine, each death measured on the stock CPU server, docs/input_guard.md):
    the scheduler keeps the list on the request; only a prefill-only request (max_new_tokens 0)
    reads it; the forward batch makes one tensor of it per request, and the logits processor
    (`compute_logprobs_at_positions`) adds each request's offset in the batch's *extend* rows and
    indexes the hidden states with it. So an index is a row of this prefill, not of the prompt:
    - the rows start after the prefix the radix cache served: only `return_logprob` with
      `logprob_start_len` 0 (the engine's own scoring shape, /v1/score) keeps the prefill whole
      (any other: a cached prefix makes the rows fewer, IndexError, the scheduler dies);
    - a prompt longer than the chunked-prefill size runs in chunks, each indexed with the whole
      list (AssertionError / IndexError in the first chunk);
    - an empty list: `torch.cat` of nothing when the batch holds no other pooled request;
    - order and duplicates are served (one row each, in the order given)."""
    # both of the engine's tokenized structs declare the pooling field; only the generate one the
    # log-prob fields (read below, after the embedding's return)
    value = tokenized.token_indices_to_pool
    if value is None or not hasattr(tokenized, "top_logprobs_num"):    # embedding: its own pooler
        return None
    max_new = tokenized.sampling_params.max_new_tokens
    if max_new != 0:
        return POOL, (f"{POOL} is read only on a prefill-only request (sampling_params."
                      f"max_new_tokens 0); with max_new_tokens {_short(max_new)} this engine "
                      "ignores it: send max_new_tokens 0 to pool, or leave it out to generate")
    if isinstance(value, (list, tuple)) and not value:
        return POOL, (f"{POOL} = [] has no position: this engine pools at least one position of "
                      "the prompt per request")
    if not tokenized.return_logprob or tokenized.logprob_start_len != 0:
        return POOL, (f"{POOL} indexes the rows of this request's prefill, which start after any "
                      "prefix the radix cache serves: this engine keeps the prefill whole only "
                      "with return_logprob true and logprob_start_len 0 (its own scoring shape); "
                      f"got return_logprob {_short(tokenized.return_logprob)}, "
                      f"logprob_start_len {_short(tokenized.logprob_start_len)}")
    if chunk is not None and chunk > 0 and prompt_len is not None and prompt_len > chunk:
        return POOL, (f"{POOL} on a prompt of {prompt_len} tokens: this line prefills in chunks of "
                      f"{chunk} tokens and the engine's pooling path indexes each chunk with the "
                      f"whole list; pooled prompts must be at most {chunk} tokens")
    return None


def check_logprob_cost(tokenized, prompt_len, limits: Limits):
    """A message when a generate request's prompt log-probs are over the line's bound (`check`
    calls it for the engine's TokenizedGenerateReqInput only), else None."""
    if not tokenized.return_logprob or prompt_len is None:
        return None
    k = tokenized.top_logprobs_num if _is_int(tokenized.top_logprobs_num) else 0
    t = len(tokenized.token_ids_logprob or ())
    start = tokenized.logprob_start_len
    positions = max(prompt_len - start, 0) if _is_int(start) and start >= 0 else 0
    # with n > 1 the engine sends this one tokenized prompt n times plus once to cache its
    # prefix, each computing its prompt log-probs (issue 50: the bound is the whole request's)
    n = tokenized.sampling_params.n
    samples = n + 1 if _is_int(n) and n > 1 else 1
    entries = (max(k, 0) + t) * positions * samples
    if entries > limits.logprob_entries:
        return ("asks for {:,} prompt log-prob entries ((top_logprobs_num {} + {} token_ids_logprob) "
                "x {} prompt positions from logprob_start_len {}{}), over this line's limit of {:,} "
                "({}): the tokenizer manager converts them all at once").format(
                    entries, k, t, positions, start,
                    f" x {samples} samples (n {n} and the prefix request)" if samples > 1 else "",
                    limits.logprob_entries, LIMIT_KEYS["logprob_entries"])
    return None


def check(tokenized, vocab: int, kinds: dict, fallback=lambda reason: None, limits=Limits(),
          re2=None, chunk: int | None = None):
    """(reason, message) when the tokenized request would kill, hang or slow the scheduler past
    this line's bounds, else None. `chunk`: the line's chunked-prefill size (pooled prompts fit in
    one chunk). Raises Unchecked when a value has a shape the guard does not
    know (the caller refuses it)."""
    message = check_ids(tokenized, vocab, fallback)
    if message is not None:
        return "input_ids", message
    is_generate = hasattr(tokenized, "top_logprobs_num")      # TokenizedEmbeddingReqInput has none
    for field in FIELDS:
        if field.struct == "request":
            if not is_generate:
                continue
            value = getattr(tokenized, field.name)
        else:
            value = getattr(tokenized.sampling_params, field.name)
        kind, optional = kinds[(field.struct, field.name)]
        message = check_field(field, kind, optional, value, vocab)
        if message is not None:
            return field.name, message
    if not isinstance(tokenized.rid, str):
        return "rid", (f"rid = {_short(tokenized.rid)} is {_shape(tokenized.rid)}, not a string: "
                       "this engine expects one string per request")
    if getattr(tokenized, "session_params", None) is not None:
        return "sessions", SESSIONS_OFF.format(what="a request with session_params")
    if getattr(tokenized, "session_id", None) is not None:
        return "sessions", SESSIONS_OFF.format(what="a request with session_id")
    sp = tokenized.sampling_params
    for num in SAMPLING_NUMBERS:
        message = check_number(num, getattr(sp, num.name), limits)
        if message is not None:
            return num.name, message
    message = check_logit_bias(sp.logit_bias, vocab)
    if message is not None:
        return "logit_bias", message
    bad = check_stops(sp, limits, re2)
    if bad is not None:
        return bad
    message = check_grammar_fields(sp)
    if message is not None:
        return "grammar", message
    prompt_len = _prompt_len(tokenized)
    bad = check_prompt_indices(tokenized, prompt_len) or check_pooling(tokenized, prompt_len, chunk)
    if bad is not None:
        return bad
    if is_generate:
        message = check_logprob_cost(tokenized, prompt_len, limits)
        if message is not None:
            return "logprob_entries", message
    return None


# ---- RE2 (google-re2): stop_regex compiled at the choke point, searched in the scheduler ----------

def re2_module():
    """The google-re2 module, or None when it is not installed (stop_regex is then refused)."""
    try:
        import re2
    except ImportError:
        return None
    return re2


@functools.lru_cache(maxsize=1024)
def re2_compile(pattern: str):
    """The pattern compiled by RE2 (cached: the scheduler searches the same patterns every step);
    raises re2.error naming the construct RE2 does not support."""
    import re2

    options = re2.Options()
    options.log_errors = False
    return re2.compile(pattern, options)


class Re2Search:
    """Stands for the `re` module in the engine's schedule_batch, whose only use of it is the
    stop_regex search per decode step (`re.search(pattern, text)`, `re.error`): the search runs on
    RE2, linear in the text; every other attribute is the real `re`'s."""

    def __init__(self, real_re):
        self._re = real_re
        self.error = real_re.error

    def search(self, pattern, string, flags=0):
        if flags or not isinstance(pattern, str):
            return self._re.search(pattern, string, flags)
        try:
            compiled = re2_compile(pattern)
        except Exception as exc:  # noqa: BLE001 - the engine's own handler: the request is finished
            raise self._re.error(f"stop_regex not runnable on RE2: {exc}") from None
        return compiled.search(string)

    def __getattr__(self, name):
        return getattr(self._re, name)


# ---- the routes' own bodies, before the engine builds a request of them --------------------------

# The Ollama options the engine maps (entrypoints/ollama/serving.py `_convert_options_to_sampling_params`)
# -> the engine's sampling field; `seed` goes to `sampling_seed` (input_guard maps it: the engine's
# mapping names a field `seed` that SamplingParams does not have). Ollama's other documented options
# (num_ctx, repeat_penalty, min_p, ...) are not mapped by the engine: ignored, as the engine does.
OLLAMA_OPTIONS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k",
                  "num_predict": "max_new_tokens", "stop": "stop",
                  "presence_penalty": "presence_penalty", "frequency_penalty": "frequency_penalty",
                  "seed": "sampling_seed"}
INT64 = (-(2**63), 2**63 - 1)
_NUMBERS = {n.name: n for n in SAMPLING_NUMBERS}


def _expects(num: Number) -> str:
    high = "" if num.high is None else f"{int(num.high)}" if num.kind == "int" else f"{num.high:g}"
    if num.kind == "int":
        return f"an integer in {num.low}..{high}" if high else f"an integer >= {num.low}"
    low = f"({num.low}" if num.low_open else f"[{num.low}"
    return f"a number in {low}, {high}]"


def sampling_value_problem(name: str, value):
    """(what the value is, what the engine expects) when a sampling value has a type the engine's
    SamplingParams cannot take (it would raise TypeError comparing it, a 500 on the routes that map
    only ValueError), else None. Ranges are the engine's own check (its ValueError) and the choke
    point's. Apart from the message's label, so each route names the field as its client sent it."""
    num = _NUMBERS.get(name)
    if num is not None:
        if value is None and num.optional:
            return None
        if num.kind == "int":
            return None if _is_int(value) else (f"is {_shape(value)}, not an integer", _expects(num))
        return None if _is_real(value) else (f"is {_shape(value)}, not a number", _expects(num))
    if name == "sampling_seed":
        if not _is_int(value) or isinstance(value, bool) or not INT64[0] <= value <= INT64[1]:
            return "is not a seed", "an integer in [-2**63, 2**63 - 1]"
        return None
    if name in ("stop", "stop_regex"):
        if value is None or isinstance(value, str) or (
                isinstance(value, list) and all(isinstance(x, str) for x in value)):
            return None
        return f"is {_shape(value)}", "a string or a list of strings"
    if name == "stop_token_ids":
        if value is None or (isinstance(value, list) and all(_is_int(x) for x in value)):
            return None
        return f"is {_shape(value)}", "a list of token ids"
    if name == "logit_bias":
        if value is None or isinstance(value, dict):
            return None
        return f"is {_shape(value)}", "an object of token id -> bias"
    if name in GRAMMAR_FIELDS:
        if value is None or isinstance(value, str):
            return None
        return f"is {_shape(value)}", "one string"
    return None


def check_sampling_value(name: str, value, where: str):
    """The message for `sampling_value_problem`, the field named `where.name`, else None."""
    problem = sampling_value_problem(name, value)
    if problem is None:
        return None
    what, expects = problem
    return f"{where}.{name} = {_short(value)} {what}: this engine expects {expects}"


def check_sampling_params(sp, where: str, accepted: frozenset):
    """A message for a sampling-params object (or the batch form, a list of them) the engine's
    `SamplingParams(**sp)` cannot take: not an object, a name it does not have (TypeError), a
    value of a type it cannot compare."""
    items = sp if isinstance(sp, list) else [sp]
    for item in items:
        if item is None:
            continue
        if not isinstance(item, dict):
            return (f"{where} = {_short(item)} is {_shape(item)}: this engine expects an object of "
                    "sampling parameters (or a list of them, one per prompt)")
        unknown = sorted(k for k in item if k not in accepted)
        if unknown:
            return (f"{where} has {_short(unknown[0])}, which is not a sampling parameter of this "
                    f"engine; it takes: {', '.join(sorted(accepted))}")
        for name, value in item.items():
            message = check_sampling_value(name, value, where)
            if message is not None:
                return message
    return None


def check_ollama_options(options):
    """(field, message) for Ollama `options` the engine's Ollama route would turn into a 500 (a value its
    SamplingParams cannot compare), else None. Ollama's documented names the engine does not map
    are ignored, as the engine ignores them."""
    if options is None:
        return None
    if not isinstance(options, dict):
        return "options", f"options = {_short(options)} is {_shape(options)}: Ollama expects an object"
    for option, field in OLLAMA_OPTIONS.items():
        if option in options:
            problem = sampling_value_problem(field, options[option])
            if problem is not None:
                return field, (f"options.{option} = {_short(options[option])} (this engine's "
                               f"sampling_params.{field}): this engine expects {problem[1]}")
    return None


VERTEX_INPUTS = ("text", "input_ids", "input_embeds")


def check_vertex(instances, parameters, request_fields: frozenset, sampling_fields: frozenset):
    """A message for a `/vertex_generate` body the engine's route cannot build a request of
    (`GenerateReqInput(**inputs, image_data=..., **parameters)`: a name it does not have is a
    TypeError, a 500), or whose values it cannot compare, else None."""
    if not isinstance(instances, list) or not all(isinstance(i, dict) for i in instances):
        return "instances must be a list of objects"
    key = next((k for k in VERTEX_INPUTS if instances and instances[0].get(k)), None)
    if key == "text":
        bad = next((i.get("text") for i in instances if not isinstance(i.get("text"), str)), None)
        if any(not isinstance(i.get("text"), str) for i in instances):
            return (f"instances[].text = {_short(bad)} is {_shape(bad)}: this engine expects one "
                    "string per instance (the same input key in every instance)")
    elif key == "input_ids":
        for i in instances:
            ids = i.get("input_ids")
            if not isinstance(ids, list) or not all(_is_int(t) for t in ids):
                return (f"instances[].input_ids = {_short(ids)} is not a list of token ids: this "
                        "engine expects one list of integers per instance")
    if parameters is None:
        return None
    if not isinstance(parameters, dict):
        return f"parameters = {_short(parameters)} is {_shape(parameters)}: this engine expects an object"
    own = set(VERTEX_INPUTS) | {"image_data"}
    unknown = sorted(k for k in parameters if k not in request_fields or k in own)
    if unknown:
        name = unknown[0]
        why = ("the route sets it from the instances" if name in own else
               "not a field of this engine's GenerateReqInput")
        return (f"parameters.{name}: {why}; sampling fields go in parameters.sampling_params, "
                "request fields (stream, return_logprob, ...) in parameters")
    return check_sampling_params(parameters.get("sampling_params"), "parameters.sampling_params",
                                 sampling_fields)


# ---- what a request costs before the choke point (the HTTP event loop, the engine's expansion) ----

def _prompts(obj) -> int:
    """How many prompts a GenerateReqInput carries before the engine normalises it (its batch
    form: a list of texts, a list of id lists, a list of embeddings; a single embeddings prompt
    is itself a list of vectors), as the engine's `_determine_batch_size` counts them."""
    shape = _batch_shape(obj)
    return shape[0] if shape is not None else 1


def check_samples(obj, limits: Limits):
    """A message when the whole request asks for more samples than the line's bound (prompts x
    n, or the sum of each prompt's n): the engine's normalisation expands it before the choke
    point, on the HTTP event loop."""
    sp = getattr(obj, "sampling_params", None)
    prompts = _prompts(obj)
    if isinstance(sp, list):
        ns = [item.get("n", 1) if isinstance(item, dict) else 1 for item in sp]
    else:
        ns = [sp.get("n", 1) if isinstance(sp, dict) else 1] * prompts
    if not all(_is_int(n) for n in ns):
        return None                         # the engine's / the choke point's type check
    total = sum(max(int(n), 1) for n in ns)
    if total <= limits.n:
        return None
    if len(ns) == 1:
        return (f"sampling_params.n = {ns[0]} is over this line's limit of {limits.n} parallel "
                f"samples per request ({LIMIT_KEYS['n']})")
    return (f"this request asks for {total} samples ({len(ns)} prompts, sampling_params.n "
            f"{'each ' + str(ns[0]) if len(set(ns)) == 1 else 'summed'}), over this line's limit of "
            f"{limits.n} samples per request, all its prompts together ({LIMIT_KEYS['n']})")


def check_text_size(obj, limits: Limits):
    """A message when a request's prompt text is longer than the line's bound (the tokenizer
    manager tokenizes it on the HTTP event loop, every other client waiting)."""
    text = getattr(obj, "text", None)
    if isinstance(text, str):
        total = len(text)
    elif isinstance(text, list):
        total = sum(len(t) for t in text if isinstance(t, str))
    else:
        return None
    if total <= limits.text_limit:
        return None
    return (f"text has {total:,} characters, over this line's limit of {limits.text_limit:,} per "
            f"request ({LIMIT_KEYS['text_chars']}): the engine tokenizes text on its HTTP event "
            "loop, where every other client waits; send the prompt as input_ids instead")


def check_parse_size(text, route: str, limits: Limits):
    """A message when a parse route's text is longer than the line's bound (the parser runs on
    the HTTP event loop, its cost grows with the square of the text for unclosed tags)."""
    if not isinstance(text, str) or len(text) <= limits.parse_chars:
        return None
    return (f"text has {len(text):,} characters, over this line's limit of {limits.parse_chars:,} "
            f"for {route} ({LIMIT_KEYS['parse_chars']}): the parser runs on the HTTP event loop, "
            "where every other client waits")


def check_prompt_present(obj):
    """A message when a request carries an empty prompt list the engine's normalisation indexes
    (`input_ids[0]`: IndexError, a 500 on /classify and /encode), else None."""
    ids, text = getattr(obj, "input_ids", None), getattr(obj, "text", None)
    if text is None and isinstance(ids, list) and not ids:     # indexed whatever else is sent
        return ("input_ids = [] has no prompt token: this engine expects at least one token id "
                "per prompt (or a text)")
    if getattr(obj, "input_embeds", None) is not None or getattr(obj, "image_data", None):
        return None
    if text is None and isinstance(ids, list):
        empty = next((i for i, x in enumerate(ids) if isinstance(x, list) and not x), None)
        if empty is not None:
            return (f"input_ids[{empty}] = [] has no prompt token: this engine expects at least "
                    "one token id per prompt")
    if ids is None and isinstance(text, list) and not text:
        return "text = [] has no prompt: this engine expects at least one prompt"
    return None


def check_embedding_batch(obj):
    """A message for an embedding request's shape the engine's normalisation cannot take
    (`EmbeddingReqInput.normalize_batch_and_arguments`: a single prompt's sampling params must be
    an object it sets max_new_tokens 0 in; a batch's rid a list (an assert), its sampling params one
    object per prompt), else None."""
    prompts = _prompts(obj)
    text, ids = getattr(obj, "text", None), getattr(obj, "input_ids", None)
    batch = isinstance(text, list) or (isinstance(ids, list) and ids and isinstance(ids[0], list))
    sp, rid = getattr(obj, "sampling_params", None), getattr(obj, "rid", None)
    if not batch:
        if sp is not None and not isinstance(sp, dict):
            return (f"sampling_params = {_short(sp)} is {_shape(sp)} on a single prompt: this engine "
                    "expects one object (a list only in the batch form, one per prompt)")
        return None
    if rid is not None and not isinstance(rid, list):
        return (f"rid = {_short(rid)} is {_shape(rid)} on a batch of {prompts} prompts: this engine "
                "expects a list of rids, one per prompt")
    if isinstance(sp, list) and (len(sp) < prompts or not all(isinstance(x, dict) for x in sp)):
        return (f"sampling_params has {len(sp)} entries for {prompts} prompts: this engine expects "
                "one object per prompt (or one object for all)")
    return None


# ---- the chat-like routes: their handlers render, tokenize or decode the body's text before the
# request reaches generate_request (issue 50) --------------------------------------------------------

def _model_fields(obj):
    """The fields of a parsed body: a dict's items, or a pydantic model's field values (its
    `__dict__`) and the extra fields a model that allows them keeps apart; None for anything else
    (duck-typed: this module imports no HTTP stack)."""
    if isinstance(obj, dict):
        return obj
    if not hasattr(type(obj), "model_fields"):
        return None
    fields = dict(vars(obj))                    # a pydantic model's field values
    extra = obj.__pydantic_extra__              # None unless its model allows extra fields
    if isinstance(extra, dict):
        fields.update(extra)
    return fields


def text_size(value, limit: int) -> int:
    """The characters of every string in `value` (dict keys included) plus one per list item,
    counted until the total passes `limit` (the count stops there: the walk costs at most the
    bound, and never more than the parse the HTTP layer has already done of the same body). One
    per list item because the engine's handlers loop over items (messages, parts, prompts, token
    ids to decode): a million empty items cost it as much as a million characters."""
    total = 0
    stack = [value]
    while stack and total <= limit:
        v = stack.pop()
        if isinstance(v, str):
            total += len(v)
        elif isinstance(v, (list, tuple)):
            total += len(v)
            stack.extend(v)
        else:
            fields = _model_fields(v)
            if fields is None:
                continue                        # a number, a bool, None: no text
            if isinstance(v, dict):
                total += sum(len(k) for k in v if isinstance(k, str))
            stack.extend(fields.values())
    return total


# Not counted on the chat routes: prompt ids are sent as they are (no rendering, no tokenizing),
# and with them the engine's chat handler skips the template (serving_chat `_process_messages`:
# "When input_ids are provided, skip template tokenization entirely"), so their messages are not
# rendered either: a conversation over the bound goes as input_ids.
UNRENDERED = "input_ids"


def check_body_text(body, route: str, limits: Limits):
    """A message when a chat-like route's body carries more text than the line's bound per
    request (`DSV41_INPUT_GUARD_MAX_TEXT_CHARS`, the bound the tokenizer manager applies to
    `text`): its handler renders the chat template over it, tokenizes or decodes it (and
    validates its tool schemas) before the request reaches generate_request, on the HTTP server
    where every other client waits. Else None."""
    fields = _model_fields(body)
    if fields is None:
        return None
    skip = {UNRENDERED}
    if fields.get(UNRENDERED) is not None and "messages" in fields:
        skip.add("messages")
    limit, total, counts = limits.text_limit, 0, {}
    for name, value in fields.items():
        if name in skip:
            continue
        before = total
        if isinstance(body, dict) and isinstance(name, str):
            total += len(name)                  # a client's key (a model's field names are its schema's)
        total += text_size(value, limit - total)
        counts[name] = total - before
        if total > limit:
            # named: the field holding most of what was counted (the walk stops at the bound)
            field = max(counts, key=counts.get)
            return (f"{route}: this request's text is over {limit:,} characters, this line's limit "
                    f"per request ({LIMIT_KEYS['text_chars']}); {field} holds {counts[field]:,} of "
                    "them: the engine renders, tokenizes or decodes a request's text on its HTTP "
                    "server before the request reaches the guard's other checks, where every "
                    "other client waits (counted: every string of the body and one per list item; "
                    "a chat request's input_ids and, with them, its messages are not rendered and "
                    "not counted)")
    return None


# The chat routes whose handler renders `messages` with the tokenizer's chat template without first
# checking there is one: the engine's Ollama chat (`apply_chat_template` on the loop; transformers
# raises ValueError "Cannot apply chat template to an empty conversation", which that route answers
# 500: found by the suite's fuzz once its boot had a chat template). The OpenAI and Anthropic
# handlers answer an empty conversation 400 themselves.
EMPTY_CONVERSATION_ROUTES = ("/api/chat",)


def check_chat_messages(body, route: str):
    """A message when a chat route that does not check it gets an empty `messages`, else None."""
    if route not in EMPTY_CONVERSATION_ROUTES:
        return None
    fields = _model_fields(body)
    messages = None if fields is None else fields.get("messages")
    if isinstance(messages, (list, tuple)) and not messages:
        return (f"{route}: messages = [] has no message: this engine renders the conversation with "
                "the model's chat template, which needs at least one message")
    return None


# ---- log-prob entries of the whole request, before the engine's normalisation (issue 50) -----------

def _per_prompt(value, i: int):
    """A request field's value for prompt i: the batch form is a list, one value per prompt."""
    return value[i] if isinstance(value, list) and i < len(value) else value


def _batch_shape(obj):
    """(prompts, batch) as the engine's `_determine_batch_size` decides them (text first, then
    input_ids, then input_embeds: a single embeddings prompt is a list of vectors); None for a
    form it does not take (its own checks answer it)."""
    text, ids, embeds = (getattr(obj, name, None) for name in ("text", "input_ids", "input_embeds"))
    if text is not None:
        return (1, False) if isinstance(text, str) else (len(text), True) if isinstance(text, list) else None
    if ids is not None:
        if not isinstance(ids, list) or not ids:
            return None
        return (1, False) if _is_int(ids[0]) else (len(ids), True)
    if isinstance(embeds, list) and embeds and isinstance(embeds[0], list) and embeds[0]:
        return (1, False) if _is_real(embeds[0][0]) else (len(embeds), True)
    return None


def _prompt_positions(obj, i: int, batch: bool):
    """(positions, exact) of prompt i before tokenizing: its ids or embeddings counted; a text's
    tokens are not known yet, so a text counts its UTF-8 length, the most a byte-level tokenizer
    (DeepSeek's) makes of it (its BOS aside). None when the form is not one the engine takes."""
    for name in ("text", "input_ids", "input_embeds"):
        value = getattr(obj, name, None)
        if value is None:
            continue
        item = value[i] if batch else value
        if name == "text":
            # surrogatepass: a lone surrogate from JSON ("\ud800") is a client's text, not our 500
            return (len(item.encode("utf-8", "surrogatepass")), False) if isinstance(item, str) else None
        return (len(item), True) if isinstance(item, list) else None
    return None


def check_request_logprobs(obj, limits: Limits):
    """A message when the whole request asks for more prompt log-prob entries than the line's
    bound: every prompt of a batch, times its samples (with n > 1 the engine sends the prompt
    n times plus once to cache its prefix, each computing and converting its prompt log-probs
    from logprob_start_len: `_handle_batch_request`, `Req._compute_max_prefix_len`), all
    converted by the tokenizer manager on the HTTP event loop. Else None.

    A single text prompt is left to the choke point (`check_logprob_cost`, exact on its tokens,
    times its samples); a batch of texts is counted here by each text's UTF-8 length (the engine
    tokenizes and sends a text batch one prompt at a time, so no later point sees the whole
    request before some of it is sent)."""
    if not hasattr(obj, "top_logprobs_num"):          # an embedding request: no log-probs
        return None
    shape = _batch_shape(obj)
    if shape is None:
        return None
    prompts, batch = shape
    if not batch and getattr(obj, "text", None) is not None:
        return None                                 # the choke point's exact count
    sp = getattr(obj, "sampling_params", None)
    total, estimated, samples_seen = 0, False, set()
    for i in range(prompts):
        if not _per_prompt(getattr(obj, "return_logprob", None), i):
            continue
        start = _per_prompt(getattr(obj, "logprob_start_len", None), i)
        k = _per_prompt(getattr(obj, "top_logprobs_num", None), i)
        ids = getattr(obj, "token_ids_logprob", None)
        ids = ids[i] if isinstance(ids, list) and ids and isinstance(ids[0], list) and i < len(ids) else ids
        if not _is_int(start) or start < 0:
            continue                                # no prompt log-probs (-1: the engine's default)
        k = k if _is_int(k) and k > 0 else 0
        t = len(ids) if isinstance(ids, list) else 0
        if k + t == 0:
            continue
        counted = _prompt_positions(obj, i, batch)
        if counted is None:
            return None                             # the engine's own checks answer the form
        length, exact = counted
        estimated |= not exact
        params = _per_prompt(sp, i)
        n = params.get("n", 1) if isinstance(params, dict) else 1
        if not _is_int(n):
            return None                             # the n check answers it
        samples = n + 1 if n > 1 else 1
        samples_seen.add(samples)
        total += (k + t) * max(length - start, 0) * samples
    if total <= limits.logprob_entries:
        return None
    how = (f"{prompts} prompts" if prompts > 1 else "1 prompt") + (
        "" if samples_seen == {1} else f", {min(samples_seen)} samples each"
        if len(samples_seen) == 1 else ", samples summed")
    counted_as = (" (a text prompt counted at one position per UTF-8 byte, the most a byte-level "
                  "tokenizer makes of it: send input_ids for an exact count)" if estimated else "")
    return (f"this request asks for {total:,} prompt log-prob entries ({how}; (top_logprobs_num + "
            "token_ids_logprob) x prompt positions from logprob_start_len, per sample), over this "
            f"line's limit of {limits.logprob_entries:,} per request, all its prompts and samples "
            f"together ({LIMIT_KEYS['logprob_entries']}): the tokenizer manager converts them on "
            f"the HTTP event loop{counted_as}")


# ---- the grammar compile pool: one client's share (issue 50) ----------------------------------------

# The header that names the client when the line's DSV41_INPUT_GUARD_CLIENT_HEADER is 1: set by the
# operator's gateway (which must overwrite what a client sends: a client free to set it can be as
# many clients as it likes).
CLIENT_HEADER = "x-dsv41-client"
GRAMMAR_SHARE_STATUS = 429          # too many requests of this client at once: retry, nothing wrong


def compile_workers(cpus: int | None) -> int:
    """The engine's grammar compile pool: `BaseGrammarBackend.__init__` builds a
    `ThreadPoolExecutor()`, whose default on this Python is min(32, cpus + 4) workers."""
    return min(32, (cpus or 1) + 4)


def grammar_share(limits: Limits, cpus: int | None) -> int:
    """The most requests with a grammar one client may have unanswered at once: the line's
    bound, or (0, the default) half the compile pool, so the other half is always free for the
    other clients' compiles."""
    if limits.grammar_compiles > 0:
        return limits.grammar_compiles
    return max(1, compile_workers(cpus) // 2)


def grammar_keys(obj) -> list:
    """(grammar, requests) for each prompt of this request that carries a grammar (json_schema,
    regex, ebnf, structural_tag), before the engine normalises it: each prompt x n sample is its
    own scheduler request, and each compiles its own grammar on a cache miss (the engine does not
    join concurrent compiles of one grammar). The grammar is (field, sha256 of its text): the
    tokenizer manager remembers the ones it has seen answered without keeping their text."""
    sp = getattr(obj, "sampling_params", None)
    items = sp if isinstance(sp, list) else [sp] * _prompts(obj)
    out = []
    for item in items:
        if not isinstance(item, dict):
            continue
        field = next((f for f in GRAMMAR_FIELDS if item.get(f) is not None), None)
        if field is None:
            continue
        value = item[field]
        text = value if isinstance(value, str) else json.dumps(value, sort_keys=True, default=str)
        digest = hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()
        n = item.get("n", 1)
        out.append(((field, digest), max(int(n), 1) if _is_int(n) else 1))   # n's type: the choke point's
    return out



def client_of(peer_host, header_value, use_header: int) -> str:
    """Who a request's grammar compiles are counted against: the operator's header (when the line
    trusts it and the request carries one), else the peer's host. Behind a gateway without the
    header every request's peer is the gateway: one client, one share for the whole line."""
    if use_header and isinstance(header_value, str) and header_value.strip():
        return "header " + header_value.strip()[:128]
    return "host " + peer_host if isinstance(peer_host, str) and peer_host else "host unknown"


def check_grammar_share(client: str, pending: int, adding: int, share: int, workers: int):
    """A message when a client's unanswered grammar requests (`pending`) plus this request's
    (`adding`) are over its share of the compile pool, else None."""
    if adding <= 0 or pending + adding <= share:
        return None
    key = LIMIT_KEYS["grammar_compiles"]
    if adding > share:
        return (f"this request sends {adding} requests with a grammar (prompts x n), over this "
                f"line's limit of {share} unanswered grammar requests per client ({key}): the "
                f"engine compiles each on a pool of {workers} workers shared by every client; "
                f"split it into requests of at most {share}")
    return (f"{client} already has {pending} requests with a grammar (json_schema, regex, ebnf, "
            f"structural_tag) not yet answered; this one would make {pending + adding}, over this "
            f"line's limit of {share} per client ({key}): the engine compiles grammars on a pool "
            f"of {workers} workers shared by every client; retry when one of them has answered")
