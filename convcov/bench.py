"""``convcov bench``: the one place convcov's speed is measured (SPEC section 5).

For each reference workload and each available backend on the device: check the result
against the numpy reference (on the first batch element, in float64), then time whole
``convcov.accumulate`` calls (dispatch included) and take the median. On a GPU the rows'
calls are interleaved in rounds (``_rows``), so that no row alone catches a slow stretch
of the device. The floor of one call is ``bytes / copy bandwidth`` with bytes = |gamma
channel-diagonal| + |mu| + 2 |out channel-diagonal| + |c| and the bandwidth of a large
copy (bytes read + written) measured in the same run; ``fraction`` = floor / time (1.0 =
at the memory floor). The same run times the plain PyTorch expression
(:mod:`convcov.torch_expr`) eagerly and under ``torch.compile`` on the same arrays.

With ``grad=True`` (``convcov bench --grad``) it also times forward + backward through
torch autograd (gradients of gamma, mu and c) for every backend with a backward and for
``torch.compile`` of the plain expression: rows ``"<impl> fwd+bwd"``, whose floor adds what
the backward must move at least (one read of the gradient of out's channel-diagonal, one
write of gamma's channel-diagonal gradient and of mu's).

Host timings use ``time.perf_counter``; CUDA timings use CUDA events around each call,
with the queue drained before it, so a small call's time includes its Python dispatch.
Inputs are small positive numbers so that hundreds of repeated accumulations stay finite
even in float16.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import statistics
import time
from dataclasses import asdict, dataclass

import numpy as np

import convcov
from convcov import _frontend, _registry


@dataclass(frozen=True)
class Workload:
    name: str
    B: int
    Ci: int
    Co: int
    H: int
    k: int
    layout: str  # "full" or "diag", for out and gamma alike
    dtype: str
    device: str  # where the workload is run: "cpu", "cuda" or "both"

    @property
    def Ho(self):
        return self.H - self.k + 1

    def floor_bytes(self) -> int:
        size = np.dtype(self.dtype).itemsize
        gamma = self.B * self.Ci * self.H**4
        mu = self.B * self.Ci * self.H**2
        out = self.B * self.Co * self.Ho**4
        return size * (gamma + mu + 2 * out + self.Co)

    def fwd_bwd_floor_bytes(self) -> int:
        """The forward's bytes plus the backward's least: read the gradient of out's
        channel-diagonal, write gamma's channel-diagonal gradient and mu's gradient."""
        size = np.dtype(self.dtype).itemsize
        extra = self.B * (self.Co * self.Ho**4 + self.Ci * self.H**4 + self.Ci * self.H**2)
        return self.floor_bytes() + size * extra


#: SPEC section 5's reference workloads.
WORKLOADS = [
    Workload("toy", 2, 3, 3, 9, 3, "full", "float32", "both"),
    Workload("cpu", 8, 16, 16, 16, 3, "full", "float32", "cpu"),
    Workload("mid", 16, 32, 32, 16, 3, "full", "float32", "cuda"),
    Workload("big-f32", 32, 64, 64, 32, 3, "diag", "float32", "cuda"),
    Workload("big-f16", 32, 64, 64, 32, 3, "diag", "float16", "cuda"),
]


@dataclass
class Row:
    workload: str
    impl: str  # a backend name, "torch" (eager) or "torch.compile"
    median_us: float
    floor_us: float
    fraction: float  # floor / median
    rel_error: float | None  # ||got - ref|| / ||ref|| on batch element 0; None if unchecked
    calls: int


# --------------------------------------------------------------------------- arrays
class _Host:
    """numpy arrays (torch views of them for the torch baselines)."""

    name = "cpu"
    #: One row after another: on the 2-core host, interleaving made torch eager's `cpu`
    #: row slower in 5 of 6 alternations (by up to 21%), which flatters numba's speed-up,
    #: and the host's drift (its copy's two modes) is minutes long, beyond what rounds
    #: within a run even out (docs/performance.md, "How the bench times").
    rounds = 1

    def __init__(self):
        self.rng = np.random.default_rng(0)

    def rand(self, shape, dtype, scale):
        return (self.rng.random(shape, dtype=np.float32) * scale).astype(dtype, copy=False)

    def to_host64(self, x):
        return np.asarray(x, np.float64)

    def clone(self, x):
        return x.copy()

    def torch(self, x):
        import torch

        return torch.from_numpy(x)

    def copy_bandwidth(self):
        """The faster of a one-thread copy (np.copyto) and an all-core copy (numba prange):
        the floor must be what the machine can move, not what one core can."""
        from numba import njit, prange

        @njit(parallel=True, cache=False)
        def parallel_copy(src, dst):
            for i in prange(src.size):
                dst[i] = src[i]

        a = np.ones(64 * 2**20, np.float32)  # 256 MiB, far beyond the caches
        b = np.empty_like(a)
        best = 0.0
        # Five rounds: on this project's 2-vCPU machines the all-core copy is bimodal
        # (about 40 or about 70 GB/s from one round to the next, 2026-11-30); the floor
        # must be the fast mode, or a backend would look closer to it than it is.
        for _ in range(5):
            for copy in (lambda: np.copyto(b, a), lambda: parallel_copy(a, b)):
                copy()  # warm-up: page faults, compilation
                ts = []
                for _ in range(7):
                    t0 = time.perf_counter()
                    copy()
                    ts.append(time.perf_counter() - t0)
                best = max(best, 2 * a.nbytes / statistics.median(ts))
        return best

    def time_calls(self, fn, repeat, budget_s, least=5):
        """Up to ``repeat`` calls' times (s), stopping past ``budget_s`` once ``least`` are in."""
        ts, start = [], time.perf_counter()
        for _ in range(repeat):
            t0 = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t0)
            if time.perf_counter() - start > budget_s and len(ts) >= least:
                break
        return ts

    def describe(self):
        return host_cpu()


class _Cuda:
    """torch CUDA tensors, the arrays GPU users hold."""

    name = "cuda"
    #: Interleaved: the H200's power-cap dip otherwise lands on one row (docs/performance.md).
    rounds = 5

    def __init__(self):
        import torch

        self.t = torch
        self.gen = torch.Generator(device="cuda").manual_seed(0)

    def rand(self, shape, dtype, scale):
        t = self.t
        return t.rand(shape, generator=self.gen, device="cuda", dtype=getattr(t, dtype)) * scale

    def to_host64(self, x):
        return x.detach().double().cpu().numpy()

    def clone(self, x):
        return x.clone()

    def torch(self, x):
        return x

    def copy_bandwidth(self):
        t = self.t
        a = t.ones(512 * 2**20, dtype=t.float32, device="cuda")  # 2 GiB
        b = t.empty_like(a)
        for _ in range(3):
            b.copy_(a)
        ts = self.time_calls(lambda: b.copy_(a), 20, 5.0)
        return 2 * 512 * 2**20 * 4 / statistics.median(ts)

    def time_calls(self, fn, repeat, budget_s, least=5):
        t = self.t
        pairs, start = [], time.perf_counter()
        for _ in range(repeat):
            t.cuda.synchronize()  # an empty queue: the interval includes host dispatch
            e0, e1 = t.cuda.Event(enable_timing=True), t.cuda.Event(enable_timing=True)
            e0.record()
            fn()
            e1.record()
            pairs.append((e0, e1))
            if time.perf_counter() - start > budget_s and len(pairs) >= least:
                break
        t.cuda.synchronize()
        return [e0.elapsed_time(e1) / 1e3 for e0, e1 in pairs]

    def describe(self):
        p = self.t.cuda.get_device_properties(0)
        return f"{p.name}, {p.multi_processor_count} SMs, {p.total_memory / 2**30:.0f} GiB"


# --------------------------------------------------------------------------- running
def _inputs(dev, w: Workload):
    out_shape = ((w.B, w.Co, w.Ho, w.Ho, w.Co, w.Ho, w.Ho) if w.layout == "full"
                 else (w.B, w.Co, w.Ho, w.Ho, w.Ho, w.Ho))
    gamma_shape = ((w.B, w.Ci, w.H, w.H, w.Ci, w.H, w.H) if w.layout == "full"
                   else (w.B, w.Ci, w.H, w.H, w.H, w.H))
    return dict(out=dev.rand(out_shape, w.dtype, 1.0), gamma=dev.rand(gamma_shape, w.dtype, 0.01),
                mu=dev.rand((w.B, w.Ci, w.H, w.H), w.dtype, 0.1), c=dev.rand((w.Co,), w.dtype, 1.0))


def _first_batch(a):
    return a[:1]


def _check(dev, w, a, run) -> float:
    """Relative error of one call on batch element 0 against the float64 numpy reference."""
    out = dev.clone(_first_batch(a["out"]))
    args = [_first_batch(a["gamma"]), _first_batch(a["mu"]), a["c"]]
    run(out, *args)
    got = dev.to_host64(out)
    ref = convcov.accumulate(dev.to_host64(_first_batch(a["out"])),
                             *(dev.to_host64(x) for x in args), w.k, backend="numpy")
    return float(np.linalg.norm(got - ref) / np.linalg.norm(ref))


def _impls(dev, backends, with_torch):
    impls = {}
    for row in convcov.backends():
        if backends and row.name not in backends:
            continue
        b = _registry.get(row.name)
        if row.available and b.device == dev.name:
            impls[row.name] = (lambda name: lambda out, gamma, mu, c, w: convcov.accumulate(
                out, gamma, mu, c, w.k, backend=name))(row.name)
    if with_torch:
        try:
            import torch  # noqa: F401

            from convcov import torch_expr
        except ImportError:
            return impls
        eager = lambda out, gamma, mu, c, w: torch_expr.accumulate(  # noqa: E731
            dev.torch(out), dev.torch(gamma), dev.torch(mu), dev.torch(c), w.k, w.k)
        impls["torch"] = eager
        compiled = torch.compile(torch_expr.accumulate, dynamic=False)
        impls["torch.compile"] = lambda out, gamma, mu, c, w: compiled(
            dev.torch(out), dev.torch(gamma), dev.torch(mu), dev.torch(c), w.k, w.k)
    return impls


def _not_measured(dev, backends):
    """Backends left out of a run, and why: those of this device that are not available
    here (a run should say so, not just lack their rows), and those asked for by name
    that run on another device."""
    out = []
    for row in convcov.backends():
        on_device = _registry.get(row.name).device == dev.name
        if backends and row.name not in backends:
            continue
        if on_device and not row.available:
            out.append(dict(backend=row.name, reason=row.reason))
        elif not on_device and backends:
            out.append(dict(backend=row.name, reason=f"runs on {row.device} arrays, "
                                                     f"not {dev.name}"))
    return out


def _baseline(name):
    """Whether row ``name`` is a torch baseline ("torch", "torch.compile", "... fwd+bwd")
    rather than a convcov backend."""
    return name.split(" ")[0] in ("torch", "torch.compile")


def _rows(dev, w, calls, floor_s, repeat, budget_s, rounds, progress=None, task=None):
    """One row per entry of ``calls`` (name -> (call, check or None)): ``check()`` (the
    relative error), a warm-up, then the timed calls in ``rounds`` interleaved rounds,
    each of which times up to ``repeat / rounds`` calls of every implementation in turn,
    the order reversed every other round. Interleaving gives every implementation the
    same moments of the machine: timed one block after another, a slow stretch (the
    H200's clock dip when it reaches its power limit) lands on one row only and decides
    a close comparison (docs/performance.md, "How the bench times"). A failing
    implementation is a row, not a crash."""
    ok, failed = {}, {}
    for name, (call, check) in calls.items():
        if progress:
            progress.update(task, description=f"{w.name} / {name}")
        try:
            err = check() if check else None
            for _ in range(3):  # warm-up: compilation, caches, allocator
                call()
            ok[name] = (call, err, [])
        except Exception as exc:
            # The text, not the exception: its traceback would keep the workload's
            # arrays alive (the frames hold them) past the caller's ``del``.
            failed[name] = f"{type(exc).__name__}: {exc}"
    rounds = max(1, min(rounds, repeat))
    for r in range(rounds):
        if progress:
            progress.update(task, description=f"{w.name}: round {r + 1} of {rounds}")
        for name in (list(ok) if r % 2 == 0 else list(ok)[::-1]):
            call, _, ts = ok[name]
            if name in failed:
                continue
            try:  # repeat calls in all, shared out among the rounds
                ts += dev.time_calls(call, repeat // rounds + (r < repeat % rounds),
                                     budget_s / rounds, least=-(-5 // rounds))
            except Exception as exc:
                failed[name] = f"{type(exc).__name__}: {exc}"
    rows = []
    for name in calls:
        if name in failed:
            rows.append(Row(w.name, f"{name} (failed: {failed[name]})"[:120],
                            float("nan"), floor_s * 1e6, float("nan"), None, 0))
        else:
            _, err, ts = ok[name]
            med = statistics.median(ts)
            rows.append(Row(w.name, name, med * 1e6, floor_s * 1e6, floor_s / med, err,
                            len(ts)))
        if progress:
            progress.advance(task)
    return rows


def _grouped_rows(dev, w, calls, *args):
    """``_rows`` for convcov's backends, then for the torch baselines: each group is
    interleaved within itself only, because a baseline's heavy calls leave the GPU
    power-capped and slower for whatever follows them (docs/performance.md, "How the
    bench times")."""
    return [row for group in (False, True) for row in _rows(
        dev, w, {k: v for k, v in calls.items() if _baseline(k) == group}, *args)]


def _grad_impls(dev, backends, with_torch):
    """Forward + backward through torch autograd: (out, leaves, G, w) -> gradients."""
    try:
        import torch

        from convcov import torch_expr
    except ImportError:
        return {}
    impls = {}
    for row in convcov.backends():
        b = _registry.get(row.name)
        if (row.available and b.device == dev.name and (not backends or row.name in backends)
                and _frontend.has_vjp(b)):
            impls[f"{row.name} fwd+bwd"] = (lambda name: lambda out, leaves, G, w: (
                torch.autograd.grad(convcov.accumulate(out, *leaves, w.k, backend=name),
                                    leaves, G)))(row.name)
    if with_torch:
        compiled = torch.compile(torch_expr.accumulate, dynamic=False)
        impls["torch.compile fwd+bwd"] = lambda out, leaves, G, w: torch.autograd.grad(
            compiled(out, *leaves, w.k, w.k), leaves, G)
    return impls


def _time_grad(dev, w, sets, impls, bandwidth, repeat, budget_s, rounds, progress, task):
    """Rows "<impl> fwd+bwd": out is a fresh alias (detach) of the set's out each call, so
    no call's graph chains onto the last; gamma, mu and c require grad."""
    floor_s = w.fwd_bwd_floor_bytes() / bandwidth
    G = dev.torch(dev.rand(sets[0]["out"].shape, w.dtype, 1.0))  # the incoming gradient
    views = [dict(out=dev.torch(x["out"]), leaves=[dev.torch(x[k]).detach().requires_grad_()
                                                   for k in ("gamma", "mu", "c")])
             for x in sets]
    turn = [0]

    def grad_call(impl):
        def call():
            turn[0] = (turn[0] + 1) % len(views)
            v = views[turn[0]]
            impl(v["out"].detach(), v["leaves"], G, w)

        return call

    calls = {name: (grad_call(impl), None) for name, impl in impls.items()}
    return _grouped_rows(dev, w, calls, floor_s, repeat, budget_s, rounds, progress, task)


def _workload_rows(dev, w, impls, gimpls, bandwidth, repeat, budget_s, rounds, progress,
                   task):
    """The rows of workload ``w``: each implementation checked, then timed (with the
    "fwd+bwd" rows of ``gimpls`` when there are any)."""
    # Rotate among input sets whose bytes outgrow the last-level caches, so repeated
    # calls are not served from cache (toy is latency-bound: one set).
    sets = [_inputs(dev, w) for _ in range(1 if w.name == "toy" or
                                           w.floor_bytes() > 2**30 else 3)]
    a = sets[0]
    turn = [0]

    def rotating():
        turn[0] = (turn[0] + 1) % len(sets)
        return sets[turn[0]]

    floor_s = w.floor_bytes() / bandwidth

    def timed(impl):
        def call():
            x = rotating()
            impl(x["out"], x["gamma"], x["mu"], x["c"], w)

        return call

    # torch.compile is not re-checked: checking would compile a second graph for
    # the one-batch shape; it compiles the eager expression checked above.
    calls = {name: (timed(impl), None if name == "torch.compile" else (
        lambda impl=impl: _check(dev, w, a, lambda out, g, m, c: impl(out, g, m, c, w))))
        for name, impl in impls.items()}
    rows = _grouped_rows(dev, w, calls, floor_s, repeat, budget_s, rounds, progress, task)
    if gimpls:
        rows += _time_grad(dev, w, sets, gimpls, bandwidth, repeat, budget_s, rounds,
                           progress, task)
    return rows


def run(device="cpu", workloads=None, backends=None, with_torch=True, repeat=200,
        budget_s=3.0, progress=None, grad=False, rounds=None) -> dict:
    """Measure; returns a JSON-ready dict (machine, date, bandwidth, rows). ``repeat`` and
    ``budget_s`` bound one row's timed calls and seconds, spread over ``rounds``
    interleaved rounds (``rounds=1``: one row after another; default: the device's)."""
    dev = _Cuda() if device == "cuda" else _Host()
    rounds = max(1, min(dev.rounds if rounds is None else rounds, repeat))
    chosen = [w for w in WORKLOADS if w.device in (device, "both")
              and (not workloads or w.name in workloads)]
    bandwidth = dev.copy_bandwidth()
    impls = _impls(dev, backends, with_torch)
    gimpls = _grad_impls(dev, backends, with_torch) if grad else {}
    rows = []
    task = (progress.add_task("bench", total=len(chosen) * (len(impls) + len(gimpls)))
            if progress else None)
    for w in chosen:  # (each workload's arrays are freed when its function returns)
        rows += _workload_rows(dev, w, impls, gimpls, bandwidth, repeat, budget_s, rounds,
                               progress, task)
    return dict(
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        device=device, machine=dev.describe(), host=host_cpu(), convcov=convcov.__version__,
        versions=_versions(), copy_bandwidth_GBps=bandwidth / 1e9, rounds=rounds,
        workloads=[asdict(w) for w in chosen], rows=[asdict(r) for r in rows],
        not_measured=_not_measured(dev, backends),
    )


def host_cpu() -> str:
    """The host's processor model and core count. The model is recorded because this
    project's 2-core machines have not always been the same processor (an AMD EPYC until
    2026-11-30, an Intel Xeon since 2026-12-01, with a third of the memory speed), and a
    host timing means nothing without it."""
    model = ""
    try:
        with open("/proc/cpuinfo") as f:  # Linux; platform.processor() says only "x86_64"
            for line in f:
                if line.startswith(("model name", "Model", "Hardware")):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return f"{model or platform.processor() or platform.machine()}, {os.cpu_count()} cores"


def _versions():
    import sys

    v = {"python": platform.python_version(), "numpy": np.__version__}
    for mod in ("numba", "torch", "cupy", "numba_cuda"):
        m = sys.modules.get(mod)
        if m is not None:
            v[mod] = getattr(m, "__version__", "?")
    return v


def table(result: dict):
    """A rich Table of one run."""
    from rich.table import Table

    host = result.get("host")  # (absent from runs recorded before 2026-12-01 12:30 UTC)
    on = result["machine"]
    if host not in (None, on):
        on = f"{on} (host: {host})"
    t = Table(title=f"convcov bench on {on} ({result['date']}); "
                    f"copy bandwidth {result['copy_bandwidth_GBps']:.1f} GB/s")
    for col in ("workload", "impl", "median µs", "floor µs", "fraction of floor",
                "rel. error", "calls"):
        t.add_column(col, justify="left" if col in ("workload", "impl") else "right")
    for r in result["rows"]:
        err = "-" if r["rel_error"] is None else f"{r['rel_error']:.1e}"
        t.add_row(r["workload"], r["impl"], f"{r['median_us']:.1f}", f"{r['floor_us']:.1f}",
                  f"{r['fraction']:.2f}", err, str(r["calls"]))
    return t


def save_json(result: dict, path: str):
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
