"""The README's performance chart and table from benchmarks/perf_figures.json.

    pip install matplotlib   # for this script only; aotinfer does not depend on it
    python benchmarks/perf_chart.py            # writes docs/perf.png, prints the Markdown table

Edit perf_figures.json when a benchmark run changes a figure (each figure carries its GPU, date and
the benchmarks/log/NOTES.md section it comes from), rerun, and commit the JSON, the PNG and the table.
"""

import argparse
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def span(figure):
    if isinstance(figure, str):
        return figure
    lo, hi = figure["lo"], figure["hi"]
    return f"{lo:g}" if lo == hi else f"{lo:g}-{hi:g}"


def where(figure):
    return "" if isinstance(figure, str) else f"{figure['gpu']}, {figure['date']}"


def markdown_table(families):
    lines = [
        "| op family | FlashInfer 0.7.2's time / ours | GPU, date | ours / copy_ of the same bytes | GPU, date | shapes |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for f in families:
        fi, copy = f["vs_flashinfer"], f["vs_copy"]
        lines.append(f"| {f['family']} | {span(fi)} | {where(fi)} | {span(copy)} | {where(copy)} | {f['shapes']} |")
    return "\n".join(lines)


def chart(families, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [f["family"] for f in families][::-1]
    fig, axes = plt.subplots(1, 2, figsize=(11, 0.42 * len(names) + 1.4), sharey=True)
    panels = (("vs_flashinfer", "FlashInfer 0.7.2's time / ours (> 1: ours faster)", 1.0, "tab:blue"),
              ("vs_copy", "ours / copy_ of the same bytes", 1.0, "tab:green"))
    for ax, (key, title, reference, color) in zip(axes, panels):
        for y, f in enumerate(families[::-1]):
            figure = f[key]
            if isinstance(figure, str):
                ax.text(reference, y, f" {figure}", va="center", fontsize=8, color="gray")
                continue
            lo, hi = figure["lo"], figure["hi"]
            ax.barh(y, max(hi - lo, 0.01), left=lo, height=0.55, color=color, alpha=0.8)
            ax.text(hi, y, f"  {span(figure)} ({figure['gpu']})", va="center", fontsize=8)
        ax.axvline(reference, color="black", linewidth=0.8)
        ax.set_title(title, fontsize=10)
        ax.grid(axis="x", alpha=0.3)
    axes[0].set_yticks(range(len(names)), names, fontsize=9)
    axes[0].set_xlim(0.9, 3.9)
    axes[1].set_xlim(0.4, 1.35)
    fig.suptitle("aotinfer: range over each family's benchmark shapes (benchmarks/perf_figures.json)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--figures", type=Path, default=ROOT / "benchmarks/perf_figures.json")
    parser.add_argument("--out", type=Path, default=ROOT / "docs/perf.png")
    args = parser.parse_args()
    families = json.loads(args.figures.read_text())["families"]
    chart(families, args.out)
    print(markdown_table(families))


if __name__ == "__main__":
    main()
