"""input_guard (`DSV41_INPUT_GUARD=1`): a request the stock scheduler would die on gets HTTP 400.

Built from the engine's code paths, not from the inputs that happened to fail. The tokenizer
manager sends the scheduler one `TokenizedGenerateReqInput` per request (a msgspec struct, with a
`SamplingParams` struct inside); the engine's HTTP schema accepts a list for many of its fields
even on a single request (the batch form), and neither the schema nor the tokenizer manager checks
most ranges. bench/input_guard_fields.py sends, for every field of both structs a client can set,
the wrong values its declared type admits from JSON, to the real stock CPU server; the table in
docs/input_guard.md lists every field, where the scheduler or the model uses it and what stock did
(dies / 4xx / 200). This guard checks exactly the fields where stock died (`FIELDS` below), each
against the type the engine declares for it (read from the engine's struct at install, so a list
where the engine expects an int is a 400) and the range its users rely on:

- prompt ids (`input_ids`, whichever way they came: `/generate` single and batched, token-id
  prompts of `/v1/completions`, `/v1/chat/completions` `input_ids`, the tokenizer's output): each
  in [0, vocab_size) - the embedding indexes with them (`IndexError`) - and at least one (a text
  that tokenizes to nothing: the prefill of 0 tokens dies reshaping its logits; found by the
  fuzz test);
- `stop_token_ids` in [0, vocab_size): the min-new-tokens penalizer scatters every request's stop
  ids of a batch into a vocabulary-sized row;
- `top_logprobs_num` an int <= vocab_size: the batch's max k goes to `logprobs.topk`, and
  `x > 0` on it decides whether top logprobs run (a list: `TypeError`; a negative k is "none",
  which stock serves);
- `logprob_start_len` an int >= -1 (-1: the engine's default): the scheduler compares it with the
  prompt length (a list: `TypeError`) and the logprob processor asserts the range;
- and the further rows of `FIELDS`, each with the scheduler's line that dies.

With the key set, every tokenized request is checked in the tokenizer manager before it leaves for
the scheduler. A bad request raises the engine's own ValueError, which its HTTP layers answer with
400 (a streamed request gets the engine's error event), naming the field, the value and what the
engine expects. Every other request goes on unchanged: nothing is written.

Where: `TokenizerManager._create_tokenized_object`, which both the single and the batch path call
right after the engine's `_validate_one_request` (after its length checks and truncation). The
prompt ids are checked on the int64 array the engine has just built (`array("q", input_ids)`)
through a zero-copy numpy view, in one vectorised pass (as unsigned, a negative id is huge, so one
`max()` covers both ends). Checking the list in `_validate_one_request` would convert the list a
second time: 25 ms for 1M ids here, 100x the check (bench/input_guard_cost.py).

Fail closed: a guard against crashes must not pass what it could not check. When the check itself
fails (an exception of ours, a value of a shape it does not know), the request gets a 400 that
says so and is counted (`rejected:unchecked`). Not checked by design (fallback line once per
reason, request passed unchanged): the prompt ids of multimodal requests (the processor's ids
carry placeholder tokens) and of `input_embeds` requests (the model reads the embeddings; the
scheduler makes up the ids); their other fields are checked. The engine's own exceptions from the
wrapped call propagate unchanged. State on failure: the guard writes nothing, so a contained
failure leaves the engine exactly as stock (the request is refused before it is sent).

Receipts: `[dsv41] input_guard installed: ...`; the first rejection of each reason is logged
(later ones are counted: `rejected:<reason>`, on `/metrics` as
`dsv41_input_guard_rejected_total{reason}`); `checked` counts the requests checked.
"""
from __future__ import annotations

import dataclasses
import typing
from array import array

import numpy as np

from adapter import receipts

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
REASONS = ("input_ids", *(f.name for f in FIELDS), "unchecked")

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
    u = a.view(np.uint64) if a.dtype == np.int64 else a.astype(np.int64).view(np.uint64)
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


def declared_kinds() -> dict:
    """(struct, field) -> (kind, optional), from the engine's own struct declarations."""
    import msgspec

    from sglang.srt.managers.io_struct import TokenizedGenerateReqInput
    from sglang.srt.sampling.sampling_params import SamplingParams

    types_of = {"request": {f.name: f.type for f in msgspec.structs.fields(TokenizedGenerateReqInput)},
                "sampling_params": {f.name: f.type for f in msgspec.structs.fields(SamplingParams)}}
    return {(f.struct, f.name): kind_of(types_of[f.struct][f.name]) for f in FIELDS}


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


def check(tokenized, vocab: int, kinds: dict, fallback=lambda reason: None):
    """(reason, message) when the tokenized request would kill the scheduler, else None.
    Raises Unchecked when a value has a shape the guard does not know (the caller refuses it)."""
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
    return None


def install(ctx) -> str:
    counters = ctx.counters
    kinds = declared_kinds()        # the engine's declared types of the guarded fields
    logged: set = set()

    def reject(reason: str, message: str):
        counters[f"rejected:{reason}"] += 1
        if reason not in logged:
            logged.add(reason)
            receipts.line(NAME, "rejected a request (HTTP 400): %s; further %s rejections are "
                          "counted, not logged", message, reason)
        raise ValueError(message)

    def create_tokenized_object(original, self, obj, *args, **kwargs):
        tokenized = original(self, obj, *args, **kwargs)     # the engine's errors propagate as is
        try:
            counters["checked"] += 1
            bad = check(tokenized, self.model_config.vocab_size, kinds, ctx.fallback)
        except Exception as exc:  # noqa: BLE001 - fail closed: what we could not check is refused
            detail = str(exc) if isinstance(exc, Unchecked) else type(exc).__name__
            reject("unchecked", f"input_guard could not check this request ({detail}); it is "
                                "refused rather than sent to the scheduler unchecked")
        if bad is None:
            return tokenized
        reject(*bad)

    ctx.around("TokenizerManager._create_tokenized_object", create_tokenized_object)
    return (f"{KEY}=1: the fields the stock scheduler dies on (prompt token ids, "
            "logprob_start_len, top_logprobs_num, lora_id, positional_embed_overrides, "
            "stop_token_ids) are checked in the tokenizer manager against the engine's declared "
            "types and the ranges the scheduler relies on; a bad request gets HTTP 400 naming "
            "the field, its value and the valid range; a request the guard cannot check gets 400 "
            "too")
