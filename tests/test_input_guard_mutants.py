"""input_guard's checks: tests added for the mutation check's survivors (bench/mutation.py
input_guard; docs/testing.md lists each survivor left and why).

The checks on their own, on the engine's real request structs (TokenizedGenerateReqInput,
TokenizedEmbeddingReqInput, SamplingParams, built by tests/test_input_guard.py's `_req`), at the
edges of each range: the first value in and the first value out, and the message the client gets."""
import types
import typing
from array import array

import numpy as np
import pytest

from adapter import input_guard as ig
from adapter.input_guard import rules
from test_input_guard import VOCAB, _req

F32 = ig.FLOAT32_MAX
FIELD = {f.name: f for f in ig.FIELDS}
NUMBER = {n.name: n for n in ig.SAMPLING_NUMBERS}


@pytest.fixture(scope="module")
def kinds():
    return ig.declared_kinds()


# --- prompt ids -------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [np.int64, np.int32])
def test_first_out_of_range_at_the_vocabulary_edge(dtype):
    a = np.array([0, VOCAB - 1], dtype)
    assert ig.first_out_of_range(a, VOCAB) is None
    assert ig.first_out_of_range(np.zeros(0, dtype), VOCAB) is None
    assert ig.first_out_of_range(np.array([3, VOCAB, -1, VOCAB - 1], dtype), VOCAB) == (1, VOCAB, 2)
    assert ig.first_out_of_range(np.array([3, -1], dtype), VOCAB) == (1, -1, 1)


@pytest.mark.parametrize("ids", [array("q", [5, VOCAB, 6, -2]), array("i", [5, VOCAB, 6, -2]),
                                 [5, VOCAB, 6, -2], np.array([5, VOCAB, 6, -2], np.int32)])
def test_check_ids_names_the_first_bad_id_and_how_many(ids):
    seen = []
    assert ig.check_ids(_req(input_ids=ids), VOCAB, seen.append) == (
        f"input_ids[1] = {VOCAB} is not a token id of this model: valid ids are 0..{VOCAB - 1} "
        f"(vocabulary size {VOCAB}) (2 of the 4 prompt ids are out of range)")
    assert seen == []


@pytest.mark.parametrize("ids", [array("q", [0, VOCAB - 1]), array("i", [VOCAB - 1]), [0, VOCAB - 1]])
def test_check_ids_passes_the_last_id_of_the_vocabulary(ids):
    assert ig.check_ids(_req(input_ids=ids), VOCAB, None) is None


def test_check_ids_one_bad_id_says_no_count():
    assert ig.check_ids(_req(input_ids=array("q", [VOCAB])), VOCAB, None) == (
        f"input_ids[0] = {VOCAB} is not a token id of this model: valid ids are 0..{VOCAB - 1} "
        f"(vocabulary size {VOCAB})")


def test_an_empty_prompt_is_refused_for_generation_only():
    from sglang.srt.managers.io_struct import TokenizedEmbeddingReqInput

    assert ig.check_ids(_req(input_ids=array("q")), VOCAB, None) == (
        "the prompt has no tokens (its text tokenizes to nothing): this engine needs at least one "
        "prompt token")
    assert ig.check_ids(_req(input_ids=[]), VOCAB, None).startswith("the prompt has no tokens")
    emb = TokenizedEmbeddingReqInput(input_text="", input_ids=array("q"), mm_inputs=None,
                                     token_type_ids=None, sampling_params=_req().sampling_params)
    assert ig.check_ids(emb, VOCAB, None) is None


def test_prompt_ids_of_an_unknown_shape_are_unchecked_naming_it():
    for ids, shape in (([[1, 2], [3]], "list"), (np.zeros((2, 2), np.int64), "ndarray")):
        with pytest.raises(ig.Unchecked) as err:
            ig.check_ids(_req(input_ids=ids), VOCAB, None)
        assert str(err.value) == f"prompt ids are not a flat integer sequence ({shape})"


def test_multimodal_and_embeds_fall_back_each_with_its_own_reason():
    seen = []
    assert ig.check_ids(_req(mm_inputs=object(), input_ids=[VOCAB]), VOCAB, seen.append) is None
    assert ig.check_ids(_req(input_embeds=[[0.0]], input_ids=[VOCAB]), VOCAB, seen.append) is None
    assert seen == [ig.MULTIMODAL, ig.EMBEDS]


# --- the engine's declared types ---------------------------------------------------------------

class _Engine:
    pass


@pytest.mark.parametrize("declared, want", [
    (int, ("int", False)), (typing.Optional[int], ("int", True)),
    (str, ("str", False)), (typing.Optional[str], ("str", True)),
    (typing.List[int], ("ids", False)), (typing.Optional[typing.Set[int]], ("ids", True)),
    (frozenset[int], ("ids", False)), (list[int], ("ids", False)),
    (_Engine, (_Engine, False)), (typing.Optional[_Engine], (_Engine, True)),
])
def test_kind_of_each_declared_type(declared, want):
    assert ig.kind_of(declared) == want


@pytest.mark.parametrize("declared", [typing.List[str], list[str], typing.Union[int, str],
                                      typing.Optional[typing.Union[int, str]], typing.Tuple[int],
                                      typing.Dict[int, int], typing.TypeVar("T"), "int", float])
def test_kind_of_a_type_it_does_not_know_is_unchecked(declared):
    if declared is float:       # a class: its instances are what the engine expects
        assert ig.kind_of(float) == (float, False)
        return
    with pytest.raises(ig.Unchecked, match="engine type"):
        ig.kind_of(declared)


def test_bounds_of_each_high():
    assert ig._bounds(FIELD["stop_token_ids"], 10) == (0, 9)
    assert ig._bounds(FIELD["top_logprobs_num"], 10) == (None, 10)
    assert ig._bounds(FIELD["logprob_start_len"], 10) == (-1, None)


# --- check_field ---------------------------------------------------------------------------------

def _field(name, value, kinds):
    f = FIELD[name]
    return ig.check_field(f, *kinds[(f.struct, f.name)], value, VOCAB)


def test_check_field_int_ranges_at_their_edges(kinds):
    assert _field("logprob_start_len", -1, kinds) is None
    assert _field("logprob_start_len", 10**9, kinds) is None
    assert _field("logprob_start_len", -2, kinds) == (
        "logprob_start_len = -2 is out of range: this engine expects an integer >= -1")
    assert _field("top_logprobs_num", VOCAB, kinds) is None
    assert _field("top_logprobs_num", -10**9, kinds) is None
    assert _field("top_logprobs_num", VOCAB + 1, kinds) == (
        f"top_logprobs_num = {VOCAB + 1} is out of range: this engine expects an integer <= {VOCAB} "
        f"(vocabulary size {VOCAB})")
    assert _field("top_logprobs_num", np.int64(3), kinds) is None


def test_check_field_wrong_shapes_name_the_shape(kinds):
    assert _field("top_logprobs_num", (3,), kinds) == (
        f"top_logprobs_num = (3,) is a list, not an integer: this engine expects an integer <= "
        f"{VOCAB} per request (a list is only the batch form, one value per prompt)")
    assert _field("logprob_start_len", "0", kinds) == (
        "logprob_start_len = '0' is str, not an integer: this engine expects an integer >= -1 per "
        "request (a list is only the batch form, one value per prompt)")
    assert _field("top_logprobs_num", None, kinds) == (
        "top_logprobs_num is missing: this engine expects int")
    assert _field("lora_id", None, kinds) is None and _field("lora_id", "a", kinds) is None
    assert _field("lora_id", ["a"], kinds) == (
        "lora_id = ['a'] is a list, not a string: this engine expects one string per request (a "
        "list is only the batch form, one value per prompt)")
    assert _field("lora_id", 5, kinds).startswith("lora_id = 5 is int, not a string")


def test_check_field_an_engine_class(kinds):
    from sglang.srt.managers.embed_types import PositionalEmbeds

    f = FIELD["positional_embed_overrides"]
    kind, optional = kinds[(f.struct, f.name)]
    assert kind is PositionalEmbeds and optional
    import torch

    assert ig.check_field(f, kind, optional, PositionalEmbeds(torch.zeros(1, 4), [0]), VOCAB) is None
    assert ig.check_field(f, kind, optional, "x" * 50, VOCAB) == (
        "positional_embed_overrides = 'xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx... is not a "
        "PositionalEmbeds: this field is set by the engine's own API, not by an HTTP client")


def test_check_field_ids_at_their_edges(kinds):
    assert _field("stop_token_ids", {0, VOCAB - 1}, kinds) is None
    assert _field("stop_token_ids", [], kinds) is None
    assert _field("stop_token_ids", frozenset({VOCAB}), kinds) == (
        f"stop_token_ids contains {VOCAB}, which is not a token id of this model: valid ids are "
        f"0..{VOCAB - 1} (vocabulary size {VOCAB})")
    assert _field("stop_token_ids", (5, -1, VOCAB), kinds).startswith("stop_token_ids contains -1,")
    assert _field("stop_token_ids", {0, VOCAB}, kinds).startswith(f"stop_token_ids contains {VOCAB},")
    assert _field("stop_token_ids", [1, 2.0], kinds) == (
        f"stop_token_ids contains 2.0, not a token id: this engine expects an integer in "
        f"0..{VOCAB - 1}")
    with pytest.raises(ig.Unchecked, match="stop_token_ids is a int"):
        _field("stop_token_ids", 7, kinds)


def test_an_ids_field_without_a_high_bound_checks_the_low_one():
    f = ig.Field("sampling_params", "ids", 0, None, "")
    assert ig.check_field(f, "ids", False, [0, 10**12], VOCAB) is None
    assert ig.check_field(f, "ids", False, [3, -1], VOCAB) == (
        f"ids contains -1, which is not a token id of this model: valid ids are 0..None "
        f"(vocabulary size {VOCAB})")
    g = ig.Field("request", "n", 1, None, "")
    assert ig.check_field(g, "int", False, 0, VOCAB) == "n = 0 is out of range: this engine expects an integer >= 1"
    h = ig.Field("request", "m", 1, "vocab", "")
    assert ig.check_field(h, "int", False, VOCAB, VOCAB) == (
        f"m = {VOCAB} is out of range: this engine expects an integer in 1..{VOCAB - 1} (vocabulary "
        f"size {VOCAB})")


# --- sampling numbers ----------------------------------------------------------------------------

LIMITS = ig.Limits(n=4, logprob_entries=10, stop_chars=5, grammar_step_ms=100)


@pytest.mark.parametrize("name, ok, bad", [
    ("max_new_tokens", [0, ig.INT32_MAX, None, True], [-1, ig.INT32_MAX + 1]),
    ("min_new_tokens", [0, ig.INT32_MAX], [-1, ig.INT32_MAX + 1]),
    ("top_k", [1, ig.INT32_MAX, np.int32(5)], [0, ig.INT32_MAX + 1]),
    ("beam_width", [1, None], [0, ig.INT32_MAX + 1]),
    ("n", [1, 4], [0]),
    ("temperature", [0.0, 0, F32, 2], [-1e-30, 3.5e38, float("inf"), float("nan"), -float("inf")]),
    ("top_p", [1e-7, 1.0, np.float32(0.5)], [0.0, 1e-50, 1.0000001, 2]),
    ("min_p", [0.0, 1.0], [-0.1, 1.1]),
    ("frequency_penalty", [-2.0, 2, 0], [-2.1, 2.1]),
    ("presence_penalty", [-2, 2.0], [-2.0001, 2.0001]),
    ("repetition_penalty", [1e-7, 2.0], [0.0, 1e-50, 2.1]),
])
def test_each_sampling_number_at_its_edges(name, ok, bad):
    num = NUMBER[name]
    for v in ok:
        assert ig.check_number(num, v, LIMITS) is None, v
    for v in bad:
        message = ig.check_number(num, v, LIMITS)
        assert message and message.startswith(f"sampling_params.{name} = "), v


def test_sampling_number_messages():
    assert ig.check_number(NUMBER["top_k"], 0, LIMITS) == (
        "sampling_params.top_k = 0 is out of range: the scheduler stores it in top_ks (torch.int32); "
        "this engine expects an integer in 1..2147483647")
    assert ig.check_number(NUMBER["n"], 5, LIMITS) == (
        "sampling_params.n = 5 is over this line's limit of 4 parallel samples per request "
        "(DSV41_INPUT_GUARD_MAX_N)")
    assert ig.check_number(NUMBER["n"], 0, LIMITS) == (
        "sampling_params.n = 0 is out of range: the scheduler stores it in parallel samples; this "
        "engine expects an integer in 1..4")
    assert ig.check_number(NUMBER["top_k"], [5], LIMITS) == (
        "sampling_params.top_k = [5] is a list, not an integer: the scheduler stores it in top_ks "
        "(torch.int32)")
    assert ig.check_number(NUMBER["top_k"], None, LIMITS) == (
        "sampling_params.top_k is missing: this engine expects a number")
    assert ig.check_number(NUMBER["temperature"], {"a": 1}, LIMITS) == (
        "sampling_params.temperature = {'a': 1} is an object, not a number: the sampling batch "
        "stores it in temperatures (torch.float32)")
    assert ig.check_number(NUMBER["temperature"], "1", LIMITS).startswith(
        "sampling_params.temperature = '1' is str, not a number")
    assert ig.check_number(NUMBER["top_p"], 0.0, LIMITS) == (
        "sampling_params.top_p = 0.0 is out of range: the sampling batch stores it in top_ps "
        "(torch.float32); this engine expects a finite number in (0.0, 1] (as float32)")
    assert ig.check_number(NUMBER["min_p"], 2, LIMITS) == (
        "sampling_params.min_p = 2 is out of range: the sampling batch stores it in min_ps "
        "(torch.float32); this engine expects a finite number in [0.0, 1] (as float32)")


def test_logit_bias_keys_and_values_at_their_edges():
    assert ig.check_logit_bias(None, VOCAB) is None
    assert ig.check_logit_bias({"0": F32, str(VOCAB - 1): -F32, 5: 1}, VOCAB) is None
    assert ig.check_logit_bias([1], VOCAB) == (
        "sampling_params.logit_bias = [1] is a list: this engine expects an object of token id -> bias")
    assert ig.check_logit_bias({"x": 1.0}, VOCAB) == (
        "sampling_params.logit_bias has the key 'x', which is not a token id")
    assert ig.check_logit_bias({None: 1.0}, VOCAB) == (
        "sampling_params.logit_bias has the key None, which is not a token id")
    for key in ("-1", str(VOCAB)):
        assert ig.check_logit_bias({key: 1.0}, VOCAB) == (
            f"sampling_params.logit_bias has the key '{key}', which is not a token id of this model: "
            f"valid ids are 0..{VOCAB - 1}")
    for value in (float("nan"), float("inf"), 3.5e38, -3.5e38, "1", None):
        assert ig.check_logit_bias({"5": value}, VOCAB).startswith(
            f"sampling_params.logit_bias['5'] = {value!r} is not a finite float32"), value
    assert ig.check_logit_bias({"5": 1e39}, VOCAB) == (
        "sampling_params.logit_bias['5'] = 1e+39 is not a finite float32: the sampling batch adds it "
        "to the logits in float32 (an overflow is inf, then NaN in the sampler); this engine expects "
        f"a number in [-{F32:g}, {F32:g}]")


# --- stops and grammars ----------------------------------------------------------------------

def _sp(**kw):
    return types.SimpleNamespace(**{"stop_strs": None, "stop_regex_strs": None, **kw})


def test_stop_strings_at_the_lines_limit():
    assert ig.check_stops(_sp(), LIMITS, None) is None
    assert ig.check_stops(_sp(stop_strs="abcde"), LIMITS, None) is None
    assert ig.check_stops(_sp(stop_strs=["ab", "cde"]), LIMITS, None) is None
    assert ig.check_stops(_sp(stop_strs=("ab", "cdef")), LIMITS, None) == ("stop", (
        "sampling_params.stop has 6 characters in 2 strings, over this line's limit of 5 "
        "(DSV41_INPUT_GUARD_MAX_STOP_CHARS): the scheduler matches every stop string against the "
        "output at every step"))
    assert ig.check_stops(_sp(stop_strs="abcdef"), LIMITS, None)[1].startswith(
        "sampling_params.stop has 6 characters in 1 strings")
    assert ig.check_stops(_sp(stop_strs=["a", 5]), LIMITS, None) == (
        "stop", "sampling_params.stop = ['a', 5]: this engine expects strings")
    assert ig.check_stops(_sp(stop_strs={"a"}), LIMITS, None) == (
        "stop", "sampling_params.stop = {'a'}: this engine expects strings")


def test_stop_regex_without_re2_or_with_a_construct_it_cannot_run():
    re2 = ig.re2_module()
    assert re2 is not None
    assert ig.check_stops(_sp(stop_regex_strs=[]), LIMITS, None) is None
    assert ig.check_stops(_sp(stop_regex_strs="a+"), LIMITS, re2) is None
    assert ig.check_stops(_sp(stop_regex_strs=["a+", "b"]), LIMITS, None) == ("stop_regex", (
        "stop_regex is refused on this line: its linear-time regex engine (RE2, the google-re2 "
        "package) is not installed"))
    assert ig.check_stops(_sp(stop_regex_strs=[5]), LIMITS, re2) == (
        "stop_regex", "sampling_params.stop_regex = [5]: this engine expects strings")
    reason, message = ig.check_stops(_sp(stop_regex_strs=["a+", "(?<=a)b"]), LIMITS, re2)
    assert reason == "stop_regex" and message.startswith(
        "stop_regex '(?<=a)b' uses a construct RE2 cannot run in linear time (invalid perl operator")
    assert message.endswith("); this line runs stop_regex on RE2 only")


def test_grammar_fields_must_be_strings():
    for name in ig.GRAMMAR_FIELDS:
        sp = types.SimpleNamespace(**{n: None for n in ig.GRAMMAR_FIELDS})
        assert ig.check_grammar_fields(sp) is None
        setattr(sp, name, "x")
        assert ig.check_grammar_fields(sp) is None
        setattr(sp, name, {"type": "object"})
        assert ig.check_grammar_fields(sp) == (
            f"sampling_params.{name} = {{'type': 'object'}} is an object: this engine expects one "
            "string")
    assert ig.check_grammar_fields(types.SimpleNamespace()) is None


# --- prompt positions and the log-prob cost ---------------------------------------------------

def test_prompt_len_of_ids_embeds_and_none():
    assert ig._prompt_len(_req(input_ids=array("q", [1, 2, 3]))) == 3
    assert ig._prompt_len(_req(input_ids=None)) is None
    assert ig._prompt_len(_req(input_embeds=[[0.0], [1.0]], input_ids=None)) == 2
    assert ig._prompt_len(types.SimpleNamespace()) is None


def test_prompt_indices_at_the_prompts_edge():
    req = _req(input_ids=array("q", [1, 2, 3]), token_indices_to_pool=[0, 2],
               multi_item_delimiter_indices=(2, 0))
    assert ig.check_prompt_indices(req, 3) is None
    assert ig.check_prompt_indices(_req(multi_item_delimiter_indices=[3]), 3) == (
        "multi_item_delimiter_indices", "multi_item_delimiter_indices contains 3, which is not a "
        "position of this request's prompt: valid positions are 0..2 (3 prompt tokens)")
    assert ig.check_prompt_indices(_req(token_indices_to_pool=[1, -1]), 3)[1].startswith(
        "token_indices_to_pool contains -1,")
    assert ig.check_prompt_indices(_req(token_indices_to_pool=[1, 2.0]), 3) == (
        "token_indices_to_pool", "token_indices_to_pool = [1, 2.0] is not a list of integers: this "
        "engine expects positions in the prompt")
    assert ig.check_prompt_indices(_req(token_indices_to_pool="0"), 3)[0] == "token_indices_to_pool"
    with pytest.raises(ig.Unchecked, match="token_indices_to_pool without prompt ids"):
        ig.check_prompt_indices(_req(token_indices_to_pool=[0]), None)


def _cost(prompt_len=5, **fields):
    base = {"return_logprob": True, "logprob_start_len": 0, "top_logprobs_num": 2}
    return ig.check_logprob_cost(_req(**{**base, **fields}), prompt_len, LIMITS)


def test_logprob_cost_at_the_lines_limit():
    assert _cost() is None                                             # (2 + 0) x 5 = 10
    assert _cost(top_logprobs_num=3) == (
        "asks for 15 prompt log-prob entries ((top_logprobs_num 3 + 0 token_ids_logprob) x 5 prompt "
        "positions from logprob_start_len 0), over this line's limit of 10 "
        "(DSV41_INPUT_GUARD_MAX_LOGPROB_ENTRIES): the tokenizer manager converts them all at once")
    assert _cost(top_logprobs_num=0, token_ids_logprob=[1, 2]) is None
    assert _cost(top_logprobs_num=1, token_ids_logprob=[1, 2]).startswith(
        "asks for 15 prompt log-prob entries ((top_logprobs_num 1 + 2 token_ids_logprob) x 5")
    assert _cost(top_logprobs_num=4, logprob_start_len=3) is None      # 4 x 2 positions
    assert _cost(top_logprobs_num=4, logprob_start_len=2).startswith("asks for 12 ")
    assert _cost(prompt_len=6, top_logprobs_num=4, logprob_start_len=4) is None
    assert _cost(top_logprobs_num=10**6, logprob_start_len=5) is None  # no prompt position
    assert _cost(top_logprobs_num=10**6, logprob_start_len=9) is None
    assert _cost(top_logprobs_num=10**6, logprob_start_len=-1) is None # the engine's default
    assert _cost(top_logprobs_num=-5, token_ids_logprob=[1, 2]) is None
    assert _cost(top_logprobs_num=-5, token_ids_logprob=[1, 2, 3]).startswith("asks for 15 ")
    assert _cost(top_logprobs_num=[100], token_ids_logprob=[1, 2]) is None   # not an int: no k
    assert _cost(top_logprobs_num=100, return_logprob=False) is None
    assert _cost(prompt_len=None, top_logprobs_num=100) is None


# --- the whole check ----------------------------------------------------------------------------

def test_check_answers_each_reason_in_its_order(kinds):
    re2 = ig.re2_module()

    def check(**fields):
        return ig.check(_req(**fields), VOCAB, kinds, limits=LIMITS, re2=re2)

    assert check() is None
    assert check(input_ids=[VOCAB], top_logprobs_num=[1])[0] == "input_ids"
    assert check(top_logprobs_num=[1], rid=5)[0] == "top_logprobs_num"
    assert check(sampling_params={"stop_token_ids": [VOCAB]})[0] == "stop_token_ids"
    assert check(rid=5, session_id="s") == ("rid", "rid = 5 is int, not a string: this engine "
                                            "expects one string per request")
    assert check(session_params={"id": "s"}, session_id="s") == (
        "sessions", ig.SESSIONS_OFF.format(what="a request with session_params"))
    assert check(session_id="s") == ("sessions", ig.SESSIONS_OFF.format(what="a request with session_id"))
    assert check(sampling_params={"n": 5, "logit_bias": {"x": 1}})[0] == "n"
    assert check(sampling_params={"logit_bias": {"x": 1}, "stop": "abcdef"})[0] == "logit_bias"
    assert check(sampling_params={"stop": "abcdef", "json_schema": 5}) == ("stop", ig.check_stops(
        _req(sampling_params={"stop": "abcdef"}).sampling_params, LIMITS, re2)[1])
    assert check(sampling_params={"json_schema": 5}, token_indices_to_pool=[9])[0] == "grammar"
    assert check(token_indices_to_pool=[9], top_logprobs_num=100, return_logprob=True,
                 logprob_start_len=0)[0] == "token_indices_to_pool"
    assert check(top_logprobs_num=100, return_logprob=True, logprob_start_len=0) == (
        "logprob_entries", ig.check_logprob_cost(
            _req(top_logprobs_num=100, return_logprob=True, logprob_start_len=0), 2, LIMITS))
    # the default limits: the logprob bound of the deselected case of tests/test_input_guard.py
    bad = ig.check(_req(input_ids=array("q", range(5, 5 + 980)), return_logprob=True,
                        logprob_start_len=0, top_logprobs_num=VOCAB), VOCAB, kinds, re2=re2)
    assert bad[0] == "logprob_entries" and bad[1].startswith("asks for 1,003,520 prompt log-prob")
    assert ig.check(_req(input_ids=array("q", range(5, 5 + 976)), return_logprob=True,
                         logprob_start_len=0, top_logprobs_num=VOCAB), VOCAB, kinds, re2=re2) is None


def test_check_of_an_embedding_request_skips_the_generation_fields(kinds):
    from sglang.srt.managers.io_struct import TokenizedEmbeddingReqInput

    def emb(**kw):
        return TokenizedEmbeddingReqInput(**{"input_text": "", "input_ids": array("q", [1, 2]),
                                             "mm_inputs": None, "token_type_ids": None,
                                             "sampling_params": _req().sampling_params, "rid": "r",
                                             **kw})
    assert ig.check(emb(), VOCAB, kinds, limits=LIMITS) is None
    assert ig.check(emb(lora_id=[1]), VOCAB, kinds, limits=LIMITS) is None       # not checked there
    assert ig.check(emb(input_ids=array("q", [VOCAB])), VOCAB, kinds, limits=LIMITS)[0] == "input_ids"
    assert ig.check(emb(token_indices_to_pool=[2]), VOCAB, kinds, limits=LIMITS)[0] == "token_indices_to_pool"
    sp = _req(sampling_params={"stop_token_ids": [VOCAB]}).sampling_params      # still checked
    assert ig.check(emb(sampling_params=sp), VOCAB, kinds, limits=LIMITS)[0] == "stop_token_ids"


def test_check_passes_its_fallback_on():
    seen = []
    kinds = ig.declared_kinds()
    assert ig.check(_req(mm_inputs=object()), VOCAB, kinds, seen.append) is None
    assert seen == [ig.MULTIMODAL]


def test_limits_from_the_lines_keys():
    values = {"DSV41_INPUT_GUARD_MAX_N": 2, "DSV41_INPUT_GUARD_MAX_LOGPROB_ENTRIES": 3,
              "DSV41_INPUT_GUARD_MAX_STOP_CHARS": 4, "DSV41_INPUT_GUARD_GRAMMAR_STEP_MS": 5,
              "DSV41_INPUT_GUARD_MAX_TEXT_CHARS": 6, "DSV41_INPUT_GUARD_MAX_PARSE_CHARS": 7,
              "DSV41_INPUT_GUARD_GRAMMAR_CACHE": 8, "DSV41_INPUT_GUARD_GRAMMAR_CACHE_MB": 9,
              "DSV41_INPUT_GUARD_GRAMMAR_COMPILES_PER_CLIENT": 10, "DSV41_INPUT_GUARD_CLIENT_HEADER": 1}
    assert ig.Limits.from_ctx(types.SimpleNamespace(value=values.__getitem__)) == ig.Limits(
        2, 3, 4, 5, 6, 7, 8, 9, 10, 1)
    assert ig.Limits.from_ctx(types.SimpleNamespace()) == ig.Limits()
    assert ig.Limits() == ig.Limits(n=128, logprob_entries=1_000_000, stop_chars=4096,
                                    grammar_step_ms=100, text_chars=0, parse_chars=32_768,
                                    grammar_cache=128, grammar_cache_mb=256)


def test_the_text_bound_defaults_to_eight_characters_per_token_of_the_context():
    """DSV41_INPUT_GUARD_MAX_TEXT_CHARS 0 (the default): 8 x the context length once the tokenizer
    manager knows it (the line's 1,048,576 tokens: 8,388,608 characters, so no prompt that fits
    the context is refused); an operator's value kept; before it is known, 1,000,000."""
    assert ig.Limits().text_limit == 1_000_000
    line = ig.Limits().with_context(1_048_576)
    assert line.text_chars == line.text_limit == 8_388_608
    assert ig.Limits().with_context(32_768).text_limit == 262_144
    assert ig.Limits(text_chars=5).with_context(1_048_576).text_limit == 5     # the operator's
    assert ig.Limits(text_chars=5).text_limit == 5
    for unreadable in (None, 0, -1, "32768", 2.5):
        assert ig.Limits().with_context(unreadable) == ig.Limits(), unreadable
    assert ig.check_text_size(types.SimpleNamespace(text="a" * 262_144), ig.Limits().with_context(32_768)) is None
    message = ig.check_text_size(types.SimpleNamespace(text="a" * 262_145), ig.Limits().with_context(32_768))
    assert "text has 262,145 characters, over this line's limit of 262,144 per request" in message


# --- the grammar compile pool: one client's share (issue 50) -----------------------------------

def test_the_compile_pool_and_the_default_share_follow_the_engines_executor():
    # ThreadPoolExecutor()'s default: min(32, cpus + 4); the share: half of it, at least 1
    assert [ig.compile_workers(c) for c in (None, 1, 2, 27, 28, 200)] == [5, 5, 6, 31, 32, 32]
    assert ig.grammar_share(ig.Limits(), 2) == 3            # this VM: 6 workers
    assert ig.grammar_share(ig.Limits(), 200) == 16
    assert ig.grammar_share(ig.Limits(), None) == 2
    assert ig.grammar_share(ig.Limits(grammar_compiles=1), 200) == 1     # the line's own bound
    assert ig.grammar_share(ig.Limits(grammar_compiles=40), 2) == 40


def _gen(**fields):
    return types.SimpleNamespace(**{"text": "hi", "input_ids": None, "input_embeds": None,
                                    "sampling_params": None, **fields})


@pytest.mark.parametrize("obj, count", [
    (_gen(), 0),
    (_gen(sampling_params={"max_new_tokens": 4}), 0),
    (_gen(sampling_params={"json_schema": None, "regex": None}), 0),
    (_gen(sampling_params={"json_schema": "{}"}), 1),
    (_gen(sampling_params={"regex": "a+", "n": 3}), 3),
    (_gen(sampling_params={"ebnf": "root ::= \"a\"", "n": 0}), 1),
    (_gen(sampling_params={"structural_tag": "{}", "n": "x"}), 1),     # n's type: the choke point's
    (_gen(text=["a", "b"], sampling_params={"json_schema": "{}", "n": 2}), 4),
    (_gen(text=None, input_ids=[[1], [2], [3]], sampling_params={"regex": "a"}), 3),
    (_gen(text=["a", "b", "c"], sampling_params=[{"regex": "a"}, {}, {"json_schema": "{}", "n": 2}]), 3),
    (_gen(text=["a"], sampling_params=["x"]), 0),
])
def test_grammar_keys_count_each_scheduler_request_with_a_grammar(obj, count):
    assert sum(requests for _, requests in ig.grammar_keys(obj)) == count


def test_the_client_is_the_operators_header_only_when_the_line_trusts_it():
    assert ig.client_of("10.0.0.5", "team-a", 0) == "host 10.0.0.5"          # header not trusted
    assert ig.client_of("10.0.0.5", "team-a", 1) == "header team-a"
    assert ig.client_of("10.0.0.5", "  ", 1) == "host 10.0.0.5"               # empty: the peer
    assert ig.client_of("10.0.0.5", None, 1) == "host 10.0.0.5"
    assert ig.client_of(None, None, 0) == "host unknown"
    assert ig.client_of("h", "x" * 500, 1) == "header " + "x" * 128


def test_check_grammar_share_at_the_edge_names_the_key_and_the_count():
    key = "DSV41_INPUT_GUARD_GRAMMAR_COMPILES_PER_CLIENT"
    assert ig.check_grammar_share("host a", 0, 0, 3, 6) is None               # no grammar
    assert ig.check_grammar_share("host a", 2, 1, 3, 6) is None               # the last one in
    message = ig.check_grammar_share("host a", 3, 1, 3, 6)                     # the first one out
    assert message.startswith("host a already has 3 requests with a grammar")
    assert "this one would make 4, over this line's limit of 3 per client (" + key + ")" in message
    assert "a pool of 6 workers" in message
    assert ig.check_grammar_share("host a", 1, 2, 3, 6) is None
    assert "would make 4" in ig.check_grammar_share("host a", 2, 2, 3, 6)
    alone = ig.check_grammar_share("host a", 0, 4, 3, 6)                       # never fits
    assert alone.startswith("this request sends 4 requests with a grammar") and key in alone
    assert alone.endswith("split it into requests of at most 3")
    assert ig.check_grammar_share("host a", 0, 3, 3, 6) is None
    assert ig.GRAMMAR_SHARE_STATUS == 429
    assert "grammar_compiles" in ig.REASONS[:-1]          # counted like the other refusals


def test_limits_read_the_grammar_share_keys():
    values = {k: 1 for k in ig.LIMIT_KEYS.values()}
    values.update({"DSV41_INPUT_GUARD_GRAMMAR_COMPILES_PER_CLIENT": 7,
                   "DSV41_INPUT_GUARD_CLIENT_HEADER": 1})
    limits = ig.Limits.from_ctx(types.SimpleNamespace(value=values.__getitem__))
    assert (limits.grammar_compiles, limits.client_header) == (7, 1)
    assert (ig.Limits().grammar_compiles, ig.Limits().client_header) == (0, 0)


def test_a_single_embeddings_prompt_is_one_prompt_not_a_batch():
    """A single input_embeds prompt is itself a list of vectors (the engine's _determine_batch_size
    looks one level deeper): 200 positions are one prompt, not 200 (once refused as 200 samples);
    a list of such prompts is a batch."""
    single = types.SimpleNamespace(text=None, input_ids=None, input_embeds=[[0.5, 0.25]] * 200,
                                   sampling_params={"max_new_tokens": 1})
    assert rules._prompts(single) == 1 and ig.check_samples(single, ig.Limits()) is None
    batch = types.SimpleNamespace(text=None, input_ids=None, input_embeds=[[[0.5, 0.25]] * 3] * 200,
                                  sampling_params={"max_new_tokens": 1})
    assert rules._prompts(batch) == 200
    assert "200 samples (200 prompts" in ig.check_samples(batch, ig.Limits())


def test_embedding_batch_shapes_at_their_edges():
    """check_embedding_batch (found by bench/mutation.py input_guard: 19 of its mutants survived the
    route tests): each message whole, and the shapes either side of each rule."""
    def req(**fields):
        return types.SimpleNamespace(**{"text": None, "input_ids": None, "input_embeds": None,
                                        "sampling_params": None, "rid": None, **fields})

    expects_one = ": this engine expects one object (a list only in the batch form, one per prompt)"
    assert ig.check_embedding_batch(req(text="hi", sampling_params=[{}])) == (
        "sampling_params = [{}] is a list on a single prompt" + expects_one)
    assert ig.check_embedding_batch(req(input_ids=[1, 2], sampling_params=[{}])) == (
        "sampling_params = [{}] is a list on a single prompt" + expects_one)
    for single in (req(text="hi"), req(text="hi", sampling_params={}), req(input_ids=[1, 2], rid="r")):
        assert ig.check_embedding_batch(single) is None
    assert ig.check_embedding_batch(req(text=["a", "b"], rid="x")) == (
        "rid = 'x' is str on a batch of 2 prompts: this engine expects a list of rids, one per prompt")
    per_prompt = ": this engine expects one object per prompt (or one object for all)"
    assert ig.check_embedding_batch(req(input_ids=[[1], [2]], rid=["x", "y"], sampling_params=[{}])) == (
        "sampling_params has 1 entries for 2 prompts" + per_prompt)
    assert ig.check_embedding_batch(req(text=["a", "b"], sampling_params=[{}, 3])) == (
        "sampling_params has 2 entries for 2 prompts" + per_prompt)
    for fine in (req(text=["a", "b"]), req(text=["a", "b"], rid=["x", "y"]),
                 req(text=["a", "b"], sampling_params={}),
                 req(input_ids=[[1], [2]], sampling_params=[{}, {}]),
                 req(text=["a", "b"], sampling_params=[{}, {}, {}])):
        assert ig.check_embedding_batch(fine) is None


# --- the rules of issue 50, on their own (bench/mutation.py input_guard: the survivors of a partial
# run at a99f80d; the route tests check a fragment of each message, these check it whole) ---------

SAMPLING_NAMES = frozenset({"temperature", "top_k", "top_p", "max_new_tokens", "stop", "regex"})
REQUEST_NAMES = frozenset({"text", "input_ids", "input_embeds", "image_data", "sampling_params",
                           "stream", "return_logprob"})


def test_a_sampling_values_type_message_names_the_kind_the_field_holds():
    # an integer field takes no float (the scheduler's int32 tensors), a float field takes an int
    assert ig.check_sampling_value("top_k", 1.5, "sampling_params") == (
        "sampling_params.top_k = 1.5 is float, not an integer: this engine expects an integer in "
        f"1..{ig.INT32_MAX}")
    assert ig.check_sampling_value("top_k", 7, "sampling_params") is None
    assert ig.check_sampling_value("temperature", 1, "p") is None
    assert ig.check_sampling_value("temperature", "x", "p") == (
        "p.temperature = 'x' is str, not a number: this engine expects a number in [0.0, "
        f"{ig.FLOAT32_MAX:g}]")
    assert ig.check_sampling_value("max_new_tokens", None, "p") is None        # optional
    assert ig.check_sampling_value("top_p", None, "p") == (
        "p.top_p = None is NoneType, not a number: this engine expects a number in (0.0, 1]")
    assert rules.sampling_value_problem("stop_token_ids", [1, "a"]) == ("is a list", "a list of token ids")
    assert rules.sampling_value_problem("logit_bias", "x") == ("is str", "an object of token id -> bias")


def test_a_sampling_params_message_whole_and_each_prompts_object_checked():
    accepted = frozenset({"temperature", "top_k"})
    assert ig.check_sampling_params([{"temperature": 0.5}, {"top_k": 3}], "sp", accepted) is None
    # a None entry is skipped, the next one still checked
    assert ig.check_sampling_params([None, {"top_k": "x"}], "sp", accepted) == (
        "sp.top_k = 'x' is str, not an integer: this engine expects an integer in "
        f"1..{ig.INT32_MAX}")
    assert ig.check_sampling_params(5, "sp", accepted) == (
        "sp = 5 is int: this engine expects an object of sampling parameters (or a list of them, "
        "one per prompt)")
    assert ig.check_sampling_params({"seed": 1}, "sp", accepted) == (
        "sp has 'seed', which is not a sampling parameter of this engine; it takes: temperature, top_k")


def test_ollama_options_messages_whole():
    assert ig.check_ollama_options(None) is None
    assert ig.check_ollama_options({"temperature": 0.5, "num_ctx": "ignored"}) is None
    assert ig.check_ollama_options([1]) == (
        "options", "options = [1] is a list: Ollama expects an object")
    assert ig.check_ollama_options({"top_k": 1.5}) == (
        "top_k", f"options.top_k = 1.5 (this engine's sampling_params.top_k): this engine expects "
                 f"an integer in 1..{ig.INT32_MAX}")
    # a value whose repr holds ": " (the message was once cut at the first ": " it found)
    assert ig.check_ollama_options({"num_predict": {"a": 1}}) == (
        "max_new_tokens", "options.num_predict = {'a': 1} (this engine's sampling_params."
                          f"max_new_tokens): this engine expects an integer in 0..{ig.INT32_MAX}")


def test_vertex_bodies_messages_whole():
    def vertex(instances, parameters=None):
        return ig.check_vertex(instances, parameters, REQUEST_NAMES, SAMPLING_NAMES)

    objects = "instances must be a list of objects"
    assert vertex(5) == objects and vertex([5]) == objects and vertex([{"text": "a"}, "b"]) == objects
    assert vertex([{}]) is None                         # no input key: the engine's own check answers
    assert vertex([{"text": "a"}, {"text": 5}]) == (
        "instances[].text = 5 is int: this engine expects one string per instance (the same input "
        "key in every instance)")
    assert vertex([{"input_ids": [1, 2]}, {"input_ids": [3]}]) is None
    assert vertex([{"input_ids": [1, 2]}, {"input_ids": [3, 2.5]}]) == (
        "instances[].input_ids = [3, 2.5] is not a list of token ids: this engine expects one list "
        "of integers per instance")
    assert vertex([{"text": "a"}], [1]) == "parameters = [1] is a list: this engine expects an object"
    tail = ("; sampling fields go in parameters.sampling_params, request fields (stream, "
            "return_logprob, ...) in parameters")
    assert vertex([{"text": "a"}], {"image_data": "x"}) == (
        "parameters.image_data: the route sets it from the instances" + tail)
    assert vertex([{"text": "a"}], {"top_k": 3}) == (
        "parameters.top_k: not a field of this engine's GenerateReqInput" + tail)
    assert vertex([{"text": "a"}], {"stream": False, "sampling_params": {"top_k": 3}}) is None


def test_parse_size_at_its_bound_and_its_message_whole():
    limits = ig.Limits(parse_chars=10)
    assert ig.check_parse_size("x" * 10, "/parse_function_call", limits) is None
    assert ig.check_parse_size(None, "/parse_function_call", limits) is None
    assert ig.check_parse_size("x" * 11, "/parse_function_call", limits) == (
        "text has 11 characters, over this line's limit of 10 for /parse_function_call "
        f"({ig.LIMIT_KEYS['parse_chars']}): the parser runs on the HTTP event loop, where every "
        "other client waits")


def _logprob_req(**fields):
    """A GenerateReqInput's fields as the request's log-prob bound reads them (only those it reads:
    a field the body did not send is None on the engine's struct, absent here)."""
    return types.SimpleNamespace(**{"return_logprob": True, "logprob_start_len": 0,
                                    "top_logprobs_num": 5, **fields})


def test_request_logprobs_count_each_prompt_of_a_batch_in_its_own_form():
    limits = ig.Limits(logprob_entries=100)
    ids = [[1] * 12, [2] * 12]                      # 2 prompts x 12 positions x 5 = 120 entries
    head = "this request asks for 120 prompt log-prob entries (2 prompts; "
    over = ig.check_request_logprobs(_logprob_req(input_ids=ids), limits)
    assert over.startswith(head) and over.endswith("on the HTTP event loop")   # ids: an exact count
    # per-prompt lists (the batch form): each prompt's own value, a short list's value whole
    per_prompt = _logprob_req(input_ids=ids, return_logprob=[True, True], logprob_start_len=[0, 0],
                              top_logprobs_num=[5, 5])
    assert ig.check_request_logprobs(per_prompt, limits).startswith(head)
    short = _logprob_req(input_ids=ids, return_logprob=[True], logprob_start_len=[0])
    assert ig.check_request_logprobs(short, limits) is None     # a list is not a start: none counted
    # embeddings: one position per vector
    embeds = _logprob_req(input_embeds=[[[0.5]] * 12, [[0.5]] * 12])
    assert ig.check_request_logprobs(embeds, limits).startswith(head)
    # a text batch: counted by UTF-8 length, and the message says so
    texts = _logprob_req(text=["x" * 12, "é" * 6])
    assert ig.check_request_logprobs(texts, limits).endswith(
        "(a text prompt counted at one position per UTF-8 byte, the most a byte-level tokenizer "
        "makes of it: send input_ids for an exact count)")
    # a prompt in a form the engine does not take: left to the engine's own checks, no exception
    assert ig.check_request_logprobs(_logprob_req(text=["x" * 30, 5]), limits) is None
    assert ig.check_request_logprobs(_logprob_req(input_ids=[[1] * 30, 5]), limits) is None


def test_embedding_batch_reads_only_the_fields_the_body_sent():
    """The rules take the request's fields as they come; one the body did not send reads as None."""
    assert ig.check_embedding_batch(types.SimpleNamespace(text="hi")) is None
    assert ig.check_embedding_batch(types.SimpleNamespace(input_ids=[[1], [2]])) is None
    assert ig.check_embedding_batch(types.SimpleNamespace(text=["a", "b"], rid="r")) == (
        "rid = 'r' is str on a batch of 2 prompts: this engine expects a list of rids, one per prompt")


# --- survivors of the run at 5b7f78e (bench/mutation.py input_guard, 591 of 1753 checked) -------

def test_logprob_cost_counts_two_samples_as_three_prompts():
    """n 2: the engine sends the prompt twice plus once for its prefix (n 1: once)."""
    assert _cost(top_logprobs_num=1, sampling_params={"n": 2}) == (
        "asks for 15 prompt log-prob entries ((top_logprobs_num 1 + 0 token_ids_logprob) x 5 prompt "
        "positions from logprob_start_len 0 x 3 samples (n 2 and the prefix request)), over this "
        "line's limit of 10 (DSV41_INPUT_GUARD_MAX_LOGPROB_ENTRIES): the tokenizer manager converts "
        "them all at once")
    assert _cost(top_logprobs_num=2, sampling_params={"n": 1}) is None     # 10: at the limit


def test_a_seed_at_the_int64_edges_and_a_bool_that_is_not_one():
    seed = ": this engine expects an integer in [-2**63, 2**63 - 1]"
    for fine in (-(2**63), 2**63 - 1, 0):
        assert ig.check_sampling_value("sampling_seed", fine, "p") is None
    for bad in (2**63, -(2**63) - 1):
        assert ig.check_sampling_value("sampling_seed", bad, "p") == f"p.sampling_seed = {bad} is not a seed" + seed
    assert ig.check_sampling_value("sampling_seed", True, "p") == "p.sampling_seed = True is not a seed" + seed


@pytest.mark.parametrize("name", ["stop", "stop_regex"])
def test_stops_are_a_string_or_a_list_of_strings(name):
    for fine in (None, "abc", ["a", "b"], []):
        assert ig.check_sampling_value(name, fine, "p") is None
    assert ig.check_sampling_value(name, ["a", 1], "p") == (
        f"p.{name} = ['a', 1] is a list: this engine expects a string or a list of strings")
    assert ig.check_sampling_value(name, 5, "p") == (
        f"p.{name} = 5 is int: this engine expects a string or a list of strings")


def test_pooling_messages_whole():
    ids = array("q", [5, 6, 7])
    empty = _req(input_ids=ids, token_indices_to_pool=[], sampling_params={"max_new_tokens": 0},
                 return_logprob=True, logprob_start_len=0)
    assert ig.check_pooling(empty, 3, None) == (
        "token_indices_to_pool", "token_indices_to_pool = [] has no position: this engine pools at "
                                 "least one position of the prompt per request")
    cached = _req(input_ids=ids, token_indices_to_pool=[1], sampling_params={"max_new_tokens": 0},
                  return_logprob=False, logprob_start_len=0)
    assert ig.check_pooling(cached, 3, None)[1].endswith(
        "with return_logprob true and logprob_start_len 0 (its own scoring shape); got return_logprob "
        "False, logprob_start_len 0")
    scoring = _req(input_ids=ids, token_indices_to_pool=[1], sampling_params={"max_new_tokens": 0},
                   return_logprob=True, logprob_start_len=0)
    assert ig.check_pooling(scoring, 3, None) is None


def test_a_pydantic_bodys_extra_fields_are_its_text_too():
    """A chat request model that allows extra fields keeps them apart (`__pydantic_extra__`): they
    are rendered like the others, so they count."""
    import pydantic

    class Body(pydantic.BaseModel, extra="allow"):
        model: str = "m"

    class Strict(pydantic.BaseModel):
        model: str = "m"

    assert rules._model_fields(Body(extra_text="x" * 7)) == {"model": "m", "extra_text": "x" * 7}
    assert rules._model_fields(Strict()) == {"model": "m"}
    assert rules._model_fields(5) is None
    limits = ig.Limits(text_chars=5)
    assert ig.check_body_text(Body(extra_text="x" * 7), "/v1/chat/completions", limits).startswith(
        "/v1/chat/completions: this request's text is over 5 characters, this line's limit per "
        f"request ({ig.LIMIT_KEYS['text_chars']}); extra_text holds 7 of them")


def test_body_text_message_whole_and_each_field_after_the_unrendered_ids_counted():
    limits = ig.Limits(text_chars=10)
    why = (": the engine renders, tokenizes or decodes a request's text on its HTTP server before the "
           "request reaches the guard's other checks, where every other client waits (counted: every "
           "string of the body and one per list item; a chat request's input_ids and, with them, its "
           "messages are not rendered and not counted)")
    # the unrendered ids first: skipped, and the fields after them still counted
    body = {"input_ids": [1] * 50, "messages": ["m" * 40], "tools": ["t" * 20]}
    assert ig.check_body_text(body, "/r", limits) == (
        f"/r: this request's text is over 10 characters, this line's limit per request "
        f"({ig.LIMIT_KEYS['text_chars']}); tools holds 26 of them" + why)
    # a field's walk stops at what is left of the bound: nothing is left after big's own key
    # (8 + 3 > 10), so its strings are not walked and abc, 8, holds the most
    assert ig.check_body_text({"abc": "x" * 5, "big": ["y" * 5, "y" * 5]}, "/r", limits).startswith(
        "/r: this request's text is over 10 characters, this line's limit per request "
        f"({ig.LIMIT_KEYS['text_chars']}); abc holds 8 of them")


def test_grammar_share_of_a_request_without_grammars_and_an_empty_peer():
    assert ig.check_grammar_share("host a", 9, 0, 2, 4) is None        # nothing added: never refused
    assert ig.check_grammar_share("host a", 1, 1, 2, 4) is None        # 2: at the share
    assert ig.client_of("", None, 0) == "host unknown"
    assert ig.client_of(None, None, 0) == "host unknown"
    assert ig.client_of("10.0.0.1", " gw ", 0) == "host 10.0.0.1"
    assert ig.client_of("10.0.0.1", " gw ", 1) == "header gw"


def test_an_empty_conversation_only_where_the_route_does_not_check_it():
    empty = ("/api/chat: messages = [] has no message: this engine renders the conversation with the "
             "model's chat template, which needs at least one message")
    assert ig.check_chat_messages({"messages": []}, "/api/chat") == empty
    assert ig.check_chat_messages({"messages": ()}, "/api/chat") == empty
    assert ig.check_chat_messages({"messages": [{"role": "user"}]}, "/api/chat") is None
    assert ig.check_chat_messages({"model": "m"}, "/api/chat") is None
    assert ig.check_chat_messages(5, "/api/chat") is None
    assert ig.check_chat_messages({"messages": []}, "/v1/chat/completions") is None   # its own 400


# --- survivors of the run at f4e855e (bench/mutation.py input_guard) ---------------------------

def _namespace_gen(**fields):
    return types.SimpleNamespace(**{"text": None, "input_ids": None, "input_embeds": None,
                                    "sampling_params": None, **fields})


def test_grammar_keys_one_per_grammar_whatever_its_form():
    import hashlib

    def keys(sp, **fields):
        return rules.grammar_keys(_namespace_gen(text=["a", "b"] if isinstance(sp, list) else "a",
                                                 sampling_params=sp, **fields))

    sha = hashlib.sha256("a+".encode()).hexdigest()
    assert keys([{}, {"regex": "a+", "n": 3}]) == [(("regex", sha), 3)]      # a prompt without one skipped
    assert keys([None, {"regex": "a+"}]) == [(("regex", sha), 1)]            # and one without params
    one, two = keys({"json_schema": {"b": 1, "a": [2]}}), keys({"json_schema": {"a": [2], "b": 1}})
    assert one == two and one[0][0][0] == "json_schema"                     # key order: one grammar
    assert one[0][0][1] == hashlib.sha256(b'{"a": [2], "b": 1}').hexdigest()
    assert keys({"json_schema": {"a": 1}}) != keys({"json_schema": {"a": 2}})
    assert len(keys({"json_schema": {"a": {1, 2}}})) == 1                   # not JSON: its str()
    assert len(keys({"regex": "\ud800"})) == 1                              # a lone surrogate from JSON


def test_samples_count_each_prompts_n_and_one_for_a_prompt_without_params():
    limits = ig.Limits(n=128)
    two = {"text": ["a", "b"]}
    assert ig.check_samples(_namespace_gen(**two, sampling_params=[{}, {"n": 127}]), limits) is None
    assert ig.check_samples(_namespace_gen(**two, sampling_params=[None, {"n": 127}]), limits) is None
    assert ig.check_samples(_namespace_gen(**two, sampling_params=[{}, {"n": 128}]), limits) == (
        "this request asks for 129 samples (2 prompts, sampling_params.n summed), over this line's "
        f"limit of 128 samples per request, all its prompts together ({ig.LIMIT_KEYS['n']})")
    assert ig.check_samples(_namespace_gen(text=["a", "b", "c"], sampling_params=None),
                            ig.Limits(n=3)) is None


def test_text_size_walks_on_at_the_bound_and_the_text_message_whole():
    assert rules.text_size(["ab", "cd"], 2) == 4         # 2 items: at the bound, the walk goes on
    assert ig.check_text_size(_namespace_gen(text="x" * 11), ig.Limits(text_chars=10)) == (
        f"text has 11 characters, over this line's limit of 10 per request "
        f"({ig.LIMIT_KEYS['text_chars']}): the engine tokenizes text on its HTTP event loop, where "
        "every other client waits; send the prompt as input_ids instead")


def test_sampling_value_types_of_stop_ids_logit_bias_and_grammars():
    for name, fine, bad, expects in (("stop_token_ids", [1, 2], ["a"], "a list of token ids"),
                                     ("logit_bias", {}, [1], "an object of token id -> bias"),
                                     ("regex", "a+", ["a"], "one string")):
        assert ig.check_sampling_value(name, None, "p") is None
        assert ig.check_sampling_value(name, fine, "p") is None, name
        assert ig.check_sampling_value(name, bad, "p") == (
            f"p.{name} = {bad!r} is {'a list'}: this engine expects {expects}")


def test_request_logprobs_single_forms_and_each_prompts_own_fields():
    limits = ig.Limits(logprob_entries=100)
    # a single text prompt: left to the choke point's exact count
    assert ig.check_request_logprobs(_logprob_req(text="x" * 500), limits) is None
    # a single ids prompt: counted here (no text field on the body)
    assert ig.check_request_logprobs(_logprob_req(input_ids=[1] * 30), limits).startswith(
        "this request asks for 150 prompt log-prob entries (1 prompt; ")
    # token ids asked by id count too
    ids = _logprob_req(input_ids=[[1] * 30, [2] * 30], top_logprobs_num=0, token_ids_logprob=[1, 2])
    assert ig.check_request_logprobs(ids, limits).startswith("this request asks for 120 ")
    # a prompt without log-probs is skipped, the next one still counted
    mixed = _logprob_req(input_ids=[[1] * 30, [2] * 30], return_logprob=[False, True])
    assert ig.check_request_logprobs(mixed, limits).startswith("this request asks for 150 ")
    # a body without logprob_start_len: no prompt log-probs asked
    bare = types.SimpleNamespace(input_ids=[[1] * 30, [2] * 30], return_logprob=True, top_logprobs_num=5)
    assert ig.check_request_logprobs(bare, limits) is None
    no_flag = types.SimpleNamespace(input_ids=[[1] * 30, [2] * 30], top_logprobs_num=5, logprob_start_len=0)
    assert ig.check_request_logprobs(no_flag, limits) is None


# --- survivors of the run at 0f20bbc not read before (docs/testing.md, input guard) -------------

def _sent(**fields):
    """Only the fields a body sent (the engine's struct holds None for the others: a rule reads
    each with its None default, so an absent one here fails a rule that forgets the default)."""
    return types.SimpleNamespace(**fields)


def test_prompt_present_messages_whole_and_each_form_it_leaves_alone():
    ids_empty = ("input_ids = [] has no prompt token: this engine expects at least one token id per "
                 "prompt (or a text)")
    assert ig.check_prompt_present(_sent(input_ids=[])) == ids_empty
    assert ig.check_prompt_present(_sent(input_ids=[], input_embeds=[[0.5]])) == ids_empty   # indexed anyway
    assert ig.check_prompt_present(_sent(input_ids=[[1], []])) == (
        "input_ids[1] = [] has no prompt token: this engine expects at least one token id per prompt")
    assert ig.check_prompt_present(_sent(text=[])) == (
        "text = [] has no prompt: this engine expects at least one prompt")
    # the same empty entry where the engine does not read the ids as the prompt: left to it
    assert ig.check_prompt_present(_sent(text="a", input_ids=[[1], []])) is None
    assert ig.check_prompt_present(_sent(input_ids=[[1], []], input_embeds=[[0.5]])) is None
    assert ig.check_prompt_present(_sent(input_ids=[[1], []], image_data="img")) is None
    assert ig.check_prompt_present(_sent(text=[], input_ids=[1])) is None
    # nothing sent, or a prompt in each form: nothing to say
    for fine in (_sent(), _sent(text="a"), _sent(text=["a"]), _sent(input_ids=[1]),
                 _sent(input_ids=[[1], [2]]), _sent(text=None, input_ids=None)):
        assert ig.check_prompt_present(fine) is None, fine


def test_batch_shape_of_each_form_at_its_edges():
    """(prompts, batch) as the engine's _determine_batch_size decides them; None for a form it does
    not take."""
    shape = rules._batch_shape
    assert shape(_sent(text="a")) == (1, False)
    assert shape(_sent(text=["a", "b"])) == (2, True)
    assert shape(_sent(text=5)) is None
    assert shape(_sent(input_ids=[7])) == (1, False)
    assert shape(_sent(input_ids=[[7], [8], [9]])) == (3, True)
    assert shape(_sent(input_ids=[])) is None
    assert shape(_sent(input_ids=5)) is None
    assert shape(_sent(input_embeds=[[0.5]])) == (1, False)            # one prompt of one vector
    assert shape(_sent(input_embeds=[[0.5, 0.25]] * 3)) == (1, False)
    assert shape(_sent(input_embeds=[[[0.5]], [[0.5]]])) == (2, True)
    for none in (_sent(), _sent(input_embeds=[]), _sent(input_embeds=[[]]), _sent(input_embeds=[5])):
        assert shape(none) is None, none
    assert rules._prompts(_sent()) == 1                                  # a form it does not take: 1
    assert rules._prompts(_sent(input_ids=[])) == 1


def test_the_text_bound_at_a_context_of_one_token_and_an_operators_bound_of_one():
    assert ig.Limits().with_context(1).text_chars == ig.TEXT_CHARS_PER_TOKEN
    assert ig.Limits(text_chars=1).with_context(32_768).text_chars == 1


def test_pooling_at_the_chunk_edges():
    def scoring(chunk, prompt_len):
        req = _req(input_ids=array("q", [5] * prompt_len), token_indices_to_pool=[1],
                   sampling_params={"max_new_tokens": 0}, return_logprob=True, logprob_start_len=0)
        return ig.check_pooling(req, prompt_len, chunk)

    assert scoring(1, 2) == ("token_indices_to_pool", (
        "token_indices_to_pool on a prompt of 2 tokens: this line prefills in chunks of 1 tokens and "
        "the engine's pooling path indexes each chunk with the whole list; pooled prompts must be at "
        "most 1 tokens"))
    assert scoring(1, 1) is None
    assert scoring(0, 5) is None            # no chunked prefill (the engine's 0 / -1): one prefill
    assert scoring(-1, 5) is None


def test_request_logprobs_each_prompts_own_values_counted_exactly():
    limits = ig.Limits(logprob_entries=100)
    two = [[1] * 30, [2] * 30]

    def total(**fields):
        message = ig.check_request_logprobs(_logprob_req(input_ids=two, **fields), ig.Limits(logprob_entries=1))
        return None if message is None else int(message.split(" prompt log-prob")[0].rsplit(" ", 1)[1].replace(",", ""))

    assert total() == 300                                                 # 2 x 30 x 5
    assert total(top_logprobs_num=0, token_ids_logprob=[[1, 2], [3, 4, 5]]) == 150    # each its own ids
    assert total(top_logprobs_num=0, token_ids_logprob=[[1, 2]]) == 2 * 30 + 1 * 30   # a short list whole
    assert total(top_logprobs_num=2, token_ids_logprob=[1, 2]) == 240     # top and ids: 4 per position
    assert total(top_logprobs_num=1) == 60
    assert total(top_logprobs_num=[0, 5]) == 150                          # the first skipped, the next counted
    assert total(logprob_start_len=[-1, 0]) == 150
    assert total(logprob_start_len=10) == 200                             # from position 10 on
    assert total(logprob_start_len=40) is None                            # past the prompt: none
    assert total(top_logprobs_num=0) is None
    assert total(top_logprobs_num=-3) is None
    # samples: one count each (n + 1 with n > 1), or summed when the prompts differ
    assert ig.check_request_logprobs(_logprob_req(input_ids=two, sampling_params=[{"n": 1}, {"n": 2}]),
                                     limits) == (
        "this request asks for 600 prompt log-prob entries (2 prompts, samples summed; "
        "(top_logprobs_num + token_ids_logprob) x prompt positions from logprob_start_len, per sample), "
        "over this line's limit of 100 per request, all its prompts and samples together "
        f"({ig.LIMIT_KEYS['logprob_entries']}): the tokenizer manager converts them on the HTTP event loop")
    assert ig.check_request_logprobs(_logprob_req(input_ids=two, sampling_params={"n": 2}), limits).startswith(
        "this request asks for 900 prompt log-prob entries (2 prompts, 3 samples each; ")
