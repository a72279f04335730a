"""How every `dsv41` command names a profile line and reads it for the CPU harness: the one leaf
module the command modules share (the canary, the gate, the `dsv41` parser), so none of them
imports another for its argument helpers.

- `add_line_args` / `add_cpu_model_arg` / `cpu_models`: `--profile FILE --line NAME [--against
  NAME]` and `--cpu-model`, the same on every command that takes them;
- `load_checked_lines`: the named lines of a profile, their DSV41_* keys parsed, a test-only key
  refused on a line that is not a test line (adapter/tools/profile.py `refuse_test_only`);
- `split_line`: a line's DSV41_* keys, the launch arguments kept on one CPU rank (`KEPT_ARGS`) and
  every other variable and argument with why it is ignored (`IGNORED_WHY`);
- `MODEL_ARGS`: the CPU models' own launch arguments (chunk, pool sizes).

Imports only the key registry and adapter/tools/profile.py (itself a leaf).
"""
from __future__ import annotations

import argparse

from adapter import keys as key_registry

# Launch arguments kept from a profile line (they mean the same on one CPU rank).
KEPT_ARGS = {"--prefill-decode-interval", "--swa-prefix-tails", "--radix-eviction-policy",
             "--radix-eviction-policy-config", "--max-running-requests"}
# Why the others are dropped, by flag (anything not named: "not meaningful on the CPU harness").
IGNORED_WHY = {
    "--tp-size": "one CPU rank (TP 2 on CPU: tests/e2e)", "--nnodes": "one host",
    "--page-size": "dense / swa: the engine's default page for torch_native; dsv4 / dsv41: 256 (the same)",
    "--chunked-prefill-size": "set per CPU model (MODEL_ARGS)",
    "--dsv4-attn-backend": "dsv4 / dsv41: the engine's SM120 route with CPU stand-ins for its "
                           "kernels; flashmla, as the engine resolves it (docs/cpu_server.md)",
    "--kv-cache-dtype": "dense / swa: float32 on CPU; dsv4 / dsv41: the engine's fp8_e4m3 (the same)",
    "--context-length": "the tiny models' own (dense / swa 32K, dsv4 / dsv41 8K)",
    "--model-path": "the tiny CPU models", "--served-model-name": "not used",
}
# Per CPU model: chunk, pool sizes. Dense: 4,096-token chunks, so that the cost model plans more
# than one decode step per chunk at share 33 / 50 (SPEC: at 256 it plans 1, like stock). SWA: a
# small SWA pool (15 % of full) so that traffic evicts sliding windows while full KV stays.
# DeepSeek-V4: the harness's page 256, SWA pool 25 % of full
# (adapter/cpu/server.py MODEL_DEFAULT_ARGS), and --enable-metrics on both boots: swan's served
# calls are read from the engine's /metrics (dsv41_swan_served_total); it changes no output.
MODEL_ARGS = {
    "dense": {"--chunked-prefill-size": "4096", "--max-total-tokens": "40960"},
    "swa": {"--chunked-prefill-size": "1024", "--max-total-tokens": "8192",
            "--swa-full-tokens-ratio": "0.15"},
    # 1024-token chunks (traffic.DSV4_CHUNK): cone's first pass then holds the replay and the
    # resume's new tokens, so rows past the resume point read the copied pages (at 512 = N the
    # engine's checkpoint after the pass points them back at the resident ones).
    "dsv4": {"--chunked-prefill-size": "1024", "--enable-metrics": ""},
    # DeepSeek-V4.1: as dsv4 (1024-token chunks: the lost-window resume is one pass [s, L), where
    # rows >= F read the copied pages, beside the engine's decoder bounded replay a pass that
    # ends where a hit at F's does: docs/swa_cone.md), --enable-metrics for swan's calls
    "dsv41": {"--chunked-prefill-size": "1024", "--enable-metrics": ""},
}
CPU_MODELS = {"dense": "Llama", "swa": "hybrid-SWA Mellum", "dsv4": "DeepSeek-V4", "dsv41": "DeepSeek-V4.1"}


def load_checked_lines(path, *names) -> list:
    """The named lines of a profile, each one's DSV41_* keys parsed and no test-only key on a line
    that is not a test line, so a bad key stops the command before anything boots. Raises
    OSError, profile.ProfileError, keys.ConfigError."""
    from adapter.tools import profile

    lines = [profile.load_line(path, name) for name in names]
    for line in lines:
        key_registry.parse_env(line.env)
        profile.refuse_test_only(line)
    return lines


def split_line(line) -> tuple[dict, dict, dict]:
    """(DSV41_* keys, kept launch args, {ignored name: why}) of a profile line."""
    keys = {k: v for k, v in line.env.items() if k.startswith(key_registry.PREFIX)}
    ignored = {k: "cluster environment (not read on the CPU harness)"
               for k in line.env if not k.startswith(key_registry.PREFIX)}
    args, words, i = {}, list(line.args), 0
    while i < len(words):
        flag = words[i]
        value = ""
        if i + 1 < len(words) and not words[i + 1].startswith("--"):
            value = words[i + 1]
            i += 1
        i += 1
        if flag in KEPT_ARGS:
            args[flag] = value
        else:
            ignored[f"{flag} {value}".strip()] = IGNORED_WHY.get(flag, "not meaningful on the CPU harness")
    return keys, args, ignored


def add_line_args(p: argparse.ArgumentParser, line: str = "production", against: str | None = None,
                  what: str = "the line to install") -> None:
    """The one way to name profile lines: --profile FILE --line NAME [--against NAME]."""
    p.add_argument("--profile", required=True, metavar="FILE",
                   help="profile file with named lines, e.g. .env.tp4.example")
    p.add_argument("--line", default=line, metavar="NAME", help=f"{what} (default {line})")
    if against is not None:
        p.add_argument("--against", default=against, metavar="NAME",
                       help=f"the line it is compared with (default {against})")


def add_cpu_model_arg(p: argparse.ArgumentParser, choices, default) -> None:
    # --cpu-model: the CPU harness's tiny model kind; gate run's --model is a served model name.
    kinds = ", ".join(f"{m} ({CPU_MODELS[m]})" for m in choices if m in CPU_MODELS)
    p.add_argument("--cpu-model", dest="model", choices=choices, default=default,
                   help=f"tiny CPU model: {kinds} (default {default})")


def cpu_models(value: str) -> list[str]:
    """--cpu-model of `dsv41 canary`: one model, a comma list ("dense,dsv4"), "all" (every one)
    or "both" (dense,swa: the default before the DeepSeek-V4 model, kept for scripts)."""
    if value == "all":
        return list(CPU_MODELS)
    if value == "both":
        return ["dense", "swa"]
    models = [m.strip() for m in value.split(",") if m.strip()]
    unknown = [m for m in models if m not in CPU_MODELS]
    if unknown or not models:
        raise argparse.ArgumentTypeError(
            f"unknown CPU model {', '.join(unknown) or repr(value)}: choose from "
            f"{', '.join(CPU_MODELS)} (a comma list), all, or both (dense,swa)")
    return list(dict.fromkeys(models))
