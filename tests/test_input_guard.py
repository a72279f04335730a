"""input_guard on the engine's real TokenizerManager (built on CPU from the tiny dense model,
vocabulary 1024, for each test; the guard installed by the production installer once per module
and reset before each test: tests/input_guard_fixtures.py), the engine's real HTTP app driven
through it, and its check on its own. The real server: tests/e2e/test_e2e_faults.py."""
import asyncio
import inspect
import types
import typing
from array import array

import numpy as np
import pytest

from adapter import input_guard, receipts
from conftest import close_zmq_sockets, run_two_ranks_modes
from input_guard_fixtures import KEYS, guard_install_of_the_module, input_guard_installed  # noqa: F401

VOCAB = 1024


@pytest.fixture(scope="module")
def dense_model():
    from adapter.cpu import models

    return models.ensure_model("dense")


def _real_manager(dense_model, **server_args):
    """The engine's TokenizerManager, as the launcher builds it (its zmq sockets bound, no
    scheduler behind them: what it would send is recorded by the caller)."""
    from sglang.srt.managers.tokenizer_manager import TokenizerManager
    from sglang.srt.server_args import PortArgs, ServerArgs

    args = ServerArgs(model_path=str(dense_model), device="cpu", skip_server_warmup=True,
                      **server_args)
    return args, lambda: TokenizerManager(args, PortArgs.init_new(args))


@pytest.fixture
def manager(input_guard_installed, dense_model):  # noqa: F811
    """The engine's real TokenizerManager, built for this test, with the guard installed (the
    module's install, reset as a fresh one), a tokenizer-role engine config active for the call
    (use_context: nothing published globally)."""
    from sglang.srt import runtime_context as rc

    args, build = _real_manager(dense_model)
    with rc.use_context(rc.create_context(args, role="tokenizer")):
        tm = build()
        try:
            assert tm.model_config.vocab_size == VOCAB
            yield tm
        finally:
            assert close_zmq_sockets(tm) == 2           # its detokenizer PULL, its scheduler PUSH


def _tokenize(tm, input_ids, **extra):
    from sglang.srt.managers.io_struct import GenerateReqInput

    sampling = {"max_new_tokens": 2, **extra.pop("sampling", {})}   # extra: this call's own dict
    obj = GenerateReqInput(input_ids=input_ids, sampling_params=sampling, **extra)
    obj.normalize_batch_and_arguments()
    tm._init_req_state(obj)
    return tm._create_tokenized_object(obj, None, obj.input_ids)


def _counts():
    return dict(receipts.counters["input_guard"])


def test_a_good_request_leaves_unchanged_and_is_counted(manager):
    out = _tokenize(manager, [5, 6, 0, VOCAB - 1], sampling={"stop_token_ids": [7, VOCAB - 1]},
                    return_logprob=True, top_logprobs_num=VOCAB)
    assert out.input_ids == array("q", [5, 6, 0, VOCAB - 1])
    assert out.sampling_params.stop_token_ids == {7, VOCAB - 1} and out.top_logprobs_num == VOCAB
    assert _counts() == {"checked": 1}


@pytest.mark.parametrize("ids, pos, bad, count", [
    ([5, 6, 5_000_000], 2, 5_000_000, 1),
    ([-1, 5, 6], 0, -1, 1),                          # negative: out of range too
    ([5, VOCAB, 6, VOCAB + 7], 1, VOCAB, 2),         # the vocabulary size itself is not an id
    ([3] * 100_000 + [2**62], 100_000, 2**62, 1),
])
def test_an_id_outside_the_vocabulary_is_a_value_error_naming_it(manager, ids, pos, bad, count, caplog):
    with pytest.raises(ValueError) as err:
        _tokenize(manager, ids)
    message = str(err.value)
    assert message.startswith(f"input_ids[{pos}] = {bad} is not a token id of this model")
    assert f"valid ids are 0..{VOCAB - 1} (vocabulary size {VOCAB})" in message
    assert (f"({count} of the {len(ids)} prompt ids are out of range)" in message) == (count > 1)
    assert _counts() == {"checked": 1, "rejected:input_ids": 1}


def test_a_prompt_of_no_tokens_is_rejected(manager):
    """`/generate {"text": ""}` on a tokenizer without BOS reaches here with no ids: the stock
    scheduler dies on a prefill of 0 tokens (found by tests/e2e/test_e2e_fuzz.py)."""
    from sglang.srt.managers.io_struct import GenerateReqInput

    obj = GenerateReqInput(text="", sampling_params={"max_new_tokens": 2})
    obj.normalize_batch_and_arguments()
    manager._init_req_state(obj)
    with pytest.raises(ValueError, match="the prompt has no tokens"):
        manager._create_tokenized_object(obj, "", [])       # what the tokenizer made of ""
    assert _counts() == {"checked": 1, "rejected:input_ids": 1}


def test_one_log_line_per_reason_every_rejection_counted(manager, caplog):
    caplog.set_level("INFO", logger=receipts.LOGGER_NAME)
    for _ in range(3):
        with pytest.raises(ValueError):
            _tokenize(manager, [5, 5_000_000])
    lines = [r.getMessage() for r in caplog.records if "input_guard rejected" in r.getMessage()]
    assert len(lines) == 1 and "input_ids[1] = 5000000" in lines[0]
    assert _counts()["rejected:input_ids"] == 3


@pytest.mark.parametrize("extra, reason, text", [
    ({"sampling": {"stop_token_ids": [7, 5_000_000]}}, "stop_token_ids", "stop_token_ids contains 5000000"),
    ({"sampling": {"stop_token_ids": [-4, 7]}}, "stop_token_ids", "stop_token_ids contains -4"),
    # without return_logprob too: a prefill batch takes every request's k (engine-fatal, e2e)
    ({"top_logprobs_num": VOCAB + 1}, "top_logprobs_num",
     f"top_logprobs_num = {VOCAB + 1} is out of range: this engine expects an integer <= 1024 "
     f"\\(vocabulary size {VOCAB}\\)"),
    ({"top_logprobs_num": 100_000, "return_logprob": True}, "top_logprobs_num", "an integer <= 1024"),
])
def test_stop_ids_and_top_logprobs_past_the_vocabulary_are_rejected(manager, extra, reason, text):
    with pytest.raises(ValueError, match=text):
        _tokenize(manager, [5, 6, 7], **extra)
    assert _counts() == {"checked": 1, f"rejected:{reason}": 1}


def test_the_engines_own_errors_propagate_unchanged(manager):
    with pytest.raises(ValueError, match="temperature must be a non-negative finite number"):
        _tokenize(manager, [5, 5_000_000], sampling={"temperature": -1.0})
    assert _counts() == {}                  # the engine raised before the guard looked


def test_a_failing_check_refuses_the_request_and_counts_it(manager, monkeypatch, caplog):
    """Fail closed: a guard against crashes must not pass what it could not check."""
    caplog.set_level("INFO", logger=receipts.LOGGER_NAME)

    def broken(*args, **kwargs):
        raise RuntimeError("planted")

    monkeypatch.setattr(input_guard.hooks, "check", broken)
    with pytest.raises(ValueError, match=r"input_guard could not check this request \(RuntimeError\); "
                                         "it is refused rather than sent to the scheduler unchecked"):
        _tokenize(manager, [5, 6])
    assert _counts() == {"checked": 1, "rejected:unchecked": 1}


@pytest.mark.parametrize("extra, reason, text", [
    # the engine's schema takes the batch form (a list) on a single request too
    ({"top_logprobs_num": [3], "return_logprob": True}, "top_logprobs_num",
     r"top_logprobs_num = \[3\] is a list, not an integer: this engine expects an integer <= 1024"),
    ({"top_logprobs_num": [100_000], "return_logprob": True}, "top_logprobs_num", "is a list"),
    ({"logprob_start_len": [0], "return_logprob": True}, "logprob_start_len",
     r"logprob_start_len = \[0\] is a list, not an integer: this engine expects an integer >= -1"),
    ({"logprob_start_len": -5, "return_logprob": True}, "logprob_start_len",
     "logprob_start_len = -5 is out of range: this engine expects an integer >= -1"),
])
def test_fields_the_scheduler_dies_on_are_rejected_by_the_engines_types(manager, extra, reason, text):
    with pytest.raises(ValueError, match=text):
        _tokenize(manager, [5, 6, 7], **extra)
    assert _counts() == {"checked": 1, f"rejected:{reason}": 1}


@pytest.mark.parametrize("extra", [
    {"logprob_start_len": -1, "return_logprob": True}, {"logprob_start_len": 0, "return_logprob": True},
    {"logprob_start_len": 3, "return_logprob": True}, {"top_logprobs_num": 0}, {"top_logprobs_num": -5, "return_logprob": True},  # "none": stock serves it
    {"top_logprobs_num": True, "return_logprob": True},      # bool: an int to the engine, stock serves it
    {"sampling": {"stop_token_ids": []}},
])
def test_values_stock_serves_pass(manager, extra):
    _tokenize(manager, [5, 6, 7], **extra)
    assert _counts() == {"checked": 1}


def test_the_receipt_names_every_guarded_field(install_adapters):
    install_adapters({})        # the engine's modules imported, nothing of ours installed
    hooks = []
    ctx = types.SimpleNamespace(counters={}, fallback=lambda reason: None,
                                around=lambda target, hook: hooks.append(target))
    receipt = input_guard.install(ctx)
    assert hooks == ["TokenizerManager._create_tokenized_object", "TokenizerControlMixin.open_session",
                     "TokenizerControlMixin.close_session",
                     "TokenizerManager.generate_request", "TokenizerManager._init_req_state",
                     "TokenizerManager.create_abort_task", "Scheduler.abort_request",
                     "XGrammarGrammar.accept_token", "XGrammarGrammar.fill_vocab_mask",
                     "Scheduler.process_batch_result",
                     "XGrammarGrammarBackend.__init__", "OllamaServing._convert_options_to_sampling_params",
                     "OllamaServing._generate_chat_response",
                     "OllamaServing._generate_generate_response",
                     "OllamaServing._stream_chat_response", "OllamaServing._stream_generate_response",
                     "TokenizerManager.__init__",
                     "TokenizerManager.generate_request"]    # the compile pool's share (issue 50)
    for field in input_guard.FIELDS:
        assert field.name in receipt, field.name
    assert "stop_regex runs on RE2" in receipt and "aborts match rids exactly" in receipt


def test_the_guarded_types_are_the_engines_declarations():
    kinds = input_guard.declared_kinds()
    assert kinds[("request", "top_logprobs_num")] == ("int", False)
    assert kinds[("request", "logprob_start_len")] == ("int", False)
    assert kinds[("sampling_params", "stop_token_ids")] == ("ids", True)
    with pytest.raises(input_guard.Unchecked):     # a type the guard does not know is not guessed
        input_guard.kind_of(typing.Dict[str, int])


# --- the check on its own ---------------------------------------------------------------------

def _req(**fields):
    """A tokenized request for the check on its own: the engine's real TokenizedGenerateReqInput
    and SamplingParams, normalised as the tokenizer manager does (no tokenizer: ids only)."""
    from sglang.srt.managers.io_struct import TokenizedGenerateReqInput
    from sglang.srt.sampling.sampling_params import SamplingParams

    sampling = fields.pop("sampling_params", None)
    if sampling is None or isinstance(sampling, dict):
        sampling = SamplingParams(**(sampling or {}))
        # normalize() encodes stop strings with the tokenizer: one character a token here
        sampling.normalize(types.SimpleNamespace(encode=lambda text, add_special_tokens=False: list(text)))
    base = dict(input_text=None, input_ids=array("q", [1, 2]), mm_inputs=None, input_embeds=None,
                sampling_params=sampling, top_logprobs_num=0, return_logprob=False,
                logprob_start_len=-1, lora_id=None, positional_embed_overrides=None, rid="r",
                stream=False, token_ids_logprob=None)
    base.update(fields)
    try:
        return TokenizedGenerateReqInput(**base)
    except TypeError:       # a shape the engine's struct would not take: a namespace carries it
        return types.SimpleNamespace(**{**{f: None for f in ("session_id", "session_params",
                                        "token_indices_to_pool", "multi_item_delimiter_indices")},
                                        **base})


@pytest.fixture(scope="module")
def kinds():
    return input_guard.declared_kinds()


@pytest.mark.parametrize("fields, why", [
    ({"mm_inputs": object(), "input_ids": array("q", [5_000_000])}, input_guard.MULTIMODAL),
    ({"input_embeds": [[0.0]], "input_ids": array("q", [5_000_000])}, input_guard.EMBEDS),
])
def test_prompt_ids_it_does_not_check_by_design_fall_back_and_pass(kinds, fields, why):
    seen = []
    assert input_guard.check(_req(**fields), VOCAB, kinds, seen.append) is None
    assert len(seen) == 1 and seen[0].startswith(why) and "passed unchanged" in seen[0]


@pytest.mark.parametrize("fields", [
    {"input_ids": [[1, 2], [3]]}, {"input_ids": [1.5, 2.0]},
    {"sampling_params": types.SimpleNamespace(stop_token_ids="7")},
])
def test_shapes_it_does_not_know_are_unchecked(kinds, fields):
    with pytest.raises(input_guard.Unchecked):
        input_guard.check(_req(**fields), VOCAB, kinds)


def test_a_stop_id_that_is_not_an_int_is_rejected(kinds):
    bad = input_guard.check(_req(sampling_params=types.SimpleNamespace(stop_token_ids={1, "x"})), VOCAB, kinds)
    assert bad == ("stop_token_ids", "stop_token_ids contains 'x', not a token id: this engine expects "
                                     "an integer in 0..1023")


def test_shapes_without_ids_or_with_clean_ids_pass_silently(kinds):
    seen = []
    for fields in ({"input_ids": None}, {"input_ids": [1, 2, 3]},
                   {"input_ids": np.arange(VOCAB, dtype=np.int32)}):
        assert input_guard.check(_req(**fields), VOCAB, kinds, seen.append) is None
    assert seen == []


def test_the_view_of_the_engines_array_is_zero_copy_and_finds_the_first_bad_id():
    ids = array("q", [7] * 1_000_000)
    view = input_guard.int64_view(ids)
    ids[999_999] = -5                         # written through the engine's array, seen in the view
    ids[999_998] = VOCAB
    assert view[999_999] == -5
    assert input_guard.first_out_of_range(view, VOCAB) == (999_998, VOCAB, 2)
    assert input_guard.first_out_of_range(view[:999_998], VOCAB) is None


# --- the guard by construction: docs/input_guard_fields.json (bench/input_guard_fields.py) -------

def _field_table():
    import importlib.util
    import json
    import pathlib

    root = pathlib.Path(__file__).resolve().parents[1]
    spec = importlib.util.spec_from_file_location("input_guard_fields", root / "bench" / "input_guard_fields.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench, json.loads((root / "docs" / "input_guard_fields.json").read_text())


def test_the_field_table_measures_every_field_a_client_can_set():
    """An engine whose request structs gain a field fails here until the field is measured."""
    import msgspec
    from sglang.srt.managers.io_struct import TokenizedGenerateReqInput
    from sglang.srt.sampling.sampling_params import SamplingParams

    bench, rows = _field_table()
    declared = ({("request", f.name) for f in msgspec.structs.fields(TokenizedGenerateReqInput)
                 if f.name not in bench.ENGINE_SET}
                | {("sampling_params", f.name) for f in msgspec.structs.fields(SamplingParams)
                   if f.name not in bench.SAMPLING_ENGINE_SET})
    assert {(r["struct"], r["field"]) for r in rows} == declared
    # every bad value its declared type admits was sent
    assert {(r["struct"], r["field"], repr(r["value"])) for r in rows} == \
        {(r["struct"], r["field"], repr(r["value"])) for r in bench.rows()}


# Stock served it here, but the guard refuses it: -5 on a 5-token prompt is served, on a 3-token
# prompt it kills the scheduler (issue 30's body); the engine gives no value below -1 a meaning.
REFUSED_THOUGH_SERVED = {("request", "logprob_start_len", -5)}


def test_the_guard_rejects_every_value_that_killed_stock_and_passes_what_stock_served():
    _, rows = _field_table()
    kinds = input_guard.declared_kinds()
    guarded = {(f.struct, f.name): f for f in input_guard.FIELDS}
    dies = [r for r in rows if r["stock"] == "dies"]
    assert dies, "the table records no death: the measurement did not run"
    for r in dies:
        field = guarded.get((r["struct"], r["field"]))
        assert field is not None, f"{r['field']} kills stock but is not in input_guard.FIELDS"
        assert input_guard.check_field(field, *kinds[(field.struct, field.name)], r["value"], VOCAB), r
    for r in rows:
        if (r["struct"], r["field"]) in guarded and r["stock"] == "200":
            field = guarded[(r["struct"], r["field"])]
            refused = input_guard.check_field(field, *kinds[(field.struct, field.name)], r["value"], VOCAB)
            assert (refused is not None) == ((r["struct"], r["field"], r["value"]) in REFUSED_THOUGH_SERVED), r


# --- issue 41: every field the scheduler, the sampling batch and the model read -----------------

@pytest.mark.parametrize("sampling, reason, text", [
    # the sampling batch's top_ks is int32: 2^31 with temperature > 0 kills stock (T=0 sets top_k 1)
    ({"temperature": 1.0, "top_k": 2**31}, "top_k", r"top_k = 2147483648 is out of range: the "
     r"scheduler stores it in top_ks \(torch.int32\); this engine expects an integer in 1..2147483647"),
    ({"temperature": 0.7, "top_k": 1.5}, "top_k", "is float, not an integer"),
    ({"max_new_tokens": 1.5}, "max_new_tokens", "is float, not an integer"),     # Ollama num_predict
    ({"max_new_tokens": 2, "min_new_tokens": 2.0}, "min_new_tokens", "not an integer"),
    ({"temperature": 1e39}, "temperature", r"a finite number in \[0.0, 3.40282e\+38\] \(as float32\)"),
    ({"top_p": 1e-50}, "top_p", r"\(0.0, 1\]"),                                  # 0 in float32
    ({"repetition_penalty": 1e-50}, "repetition_penalty", r"\(0.0, 2\]"),
    ({"temperature": 1.0, "top_k": 50, "logit_bias": {"5": 1e39}}, "logit_bias",
     r"logit_bias\['5'\] = 1e\+39 is not a finite float32"),
    ({"logit_bias": {"5": "x"}}, "logit_bias", "is not a finite float32"),
    ({"stop": ["x" * 3000, "y" * 1500]}, "stop", r"sampling_params.stop has 4500 characters in 2 "
     r"strings, over this line's limit of 4096 \(DSV41_INPUT_GUARD_MAX_STOP_CHARS\)"),
    ({"stop_regex": "(?<=a)b"}, "stop_regex", r"uses a construct RE2 cannot run in linear time "
     r"\(invalid perl operator: \(\?<=\)"),
    ({"stop_regex": r"(a)\1"}, "stop_regex", "invalid escape sequence"),
])
def test_sampling_fields_are_checked_against_their_tensors_and_the_lines_bounds(
        manager, sampling, reason, text):
    with pytest.raises(ValueError, match=text):
        _tokenize(manager, [5, 6, 7], sampling=dict({"max_new_tokens": 2}, **sampling))
    assert _counts() == {"checked": 1, f"rejected:{reason}": 1}   # n: at the choke point too


@pytest.mark.parametrize("sampling", [
    {"temperature": 1.0, "top_k": 50, "top_p": 0.9, "min_p": 0.05},
    {"temperature": 0.7, "top_k": 2**31 - 1}, {"temperature": 1.0, "top_k": -1},
    {"temperature": 1.0, "logit_bias": {"5": 100.0, "6": -1e30}}, {"n": 1},
    {"stop": ["\n\n", "User:"]}, {"stop_regex": r"(.+)+\x00"},         # RE2 runs it in linear time
    {"repetition_penalty": 1.1, "frequency_penalty": -2, "presence_penalty": 2},
    {"max_new_tokens": 0}, {"max_new_tokens": None},
])
def test_ordinary_sampling_passes_unchanged(manager, sampling):
    out = _tokenize(manager, [5, 6, 7], sampling=dict({"max_new_tokens": 2}, **sampling))
    assert _counts() == {"checked": 1}
    if "top_k" in sampling and sampling["top_k"] > 0:
        assert out.sampling_params.top_k == sampling["top_k"]


@pytest.mark.parametrize("extra, reason, text", [
    ({"session_params": {"id": [1]}}, "sessions", "sessions are off on this line"),
    ({"session_params": {"id": "abc", "offset": 3}}, "sessions", "request with session_params"),
    # prefill-only with a pooling index past the prompt: the logits processor indexes its rows
    ({"token_indices_to_pool": [0, 5], "sampling": {"max_new_tokens": 0}}, "token_indices_to_pool",
     r"token_indices_to_pool contains 5, which is not a position of this request's prompt: valid "
     r"positions are 0..2 \(3 prompt tokens\)"),
    ({"multi_item_delimiter_indices": [-1]}, "multi_item_delimiter_indices", "contains -1"),
    ({"return_logprob": True, "logprob_start_len": 0, "top_logprobs_num": VOCAB,
      "input_ids": list(range(5, 5 + 980))}, "logprob_entries",
     r"asks for 1,003,520 prompt log-prob entries \(\(top_logprobs_num 1024 \+ 0 token_ids_logprob\) "
     r"x 980 prompt positions from logprob_start_len 0\), over this line's limit of 1,000,000 "
     r"\(DSV41_INPUT_GUARD_MAX_LOGPROB_ENTRIES\)"),
])
def test_sessions_index_fields_and_logprob_cost_are_refused(manager, extra, reason, text):
    extra = dict(extra)                     # the parametrize dict is shared by every run of the test
    ids = extra.pop("input_ids", [5, 6, 7])
    with pytest.raises(ValueError, match=text):
        _tokenize(manager, ids, **extra)
    assert _counts() == {"checked": 1, f"rejected:{reason}": 1}


def test_a_huge_n_is_refused_before_the_engine_expands_the_request(manager, monkeypatch):
    from sglang.srt.managers.io_struct import GenerateReqInput

    obj = GenerateReqInput(input_ids=[5, 6], sampling_params={"n": 10**9, "max_new_tokens": 2})
    expanded = []                           # the engine's normalisation (it expands n) is watched
    real = GenerateReqInput.normalize_batch_and_arguments
    monkeypatch.setattr(GenerateReqInput, "normalize_batch_and_arguments",
                        lambda self: expanded.append(self) or real(self))
    with pytest.raises(ValueError, match=r"n = 1000000000 is over this line's limit of 128"):
        manager.generate_request(obj)           # refused on the way in: nothing expanded
    assert expanded == [] and _counts() == {"rejected:n": 1}
    assert obj.rid is None                      # the engine's normalisation never ran
    # under the limit the call goes on to the engine's own generate_request (its async generator,
    # whose first step is the normalisation watched above)
    ok = GenerateReqInput(input_ids=[5, 6], sampling_params={"n": 2, "max_new_tokens": 2})
    agen = manager.generate_request(ok)
    assert inspect.isasyncgen(agen) and agen.ag_code.co_name == "generate_request"
    asyncio.run(agen.aclose())
    assert expanded == [] and _counts() == {"rejected:n": 1}


def test_n_is_checked_at_the_choke_point_too(kinds):
    bad = input_guard.check(_req(sampling_params={"n": 129}), VOCAB, kinds, re2=input_guard.re2_module())
    assert bad == ("n", "sampling_params.n = 129 is over this line's limit of 128 parallel samples "
                        "per request (DSV41_INPUT_GUARD_MAX_N)")


def test_sessions_cannot_be_opened_or_closed(manager):
    from sglang.srt.managers.io_struct import CloseSessionReqInput, OpenSessionReqInput

    with pytest.raises(ValueError, match="sessions are off on this line .* /open_session"):
        asyncio.run(manager.open_session(OpenSessionReqInput(capacity_of_str_len=100)))
    with pytest.raises(ValueError, match="/close_session is refused"):
        asyncio.run(manager.close_session(CloseSessionReqInput(session_id="another-clients")))


def test_the_scheduler_searches_stop_regex_on_re2_in_linear_time(input_guard_installed):  # noqa: F811
    from sglang.srt.managers import schedule_batch

    assert isinstance(schedule_batch.re, input_guard.Re2Search)
    text = "a" * 200_000                 # Python's re backtracks exponentially on this pattern
    import re as python_re

    input_guard.re2_compile.cache_clear()
    cached = input_guard.re2_compile.cache_info().currsize

    def backtracking(*args, **kwargs):
        raise AssertionError("the stop_regex search reached Python's re")

    with pytest.MonkeyPatch.context() as mp:    # the search must not reach Python's re at all
        for name in ("search", "compile", "match", "fullmatch", "finditer", "findall"):
            mp.setattr(python_re, name, backtracking)
        assert schedule_batch.re.search(r"(.+)+\x00", text) is None
    assert input_guard.re2_compile.cache_info().currsize == cached + 1     # compiled by RE2
    assert schedule_batch.re.search(r"b+c", "aabbbc").group(0) == "bbbc"
    with pytest.raises(schedule_batch.re.error):            # the engine's own handler finishes it
        schedule_batch.re.search("(?<=a)b", "ab")


def test_without_re2_stop_regex_is_refused(kinds):
    bad = input_guard.check(_req(sampling_params={"stop_regex": "x"}), VOCAB, kinds, re2=None)
    assert bad == ("stop_regex", "stop_regex is refused on this line: its linear-time regex engine "
                                 "(RE2, the google-re2 package) is not installed")


def test_the_rid_must_be_a_string(kinds):
    bad = input_guard.check(_req(rid=5), VOCAB, kinds, re2=input_guard.re2_module())
    assert bad[0] == "rid" and "not a string" in bad[1]


# --- rids are exact: the engine's Scheduler.abort_request, installed ------------------------------

class _Req:
    def __init__(self, rid):
        self.rid = rid
        self.finished_reason = None
        self.to_finish = None
        self.weight_version_events = []
        self.output_ids = []
        self.kv = types.SimpleNamespace(holds_mamba=False, holds_kv=False)

    def finished(self):
        return self.finished_reason is not None


def _scheduler(waiting, running):
    """The engine's Scheduler class with only what abort_request reads: constructing a real one
    loads a model onto a device and joins process groups (a server boot: tests/e2e), so the
    instance is made with __new__ and the engine's own abort_request runs on it."""
    from sglang.srt.disaggregation.utils import DisaggregationMode
    from sglang.srt.managers.scheduler import Scheduler

    sched = Scheduler.__new__(Scheduler)
    sched.chunked_req = None
    sched.mm_receiver = None
    sched.dllm_config = None
    sched.disaggregation_mode = DisaggregationMode.NULL
    sched.waiting_queue = list(waiting)
    sched.grammar_manager = types.SimpleNamespace(grammar_queue=[], abort_requests=lambda r: None)
    sched.collect_inflight_reqs = lambda: set(running)
    sched.aborted = []
    sched._release_aborted_request = lambda req: None
    sched.beam_coordinator = types.SimpleNamespace(retire_group=lambda req: None)
    sched.send_abort_output = lambda out, req: sched.aborted.append(req.rid)
    return sched


@pytest.mark.parametrize("keys, a_aborted", [({}, True), (KEYS, False)])
def test_an_abort_takes_exactly_its_rid(install_adapters, keys, a_aborted):
    """Client A runs "job-7-long", client B's "job-7" is dropped: stock's prefix match takes A."""
    install_adapters(keys)
    from sglang.srt.managers.io_struct import AbortReq

    a, b, queued_a, queued_b = _Req("job-7-long"), _Req("job-7"), _Req("job-7-x"), _Req("job-7")
    sched = _scheduler([queued_a, queued_b], [a, b])
    from sglang.srt import runtime_context as rc
    from sglang.srt.server_args import ServerArgs

    with rc.use_context(rc.create_context(ServerArgs(model_path="dummy"), role="scheduler")):
        sched.abort_request(AbortReq(rid="job-7"))
    assert (a.to_finish is not None) == a_aborted and b.to_finish is not None
    assert sched.aborted == (["job-7", "job-7-x"] if a_aborted else ["job-7"])     # reversed pops
    assert [r.rid for r in sched.waiting_queue] == ([] if a_aborted else ["job-7-x"])
    assert a.rid == "job-7-long" and queued_a.rid == "job-7-x"      # rids restored


def test_a_second_request_with_an_rid_in_flight_gets_a_400_naming_it(manager):
    from sglang.srt.managers.io_struct import GenerateReqInput

    first = GenerateReqInput(input_ids=[5, 6], rid="job-7", sampling_params={"max_new_tokens": 2})
    first.normalize_batch_and_arguments()
    manager._init_req_state(first)
    second = GenerateReqInput(input_ids=[5, 6], rid="job-7", sampling_params={"max_new_tokens": 2})
    second.normalize_batch_and_arguments()
    with pytest.raises(ValueError, match="Duplicate request ID detected: job-7"):    # the engine's
        manager._init_req_state(second)


# --- a grammar step is time-bounded per request (the engine's XGrammarGrammar, installed) --------

class _SlowMatcher:
    """Stands for xgrammar's GrammarMatcher (a compiled grammar needs the model's tokenizer info
    and xgrammar's compiler; the cost under test is the time its calls take): each call advances
    the test's clock (`clock`, which the guard reads as time.perf_counter) by `seconds`, so a
    step's measured time is planted, not the machine's."""

    def __init__(self, seconds, clock):
        self.seconds = seconds
        self.clock = clock
        self.calls = 0

    def is_terminated(self):
        return False

    def accept_token(self, token):
        self.calls += 1
        self.clock["now"] += self.seconds
        return True

    def fill_next_token_bitmask(self, mask, idx):
        self.calls += 1
        self.clock["now"] += self.seconds


def _grammars(monkeypatch):
    from sglang.srt.constrained.xgrammar_backend import XGrammarGrammar

    clock = {"now": 0.0}
    monkeypatch.setattr(input_guard.time, "perf_counter", lambda: clock["now"])
    fast = XGrammarGrammar(_SlowMatcher(0.0, clock), VOCAB, None, None)
    slow = XGrammarGrammar(_SlowMatcher(0.05, clock), VOCAB, None, None)
    return fast, slow


# TP 4 as the production line lays it out, every width the engine validates consistent with it
# (another test in the same worker may have published a whole ServerArgs: tp_size, the MoE widths);
# dp_rank None: no data-parallel controller (the output streamer reads it).
TP4_ONE_NODE = dict(tp_size=4, attn_tp_size=4, attn_dp_size=1, attn_cp_size=1, moe_tp_size=4,
                    moe_ep_size=1, moe_dp_size=1, pp_size=1, tp_rank=0, attn_tp_rank=0,
                    attn_dp_rank=0, attn_cp_rank=0, dp_rank=None)
ONE_RANK = {**TP4_ONE_NODE, "tp_size": 1, "attn_tp_size": 1, "moe_tp_size": 1}


class _Detokenizer:
    """Stands for the scheduler's ZMQ socket to the detokenizer (another process): records what
    the engine's output streamer sends the client side."""

    def __init__(self):
        self.sent = []

    def send_output(self, output, req=None):
        self.sent.append(output)

    def finishes(self):
        """rid -> the finish reason the client is sent."""
        return {rid: reason for out in self.sent for rid, reason in zip(out.rids, out.finished_reasons)
                if reason is not None}


def _grammar_scheduler(model_path, world=1, group=None):
    """A real Scheduler on CPU pools and cache (the decode-yield sim's build_scheduler) wired as
    Scheduler.__init__ wires its results: the tiny dense model's ModelConfig, then the engine's own
    init_output_streamer and init_batch_result_processor. Stand-ins only for what needs a server:
    the detokenizer socket, the metrics reporter (Prometheus, device timers), the load publisher
    (a PUB socket) and the TP group coordinator (torch.distributed; `group` is the gloo group the
    guard agrees over, None on one rank)."""
    import collections

    from adapter.tools.sims import decode_yield as sim
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.runtime_context import get_server_args
    from sglang.srt.server_args import ServerArgs

    sched = sim.build_scheduler(chunk=2048, req_slots=4, full_tokens=16 * 256, swa_tokens=16 * 256)
    sched.model_config = ModelConfig.from_server_args(ServerArgs(model_path=str(model_path),
                                                                 device="cpu"))
    sched.server_args = get_server_args()
    sched.is_generation, sched.enable_overlap_mlx, sched.enable_fpm = True, False, False
    sched.metrics_collector = sched.draft_worker = sched.model_worker = sched.future_map = None
    sched.max_req_len = 16 * 256
    sched.ipc_channels.send_to_detokenizer = _Detokenizer()
    sched.metrics_reporter = types.SimpleNamespace(
        num_generated_tokens=0, forward_ct_decode=0, report_prefill_stats=lambda **k: None,
        report_decode_stats=lambda *a, **k: None, log_batch_result_stats=lambda *a: None,
        update_device_timer=lambda: None)
    sched.load_snapshot_writer = None
    sched.load_publisher = types.SimpleNamespace(publish_load_stat=lambda *a, **k: None)
    sched.return_health_check_ipcs = collections.deque()
    # the step counters Scheduler.init_load_inquirer starts (process_batch_result feeds them)
    sched.total_prefill_uncached_tokens = 0
    sched._prev_step = sched._prev_prefill_end_ts = sched._pause_started_at = None
    sched._pause_intervals = collections.deque()
    sched.dp_tp_group = types.SimpleNamespace(world_size=world)
    sched.dp_tp_cpu_group = group
    sched.init_output_streamer()
    sched.init_batch_result_processor()
    return sched


def _submit(sched, *grammars):
    """A real Req per grammar (a 300-token prompt, 64 new tokens at most), queued for prefill."""
    from adapter.tools.sims import decode_yield as sim

    reqs = []
    for i, grammar in enumerate(grammars):
        req = sim.make_req(f"g{i}", 300, max_new_tokens=64, salt=i + 1)
        req.grammar = grammar
        sched.waiting_queue.append(req)
        reqs.append(req)
    return reqs


def _step(sched, token=5):
    """One turn of the engine's event loop without the model: the real get_next_batch_to_run,
    what run_batch stamps on the batch, a result with `token` sampled per row (the forward's
    output), and the real process_batch_result (prefill or decode result processing)."""
    import time

    import torch
    from sglang.srt.managers.utils import GenerationBatchResult

    plan = sched.get_next_batch_to_run(sched.running_batch, sched.last_batch)
    sched.running_batch = plan.running_batch
    batch = plan.batch_to_run
    if batch is not None:
        batch.forward_iter, batch.launch_ts = sched.forward_ct, time.monotonic()
        sched.forward_ct += 1
        result = GenerationBatchResult(logits_output=None, can_run_cuda_graph=False,
                                       next_token_ids=torch.tensor([token] * len(batch.reqs)))
        sched.process_batch_result(batch, result)
    sched.last_batch = batch
    return batch


def _bound_message(took, ranks):
    return (f"dsv41 input_guard: this request's grammar exceeded the per-step bound of 20 ms "
            f"(DSV41_INPUT_GUARD_GRAMMAR_STEP_MS): one decode step of it took {took} ms ({ranks}); "
            "the request is finished")


def test_a_grammar_step_over_the_bound_finishes_only_its_request(install_adapters, monkeypatch,
                                                                 dense_model, caplog):
    """One rank runs each request's grammar: a step over the bound (the prefill's token, 50 ms)
    marks that request after the batch's result; the next decode step's accept_token finishes it
    through the engine's grammar error path, the client is sent a 400 naming the bound, and the
    other request goes on."""
    import logging

    from sglang.srt.runtime_context import get_parallel

    install_adapters({**KEYS, "DSV41_INPUT_GUARD_GRAMMAR_STEP_MS": "20"})
    fast, slow = _grammars(monkeypatch)
    sched = _grammar_scheduler(dense_model)
    fast_req, slow_req = _submit(sched, fast, slow)
    with get_parallel().override(**ONE_RANK), caplog.at_level(logging.INFO, logger="sglang.dsv41"):
        assert _step(sched).forward_mode.is_extend()        # prefill: one token each, timed
        assert slow_req.to_finish is None and slow.accepted_tokens == [5]
        calls = slow.matcher.calls
        assert _step(sched).forward_mode.is_decode()        # marked: accept_token finishes it
        finish = slow_req.to_finish
        assert (finish.status_code, finish.err_type) == (400, "BadRequestError")
        assert finish.message.startswith(_bound_message(50, "this rank's"))
        _step(sched)                                        # the engine finishes and streams it
        assert [r.rid for r in _step(sched).reqs] == ["g0"]  # and drops it from the next batch
    assert slow_req.finished() and slow.matcher.calls == calls      # no more grammar work for it
    sent = sched.ipc_channels.send_to_detokenizer.finishes()
    assert list(sent) == ["g1"] and sent["g1"]["status_code"] == 400
    assert sent["g1"]["message"].startswith(_bound_message(50, "this rank's"))
    assert not fast_req.finished() and fast.accepted_tokens == [5] * 4    # the other goes on
    logged = [r.getMessage() for r in caplog.records if "input_guard finished a request" in r.getMessage()]
    assert logged == ["[dsv41] input_guard finished a request whose grammar took 50 ms in one decode step "
                      "(this rank's), over 20 ms (logged once)"]


@pytest.mark.parametrize("keys", [
    {**KEYS, "DSV41_INPUT_GUARD_GRAMMAR_STEP_MS": "60"},    # the bound above the step time
    {},                                                     # the stock engine: guard not installed
], ids=["within_the_bound", "without_the_guard"])
def test_a_slow_grammar_runs_on_within_the_bound_and_without_the_guard(install_adapters, monkeypatch,
                                                                       dense_model, keys):
    """The controls of the bound: the same 50 ms grammar runs every step with the bound above its
    step time, and on the stock engine (the negative control: the finish above is the guard's)."""
    from sglang.srt.runtime_context import get_parallel

    assert (install_adapters(keys)["input_guard"].status == "installed") == bool(keys)
    _, slow = _grammars(monkeypatch)
    sched = _grammar_scheduler(dense_model)
    (req,) = _submit(sched, slow)
    with get_parallel().override(**ONE_RANK):
        for _ in range(4):
            _step(sched)
    assert req.to_finish is None and not req.finished() and slow.accepted_tokens == [5] * 4
    assert sched.ipc_channels.send_to_detokenizer.finishes() == {}


def test_the_verdict_is_the_groups_max_not_this_ranks(install_adapters, monkeypatch, dense_model):
    """TP 4 (the production line): this rank's grammar steps are fast, the group's MAX (another
    rank's clock) is over the bound: this rank finishes the request too, at the same step."""
    from sglang.srt.runtime_context import get_parallel

    install_adapters({**KEYS, "DSV41_INPUT_GUARD_GRAMMAR_STEP_MS": "20"})
    fast, _ = _grammars(monkeypatch)
    seen = []

    def group_max(values, group):                          # the all-reduce: another rank's 90 ms
        seen.append(list(values))
        return [max(v, 90_000) for v in values]

    monkeypatch.setattr(input_guard, "all_reduce_max", group_max)
    monkeypatch.setattr(input_guard.agreed_step_us, "__defaults__", (group_max,))
    sched = _grammar_scheduler(dense_model, world=4, group="the gloo group")
    (req,) = _submit(sched, fast)
    with get_parallel().override(**TP4_ONE_NODE):
        _step(sched)
        _step(sched)
    assert seen and seen[0] == [0]                         # this rank's own: 0 ms
    assert req.to_finish.status_code == 400
    assert req.to_finish.message.startswith(_bound_message(90, "the slowest of 4 TP ranks"))


def test_the_grammar_step_bound_stays_off_beside_context_or_pipeline_parallel_ranks(
        install_adapters, monkeypatch, caplog, dense_model):
    """PP 2: the later stage's ranks follow the first stage's grammar by another path; the bound
    stays off (one fallback line says why) and the slow request is not finished."""
    from sglang.srt.runtime_context import get_parallel

    install_adapters({**KEYS, "DSV41_INPUT_GUARD_GRAMMAR_STEP_MS": "20"})
    _, slow = _grammars(monkeypatch)
    sched = _grammar_scheduler(dense_model)
    (req,) = _submit(sched, slow)
    with get_parallel().override(**{**TP4_ONE_NODE, "tp_size": 2, "attn_tp_size": 2, "moe_tp_size": 2,
                                    "pp_size": 2}):
        for _ in range(3):
            _step(sched)
    assert req.to_finish is None and not req.finished() and slow.accepted_tokens == [5, 5, 5]
    assert ("input_guard fallback: grammar step bound off: 2 context- / pipeline-parallel ranks "
            "(attention CP x PP) run each request's grammar") in caplog.text


# --- every route of the engine's HTTP app: the request routes pass the one check ------------------

CHAT = [{"role": "user", "content": "hi"}]
# A valid body per request route the dense CPU model serves (the embedding, scoring-decision,
# transcription and responses routes: see ROUTE_NOT_DRIVEN).
ROUTE_BODIES = {
    "/generate": {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 4}},
    "/v1/completions": {"model": "m", "prompt": "hello", "max_tokens": 4},
    "/v1/chat/completions": {"model": "m", "messages": CHAT, "max_tokens": 4},
    "/invocations": {"model": "m", "messages": CHAT, "max_tokens": 4},
    "/v1/messages": {"model": "m", "max_tokens": 4, "messages": CHAT},
    "/api/generate": {"model": "m", "prompt": "hi", "stream": False},
    "/api/chat": {"model": "m", "messages": CHAT, "stream": False},
    "/vertex_generate": {"instances": [{"text": "hello"}],
                         "parameters": {"sampling_params": {"max_new_tokens": 4}}},
    "/v1/score": {"query": "a", "items": ["b"], "label_token_ids": [5, 6]},
}
# The same routes with sampling on and top_k past the sampling batch's int32 (stock dies).
SAMPLING_BAD = {
    "/generate": {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 4, "temperature": 1.0,
                                                                "top_k": 2**31}},
    "/v1/completions": {"model": "m", "prompt": "hello", "max_tokens": 4, "temperature": 1.0,
                        "top_k": 2**31},
    "/v1/chat/completions": {"model": "m", "messages": CHAT, "max_tokens": 4, "temperature": 1.0,
                             "top_k": 2**31},
    "/invocations": {"model": "m", "messages": CHAT, "max_tokens": 4, "temperature": 1.0,
                     "top_k": 2**31},
    "/v1/messages": {"model": "m", "max_tokens": 4, "messages": CHAT, "temperature": 1.0,
                     "top_k": 2**31},
    "/api/generate": {"model": "m", "prompt": "hi", "stream": False,
                      "options": {"temperature": 1.0, "top_k": 2**31}},
    "/api/chat": {"model": "m", "messages": CHAT, "stream": False,
                  "options": {"num_predict": 1.5}},       # a float where the engine expects an int
    "/vertex_generate": {"instances": [{"text": "hello"}], "parameters": {"sampling_params": {
        "max_new_tokens": 4, "temperature": 1.0, "top_k": 2**31}}},
}
ROUTE_NOT_DRIVEN = {
    "/encode": "embedding models only (--is-embedding)", "/classify": "embedding models only",
    "/v1/embeddings": "embedding models only", "/v1/classify": "embedding models only",
    "/v1/rerank": "embedding / cross-encoder models only",
    "/v1/decisions": "schema-decision checkpoints only", "/v1/systemone": "schema-decision checkpoints only",
    "/v1/audio/transcriptions": "speech models only", "/v1/realtime": "speech models only (websocket)",
    "/v1/responses": "its handler needs the harmony vocabulary (a download): not set up on CPU",
    "/health": "the engine's own fixed probe", "/health_generate": "the engine's own fixed probe",
}


class _Dispatched(Exception):
    status_code = 599      # the routes that catch it answer with it: recognisably ours


@pytest.fixture
def app_client(input_guard_installed, dense_model):  # noqa: F811
    """The engine's HTTP app with its lifespan run (its serving handlers built) over the engine's
    real TokenizerManager, built for this test, with the guard installed (the module's install,
    reset as a fresh one); what would go to the scheduler is recorded at `_dispatch_to_scheduler`
    and the request stopped there."""
    from sglang.srt import runtime_context as rc
    from sglang.srt.entrypoints import http_server as hs
    from sglang.srt.parser.template_manager import TemplateManager
    from starlette.testclient import TestClient

    args, build = _real_manager(dense_model)
    sent = []
    with rc.use_context(rc.create_context(args, role="tokenizer")):
        tm = build()
        tm.tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"

        def dispatch(obj):
            sent.append(obj)
            raise _Dispatched("dispatched")

        tm._dispatch_to_scheduler = dispatch
        templates = TemplateManager()
        templates.initialize_templates(tokenizer_manager=tm, model_path=str(dense_model),
                                       chat_template=None, completion_template=None)
        saved = hs.get_global_state()
        hs.set_global_state(hs._GlobalState(tokenizer_manager=tm, template_manager=templates,
                                            scheduler_info={}))
        hs.app.is_single_tokenizer_mode = True
        hs.app.server_args = args
        hs.app.warmup_thread_kwargs = dict(server_args=args, execute_warmup_func=lambda a: False)
        middleware = list(hs.app.user_middleware)
        hs.app.middleware_stack = None
        try:
            with TestClient(hs.app, raise_server_exceptions=False) as client:
                yield client, sent
        finally:
            close_zmq_sockets(tm)
            hs.set_global_state(saved)
            hs.app.user_middleware[:] = middleware      # what the lifespan added (metrics off: none)
            hs.app.middleware_stack = None              # built again by the next test's app


def test_every_route_of_the_app_is_classified():
    from adapter import admin_guard
    from sglang.srt.entrypoints.http_server import app

    admin = {r.path for r in admin_guard.admin_routes(app)}
    served = {e.path for e in admin_guard.route_entries(app)}
    assert "/scale_elastic_ep" in admin           # an included router's: walked
    unclassified = served - admin - set(input_guard.ROUTES)
    assert not unclassified, f"classify these routes in input_guard.ROUTES: {sorted(unclassified)}"
    requests = {p for p, kind in input_guard.ROUTES.items() if kind.startswith("request")}
    assert requests == set(ROUTE_BODIES) | set(ROUTE_NOT_DRIVEN)
    assert not requests & admin and requests <= served


def test_every_request_route_reaches_the_scheduler_only_through_the_check(app_client):
    client, sent = app_client
    for path, body in ROUTE_BODIES.items():
        before, checked = len(sent), receipts.counters["input_guard"]["checked"]
        resp = client.post(path, json=body)
        assert len(sent) == before + 1, (path, resp.status_code, resp.text[:300])
        assert receipts.counters["input_guard"]["checked"] == checked + 1, path
        assert type(sent[-1]).__name__ == "TokenizedGenerateReqInput", path
    for path, body in SAMPLING_BAD.items():
        before = len(sent)
        resp = client.post(path, json=body)
        assert resp.status_code == 400, (path, resp.status_code, resp.text[:300])
        assert len(sent) == before, path                        # nothing reached the scheduler
    rejected = {k: v for k, v in receipts.counters["input_guard"].items() if k.startswith("rejected")}
    assert rejected == {"rejected:top_k": len(SAMPLING_BAD) - 1, "rejected:max_new_tokens": 1}


def test_session_routes_are_refused_through_the_app(app_client):
    client, sent = app_client
    resp = client.post("/open_session", json={"capacity_of_str_len": 100})
    assert resp.status_code == 400 and "sessions are off on this line" in resp.text
    resp = client.post("/close_session", json={"session_id": "another-clients"})
    assert resp.status_code == 400 and "/close_session is refused" in resp.text
    resp = client.post("/generate", json={"input_ids": [5, 6], "session_params": {"id": [1]}})
    assert resp.status_code == 400 and "sessions are off" in resp.text
    assert sent == []


def test_with_sampling_on_every_value_that_killed_stock_the_guard_answers_400(app_client):
    """docs/input_guard_fields_top_k.json records the field table's rows sent with temperature 1
    and top_k 50 (bench/input_guard_fields.py --sampling top_k) to stock and to the production
    line. Each row that killed stock is sent again here, the same body the bench sent
    (`on_route`), through the engine's HTTP app and real TokenizerManager with the guard
    installed: 400, nothing sent to the scheduler. (The recorded production column says the same
    of a real server; this runs the guard on the rows.)"""
    import json
    import pathlib

    client, sent = app_client
    bench, _ = _field_table()
    rows = json.loads((pathlib.Path(__file__).resolve().parents[1] / "docs" /
                       "input_guard_fields_top_k.json").read_text())
    dies = [r for r in rows if r["stock"] == "dies"]
    assert dies, "the table records no death: the measurement did not run"
    bodies = {(r["struct"], r["field"], repr(r["value"])): r["body"] for r in bench.rows()}
    for r in dies:
        body = bench.on_route(bodies[(r["struct"], r["field"], repr(r["value"]))], "/generate",
                              "top_k", r)
        resp = client.post("/generate", json=body)
        assert resp.status_code == 400 and r["field"] in resp.text, (r, resp.status_code, resp.text)
        assert sent == [], r
    assert not [r for r in rows if r["production"] == "dies"]


# --- the grammar verdict over a real gloo group of two processes ---------------------------------

# runs after conftest.TWO_RANKS_PREAMBLE (rank, mode, out, dist, tests/ on the path)
GRAMMAR_CHILD = r"""
from adapter.cpu import cpu_engine, models
cpu_engine.install_torchvision_shim()
from adapter import input_guard, installer
from sglang.srt.constrained.xgrammar_backend import XGrammarGrammar
from sglang.srt.runtime_context import get_parallel
import test_input_guard as t

installer.set_mode("report")
state = installer.install_in_process({"DSV41_INPUT_GUARD": "1",
                                      "DSV41_INPUT_GUARD_GRAMMAR_STEP_MS": "20"})["input_guard"]
assert state.status == "installed", state.detail
clock = {"now": 0.0}
input_guard.time.perf_counter = lambda: clock["now"]
# the same request on both ranks; its grammar calls take 50 ms on rank 0's clock, 1 ms on rank 1's
grammar = XGrammarGrammar(t._SlowMatcher(0.05 if rank == 0 else 0.001, clock), t.VOCAB, None, None)
if mode == "local":                    # the agreement replaced by each rank's own reading
    input_guard.agreed_step_us.__defaults__ = (lambda values, group: values,)
sched = t._grammar_scheduler(models.ensure_model("dense"), world=2,
                             group=dist.new_group([0, 1], backend="gloo"))
(req,) = t._submit(sched, grammar)
steps = []
with get_parallel().override(**{**t.TP4_ONE_NODE, "tp_size": 2, "attn_tp_size": 2, "moe_tp_size": 2}):
    for step in range(3):              # the prefill, then two decode steps
        t._step(sched)
        steps.append(None if req.to_finish is None else req.to_finish.status_code)
json.dump({"finished_at": steps, "message": req.to_finish and req.to_finish.message,
           "accepted": grammar.accepted_tokens, "finished": req.finished()}, open(out, "w"))
dist.destroy_process_group()
"""


# GRAMMAR_CHILD's imports, once per rank (conftest.run_two_ranks_modes forks a child per mode)
GRAMMAR_PRELOAD = """
import sys
sys.path.insert(0, "tests")
from adapter.cpu import cpu_engine, models
cpu_engine.install_torchvision_shim()
from adapter import input_guard, installer
from sglang.srt.constrained.xgrammar_backend import XGrammarGrammar
import test_input_guard
"""


@pytest.fixture(scope="module")
def grammar_ranks(tmp_path_factory):
    """{mode: [rank 0's JSON, rank 1's JSON]} for the agreed run and its control, run once."""
    return run_two_ranks_modes(GRAMMAR_CHILD, tmp_path_factory.mktemp("grammar-ranks"),
                               ["agree", "local"], GRAMMAR_PRELOAD)


def test_both_ranks_finish_the_grammar_request_at_the_same_step(grammar_ranks):
    """Rank 0's clock reads 50 ms a call, rank 1's 1 ms (limit 20): agreed, both finish the request
    at the first decode step (its prefill's grammar step marked it), with the same message."""
    r0, r1 = grammar_ranks["agree"]
    assert r0["finished_at"] == r1["finished_at"] == [None, 400, 400], (r0, r1)
    assert r0["message"] == r1["message"] and "(the slowest of 2 TP ranks)" in r0["message"]
    assert r0["accepted"] == r1["accepted"] == [5] and r0["finished"] and r1["finished"]


def test_without_the_agreement_the_ranks_split(grammar_ranks):
    """The control of the one above: each rank's own reading finishes the request on rank 0 only;
    the two ranks' batches would differ from there on."""
    r0, r1 = grammar_ranks["local"]
    assert r0["finished_at"] == [None, 400, 400] and r1["finished_at"] == [None, None, None], (r0, r1)
    assert r0["finished"] and not r1["finished"] and r1["accepted"] == [5, 5, 5]
