"""`dsv41 sim all --plot DIR`: every simulation once, PNG plots and a short text report.

Each sim runs through its own `--json` interface (the same fields other tools read), in this
process, on the real engine classes: decode yield at shares 33 and 50, swa_thin per tails value,
cone replay, autotune_keep's boot sequence. Writes DIR/yield_cadence.png, DIR/thin_resume.png,
DIR/cone_prefill.png, DIR/report.txt and DIR/results.json.
"""
from __future__ import annotations

import argparse
import contextlib
import importlib
import io
import json
import pathlib
import sys

CLUSTER = {"yield": {33: 0.393, 50: 0.524, "stock": 0.080},
           "cone": {"cached": 291_328, "prompt": 302_048}}


def run_json(module: str, argv: list[str]) -> dict:
    """Run `dsv41 sim ...` with --json in this process and parse what it prints."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = importlib.import_module(module).main([*argv, "--json"])
    if code:
        raise RuntimeError(f"{module} {argv} exited {code}")
    return json.loads(out.getvalue())


def collect(tails: list[int], shares: list[int]) -> dict:
    return {
        "yield": {s: run_json("adapter.tools.sims.decode_yield", ["--share", str(s)]) for s in shares},
        "thin": {t: run_json("adapter.tools.sims.swa_thin", ["--tails", str(t)]) for t in tails},
        "cone": run_json("adapter.tools.sims.swa_cone", []),
        "autotune": run_json("adapter.tools.sims.autotune_keep", []),
    }


def plot(results: dict, out: pathlib.Path) -> list[pathlib.Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    files = []
    shares = sorted(results["yield"])
    fig, ax = plt.subplots(figsize=(6, 4))
    xs = range(len(shares))
    ax.bar([x - 0.2 for x in xs], [results["yield"][s]["cadence_stock"] for s in shares], 0.4,
           label="stock (sim)")
    ax.bar([x + 0.2 for x in xs], [results["yield"][s]["cadence_yield"] for s in shares], 0.4,
           label="decode yield (sim)")
    ax.scatter([x + 0.2 for x in xs], [CLUSTER["yield"].get(s, float("nan")) for s in shares],
               color="black", marker="x", zorder=3, label="cluster, yield")
    ax.axhline(CLUSTER["yield"]["stock"], color="gray", ls=":", label="cluster, stock")
    ax.set_xticks(list(xs), [f"share {s}" for s in shares])
    ax.set_ylabel("stream decode rate during prefill / before")
    ax.set_title("Decode yield: streams during a cold 500K prefill")
    ax.legend(fontsize=8)
    files.append(_save(fig, out / "yield_cadence.png"))

    tails = sorted(results["thin"])
    fig, ax = plt.subplots(figsize=(7, 4))
    width = 0.2
    for i, t in enumerate(tails):
        for j, variant in enumerate(("control", "thin")):
            cached = results["thin"][t][variant]["resumed_cached_tokens"]
            for k, c in enumerate(cached):
                x = i + (2 * j + k - 1.5) * width
                ax.bar(x, c / 1000, width, color=("tab:red", "tab:green")[j], alpha=(1.0, 0.6)[k],
                       label=f"{variant}, session {k + 1}" if i == 0 else None)
                if c == 0:   # a whole-session re-prefill: no bar to see, say so
                    ax.text(x, 2, "0", ha="center", va="bottom", color="tab:red", fontsize=8)
    ax.set_xticks(range(len(tails)), [f"{t} tails" for t in tails])
    ax.set_ylabel("cached prefix at resume (K tokens)")
    ax.set_title("swa_thin: idle 330K / 300K sessions resumed")
    ax.legend(fontsize=8)
    files.append(_save(fig, out / "thin_resume.png"))

    cone = results["cone"]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.bar(["stock", "cone replay"], [cone["stock_prefill_tokens"] / 1000, cone["cone_prefill_tokens"] / 1000],
           color=["tab:red", "tab:green"])
    ax.set_ylabel("prefill tokens for the resumed prompt (K)")
    ax.set_title(f"Cone replay: {cone['prompt_tokens']:,}-token prompt after its SWA window was evicted",
                 fontsize=9)
    for x, v in enumerate((cone["stock_prefill_tokens"], cone["cone_prefill_tokens"])):
        ax.text(x, v / 1000, f"{v:,}", ha="center", va="bottom")
    files.append(_save(fig, out / "cone_prefill.png"))
    return files


def _save(fig, path: pathlib.Path) -> pathlib.Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path


def report(results: dict) -> str:
    lines = ["dsv41 v2.6.4 simulations (real engine classes on CPU; cost models where no GPU)", ""]
    lines.append("decode yield (2 streams at 300K, cold 500K prompt, 8192-token chunks):")
    for s, r in sorted(results["yield"].items()):
        lines.append(f"  share {s}: cadence {r['cadence_stock']:.3f} -> {r['cadence_yield']:.3f} "
                     f"(cluster {CLUSTER['yield']['stock']:.3f} -> {CLUSTER['yield'].get(s, '-')}), "
                     f"first token x{r['first_token_ratio']:.2f}")
    lines.append("swa_thin (idle 330K / 300K sessions beside sub-agents and new 500K sessions):")
    for t, r in sorted(results["thin"].items()):
        lines.append(f"  {t} tails: whole re-prefills control {r['control']['whole_reprefills']}, "
                     f"thin {r['thin']['whole_reprefills']}; cached at resume control "
                     f"{r['control']['resumed_cached_tokens']}, thin {r['thin']['resumed_cached_tokens']}")
    c = results["cone"]
    lines.append(f"cone replay: prefill {c['stock_prefill_tokens']:,} -> {c['cone_prefill_tokens']:,} "
                 f"tokens; {c['cached_tokens']:,} of {c['prompt_tokens']:,} cached "
                 f"(cluster {CLUSTER['cone']['cached']:,} of {CLUSTER['cone']['prompt']:,})")
    a = results["autotune"]
    lines.append(f"autotune_keep: {a['boots']} boots, dropped stock {a['stock']['dropped_boots']}, "
                 f"keep {a['keep']['dropped_boots']} ({', '.join(a['keep'].get('dropped_on', []))})")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="dsv41 sim all", description=__doc__.split("\n\n")[0])
    p.add_argument("--plot", required=True, metavar="DIR", help="where the PNGs and report go")
    p.add_argument("--tails", default="128,256,384", help="swa_thin tails values (comma list; default %(default)s)")
    p.add_argument("--shares", default="33,50", help="decode yield shares (comma list; default %(default)s)")
    p.add_argument("--json", action="store_true", help="also print all results as JSON")
    args = p.parse_args(argv)
    out = pathlib.Path(args.plot)
    out.mkdir(parents=True, exist_ok=True)
    results = collect([int(t) for t in args.tails.split(",")], [int(s) for s in args.shares.split(",")])
    files = plot(results, out)
    text = report(results)
    (out / "report.txt").write_text(text)
    (out / "results.json").write_text(json.dumps(results, indent=1, default=str))
    if args.json:
        print(json.dumps(results, default=str))
    else:
        print(text + "wrote " + ", ".join(str(f) for f in [*files, out / "report.txt"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
