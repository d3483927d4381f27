"""Reports from `results.jsonl`: a markdown summary and PNG plots (score against context length per
method; cost and latency quantiles p25/p50/p75/p95 per method), as in the paper's figures."""

from __future__ import annotations

import importlib.util
import math
from collections import defaultdict
from pathlib import Path
from typing import Any

from recursa.bench.sizes import label
from recursa.extras import install_hint

QUANTILES = (0.25, 0.5, 0.75, 0.95)


def quantile(values: list[float], q: float) -> float:
    """Linear interpolation between order statistics (numpy's default)."""
    if not values:
        return math.nan
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q
    low, high = math.floor(pos), math.ceil(pos)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def _size_of(row: dict[str, Any]) -> int:
    return int(row.get("target_tokens") or row.get("size_tokens") or 0)


def _score(row: dict[str, Any]) -> float:
    return float(row["score"]) if row.get("score") is not None else 0.0


def scored(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Rows that count for scores: answered or cleanly failed (scored 0); harness errors do not."""
    return [r for r in rows if r.get("status") in ("ok", "failed")]


def summary_table(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One line per (family, method, size): n, mean score, failures, median cost and latency."""
    groups: dict[tuple[str, str, int], list[dict[str, Any]]] = defaultdict(list)
    for r in scored(rows):
        groups[(r["family"], r["method"], _size_of(r))].append(r)
    out = []
    for (family, method, size), rs in sorted(groups.items()):
        out.append(
            {
                "family": family,
                "method": method,
                "size_tokens": size,
                "n": len(rs),
                "score": sum(_score(r) for r in rs) / len(rs),
                "failed": sum(1 for r in rs if r["status"] == "failed"),
                "cost_p50": quantile([float(r.get("cost_usd") or 0) for r in rs], 0.5),
                "latency_p50": quantile([float(r.get("latency_s") or 0) for r in rs], 0.5),
                "sub_calls_p50": quantile([float(r.get("sub_calls") or 0) for r in rs], 0.5),
            }
        )
    return out


def quantile_table(rows: list[dict[str, Any]], field: str) -> dict[str, list[float]]:
    per: dict[str, list[float]] = defaultdict(list)
    for r in scored(rows):
        per[r["method"]].append(float(r.get(field) or 0.0))
    return {m: [quantile(v, q) for q in QUANTILES] for m, v in sorted(per.items())}


def write_summary(
    rows: list[dict[str, Any]], path: Path, *, title: str, config: dict[str, Any] | None = None
) -> Path:
    lines = [f"# {title}", ""]
    if config:
        lines += [
            f"Model `{config.get('model')}`, sub-model `{config.get('sub_model') or config.get('model')}`; "
            f"{len(rows)} rows ({sum(1 for r in rows if r.get('status') == 'error')} harness errors, not scored).",
            "",
        ]
    lines += [
        "| family | method | context (tokens) | n | score | failed | cost p50 (USD) | latency p50 (s) | sub-calls p50 |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for g in summary_table(rows):
        lines.append(
            f"| {g['family']} | {g['method']} | {label(g['size_tokens'])} | {g['n']} | {g['score']:.3f} | "
            f"{g['failed']} | {g['cost_p50']:.4f} | {g['latency_p50']:.2f} | {g['sub_calls_p50']:g} |"
        )
    for field, name, fmt in (("cost_usd", "Cost (USD)", "{:.4f}"), ("latency_s", "Latency (s)", "{:.2f}")):
        lines += [
            "",
            f"## {name} quantiles per method",
            "",
            "| method | p25 | p50 | p75 | p95 |",
            "|---|---|---|---|---|",
        ]
        for method, qs in quantile_table(rows, field).items():
            lines.append(f"| {method} | " + " | ".join(fmt.format(q) for q in qs) + " |")
    bases = sorted({str(r.get("cost_basis")) for r in rows if r.get("cost_basis")})
    if bases:
        lines += ["", "Cost basis: " + "; ".join(bases) + "."]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def plots_skipped(rows: list[dict[str, Any]]) -> str | None:
    """Why `write_plots` writes nothing for these rows (said to the user), or None if it writes them."""
    if importlib.util.find_spec("matplotlib") is None:
        return f"plots skipped: matplotlib is not installed ({install_hint('bench')})"
    if not scored(rows):
        return "plots skipped: no row has a score to plot yet"
    return None


def write_plots(rows: list[dict[str, Any]], out: Path, *, title: str) -> list[Path]:
    """PNG plots; [] when `plots_skipped` gives a reason (matplotlib missing, nothing scored)."""
    if plots_skipped(rows) is not None:
        return []
    # The object API (no pyplot): no global backend switch, no display, safe next to user plots.
    from matplotlib.figure import Figure

    written: list[Path] = []
    table = summary_table(rows)
    fig = Figure(figsize=(7, 4.2))
    ax = fig.subplots()
    for method in sorted({g["method"] for g in table}):
        points = sorted((g["size_tokens"], g["score"]) for g in table if g["method"] == method)
        # several families in one run: average their scores per size
        merged: dict[int, list[float]] = defaultdict(list)
        for size, score in points:
            merged[size].append(score)
        xs = sorted(merged)
        ax.plot(xs, [sum(merged[x]) / len(merged[x]) for x in xs], marker="o", label=method)
    ax.set_xscale("log")
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("score")
    ax.set_ylim(-0.05, 1.05)
    ax.set_title(f"{title}: score vs context length")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = out / "score_vs_context.png"
    fig.savefig(path, dpi=110)
    written.append(path)
    for field, name, fname in (
        ("cost_usd", "cost (USD)", "cost_quantiles.png"),
        ("latency_s", "latency (s)", "latency_quantiles.png"),
    ):
        qt = quantile_table(rows, field)
        if not qt:
            continue
        fig = Figure(figsize=(7, 4.2))
        ax = fig.subplots()
        methods = list(qt)
        width = 0.8 / len(QUANTILES)
        for i, q in enumerate(QUANTILES):
            ax.bar(
                [m + (i - 1.5) * width for m in range(len(methods))],
                [qt[m][i] for m in methods],
                width,
                label=f"p{int(q * 100)}",
            )
        ax.set_xticks(range(len(methods)))
        ax.set_xticklabels(methods, rotation=20, fontsize=8)
        ax.set_ylabel(name)
        ax.set_title(f"{title}: {name} quantiles per method")
        ax.legend(fontsize=8)
        ax.grid(True, axis="y", alpha=0.3)
        fig.tight_layout()
        path = out / fname
        fig.savefig(path, dpi=110)
        written.append(path)
    return written
