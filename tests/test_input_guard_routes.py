"""input_guard on the routes whose handlers build the engine's request themselves (issue 50): the
Ollama routes (`options.seed` to the engine's `sampling_seed`, option types, the engine's
ValueError answered 400), `/vertex_generate` (its body checked before `GenerateReqInput(**...)`),
driven through the engine's real app and real TokenizerManager (tests/test_input_guard.py's
`app_client`: what would go to the scheduler is recorded and the request stopped there); and the
pooling fields against the engine's pooling path, on the real TokenizerManager. Each test builds
its own TokenizerManager (and app lifespan) on the guard installed once for the module and reset
before each test (tests/input_guard_fixtures.py); the tests that install with keys of their own
install for themselves."""
import pytest

from adapter import input_guard, receipts
from conftest import close_zmq_sockets
from input_guard_fixtures import guard_install_of_the_module, input_guard_installed  # noqa: F401
from test_input_guard import (  # noqa: F401
    CHAT, KEYS, VOCAB, _real_manager, _tokenize, app_client, dense_model, manager)


@pytest.fixture
def client(app_client):  # noqa: F811
    """The app with the route wraps of this install (what the engine's app setup gets)."""
    from sglang.srt.entrypoints import http_server as hs

    assert sorted(input_guard.hooks.guard_app_routes(hs.app)) == [
        "/parse_function_call", "/separate_reasoning", "/vertex_generate"]
    try:
        yield app_client
    finally:
        for route in hs.app.routes:
            call = getattr(getattr(route, "dependant", None), "call", None)
            if getattr(call, "_dsv41_guarded", False):
                route.dependant.call = call.__wrapped__


def _ollama(path, **options):
    if path == "/api/generate":
        return {"model": "m", "prompt": "hi", "stream": False, "options": options}
    return {"model": "m", "messages": CHAT, "stream": False, "options": options}


def _vertex(sampling=None, **parameters):
    if sampling is not None:
        parameters["sampling_params"] = sampling
    return {"instances": [{"text": "hello"}], "parameters": parameters}


@pytest.mark.parametrize("path", ["/api/generate", "/api/chat"])
def test_an_ollama_seed_reaches_the_engines_sampling_seed(client, path):
    """Every seeded Ollama request was a TypeError 500 (`SamplingParams(seed=...)`)."""
    client, sent = client
    client.post(path, json=_ollama(path, seed=1234, temperature=0.7))
    (tokenized,) = sent                                 # it reached the scheduler's door
    assert tokenized.sampling_params.sampling_seed == 1234
    assert tokenized.sampling_params.temperature == pytest.approx(0.7)


@pytest.mark.parametrize("path", ["/api/generate", "/api/chat"])
@pytest.mark.parametrize("options, text", [
    ({"top_p": "x"}, "options.top_p = 'x' (this engine's sampling_params.top_p): this engine "
                     "expects a number in (0.0, 1]"),
    ({"temperature": None}, "options.temperature = None"),
    ({"seed": "x"}, "options.seed = 'x' (this engine's sampling_params.sampling_seed): this engine "
                    "expects an integer in [-2**63, 2**63 - 1]"),
    ({"seed": 2**64}, "options.seed = 1.8446744073709552e+19"),     # as the route's JSON parser reads it
    ({"num_predict": "x"}, "options.num_predict = 'x' (this engine's sampling_params.max_new_tokens)"),
    ({"stop": 5}, "options.stop = 5"),
    ({"top_k": [1]}, "options.top_k = [1]"),
    # the engine's own range checks (its ValueError, which these routes did not catch): 400 now
    ({"top_p": 5}, "top_p must be in (0, 1], got 5"),
    ({"temperature": -1}, "temperature must be a non-negative finite number, got -1"),
    ({"presence_penalty": 5}, "presence_penalty must be in [-2, 2], got 5"),
    ({"frequency_penalty": -3.5}, "frequency_penalty must be in [-2, 2], got -3.5"),
    ({"num_predict": -1}, "max_new_tokens must be at least 0, got -1"),
])
def test_ollama_client_mistakes_are_400_naming_the_option(client, path, options, text):
    client, sent = client
    resp = client.post(path, json=_ollama(path, **options))
    assert resp.status_code == 400, resp.text
    assert text in resp.json()["message"], resp.text
    assert sent == []


def test_ollama_options_the_engine_does_not_map_are_ignored_as_it_does(client):
    client, sent = client
    client.post("/api/generate", json=_ollama("/api/generate", num_ctx=4096, repeat_penalty=1.1,
                                              min_p=0.05, mirostat=0))
    assert len(sent) == 1


@pytest.mark.parametrize("body, text", [
    # the three hostile bodies that answered 500 (issue 50) and the engine's constructor's TypeError
    (_vertex({"logit_bias": "x", "temperature": 1.0}),
     "parameters.sampling_params.logit_bias = 'x' is str: this engine expects an object"),
    (_vertex({"logit_bias": "5", "temperature": 1.0}), "parameters.sampling_params.logit_bias = '5'"),
    (_vertex({"regex": ["a"]}), "parameters.sampling_params.regex = ['a'] is a list: this engine "
                                "expects one string"),
    (_vertex({"top_k": 2**31 + 5, "temperature": 0.5}), "sampling_params.top_k = 2147483653 is out "
                                                         "of range"),
    (_vertex(None, foo=1), "parameters.foo: not a field of this engine's GenerateReqInput"),
    (_vertex(None, top_k=5), "parameters.top_k: not a field of this engine's GenerateReqInput; "
                             "sampling fields go in parameters.sampling_params"),
    (_vertex(None, text="again"), "parameters.text: the route sets it from the instances"),
    (_vertex({"seed": 5}), "parameters.sampling_params has 'seed', which is not a sampling "
                           "parameter of this engine; it takes: "),
    (_vertex({"temperature": "x"}), "parameters.sampling_params.temperature = 'x' is str, not a number"),
    (_vertex({"min_p": "x"}), "parameters.sampling_params.min_p = 'x'"),
    (_vertex({"max_new_tokens": "x"}), "parameters.sampling_params.max_new_tokens = 'x'"),
    (_vertex("x"), "parameters.sampling_params = 'x' is str"),
    ({"instances": [{"text": 5}]}, "instances[].text = 5 is int"),
    ({"instances": [{"text": "a"}, {"text": ["b"]}]}, "instances[].text = ['b'] is a list"),
    ({"instances": [{"input_ids": [5, "x"]}]}, "instances[].input_ids = [5, 'x'] is not a list of token ids"),
    (_vertex({"top_p": 5}), "top_p must be in (0, 1], got 5."),       # the engine's own, as before
])
def test_vertex_bodies_the_route_cannot_build_are_400_naming_the_field(client, body, text):
    client, sent = client
    resp = client.post("/vertex_generate", json=body)
    assert resp.status_code == 400, resp.text
    assert text in resp.text, resp.text
    assert sent == []


def test_a_valid_vertex_body_still_reaches_the_scheduler(client):
    client, sent = client
    client.post("/vertex_generate", json=_vertex({"max_new_tokens": 4, "temperature": 0.5,
                                                  "sampling_seed": 3}, return_logprob=True))
    (tokenized,) = sent
    assert tokenized.sampling_params.sampling_seed == 3 and tokenized.return_logprob


# --- pooling: token_indices_to_pool against the engine's pooling path -----------------------------

SCORING = {"return_logprob": True, "logprob_start_len": 0, "token_ids_logprob": [5, 6]}


def _pool(tm, ids, pool, max_new=0, **extra):
    return _tokenize(tm, ids, sampling={"max_new_tokens": max_new}, token_indices_to_pool=pool,
                     **extra)


@pytest.mark.parametrize("pool", [[1, 3], [7], [3, 3], [5, 1], [0]])
def test_pooling_shapes_the_engine_serves_pass(manager, pool):  # noqa: F811
    """Measured on the stock CPU server: order and duplicates are served (one row each)."""
    out = _pool(manager, [5, 6, 7, 8, 9, 10, 11, 12], pool, **SCORING)
    assert list(out.token_indices_to_pool) == pool


@pytest.mark.parametrize("pool, extra, max_new, text", [
    ([], SCORING, 0, r"token_indices_to_pool = \[\] has no position"),
    ([1, 3], {}, 0, "keeps the prefill whole only with return_logprob true and logprob_start_len 0"),
    ([6], {"return_logprob": True}, 0, "got return_logprob True, logprob_start_len -1"),
    ([1], {"return_logprob": True, "logprob_start_len": 3}, 0, "logprob_start_len 3"),
    ([1, 3], SCORING, 4, "read only on a prefill-only request .* with max_new_tokens 4 this engine ignores it"),
    ([[1, 2]], SCORING, 0, "is not a list of integers"),
    ([8], SCORING, 0, "contains 8, which is not a position of this request's prompt"),
    ([-1], SCORING, 0, "contains -1"),
])
def test_pooling_shapes_the_engine_cannot_serve_are_400(manager, pool, extra, max_new, text):  # noqa: F811
    with pytest.raises(ValueError, match=text):
        _pool(manager, [5, 6, 7, 8, 9, 10, 11, 12], pool, max_new=max_new, **extra)
    assert receipts.counters["input_guard"]["rejected:token_indices_to_pool"] == 1


@pytest.fixture
def chunked_manager(input_guard_installed, dense_model):  # noqa: F811
    """The engine's TokenizerManager of a line launched with --chunked-prefill-size 16, with the
    guard installed (the module's install, reset as a fresh one)."""
    from sglang.srt import runtime_context as rc

    args, build = _real_manager(dense_model, chunked_prefill_size=16)
    with rc.use_context(rc.create_context(args, role="tokenizer")):
        tm = build()
        try:
            yield tm
        finally:
            close_zmq_sockets(tm)


def test_a_pooled_prompt_longer_than_one_chunk_is_400(chunked_manager):
    """The CPU server's line prefills in chunks of 1024: a 1500-token pooled prompt killed stock
    (AssertionError in the first chunk), whatever its index."""
    manager = chunked_manager
    chunk = manager.server_args.chunked_prefill_size
    assert chunk == 16
    ids = [5 + i % 900 for i in range(chunk + 1)]
    with pytest.raises(ValueError, match=f"prompt of {chunk + 1} tokens: this line prefills in "
                                         f"chunks of {chunk} tokens"):
        _pool(manager, ids, [10], **SCORING)
    _pool(manager, ids[:chunk], [chunk - 1], **SCORING)     # one chunk: served


# --- the review's classes: what a request costs before the check, and whose abort it is ----------

def test_a_batch_of_prompts_is_bounded_by_its_samples_all_together(client):
    """The `n` bound is the whole request's: 200 prompts x n 100 is 20,000 samples the engine's
    normalisation would expand on the HTTP event loop (each prompt under the bound)."""
    client, sent = client
    resp = client.post("/generate", json={"text": ["hi"] * 200, "sampling_params": {"n": 100}})
    assert resp.status_code == 400
    assert ("this request asks for 20000 samples (200 prompts, sampling_params.n each 100), over "
            "this line's limit of 128 samples per request, all its prompts together "
            "(DSV41_INPUT_GUARD_MAX_N)") in resp.text
    resp = client.post("/generate", json={"text": ["hi"] * 3, "sampling_params": [{"n": 100}, {"n": 20},
                                                                                   {"n": 20}]})
    assert resp.status_code == 400 and "140 samples (3 prompts, sampling_params.n summed)" in resp.text
    assert sent == []
    client.post("/generate", json={"text": ["hi"] * 4, "sampling_params": {"n": 32, "temperature": 1.0,
                                                                           "max_new_tokens": 2}})
    assert len(sent) == 1                   # 128 samples: at the bound, sent


def test_text_longer_than_the_bound_is_refused_before_it_is_tokenized(client, monkeypatch):
    """The tokenizer manager tokenizes text on the HTTP event loop (a 9 MB body stalled every
    client ~6 s): refused before any tokenizing."""
    from sglang.srt.managers.tokenizer_manager import TokenizerManager

    client, sent = client
    tokenized = []
    real = TokenizerManager._tokenize_one_request

    async def spy(self, obj):
        tokenized.append(obj)
        return await real(self, obj)

    monkeypatch.setattr(TokenizerManager, "_tokenize_one_request", spy)
    # the bound: 8 characters per token of the context this manager serves (the dense model's
    # 32,768 positions), the key unset
    resp = client.post("/generate", json={"text": "a" * 262_145, "sampling_params": {"max_new_tokens": 1}})
    assert resp.status_code == 400, resp.text
    assert ("text has 262,145 characters, over this line's limit of 262,144 per request "
            "(DSV41_INPUT_GUARD_MAX_TEXT_CHARS)") in resp.text
    assert tokenized == [] and sent == []
    client.post("/generate", json={"text": "a" * 262_144, "sampling_params": {"max_new_tokens": 1}})
    assert len(tokenized) == 1              # at the bound: tokenized (the engine's own checks follow)


@pytest.mark.parametrize("path, body", [
    ("/parse_function_call", {"text": "<tool_call>" * 4000, "tools": [], "tool_call_parser": "qwen25"}),
    ("/separate_reasoning", {"text": "<think>" * 6000, "reasoning_parser": "deepseek-r1"}),
])
def test_parse_routes_refuse_text_over_the_bound_before_the_parser_runs(client, monkeypatch, path, body):
    from sglang.srt.function_call.function_call_parser import FunctionCallParser

    client, _ = client
    parsed = []
    monkeypatch.setattr(FunctionCallParser, "parse_non_stream", lambda self, text: parsed.append(text))
    resp = client.post(path, json=body)
    assert resp.status_code == 400, resp.text
    assert (f"over this line's limit of 32,768 for {path} (DSV41_INPUT_GUARD_MAX_PARSE_CHARS)"
            in resp.text)
    assert parsed == []


def test_parse_function_call_within_the_bound_is_served(client):
    client, _ = client
    resp = client.post("/parse_function_call", json={"text": "hello", "tools": [],
                                                     "tool_call_parser": "qwen25"})
    assert resp.status_code == 200, resp.text


def test_a_refused_duplicates_abort_never_reaches_the_owners_request(manager, monkeypatch):  # noqa: F811
    """A streamed /generate schedules an abort of its rid when its stream ends; the engine refuses
    a duplicate rid (400) but its stream's abort task aborted the owner's running request."""
    from sglang.srt.managers.io_struct import GenerateReqInput

    monkeypatch.setattr("asyncio.sleep", _no_sleep)
    aborted = []
    monkeypatch.setattr(manager, "abort_request", lambda rid=None, **kw: aborted.append(rid))
    owner = GenerateReqInput(input_ids=[5, 6], rid="job-7", stream=True)
    owner.normalize_batch_and_arguments()
    manager._init_req_state(owner)
    dup = GenerateReqInput(input_ids=[5, 6], rid="job-7", stream=True)
    dup.normalize_batch_and_arguments()
    with pytest.raises(ValueError, match="Duplicate request ID detected: job-7"):
        manager._init_req_state(dup)
    _run(manager.create_abort_task(dup))
    assert aborted == []                        # the owner's request goes on
    _run(manager.create_abort_task(owner))      # the owner's own stream: its abort as the engine's
    assert aborted == ["job-7"]


async def _no_sleep(seconds):
    return None


def _run(tasks):
    import asyncio

    asyncio.run(tasks())


# --- the grammar caches (the scheduler's): bounded, a timeout never cached as the verdict ---------

def _xgrammar_backend(dense_model):
    from transformers import AutoTokenizer

    from sglang.srt.constrained.xgrammar_backend import XGrammarGrammarBackend

    return XGrammarGrammarBackend(AutoTokenizer.from_pretrained(str(dense_model)), vocab_size=VOCAB)


def test_a_compile_timeout_is_not_cached_and_the_cache_keeps_its_bound(install_adapters, dense_model,  # noqa: F811
                                                                       caplog):
    """The engine cached a compilation that ran past its timeout (the pool busy with another
    client's schemas) as an invalid grammar: that schema was refused for every client until a
    restart. The cache itself grew without bound (~1.4 MB a regex here)."""
    assert install_adapters({**KEYS, "DSV41_INPUT_GUARD_GRAMMAR_CACHE": "3"})["input_guard"].status == "installed"
    from sglang.srt.constrained.base_grammar_backend import InvalidGrammarObject

    backend = _xgrammar_backend(dense_model)
    try:
        backend.set_cache(("json", "{}"), InvalidGrammarObject("Grammar preprocessing timed out"))
        assert backend.cache == {}                          # compiled again next time
        value, hit = backend.get_cached_or_future_value(("regex", "a+"), False)
        assert not hit                                      # a compile, not the cached verdict
        backend.set_cache(("regex", "a+"), value.result(timeout=60))
        assert backend.get_cached_or_future_value(("regex", "a+"), False)[1]    # a real one: cached
        for i in range(5):
            backend.set_cache(("regex", f"a{i}"), InvalidGrammarObject(f"r{i}"))
        assert list(backend.cache) == [("regex", "a2"), ("regex", "a3"), ("regex", "a4")]
    finally:
        backend.executor.shutdown(wait=False)
    assert "did not cache a grammar whose compilation timed out" in caplog.text


def test_xgramars_compiler_cache_is_bounded(install_adapters, dense_model):  # noqa: F811
    assert install_adapters({**KEYS, "DSV41_INPUT_GUARD_GRAMMAR_CACHE_MB": "8"})["input_guard"].status == "installed"
    backend = _xgrammar_backend(dense_model)
    try:
        assert backend.grammar_compiler.cache_limit_bytes == 8 * 1024 * 1024
    finally:
        backend.executor.shutdown(wait=False)


# --- found by the fuzz (issue 50): an Ollama stream's client mistake, an empty prompt list ---------

@pytest.mark.parametrize("path", ["/api/generate", "/api/chat"])
def test_an_ollama_streams_client_mistake_is_400_not_a_cut_stream(client, path):
    """A stream's status goes out with its first chunk: the engine's ValueError (top_k 0 with
    temperature > 0) cut the stream after a 200 (the fuzz: no answer, ChunkedEncodingError)."""
    client, sent = client
    body = _ollama(path, top_k=0, temperature=1.0)
    body["stream"] = True
    resp = client.post(path, json=body)
    assert resp.status_code == 400, resp.text
    assert "top_k must be -1 (disable) or at least 1, got 0" in resp.text
    assert sent == []


@pytest.mark.parametrize("path, body", [
    ("/classify", {"input_ids": [], "text": None}),
    ("/classify", {"input_ids": [], "input_embeds": [[[0.5, 0.5]]]}),      # the fuzz's second body
    ("/encode", {"input_ids": []}),
    ("/generate", {"input_ids": [], "sampling_params": {"max_new_tokens": 1}}),
    ("/generate", {"input_ids": [[5, 6], []], "sampling_params": {"max_new_tokens": 1}}),
])
def test_an_empty_prompt_list_is_400(client, path, body):
    """`/classify {"input_ids": []}`: the engine's normalisation indexed it (IndexError, a 500)."""
    client, sent = client
    resp = client.post(path, json=body)
    assert resp.status_code == 400, resp.text
    assert "has no prompt token" in resp.text and sent == []


@pytest.mark.parametrize("path, body, text", [
    # found by the fuzz: the engine's embedding normalisation asserts / indexes these (500s)
    ("/v1/embeddings", {"model": "m", "input": ["a", "b"], "rid": "one"}, "rid = 'one' is str on a batch of 2 prompts"),
    ("/v1/classify", {"model": "m", "input": ["a", "b", "c"], "rid": "x"}, "rid = 'x' is str on a batch of 3"),
    ("/encode", {"text": "a", "sampling_params": [{}, {}]}, "sampling_params = [{}, {}] is a list on a single prompt"),
    ("/encode", {"text": ["a", "b"], "sampling_params": [{}]}, "sampling_params has 1 entries for 2 prompts"),
])
def test_embedding_shapes_the_normalisation_cannot_take_are_400(client, path, body, text):
    client, sent = client
    resp = client.post(path, json=body)
    assert resp.status_code == 400, resp.text
    assert text in resp.text and sent == []


# --- the grammar compile pool: one client's share (issue 50) -----------------------------------
# The engine's real TokenizerManager with the guard installed (no scheduler behind it): what it
# would send is recorded at `_dispatch_to_scheduler`; the scheduler's first output is planted in
# the request's state as the tokenizer manager's output loop (`_handle_batch_output`, not started
# here: it reads the detokenizer's socket) would put it; the HTTP request is starlette's own,
# with the peer and headers a client would have.
SHARE_KEY = "DSV41_INPUT_GUARD_GRAMMAR_COMPILES_PER_CLIENT"
BIG = '{"type": "object", "properties": {"a": {"type": "string", "pattern": "[a-z]{1,900}"}}}'


@pytest.fixture
def share_manager(install_adapters, dense_model):  # noqa: F811
    """share_manager(keys) -> (the real TokenizerManager, what it sent), the guard installed with
    KEYS and `keys` (the engine as stock with `keys` None)."""
    import contextlib

    from sglang.srt import runtime_context as rc

    with contextlib.ExitStack() as stack:
        def build(keys):
            status = install_adapters({**KEYS, **keys} if keys is not None else {})
            assert status["input_guard"].status == ("installed" if keys is not None else "off"), status
            args, make = _real_manager(dense_model)
            receipts.forget("input_guard")
            stack.enter_context(rc.use_context(rc.create_context(args, role="tokenizer")))
            tm = make()
            stack.callback(close_zmq_sockets, tm)
            sent = []        # the requests (a cancelled one's abort goes the same way: not kept)

            def dispatch(obj):
                if type(obj).__name__ == "TokenizedGenerateReqInput":
                    sent.append(obj)
            tm._dispatch_to_scheduler = dispatch
            tm.auto_create_handle_loop = lambda: None
            return tm, sent

        yield build
    receipts.forget("input_guard")


def _http(host, client=None):
    from starlette.requests import Request

    async def receive():                # a client still connected: nothing more arrives
        import asyncio

        await asyncio.Event().wait()

    headers = [(b"x-dsv41-client", client.encode())] if client else []
    return Request({"type": "http", "method": "POST", "path": "/generate", "client": (host, 4242),
                    "headers": headers}, receive)


def _big(salt):
    """A schema of its own per salt (a grammar this line has not answered)."""
    return BIG.replace('"a"', f'"{salt}"')


def _grammar_req(rid, schema=BIG, **sampling):
    from sglang.srt.managers.io_struct import GenerateReqInput

    return GenerateReqInput(text="hi", rid=rid, stream=True,
                            sampling_params={"json_schema": schema, "max_new_tokens": 4, **sampling})


async def _dispatched(sent, count):
    import asyncio

    for _ in range(200):                # a few loop turns: tokenizing "hi" awaits nothing slow
        if len(sent) >= count:
            return
        await asyncio.sleep(0)
    raise AssertionError(f"{len(sent)} of {count} requests reached the scheduler's door")


def _first_output(tm, rid):
    state = tm.rid_to_state[rid]
    state.out_list.append({"text": "{", "meta_info": {"id": rid}})
    state.event.set()


def test_one_clients_grammar_requests_are_bounded_and_another_client_is_served(share_manager):
    import asyncio

    tm, sent = share_manager({SHARE_KEY: "2"})
    a, b = _http("10.0.0.1"), _http("10.0.0.2")

    async def run():
        waiting = [asyncio.ensure_future(tm.generate_request(_grammar_req(r, _big(r)), a).__anext__())
                   for r in ("a1", "a2")]
        await _dispatched(sent, 2)
        with pytest.raises(ValueError) as refused:          # at the call: before any work
            tm.generate_request(_grammar_req("a3", _big("a3")), a)
        assert refused.value.status_code == 429
        assert ("host 10.0.0.1 already has 2 requests with a grammar (json_schema, regex, ebnf, "
                "structural_tag) not yet answered; this one would make 3, over this line's limit "
                f"of 2 per client ({SHARE_KEY})") in str(refused.value)
        # another client's ordinary schema, and the same client's request without a grammar
        others = [asyncio.ensure_future(tm.generate_request(_grammar_req("b1", '{"type": "object"}'),
                                                            b).__anext__()),
                  asyncio.ensure_future(tm.generate_request(GenerateReqInput(
                      text="hi", rid="a-plain", stream=True), a).__anext__())]
        await _dispatched(sent, 4)
        # a1's first output (its grammar compiled): a1 answered, a's next request (another new
        # schema) admitted
        _first_output(tm, "a1")
        assert (await waiting[0])["meta_info"]["id"] == "a1"
        more = asyncio.ensure_future(tm.generate_request(_grammar_req("a4", _big("a4")), a).__anext__())
        await _dispatched(sent, 5)
        # a2's client went away (its task cancelled, as the route's on a disconnect): uncounted
        waiting[1].cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting[1]
        later = asyncio.ensure_future(tm.generate_request(_grammar_req("a5", _big("a5")), a).__anext__())
        await _dispatched(sent, 6)
        with pytest.raises(ValueError, match="already has 2 requests"):
            tm.generate_request(_grammar_req("a6", _big("a6")), a)
        # a response generator dropped without being iterated: uncounted too
        dropped = tm.generate_request(_grammar_req("b2"), b)
        assert input_guard.hooks.INSTALLED["grammar_share"].pending["host 10.0.0.2"] == 2
        del dropped
        assert input_guard.hooks.INSTALLED["grammar_share"].pending["host 10.0.0.2"] == 1
        for task in (*others, more, later):
            task.cancel()
        await asyncio.gather(*others, more, later, return_exceptions=True)

    from sglang.srt.managers.io_struct import GenerateReqInput

    asyncio.run(run())
    assert [t.rid for t in sent] == ["a1", "a2", "b1", "a-plain", "a4", "a5"]
    assert input_guard.hooks.INSTALLED["grammar_share"].pending == {}     # every count released
    assert receipts.counters["input_guard"]["rejected:grammar_compiles"] == 2


def _answer(tm, rid, aborted=False):
    """rid's first output: the engine's answer, or (aborted) the FINISH_ABORT of a grammar that
    failed to compile."""
    state = tm.rid_to_state[rid]
    reason = {"type": "abort", "message": "Failed to compile json grammar"} if aborted else None
    state.out_list.append({"text": "" if aborted else "{", "meta_info": {"id": rid, "finish_reason": reason}})
    state.event.set()


def test_a_grammar_the_line_has_answered_is_not_counted_again(share_manager):
    """The scheduler keeps a compiled grammar in its cache: a request with a grammar this line has
    answered takes no compile worker, so it is not counted against its client's share (an app
    sending many requests with its one schema is not held to the share). A grammar whose request
    was aborted (failed to compile) is not remembered: its next request is counted."""
    import asyncio

    tm, sent = share_manager({SHARE_KEY: "1"})
    a = _http("10.0.0.1")
    other = '{"type": "object", "properties": {"b": {"type": "integer"}}}'
    broken = '{"type": "object", "properties": {"c": {"type": "string"}}}'

    async def run():
        first = asyncio.ensure_future(tm.generate_request(_grammar_req("r1"), a).__anext__())
        await _dispatched(sent, 1)
        with pytest.raises(ValueError, match="already has 1 requests"):   # BIG not answered yet
            tm.generate_request(_grammar_req("r2"), a)
        _answer(tm, "r1")
        await first
        # BIG answered: three more of it at once, none counted
        again = [asyncio.ensure_future(tm.generate_request(_grammar_req(r), a).__anext__())
                 for r in ("r3", "r4", "r5")]
        await _dispatched(sent, 4)
        assert input_guard.hooks.INSTALLED["grammar_share"].pending == {}
        # a new schema is counted (the share is 1), a second new one beside it refused
        fresh = asyncio.ensure_future(tm.generate_request(_grammar_req("r6", broken), a).__anext__())
        await _dispatched(sent, 5)
        with pytest.raises(ValueError, match="already has 1 requests"):
            tm.generate_request(_grammar_req("r7", other), a)
        _answer(tm, "r6", aborted=True)                 # that schema failed to compile
        await fresh
        # not remembered: counted again, so a second new schema beside it is refused again
        retry = asyncio.ensure_future(tm.generate_request(_grammar_req("r8", broken), a).__anext__())
        await _dispatched(sent, 6)
        with pytest.raises(ValueError, match="already has 1 requests"):
            tm.generate_request(_grammar_req("r9", other), a)
        for task in (*again, retry):
            task.cancel()
        await asyncio.gather(*again, retry, return_exceptions=True)

    asyncio.run(run())
    assert [t.rid for t in sent] == ["r1", "r3", "r4", "r5", "r6", "r8"]
    share = input_guard.hooks.INSTALLED["grammar_share"]
    assert share.pending == {} and len(share.answered) == 1


@pytest.mark.parametrize("keys, sent_rids", [
    # negative controls: the engine as stock admits the flood; with the header not trusted (the
    # default) a client naming itself another client is still the same peer host
    (None, ["a1", "a2", "a3"]),
    ({SHARE_KEY: "2"}, ["a1", "a2"]),
    # the header trusted (an operator's gateway sets it): two clients behind one host
    ({SHARE_KEY: "2", "DSV41_INPUT_GUARD_CLIENT_HEADER": "1"}, ["a1", "a2", "a3"]),
])
def test_the_client_is_the_peers_host_unless_the_line_trusts_its_header(share_manager, keys,
                                                                        sent_rids):
    import asyncio

    tm, sent = share_manager(keys)

    async def run():
        tasks = []
        for rid, who in (("a1", "gw-a"), ("a2", "gw-a"), ("a3", "gw-b")):
            try:
                agen = tm.generate_request(_grammar_req(rid), _http("10.0.0.9", who))
            except ValueError as exc:
                assert "already has 2 requests" in str(exc) and exc.status_code == 429
                continue
            tasks.append(asyncio.ensure_future(agen.__anext__()))
            await _dispatched(sent, len(tasks))
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    asyncio.run(run())
    assert [t.rid for t in sent] == sent_rids
