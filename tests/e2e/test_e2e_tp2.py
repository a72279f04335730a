"""The production topology on one machine: the cluster runs one TP rank per node (`--tp-size 4
--nnodes 4`); here the production line boots as `--tp-size 2 --nnodes 2`, two launch processes
on 127.0.0.1 (`--dist-init-addr`, `--node-rank 0/1`; adapter/cpu/server.py `nodes=2`), the TP
group over gloo between them. Ranks that decided differently would hang or diverge; here:
- every rank of both nodes logs its receipts (input_guard in node 0's launcher, which alone
  runs the tokenizer manager);
- both ranks log the same decode-yield decisions (a 12,288-token prompt beside two streams);
- autotune_keep's rank agreement runs across the two nodes (the harness's
  DSV41CPU_AUTOTUNE_AGREE: the engine's own exchange over the TP group, three rounds: first
  boot, caches kept on both, node 1's cache corrupted so both drop);
- the input guard's grammar step bound acts on both ranks alike: an ambiguous grammar beside a
  stream is finished at the same step on both (the verdict agreed over the TP group), the stream
  gets all its tokens and the two ranks still serve together afterwards;
- T=0 outputs equal the single-rank stock boot's.
One boot (it replaced the single-node TP2 boot); the stock boot is the session's shared one."""
import re

from adapter.table import ADAPTERS
from adapter.tools import canary, traffic

from e2e.e2e_configs import PROD_ARGS, PROD_KEYS
from e2e.grammar_traffic import grammar_beside_stream

# The session's shared runs this module reads (booted by conftest's lane ahead of it).
SHARED_BOOTS = [("dense", "stock")]

# Three 4,096-token chunks (two yields on each rank) are enough for the ranks to show they decide
# alike; the single-rank boots run the same prompt (canary.CADENCE_PREFILL).
CADENCE_PREFILL = 12288
# The grammar step bound on this boot, and the planted grammar step over it: the CPU harness makes
# each of xgrammar's accept_token calls sleep PLANTED_STEP_MS first (adapter/cpu/grammar_step.py,
# DSV41CPU_GRAMMAR_STEP_MS, on both nodes), so every grammar step the guard times takes at least
# that long on any machine, fast or loaded, and both ranks must act at the first agreed step.
GRAMMAR_STEP_MS = "5"
PLANTED_STEP_MS = "20"


def _grammar_then_probe(server) -> dict:
    """After the traffic: the grammar beside a stream, then a plain request (ranks that split
    their batches would not answer it)."""
    beside = grammar_beside_stream(server)
    after = server.generate(list(range(5, 45)), 8, timeout=300)
    return {"beside": beside, "after_tokens": len(after.get("output_ids", []))}


def _decisions(run, rank):
    """decode_yield's per-request lines of one rank, without timestamps and without the achieved
    share that ends them (a measurement from the rank's own step timings, for logs and /metrics
    only: it differs between ranks; the decisions before it must not)."""
    lines = [re.sub(r"^.*?\[dsv41\]", "[dsv41]", ln) for ln in run.lines(f"sglang::scheduler_TP{rank}")
             if "[dsv41] decode_yield rid=" in ln]
    return [ln.split("; achieved share", 1)[0] for ln in lines]


def _agreement(run, rank):
    """(round, cache kept|absent) per agreement round the rank logged, and its autotune_keep lines."""
    rounds = [tuple(m.groups()) for ln in run.lines(f"sglang::scheduler_TP{rank}")
              for m in [re.search(r"autotune agreement round (\d) rank (\d): cache (\w+)", ln)] if m]
    keep = [ln for ln in run.dsv41_lines("autotune_keep", f"sglang::scheduler_TP{rank}")
            if " installed:" not in ln]
    return rounds, keep


def test_production_line_on_two_nodes_agrees_across_them_and_equals_stock(boots, tmp_path):
    keys = {**PROD_KEYS, "DSV41_INPUT_GUARD_GRAMMAR_STEP_MS": GRAMMAR_STEP_MS}
    run = canary.run_config("dense", keys, {**PROD_ARGS, "--tp-size": "2"}, nodes=2,
                            scenarios=("equality", "cadence"), name="dense production 2 nodes",
                            cadence_prefill=CADENCE_PREFILL, on_server=_grammar_then_probe,
                            extra_env={"DSV41CPU_AUTOTUNE_AGREE": str(tmp_path / "autotune"),
                                       "DSV41CPU_GRAMMAR_STEP_MS": PLANTED_STEP_MS},
                            progress=lambda msg: print(f"[e2e] {msg}"))
    assert not run.errors, run.errors
    for adapter in ADAPTERS:
        installed = run.installed_in(adapter)
        if canary.install_process(adapter) == "launcher":
            assert installed.get("launcher"), (adapter, installed)
        else:
            assert installed.get("scheduler_TP0") and installed.get("scheduler_TP1"), (adapter, installed)
    # the two schedulers are children of two launch processes (two nodes)
    assert any(role.startswith("node 1 launcher") for role in run.logs)
    tp0, tp1 = _decisions(run, 0), _decisions(run, 1)
    assert tp0 and tp0 == tp1, (tp0, tp1)
    assert run.cadence["long_prompt_completed"]
    # autotune_keep's agreement, across the nodes: same outcome on both ranks every round
    (r0, keep0), (r1, keep1) = _agreement(run, 0), _agreement(run, 1)
    assert [(n, c) for n, _, c in r0] == [(n, c) for n, _, c in r1] == \
        [("1", "kept"), ("2", "kept"), ("3", "absent")], (r0, r1)
    assert any(ln.startswith("[dsv41] autotune_keep kept rank_tp0_pp0_dp0.json") for ln in keep0)
    assert any(ln.startswith("[dsv41] autotune_keep kept rank_tp1_pp0_dp0.json") for ln in keep1)
    assert any("dropped rank_tp0_pp0_dp0.json: another rank cannot load its cache" in ln for ln in keep0)
    # the grammar step bound, agreed: finished on both ranks alike, the stream whole, still in step
    beside = run.extras["beside"]
    assert beside.stream_ok and beside.finished_by_bound, beside.outcome()
    assert "(the slowest of 2 TP ranks)" in beside.grammar_reason, beside.grammar_reason
    finished = [[ln for ln in run.dsv41_lines("input_guard", f"sglang::scheduler_TP{rank}")
                 if "finished a request whose grammar took" in ln] for rank in (0, 1)]
    assert all(len(f) == 1 and "(the slowest of 2 TP ranks)" in f[0] for f in finished), finished
    assert run.extras["after_tokens"] == 8
    # Same token ids as the single-rank stock server; logprobs move in the last bits because the
    # two ranks' partial sums are reduced in another order (measured: within 3e-6).
    stock = boots.config("dense", "stock")
    cmp = traffic.compare(stock.records, run.records, tol=1e-3)
    assert cmp.ok, cmp
    print(f"\n2 nodes x TP1: boot {run.boot_s}s, {len(tp0)} decode_yield decisions on each rank, "
          f"agreement rounds {[c for _, _, c in r0]} on both, max logprob diff vs TP1 stock "
          f"{cmp.max_logprob_diff:.2e}; grammar beside a stream: {beside.outcome()}")
