"""input_guard, issue 50's two remaining bounds, through the engine's real app and TokenizerManager
(tests/test_input_guard.py's `app_client`: what would go to the scheduler is recorded and the
request stopped there; each test builds its own, on the guard installed once for the module and
reset before each test: tests/input_guard_fixtures.py):

- the chat-like routes' text: their handlers render the chat template over `messages` and tools,
  tokenize or decode the body's text before any request reaches generate_request (where the
  `text` bound sits); the body's text is bounded by DSV41_INPUT_GUARD_MAX_TEXT_CHARS before the
  handler runs;
- prompt log-prob entries summed over the whole request (every prompt of a batch, n samples and
  the engine's prefix request), before the engine sends any of it.

Each refusal has a control just at the bound that passes (the check does not refuse everything)."""
import dataclasses
import types

import pytest

from adapter import input_guard
from adapter.input_guard import rules
from input_guard_fixtures import guard_install_of_the_module, input_guard_installed  # noqa: F401
from test_input_guard import CHAT, app_client, dense_model  # noqa: F401

KEY = "DSV41_INPUT_GUARD_MAX_TEXT_CHARS"
LOGPROB_KEY = "DSV41_INPUT_GUARD_MAX_LOGPROB_ENTRIES"


@pytest.fixture
def client(app_client):  # noqa: F811
    """The app with the text-route wraps of this install (what the launcher's app gets)."""
    from sglang.srt.entrypoints import http_server as hs

    paths = input_guard.hooks.guard_app_text_routes(hs.app)
    try:
        yield app_client, paths
    finally:
        for route in hs.app.routes:
            call = getattr(getattr(route, "dependant", None), "call", None)
            if getattr(call, "_dsv41_guarded", False):
                route.dependant.call = call.__wrapped__


def _bound(monkeypatch, **limits):
    """This install's bounds, as an operator's keys would set them (read by the wraps per call)."""
    guard = input_guard.hooks.INSTALLED["guard"]
    monkeypatch.setattr(guard, "limits", dataclasses.replace(guard.limits, **limits))


def test_every_chat_like_route_is_wrapped(client):
    _, paths = client
    assert set(paths) == {
        "/v1/chat/completions", "/invocations", "/v1/responses", "/v1/messages",
        "/v1/messages/count_tokens", "/api/chat", "/v1/tokenize", "/tokenize", "/v1/detokenize",
        "/detokenize", "/v1/embeddings", "/v1/rerank", "/v1/score", "/v1/decisions", "/v1/systemone"}


# --- the rule, on plain values ------------------------------------------------------------------

def test_text_size_counts_strings_keys_and_list_items():
    assert rules.text_size("abc", 100) == 3
    assert rules.text_size({"ab": "cde"}, 100) == 5
    assert rules.text_size(["", "", ""], 100) == 3               # each item costs the handler a step
    assert rules.text_size([1, 2, 3, 4], 100) == 4               # token ids to decode: one each
    assert rules.text_size({"a": [{"b": "cd"}, 7, None]}, 100) == 1 + 3 + 1 + 2
    assert rules.text_size(["x" * 50] * 1000, 100) <= 100 + 1000 + 50   # stops past the bound


@pytest.mark.parametrize("route", ["/v1/chat/completions", "/api/chat"])
def test_body_text_at_the_bound_passes_one_over_is_refused(route):
    body = {"model": "m", "messages": [{"role": "user", "content": "x" * 88}]}
    # "model" 5 + "m" 1; "messages" 8 + 1 item + "role" 4 + "user" 4 + "content" 7 + 88 = 112
    size = rules.text_size(body, 10**9)
    assert rules.check_body_text(body, route, rules.Limits(text_chars=size)) is None
    message = rules.check_body_text(body, route, rules.Limits(text_chars=size - 1))
    assert message.startswith(f"{route}: this request's text is over {size - 1:,} characters, this "
                              f"line's limit per request ({KEY}); messages holds 112 of them")


def test_a_chat_requests_input_ids_and_its_unrendered_messages_are_not_counted():
    body = {"model": "m", "messages": [{"role": "user", "content": "x" * 500}],
            "input_ids": list(range(500))}
    assert rules.check_body_text(body, "/v1/chat/completions", rules.Limits(text_chars=10)) is None
    body.pop("input_ids")
    assert "; messages holds" in rules.check_body_text(body, "/v1/chat/completions",
                                                      rules.Limits(text_chars=10))


# --- on the engine's app --------------------------------------------------------------------------

def _chat_request(path, content, **extra):
    """A chat body for `path` and the count the guard makes of it, on the route's own parsed body
    (the engine's request model)."""
    from sglang.srt.entrypoints.anthropic.protocol import AnthropicMessagesRequest
    from sglang.srt.entrypoints.ollama.protocol import OllamaChatRequest
    from sglang.srt.entrypoints.openai.protocol import ChatCompletionRequest

    body = {"model": "m", "messages": [{"role": "user", "content": content}], **extra}
    if path == "/api/chat":
        body["stream"], model = False, OllamaChatRequest
    elif path == "/v1/messages":
        body["max_tokens"], model = 4, AnthropicMessagesRequest
    else:
        body["max_tokens"], model = 4, ChatCompletionRequest
    return body, rules.text_size(model(**body), 10**9)


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/invocations", "/api/chat",
                                  "/v1/messages"])
def test_a_chat_request_over_the_text_bound_is_refused_before_its_template_runs(
        client, monkeypatch, path):
    """The chat handlers render the template over the messages (the OpenAI ones in the default
    executor, Ollama's and Anthropic's on the HTTP event loop) before generate_request."""
    from sglang.srt.entrypoints import http_server as hs
    from sglang.srt.entrypoints.openai.serving_chat import OpenAIServingChat

    (client, sent), _ = client
    rendered = []
    monkeypatch.setattr(OpenAIServingChat, "_process_messages",
                        lambda self, *a, **k: rendered.append(a))
    monkeypatch.setattr(hs.get_global_state().tokenizer_manager.tokenizer, "apply_chat_template",
                        lambda *a, **k: rendered.append(a), raising=False)
    body, size = _chat_request(path, "y" * 3000)
    _bound(monkeypatch, text_chars=size - 1)
    resp = client.post(path, json=body)
    assert resp.status_code == 400, resp.text
    assert (f"this request's text is over {size - 1:,} characters, this line's limit per request "
            f"({KEY}); messages holds") in resp.text
    assert KEY in resp.text
    assert rendered == [] and sent == []


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/api/chat", "/v1/messages"])
def test_a_chat_request_at_the_text_bound_reaches_the_scheduler(client, monkeypatch, path):
    (client, sent), _ = client
    body, size = _chat_request(path, "y" * 3000)
    _bound(monkeypatch, text_chars=size)
    client.post(path, json=body)
    assert len(sent) == 1                       # rendered, tokenized, checked, dispatched


def test_a_chat_conversation_over_the_bound_goes_as_input_ids(client, monkeypatch):
    """With input_ids the engine's chat handler skips the template: not counted, not refused."""
    (client, sent), _ = client
    body, _ = _chat_request("/v1/chat/completions", "y" * 3000, input_ids=[5, 6, 7])
    _bound(monkeypatch, text_chars=100)
    client.post("/v1/chat/completions", json=body)
    (tokenized,) = sent
    assert list(tokenized.input_ids) == [5, 6, 7]


@pytest.mark.parametrize("path, body", [
    ("/v1/tokenize", {"model": "m", "prompt": "z" * 3000}),
    ("/tokenize", {"model": "m", "prompt": ["z" * 1500, "z" * 1500]}),
    ("/v1/tokenize", {"model": "m", "messages": [{"role": "user", "content": "z" * 3000}]}),
    ("/v1/messages/count_tokens", {"model": "m", "messages": [{"role": "user", "content": "z" * 3000}]}),
    ("/v1/detokenize", {"model": "m", "tokens": [5] * 3000}),
    ("/detokenize", {"model": "m", "tokens": [[5] * 1500, [6] * 1500]}),
])
def test_tokenize_and_detokenize_are_bounded_before_they_run_on_the_loop(client, monkeypatch, path, body):
    """/v1/tokenize, /v1/detokenize and Anthropic's count_tokens tokenize (rendering the template for
    messages) or decode on the HTTP event loop itself: refused over the bound, served under it."""
    (client, _), _ = client
    _bound(monkeypatch, text_chars=2900)
    resp = client.post(path, json=body)
    assert resp.status_code == 400, resp.text
    assert f"is over 2,900 characters, this line's limit per request ({KEY})" in resp.text
    _bound(monkeypatch, text_chars=3100)
    resp = client.post(path, json=body)
    assert resp.status_code == 200, resp.text           # under the bound: the engine's own answer


# --- prompt log-prob entries, the whole request ---------------------------------------------------

def _logprob_body(prompts, positions, k=1000, n=1, **extra):
    ids = [[5 + (i + j) % 900 for j in range(positions)] for i in range(prompts)]
    return {"input_ids": ids if prompts > 1 else ids[0], "return_logprob": True,
            "logprob_start_len": 0, "top_logprobs_num": k,
            "sampling_params": {"max_new_tokens": 1, "n": n,
                                **({"temperature": 1.0} if n > 1 else {})}, **extra}


def test_a_batch_whose_summed_log_prob_entries_pass_the_bound_is_refused(client):
    """Two prompts of 600 positions at top-1000: 600,000 entries each (under the bound alone),
    1,200,000 together, all converted on the HTTP event loop."""
    (client, sent), _ = client
    resp = client.post("/generate", json=_logprob_body(2, 600))
    assert resp.status_code == 400, resp.text
    assert ("this request asks for 1,200,000 prompt log-prob entries (2 prompts; ") in resp.text
    assert f"over this line's limit of 1,000,000 per request, all its prompts and samples together ({LOGPROB_KEY})" in resp.text
    assert sent == []
    client.post("/generate", json=_logprob_body(1, 600))            # one of them alone: sent
    assert len(sent) == 1
    client.post("/generate", json=_logprob_body(2, 500))            # 1,000,000: at the bound, sent
    assert len(sent) == 2


def test_n_samples_multiply_a_prompts_log_prob_entries(client):
    """With n > 1 the engine sends the prompt n times plus once for its prefix, each computing its
    prompt log-probs: 400 positions x top-1000 x (2 + 1) = 1,200,000."""
    (client, sent), _ = client
    resp = client.post("/generate", json=_logprob_body(1, 400, n=2))
    assert resp.status_code == 400, resp.text
    assert "1,200,000 prompt log-prob entries (1 prompt, 3 samples each" in resp.text
    assert sent == []
    resp = client.post("/generate", json=_logprob_body(1, 333, n=2))   # 999,000: passes the guard
    assert "prompt log-prob entries" not in resp.text, resp.text


def test_a_text_batch_is_counted_by_its_utf8_length(client):
    (client, sent), _ = client
    body = {"text": ["a" * 600, "b" * 600], "return_logprob": True, "logprob_start_len": 0,
            "top_logprobs_num": 1000, "sampling_params": {"max_new_tokens": 1}}
    resp = client.post("/generate", json=body)
    assert resp.status_code == 400, resp.text
    assert "1,200,000 prompt log-prob entries (2 prompts;" in resp.text
    assert "counted at one position per UTF-8 byte" in resp.text
    assert sent == []


def test_the_choke_point_counts_a_single_prompts_samples():
    """A single text prompt is counted where its tokens are known, times its samples."""
    tokenized = types.SimpleNamespace(return_logprob=True, top_logprobs_num=10, token_ids_logprob=None,
                                      logprob_start_len=0, sampling_params=types.SimpleNamespace(n=4))
    limits = rules.Limits(logprob_entries=500)
    message = rules.check_logprob_cost(tokenized, 10, limits)            # 10 x 10 x 5 = 500
    assert message is None
    message = rules.check_logprob_cost(tokenized, 11, limits)            # 550
    assert "asks for 550 prompt log-prob entries" in message and "x 5 samples (n 4" in message
    tokenized.sampling_params.n = 1
    assert rules.check_logprob_cost(tokenized, 50, limits) is None      # 500, one sample


def test_drift_leaves_the_chat_routes_as_the_engines_with_a_fallback_line(app_client, monkeypatch):  # noqa: F811
    """An HTTP module whose internals drifted from their pins: no wrap, one fallback line."""
    from sglang.srt.entrypoints import http_server as hs

    from adapter import pins

    real = pins.drifted_touches
    monkeypatch.setattr(pins, "drifted_touches", lambda name: (
        ["sglang.srt.entrypoints.http_server:ollama_chat (expected a, found b)"]
        if name == input_guard.hooks.TEXT_ROUTE_TOUCHES else real(name)))
    def unwrap():
        for route in hs.app.routes:
            call = getattr(getattr(route, "dependant", None), "call", None)
            if getattr(call, "_dsv41_guarded", False):
                route.dependant.call = call.__wrapped__

    unwrap()        # the launcher's wraps, made when app_client built its tokenizer manager
    said = []
    guard = input_guard.hooks.INSTALLED["guard"]
    assert input_guard.hooks.guard_text_routes(hs.app, guard, said.append) == []
    assert said == ["chat-route text bound not added: sglang.srt.entrypoints.http_server:ollama_chat "
                    "(expected a, found b) drifted from its pin; those routes render and tokenize "
                    "as the engine does"]
    assert not any(getattr(getattr(getattr(r, "dependant", None), "call", None), "_dsv41_guarded", False)
                   for r in hs.app.routes)


def test_an_exception_while_wrapping_never_stops_the_server(monkeypatch):
    said = []
    guard = types.SimpleNamespace(limits=rules.Limits())
    monkeypatch.setattr(input_guard.hooks, "guard_text_routes",
                        lambda *a: (_ for _ in ()).throw(RuntimeError("boom")))
    input_guard.hooks.install_text_routes(object(), guard, said.append)
    assert said == ["the chat-route text bound could not be added (RuntimeError: boom); those "
                    "routes render and tokenize as the engine does"]


def test_an_empty_ollama_conversation_is_400_not_the_templates_500(client, monkeypatch):
    """/api/chat renders its messages with the tokenizer's chat template, which raises ValueError on
    an empty conversation (the route's 500: found by the suite's fuzz); refused before it renders.
    One message is rendered and reaches the scheduler (its control)."""
    from sglang.srt.entrypoints import http_server as hs

    (client, sent), _ = client
    rendered = []
    tokenizer = hs.get_global_state().tokenizer_manager.tokenizer
    monkeypatch.setattr(tokenizer, "apply_chat_template",
                        lambda *a, **k: rendered.append(a) or [5, 6], raising=False)
    resp = client.post("/api/chat", json={"model": "m", "messages": [], "stream": False})
    assert resp.status_code == 400, resp.text
    assert ("/api/chat: messages = [] has no message: this engine renders the conversation with the "
            "model's chat template, which needs at least one message") in resp.text
    assert rendered == [] and sent == []
    client.post("/api/chat", json={"model": "m", "messages": [{"role": "user", "content": "hi"}],
                                   "stream": False})
    assert len(rendered) == 1 and len(sent) == 1
