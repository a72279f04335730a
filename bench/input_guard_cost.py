"""Per-request cost of input_guard against what the engine itself spends on the same prompt.

For prompts of 1K, 100K and 1M token ids, one run on this machine, medians of interleaved rounds:

- guard: input_guard's hook as installed, around a stand-in `original` that returns the engine's
  tokenized request for that prompt (built once by the real `_create_tokenized_object`): exactly
  what the hook adds to a request (counter, check of the int64 array, stop ids, top_logprobs_num).
- guard on the list: the same check done on the request's Python list instead (what a check in
  `_validate_one_request` would cost: one more conversion of the list), for comparison.
- reference "ids" (a `/generate` with `input_ids`, no tokenizer): the engine's own request path
  up to the scheduler's receive: orjson parse of the HTTP body, the `/generate` contract check
  (`generate_contract_error`), `_validate_one_request` + `_create_tokenized_object` (stock), the
  IPC to the scheduler (the engine's default SGLANG_USE_PICKLE_IPC: pickle dumps + loads) and
  the scheduler's `Req` for it.
- reference "text": the engine's tokenizer (the tiny CPU model's, `get_tokenizer`) on text of that
  many tokens, plus the same path from `_create_tokenized_object` on.
Not counted in either reference: HTTP I/O, the scheduler's queueing, radix match and admission,
the forward.
So the references are lower bounds of a request's tokenize + schedule time, and the ratios upper
bounds of the guard's share. The tiny model's tokenizer (vocabulary 1024) is cheaper per token
than DeepSeek's (129K): on the cluster "text" is larger.

    .venv/bin/python bench/input_guard_cost.py [--sizes 1000,100000,1000000] [--rounds 7] [--json]
"""
from __future__ import annotations

import argparse
import json
import pathlib
import pickle
import random
import statistics
import sys
import time
import types

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]


def _median_s(fn, rounds: int) -> float:
    times = []
    for _ in range(rounds):
        began = time.perf_counter()
        fn()
        times.append(time.perf_counter() - began)
    return statistics.median(times)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="1000,100000,1000000", help="prompt lengths in token ids")
    ap.add_argument("--rounds", type=int, default=7, help="interleaved rounds per size (default 7)")
    ap.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = ap.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",")]

    sys.path.insert(0, str(REPO_ROOT))
    from adapter.cpu import cpu_engine, models

    cpu_engine.install_torchvision_shim()
    import numpy as np
    import orjson
    from sglang.srt import runtime_context as rc
    from sglang.srt.entrypoints.api_contract import generate_contract_error
    from sglang.srt.managers.io_struct import GenerateReqInput, TokenizedGenerateReqInput
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.managers.tokenizer_manager import TokenizerManager
    from sglang.srt.observability.req_time_stats import APIServerReqTimeStats
    from sglang.srt.sampling.sampling_params import SamplingParams
    from sglang.srt.server_args import ServerArgs
    from sglang.srt.utils.hf_transformers_utils import get_tokenizer

    from adapter import input_guard, installer, keys
    from adapter.table import hooks_of

    ctx = installer.InstallContext("input_guard", keys.parse_env({"DSV41_INPUT_GUARD": "1"}))
    input_guard.install(ctx)
    hook = ctx.hooks[hooks_of("input_guard")[0].target]

    model_dir = models.ensure_model("dense")
    tokenizer = get_tokenizer(str(model_dir))
    vocab = models.VOCAB
    context_len = max(sizes) + 1024
    tm = TokenizerManager.__new__(TokenizerManager)
    tm.model_config = types.SimpleNamespace(vocab_size=vocab, joint_head_config=None, pointer_head=None)
    tm.preferred_sampling_params = None
    tm.sampling_params_class = SamplingParams
    tm.tokenizer = tokenizer
    tm.tokenized_generate_req_type = TokenizedGenerateReqInput
    tm.fake_bootstrap_room_counter = 0
    tm.context_len = context_len
    tm.num_reserved_tokens = 0
    tm.allow_auto_truncate = False
    tm.validate_total_tokens = True
    tm.rid_to_state = {}
    create = TokenizerManager._create_tokenized_object      # stock: the hook is not registered here

    def request(ids, text=None):
        obj = GenerateReqInput(input_ids=ids, text=text,
                               sampling_params={"max_new_tokens": 16, "temperature": 0})
        obj.normalize_batch_and_arguments()
        tm.rid_to_state = {obj.rid: types.SimpleNamespace(time_stats=APIServerReqTimeStats())}
        return obj

    rng = random.Random(23)
    rows = []
    server_args = ServerArgs(model_path="dummy")
    with rc.use_context(rc.create_context(server_args, role="tokenizer")):
        for n in sizes:
            ids = [rng.randrange(3, vocab) for _ in range(n)]
            body = orjson.dumps({"input_ids": ids, "sampling_params": {"max_new_tokens": 16}})
            text = tokenizer.decode(ids)
            text_tokens = len(tokenizer.encode(text, add_special_tokens=False))
            # scale the text to n tokens (decode/encode round trips do not keep the count)
            text = text[: max(1, int(len(text) * n / max(text_tokens, 1)))]
            text_tokens = len(tokenizer.encode(text, add_special_tokens=False))
            obj = request(ids)
            tokenized = create(tm, obj, None, list(ids))

            def guard():
                hook(lambda *a, **k: tokenized, tm, obj, None, None)

            def guard_on_list():
                a = np.asarray(ids, dtype=np.int64)
                input_guard.first_out_of_range(a, vocab)

            def ids_path():
                payload = orjson.loads(body)
                assert generate_contract_error(payload) is None
                o = request(payload["input_ids"])
                tm._validate_one_request(o, o.input_ids)
                t = create(tm, o, None, o.input_ids)
                r = pickle.loads(pickle.dumps(t, protocol=pickle.HIGHEST_PROTOCOL))
                Req(r.rid, r.input_text, r.input_ids, r.sampling_params)

            def text_path():
                o = request(None, text)
                toks = tokenizer.encode(text)
                tm._validate_one_request(o, toks)
                t = create(tm, o, text, toks)
                r = pickle.loads(pickle.dumps(t, protocol=pickle.HIGHEST_PROTOCOL))
                Req(r.rid, r.input_text, r.input_ids, r.sampling_params)

            variants = {"guard": guard, "guard_on_list": guard_on_list, "ids_path": ids_path,
                        "text_path": text_path}
            runs = {name: [] for name in variants}
            for _ in range(args.rounds):                     # interleaved rounds
                for name, fn in variants.items():
                    reps = max(1, min(200, 2_000_000 // n)) if name.startswith("guard") else 1
                    runs[name].append(_median_s(fn, reps))
            med = {name: statistics.median(v) for name, v in runs.items()}
            rows.append({
                "ids": n, "text_tokens": text_tokens,
                "guard_us": med["guard"] * 1e6, "guard_on_list_us": med["guard_on_list"] * 1e6,
                "ids_path_ms": med["ids_path"] * 1e3, "text_path_ms": med["text_path"] * 1e3,
                "guard_share_of_ids_path": med["guard"] / med["ids_path"],
                "guard_share_of_text_path": med["guard"] / med["text_path"],
                "list_check_over_guard": med["guard_on_list"] / med["guard"],
            })
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    print(f"input_guard cost per request ({args.rounds} interleaved rounds, medians; goal < 1 % "
          "of the prompt's own tokenize + request path)")
    print(f"{'ids':>9} {'guard':>10} {'ids path':>10} {'share':>8} {'text path':>11} "
          f"{'share':>8} {'check on list':>14}")
    for r in rows:
        print(f"{r['ids']:>9,} {r['guard_us']:>8.1f}us {r['ids_path_ms']:>8.2f}ms "
              f"{100 * r['guard_share_of_ids_path']:>7.3f}% {r['text_path_ms']:>9.2f}ms "
              f"{100 * r['guard_share_of_text_path']:>7.3f}% {r['guard_on_list_us']:>12.1f}us")
    print("ids path: orjson parse + contract check + _validate_one_request + _create_tokenized_object"
          " + pickle IPC + the scheduler's Req; text path: the tokenizer on text of ~that many tokens + the same"
          " from _validate_one_request on; check on list: the same check on the Python list (one more"
          " conversion)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
