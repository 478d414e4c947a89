"""PNG plots drawn from the benchmark's result rows (the same dicts the JSON holds)."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

STAGE_COLORS = {"prefill": "#55a868", "draft": "#4c72b0", "verify": "#dd8452", "align": "#c44e52", "other": "#8c8c8c"}


def series_name(row: dict) -> str:
    name = row["method"]
    if row.get("gamma"):
        name += f" γ={row['gamma']}"
    if row.get("drafter") and row["drafter"] != "draft_model":
        name += f" [{row['drafter']}]"
    return name


def _series(results: list[dict]) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = defaultdict(list)
    for r in results:
        out[series_name(r)].append(r)
    for rows in out.values():
        rows.sort(key=lambda r: r["batch_size"])
    return out


def _style(name: str) -> dict:
    if name.startswith("hf_"):
        return {"linestyle": "--", "marker": "s"}
    if name.startswith("autoregressive"):
        return {"linestyle": "-", "marker": "o", "color": "black"}
    return {"linestyle": "-", "marker": "o"}


def _batch_axis(ax, sizes) -> None:
    ax.set_xscale("log", base=2)
    ax.set_xticks(sizes)
    ax.set_xticklabels([str(s) for s in sizes])
    ax.set_xlabel("batch size")
    ax.grid(alpha=0.3)


def plot_all(results: list[dict], out_dir: str | Path, title: str = "") -> list[Path]:
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    sizes = sorted({r["batch_size"] for r in results})
    series = _series(results)
    paths = []

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, rows in series.items():
        ax.plot([r["batch_size"] for r in rows], [r["tokens_per_s"] for r in rows], label=name, **_style(name))
    _batch_axis(ax, sizes)
    ax.set_ylabel("generated tokens / s")
    ax.set_title(f"Throughput {title}".strip())
    ax.legend(fontsize=8)
    paths.append(_save(fig, out_dir / "throughput.png"))

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for key, ax, label in (("speedup", axes[0], "speedup over our autoregressive (same batch size)"),
                           ("vs_hf_generate", axes[1], "tokens/s over HF generate (same batch size)")):
        for name, rows in series.items():
            pts = [(r["batch_size"], r[key]) for r in rows if r.get(key) is not None]
            if pts and not name.startswith("hf_"):
                ax.plot(*zip(*pts), label=name, **_style(name))
        ax.axhline(1.0, color="grey", linewidth=1)
        _batch_axis(ax, sizes)
        ax.set_ylabel(label)
    colors = {line.get_label(): line.get_color() for line in axes[1].get_lines()}
    assisted = [(r, r["vs_hf_assisted"]) for r in results if r.get("vs_hf_assisted")]
    for r, ratio in assisted:  # a star in the colour of its series
        axes[1].scatter([1], [ratio], marker="*", s=140, zorder=5, color=colors.get(series_name(r)),
                        label=f"{series_name(r)} vs hf_assisted (bs 1)")
    axes[0].legend(fontsize=8)
    axes[1].legend(fontsize=8)
    fig.suptitle(f"Speed-up {title}".strip())
    paths.append(_save(fig, out_dir / "speedup.png"))

    timed = [r for r in results if r.get("time_share")]
    if timed:
        fig, ax = plt.subplots(figsize=(max(7, 0.45 * len(timed)), 4.5))
        labels = [f"{series_name(r)}\nbs={r['batch_size']}" for r in timed]
        bottom = [0.0] * len(timed)
        for stage, color in STAGE_COLORS.items():
            vals = [r["time_share"].get(stage, 0.0) for r in timed]
            ax.bar(range(len(timed)), vals, bottom=bottom, color=color, label=stage)
            bottom = [b + v for b, v in zip(bottom, vals)]
        ax.set_xticks(range(len(timed)))
        ax.set_xticklabels(labels, rotation=90, fontsize=7)
        ax.set_ylabel("share of decoding time")
        ax.set_title(f"Where the time goes {title}".strip())
        ax.legend(fontsize=8)
        paths.append(_save(fig, out_dir / "time_share.png"))

    hist_rows = [r for r in results if r.get("accept_hist")]
    if hist_rows:
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for r in hist_rows:
            hist = {int(k): v for k, v in r["accept_hist"].items()}
            total = sum(hist.values()) or 1
            xs = list(range(max(hist) + 1))
            ax.plot(xs, [hist.get(x, 0) / total for x in xs], marker="o",
                    label=f"{series_name(r)} bs={r['batch_size']}")
        ax.set_xlabel("draft tokens accepted in a round")
        ax.set_ylabel("share of row-rounds")
        ax.set_title(f"Accepted lengths {title}".strip())
        ax.legend(fontsize=7, ncol=2)
        ax.grid(alpha=0.3)
        paths.append(_save(fig, out_dir / "acceptance.png"))
    return paths


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
