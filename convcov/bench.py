"""``convcov bench``: the one place convcov's speed is measured (SPEC section 5).

Owns the workloads (the ``reference`` suite, and the ``layers`` suite of real networks'
conv layers: :data:`SUITES`), the memory floor of each (:class:`Workload`), the timing,
the run's rows, its summary and their tables.

For each workload of the chosen suite and each available backend on the device: check
the result against the numpy reference (on the first batch element, in float64; a
result past ``TOLERANCE`` is a failed row, never timed), then time whole
``convcov.accumulate`` calls (dispatch included) and take the median. On a GPU the rows'
calls are interleaved in rounds (``_rows``), so that no row alone catches a slow stretch
of the device. The floor of one call is ``bytes / copy bandwidth``, with bytes = the
32-byte sectors of gamma's and of mu's contiguous layouts that hold an entry the
operation reads (:func:`read_pairs`, :func:`sectors`: a strided layer reads less than
all of them) + 2 |out channel-diagonal| + |c|, and the bandwidth of a large copy (bytes
read + written) measured in the same run; ``fraction`` = floor / time (1.0 = at the
memory floor). The same run times the plain PyTorch expression
(:mod:`convcov.torch_expr`) eagerly and under ``torch.compile`` (compiled afresh for each
workload's shape) on the same arrays, and gives each backend's speed-up over the faster
of the two; the summary holds, per suite and implementation, the geometric mean and the
worst over the suite's workloads.

With ``grad=True`` (``convcov bench --grad``) it also times forward + backward through
torch autograd (gradients of gamma, mu and c) for every backend with a backward and for
``torch.compile`` of the plain expression: rows ``"<impl> fwd+bwd"``, whose floor adds what
the backward must move at least (one read of the gradient of out's channel-diagonal, one
write of gamma's channel-diagonal gradient and of mu's).

Host timings use ``time.perf_counter``; CUDA timings use CUDA events around each call,
with the queue drained before it, so a small call's time includes its Python dispatch.
On the GPU every array is a torch CUDA tensor (bfloat16 layers included); on the host a
numpy array, so the host runs the bfloat16 layers in float32. Inputs are small positive
numbers so that hundreds of repeated accumulations stay finite even in float16.
"""

from __future__ import annotations

import datetime
import functools
import json
import math
import os
import platform
import statistics
import time
from dataclasses import InitVar, asdict, dataclass

import numpy as np

import convcov
from convcov import _frontend, _registry


#: Bytes of one entry, by dtype name (bfloat16 has no numpy dtype).
ITEMSIZE = {"float16": 2, "bfloat16": 2, "float32": 4, "float64": 8}
#: The unit of a memory access the floor counts: a 32-byte sector, the smallest piece of
#: memory a GPU reads or writes. (A CPU moves 64-byte lines, so on the host the floor
#: can be lower than what must move: a fraction there errs low, never high.)
SECTOR = 32


def read_pairs(n, n_out, k, s, p, d):
    """Along one axis, the input pairs ``(x0, x1)`` (an ``n x n`` boolean array) that the
    operation reads together: ``x0 = o0*s + i*d - p`` and ``x1 = o1*s + i*d - p`` for one
    kernel offset ``i`` and outputs ``o0, o1 < n_out``, both inside ``[0, n)``. Its
    diagonal is the positions read at all. gamma's entries read are the pairs of both
    axes: ``(x0, x1)`` read along H and ``(y0, y1)`` along W (the offsets ``ii`` and
    ``ji`` are independent). With stride 1 and dilation 1 the pairs are a band
    ``|x1 - x0| <= n_out - 1``, all pairs when the padding keeps ``n_out = n``; with
    stride s only pairs ``x1 - x0 = s (o1 - o0)``, a multiple of s, are read."""
    M = np.zeros((n, n), bool)
    for i in range(k):
        x = np.arange(n_out) * s + i * d - p
        x = x[(x >= 0) & (x < n)]
        M[np.ix_(x, x)] = True
    return M


def sectors(R, N, blocks, itemsize):
    """The number of SECTOR-byte sectors that hold at least one entry read in a contiguous
    array of ``blocks`` consecutive blocks of ``N`` entries each, every block read at the
    sorted in-block flat indices ``R`` (the array starting on a sector boundary)."""
    R = np.asarray(R, np.int64)
    if blocks == 0 or R.size == 0:
        return 0
    block_bytes = N * itemsize
    if block_bytes % SECTOR == 0:  # every block starts on a sector boundary: none shared
        sec = R * itemsize // SECTOR
        return blocks * (1 + int(np.count_nonzero(np.diff(sec))))
    if block_bytes < SECTOR or blocks * R.size <= 2**20:  # small: every entry at once
        sec = (np.arange(blocks, dtype=np.int64)[:, None] * N + R).ravel() * itemsize // SECTOR
        return 1 + int(np.count_nonzero(np.diff(sec)))
    # Block b starts ``o_b = (b * block_bytes) % SECTOR`` bytes into a sector: its sectors
    # are those of R shifted by o_b, one of a few patterns; a block (at least a sector
    # long) shares a sector only with its neighbours, at most the one where they meet.
    start = np.arange(blocks, dtype=np.int64) * block_bytes
    o, base = start % SECTOR, start // SECTOR
    count = np.zeros(SECTOR, np.int64)
    first, last = np.zeros(SECTOR, np.int64), np.zeros(SECTOR, np.int64)
    for r in np.unique(o):
        sec = (r + R * itemsize) // SECTOR
        count[r], first[r], last[r] = 1 + np.count_nonzero(np.diff(sec)), sec[0], sec[-1]
    shared = base[:-1] + last[o[:-1]] == base[1:] + first[o[1:]]
    return int(count[o].sum() - np.count_nonzero(shared))


@dataclass(frozen=True)
class Workload:
    """One conv layer to time (SPEC section 1's names). ``gamma``: "none", "diag" or
    "full"; ``out``: "diag" or "full". ``layout`` (reading recorded runs, which had one
    layout for both) sets gamma's and out's."""

    name: str
    B: int
    Ci: int
    Co: int
    H: int  # = W
    k: int  # = kh = kw
    gamma: str = "diag"
    out: str = "diag"
    dtype: str = "float32"
    device: str = "both"  # where the workload is run: "cpu", "cuda" or "both"
    stride: int = 1
    padding: int = 0
    dilation: int = 1
    groups: int = 1
    suite: str = "reference"
    layout: InitVar[str | None] = None

    def __post_init__(self, layout):
        if layout is not None:
            object.__setattr__(self, "gamma", layout)
            object.__setattr__(self, "out", layout)

    @property
    def W(self):
        return self.H

    @property
    def Ho(self):
        """As torch.nn.functional.conv2d."""
        return (self.H + 2 * self.padding - self.dilation * (self.k - 1) - 1) // self.stride + 1

    @property
    def Wo(self):
        return self.Ho

    @property
    def conv(self) -> dict:
        """The keyword arguments of convcov.accumulate for this layer."""
        return dict(stride=self.stride, padding=self.padding, dilation=self.dilation,
                    groups=self.groups)

    @property
    def itemsize(self) -> int:
        return ITEMSIZE[self.dtype]

    def _pairs(self):
        p = (self.H, self.Ho, self.k, self.stride, self.padding, self.dilation)
        return read_pairs(*p), read_pairs(*p)  # square: the W axis is the H axis

    def mu_bytes(self) -> int:
        """mu's sectors holding a position some window reads."""
        Mx, My = self._pairs()
        R = np.flatnonzero(np.diag(Mx)[:, None] & np.diag(My)[None, :])
        return SECTOR * sectors(R, self.H * self.W, self.B * self.Ci, self.itemsize)

    def gamma_bytes(self) -> int:
        """gamma's sectors holding an entry of its channel-diagonal that is read:
        ``gamma[b, ci, x0, y0, (ci,) x1, y1]`` for the pairs of :func:`read_pairs`. Each
        ``(x0, y0)`` row of the ``(x1, y1)`` plane is a contiguous run of the layout, in
        both layouts, so the in-block indices of one block are counted with numpy on the
        read pattern of one plane: per (b, ci) in the diagonal layout, per b in the full
        one (there the rows of channel ci sit at ci*(H*W) inside the row of (ci, x0, y0))."""
        if self.gamma == "none":
            return 0
        Mx, My = self._pairs()
        P = self.H * self.W
        plane = (Mx[:, None, :, None] & My[None, :, None, :]).reshape(P, P)  # [p0, p1]
        if self.gamma == "diag":
            return SECTOR * sectors(np.flatnonzero(plane), P * P, self.B * self.Ci,
                                    self.itemsize)
        p0, p1 = np.nonzero(plane)  # row-major: sorted by p0, then p1
        row = p0.astype(np.int64) * (self.Ci * P) + p1
        R = (np.arange(self.Ci, dtype=np.int64)[:, None] * (self.Ci * P * P + P) + row).ravel()
        return SECTOR * sectors(R, self.Ci * P * self.Ci * P, self.B, self.itemsize)

    def out_bytes(self) -> int:
        """out's channel-diagonal, read and written."""
        return 2 * self.itemsize * self.B * self.Co * (self.Ho * self.Wo) ** 2

    def floor_bytes(self) -> int:
        """SPEC section 5's bytes of one call: gamma's and mu's sectors read, out's
        channel-diagonal twice, c."""
        return _floor(self)[0]

    def fwd_bwd_floor_bytes(self) -> int:
        """The forward's bytes plus the backward's least: read the gradient of out's
        channel-diagonal, write gamma's channel-diagonal gradient (where it is read) and
        mu's gradient."""
        return _floor(self)[1]


@functools.lru_cache(maxsize=None)
def _floor(w: Workload):
    gamma, mu, out = w.gamma_bytes(), w.mu_bytes(), w.out_bytes()
    fwd = gamma + mu + out + w.itemsize * w.Co
    return fwd, fwd + out // 2 + gamma + mu


#: SPEC section 5's reference workloads.
WORKLOADS = [
    Workload("toy", 2, 3, 3, 9, 3, "full", "full", "float32", "both"),
    Workload("cpu", 8, 16, 16, 16, 3, "full", "full", "float32", "cpu"),
    Workload("mid", 16, 32, 32, 16, 3, "full", "full", "float32", "cuda"),
    Workload("big-f32", 32, 64, 64, 32, 3, "diag", "diag", "float32", "cuda"),
    Workload("big-f16", 32, 64, 64, 32, 3, "diag", "diag", "float16", "cuda"),
]


def _layer(name, Ci, Co, H, k, s, p, gamma, dtype, d=1, groups=1, out="diag", half=False):
    """A layer of the suite as two workloads of one name: batch 32 (16 for ``half``) on
    the GPU, 2 on the host; bfloat16 runs as float32 on the host, whose arrays are
    numpy's (no bfloat16)."""
    kw = dict(k=k, stride=s, padding=p, dilation=d, groups=groups, gamma=gamma, out=out,
              suite="layers")
    return [Workload(name, 16 if half else 32, Ci, Co, H, dtype=dtype, device="cuda", **kw),
            Workload(name, 2, Ci, Co, H, dtype="float32" if dtype == "bfloat16" else dtype,
                     device="cpu", **kw)]


#: SPEC section 5's ``layers`` suite: conv layers of ResNet-20, VGG-11 and MobileNetV2 on
#: 32x32 inputs (name, Ci, Co, H, k, stride, padding, gamma, dtype, ...).
LAYERS = [w for ws in (
    _layer("r20-stem", 3, 16, 32, 3, 1, 1, "none", "float32"),
    _layer("r20-16", 16, 16, 32, 3, 1, 1, "diag", "float32"),
    _layer("r20-down", 16, 32, 32, 3, 2, 1, "diag", "float32"),
    _layer("r20-short", 16, 32, 32, 1, 2, 0, "diag", "float32"),
    _layer("r20-64full", 64, 64, 8, 3, 1, 1, "full", "float32", out="full"),
    _layer("vgg-256", 128, 256, 16, 3, 1, 1, "diag", "float16", half=True),
    _layer("mb-dw", 96, 96, 16, 3, 1, 1, "diag", "float16", groups=96),
    _layer("mb-dw-s2", 144, 144, 16, 3, 2, 1, "diag", "bfloat16", groups=144),
    _layer("mb-pw", 32, 192, 16, 1, 1, 0, "diag", "float16", half=True),
    _layer("stem-k5", 3, 32, 32, 5, 1, 2, "none", "float32"),
    _layer("dil2", 64, 64, 16, 3, 1, 2, "diag", "float32", d=2, half=True),
    _layer("grp8", 64, 64, 16, 3, 1, 1, "diag", "bfloat16", groups=8, half=True),
) for w in ws]

#: The suites ``convcov bench --suite`` runs ("all": every one, in this order).
SUITES = {"reference": WORKLOADS, "layers": LAYERS}


def select(suite="reference", device="cpu", names=None) -> list[Workload]:
    """The workloads of ``suite`` ("reference", "layers" or "all") that run on ``device``,
    only those named in ``names`` when given; a ValueError for a name not in the suite."""
    if suite not in (*SUITES, "all"):
        raise ValueError(f"unknown suite {suite!r}; the suites are "
                         f"{', '.join([*SUITES, 'all'])}")
    pool = [w for s, ws in SUITES.items() if suite in (s, "all") for w in ws]
    known = list(dict.fromkeys(w.name for w in pool))
    unknown = [n for n in names or () if n not in known]
    if unknown:
        raise ValueError(f"unknown workload {', '.join(map(repr, unknown))} in suite "
                         f"{suite!r}; its workloads are {', '.join(known)}")
    return [w for w in pool if w.device in (device, "both") and (not names or w.name in names)]


@dataclass
class Row:
    workload: str
    impl: str  # a backend name, "torch" (eager) or "torch.compile"
    median_us: float
    floor_us: float
    fraction: float  # floor / median
    rel_error: float | None  # ||got - ref|| / ||ref|| on batch element 0; None if unchecked
    calls: int
    #: A backend's row: the faster torch baseline's median (eager or compiled, of the same
    #: kind: forward, or forward + backward) over this row's. None for a baseline, or
    #: where there is none.
    speedup: float | None = None


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
    P, Q = (w.H, w.W), (w.Ho, w.Wo)
    out_shape = ((w.B, w.Co, *Q, w.Co, *Q) if w.out == "full" else (w.B, w.Co, *Q, *Q))
    gamma_shape = {"none": None, "full": (w.B, w.Ci, *P, w.Ci, *P),
                   "diag": (w.B, w.Ci, *P, *P)}[w.gamma]
    return dict(out=dev.rand(out_shape, w.dtype, 1.0),
                gamma=None if gamma_shape is None else dev.rand(gamma_shape, w.dtype, 0.01),
                mu=dev.rand((w.B, w.Ci, *P), w.dtype, 0.1), c=dev.rand((w.Co,), w.dtype, 1.0))


def _first_batch(a):
    return None if a is None else a[:1]


#: The largest relative error a checked row may have (by out's dtype): more, and the
#: implementation is wrong, its row a failure rather than a timing.
TOLERANCE = {"float16": 2e-2, "bfloat16": 2e-2, "float32": 1e-4, "float64": 1e-9}


def _check(dev, w, a, run, whole=False) -> float:
    """Relative error on batch element 0 against the float64 numpy reference, of one call
    on batch element 0 (``whole``: on all of the batch, the shape the call is timed at);
    a ValueError past ``TOLERANCE``."""
    first = dict(a, out=_first_batch(a["out"]), gamma=_first_batch(a["gamma"]),
                 mu=_first_batch(a["mu"]))
    x = a if whole else first
    out = dev.clone(x["out"])
    run(out, x["gamma"], x["mu"], x["c"])
    got = dev.to_host64(_first_batch(out))
    ref = convcov.accumulate(*(None if first[k] is None else dev.to_host64(first[k])
                               for k in ("out", "gamma", "mu", "c")),
                             w.k, backend="numpy", **w.conv)
    err = float(np.linalg.norm(got - ref) / np.linalg.norm(ref))
    if not err <= TOLERANCE[w.dtype]:  # (NaN too)
        raise ValueError(f"wrong result: relative error {err:.1e} on batch element 0")
    return err


def _t(dev, x):
    return None if x is None else dev.torch(x)


def _expr_args(w):
    """torch_expr.accumulate's arguments after (out, gamma, mu, c)."""
    return (w.k, w.k, (w.stride,) * 2, (w.padding,) * 2, (w.dilation,) * 2, w.groups)


def _fresh_compile():
    """Forget every graph torch.compile holds: its caches live on the compiled function's
    code object, whichever ``torch.compile`` wrapper made them, and past the recompile
    limit (8 shapes by default) it would run the next shapes eagerly, unnoticed. Called
    before each workload, so each is timed with the one graph compiled for its shape."""
    import sys

    torch = sys.modules.get("torch")
    if torch is not None:
        torch.compiler.reset()


def _impls(dev, backends, with_torch):
    """name -> impl(out, gamma, mu, c, w): the backends of the device (or those named),
    then torch eager and a fresh ``torch.compile`` of the plain expression (one for the
    workload at hand: ``run`` asks anew for each, after :func:`_fresh_compile`)."""
    impls = {}
    for row in convcov.backends():
        if backends and row.name not in backends:
            continue
        b = _registry.get(row.name)
        if row.available and b.device == dev.name:
            impls[row.name] = (lambda name: lambda out, gamma, mu, c, w: convcov.accumulate(
                out, gamma, mu, c, w.k, backend=name, **w.conv))(row.name)
    if with_torch:
        try:
            import torch

            from convcov import torch_expr
        except ImportError:
            return impls
        impls["torch"] = lambda out, gamma, mu, c, w: torch_expr.accumulate(
            _t(dev, out), _t(dev, gamma), _t(dev, mu), _t(dev, c), *_expr_args(w))
        # fullgraph: a graph break is an error, not a silently half-eager timing
        compiled = torch.compile(torch_expr.accumulate, dynamic=False, fullgraph=True)
        impls["torch.compile"] = lambda out, gamma, mu, c, w: compiled(
            _t(dev, out), _t(dev, gamma), _t(dev, mu), _t(dev, c), *_expr_args(w))
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
    """Forward + backward through torch autograd: (out, args, leaves, G, w) -> gradients,
    ``args`` = (gamma or None, mu, c) and ``leaves`` those of them that are tensors."""
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
            impls[f"{row.name} fwd+bwd"] = (lambda name: lambda out, args, leaves, G, w: (
                torch.autograd.grad(convcov.accumulate(out, *args, w.k, backend=name,
                                                       **w.conv), leaves, G)))(row.name)
    if with_torch:
        compiled = torch.compile(torch_expr.accumulate, dynamic=False, fullgraph=True)
        impls["torch.compile fwd+bwd"] = lambda out, args, leaves, G, w: torch.autograd.grad(
            compiled(out, *args, *_expr_args(w)), leaves, G)
    return impls


def _time_grad(dev, w, sets, impls, bandwidth, repeat, budget_s, rounds, progress, task):
    """Rows "<impl> fwd+bwd": out is a fresh alias (detach) of the set's out each call, so
    no call's graph chains onto the last; gamma (when there is one), mu and c require
    grad."""
    floor_s = w.fwd_bwd_floor_bytes() / bandwidth
    G = dev.torch(dev.rand(sets[0]["out"].shape, w.dtype, 1.0))  # the incoming gradient
    views = []
    for x in sets:
        args = [None if x[k] is None else dev.torch(x[k]).detach().requires_grad_()
                for k in ("gamma", "mu", "c")]
        views.append(dict(out=dev.torch(x["out"]), args=args,
                          leaves=[a for a in args if a is not None]))
    turn = [0]

    def grad_call(impl):
        def call():
            turn[0] = (turn[0] + 1) % len(views)
            v = views[turn[0]]
            impl(v["out"].detach(), v["args"], v["leaves"], G, w)

        return call

    calls = {name: (grad_call(impl), None) for name, impl in impls.items()}
    return _grouped_rows(dev, w, calls, floor_s, repeat, budget_s, rounds, progress, task)


def _speedups(rows):
    """Set each backend row's ``speedup``: the faster torch baseline of the same kind
    (forward, or forward + backward) over the row's median."""
    def kind(name):
        return name.endswith(" fwd+bwd")

    best = {}
    for r in rows:
        if _baseline(r.impl) and r.calls and math.isfinite(r.median_us):
            k = kind(r.impl)
            best[k] = min(best.get(k, math.inf), r.median_us)
    for r in rows:
        if not _baseline(r.impl) and r.calls and kind(r.impl) in best:
            r.speedup = best[kind(r.impl)] / r.median_us
    return rows


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

    # torch.compile is checked on the whole batch: a check on batch element 0 alone
    # would compile (and check) a second graph, not the one timed.
    calls = {name: (timed(impl), lambda impl=impl, whole=name == "torch.compile": _check(
        dev, w, a, lambda out, g, m, c: impl(out, g, m, c, w), whole))
        for name, impl in impls.items()}
    rows = _grouped_rows(dev, w, calls, floor_s, repeat, budget_s, rounds, progress, task)
    if gimpls:
        rows += _time_grad(dev, w, sets, gimpls, bandwidth, repeat, budget_s, rounds,
                           progress, task)
    return _speedups(rows)


def run(device="cpu", workloads=None, backends=None, with_torch=True, repeat=200,
        budget_s=3.0, progress=None, grad=False, rounds=None, suite="reference") -> dict:
    """Measure; returns a JSON-ready dict (machine, date, bandwidth, workloads, rows, and
    the summary per suite: :func:`summary`). ``suite``: "reference" (SPEC section 5's
    reference workloads), "layers" or "all"; ``workloads``: names within it. ``repeat``
    and ``budget_s`` bound one row's timed calls and seconds, spread over ``rounds``
    interleaved rounds (``rounds=1``: one row after another; default: the device's)."""
    chosen = select(suite, device, workloads)
    dev = _Cuda() if device == "cuda" else _Host()
    rounds = max(1, min(dev.rounds if rounds is None else rounds, repeat))
    bandwidth = dev.copy_bandwidth()
    n_impls = len(_impls(dev, backends, with_torch))
    n_gimpls = len(_grad_impls(dev, backends, with_torch)) if grad else 0
    rows = []
    task = (progress.add_task("bench", total=len(chosen) * (n_impls + n_gimpls))
            if progress else None)
    for w in chosen:  # (each workload's arrays are freed when its function returns)
        if with_torch:
            _fresh_compile()
        impls = _impls(dev, backends, with_torch)
        gimpls = _grad_impls(dev, backends, with_torch) if grad else {}
        rows += _workload_rows(dev, w, impls, gimpls, bandwidth, repeat, budget_s, rounds,
                               progress, task)
    result = dict(
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        device=device, machine=dev.describe(), host=host_cpu(), convcov=convcov.__version__,
        versions=_versions(), copy_bandwidth_GBps=bandwidth / 1e9, rounds=rounds,
        suite=suite, workloads=[asdict(w) for w in chosen], rows=[asdict(r) for r in rows],
        not_measured=_not_measured(dev, backends),
    )
    result["summary"] = summary(result)
    return result


def _geomean(xs):
    return math.exp(statistics.fmean(math.log(x) for x in xs)) if xs else None


def _base_impl(name):
    return name.split(" (failed")[0]


def suite_of(result: dict) -> dict:
    """workload name -> its suite, from a run's workloads (runs recorded before there were
    suites hold the reference workloads only)."""
    return {w["name"]: w.get("suite", "reference") for w in result.get("workloads", [])}


def summary(result: dict) -> dict:
    """Per suite of the run, per implementation, over the suite's workloads in the run:
    the geometric mean and the worst (least) fraction of the floor and, for a backend,
    of its speed-up over the faster torch baseline, each worst with its workload; the
    workloads on which it failed (left out of the means)."""
    suites = suite_of(result)
    out = {}
    for s in dict.fromkeys(suites.values()):
        names = [n for n, t in suites.items() if t == s]
        impls = {}
        for r in result["rows"]:
            if r["workload"] not in names:
                continue
            e = impls.setdefault(_base_impl(r["impl"]), dict(fraction={}, speedup={},
                                                             failed=[]))
            if r["calls"] and math.isfinite(r["fraction"]):
                e["fraction"][r["workload"]] = r["fraction"]
                if r.get("speedup") is not None:
                    e["speedup"][r["workload"]] = r["speedup"]
            else:
                e["failed"].append(r["workload"])
        stats = {}
        for impl, e in impls.items():
            st = dict(measured=len(e["fraction"]), failed=e["failed"])
            for key in ("fraction", "speedup"):
                vals = e[key]
                if vals:
                    worst = min(vals, key=vals.get)
                    st[key] = dict(geomean=_geomean(list(vals.values())), worst=vals[worst],
                                   worst_workload=worst, per_workload=vals)
            stats[impl] = st
        out[s] = dict(workloads=names, impls=stats)
    return out


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


def _fmt(x, spec):
    return "-" if x is None or not math.isfinite(x) else format(x, spec)


def table(result: dict):
    """A rich Table of one run: a row per workload and implementation, with a backend's
    speed-up over the faster torch baseline ("× torch")."""
    from rich.table import Table

    host = result.get("host")  # (absent from runs recorded before 2026-12-01 12:30 UTC)
    on = result["machine"]
    if host not in (None, on):
        on = f"{on} (host: {host})"
    t = Table(title=f"convcov bench on {on} ({result['date']}); "
                    f"copy bandwidth {result['copy_bandwidth_GBps']:.1f} GB/s")
    for col in ("workload", "impl", "median µs", "floor µs", "fraction of floor",
                "× torch", "rel. error", "calls"):
        t.add_column(col, justify="left" if col in ("workload", "impl") else "right")
    for r in result["rows"]:
        err = "-" if r["rel_error"] is None else f"{r['rel_error']:.1e}"
        t.add_row(r["workload"], r["impl"], f"{r['median_us']:.1f}", f"{r['floor_us']:.1f}",
                  _fmt(r["fraction"], ".3g"), _fmt(r.get("speedup"), ".3g"), err,
                  str(r["calls"]))
    return t


def summary_tables(result: dict) -> list:
    """A rich Table per suite of the run with more than one workload: per implementation,
    the geometric mean and the worst fraction of the floor over the suite's workloads,
    and a backend's speed-up over the faster torch baseline, likewise."""
    from rich.table import Table

    tables = []
    for suite, s in (result.get("summary") or summary(result)).items():
        if len(s["workloads"]) < 2:
            continue
        t = Table(title=f"suite {suite}: {len(s['workloads'])} workloads")
        for col in ("impl", "fraction geomean", "fraction worst", "× torch geomean",
                    "× torch worst", "failed"):
            t.add_column(col, justify="left" if col in ("impl", "failed") else "right")
        for impl, st in s["impls"].items():
            cells = [impl]
            for key in ("fraction", "speedup"):
                v = st.get(key)
                cells += (["-", "-"] if v is None else
                          [f"{v['geomean']:.3g}", f"{v['worst']:.3g} ({v['worst_workload']})"])
            cells.append(", ".join(st["failed"]) or "-")
            t.add_row(*cells)
        tables.append(t)
    return tables


def save_json(result: dict, path: str):
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
