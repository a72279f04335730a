"""The gate's report, written next to the run: runs/<run-id>/report.md and three PNG plots.

    report.md    the verdict, the rules (outcome and why), a table of cells x labels
    speed.png    tokens/s per speed cell and label: median bar, every repeat as a dot, range as
                 an error bar; the candidate's kill line (mean of the controls x (1 - tolerance))
    resume.png   TTFT of the resume cell (cold, warm, evicted) per label
    kld.png      mean KL per KL prompt: control || candidate (both controls) and control || control,
                 with the thresholds of each group (symlog axis: identical boots give 0)

Plots use matplotlib's Agg backend (no display). The latest verdict of a run overwrites them.
"""
from __future__ import annotations

import pathlib

from adapter.tools.gate import cells as C


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _labels(result: dict) -> list[str]:
    o = result["order"]
    return [o["control"], o["candidate"], o["control2"]]


COLOURS = ("tab:blue", "tab:red", "tab:cyan")


def plot_speed(result: dict, path: pathlib.Path) -> None:
    plt = _plt()
    data, labels = result["_data"], _labels(result)
    per_cell = next(r for r in result["rules"] if r["rule"] == "controls.speed")["figures"]["cells"]
    fig, axes = plt.subplots(1, len(C.SPEED_CELLS), figsize=(3.2 * len(C.SPEED_CELLS), 3.4))
    for ax, cell in zip(axes, C.SPEED_CELLS):
        for i, lb in enumerate(labels):
            s = data[lb]["cells"][cell]
            reps = s["tok_s_reps"]
            med = s["tok_s"]
            ax.bar(i, med, color=COLOURS[i], alpha=0.6,
                   yerr=[[med - min(reps)], [max(reps) - med]], capsize=4)
            ax.scatter([i] * len(reps), reps, color="k", s=8, zorder=3)
        f = per_cell[cell]
        ax.axhline(f["control_mean"] * f["kill_below"], color="tab:red", ls="--", lw=1,
                   label="kill below")
        ax.set_xticks(range(3), labels)
        ax.set_title(cell, fontsize=9)
        ax.set_ylabel("output tok/s")
    axes[0].legend(fontsize=7, loc="lower left")
    fig.suptitle(f"speed (median, repeats, range) - verdict {result['verdict']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def plot_resume(result: dict, path: pathlib.Path) -> None:
    plt = _plt()
    data, labels = result["_data"], _labels(result)
    steps = ("cold", "warm", "evicted")
    fig, ax = plt.subplots(figsize=(5.5, 3.4))
    width = 0.25
    for i, lb in enumerate(labels):
        s = data[lb]["cells"]["resume"]
        ys = [(s.get(f"{st}_ttft_s") or 0.0) * 1000 for st in steps]
        ax.bar([k + (i - 1) * width for k in range(3)], ys, width, color=COLOURS[i], label=lb)
    ax.set_xticks(range(3), [f"{st}" for st in steps])
    ax.set_ylabel("TTFT (ms)")
    ax.set_title("resume: document cold, warm, after eviction", fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def plot_kld(result: dict, path: pathlib.Path) -> None:
    plt = _plt()
    table = result["_kld_table"]
    kld = next(r for r in result["rules"] if r["rule"] == "kld")["figures"]
    ids = list(table)
    fig, ax = plt.subplots(figsize=(8.0, 3.6))
    width = 0.27
    for j, (key, colour) in enumerate((("A||B", "tab:red"), ("A2||B", "tab:orange"), ("A||A2", "tab:blue"))):
        ax.bar([k + (j - 1) * width for k in range(len(ids))], [table[i][key] for i in ids], width,
               color=colour, label=key.replace("A2", "ctrl2").replace("A", "ctrl").replace("B", "cand"))
    for g, ls in (("long", "--"), ("short", ":")):
        if g in kld["groups"]:
            ax.axhline(kld["groups"][g]["threshold"], color="k", ls=ls, lw=1, label=f"threshold {g}")
    ax.set_yscale("symlog", linthresh=1e-4)
    ax.set_xticks(range(len(ids)), ids, rotation=20, fontsize=7)
    ax.set_ylabel("mean KL (nats)")
    ax.set_title("KL divergence per prompt (top-k logprobs)", fontsize=10)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def _fmt(v, spec=".3g") -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        return format(v, spec)
    return str(v)


def cell_rows(result: dict) -> list[list[str]]:
    """Rows of the cells x labels table."""
    data, labels = result["_data"], _labels(result)
    rows = []
    for cell in C.SPEED_CELLS:
        row = [f"{cell} tok/s (median, range)"]
        for lb in labels:
            s = data[lb]["cells"][cell]
            row.append(f"{s['tok_s']:.1f} ({min(s['tok_s_reps']):.0f}-{max(s['tok_s_reps']):.0f})")
        rows.append(row)
        rows.append([f"{cell} TTFT p50 / ITL p50 (ms)"] + [
            f"{_fmt((data[lb]['cells'][cell]['ttft_p50_s'] or 0) * 1000, '.1f')} / "
            f"{_fmt((data[lb]['cells'][cell]['itl_p50_s'] or 0) * 1000, '.1f')}" for lb in labels])
    t0 = next(r for r in result["rules"] if r["rule"] == "t0")["figures"]
    rows.append(["t0: equal to the controls (agreed prompts)", "-", f"{t0['equal']} of {t0['agreed']}", "-"])
    for g, v in next(r for r in result["rules"] if r["rule"] == "kld")["figures"]["groups"].items():
        rows.append([f"kld {g}: mean KL vs controls / threshold", "-",
                     f"{v['candidate']:.3g} / {v['threshold']:.3g}", f"(ctrl-ctrl {v['controls']:.3g})"])
    t1 = next(r for r in result["rules"] if r["rule"] == "t1")["figures"]["tests"]
    rows.append(["t1: chi-square p vs pooled controls (min)", "-", _fmt(min(x["p"] for x in t1.values())), "-"])
    rows.append(["needle found (prompt tokens)"] + [
        f"{_fmt(data[lb]['cells']['needle']['found'])} ({data[lb]['cells']['needle'].get('prompt_tokens')})"
        for lb in labels])
    for st in ("cold", "warm", "evicted"):
        rows.append([f"resume {st}: TTFT ms (cached tokens)"] + [
            f"{_fmt((data[lb]['cells']['resume'].get(f'{st}_ttft_s') or 0) * 1000, '.1f')} "
            f"({_fmt(data[lb]['cells']['resume'].get(f'{st}_cached_tokens'))})" for lb in labels])
    rows.append(["soak: requests / failures / companion streams"] + [
        f"{data[lb]['cells']['soak']['requests']} / "
        f"{data[lb]['cells']['soak']['failures'] + data[lb]['cells']['soak']['companion_failures']} / "
        f"{data[lb]['cells']['soak']['companion_streams']}" for lb in labels])
    rows.append(["measured in (s, all cells)"] + [
        f"{sum(data[lb]['cells'][c]['elapsed_s'] for c in C.CELLS):.1f}" for lb in labels])
    return rows


def markdown(result: dict, plots: dict) -> str:
    labels = _labels(result)
    o = result["order"]
    out = [f"# dsv41 gate: {result['verdict']}", "",
           f"Run `{pathlib.Path(result['run_dir']).name}`, {result['suite']} suite, model `{result['model']}`; "
           f"order control `{o['control']}`, candidate `{o['candidate']}`, control `{o['control2']}`.", ""]
    if result["decided_by"]:
        out += [f"Decided by: {', '.join(result['decided_by'])}.", ""]
    out += ["## Rules (docs/gate.md)", "", "| rule | outcome | why |", "|---|---|---|"]
    for r in result["rules"]:
        out.append(f"| {r['rule']} | {r['outcome']} | {r['why'].replace('|', '/')} |")
    out += ["", "## Cells", "", "| cell | " + " | ".join(f"{lb} ({role})" for lb, role in
                                                          zip(labels, ("control", "candidate", "control"))) + " |",
            "|---|---|---|---|"]
    for row in cell_rows(result):
        out.append("| " + " | ".join(str(x).replace("|", "/") for x in row) + " |")
    out += ["", "## Plots", ""]
    out += [f"![{name}]({path.name})" for name, path in plots.items()]
    return "\n".join(out) + "\n"


def write(result: dict, out_dir) -> dict:
    """Write report.md and the plots into out_dir; return their paths."""
    out_dir = pathlib.Path(out_dir)
    plots = {"speed": out_dir / "speed.png", "resume": out_dir / "resume.png", "kld": out_dir / "kld.png"}
    plot_speed(result, plots["speed"])
    plot_resume(result, plots["resume"])
    plot_kld(result, plots["kld"])
    md = out_dir / "report.md"
    md.write_text(markdown(result, plots))
    return {"report": md, **plots}
