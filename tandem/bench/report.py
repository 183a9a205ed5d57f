"""Results out: a side-by-side table, a JSON file and PNG plots (latency CDFs; throughput
and goodput against the offered rate). matplotlib is optional: without it the plots are
skipped with a note."""
from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any, Sequence

from tandem.bench.client import RequestResult
from tandem.bench.stats import Dist, Summary


def fmt_ms(x: float | None) -> str:
    """Seconds as milliseconds for a table ("-" when not measured)."""
    return "-" if x is None else f"{x * 1e3:,.1f}"


def _num(x: float | None, digits: int = 2) -> str:
    return "-" if x is None else f"{x:,.{digits}f}"


def _dist_rows(name: str, d: Dist, unit_ms: bool = True) -> list[tuple[str, str]]:
    f = fmt_ms if unit_ms else (lambda x: _num(x, 2))
    unit = "ms" if unit_ms else "s"
    return [(f"{name} {k} ({unit})", f(getattr(d, k))) for k in ("mean", "p50", "p90", "p99")]


def summary_rows(s: Summary) -> list[tuple[str, str]]:
    rows = [("completed / failed", f"{s.completed} / {s.failed}"),
            ("duration (s)", _num(s.duration_s)),
            ("requests/s", _num(s.request_throughput, 3)),
            ("output tokens/s", _num(s.output_throughput, 1)),
            ("total tokens/s", _num(s.total_token_throughput, 1))]
    rows += _dist_rows("TTFT", s.ttft) + _dist_rows("TPOT", s.tpot)
    rows += [(f"ITL {k} (ms)", fmt_ms(getattr(s.itl, k))) for k in ("p50", "p90", "p99")]
    rows += _dist_rows("E2E", s.e2e, unit_ms=False)
    if s.slo_ttft is not None or s.slo_tpot is not None:
        slo = " & ".join(x for x in (
            f"TTFT<={s.slo_ttft * 1e3:g}ms" if s.slo_ttft is not None else "",
            f"TPOT<={s.slo_tpot * 1e3:g}ms" if s.slo_tpot is not None else "") if x)
        rows += [(f"goodput req/s ({slo})", _num(s.goodput, 3)),
                 ("SLO attainment", f"{s.slo_attainment:.1%}")]
    return rows


def format_table(runs: Sequence[tuple[str, Summary]]) -> str:
    """Metrics down, runs across."""
    if not runs:
        return "(no runs)"
    columns = [summary_rows(s) for _, s in runs]
    names = [name for name, _ in columns[0]]
    w0 = max(len(n) for n in names)
    widths = [max(len(label), *(len(v) for _, v in col)) for (label, _), col in zip(runs, columns)]
    lines = [f"{'':{w0}}  " + "  ".join(f"{label:>{w}}" for (label, _), w in zip(runs, widths))]
    lines.append("-" * len(lines[0]))
    for i, name in enumerate(names):
        lines.append(f"{name:{w0}}  " + "  ".join(f"{col[i][1]:>{w}}"
                                                  for col, w in zip(columns, widths)))
    return "\n".join(lines)


def target_line(name: str, value: float | None, op: str, target: float, unit: str = "x") -> str:
    """'name: value (target op target): OK' or '... MISSED by N%' (how far from the target,
    relative to the target). op is '>=' (higher is better) or '<='."""
    if op not in (">=", "<="):
        raise ValueError(f"op must be >= or <=, got {op!r}")
    head = f"{name}: " + ("-" if value is None else f"{value:.2f}{unit}") + \
        f" (target {op} {target:g}{unit})"
    if value is None:
        return head + ": NOT MEASURED"
    ok = value >= target if op == ">=" else value <= target
    if ok:
        return head + ": OK"
    miss = (target - value) / target if op == ">=" else (value - target) / target
    return head + f": MISSED by {miss:.0%}"


def write_json(path: str | Path, config: dict[str, Any],
               runs: Sequence[tuple[str, Summary, Sequence[RequestResult]]]) -> None:
    """One file: the config, then per run its summary and every request's timeline."""
    doc = {"config": config,
           "runs": [{"label": label, "summary": s.to_dict(),
                     "requests": [r.record() for r in results]}
                    for label, s, results in runs]}
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(doc, indent=1, default=str))


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        print("note: matplotlib is not installed; no plots (pip install matplotlib)",
              file=sys.stderr)
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _cdf(ax, values: list[float], label: str) -> None:
    xs = sorted(values)
    if xs:
        ax.step(xs, [(i + 1) / len(xs) for i in range(len(xs))], where="post", label=label)


def plot_cdfs(path: str | Path, runs: Sequence[tuple[str, Sequence[RequestResult]]],
              title: str = "") -> Path | None:
    """2x2 CDFs (TTFT, TPOT, ITL, E2E), one line per run."""
    plt = _pyplot()
    if plt is None:
        return None
    fig, axes = plt.subplots(2, 2, figsize=(9, 6.5))
    panels = [("TTFT (ms)", lambda r: [r.ttft * 1e3] if r.ttft is not None else []),
              ("TPOT (ms)", lambda r: [r.tpot * 1e3] if r.tpot is not None else []),
              ("inter-token latency (ms)", lambda r: [x * 1e3 for x in r.itls]),
              ("end-to-end latency (s)", lambda r: [r.e2e] if r.e2e is not None else [])]
    for ax, (name, get) in zip(axes.flat, panels):
        for label, results in runs:
            _cdf(ax, [x for r in results if r.ok for x in get(r)], label)
        ax.set_xlabel(name)
        ax.set_ylabel("fraction of requests" if "inter" not in name else "fraction of gaps")
        ax.grid(alpha=0.3)
        if name.startswith(("TTFT", "inter")):
            ax.set_xscale("log")
    axes.flat[0].legend(fontsize=8)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    return _save(fig, path, plt)


def plot_vs_rate(path: str | Path, series: dict[str, Sequence[tuple[float, Summary]]],
                 title: str = "") -> Path | None:
    """Output throughput and goodput against the offered request rate, one line per series."""
    plt = _pyplot()
    if plt is None:
        return None
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(9, 3.8))
    for label, points in series.items():
        pts = sorted((p for p in points if math.isfinite(p[0])), key=lambda p: p[0])
        rates = [p[0] for p in pts]
        a1.plot(rates, [s.output_throughput for _, s in pts], "o-", label=label)
        a2.plot(rates, [s.goodput for _, s in pts], "o-", label=label)
    a1.set_ylabel("output tokens/s")
    a2.set_ylabel("goodput (req/s meeting SLOs)")
    for ax in (a1, a2):
        ax.set_xlabel("offered rate (req/s)")
        ax.grid(alpha=0.3)
    a1.legend(fontsize=8)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    return _save(fig, path, plt)


def _save(fig, path: str | Path, plt) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return path
