"""``convcov bench --suite moments``: ``conv2d_moments`` against the plain ways of carrying a
full covariance through a conv layer.

Owns the layers (:data:`LAYERS`: each with its GPU size and the host's scaled-down one),
the rows timed for each, the check of each row against a float64 reference before it is
timed, the timing, the table and the JSON record. Rows per layer, on torch tensors:

* ``conv2d_moments`` with ``out_layout`` "full", "diag" and "var", float32 (IEEE: TF32 off),
  with a weight noise ``c`` (the whole layer's moments: ``K gamma K^T``, the noise term,
  the symmetrisation); on the host also on NumPy arrays;
* torch-adf's full mode, ``torchadf.nn.functional.conv2d(mu, gamma, weight, bias, stride,
  padding, dilation, groups, mode="full")`` (``pip install torch-adf``), float32: a row
  that says why not when it is not installed;
* the two plain ``conv2d`` calls on the flattened covariance (the right index as the
  batch, transpose, the left index as the batch: torch-adf's computation written out),
  in float32 and, on CUDA, in TF32 and in bfloat16.

The baselines compute ``K gamma K^T`` alone, without the noise term or the
symmetrisation: less work than the ``conv2d_moments`` rows. Each row is checked first
(its largest error relative to the reference's largest entry, against ``TOLERANCE`` of its
precision; a failed row is not timed); the reference is ``conv2d_moments`` in float64
(itself tested against the definition in tests/test_moments.py) without the noise for the
baselines. Timings are the median of repeated calls: CUDA events around each call (the
queue drained before it) on a GPU, ``time.perf_counter`` on the host.

Each row has its floor (:func:`_work`): the larger of reading what the row's layout
needs of ``gamma`` and writing the result once at the copy bandwidth measured in the same
run, and the multiply-adds of what the row's layout keeps, half of each symmetric part,
at the peak of the row's precision measured in the same run (a large matrix product:
float32 with TF32 off, TF32, bfloat16).
The baselines compute the full ``K gamma K^T``: their floor is the "full" layout's.
"""

from __future__ import annotations

import datetime
import json
import platform
import statistics
import time
from dataclasses import dataclass

import convcov

#: Largest error allowed, relative to the reference's largest entry, by precision.
TOLERANCE = {"float32": 1e-4, "tf32": 2e-2, "bfloat16": 8e-2}
#: The weight-noise variance of the conv2d_moments rows.
C = 0.01


@dataclass(frozen=True)
class Layer:
    """A conv layer with a full input covariance: ``Ci -> Co`` at ``H x H``, batch ``B``."""

    name: str
    Ci: int
    Co: int
    H: int
    k: int
    stride: int
    padding: int
    groups: int
    B: int

    def describe(self) -> str:
        g = f" g{self.groups}" if self.groups > 1 else ""
        return (f"{self.Ci}->{self.Co} {self.H}x{self.H} k{self.k} s{self.stride} "
                f"p{self.padding}{g} B{self.B}")

    def conv(self) -> dict:
        return dict(stride=self.stride, padding=self.padding, groups=self.groups)


#: name -> (the GPU layer, the host's scaled-down one)
LAYERS = {
    "16ch": (Layer("16ch", 16, 16, 32, 3, 1, 1, 1, 4), Layer("16ch", 16, 16, 16, 3, 1, 1, 1, 2)),
    "64ch": (Layer("64ch", 64, 64, 16, 3, 1, 1, 1, 2), Layer("64ch", 32, 32, 8, 3, 1, 1, 1, 2)),
    "strided": (Layer("strided", 32, 32, 32, 3, 2, 1, 1, 1),
                Layer("strided", 16, 16, 16, 3, 2, 1, 1, 2)),
    "depthwise": (Layer("depthwise", 64, 64, 16, 3, 1, 1, 64, 2),
                  Layer("depthwise", 32, 32, 8, 3, 1, 1, 32, 2)),
}


def _inputs(torch, layer: Layer, device):
    """mu, a full symmetric gamma (a smooth covariance plus a random symmetric part, so
    every entry matters) and the weight, float32, on the device."""
    g = torch.Generator(device=device).manual_seed(0)
    L, n = layer, layer.Ci * layer.H * layer.H
    mu = torch.rand(L.B, L.Ci, L.H, L.H, generator=g, device=device)
    A = torch.randn(L.B, n, n, generator=g, device=device) / n
    gamma = A + A.transpose(1, 2)
    gamma.diagonal(0, 1, 2).add_(1.0)
    w = torch.randn(L.Co, L.Ci // L.groups, L.k, L.k, generator=g, device=device)
    return mu, gamma.reshape(L.B, L.Ci, L.H, L.H, L.Ci, L.H, L.H), w


def _two_convs(F, gamma, w, layer: Layer):
    """K gamma K^T with two conv2d calls: the right index first, then the left one."""
    B, Ci, H = layer.B, layer.Ci, layer.H
    n = Ci * H * H
    T = F.conv2d(gamma.reshape(B * n, Ci, H, H), w, None, **layer.conv())
    m = T[0].numel()
    T = T.reshape(B, n, m).transpose(1, 2).reshape(B * m, Ci, H, H)
    return F.conv2d(T, w, None, **layer.conv()).reshape(B, m, m).transpose(1, 2)


def _rows(torch, layer: Layer, device):
    """(name, precision, call, which reference) for every row that can run here; and the
    rows that cannot, with why."""
    F = torch.nn.functional
    mu, gamma, w = _inputs(torch, layer, device)
    conv = layer.conv()
    rows, skipped = [], []
    for layout in ("full", "diag", "var"):
        rows.append((f"conv2d_moments {layout}", "float32",
                     lambda layout=layout: convcov.conv2d_moments(
                         mu, gamma, w, c=C, out_layout=layout, **conv)[1], layout))
    if device == "cpu":
        mn, gn, wn = mu.numpy(), gamma.numpy(), w.numpy()
        for layout in ("full", "diag", "var"):
            rows.append((f"conv2d_moments {layout} (numpy)", "float32",
                         lambda layout=layout: convcov.conv2d_moments(
                             mn, gn, wn, c=C, out_layout=layout, **conv)[1], layout))
    try:
        import torchadf.nn.functional as adf

        rows.append(("torch-adf full", "float32",
                     lambda: adf.conv2d(mu, gamma, w, None, layer.stride, layer.padding, 1,
                                        layer.groups, mode="full")[1], "carried"))
    except Exception as exc:  # not installed, or not importable with this torch
        skipped.append(("torch-adf full", f"{type(exc).__name__}: {exc}"))
    rows.append(("two conv2d", "float32", lambda: _two_convs(F, gamma, w, layer), "carried"))
    if device != "cpu":
        rows.append(("two conv2d", "tf32", lambda: _two_convs(F, gamma, w, layer), "carried"))
        gb, wb = gamma.bfloat16(), w.bfloat16()
        rows.append(("two conv2d", "bfloat16", lambda: _two_convs(F, gb, wb, layer),
                     "carried"))
    refs = {"carried": lambda: convcov.conv2d_moments(
        mu.double(), gamma.double(), w.double(), **conv)[1]}
    for layout in ("full", "diag", "var"):
        refs[layout] = (lambda layout=layout: convcov.conv2d_moments(
            mu.double(), gamma.double(), w.double(), c=C, out_layout=layout, **conv)[1])
    return rows, skipped, refs


def _reach(n, n_out, k, s, p) -> tuple[int, int]:
    """Along one axis: how many input positions some window reads, and how many ordered
    pairs of positions lie in one window together."""
    windows = [{i * s - p + u for u in range(k)} & set(range(n)) for i in range(n_out)]
    return len(set().union(*windows)), len({(a, b) for w in windows for a in w for b in w})


def _work(layer: Layer, layout: str, itemsize: int = 4) -> tuple[int, int]:
    """(bytes, floating-point operations) that a layer's ``K gamma K^T`` in ``layout`` must
    move and do, with a full ``gamma``: the entries of ``gamma`` the layout depends on read
    and the result written once; the first convolution (the right index of ``gamma``, the
    rows the layout reaches), then the second, only the half of each symmetric block that
    the layout keeps. With ``N = Ci H W`` input positions, ``M = Co Q`` output ones (``Q =
    Ho Wo``) and ``t = (Ci / G) kh kw`` terms an output sums: full ``2 B N M t + B M^2
    t``; diag ``2 B N M t / G + B Co Q^2 t`` (a channel's block needs only its group's
    rows); var ``B M t^2`` (each variance a quadratic form of ``t`` terms, half of it by
    symmetry). The entries: full, every pair of positions some window reads; diag, the
    pairs within a group; var, the pairs within a group and within one window."""
    L = layer
    Ho = (L.H + 2 * L.padding - L.k) // L.stride + 1
    N, Q, t = L.Ci * L.H * L.H, Ho * Ho, L.Ci // L.groups * L.k * L.k
    M, Cg = L.Co * Q, L.Ci // L.groups
    covered, pairs = _reach(L.H, Ho, L.k, L.stride, L.padding)  # the same along both axes
    read = {"full": (L.Ci * covered**2) ** 2, "diag": L.groups * (Cg * covered**2) ** 2,
            "var": L.groups * Cg**2 * pairs**2}[layout]
    result = {"full": M * M, "diag": L.Co * Q * Q, "var": M}[layout]
    flops = {"full": 2 * L.B * N * M * t + L.B * M * M * t,
             "diag": 2 * L.B * N * M * t // L.groups + L.B * L.Co * Q * Q * t,
             "var": L.B * M * t * t}[layout]
    return (L.B * read + L.B * result) * itemsize, flops


def _peaks(torch, device) -> dict:
    """Floating-point operations a second of a large matrix product on ``device``, by
    precision (the median of a few after a warm-up)."""
    n = 8192 if device != "cpu" else 2048
    backends = torch.backends.cuda.matmul
    peaks = {}
    for precision, dtype in (("float32", torch.float32), ("tf32", torch.float32),
                             ("bfloat16", torch.bfloat16)):
        if device == "cpu" and precision != "float32":
            continue
        a = torch.rand(n, n, device=device, dtype=dtype)
        saved = backends.allow_tf32
        backends.allow_tf32 = precision == "tf32"
        try:
            torch.matmul(a, a)
            peaks[precision] = 2 * n**3 / _time(torch, lambda a=a: torch.matmul(a, a), device,
                                                5, 1.0)
        finally:
            backends.allow_tf32 = saved
    return peaks


def _floors(torch, device, rows):
    """Each timed row's floor (``floor_s``), what sets it (``bound``) and its ``of_floor``."""
    from .bench import _Cuda, _Host

    bandwidth = (_Host() if device == "cpu" else _Cuda()).copy_bandwidth()
    peaks = _peaks(torch, device)
    for r in rows:
        if "seconds" not in r:
            continue
        layout = r["impl"].split()[1] if r["impl"].startswith("conv2d_moments") else "full"
        nbytes, flops = _work(LAYERS[r["layer"]][device == "cpu"], layout,
                              2 if r["precision"] == "bfloat16" else 4)
        memory, compute = nbytes / bandwidth, flops / peaks[r["precision"]]
        r["floor_s"], r["bound"] = max(memory, compute), "memory" if memory >= compute else \
            "FLOPs"
        r["of_floor"] = r["floor_s"] / r["seconds"]
    return dict(copy_bandwidth=bandwidth, peak_flops=peaks)


class _Precision:
    """cuDNN's TF32 switch for the row's precision (restored afterwards)."""

    def __init__(self, torch, precision):
        self.cudnn, self.tf32 = torch.backends.cudnn, precision == "tf32"

    def __enter__(self):
        self.saved = self.cudnn.allow_tf32
        self.cudnn.allow_tf32 = self.tf32

    def __exit__(self, *exc):
        self.cudnn.allow_tf32 = self.saved


def _error(torch, got, ref) -> float:
    got = torch.as_tensor(got).to(ref.device, torch.float64).reshape(ref.shape)
    return float((got - ref).abs().max() / ref.abs().max())


def _time(torch, call, device, repeat, budget_s) -> float:
    """Median seconds of one call, over up to ``repeat`` calls within ``budget_s``."""
    times, start = [], time.perf_counter()
    while len(times) < repeat and (len(times) < 3 or time.perf_counter() - start < budget_s):
        if device == "cpu":
            t = time.perf_counter()
            call()
            times.append(time.perf_counter() - t)
        else:
            torch.cuda.synchronize()
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            call()
            e1.record()
            e1.synchronize()
            times.append(e0.elapsed_time(e1) / 1e3)
    return statistics.median(times)


def run(device="cpu", layers=None, repeat=20, budget_s=10.0, progress=None) -> dict:
    """Measure every row of every layer (``layers``: names of :data:`LAYERS`, default all)
    on ``device`` ("cpu" or "cuda"); the result as a JSON-ready dict."""
    import torch

    names = list(LAYERS) if not layers else list(layers)
    unknown = [n for n in names if n not in LAYERS]
    if unknown:
        raise ValueError(f"unknown layer {unknown[0]!r}; layers: {', '.join(LAYERS)}")
    results = []
    for name in names:
        layer = LAYERS[name][device == "cpu"]
        rows, skipped, refs = _rows(torch, layer, device)
        ref_values = {}
        for impl, precision, call, which in rows:
            if progress:
                progress(f"{layer.name}: {impl} ({precision})")
            row = dict(layer=layer.name, shape=layer.describe(), impl=impl,
                       precision=precision)
            try:
                if which not in ref_values:
                    ref_values[which] = refs[which]()
                with _Precision(torch, precision):
                    row["error"] = _error(torch, call(), ref_values[which])
                    if row["error"] <= TOLERANCE[precision]:
                        row["seconds"] = _time(torch, call, device, repeat, budget_s)
                    else:
                        row["failed"] = f"error {row['error']:.2g} > {TOLERANCE[precision]}"
            except Exception as exc:  # out of memory, an unsupported precision, ...
                row["failed"] = f"{type(exc).__name__}: {exc}"[:200]
            results.append(row)
            if device != "cpu":
                torch.cuda.empty_cache()
        results += [dict(layer=layer.name, shape=layer.describe(), impl=impl,
                         precision="float32", failed=why) for impl, why in skipped]
        del ref_values
    _speedups(results)
    machine = _floors(torch, device, results)
    return dict(suite="moments", device=_device_name(torch, device), date=str(
        datetime.date.today()), torch=torch.__version__, torchadf=_version("torchadf"),
        python=platform.python_version(), **machine, rows=results)


def _speedups(rows):
    """Each timed row's speed-up over torch-adf's full mode on its layer (the two-conv2d
    float32 row where torch-adf was not measured)."""
    for layer in {r["layer"] for r in rows}:
        mine = [r for r in rows if r["layer"] == layer and "seconds" in r]
        base = ([r for r in mine if r["impl"] == "torch-adf full"]
                or [r for r in mine if r["impl"] == "two conv2d" and r["precision"] == "float32"])
        for r in mine:
            if base:
                r["speedup"] = base[0]["seconds"] / r["seconds"]
                r["baseline"] = base[0]["impl"]


def _version(module):
    try:
        from importlib.metadata import version

        return version({"torchadf": "torch-adf"}.get(module, module))
    except Exception:
        return None


def _device_name(torch, device):
    if device == "cpu":
        cpu = platform.processor() or platform.machine()
        return f"cpu: {cpu}, {torch.get_num_threads()} threads"
    return torch.cuda.get_device_name()


def table(result: dict):
    """The rows as a rich table."""
    from rich.table import Table

    peaks = ", ".join(f"{k} {v / 1e12:.1f}" for k, v in result["peak_flops"].items())
    t = Table(title=f"conv2d_moments vs plain full-covariance propagation on "
                    f"{result['device']} (torch {result['torch']}, torch-adf "
                    f"{result['torchadf'] or 'not installed'}); floor: copy "
                    f"{result['copy_bandwidth'] / 1e9:.0f} GB/s, matmul TFLOP/s {peaks}")
    for col, just in (("layer", "left"), ("shape", "left"), ("implementation", "left"),
                      ("precision", "left"), ("error", "right"), ("time", "right"),
                      ("speed-up", "right"), ("floor", "right"), ("of floor", "right")):
        t.add_column(col, justify=just)
    for r in result["rows"]:
        time_s = (f"{r['seconds'] * 1e3:.2f} ms" if "seconds" in r else r.get("failed", ""))
        floor = f"{r['floor_s'] * 1e3:.2f} ms ({r['bound']})" if "floor_s" in r else ""
        t.add_row(r["layer"], r["shape"], r["impl"], r["precision"],
                  f"{r['error']:.1e}" if "error" in r else "",
                  time_s, f"{r['speedup']:.2f}x" if "speedup" in r else "", floor,
                  f"{r['of_floor']:.2f}" if "of_floor" in r else "")
    return t


def save_json(result, path):
    with open(path, "w") as f:
        json.dump(result, f, indent=1)


def main(args, console):
    """``convcov bench --suite moments``: the host, CUDA or both (``--device``); layers by
    ``--workload``; ``--repeat`` and ``--budget`` per row; ``--json``."""
    import torch

    devices = {"auto": ["cpu"] + (["cuda"] if torch.cuda.is_available() else []),
               "cpu": ["cpu"], "cuda": ["cuda"]}[args.device]
    results = []
    for device in devices:
        results.append(run(device, args.workload, min(args.repeat, 50), args.budget,
                           lambda what: console.print(f"{what} ...", highlight=False)))
        console.print(table(results[-1]))
    if args.json:
        save_json(results[0] if len(results) == 1 else {"runs": results}, args.json)
        console.print(f"wrote {args.json}")
    return results


if __name__ == "__main__":
    import argparse

    from rich.console import Console

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    p.add_argument("--workload", action="append", help=f"a layer: {', '.join(LAYERS)}")
    p.add_argument("--repeat", type=int, default=20)
    p.add_argument("--budget", type=float, default=10.0)
    p.add_argument("--json")
    main(p.parse_args(), Console(width=160))
