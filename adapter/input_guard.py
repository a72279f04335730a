"""input_guard (`DSV41_INPUT_GUARD=1`): a token id outside the vocabulary gets HTTP 400, not a
dead scheduler.

The stock 0.5.23 tokenizer manager range-checks `token_ids_logprob` and `logit_bias`, but not the
prompt's token ids: one `/generate` whose `input_ids` holds an id outside [0, vocab_size) (e.g.
`[5, 6, 5000000]`, or a negative id) reaches the embedding, the scheduler dies on
`IndexError: index out of range in self` and the whole server with it. Measured on the real CPU
server (tests/e2e/test_e2e_faults.py), two more inputs kill it the same way:
- `stop_token_ids` outside the vocabulary: the min-new-tokens penalizer scatters every request's
  stop ids of a batch into a vocabulary-sized row, so one such request dies alone with
  `min_new_tokens` > 0, and with any other request of its batch that sets `min_new_tokens`;
- `top_logprobs_num` above the vocabulary size: `logprobs.topk(max k of the batch)` fails
  (`selected index k out of range`), with `return_logprob` on that request or, without it, on
  any other request of its prefill batch (the batch takes every request's k).

With the key set, every tokenized request is checked in the tokenizer manager before it leaves
for the scheduler: the prompt's ids (`/generate` `input_ids`, single and batched; token-id prompts
of `/v1/completions`; `/v1/chat/completions` `input_ids`; whatever the tokenizer produced),
`stop_token_ids` against [0, vocab_size), `top_logprobs_num` against vocab_size. A bad request raises the engine's own ValueError, which its HTTP layers answer with 400
(a streamed request gets the engine's error event), naming the first bad id, its position and the
valid range. Every other request goes on unchanged: nothing else is read or written.

Where: `TokenizerManager._create_tokenized_object`, which both the single and the batch path call
right after the engine's `_validate_one_request` (after its length checks and truncation). The
hook checks the int64 array the engine has just built from the ids (`array("q", input_ids)`)
through a zero-copy numpy view, in one vectorised pass (as unsigned, a negative id is huge, so one
`max()` covers both ends). Checking the list in `_validate_one_request` would convert the list a
second time: 25 ms for 1M ids here, 100x the check (bench/input_guard_cost.py).

Shapes it does not check (fallback line once per reason, request passed unchanged): multimodal
requests (the processor's ids carry placeholder tokens), `input_embeds` requests (the model reads
the embeddings; the scheduler makes up the ids), ids that are not an integer array. A failure of
the check itself is a fallback line too, and the request goes on unchanged: no exception of ours
reaches the engine. The engine's own exceptions from the wrapped call propagate unchanged.

Receipts: `[dsv41] input_guard installed: ...`; the first rejection of each reason is logged
(later ones are counted: `rejected:<reason>`, on `/metrics` as
`dsv41_input_guard_rejected_total{reason}`); `checked` counts the requests checked.
"""
from __future__ import annotations

from array import array

import numpy as np

from adapter import receipts

NAME = "input_guard"
KEY = "DSV41_INPUT_GUARD"

# Counter keys in receipts.counters["input_guard"] (series: adapter/metrics.py KEYS).
COUNTERS = {
    "checked": "requests whose token ids were range-checked",
    "rejected:": "requests answered 400, by what was out of range (input_ids, stop_token_ids, "
                 "top_logprobs_num)",
}
REASONS = ("input_ids", "stop_token_ids", "top_logprobs_num")

MULTIMODAL = ("multimodal request: its ids carry the processor's placeholder tokens; prompt ids "
              "not checked, request passed unchanged")
EMBEDS = ("input_embeds request: the model reads the given embeddings and the scheduler makes up "
          "the ids; prompt ids not checked, request passed unchanged")


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


def check(tokenized, vocab: int, fallback=lambda reason: None):
    """(reason, message) when the tokenized request would index past the vocabulary, else None."""
    if getattr(tokenized, "mm_inputs", None) is not None:
        fallback(MULTIMODAL)
    elif getattr(tokenized, "input_embeds", None) is not None:
        fallback(EMBEDS)
    else:
        ids = tokenized.input_ids
        if type(ids) is array and ids.typecode == "q":      # what the engine builds
            # the common case in one numpy pass over the engine's buffer (no copy)
            u = np.frombuffer(ids, np.uint64) if ids else None
            a = None if u is None or u[u.argmax()] < vocab else np.frombuffer(ids, np.int64)
        else:
            a = None if ids is None else int64_view(ids)
            if a is None and ids is not None:
                fallback(f"prompt ids are not a flat integer sequence ({type(ids).__name__}); not "
                         "checked, request passed unchanged")
        bad = None if a is None else first_out_of_range(a, vocab)
        if bad is not None:
            pos, token, count = bad
            more = f" ({count} of the {a.size} prompt ids are out of range)" if count > 1 else ""
            return "input_ids", (f"input_ids[{pos}] = {token} is not a token id of this model: valid "
                                 f"ids are 0..{vocab - 1} (vocabulary size {vocab}){more}")
    stop = getattr(getattr(tokenized, "sampling_params", None), "stop_token_ids", None)
    if stop:
        try:
            lo, hi = min(stop), max(stop)
        except TypeError:
            fallback("stop_token_ids are not comparable integers; not checked, request passed "
                     "unchanged")
        else:
            if lo < 0 or hi >= vocab:
                token = lo if lo < 0 else hi
                return "stop_token_ids", (f"stop_token_ids contains {token}, which is not a token "
                                          f"id of this model: valid ids are 0..{vocab - 1} "
                                          f"(vocabulary size {vocab})")
    k = getattr(tokenized, "top_logprobs_num", None)
    if isinstance(k, int) and k > vocab:
        return "top_logprobs_num", (f"top_logprobs_num = {k} is more than this model's vocabulary "
                                    f"size: valid values are 0..{vocab}")
    return None


def install(ctx) -> str:
    counters = ctx.counters
    logged: set = set()

    def create_tokenized_object(original, self, obj, *args, **kwargs):
        tokenized = original(self, obj, *args, **kwargs)     # the engine's errors propagate as is
        try:
            counters["checked"] += 1
            bad = check(tokenized, self.model_config.vocab_size, ctx.fallback)
        except Exception as exc:  # noqa: BLE001 - a failing check never stops a request
            ctx.fallback(f"the check itself failed ({type(exc).__name__}); request passed unchanged")
            return tokenized
        if bad is None:
            return tokenized
        reason, message = bad
        counters[f"rejected:{reason}"] += 1
        if reason not in logged:
            logged.add(reason)
            receipts.line(NAME, "rejected a request (HTTP 400): %s; further %s rejections are "
                          "counted, not logged", message, reason)
        raise ValueError(message)

    ctx.around("TokenizerManager._create_tokenized_object", create_tokenized_object)
    return (f"{KEY}=1: prompt token ids (/generate input_ids, single and batched; token-id prompts "
            "of /v1/completions and /v1/chat/completions; tokenizer output), stop_token_ids and "
            "top_logprobs_num are range-checked against the vocabulary in the tokenizer manager; "
            "a bad request gets HTTP 400 naming the first bad id, its position and the valid range")
