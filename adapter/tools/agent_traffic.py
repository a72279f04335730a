"""Agent traffic through the engine's own benchmark client (`python -m sglang.bench_serving`).

One seeded trace, written in the client's own dataset formats (no download), replayed against a
running server in five client runs; the client's `--output-file` JSON (with `--output-details
--cache-report`) is read back into rows:

  short    `--dataset-name random-ids` (token ids, `--backend sglang`): short prompts at a fixed
           concurrency; requests/s, output tokens/s, TTFT p50 (the cost of a line).
  agent    `--dataset-name agentic-trace` (`--backend sglang-oai-chat`: each conversation replayed
           turn by turn with the server's real replies fed back): agent sessions of many turns
           whose contexts grow far past the SWA window, then sub-agent conversations (every turn
           moves past its previous checkpoint).
  users    `--dataset-name mooncake` (`--backend sglang`, timed by the trace's `timestamp`, prompts
           built by the client from `hash_ids`, shared leading blocks = shared prefixes): other
           users' long prompts, chunked, needing more SWA slots than are free.
  resume   `--dataset-name agentic-trace`: each session comes back, its first round holding the
           whole history (the replies the server gave in `agent`) plus a new message: the
           resumed turns (TTFT, `cached_tokens` / prompt tokens from the server).
  streams  `--dataset-name mooncake`: two decode streams, then a long prompt arriving while they
           run: the streams' inter-token latencies while the long prompt prefills (read from the
           client's per-request ttft / itl lists and the trace's own arrival times), and that
           prompt's TTFT.

Sizes (SCALES) are scaled to the tiny CPU models; `CLUSTER` holds the seed's cluster figures and
sizes for the reports. The server needs `server_args()` on top of its line's (a chat template
for the chat route, the engine's request log for the T=0 output ids, the pool sizes the scale
was made for).

Reusable entry points (also for `dsv41 canary --traffic agent`):
  server_args(model, scale, workdir) -> {flag: value}   launch args the workload needs
  run_agent_traffic(server, model, scale, workdir, ...) -> dict   one boot's rows (see its doc)
  request_outputs(logs) -> {prompt sha: output ids}   the engine's request log, per prompt
  compare(control_rows, line_rows) -> dict   the line vs control ratios and equality
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import pathlib
import random
import re
import sys
import time
from typing import Callable, Optional

import numpy as np

SEED = 20261205

# The chat route needs a template; the tiny models' tokenizers have none. Each message is
# delimited by the tokenizer's own special tokens, so a history tokenizes the same as a prefix of
# a longer one (the text between two specials is encoded on its own).
CHAT_TEMPLATE = ("{%- for m in messages -%}<s>{{ m['role'] }}\n{{ m['content'] }}</s>{%- endfor -%}"
                 "{%- if add_generation_prompt -%}<s>assistant\n{% endif -%}")

# The seed's cluster figures (SPEC "Features"), printed beside each row as the reference.
CLUSTER = {
    "resume_ttft": "61-64 s -> 3.9/6.5 s (thin; cone: 21.8-68.3 s -> 1.6-2.1 s)",
    "resume_cached": "0 whole-session re-prefills on the line (2 in each control); "
                     "cone: 291,328 of 302,048 prompt tokens cached",
    "stream_rate": "stream rate during a cold 500K prefill 0.080 -> 0.393 of before",
    "stream_itl": "(not measured as ITL on the cluster; rate 0.080 -> 0.393 of before)",
    "long_ttft": "that prompt's first token x1.47 later",
    "short": "speedbench c1/c4 +0.72...+0.99 % (decode yield), greedy c1 +1.36/+1.86 % (swan)",
    "outputs": "T=0 equal on 74 of 75 qeval prompts on which the controls agree",
}
CLUSTER_SIZES = {
    "session": "300-330K tokens (idle sessions), 500K new sessions",
    "window": "SWA window 128 tokens, page 256",
    "chunk": "8192 tokens",
    "swa_pool": "84,480 SWA slots (tails 128) / 182,784 (tails 384)",
    "full_pool": "4,997,632 tokens (tails 128) / 3,444,224 (tails 384)",
    "long_prompt": "500K cold prompt beside two 300K streams",
}


@dataclasses.dataclass(frozen=True)
class Scale:
    """Sizes of one workload, in tokens unless said otherwise."""
    server: tuple                 # ((flag, value), ...) pool / chunk args the sizes were made for
    # agent sessions (idle later, then resumed)
    sessions: int
    session_system: int           # first round: a system message (tool list, repository context)
    session_first: int            #   and the task
    session_turns: int            # rounds before the session goes idle (the first included)
    session_user: int             # each later round: a tool result / user message
    turn_output: int              # tokens the server generates per round (agent, resume)
    agent_concurrency: int
    # sub-agents, between the sessions' turns and their resume
    subagents: int
    subagent_first: int
    subagent_turns: int
    subagent_user: int
    # other users' long prompts (mooncake: prompts of `hash_ids` blocks)
    users: tuple                  # ((timestamp ms, blocks, shared leading blocks), ...)
    user_output: int
    # the resume
    resume_user: int
    resume_turns: int             # rounds after the resume (the resumed one included)
    # streams beside a long prefill
    stream_blocks: int
    stream_output: int
    streams: int
    long_blocks: int
    long_at_ms: int
    long_output: int
    # short traffic
    short_prompts: int
    short_input: int
    short_output: int
    short_concurrency: int
    # harness switches for the server's environment (adapter/cpu/pool_budget.py), ((name, value), ...)
    env: tuple = ()

    def server_args(self) -> dict:
        return dict(self.server)

    def server_env(self) -> dict:
        return dict(self.env)


# Blocks of the mooncake loader: f"{hash_id}" + " ".join(["hi"] * 128) -> 384 tokens each with the
# tiny models' tokenizer (measured by write_trace; the trace records the real counts).
SCALES = {
    # bench/agent_traffic.py. Full pool 32,768 tokens (every session's full KV stays resident),
    # SWA pool 5 % of it (1,638 slots: a 1,024-token chunk plus the live windows fit, the
    # sessions' and sub-agents' passed checkpoints do not), chunks of 1,024.
    ("swa", "bench"): Scale(
        server=(("--max-total-tokens", "32768"), ("--swa-full-tokens-ratio", "0.05"),
                ("--chunked-prefill-size", "1024")),
        sessions=3, session_system=3000, session_first=200, session_turns=5, session_user=120,
        turn_output=16, agent_concurrency=3,
        subagents=4, subagent_first=400, subagent_turns=4, subagent_user=150,
        users=((0, 8, 2), (1500, 8, 2)), user_output=4,
        resume_user=80, resume_turns=2,
        stream_blocks=1, stream_output=400, streams=2, long_blocks=13, long_at_ms=1500,
        long_output=2,
        short_prompts=48, short_input=256, short_output=32, short_concurrency=4),
    # `dsv41 canary --traffic agent`: the canary's own swa pools (canary.MODEL_ARGS["swa"]: full
    # 8,192, SWA 1,228, chunks of 1,024), everything smaller. One user prompt of ~790 tokens (one
    # chunk): with a 3-block prompt (two chunks, 1,024 SWA slots at once) thin kept 1 of the 2
    # sessions (the live windows no longer fit beside the chunk).
    ("swa", "canary"): Scale(
        server=(("--max-total-tokens", "8192"), ("--swa-full-tokens-ratio", "0.15"),
                ("--chunked-prefill-size", "1024")),
        sessions=2, session_system=1000, session_first=100, session_turns=3, session_user=80,
        turn_output=8, agent_concurrency=2,
        subagents=3, subagent_first=250, subagent_turns=3, subagent_user=100,
        users=((0, 2, 0),), user_output=4,
        resume_user=40, resume_turns=1,
        stream_blocks=1, stream_output=300, streams=2, long_blocks=8, long_at_ms=1000,
        long_output=2,
        short_prompts=16, short_input=128, short_output=16, short_concurrency=4),
    # The tiny DeepSeek-V4 (window 128, page 256, 8K context; the engine's DeepSeek-V4 pool, its
    # c4 / c128 compressed caches, cone's forward side): bench/agent_traffic.py --cpu-model dsv4.
    # Full pool 32,768 tokens (every session's full KV stays resident), SWA pool 12.5 % (16 pages
    # of 256), chunks of 1,024 (the canary's for dsv4). Sessions of ~4,700 tokens (18 pages; the
    # model's context is 8K), sub-agents and other users' prompts between their turns take the
    # SWA pages of the sessions' last windows on stock.
    ("dsv4", "bench"): Scale(
        server=(("--max-total-tokens", "32768"), ("--swa-full-tokens-ratio", "0.125"),
                ("--chunked-prefill-size", "1024")),
        sessions=3, session_system=4200, session_first=200, session_turns=3, session_user=100,
        turn_output=16, agent_concurrency=3,
        subagents=4, subagent_first=400, subagent_turns=3, subagent_user=120,
        users=((0, 6, 2), (1500, 6, 2)), user_output=4,
        resume_user=60, resume_turns=2,
        stream_blocks=1, stream_output=200, streams=2, long_blocks=8, long_at_ms=5000,
        long_output=2,
        short_prompts=32, short_input=256, short_output=32, short_concurrency=4),
    # `dsv41 canary --traffic agent` on dsv4: the canary's own dsv4 pools (full 8,192, SWA 2,048 =
    # 8 pages, chunks of 1,024: canary.MODEL_ARGS / adapter/cpu/server.py), everything smaller.
    ("dsv4", "canary"): Scale(
        server=(("--max-total-tokens", "8192"), ("--swa-full-tokens-ratio", "0.25"),
                ("--chunked-prefill-size", "1024")),
        sessions=2, session_system=1000, session_first=100, session_turns=2, session_user=80,
        turn_output=8, agent_concurrency=2,
        subagents=2, subagent_first=300, subagent_turns=2, subagent_user=100,
        users=((0, 3, 0),), user_output=4,
        resume_user=40, resume_turns=1,
        stream_blocks=1, stream_output=300, streams=2, long_blocks=4, long_at_ms=3000,
        long_output=2,
        short_prompts=8, short_input=128, short_output=16, short_concurrency=4),
    # bench/agent_traffic.py --cpu-model dsv4 --scale knobs (issue 43: the engine's own knobs beside
    # ours). The pools are the engine's own sizing, not set by us: no --max-total-tokens, no
    # --swa-full-tokens-ratio (an operator ratio turns the tails-based cap mode off), the cap mode
    # the cluster's V4.1 checkpoint gets (DSV41CPU_DSV4_CAP_SIZING) and a fixed KV budget
    # (DSV41CPU_FREE_MEMORY_MB: 2,627 MB free x --mem-fraction-static 0.3 = 788 MB). The budget
    # is the cluster's trade in proportion: on this model a SWA slot costs 2,075 bytes and a full
    # token 186 (the engine's log), so tails 384 over 128 (98,304 more SWA slots) cost 1.10M full
    # tokens: the engine sized 3,769,088 full tokens at tails 128 and 2,672,640 at 384 (x0.71; the
    # cluster 4,997,632 -> 3,444,224, x0.69). Workload: the dsv4 canary's shape with 1,024-token chunks,
    # sessions of ~2,200 tokens, a 3-chunk prompt beside 2 streams (arriving after their prefill),
    # 12 short prompts: about a minute a boot, for 10 lines x 2-3 boots. Nothing here fills the SWA
    # pool at 128 tails (57,600 slots): 48 sub-agents x 3 turns between the sessions' turns and their
    # resume (one trial boot, 84 s for that run alone) still left both sessions' windows cached on
    # stock (peak "swa token usage" 0.05), so the resume rows of this scale show the lines' costs,
    # not thin's or the tails' effect (the "bench" scales, with an operator ratio, show thin's).
    ("dsv4", "knobs"): Scale(
        server=(("--max-total-tokens", None), ("--swa-full-tokens-ratio", None),
                ("--chunked-prefill-size", "1024")),
        env=(("DSV41CPU_FREE_MEMORY_MB", "2627"), ("DSV41CPU_DSV4_CAP_SIZING", "1")),
        sessions=2, session_system=2000, session_first=100, session_turns=2, session_user=80,
        turn_output=8, agent_concurrency=2,
        subagents=2, subagent_first=300, subagent_turns=2, subagent_user=100,
        users=((0, 3, 0),), user_output=4,
        resume_user=40, resume_turns=1,
        stream_blocks=1, stream_output=300, streams=2, long_blocks=8, long_at_ms=5000,
        long_output=2,
        short_prompts=12, short_input=256, short_output=32, short_concurrency=4),
}
# The tiny DeepSeek-V4.1 (issue 48: the model the line serves; the engine's decoder SWA bounded
# replay on, set by the harness): the dsv4 scales as they are (the same window, page, pools and
# context), `bench/agent_traffic.py --cpu-model dsv41 [--scale knobs]`, `dsv41 canary --traffic
# agent`. Beside the flag every match stops 128 tokens short of its prompt, so the resumed turns'
# cached fractions read a little lower than dsv4's for the same workload.
for _scale in ("bench", "canary", "knobs"):
    SCALES[("dsv41", _scale)] = SCALES[("dsv4", _scale)]
# The SWA window of each CPU model, for the reports.
WINDOW = {"swa": "32 tokens (Mellum sliding_window), page 1",
          "dsv4": "128 tokens, page 256 (the tiny DeepSeek-V4: as the cluster's)",
          "dsv41": "128 tokens, page 256 (the tiny DeepSeek-V4.1: as the cluster's)"}
# Models whose chat route renders with the engine's own encoder (serving_chat: DeepseekV4
# architectures -> chat encoding spec "dsv4", deepseek-recipe's), not a --chat-template.
OWN_CHAT_ENCODING = ("dsv4", "dsv41")


def scale_of(model: str, scale: str) -> Scale:
    try:
        return SCALES[(model, scale)]
    except KeyError:
        have = ", ".join(f"{m}/{s}" for m, s in SCALES)
        raise ValueError(f"no agent-traffic scale {scale!r} for CPU model {model!r} (have {have})") from None


def scaling_table(model: str, scale: str) -> list[dict]:
    """The CPU sizes beside the cluster's, for the reports."""
    sc = scale_of(model, scale)
    args = sc.server_args()
    session = sc.session_system + sc.session_first + sc.session_turns * sc.turn_output \
        + (sc.session_turns - 1) * sc.session_user
    return [
        {"what": "idle session (context when it goes idle)", "cpu": f"~{session} tokens x {sc.sessions}",
         "cluster": CLUSTER_SIZES["session"]},
        {"what": "SWA window", "cpu": WINDOW.get(model, "none"), "cluster": CLUSTER_SIZES["window"]},
        {"what": "prefill chunk", "cpu": f"{args['--chunked-prefill-size']} tokens", "cluster": CLUSTER_SIZES["chunk"]},
        {"what": "full KV pool", "cpu": (f"{args['--max-total-tokens']} tokens" if args.get("--max-total-tokens")
                                         else "the engine's sizing of a fixed KV budget (logged per boot)"),
         "cluster": CLUSTER_SIZES["full_pool"]},
        {"what": "SWA pool", "cpu": (f"{args['--swa-full-tokens-ratio']} of the full pool (every line: an operator "
                                     "ratio turns the engine's tails sizing off)" if args.get("--swa-full-tokens-ratio")
                                     else "the engine's cap mode: request cap + --swa-prefix-tails x (window + page) "
                                          "(logged per boot)"),
         "cluster": CLUSTER_SIZES["swa_pool"]},
        {"what": "long prompt beside streams", "cpu": f"{sc.long_blocks} mooncake blocks (~{sc.long_blocks * 384} "
                                                      f"tokens) beside {sc.streams} streams",
         "cluster": CLUSTER_SIZES["long_prompt"]},
        {"what": "sub-agents / other users", "cpu": f"{sc.subagents} x {sc.subagent_turns} turns; "
                                                    f"{len(sc.users)} long prompts of ~{sc.users[0][1] * 384} tokens",
         "cluster": "sub-agent turns and new 500K sessions"},
    ]


def server_args(model: str, scale: str, workdir) -> dict:
    """Launch args this workload needs on both lines: the scale's pools and chunk, a chat template
    (written into `workdir`; not for dsv4, whose chat route uses the engine's own DeepSeek
    encoder), the engine's request log at level 3 as JSON (each finished
    request's prompt ids and output ids: the T=0 comparison)."""
    workdir = pathlib.Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    args = {**scale_of(model, scale).server_args(),
            "--log-requests": "", "--log-requests-level": "3", "--log-requests-format": "json"}
    if model not in OWN_CHAT_ENCODING:
        template = workdir / "chat_template.jinja"
        template.write_text(CHAT_TEMPLATE)
        args["--chat-template"] = str(template)
    return args


# --- lines beside the engine's own knobs (issue 43) ------------------------------------------------

# Each differs from stock by exactly one engine knob, or is one of ours. swapool: the engine's
# ratio flag at the public 4-Spark TP4 line's value (SPEC: 0.22 there gave 954 tails where the
# default gave 64). 954 tails fit neither the cluster's budget nor this bench's (their SWA slots alone
# would cost more than the whole budget: 401,664 x 15.8 full-token equivalents > 6.33M on the
# cluster), so the flag's own value is the analogue: at the "knobs" scale's budget 0.22 sizes a SWA
# pool of 280,832 slots = 709 tails' worth, at the cluster's ~718 (docs/performance.md).
SWAPOOL_RATIO = "0.22"
KNOB_LINES = {
    "stock": "no DSV41 keys, the control line's args (--prefill-decode-interval 1 --swa-prefix-tails 128)",
    "line": "the production line of .env.tp4.example (its DSV41 keys, --swa-prefix-tails 384)",
    "pdi8": "stock + --prefill-decode-interval 8",
    "pdi16": "stock + --prefill-decode-interval 16",
    "mixed": "stock + --enable-mixed-chunk",
    "half": "stock + --chunked-prefill-size half the scale's chunk",
    "stock384": "stock + --swa-prefix-tails 384",
    "swapool": f"stock + --swa-full-tokens-ratio {SWAPOOL_RATIO} (the engine's ratio sizing: a larger SWA pool)",
    "thin128": "stock + DSV41_SWA_THIN=1 (tails 128: the full KV pool kept)",
    "thin384": "stock + DSV41_SWA_THIN=1 + --swa-prefix-tails 384 (the production line's thin alone)",
}


def knob_lines(names, stock: dict, line: dict, chunk) -> dict:
    """{name: {"keys", "args", "change"}} for the named lines (KNOB_LINES). stock / line: {"keys",
    "args"} of the profile's control and production lines (bench/agent_traffic.py lines());
    chunk: the scale's --chunked-prefill-size (half's is half of it)."""
    one_change = {
        "pdi8": ({}, {"--prefill-decode-interval": "8"}),
        "pdi16": ({}, {"--prefill-decode-interval": "16"}),
        "mixed": ({}, {"--enable-mixed-chunk": ""}),
        "half": ({}, {"--chunked-prefill-size": str(int(chunk) // 2)}),
        "stock384": ({}, {"--swa-prefix-tails": "384"}),
        "swapool": ({}, {"--swa-full-tokens-ratio": SWAPOOL_RATIO}),
        "thin128": ({"DSV41_SWA_THIN": "1"}, {}),
        "thin384": ({"DSV41_SWA_THIN": "1"}, {"--swa-prefix-tails": "384"}),
    }
    out = {}
    for name in names:
        if name not in KNOB_LINES:
            raise ValueError(f"unknown line {name!r} (have {', '.join(KNOB_LINES)})")
        if name in ("stock", "line"):
            base = stock if name == "stock" else line
            out[name] = {"keys": dict(base["keys"]), "args": dict(base["args"]), "change": KNOB_LINES[name]}
            continue
        keys, args = one_change[name]
        out[name] = {"keys": {**stock["keys"], **keys}, "args": {**stock["args"], **args},
                     "change": KNOB_LINES[name]}
    return out


def session_full_tokens(prompt_tokens: int, page: int = 1) -> int:
    """Full-pool tokens a resumed session holds: its resumed prompt, in whole pages."""
    return -(-int(prompt_tokens) // page) * page


# --- the trace, in the client's formats ----------------------------------------------------------

_SYLLABLES = ("ka", "lo", "mi", "ne", "ru", "sa", "to", "vi", "ze", "qu", "the", "and", "ion", "er",
              "st", "ing", "an", "re", "on", "at")


class Texts:
    """Seeded text of a given token length for a tokenizer (words of the tiny models' corpus)."""

    def __init__(self, tokenizer, seed: int):
        self.tok = tokenizer
        self.rng = random.Random(seed)

    def words(self, n: int) -> str:
        return " ".join("".join(self.rng.choice(_SYLLABLES) for _ in range(self.rng.randint(1, 4)))
                        for _ in range(n))

    def text(self, n_tokens: int, tag: str = "") -> str:
        raw = (tag + " " if tag else "") + self.words(n_tokens)      # > 1 token per word
        ids = self.tok.encode(raw, add_special_tokens=False)[:n_tokens]
        return self.tok.decode(ids)

    def count(self, text: str) -> int:
        return len(self.tok.encode(text, add_special_tokens=False))


def mooncake_prompt_tokens(tokenizer, hash_ids) -> int:
    """Tokens of the prompt the 0.5.23 client builds from a mooncake record (one round, no chat
    template in the tokenizer: its fallback 'user: ...' text; sglang/benchmark/datasets/mooncake.py)."""
    base = "".join(f"{h}" + " ".join(["hi"] * 128) for h in hash_ids) + "Tell me a story based on this context."
    return len(tokenizer.encode(f"user: Round 1: {base}", add_special_tokens=False))


@dataclasses.dataclass
class Trace:
    workdir: str
    model: str
    scale: str
    seed: int
    agent: str                    # agentic-trace JSON: sessions, then sub-agents
    users: str                    # mooncake JSONL
    streams: str                  # mooncake JSONL
    sessions: list                # per session: its rounds' messages (for the resume)
    session_ids: list             # indices of the sessions in `agent`'s conversations
    resume_user: list             # per session: the resumed round's new message, then later ones
    stream_index: list            # indices of the streams in the streams run's outputs
    long_index: int
    stream_at_s: list
    long_at_s: float
    meta: dict

    def as_json(self) -> dict:
        return dataclasses.asdict(self)


def load_tokenizer(model: str):
    from transformers import AutoTokenizer

    from adapter.cpu import models

    return AutoTokenizer.from_pretrained(str(models.ensure_model(model)))


def write_trace(workdir, model: str = "swa", scale: str = "bench", seed: int = SEED,
                tokenizer=None) -> Trace:
    """Write the seeded trace files into `workdir`; the same seed gives the same bytes."""
    sc = scale_of(model, scale)
    workdir = pathlib.Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    tok = tokenizer or load_tokenizer(model)
    texts = Texts(tok, seed)

    def turn(messages):
        return {"messages": messages, "prompt_tokens": sum(texts.count(m["content"]) for m in messages)}

    conversations, sessions = [], []
    for s in range(sc.sessions):
        rounds = [[{"role": "system", "content": texts.text(sc.session_system, f"session{s} system")},
                   {"role": "user", "content": texts.text(sc.session_first, f"session{s} task")}]]
        rounds += [[{"role": "user", "content": texts.text(sc.session_user, f"session{s} tool{t}")}]
                   for t in range(1, sc.session_turns)]
        sessions.append(rounds)
        conversations.append([turn(r) for r in rounds])
    for a in range(sc.subagents):
        rounds = [[{"role": "system", "content": texts.text(sc.subagent_first // 2, f"agent{a} system")},
                   {"role": "user", "content": texts.text(sc.subagent_first - sc.subagent_first // 2,
                                                          f"agent{a} task")}]]
        rounds += [[{"role": "user", "content": texts.text(sc.subagent_user, f"agent{a} tool{t}")}]
                   for t in range(1, sc.subagent_turns)]
        conversations.append([turn(r) for r in rounds])
    resume_user = [[texts.text(sc.resume_user, f"session{s} resume{t}") for t in range(sc.resume_turns)]
                   for s in range(sc.sessions)]
    meta = {"generator": "adapter/tools/agent_traffic.py write_trace", "model": model, "scale": scale,
            "seed": seed, "scaling": scaling_table(model, scale)}
    agent = workdir / "agent.json"
    agent.write_text(json.dumps({"metadata": meta, "conversations": conversations}, indent=1))

    # Other users: long prompts; users after the first share its leading blocks (a common system
    # prompt, the Mooncake trace's prefix sharing by hash_ids).
    next_id = 1000 + 100 * (seed % 97)
    users, first = [], None
    for ts, blocks, shared in sc.users:
        own = list(range(next_id, next_id + blocks - (shared if first else 0)))
        next_id += len(own)
        ids = (first[:shared] + own) if first else own
        first = first or ids
        users.append({"timestamp": ts, "input_length": mooncake_prompt_tokens(tok, ids),
                      "output_length": sc.user_output, "hash_ids": ids})
    (workdir / "users.jsonl").write_text("".join(json.dumps(r) + "\n" for r in users))

    streams = []
    for i in range(sc.streams):
        ids = list(range(next_id, next_id + sc.stream_blocks))
        next_id += sc.stream_blocks
        streams.append({"timestamp": 0, "input_length": mooncake_prompt_tokens(tok, ids),
                        "output_length": sc.stream_output, "hash_ids": ids})
    long_ids = list(range(next_id, next_id + sc.long_blocks))
    streams.append({"timestamp": sc.long_at_ms, "input_length": mooncake_prompt_tokens(tok, long_ids),
                    "output_length": sc.long_output, "hash_ids": long_ids})
    (workdir / "streams.jsonl").write_text("".join(json.dumps(r) + "\n" for r in streams))
    meta.update({"users": users, "long_prompt_tokens": streams[-1]["input_length"],
                 "stream_prompt_tokens": [r["input_length"] for r in streams[:-1]],
                 "session_first_tokens": [c[0]["prompt_tokens"] for c in conversations[:sc.sessions]]})
    # the client sorts mooncake records by timestamp (stable): streams first, then the long prompt
    return Trace(str(workdir), model, scale, seed, str(agent), str(workdir / "users.jsonl"),
                 str(workdir / "streams.jsonl"), sessions, list(range(sc.sessions)), resume_user,
                 list(range(sc.streams)), sc.streams, [0.0] * sc.streams, sc.long_at_ms / 1000.0, meta)


def write_resume(trace: Trace, agent_result: dict, path=None) -> str:
    """The resume conversations (agentic-trace): per session, a first round holding its whole
    history with the replies the server gave in the agent run (the client's generated_texts, in
    the client's output order: conversation by conversation, round by round), plus a new message;
    then the later rounds."""
    sc = scale_of(trace.model, trace.scale)
    texts = agent_result["generated_texts"]
    out, k = [], 0
    for s, rounds in enumerate(trace.sessions):
        history = []
        for r in rounds:
            history += r
            history.append({"role": "assistant", "content": texts[k]})
            k += 1
        first = history + [{"role": "user", "content": trace.resume_user[s][0]}]
        conv = [{"messages": first, "prompt_tokens": 0}]
        conv += [{"messages": [{"role": "user", "content": m}], "prompt_tokens": 0}
                 for m in trace.resume_user[s][1:sc.resume_turns]]
        out.append(conv)
    path = pathlib.Path(path or pathlib.Path(trace.workdir) / "resume.json")
    path.write_text(json.dumps({"metadata": {"resume_of": trace.agent}, "conversations": out}, indent=1))
    return str(path)


# --- the engine's client ---------------------------------------------------------------------

# The engine's client is `python -m sglang.bench_serving`, a deprecated alias whose __main__ calls
# `sglang.benchmark.serving.cli_main()`: that function is run here, in this process (one import
# for every run of a bench: its imports take 15-25 s on this machine), with the run's argv. Two
# import stand-ins first, which its module needs on this CPU machine: torchvision (the engine's
# configs import it; adapter/cpu/cpu_engine.py, as the CPU servers use) and, only when the
# package is absent, Hugging Face `datasets` (0.5.23's client imports it at start for its mmmu
# loader; agentic-trace, mooncake and random-ids never call it: a stand-in whose load_dataset
# raises, naming itself).
_CLIENT = None


class ClientError(RuntimeError):
    pass


def client_stand_ins() -> None:
    """The two import stand-ins the client's module needs here (see above)."""
    import importlib.util
    import types

    from adapter.cpu import cpu_engine

    cpu_engine.install_torchvision_shim()
    if "datasets" not in sys.modules and importlib.util.find_spec("datasets") is None:
        stand_in = types.ModuleType("datasets")

        def load_dataset(*args, **kwargs):
            raise RuntimeError("datasets stand-in (adapter/tools/agent_traffic.py): the Hugging "
                               "Face datasets package is not installed")

        stand_in.load_dataset = load_dataset
        sys.modules["datasets"] = stand_in


def client_module():
    """sglang.benchmark.serving, imported once (its import warnings about GPU-only quantization
    methods silenced)."""
    global _CLIENT
    if _CLIENT is None:
        import warnings

        client_stand_ins()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            warnings.simplefilter("ignore", UserWarning)
            from sglang.benchmark import serving
        _CLIENT = serving
    return _CLIENT


def client_argv(base_url: str, tokenizer_dir: str, out_file: str, *, backend: str, dataset: str,
                num_prompts: int, extra: tuple = (), seed: int = SEED) -> list[str]:
    """The client's command line (after `python -m sglang.bench_serving`)."""
    return ["--backend", backend, "--base-url", base_url, "--tokenizer", tokenizer_dir,
            "--dataset-name", dataset, "--num-prompts", str(num_prompts), "--request-rate", "inf",
            "--seed", str(seed), "--output-file", out_file, "--output-details", "--cache-report",
            "--disable-tqdm", *map(str, extra)]


def run_client(argv: list[str], log_path) -> dict:
    """Run the client's cli_main with `argv`, its output to `log_path`; return the JSON line it
    appended to its --output-file."""
    import contextlib

    serving = client_module()
    out_file = pathlib.Path(argv[argv.index("--output-file") + 1])
    if out_file.exists():
        out_file.unlink()
    saved = sys.argv
    code = 0
    with open(log_path, "w") as log, contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
        print("python -m sglang.bench_serving " + " ".join(argv), flush=True)
        sys.argv = ["sglang.bench_serving", *argv]
        try:
            serving.cli_main()
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else 1
        except Exception:  # noqa: BLE001 - the client's own failure, reported with its log
            import traceback

            traceback.print_exc()
            code = 1
        finally:
            sys.argv = saved
    if code or not out_file.exists():
        tail = "\n".join(pathlib.Path(log_path).read_text(errors="replace").splitlines()[-15:])
        raise ClientError(f"sglang.bench_serving failed (exit {code}; log {log_path}):\n{tail}")
    return read_result(out_file)


def read_result(path) -> dict:
    """The client's --output-file: JSON lines, one per run; the last one."""
    lines = [ln for ln in pathlib.Path(path).read_text().splitlines() if ln.strip()]
    if not lines:
        raise ClientError(f"{path}: no result line")
    result = json.loads(lines[-1])
    errors = [e for e in result.get("errors", []) if e]
    if errors:
        raise ClientError(f"{path}: {len(errors)} failed requests, first: {errors[0][:400]}")
    return result


# --- rows from the client's output -------------------------------------------------------------

def pct(values, q) -> Optional[float]:
    values = [v for v in values if v is not None]
    return float(np.percentile(values, q)) if values else None


def short_rows(result: dict) -> dict:
    return {"requests": result["completed"], "request_throughput": result["request_throughput"],
            "output_throughput": result["output_throughput"],
            "ttft_p50_s": result["median_ttft_ms"] / 1000, "ttft_p99_s": result["p99_ttft_ms"] / 1000,
            "itl_p50_s": result["median_itl_ms"] / 1000, "duration_s": result["duration"]}


def turn_records(result: dict, rounds_per_conv: list[int]) -> list[dict]:
    """Per (conversation, round) of a multi-turn run: the client's per-request details."""
    out, k = [], 0
    for c, n in enumerate(rounds_per_conv):
        for r in range(n):
            prompt = result["input_lens"][k]
            cached = (result.get("cached_tokens") or [0] * len(result["input_lens"]))[k]
            out.append({"conversation": c, "round": r, "ttft_s": result["ttfts"][k],
                        "prompt_tokens": prompt, "cached_tokens": cached,
                        "cached_fraction": cached / prompt if prompt else None,
                        "output_tokens": result["output_lens"][k], "text": result["generated_texts"][k]})
            k += 1
    if k != len(result["ttfts"]):
        raise ClientError(f"{k} rounds expected, the client reported {len(result['ttfts'])}")
    return out


def resume_rows(result: dict, trace: Trace) -> dict:
    sc = scale_of(trace.model, trace.scale)
    turns = turn_records(result, [sc.resume_turns] * sc.sessions)
    resumed = [t for t in turns if t["round"] == 0]
    return {"resumed": resumed, "later": [t for t in turns if t["round"] > 0],
            "ttft_p50_s": pct([t["ttft_s"] for t in resumed], 50),
            "ttft_p99_s": pct([t["ttft_s"] for t in resumed], 99),
            "cached_fraction": (sum(t["cached_tokens"] for t in resumed)
                                / max(1, sum(t["prompt_tokens"] for t in resumed)))}


def agent_rows(result: dict, trace: Trace) -> dict:
    sc = scale_of(trace.model, trace.scale)
    turns = turn_records(result, [sc.session_turns] * sc.sessions + [sc.subagent_turns] * sc.subagents)
    later = [t for t in turns if t["round"] > 0]
    return {"turns": turns, "ttft_p50_s": pct([t["ttft_s"] for t in turns], 50),
            "later_rounds_cached_fraction": (sum(t["cached_tokens"] for t in later)
                                             / max(1, sum(t["prompt_tokens"] for t in later)))}


def users_rows(result: dict) -> dict:
    return {"ttft_s": result["ttfts"], "prompt_tokens": result["input_lens"],
            "cached_tokens": result.get("cached_tokens")}


def stream_rows(result: dict, trace: Trace) -> dict:
    """The streams' inter-token gaps that overlap the long prompt's prefill window [arrival,
    arrival + its TTFT] (arrival: the trace's timestamp; the client starts each record at it),
    their rate in that window over their rate before it, and the long prompt's TTFT."""
    long_ttft = result["ttfts"][trace.long_index]
    w0, w1 = trace.long_at_s, trace.long_at_s + long_ttft
    gaps, during, before, ended_early = [], 0, 0, 0
    first_token = []
    for i, at in zip(trace.stream_index, trace.stream_at_s):
        t = at + result["ttfts"][i]
        first_token.append(t)
        times = [t]
        for itl in result["itls"][i]:
            t += itl
            times.append(t)
        if times[-1] < w1:
            ended_early += 1
        for a, b in zip(times, times[1:]):
            if b > w0 and a < w1:
                gaps.append(b - a)
        during += sum(w0 < x <= w1 for x in times)
        lo = max(first_token[-1], 0.0)
        before += sum(lo < x <= w0 for x in times)
    span_before = max(w0 - max(first_token), 1e-9)
    rate_before = before / span_before / len(trace.stream_index)
    rate_during = during / max(w1 - w0, 1e-9) / len(trace.stream_index)
    return {"long_ttft_s": long_ttft, "long_prompt_tokens": result["input_lens"][trace.long_index],
            "window_s": [w0, w1], "gaps": len(gaps),
            "itl_p50_s": pct(gaps, 50), "itl_p90_s": pct(gaps, 90), "itl_p99_s": pct(gaps, 99),
            "itl_max_s": max(gaps) if gaps else None,
            "rate_before_tok_s": rate_before, "rate_during_tok_s": rate_during,
            "rate_ratio": rate_during / rate_before if rate_before else None,
            "streams_ended_before_first_token": ended_early, "itl_gaps_s": gaps}


# --- one boot ----------------------------------------------------------------------------------

def _flush(server) -> None:
    server.flush_cache(wait_s=60)


def run_agent_traffic(server, *, model: str = "swa", scale: str = "bench", workdir,
                      seed: int = SEED, progress: Optional[Callable[[str], None]] = None,
                      trace: Optional[Trace] = None, profile_tokens: Optional[int] = None) -> dict:
    """Run the five client runs against a running server (launched with server_args(model,
    scale, workdir) on top of its line's) and return this boot's rows:

      {"trace": Trace json, "phases": {name: [t0, t1] unix s}, "client_s": s,
       "short": short_rows, "agent": agent_rows, "users": users_rows, "resume": resume_rows,
       "streams": stream_rows, "profile": {...} (when profile_tokens)}

    The radix cache is flushed before `agent` and before `streams`. profile_tokens: afterwards,
    a cold prompt of that many tokens and the same prompt + 64 tokens, each timed alone
    (/generate, one new token): what a re-prefill and a cache hit cost on this server."""
    say = progress or (lambda msg: None)
    workdir = pathlib.Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    sc = scale_of(model, scale)
    trace = trace or write_trace(workdir, model, scale, seed)
    from adapter.cpu import models

    tok_dir = str(models.ensure_model(model))
    rows: dict = {"trace": trace.as_json(), "phases": {}}
    began = time.monotonic()

    def client(name, **kw):
        say(f"client: {name}")
        t0 = time.time()
        argv = client_argv(server.url, tok_dir, str(workdir / f"{name}.result.jsonl"), seed=seed, **kw)
        result = run_client(argv, workdir / f"{name}.client.log")
        rows["phases"][name] = [t0, time.time()]
        return result

    cpu0 = server_cpu_s(server)
    rows["short"] = short_rows(client(
        "short", backend="sglang", dataset="random-ids", num_prompts=sc.short_prompts,
        extra=("--tokenize-prompt", "--random-input-len", sc.short_input, "--random-output-len",
               sc.short_output, "--random-range-ratio", "1.0", "--max-concurrency",
               sc.short_concurrency, "--warmup-requests", "1")))
    cpu1 = server_cpu_s(server)
    n_short = sc.short_prompts + 1           # + the client's warmup request
    rows["short"]["cpu_ms_per_request"] = {role: round(1000 * (cpu1[role] - cpu0.get(role, 0.0)) / n_short, 2)
                                           for role in cpu1}
    _flush(server)
    n_conv = sc.sessions + sc.subagents
    agent = client("agent", backend="sglang-oai-chat", dataset="agentic-trace", num_prompts=n_conv,
                   extra=("--dataset-path", trace.agent, "--sharegpt-output-len", sc.turn_output,
                          "--max-concurrency", sc.agent_concurrency, "--warmup-requests", "0"))
    rows["agent"] = agent_rows(agent, trace)
    rows["users"] = users_rows(client(
        "users", backend="sglang", dataset="mooncake", num_prompts=len(sc.users),
        extra=("--dataset-path", trace.users, "--mooncake-num-rounds", "1",
               "--mooncake-slowdown-factor", "1", "--warmup-requests", "0")))
    resume_path = write_resume(trace, agent, workdir / "resume.json")
    rows["resume"] = resume_rows(client(
        "resume", backend="sglang-oai-chat", dataset="agentic-trace", num_prompts=sc.sessions,
        extra=("--dataset-path", resume_path, "--sharegpt-output-len", sc.turn_output,
               "--max-concurrency", "1", "--warmup-requests", "0")), trace)
    _flush(server)
    rows["streams"] = stream_rows(client(
        "streams", backend="sglang", dataset="mooncake", num_prompts=sc.streams + 1,
        extra=("--dataset-path", trace.streams, "--mooncake-num-rounds", "1",
               "--mooncake-slowdown-factor", "1", "--warmup-requests", "0")), trace)
    if profile_tokens:
        say("profile: a re-prefill and a cache hit, each alone")
        rows["profile"] = profile_prefill(server, profile_tokens, seed)
    rows["client_s"] = round(time.monotonic() - began, 1)
    return rows


def server_cpu_s(server) -> dict:
    """CPU seconds (user + system) used so far by the server's processes, by role: "scheduler"
    (the model forward and the radix cache: where the line's scheduler hooks run), "launcher"
    (HTTP + tokenizer manager), "detokenizer". Less sensitive to other load on the machine than
    wall time."""
    import psutil

    out: dict = {}
    for pid, title in list(server.roles.items()):
        title = str(title)
        role = ("scheduler" if title.startswith("sglang::scheduler") else
                "detokenizer" if title.startswith("sglang::detokenizer") else
                "launcher" if title.startswith("launcher") else None)
        if role is None:
            continue
        try:
            t = psutil.Process(pid).cpu_times()
        except psutil.Error:
            continue
        out[role] = out.get(role, 0.0) + t.user + t.system
    return out


def profile_prefill(server, tokens: int, seed: int = SEED) -> dict:
    """What a cold prompt of `tokens` and a cache hit on it (+64 new tokens) cost, each alone."""
    rng = random.Random(seed + tokens)
    prompt = [rng.randrange(3, 1024) for _ in range(tokens)]
    turn = [rng.randrange(3, 1024) for _ in range(64)]
    _flush(server)
    t0 = time.monotonic()
    server.generate(prompt, max_new_tokens=1)
    cold = time.monotonic() - t0
    t0 = time.monotonic()
    hit = server.generate(prompt + turn, max_new_tokens=1)
    warm = time.monotonic() - t0
    _flush(server)
    return {"tokens": tokens, "cold_prefill_s": cold, "hit_plus_64_s": warm,
            "hit_cached_tokens": int(hit["meta_info"]["cached_tokens"]),
            "cold_over_hit": cold / warm if warm else None}


# --- the server's side -------------------------------------------------------------------------

_REQ_RE = re.compile(r'(\{"timestamp": "[^"]*", "event": "request\.finished".*\})\s*$')


def request_outputs(logs: dict, since: float = 0.0, until: float = float("inf")) -> dict:
    """{sha256 of the prompt ids: output ids} of every request the engine logged as finished
    (`--log-requests --log-requests-level 3 --log-requests-format json`), health checks left out;
    `since` / `until`: unix seconds of the log's timestamp."""
    import datetime

    out = {}
    for text in logs.values():
        for line in text.splitlines():
            m = _REQ_RE.search(line)
            if not m:
                continue
            try:
                rec = json.loads(m.group(1))
            except json.JSONDecodeError:
                continue
            if str(rec.get("rid", "")).startswith("HEALTH_CHECK"):
                continue
            ts = datetime.datetime.fromisoformat(rec["timestamp"]).timestamp()
            if not since <= ts <= until:
                continue
            ids = (rec.get("obj") or {}).get("input_ids")
            outs = (rec.get("out") or {}).get("output_ids")
            if not isinstance(ids, list) or outs is None:
                continue
            key = hashlib.sha256(json.dumps(ids).encode()).hexdigest()[:16]
            out[key] = list(outs)
    return out


def compare_outputs(reference: dict, other: dict) -> dict:
    """T=0 outputs of the same prompts on two boots."""
    keys = sorted(set(reference) | set(other))
    same = [k for k in keys if k in reference and k in other and reference[k] == other[k]]
    return {"equal": len(same), "total": len(keys),
            "only_one_side": sum((k in reference) != (k in other) for k in keys)}


_POOL_RE = re.compile(r"swa size: (\d+), full size: (\d+)")
# The DeepSeek-V4 pool configurator's own lines (pool_configurator.py): the sizes it chose and how.
_DSV4_POOL_RE = re.compile(r"DSV4 pool sizes: full=(\d+), swa=(\d+)")
_DSV4_CAP_RE = re.compile(r"DSV4 SWA sizing: mode=cap, swa_tokens=(\d+), .*prefix_tails=(\d+)")
_DSV4_RATIO_RE = re.compile(r"DSV4 SWA sizing: mode=ratio \((\w+)\), swa_tokens=(\d+), swa_full_tokens_ratio=([\d.]+)")


def pool_sizes(logs: dict) -> Optional[dict]:
    """{"swa": slots, "full": tokens} as the engine logged them; on DeepSeek-V4 also how the SWA
    pool was sized: "mode" "cap" (+ "tails": --swa-prefix-tails) or "ratio (explicit|default)"
    (+ "ratio")."""
    for text in logs.values():
        m = _POOL_RE.search(text)
        if m:
            return {"swa": int(m.group(1)), "full": int(m.group(2))}
        m = _DSV4_POOL_RE.search(text)
        if m:
            out = {"swa": int(m.group(2)), "full": int(m.group(1))}
            cap, ratio = _DSV4_CAP_RE.search(text), _DSV4_RATIO_RE.search(text)
            if cap:
                out.update(mode="cap", tails=int(cap.group(2)))
            elif ratio:
                out.update(mode=f"ratio ({ratio.group(1)})", ratio=float(ratio.group(3)))
            return out
    return None


def dsv41_lines(logs: dict, what: str) -> list[str]:
    out = []
    for text in logs.values():
        for line in text.splitlines():
            if f"[dsv41] {what}" in line:
                entry = line[line.index("[dsv41]"):].strip()
                if entry not in out:
                    out.append(entry)
    return out


def compare(control: dict, line: dict) -> dict:
    """Line vs control from one boot each (the canary's view): ratios of the rows."""
    def ratio(a, b):
        return a / b if a and b else None

    return {
        "resume_ttft_p50": {"control_s": control["resume"]["ttft_p50_s"], "line_s": line["resume"]["ttft_p50_s"],
                            "control_over_line": ratio(control["resume"]["ttft_p50_s"], line["resume"]["ttft_p50_s"])},
        "resume_cached_fraction": {"control": control["resume"]["cached_fraction"],
                                   "line": line["resume"]["cached_fraction"]},
        "stream_itl_p99": {"control_s": control["streams"]["itl_p99_s"], "line_s": line["streams"]["itl_p99_s"]},
        "stream_itl_p50": {"control_s": control["streams"]["itl_p50_s"], "line_s": line["streams"]["itl_p50_s"]},
        "stream_rate_ratio": {"control": control["streams"]["rate_ratio"], "line": line["streams"]["rate_ratio"]},
        "long_ttft": {"line_over_control": ratio(line["streams"]["long_ttft_s"], control["streams"]["long_ttft_s"])},
        "short_throughput": {"line_over_control": ratio(line["short"]["request_throughput"],
                                                        control["short"]["request_throughput"])},
        "short_ttft_p50": {"line_over_control": ratio(line["short"]["ttft_p50_s"], control["short"]["ttft_p50_s"])},
        "resumed_texts_equal": sum(a["text"] == b["text"] for a, b in
                                   zip(control["resume"]["resumed"], line["resume"]["resumed"])),
    }


# --- decode yield's fitted cost model (`dsv41 calibrate yield`) on this server -----------------

# The calibration traffic `dsv41 calibrate yield` fits (docs/decode_yield.md, "Calibrate"), at
# sizes this model's pools hold: lone prompts of whole chunks (>= 5 each), then decode alone at
# 1, 2 and 4 rows and 2 rows of long context, 200 tokens each (5 log lines at the engine's
# --decode-log-interval 40).
CALIBRATION = {"swa": {"prompts": (6144, 5120), "decode": ((1, 32), (2, 32), (4, 32), (2, 3072)),
                       "new_tokens": 200}}
CALIBRATION["dsv4"] = CALIBRATION["swa"]       # within the tiny DeepSeek-V4's 8K context
CALIBRATION["dsv41"] = CALIBRATION["swa"]      # and the tiny DeepSeek-V4.1's


def scheduler_log(server) -> pathlib.Path:
    pids = [pid for pid, title in server.roles.items() if str(title).startswith("sglang::scheduler")]
    if len(pids) != 1:
        raise RuntimeError(f"expected one scheduler process, found {pids} ({server.roles})")
    return pathlib.Path(server.log_dir) / f"{pids[0]}.log"


def calibrate_yield(server, workdir, model: str = "swa", seed: int = SEED,
                    progress: Optional[Callable[[str], None]] = None) -> dict:
    """Send the calibration traffic and fit the scheduler's log lines it produced with
    `dsv41 calibrate yield`'s fit (adapter/tools/calibrate.py). Returns the fit (its "value" is
    DSV41_DECODE_YIELD_MODEL)."""
    import concurrent.futures as cf

    from adapter.tools import calibrate

    say = progress or (lambda msg: None)
    spec = CALIBRATION[model]
    log = scheduler_log(server)
    _flush(server)
    start = log.stat().st_size
    rng = random.Random(seed + 1)

    def ids(n):
        return [rng.randrange(3, 1024) for _ in range(n)]

    for n in spec["prompts"]:
        say(f"calibration: a lone {n}-token prompt")
        _flush(server)
        server.generate(ids(n), max_new_tokens=1)
    for rows, prompt_tokens in spec["decode"]:
        say(f"calibration: decode alone, {rows} rows of {prompt_tokens}-token prompts")
        _flush(server)
        prompts = [ids(prompt_tokens) for _ in range(rows)]
        with cf.ThreadPoolExecutor(rows) as pool:
            list(pool.map(lambda p: server.generate(p, max_new_tokens=spec["new_tokens"]), prompts))
    _flush(server)
    time.sleep(0.5)
    with open(log, "rb") as f:
        f.seek(start)
        part = f.read()
    sliced = pathlib.Path(workdir) / "calibration-scheduler.log"
    sliced.write_bytes(part)
    fit = calibrate.fit([sliced])
    say(f"calibration: {fit['profile_line']}")
    return fit


# --- `dsv41 canary --traffic agent` --------------------------------------------------------------

def canary_setup(model: str, workdir) -> tuple[dict, Callable]:
    """For `dsv41 canary --traffic agent` (the same workload, scale "canary": the canary's own swa
    pools and chunk, fewer and shorter conversations): (launch args to add to BOTH boots' args,
    an `on_server` callback for canary.run_config: it runs the workload after the canary's own
    traffic and returns {"agent_traffic": run_agent_traffic(...) rows}, which lands in
    run.extras). The canary flushes the cache between its scenarios; this workload flushes its
    own. Without a fitted DSV41_DECODE_YIELD_MODEL on the line, decode yield uses the cluster
    constants, which plan about one decode step per CPU chunk (SPEC): the stream rows then show
    little of its effect."""
    base = pathlib.Path(workdir)
    args = server_args(model, "canary", base)
    trace = write_trace(base / "trace", model, "canary")

    def on_server(server):
        boot_dir = pathlib.Path(server.log_dir) / "agent_traffic"
        return {"agent_traffic": run_agent_traffic(server, model=model, scale="canary", workdir=boot_dir,
                                                   trace=trace)}

    return args, on_server


def canary_report(control, line) -> dict:
    """The canary's agent-traffic rows from its two runs (canary.ConfigRun: .extras, .logs):
    compare() of their rows, plus the T=0 output ids of the conversations' turns (the engine's
    request log) line vs control."""
    c, ln = control.extras.get("agent_traffic"), line.extras.get("agent_traffic")
    if not c or not ln:
        return {"ok": False, "error": "agent traffic did not run on both boots"}

    def conv(run, rows):
        ph = rows["phases"]
        return request_outputs(run.logs, ph["agent"][0], ph["resume"][1])

    out = compare(c, ln)
    out["outputs"] = compare_outputs(conv(control, c), conv(line, ln))
    out["ok"] = out["outputs"]["equal"] == out["outputs"]["total"] > 0
    return out


def canary_lines(report: dict) -> list[str]:
    """Table lines for the canary's report."""
    if not report.get("ok") and "error" in report:
        return [f"agent traffic: {report['error']}"]

    def f(v, unit=""):
        return "n/a" if v is None else f"{v:.3g}{unit}"

    r = report
    return [
        f"agent traffic (sglang.bench_serving): resumed-turn TTFT p50 control {f(r['resume_ttft_p50']['control_s'], ' s')}"
        f" -> line {f(r['resume_ttft_p50']['line_s'], ' s')}; cached fraction "
        f"{f(r['resume_cached_fraction']['control'])} -> {f(r['resume_cached_fraction']['line'])}",
        f"agent traffic: stream ITL p50 / p99 beside a long prefill control {f(r['stream_itl_p50']['control_s'], ' s')}"
        f" / {f(r['stream_itl_p99']['control_s'], ' s')} -> line {f(r['stream_itl_p50']['line_s'], ' s')} / "
        f"{f(r['stream_itl_p99']['line_s'], ' s')}; rate during/before {f(r['stream_rate_ratio']['control'])} -> "
        f"{f(r['stream_rate_ratio']['line'])}; long prompt TTFT x{f(r['long_ttft']['line_over_control'])}",
        f"agent traffic: short traffic line/control requests/s {f(r['short_throughput']['line_over_control'])}, "
        f"TTFT p50 {f(r['short_ttft_p50']['line_over_control'])}",
        f"agent traffic: T=0 output ids of the conversations' turns {r['outputs']['equal']} of {r['outputs']['total']}",
    ]
