"""The ``convcov`` command: ``convcov bench`` (SPEC section 5 measurements), ``convcov
plot`` (fraction-of-floor bars from saved results; also ``bench --plot``) and ``convcov
info`` (backends, devices, versions). Argument parsing is argparse; tables and progress
are rich (the ``bench`` extra); pictures are matplotlib (the ``plot`` extra), imported only
when one is drawn."""

from __future__ import annotations

import argparse
import sys


def _console():
    try:
        from rich.console import Console
    except ImportError:
        sys.exit("convcov: the command line needs rich: pip install 'convcov[bench]'")
    console = Console()
    if not console.is_terminal:  # logs and CI: wide enough for the whole table
        console = Console(width=140)
    return console


def _cuda_usable() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


class _LineProgress:
    """rich.progress.Progress's interface as one printed line per row: a live progress bar
    draws nothing when the output is not a terminal (a log, CI, a pipe), yet a long run
    there still has to show where it is."""

    def __init__(self, console):
        self.console, self.total, self.done = console, 0, 0

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def add_task(self, description, total=0):
        self.total, self.done = total, 0
        return 0

    def update(self, task, description=""):
        self.console.print(f"[{self.done + 1}/{self.total}] {description} ...",
                           highlight=False)

    def advance(self, task):
        self.done += 1


def _progress(console):
    if not console.is_terminal:
        return _LineProgress(console)
    from rich.progress import Progress

    return Progress(console=console, transient=True)


def _need_matplotlib():
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        sys.exit("convcov: plotting needs matplotlib: pip install 'convcov[plot]'")


def _at_least_one(text):
    n = int(text)
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be 1 or more, got {n}")
    return n


def cmd_bench(args):
    console = _console()
    if args.dask:  # dask's overhead over the direct call (convcov/bench_dask.py)
        from . import bench, bench_dask

        results = bench_dask.main(args, console)
        if args.json:
            bench.save_json({"dask": results}, args.json)
            console.print(f"wrote {args.json}")
        return
    if args.suite == "moments":  # conv2d_moments against full-covariance baselines
        from . import bench_moments

        try:
            bench_moments.main(args, console)
        except ValueError as exc:
            sys.exit(f"convcov bench: {exc}")
        return
    if args.plot:  # fail now, not after a long run
        _need_matplotlib()
    from . import bench

    try:  # an unknown workload fails now, not after a long run
        bench.select(args.suite, "cpu", args.workload)
    except ValueError as exc:
        sys.exit(f"convcov bench: {exc}")
    devices = {"auto": ["cpu"] + (["cuda"] if _cuda_usable() else []),
               "cpu": ["cpu"], "cuda": ["cuda"]}[args.device]
    if "cuda" in devices and not _cuda_usable():
        sys.exit("convcov bench: --device cuda needs torch with a CUDA device")
    results = []
    for device in devices:
        with _progress(console) as progress:
            result = bench.run(device, args.workload, args.backend, not args.no_torch,
                               args.repeat, args.budget, progress, args.grad, args.rounds,
                               args.suite)
        console.print(bench.table(result))
        for t in bench.summary_tables(result):
            console.print(t)
        for skip in result["not_measured"]:
            console.print(f"not measured: {skip['backend']}: {skip['reason']}")
        results.append(result)
    if args.json:
        bench.save_json(results[0] if len(results) == 1 else {"runs": results}, args.json)
        console.print(f"wrote {args.json}")
    if args.plot:
        from . import plot

        console.print(f"wrote {plot.fraction_of_floor(results, args.plot)}")


def cmd_plot(args):
    console = _console()
    _need_matplotlib()
    from . import plot

    try:
        result = plot.load(args.json)
        path = plot.fraction_of_floor(result, args.output, args.title)
    except (OSError, ValueError, KeyError) as exc:
        sys.exit(f"convcov plot: {type(exc).__name__}: {exc}")
    console.print(f"wrote {path}")


def cmd_info(args):
    console = _console()
    import platform

    import numpy

    import convcov
    from rich.table import Table

    t = Table(title=f"convcov {convcov.__version__} (python {platform.python_version()}, "
                    f"numpy {numpy.__version__})")
    for col in ("backend", "device", "available", "why not"):
        t.add_column(col)
    for row in convcov.backends():
        t.add_row(row.name, row.device, "yes" if row.available else "no", row.reason)
    console.print(t)
    for mod in ("numba", "torch", "cupy"):
        try:
            m = __import__(mod)
            console.print(f"{mod} {m.__version__}")
        except ImportError:
            console.print(f"{mod}: not installed")
    if _cuda_usable():
        import torch

        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            console.print(f"cuda:{i} {p.name}, {p.multi_processor_count} SMs, "
                          f"{p.total_memory / 2**30:.0f} GiB")
    else:
        console.print("no CUDA device visible to torch")


def main(argv=None):
    parser = argparse.ArgumentParser(prog="convcov", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    b = sub.add_parser("bench", help="time every available backend on SPEC's workloads")
    b.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto",
                   help="host backends, CUDA backends, or both when a GPU is there (default)")
    b.add_argument("--suite", choices=["reference", "layers", "all", "moments"],
                   default="reference",
                   help="reference: SPEC's reference workloads (toy, cpu, mid, big-f32, "
                        "big-f16; the default); layers: conv layers of ResNet-20, VGG-11 and "
                        "MobileNetV2 (r20-stem, r20-16, ...), with each backend's geometric "
                        "mean and worst; all: both; moments: conv2d_moments against "
                        "torch-adf's full mode and two plain conv2d calls on a full covariance "
                        "(convcov/bench_moments.py)")
    b.add_argument("--workload", action="append",
                   help="a workload of the suite (repeatable; default: all of the suite "
                        "that run on the device)")
    b.add_argument("--backend", action="append", help="restrict to these backends (repeatable)")
    b.add_argument("--no-torch", action="store_true", help="skip the torch / torch.compile rows")
    b.add_argument("--repeat", type=_at_least_one, default=200, help="timed calls per row, at most")
    b.add_argument("--budget", type=float, default=3.0, help="seconds per row, at most")
    b.add_argument("--rounds", type=_at_least_one,
                   help="interleave the rows' timed calls in this many rounds (1: one row "
                        "after another; default: 5 on a GPU, 1 on the host)")
    b.add_argument("--grad", action="store_true",
                   help="also time forward + backward through torch autograd (needs torch)")
    b.add_argument("--dask", action="store_true",
                   help="instead, time dask's overhead against the direct call on chunks of "
                        "268 MB: NumPy chunks on the threaded scheduler and a LocalCluster, "
                        "CuPy chunks on dask-cuda's LocalCUDACluster (needs 'convcov[dask]')")
    b.add_argument("--json", help="also write the results to this JSON file")
    b.add_argument("--plot", metavar="PATH",
                   help="also draw fraction of floor per backend and workload, with the "
                        "layers suite's geometric mean (.png, .svg, .pdf; needs matplotlib)")
    b.set_defaults(func=cmd_bench)
    p = sub.add_parser("plot", help="draw fraction of floor from saved bench --json files")
    p.add_argument("json", nargs="+", help="JSON files written by convcov bench --json")
    p.add_argument("-o", "--output", required=True, metavar="PATH",
                   help="picture to write (.png, .svg, .pdf)")
    p.add_argument("--title", help="figure title")
    p.set_defaults(func=cmd_plot)
    i = sub.add_parser("info", help="backends, devices, versions")
    i.set_defaults(func=cmd_info)
    args = parser.parse_args(argv)
    args.func(args)


if __name__ == "__main__":
    main()
