"""More than one rank: the production keys at --tp-size 2 on CPU (gloo process groups). Ranks
that decided differently would hang or diverge; here both ranks log the same decisions."""
import re

from adapter.table import ADAPTERS
from adapter.tools import traffic

from e2e.e2e_configs import PROD_ARGS, PROD_KEYS


def _decisions(run, rank):
    """decode_yield's per-request lines of one rank, without timestamps."""
    return [re.sub(r"^.*?\[dsv41\]", "[dsv41]", ln) for ln in run.lines(f"sglang::scheduler_TP{rank}")
            if "[dsv41] decode_yield rid=" in ln]


def test_production_keys_at_tp2_install_on_both_ranks_and_agree(boots):
    run = boots.run("dense", PROD_KEYS, {**PROD_ARGS, "--tp-size": "2"}, name="dense production tp2")
    assert not run.errors, run.errors
    for adapter in ADAPTERS:
        installed = run.installed_in(adapter)
        assert installed.get("scheduler_TP0") and installed.get("scheduler_TP1"), (adapter, installed)
    tp0, tp1 = _decisions(run, 0), _decisions(run, 1)
    assert tp0 and tp0 == tp1, (tp0, tp1)
    assert run.cadence["long_prompt_completed"]
    # Same token ids as the single-rank stock server; logprobs move in the last bits because the
    # two ranks' partial sums are reduced in another order.
    stock = boots.config("dense", "stock")
    cmp = traffic.compare(stock.records, run.records, tol=1e-3)
    assert cmp.ok, cmp
    print(f"\nTP2: boot {run.boot_s}s, {len(tp0)} decode_yield decisions on each rank, "
          f"max logprob diff vs TP1 stock {cmp.max_logprob_diff:.2e}")
