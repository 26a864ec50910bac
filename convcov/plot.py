"""Pictures of ``convcov bench`` results: fraction of the memory floor per backend and workload.

Owns :func:`fraction_of_floor` (a grouped bar chart drawn from a run's rows, written to a
file; :func:`figure` is the same as a matplotlib Figure), :func:`runs`
(the runs inside a result or a saved ``--json`` file, which holds one run or
``{"runs": [...]}``) and :func:`load`. Used by ``convcov bench --plot PATH`` and
``convcov plot FILE.json ... -o PATH``.

It draws with matplotlib's object API (:class:`matplotlib.figure.Figure`), never pyplot:
no global state, no display needed, safe inside a test run. matplotlib (the ``plot``
extra) is imported only when a picture is drawn; it must not be imported by ``convcov``.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable

#: impl names that are not convcov backends, drawn after the backends in this order.
BASELINES = ("torch", "torch.compile")


def runs(result) -> list[dict]:
    """The runs in a bench result: ``bench.run``'s dict, ``{"runs": [...]}``, or a list."""
    if isinstance(result, list):
        return [r for x in result for r in runs(x)]
    if "runs" in result:
        return runs(result["runs"])
    if "rows" not in result:
        raise ValueError("not a convcov bench result: no 'rows' and no 'runs' key")
    return [result]


def load(paths: str | Iterable[str]) -> list[dict]:
    """All runs in one or several JSON files written by ``convcov bench --json``."""
    if isinstance(paths, str):
        paths = [paths]
    out = []
    for path in paths:
        with open(path) as f:
            try:
                out += runs(json.load(f))
            except ValueError as exc:
                raise ValueError(f"{path}: {exc}") from None
    return out


def _impl(row) -> tuple[str, bool]:
    """(implementation name, failed?): a failed row's impl reads 'name (failed: ...)'."""
    name = row["impl"]
    failed = " (failed" in name or not math.isfinite(row["fraction"] or math.nan)
    return name.split(" (failed")[0], failed


def _order(names: Iterable[str]) -> list[str]:
    names = list(dict.fromkeys(names))
    return ([n for n in names if n not in BASELINES]
            + [n for n in BASELINES if n in names])


def fraction_of_floor(result, path: str, title: str | None = None) -> str:
    """Draw :func:`figure` into ``path`` (the format from its extension); returns ``path``."""
    figure(result, title).savefig(path, dpi=110)
    return path


def figure(result, title: str | None = None):
    """Fraction-of-floor bars: one group per workload, one bar per implementation (the
    same colour in every panel), one panel per run.

    The y axis is logarithmic: fractions span from ~1e-4 (a slow baseline) to ~1 (at the
    memory floor, drawn as a dashed line). Failed rows are marked, not dropped.
    """
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    all_runs = runs(result)
    if not all_runs or not any(r["rows"] for r in all_runs):
        raise ValueError("nothing to plot: the result has no rows")
    impls = _order(_impl(row)[0] for r in all_runs for row in r["rows"])
    colours = {n: f"C{i % 10}" for i, n in enumerate(impls)}

    fig = Figure(figsize=(max(6.0, 1.6 + 2.2 * max(len(_workloads(r)) for r in all_runs)),
                          3.6 * len(all_runs)), layout="constrained")
    axes = fig.subplots(len(all_runs), 1, squeeze=False)[:, 0]
    for ax, run in zip(axes, all_runs):
        _panel(ax, run, colours)
    fig.suptitle(title or "convcov bench: fraction of the memory floor (1 = at the floor)")
    handles = [Patch(color=colours[n], label=n) for n in impls]
    fig.legend(handles=handles, loc="outside lower center",
               ncols=min(len(impls), 6), frameon=False)
    return fig


def _workloads(run) -> list[str]:
    return list(dict.fromkeys(row["workload"] for row in run["rows"]))


def _panel(ax, run, colours):
    from matplotlib.ticker import NullFormatter

    workloads = _workloads(run)
    impls = _order(_impl(row)[0] for row in run["rows"])
    width = min(0.8 / max(len(impls), 1), 0.22)
    fractions = [row["fraction"] for row in run["rows"]
                 if not _impl(row)[1] and row["fraction"] > 0]
    low = min(fractions, default=1.0)
    # at least two decades below the floor line, and room under the smallest bar
    bottom = min(10 ** math.floor(math.log10(low) - 0.3), 1e-2)
    for row in run["rows"]:
        name, failed = _impl(row)
        x = workloads.index(row["workload"]) + (impls.index(name) - (len(impls) - 1) / 2) * width
        if failed:
            ax.text(x, bottom * 1.3, "failed", rotation=90, ha="center", va="bottom",
                    fontsize=7, color=colours[name])
            continue
        # a log axis has no 0: bars stand on the panel's floor and end at the fraction
        ax.bar(x, row["fraction"] - bottom, width * 0.92, bottom=bottom, color=colours[name])
        ax.text(x, row["fraction"] * 1.08, f"{row['fraction']:.2g}", ha="center",
                va="bottom", fontsize=7)
    ax.axhline(1.0, color="0.3", lw=0.8, ls="--")
    ax.set_yscale("log")
    ax.yaxis.set_minor_formatter(NullFormatter())
    ax.set_ylim(bottom, 2.0)
    ax.set_xticks(range(len(workloads)), workloads)
    ax.set_xlim(-0.5, len(workloads) - 0.5)  # one slot per workload, however few bars
    ax.set_ylabel("fraction of floor")
    bw = run.get("copy_bandwidth_GBps")
    ax.set_title(f"{run.get('device', '?')}: {run.get('machine', '?')}"
                 + (f", copy {bw:.0f} GB/s" if bw else "")
                 + (f", {run['date']}" if run.get("date") else ""), fontsize=9)
