"""``stream_bench.png``: latency vs offered load, throughput vs threads, and the sweep (matplotlib).

matplotlib is optional (the ``bench`` extra): without it the run still writes its table and JSON.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

COLOURS = {
    "hf-sequential": "#d62728",
    "hf-threads": "#ff7f0e",
    "vllm": "#9467bd",
    "aiomm": "#1f77b4",
    "floor": "#787878",
    "aiomm-gpu": "#2ca02c",
}
#: for series named otherwise (the sweep's thread counts)
PALETTE = ("#1f77b4", "#2ca02c", "#e377c2", "#17becf", "#bcbd22")

Series = dict[str, list[tuple[float, float]]]


class PlotUnavailableError(ImportError):
    """Raised when matplotlib (the ``bench`` extra) is not installed."""

    def __init__(self) -> None:
        super().__init__(
            "the plot needs matplotlib, which is not installed: "
            "pip install -e '.[bench]' (or pip install matplotlib)"
        )


def _panel(
    ax: Any, title: str, xlabel: str, ylabel: str, series: Series, *, log_y: bool = False,
    dashed: frozenset[str] = frozenset(), integer_x: bool = False,
) -> None:  # fmt: skip
    ax.set_title(title, loc="left")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(True, which="major", color="#e6e6e6")
    drawn = 0
    for i, (name, pts) in enumerate(series.items()):
        pts = sorted(
            (x, y) for x, y in pts if math.isfinite(x) and math.isfinite(y) and (y > 0 or not log_y)
        )
        if not pts:
            continue
        colour = COLOURS.get(name.split(" ")[0], PALETTE[i % len(PALETTE)])
        xs, ys = zip(*pts, strict=True)
        if name in dashed:
            style = {"linestyle": "--", "marker": "s", "markerfacecolor": "white"}
        else:
            style = {"linestyle": "-", "marker": "o"}
        ax.plot(xs, ys, color=colour, label=name, linewidth=2, **style)
        drawn += 1
    if not drawn:
        ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes)
        return
    if log_y:
        ax.set_yscale("log")
        # plain numbers (300, not 3x10^2), on the minor ticks too: a log axis rarely spans a decade
        ax.yaxis.set_major_formatter("{x:g}")
        ax.yaxis.set_minor_formatter("{x:g}")
    else:
        ax.set_ylim(bottom=0)
    if integer_x:
        ax.xaxis.get_major_locator().set_params(integer=True)
    ax.set_xlim(left=0)
    ax.legend(loc="best", fontsize="small")


def plot(results: dict[str, Any], path: Path) -> None:
    """Latency vs offered load per system; throughput vs threads (and the sweep, if run).

    :raises PlotUnavailableError: when matplotlib is not installed.
    """
    try:
        # imported here: matplotlib is an optional extra, the rest of the run needs none of it
        from matplotlib.figure import Figure
    except ImportError as exc:
        raise PlotUnavailableError() from exc

    sweep = results.get("sweep") if results.get("sweep", {}).get("status") == "ok" else None
    panels = 3 if sweep else 2
    # a Figure of our own, not pyplot: no global state, no GUI backend
    fig = Figure(figsize=(6.2 * panels, 5.6), dpi=100, layout="constrained")
    axes = fig.subplots(1, panels)

    latency: Series = {}
    dashed = set()
    for name, rec in results["systems"].items():
        if rec.get("status") != "ok":
            continue
        runs = rec.get("open", [])
        latency[f"{name} p99"] = [(r["offered_rps"], r["latency_ms"]["p99"]) for r in runs]
        latency[f"{name} p50"] = [(r["offered_rps"], r["latency_ms"]["p50"]) for r in runs]
        dashed.add(f"{name} p50")
    _panel(axes[0], "Latency vs offered load (open loop)", "offered load (requests/s)",
           "latency (ms, log)", latency, log_y=True, dashed=frozenset(dashed))  # fmt: skip

    throughput: Series = {}
    scaling = results["systems"].get("aiomm", {}).get("scaling", [])
    if scaling:
        throughput["aiomm (cache off)"] = [(r["threads"], r["images_per_s"]) for r in scaling]
        floor = results.get("checks", {}).get("floor", {})
        if floor.get("floor_s"):
            per_thread = floor["images_per_s"] / floor["cores"]
            throughput["floor (decode+resize)"] = [
                (r["threads"], per_thread * min(r["threads"], floor["cores"])) for r in scaling
            ]
    for name, rec in results["systems"].items():
        if name != "aiomm" and rec.get("status") == "ok" and scaling:
            ips = rec["closed"]["images_per_s"]
            throughput[name] = [(r["threads"], ips) for r in scaling]
            dashed.add(name)
    _panel(axes[1], "Throughput vs threads (closed loop)", "aiomm transform threads",
           "images/s", throughput, dashed=frozenset(dashed), integer_x=True)  # fmt: skip

    if sweep:
        grid: Series = {}
        for g in sweep["grid"]:
            grid.setdefault(f"{g['threads']} transform threads", []).append(
                (g["max_in_flight"], g["images_per_s"])
            )
        _panel(axes[2], "Sweep: throughput vs max_in_flight", "max_in_flight", "images/s", grid,
               integer_x=True)  # fmt: skip
    fig.savefig(path)
