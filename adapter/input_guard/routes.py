"""Every route of the engine's HTTP app, by what it sends the scheduler (no engine import: the
route table itself is walked by tests/test_input_guard.py)."""
from __future__ import annotations

# Every route of the engine's HTTP app (sglang.srt.entrypoints.http_server `app`, its included
# routers walked), by what it sends the scheduler. tests/test_input_guard.py walks the real route
# table: a route the engine adds fails it until it is classified here, and every REQUEST route is
# driven through the real app and tokenizer manager to the dispatch, through the check.
REQUEST = "request: builds a GenerateReqInput / EmbeddingReqInput -> TokenizerManager.generate_request -> _create_tokenized_object (the check)"
SESSION = "session: refused by input_guard (sessions off)"
ADMIN = "admin: closed by admin_guard"
NO_REQUEST = "sends the scheduler no request a client shapes"
TEXT_BOUNDED = (" (its text bounded before the handler tokenizes or decodes it: "
                "DSV41_INPUT_GUARD_MAX_TEXT_CHARS)")
ROUTES = {
    "/generate": REQUEST, "/v1/completions": REQUEST, "/v1/chat/completions": REQUEST,
    "/v1/messages": REQUEST, "/api/generate": REQUEST, "/api/chat": REQUEST,
    "/vertex_generate": REQUEST, "/invocations": REQUEST, "/v1/responses": REQUEST,
    "/v1/score": REQUEST, "/v1/decisions": REQUEST, "/v1/systemone": REQUEST,
    "/encode": REQUEST, "/classify": REQUEST, "/v1/embeddings": REQUEST, "/v1/classify": REQUEST,
    "/v1/rerank": REQUEST, "/v1/audio/transcriptions": REQUEST, "/v1/realtime": REQUEST,
    "/health_generate": REQUEST + " (the engine's own fixed probe)",
    "/health": REQUEST + " (the engine's own fixed probe)",
    "/open_session": SESSION, "/close_session": SESSION,
    # read-only or tokenizer-only: nothing reaches the scheduler, or only the engine's own queries
    "/openapi.json": NO_REQUEST, "/docs": NO_REQUEST, "/docs/oauth2-redirect": NO_REQUEST,
    "/redoc": NO_REQUEST, "/v1/loads": NO_REQUEST, "/ready": NO_REQUEST,
    "/get_model_info": NO_REQUEST, "/model_info": NO_REQUEST,
    "/get_server_info": NO_REQUEST + " (admin_guard redacts its keys)",
    "/server_info": NO_REQUEST + " (admin_guard redacts its keys)",
    "/get_hicache_l3_cache_layout": NO_REQUEST, "/parse_function_call": NO_REQUEST,
    "/separate_reasoning": NO_REQUEST,
    # tokenized / decoded in the handler on the HTTP event loop: text bounded before (issue 50)
    "/tokenize": NO_REQUEST + TEXT_BOUNDED, "/v1/tokenize": NO_REQUEST + TEXT_BOUNDED,
    "/detokenize": NO_REQUEST + TEXT_BOUNDED, "/v1/detokenize": NO_REQUEST + TEXT_BOUNDED,
    "/v1/models": NO_REQUEST,
    "/v1/models/{model:path}": NO_REQUEST, "/v1/responses/{response_id}": NO_REQUEST,
    "/v1/responses/{response_id}/cancel": NO_REQUEST + " (aborts that response's own rid)",
    "/": NO_REQUEST, "/api/tags": NO_REQUEST, "/api/show": NO_REQUEST,
    "/v1/messages/count_tokens": NO_REQUEST + TEXT_BOUNDED, "/ping": NO_REQUEST,
}
