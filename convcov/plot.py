"""Pictures of ``convcov bench`` results: fraction of the memory floor per backend and workload.

Owns :func:`fraction_of_floor` (a grouped bar chart drawn from a run's rows, written to a
file; :func:`figure` is the same as a matplotlib Figure), :func:`runs`
(the runs inside a result or a saved ``--json`` file, which holds one run or
``{"runs": [...]}``) and :func:`load`. Used by ``convcov bench --plot PATH`` and
``convcov plot FILE.json ... -o PATH``. Each suite of a run is a panel, one group of bars
per workload; the ``layers`` suite's panel ends with a group of each implementation's
geometric mean over its layers.

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


#: Suites whose panel ends with the geometric-mean group.
GEOMEAN_SUITES = ("layers",)


def figure(result, title: str | None = None):
    """Fraction-of-floor bars: one panel per run and suite, one group per workload (and
    for the ``layers`` suite a last group, "geomean", of each implementation's geometric
    mean over the layers it was measured on), one bar per implementation (the same colour
    in every panel).

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
    panels = [(run, suite, rows) for run in all_runs for suite, rows in _suites(run)]
    groups = max(len(_workloads(rows)) + (suite in GEOMEAN_SUITES) for _, suite, rows in panels)
    per_group = 0.5 + 0.3 * len(impls)
    # a wide panel (the layers suite's 13 groups) gets more height, to stay readable
    fig = Figure(figsize=(min(max(6.0, 1.6 + per_group * groups), 20.0),
                          (3.6 if groups <= 6 else 5.0) * len(panels)), layout="constrained")
    axes = fig.subplots(len(panels), 1, squeeze=False)[:, 0]
    for ax, (run, suite, rows) in zip(axes, panels):
        _panel(ax, run, suite, rows, colours)
    fig.suptitle(title or "convcov bench: fraction of the memory floor (1 = at the floor)")
    handles = [Patch(color=colours[n], label=n) for n in impls]
    fig.legend(handles=handles, loc="outside lower center",
               ncols=min(len(impls), 6), frameon=False)
    return fig


def _suites(run) -> list[tuple[str, list[dict]]]:
    """(suite, its rows) in the order of the rows; a run recorded before there were suites
    holds the reference workloads only."""
    suite = {w["name"]: w.get("suite", "reference") for w in run.get("workloads", [])}
    out: dict[str, list[dict]] = {}
    for row in run["rows"]:
        out.setdefault(suite.get(row["workload"], "reference"), []).append(row)
    return list(out.items())


def _workloads(rows) -> list[str]:
    return list(dict.fromkeys(row["workload"] for row in rows))


def geomeans(rows) -> dict[str, tuple[float, int]]:
    """impl -> (geometric mean of its fractions over the workloads it was measured on,
    how many those are)."""
    fr: dict[str, list[float]] = {}
    for row in rows:
        name, failed = _impl(row)
        if not failed and row["fraction"] > 0:
            fr.setdefault(name, []).append(row["fraction"])
    return {n: (math.exp(sum(map(math.log, v)) / len(v)), len(v)) for n, v in fr.items()}


def _panel(ax, run, suite, rows, colours):
    from matplotlib.ticker import NullFormatter

    workloads = _workloads(rows)
    impls = _order(_impl(row)[0] for row in rows)
    width = min(0.8 / max(len(impls), 1), 0.22)
    fractions = [row["fraction"] for row in rows if not _impl(row)[1] and row["fraction"] > 0]
    low = min(fractions, default=1.0)
    # at least two decades below the floor line, and room under the smallest bar
    bottom = min(10 ** math.floor(math.log10(low) - 0.3), 1e-2)
    labels = list(workloads)
    bars = []  # (group, impl, fraction or None for a failed row)
    for row in rows:
        name, failed = _impl(row)
        bars.append((workloads.index(row["workload"]), name, None if failed else row["fraction"]))
    if suite in GEOMEAN_SUITES:
        means = geomeans(rows)
        partial = any(n < len(workloads) for _, n in means.values())
        labels.append("geomean" + ("\n(of those run)" if partial else ""))
        ax.axvline(len(workloads) - 0.5, color="0.5", lw=0.8, ls=":")
        bars += [(len(workloads), name, g) for name, (g, _) in means.items()]
    rotation = 90 if len(impls) > 3 else 0
    for group, name, fraction in bars:
        x = group + (impls.index(name) - (len(impls) - 1) / 2) * width
        if fraction is None:
            ax.text(x, bottom * 1.3, "failed", rotation=90, ha="center", va="bottom",
                    fontsize=7, color=colours[name])
            continue
        # a log axis has no 0: bars stand on the panel's floor and end at the fraction
        ax.bar(x, fraction - bottom, width * 0.92, bottom=bottom, color=colours[name])
        ax.text(x, fraction * 1.08, f"{fraction:.2g}", ha="center", va="bottom",
                fontsize=7, rotation=rotation)
    ax.axhline(1.0, color="0.3", lw=0.8, ls="--")
    ax.set_yscale("log")
    ax.yaxis.set_minor_formatter(NullFormatter())
    ax.set_ylim(bottom, 2.0 if not rotation else 4.0)
    ax.set_xticks(range(len(labels)), labels)
    ax.set_xlim(-0.5, len(labels) - 0.5)  # one slot per group, however few bars
    ax.set_ylabel("fraction of floor")
    bw = run.get("copy_bandwidth_GBps")
    ax.set_title(f"{run.get('device', '?')}: {run.get('machine', '?')}"
                 + (f", copy {bw:.0f} GB/s" if bw else "")
                 + (f", {run['date']}" if run.get("date") else "")
                 + (f"; suite {suite}" if suite != "reference" else ""), fontsize=9)
