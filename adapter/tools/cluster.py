"""What the engine resolves for DeepSeek-V4.1 on the cluster, and whether each adapter acts there.

`dsv41 check` runs on a CPU machine, where the engine would resolve a V4.1 line differently from
the four GB10s: `--enable-decoder-swa-bounded-replay`, left unset, resolves on only on CUDA / HIP
(`arg_groups/deepseek_v4_hook.py` `validate_deepseek_v41_features`). So the check's child asks the
engine's own resolver, not a copy of its rules: it parses the line's launch arguments with the
engine's parser, builds the engine's ServerArgs, and runs the engine's cuda-graph resolution and
`validate_deepseek_v41_features` under `override_platform(is_cuda=True, is_sm120=True)` (GB10,
sm_121) with a DeepSeek-V4.1 model config (`model_type` "deepseek_v41"; the checkpoint is not on
this machine). What it reads back is what the engine declares.

Then one verdict per enabled adapter: "acts" or "declines: <why>", from the same conditions each
adapter checks at run time (its fallback reasons), on the resolved values. An adapter whose key
is set but which would decline on every request there is the defect the check reports
(issue 48: cone beside the decoder bounded replay).

Runs inside the check's child only (it imports the engine). Imports nothing of the CPU harness but
the torchvision shim the child already armed.
"""
from __future__ import annotations

import argparse
import types
from typing import Mapping

PLATFORM = {"is_cuda": True, "is_hip": False, "is_npu": False, "is_xpu": False, "is_sm120": True}
PLATFORM_TEXT = "CUDA, GB10 (sm_121)"
MODEL_TYPE = "deepseek_v41"
FIELDS = ("enable_decoder_swa_bounded_replay", "enable_encoder_swa_bounded_replay",
          "chunked_prefill_size", "enable_dp_attention", "pp_size", "page_size",
          "dsv4_attn_backend", "admin_api_key")


def resolve(argv: list[str]) -> dict:
    """{field: value} as the engine resolves the line's launch args for V4.1 on the cluster, plus
    "error" when the engine refuses the line there (its ValueError text)."""
    from sglang.srt.arg_groups.cuda_graph_hook import handle_cuda_graph_config
    from sglang.srt.arg_groups.deepseek_v4_hook import validate_deepseek_v41_features
    from sglang.srt.arg_groups.model_override_base import resolving_view
    from sglang.srt.runtime_context import override_platform
    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser(exit_on_error=False, add_help=False)
    ServerArgs.add_cli_args(parser)
    ns, _ = parser.parse_known_args(["--model-path", "/models/DeepSeek-V4.1-Flash", *argv])
    out: dict = {"platform": PLATFORM_TEXT, "model_type": MODEL_TYPE,
                 "decoder_replay_set_on_line": ns.enable_decoder_swa_bounded_replay is not None}
    with override_platform(**PLATFORM):
        args = ServerArgs.from_cli_args(ns)
        # A configuration a caller supplies is handed back as it is (model_config_of's memo with
        # no source key): the V4.1 checkpoint's config.json is not on this machine.
        args._model_config = types.SimpleNamespace(
            hf_config=types.SimpleNamespace(model_type=MODEL_TYPE))
        args._model_config_built_from = None
        try:
            handle_cuda_graph_config(args)
            validate_deepseek_v41_features(args)
        except ValueError as exc:       # the engine refuses this line for V4.1 there
            out["error"] = str(exc)
        view = resolving_view(args)
        for field in FIELDS:
            out[field] = getattr(view, field, None)
    return out


def verdicts(resolved: Mapping, env: Mapping[str, str], enabled: Mapping[str, bool]) -> dict:
    """{adapter: {"acts": bool, "why": str}} for each enabled adapter on the resolved line."""
    from adapter import keys as key_registry

    settings = key_registry.parse_env(dict(env))
    if resolved.get("error"):
        return {name: {"acts": False, "why": f"the engine refuses this line for V4.1: "
                                             f"{resolved['error']}"}
                for name, on in enabled.items() if on}
    decoder = bool(resolved.get("enable_decoder_swa_bounded_replay"))
    encoder = bool(resolved.get("enable_encoder_swa_bounded_replay"))
    chunk = resolved.get("chunked_prefill_size")
    out = {}
    for name, on in enabled.items():
        if not on:
            continue
        acts, why = True, ""
        if name == "swan":
            from adapter.swan import routing

            # swan's own first check of every call, on a one-row decode call of that backend
            backend = env.get("SGLANG_SM120_FLASHMLA_BACKEND", "flashinfer")
            reason = routing.entry_reason(False, backend, True, 1)
            if reason is not None:
                acts, why = False, f"SGLANG_SM120_FLASHMLA_BACKEND={backend}: {reason}"
            else:
                why = ("V4.1 decode on SM12x goes through flash_mla_with_kvcache_sm120's 256 -> "
                       "4 x 64 page split (SGLANG_SM120_FLASHMLA_BACKEND=flashinfer)")
        elif name == "decode_yield":
            if resolved.get("enable_dp_attention"):
                acts, why = False, "DP attention: the engine keeps the interval in step across DP ranks"
            elif (resolved.get("pp_size") or 1) > 1:
                acts, why = False, "pipeline parallelism: the chunked prompt spans micro-batches"
            else:
                why = f"chunked prefill of {chunk} tokens, TP only"
        elif name == "swa_thin":
            if encoder:
                acts, why = False, ("--enable-encoder-swa-bounded-replay: the cache keeps no SWA "
                                    "window to reorder")
            else:
                why = "V4.1's radix cache is FULL + SWA"
        elif name == "swa_cone":
            from adapter import swa_cone

            tokens = settings.get("DSV41_SWA_CONE_TOKENS")
            declined = [flag for field, flag in swa_cone.ENGINE_REPLAY_FLAGS if resolved.get(field)]
            if declined:
                acts, why = False, (f"{declined[0]} resolves on: cone declines beside it (its own "
                                    "replay owns the compress rows)")
            elif chunk is not None and 0 < chunk < tokens:
                acts, why = False, (f"DSV41_SWA_CONE_TOKENS={tokens} exceeds --chunked-prefill-size "
                                    f"{chunk}: no first pass covers the replay")
            elif decoder:
                why = ("beside the engine's decoder SWA bounded replay (resolved on): a first pass "
                       "that is not the last ends at F"
                       + ("" if chunk == tokens else
                          f" (DSV41_SWA_CONE_TOKENS={tokens} != chunk {chunk}: one pass more)"))
            else:
                why = "decoder SWA bounded replay off: cone's replay as on DeepSeek-V4"
        elif name == "admin_guard" and resolved.get("admin_api_key"):
            why = "--admin-api-key set: the routes the engine's own auth misses need it"
        out[name] = {"acts": acts, "why": why}
    return out


def format_lines(resolved: Mapping, verdict: Mapping) -> list[str]:
    """The check's text: the resolved flags, then one line per enabled adapter."""
    if not resolved:
        return []
    if "error" in resolved and not verdict:
        return [f"on the cluster ({resolved.get('platform', PLATFORM_TEXT)}, {MODEL_TYPE}): "
                f"not resolved ({resolved['error']})"]
    dec = resolved.get("enable_decoder_swa_bounded_replay")
    how = "set on the line" if resolved.get("decoder_replay_set_on_line") else "the engine's default"
    lines = [f"on the cluster ({resolved['platform']}, {MODEL_TYPE}, as the engine resolves the "
             f"line): decoder SWA bounded replay {'on' if dec else 'off'} ({how}), encoder SWA "
             f"bounded replay {'on' if resolved.get('enable_encoder_swa_bounded_replay') else 'off'}"]
    if resolved.get("error"):
        lines.append(f"  the engine refuses this line there: {resolved['error']}")
    width = max((len(n) for n in verdict), default=0)
    for name, v in verdict.items():
        lines.append(f"  {name.ljust(width)}  {'acts' if v['acts'] else 'DECLINES'}"
                     + (f": {v['why']}" if v["why"] else ""))
    return lines
