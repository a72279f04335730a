"""swan acts in the real server on CPU: the tiny DeepSeek-V4 (CpuServer(model="dsv4")) on the
engine's production SM12x backend (`flashinfer`: its 256 -> 4 x 64-token page split before every
sparse decode call, with the CPU stand-ins of adapter/cpu/dsv4/flash_mla.py), once stock and once
with DSV41_SWA_NATIVE_DECODE=1 (the harness's swan module directory is the built one,
runtime/build/swan256: verified at install as in the image; this process has no CUDA, so the
router's kernel is the CPU twin, adapter/swan/twin.py).

What the two boots show:
  * swan installs in the scheduler naming the CPU twin, routes the decode calls (<= 64 query rows)
    to it (the first-served line; /metrics dsv41_swan_served_total > 0) and sends only prefill
    rows to the stock split (the one fallback reason);
  * the stock boot's scheduler logs a page split of a decode call; the swan boot's logs none
    (its prefill calls still split);
  * T=0 greedy ids are equal and logprobs within the stock-vs-stock tolerance of
    tests/e2e/test_e2e_dsv4.py (1e-4).
What they do not show: the swan256 module's kernel (its bits are the GPU's); see docs/swan.md.

Cost: two boots (~1-2 min each on 2 shared cores) and ~30 s of traffic each."""
import concurrent.futures
import re

import pytest

from adapter.cpu.server import CpuServer, error_lines, output_of

SHORT = [(i * 37 + 11) % 1000 + 3 for i in range(40)]         # prefill of 40 rows: the decode path
LONG = [(i * 53 + 7) % 1000 + 3 for i in range(300)]          # 300 rows: the engine's prefill path
PAIR = ([(i * 41 + 5) % 1000 + 3 for i in range(48)],         # two at once: a 2-row decode batch
        [(i * 29 + 13) % 1000 + 3 for i in range(56)])
NEW_TOKENS = 6
LOGPROB_TOL = 1e-4                                            # tests/e2e/test_e2e_dsv4.py
SPLIT = "[dsv41-cpu] dsv4 page split: "
SERVED_LINE = re.compile(r"\[dsv41\] swan first in-place decode: (\d+) rows, \d+ heads, topk \d+; "
                         r"kernel CPU twin \(")
PREFILL_REASON = "more than 64 query rows (engine prefill path)"


def _traffic(server) -> dict:
    out = {"short": output_of(server.generate(SHORT, max_new_tokens=NEW_TOKENS)),
           "long": output_of(server.generate(LONG, max_new_tokens=NEW_TOKENS))}
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        pair = list(pool.map(lambda ids: server.generate(ids, max_new_tokens=NEW_TOKENS), PAIR))
    out.update({f"pair{i}": output_of(r) for i, r in enumerate(pair)})
    return out


def _boot(name: str, keys: dict, args: dict) -> dict:
    server = CpuServer(model="dsv4", keys=keys, args=args, name=name)
    try:
        server.start()
        outputs = _traffic(server)
        metrics = ""
        if "--enable-metrics" in args:
            import requests

            metrics = requests.get(server.url + "/metrics", timeout=30).text
        logs = server.process_logs()
        scheduler = [ln for role, text in logs.items() if role.startswith("sglang::scheduler")
                     for ln in text.splitlines()]
        print(f"\n{name}: boot {server.boot_s:.1f} s, logs {server.log_dir}")
        return {"outputs": outputs, "scheduler": scheduler, "metrics": metrics,
                "errors": [e for e in error_lines(logs) if e.startswith("[sglang::scheduler")]}
    finally:
        server.stop()
        assert not server.group_alive()


@pytest.fixture(scope="module")
def boots():
    return {"stock": _boot("dsv4 stock (swan control)", {}, {}),
            "swan": _boot("dsv4 swan (CPU twin)", {"DSV41_SWA_NATIVE_DECODE": "1"},
                          {"--enable-metrics": ""})}


def _samples(text: str, name: str, **labels) -> list:
    """The samples of a series on a /metrics text whose labels include `labels`."""
    from prometheus_client.parser import text_string_to_metric_families

    return [s for family in text_string_to_metric_families(text) for s in family.samples
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())]


def _metric(text: str, name: str, **labels) -> float:
    return sum(s.value for s in _samples(text, name, **labels))


def _splits(lines, path):
    return [ln[ln.index(SPLIT):] for ln in lines if SPLIT + path + "," in ln]


def test_no_scheduler_error(boots):
    for name, boot in boots.items():
        assert not boot["errors"], (name, boot["errors"])


def test_swan_installs_with_the_cpu_twin_and_serves_decode_calls(boots):
    swan = boots["swan"]["scheduler"]
    installed = [ln for ln in swan if "[dsv41] swan installed: " in ln]
    assert len(installed) == 1 and "; kernel CPU twin (no CUDA in this process" in installed[0], installed
    assert "engine SM120 backend flashinfer" in installed[0]
    served = [m for ln in swan for m in [SERVED_LINE.search(ln)] if m]
    assert len(served) == 1 and 1 <= int(served[0].group(1)) <= 64, served
    text = boots["swan"]["metrics"]
    count = _metric(text, "dsv41_swan_served_total", tp_rank="0")
    # every decode forward of every layer is a served call: at least one per generated token
    assert count >= 4 * NEW_TOKENS, count
    fallbacks = {s.labels["reason"] for s in _samples(text, "dsv41_fallbacks_total", adapter="swan")}
    assert fallbacks == {PREFILL_REASON}, fallbacks
    print(f"\nswan: {count:.0f} calls served in place, "
          f"{_metric(text, 'dsv41_fallbacks_total', adapter='swan'):.0f} prefill calls split")


def test_decode_calls_split_in_stock_and_not_with_swan(boots):
    stock, swan = boots["stock"]["scheduler"], boots["swan"]["scheduler"]
    assert _splits(stock, "decode"), "the stock boot logged no page split of a decode call"
    assert not _splits(swan, "decode"), _splits(swan, "decode")
    # prefill rows keep the stock split in both boots
    assert _splits(stock, "prefill") and _splits(swan, "prefill")
    assert not any("stock split was reached" in ln for ln in swan)


def test_greedy_ids_equal_and_logprobs_within_stock_spread(boots):
    stock, swan = boots["stock"]["outputs"], boots["swan"]["outputs"]
    worst = 0.0
    for label, (ids, logprobs) in stock.items():
        ids2, logprobs2 = swan[label]
        assert len(ids) == NEW_TOKENS and ids == ids2, (label, ids, ids2)
        worst = max([worst] + [abs(a - b) for a, b in zip(logprobs, logprobs2)])
    print(f"\nmax logprob diff stock vs swan (CPU twin): {worst:.3g} (tolerance {LOGPROB_TOL})")
    assert worst <= LOGPROB_TOL
