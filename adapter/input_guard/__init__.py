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

Shape (issue 50): `rules` holds the checks and the bounds with their defaults, pure and free of
engine imports (an import-linter contract in pyproject.toml keeps it so: they are tested without
a server); `hooks` is where the engine calls them (one installer per place, each pinned in
adapter/table.py); `routes` classifies every route of the engine's app. This package re-exports
the names the installer, the metrics and the tests use, so `adapter.input_guard` stays the
adapter's module.
"""
from __future__ import annotations

import time  # noqa: F401 - the hooks' clock (tests patch input_guard.time.perf_counter)

from adapter.input_guard import hooks, routes, rules  # noqa: F401
from adapter.input_guard.hooks import (  # noqa: F401 - the adapter's public names
    SB, XG, Guard, agreed_step_us, declared_kinds, install, live_reqs, note_step_time,
    rejection_class, xgrammar_of)
from adapter.input_guard.routes import ADMIN, NO_REQUEST, REQUEST, ROUTES, SESSION  # noqa: F401
from adapter.input_guard.rules import *  # noqa: F401,F403 - the rules and bounds
from adapter.input_guard.rules import (  # noqa: F401 - private helpers the tests read
    _bounds, _is_int, _is_real, _prompt_len, _range_text, _shape, _short, _strings)
from adapter.tp_group import all_reduce_max  # noqa: F401 - the grammar bound's collective
