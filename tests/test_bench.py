"""The bench: its timing schedule (convcov.bench._rows: the rows' calls interleaved in
rounds, the order reversed every other round, ``repeat`` calls in all, failures as rows;
a stand-in device records the schedule, no time is measured or asserted), its workloads
(the layers suite as SPEC section 5 lists it), its memory floor (against a count of the
sectors SPEC section 1's loops read), the plain torch baseline (against the numpy
reference, eager and compiled) and that torch.compile is compiled afresh per shape."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from convcov import bench

TOY = next(w for w in bench.WORKLOADS if w.name == "toy")


class Recorder:
    """A device whose time_calls runs each call ``repeat`` times and records who asked."""

    def __init__(self):
        self.log = []

    def time_calls(self, fn, repeat, budget_s, least=5):
        self.log.append((fn.__name__, repeat, budget_s, least))
        for _ in range(repeat):
            fn()
        return [1e-3] * repeat


def named(name, counter):
    def call():
        counter[name] = counter.get(name, 0) + 1

    call.__name__ = name
    return call


def test_rounds_interleave_and_share_out_repeat():
    dev, count = Recorder(), {}
    calls = {"a": (named("a", count), lambda: 0.5), "b": (named("b", count), None)}
    rows = bench._rows(dev, TOY, calls, 1e-4, repeat=7, budget_s=3.0, rounds=3)
    assert [e[0] for e in dev.log] == ["a", "b", "b", "a", "a", "b"]
    assert [e[1] for e in dev.log] == [3, 3, 2, 2, 2, 2]  # 7 = 3 + 2 + 2 for each
    assert all(e[2] == 1.0 and e[3] == 2 for e in dev.log)  # budget and least per round
    assert count == {"a": 3 + 7, "b": 3 + 7}  # three warm-up calls, then the timed ones
    assert [(r.impl, r.calls, r.rel_error) for r in rows] == [("a", 7, 0.5), ("b", 7, None)]
    assert rows[0].median_us == 1e3 and rows[0].fraction == 0.1


def test_one_round_is_one_row_after_another():
    dev = Recorder()
    calls = {n: (named(n, {}), None) for n in "abc"}
    bench._rows(dev, TOY, calls, 1e-4, repeat=4, budget_s=1.0, rounds=1)
    assert dev.log == [("a", 4, 1.0, 5), ("b", 4, 1.0, 5), ("c", 4, 1.0, 5)]


def test_more_rounds_than_calls():
    dev = Recorder()
    rows = bench._rows(dev, TOY, {"a": (named("a", {}), None)}, 1e-4, repeat=2,
                       budget_s=1.0, rounds=5)
    assert [e[1] for e in dev.log] == [1, 1] and rows[0].calls == 2


def test_a_row_that_fails_is_never_timed_again():
    dev = Recorder()

    def fails_in_round_two():
        if sum(e[0] == "t" for e in dev.log) == 2:
            raise RuntimeError("broke")

    fails_in_round_two.__name__ = "t"
    rows = bench._rows(dev, TOY, {"t": (fails_in_round_two, None), "ok": (named("ok", {}), None)},
                       1e-4, repeat=6, budget_s=1.0, rounds=3)
    assert [e[0] for e in dev.log] == ["t", "ok", "ok", "t", "ok"]  # no "t" in round 3
    assert "broke" in rows[0].impl and rows[1].calls == 6


def test_a_failed_row_does_not_keep_the_arrays_alive():
    """The workload's arrays must go when the caller drops them, without waiting for the
    garbage collector: a kept exception's traceback would hold the frames that hold them."""
    import gc
    import weakref

    import numpy as np

    arr = np.ones(10)
    gone = weakref.ref(arr)

    def call(x=arr):
        raise RuntimeError(x.shape)

    gc.disable()
    try:
        rows = bench._rows(Recorder(), TOY, {"x": (call, None)}, 1e-4, repeat=2, budget_s=1.0,
                           rounds=1)
        del arr, call
        assert gone() is None and "RuntimeError: (10,)" in rows[0].impl
    finally:
        gc.enable()


def test_progress_advances_once_a_row():
    class Progress:
        advanced = 0

        def update(self, task, description=""):
            pass

        def advance(self, task):
            self.advanced += 1

    p = Progress()
    calls = {n: (named(n, {}), None) for n in "abc"}
    bench._rows(Recorder(), TOY, calls, 1e-4, repeat=2, budget_s=1.0, rounds=2, progress=p,
                task=0)
    assert p.advanced == 3


def test_failures_are_rows_and_the_others_still_run():
    def broken_check():
        raise RuntimeError("check broke")

    def breaks_when_timed():
        if len(dev.log) > 1:
            raise RuntimeError("timing broke")

    breaks_when_timed.__name__ = "t"
    dev = Recorder()
    calls = {"c": (named("c", {}), broken_check), "t": (breaks_when_timed, None),
             "ok": (named("ok", {}), None)}
    rows = bench._rows(dev, TOY, calls, 1e-4, repeat=4, budget_s=1.0, rounds=2)
    by = {r.impl.split(" ")[0]: r for r in rows}
    assert [r.impl.split(" ")[0] for r in rows] == ["c", "t", "ok"]  # the given order
    assert "RuntimeError: check broke" in by["c"].impl and math.isnan(by["c"].median_us)
    assert "RuntimeError: timing broke" in by["t"].impl and by["t"].calls == 0
    assert by["ok"].calls == 4 and by["ok"].impl == "ok"
    assert "c" not in [e[0] for e in dev.log]  # a failed check is never timed


def test_backends_and_torch_baselines_are_interleaved_apart(monkeypatch):
    """The torch baselines' calls never sit between two backends' blocks (their heavy
    calls leave a GPU power-capped for what follows): two groups, in the table's order."""
    groups, real = [], bench._rows

    def spy(dev, w, calls, *args, **kwargs):
        groups.append(list(calls))
        return real(dev, w, calls, *args, **kwargs)

    def nothing(out, gamma, mu, c, w):
        pass

    monkeypatch.setattr(bench, "_rows", spy)
    monkeypatch.setattr(bench, "_impls", lambda dev, backends, with_torch: dict.fromkeys(
        ("numpy", "torch", "numba", "torch.compile"), nothing))
    monkeypatch.setattr(bench, "_check", lambda *args, **kwargs: 0.0)  # nothing is right
    monkeypatch.setattr(bench._Host, "copy_bandwidth", lambda self: 1e10)  # not measured
    result = bench.run("cpu", ["toy"], repeat=2, budget_s=0.01, rounds=2)
    assert groups == [["numpy", "numba"], ["torch", "torch.compile"]]
    assert [r["impl"] for r in result["rows"]] == ["numpy", "numba", "torch", "torch.compile"]
    assert result["rounds"] == 2 and all(r["calls"] == 2 for r in result["rows"])
    # The host's default is one row after another (bench._Host.rounds); the GPU's is 5.
    assert bench.run("cpu", ["toy"], repeat=2, budget_s=0.01)["rounds"] == 1
    assert bench._Cuda.rounds == 5


def test_gradient_rows_are_grouped_too(monkeypatch):
    pytest.importorskip("torch")
    groups, real = [], bench._rows

    def spy(dev, w, calls, *args, **kwargs):
        groups.append(list(calls))
        return real(dev, w, calls, *args, **kwargs)

    def nothing(*args):
        pass

    monkeypatch.setattr(bench, "_rows", spy)
    monkeypatch.setattr(bench, "_impls", lambda dev, backends, with_torch: {"numpy": nothing})
    monkeypatch.setattr(bench, "_grad_impls", lambda dev, backends, with_torch: dict.fromkeys(
        ("numpy fwd+bwd", "torch.compile fwd+bwd", "numba fwd+bwd"), nothing))
    monkeypatch.setattr(bench._Host, "copy_bandwidth", lambda self: 1e10)  # not measured
    bench.run("cpu", ["toy"], repeat=2, budget_s=0.01, rounds=2, grad=True)
    assert groups == [["numpy"], [], ["numpy fwd+bwd", "numba fwd+bwd"],
                      ["torch.compile fwd+bwd"]]


def test_the_recorded_rounds_are_the_rounds_used(monkeypatch):
    monkeypatch.setattr(bench._Host, "copy_bandwidth", lambda self: 1e10)  # not measured
    assert bench.run("cpu", ["toy"], ["numpy"], False, repeat=2, budget_s=0.01,
                     rounds=5)["rounds"] == 2


def test_the_host_cpu_is_named(monkeypatch, tmp_path):
    """The host's processor model comes from /proc/cpuinfo where there is one (this
    project's machines changed model between two days: docs/performance.md, "Host"), and
    from platform where not; the table names it beside a GPU."""
    import builtins

    fake = tmp_path / "cpuinfo"
    fake.write_text("processor\t: 0\nvendor_id\t: GenuineIntel\n"
                    "model name\t: Intel(R) Xeon(R) Processor\nflags\t: fpu\n")
    real_open = builtins.open
    monkeypatch.setattr(builtins, "open", lambda f, *a, **k: real_open(
        fake if f == "/proc/cpuinfo" else f, *a, **k))
    monkeypatch.setattr(bench.os, "cpu_count", lambda: 2)
    assert bench.host_cpu() == "Intel(R) Xeon(R) Processor, 2 cores"
    assert bench._Host().describe() == bench.host_cpu()

    def missing(f, *a, **k):
        if f == "/proc/cpuinfo":
            raise FileNotFoundError(f)
        return real_open(f, *a, **k)

    monkeypatch.setattr(builtins, "open", missing)
    monkeypatch.setattr(bench.platform, "processor", lambda: "arm")
    assert bench.host_cpu() == "arm, 2 cores"

    from rich.console import Console
    result = dict(machine="NVIDIA H200, 132 SMs, 139 GiB", host="Xeon, 2 cores",
                  date="2026-12-01", copy_bandwidth_GBps=4000.0, rows=[])
    console = Console(record=True, width=200)
    console.print(bench.table(result))
    assert "NVIDIA H200, 132 SMs, 139 GiB (host: Xeon, 2 cores)" in console.export_text()


# ---------------------------------------------------------------------------------------
# The layers suite

#: SPEC section 5, as written there: name: Ci, Co, H, k, stride, padding, dilation,
#: groups, gamma, out, dtype on the GPU, batch on the GPU; and Ho as torch's conv2d gives.
SPEC_LAYERS = {
    "r20-stem": (3, 16, 32, 3, 1, 1, 1, 1, "none", "diag", "float32", 32, 32),
    "r20-16": (16, 16, 32, 3, 1, 1, 1, 1, "diag", "diag", "float32", 32, 32),
    "r20-down": (16, 32, 32, 3, 2, 1, 1, 1, "diag", "diag", "float32", 32, 16),
    "r20-short": (16, 32, 32, 1, 2, 0, 1, 1, "diag", "diag", "float32", 32, 16),
    "r20-64full": (64, 64, 8, 3, 1, 1, 1, 1, "full", "full", "float32", 32, 8),
    "vgg-256": (128, 256, 16, 3, 1, 1, 1, 1, "diag", "diag", "float16", 16, 16),
    "mb-dw": (96, 96, 16, 3, 1, 1, 1, 96, "diag", "diag", "float16", 32, 16),
    "mb-dw-s2": (144, 144, 16, 3, 2, 1, 1, 144, "diag", "diag", "bfloat16", 32, 8),
    "mb-pw": (32, 192, 16, 1, 1, 0, 1, 1, "diag", "diag", "float16", 16, 16),
    "stem-k5": (3, 32, 32, 5, 1, 2, 1, 1, "none", "diag", "float32", 32, 32),
    "dil2": (64, 64, 16, 3, 1, 2, 2, 1, "diag", "diag", "float32", 16, 16),
    "grp8": (64, 64, 16, 3, 1, 1, 1, 8, "diag", "diag", "bfloat16", 16, 16),
}


def test_the_layers_suite_is_spec_s():
    torch = pytest.importorskip("torch")
    for device in ("cuda", "cpu"):
        got = bench.select("layers", device)
        assert [w.name for w in got] == list(SPEC_LAYERS)
        for w in got:
            Ci, Co, H, k, s, p, d, G, gamma, out, dtype, B, Ho = SPEC_LAYERS[w.name]
            host = dict(B=2, dtype="float32" if dtype == "bfloat16" else dtype)
            want = dict(B=B, dtype=dtype) if device == "cuda" else host
            assert (w.Ci, w.Co, w.H, w.k, w.stride, w.padding, w.dilation, w.groups, w.gamma,
                    w.out, w.dtype, w.B, w.suite) == (Ci, Co, H, k, s, p, d, G, gamma, out,
                                                      want["dtype"], want["B"], "layers")
            y = torch.nn.functional.conv2d(torch.empty(1, Ci, H, H, device="meta"),
                                           torch.empty(Co, Ci // G, k, k, device="meta"),
                                           stride=s, padding=p, dilation=d, groups=G)
            assert (w.Ho, w.Wo) == tuple(y.shape[2:]) == (Ho, Ho)
    # the reference suite stays as it was; "all" is both; a name must be in the suite
    assert [w.name for w in bench.select("reference", "cpu")] == ["toy", "cpu"]
    assert [w.name for w in bench.select("all", "cpu", ["toy", "grp8"])] == ["toy", "grp8"]
    with pytest.raises(ValueError, match="unknown workload 'grp8' in suite 'reference'"):
        bench.select("reference", "cpu", ["grp8"])


def test_recorded_runs_still_read():
    """A run recorded with one ``layout`` for gamma and out reads back as a Workload."""
    w = bench.Workload(**dict(name="toy", B=2, Ci=3, Co=3, H=9, k=3, layout="full",
                              dtype="float32", device="both"))
    assert w == next(x for x in bench.WORKLOADS if x.name == "toy")


# ---------------------------------------------------------------------------------------
# The floor

def _read_sectors(w):
    """gamma's and mu's bytes in whole sectors, by SPEC section 1's loops: every term
    (b, ci, i0, j0, i1, j1, ii, ji) enumerated, the flat indices of the entries it reads
    in the contiguous layouts collected, their 32-byte sectors counted."""
    import numpy as np

    s, p, d = w.stride, w.padding, w.dilation
    i0, j0, i1, j1, ii, ji = np.meshgrid(*(np.arange(n) for n in (
        w.Ho, w.Wo, w.Ho, w.Wo, w.k, w.k)), indexing="ij")
    x0, y0 = i0 * s + ii * d - p, j0 * s + ji * d - p
    x1, y1 = i1 * s + ii * d - p, j1 * s + ji * d - p
    ok = ((x0 >= 0) & (x0 < w.H) & (y0 >= 0) & (y0 < w.W) & (x1 >= 0) & (x1 < w.H)
          & (y1 >= 0) & (y1 < w.W))
    x0, y0, x1, y1 = x0[ok], y0[ok], x1[ok], y1[ok]
    HW = w.H * w.W
    mu, gamma = set(), set()
    for b in range(w.B):
        for ci in range(w.Ci):
            mu.update(((b * w.Ci + ci) * HW + x0 * w.W + y0).tolist())
            if w.gamma == "diag":
                gamma.update((((b * w.Ci + ci) * HW + x0 * w.W + y0) * HW
                              + x1 * w.W + y1).tolist())
            elif w.gamma == "full":
                gamma.update((((((b * w.Ci + ci) * HW + x0 * w.W + y0) * w.Ci + ci) * HW)
                              + x1 * w.W + y1).tolist())

    def nbytes(entries):
        return 32 * len({e * w.itemsize // 32 for e in entries})

    return nbytes(gamma), nbytes(mu)


FLOOR_CASES = [  # B, Ci, H, k, stride, padding, dilation, gamma, dtype
    (2, 3, 9, 3, 1, 0, 1, "full", "float32"),  # toy: 324-byte rows, across sectors
    (1, 2, 9, 3, 1, 0, 1, "diag", "float16"),  # blocks that do not start on a sector
    (1, 2, 8, 3, 2, 1, 1, "diag", "float32"),  # k3 stride 2: pairs of one parity only
    (2, 2, 7, 3, 2, 1, 2, "full", "float16"),
    (1, 1, 10, 2, 3, 2, 1, "diag", "float64"),
    (1, 3, 6, 1, 2, 0, 1, "none", "bfloat16"),
]


@pytest.mark.parametrize("case", FLOOR_CASES)
def test_the_floor_is_the_sectors_the_operation_reads(case):
    B, Ci, H, k, s, p, d, gamma, dtype = case
    w = bench.Workload("t", B, Ci, 5, H, k, gamma, "full", dtype, stride=s, padding=p,
                       dilation=d)
    assert (w.gamma_bytes(), w.mu_bytes()) == _read_sectors(w)
    assert w.floor_bytes() == (w.gamma_bytes() + w.mu_bytes()
                               + w.itemsize * (2 * B * 5 * (w.Ho * w.Wo) ** 2 + 5))


def test_the_floor_of_a_1x1_stride_2_layer():
    """1x1, stride 2, W = 16, float32: the even (x, y) positions are read, a quarter of
    mu's entries; but a 32-byte sector is 8 neighbours along y, so every sector of an even
    row holds 4 read entries and mu's read sectors are half of its sectors (256 entries,
    32 sectors, 16 read). gamma's: rows (x0, y0, x1) even in all three (an eighth), each
    all read: 65536 entries / 8 per sector / 8 = 1024 sectors. out: Ho = 8."""
    w = bench.Workload("t", 1, 1, 1, 16, 1, "diag", "diag", "float32", stride=2)
    assert w.Ho == 8
    assert w.mu_bytes() == 16 * 32 and w.gamma_bytes() == 1024 * 32
    assert w.floor_bytes() == 16 * 32 + 1024 * 32 + 2 * 4 * 8**4 + 4
    # 3x3, stride 2, padding 1: every position read, but gamma only in same-parity pairs
    # of x (x1 - x0 = 2 (i1 - i0)): half of its rows; along y, 4 of a sector's 8
    w3 = bench.Workload("t", 1, 1, 1, 16, 3, "diag", "diag", "float32", stride=2, padding=1)
    assert w3.mu_bytes() == 32 * 32 and w3.gamma_bytes() == 8192 * 32 // 2


def test_the_floor_of_the_reference_workloads():
    """mu (in whole sectors: toy's 1944 bytes are 61 sectors), out and c as before;
    gamma's channel-diagonal all but the rows of the pairs no window reads together: with
    stride 1 and no padding the pairs read are |x1 - x0| <= Ho - 1 = H - 3, so of H*H x
    pairs six are never read ((0, H-2), (0, H-1), (1, H-1) and their mirrors), rows of
    whole sectors each (H*itemsize a multiple of 32)."""
    for w in bench.WORKLOADS:
        size = w.itemsize
        assert w.mu_bytes() == -(-size * w.B * w.Ci * w.H**2 // 32) * 32
        assert w.out_bytes() == size * 2 * w.B * w.Co * w.Ho**4
        assert w.floor_bytes() - w.gamma_bytes() - w.mu_bytes() - w.out_bytes() == size * w.Co
        if w.name != "toy":  # (toy's rows straddle sectors: the test above counts it)
            assert w.gamma_bytes() == size * w.B * w.Ci * w.H**4 * (w.H**2 - 6) // w.H**2
    # a stride-1 layer with "same" padding reads every pair: all of gamma's diagonal
    r20 = next(w for w in bench.LAYERS if w.name == "r20-16" and w.device == "cpu")
    assert r20.gamma_bytes() == 4 * r20.B * r20.Ci * r20.H**4


def test_sectors_of_blocks_that_straddle_sectors():
    """The periodic count (many blocks, not a whole number of sectors each) equals the
    count of every entry's sector."""
    import numpy as np

    rng = np.random.default_rng(0)
    for N, itemsize, density in ((6561, 4, 0.02), (6561, 2, 0.02), (1000, 8, 0.05),
                                 (37, 2, 0.3)):
        R = np.flatnonzero(rng.random(N) < density)
        blocks = 2**20 // R.size + 1  # past the direct count's limit
        every = (np.arange(blocks)[:, None] * N + R).ravel() * itemsize // 32
        assert bench.sectors(R, N, blocks, itemsize) == np.unique(every).size


# ---------------------------------------------------------------------------------------
# The plain torch baseline

def _np(t):
    return t.detach().double().numpy().copy()  # a copy: float64's would share memory


@st.composite
def layers(draw):
    G, Cg, Cog = draw(st.integers(1, 3)), draw(st.integers(1, 2)), draw(st.integers(1, 2))
    kh, kw = draw(st.integers(1, 3)), draw(st.integers(1, 3))
    s, p, d = (draw(st.tuples(st.integers(lo, hi), st.integers(lo, hi)))
               for lo, hi in ((1, 3), (0, 2), (1, 2)))
    H = draw(st.integers(max(1, d[0] * (kh - 1) + 1 - 2 * p[0]), 7))
    W = draw(st.integers(max(1, d[1] * (kw - 1) + 1 - 2 * p[1]), 7))
    dtypes = st.sampled_from(["float16", "bfloat16", "float32", "float64"])
    return dict(B=draw(st.integers(1, 2)), G=G, Ci=G * Cg, Co=G * Cog, H=H, W=W, k=(kh, kw),
                s=s, p=p, d=d, gamma=draw(st.sampled_from(["none", "diag", "full"])),
                out=draw(st.sampled_from(["diag", "full"])),
                c=draw(st.sampled_from(["number", "0-d", "vector"])),
                dtypes=[draw(dtypes) for _ in range(4)], seed=draw(st.integers(0, 2**16)))


def _case(L):
    """Random arrays of layer ``L`` (torch tensors in ``L``'s dtypes) and the float64
    reference result of accumulate, by the numpy backend."""
    import numpy as np
    import torch

    import convcov

    gen = torch.Generator().manual_seed(L["seed"])
    B, Ci, Co, H, W, (kh, kw) = L["B"], L["Ci"], L["Co"], L["H"], L["W"], L["k"]
    Ho = (H + 2 * L["p"][0] - L["d"][0] * (kh - 1) - 1) // L["s"][0] + 1
    Wo = (W + 2 * L["p"][1] - L["d"][1] * (kw - 1) - 1) // L["s"][1] + 1
    dt = [getattr(torch, n) for n in L["dtypes"]]
    out = torch.rand((B, Co, Ho, Wo) + ((Co,) if L["out"] == "full" else ()) + (Ho, Wo),
                     generator=gen).to(dt[0])
    gamma = None if L["gamma"] == "none" else torch.rand(
        (B, Ci, H, W) + ((Ci,) if L["gamma"] == "full" else ()) + (H, W),
        generator=gen).to(dt[1])
    mu = torch.rand(B, Ci, H, W, generator=gen).to(dt[2])
    c = {"number": 0.7, "0-d": torch.tensor(0.7, dtype=dt[3]),
         "vector": torch.rand(Co, generator=gen).to(dt[3])}[L["c"]]
    conv = dict(stride=L["s"], padding=L["p"], dilation=L["d"], groups=L["G"])
    ref = convcov.accumulate(_np(out), None if gamma is None else _np(gamma), _np(mu),
                             c if L["c"] == "number" else np.asarray(_np(c)), L["k"],
                             backend="numpy", **conv)
    return out, gamma, mu, c, ref


def _assert_matches(got, out0, ref, L):
    import numpy as np
    import torch

    # one rounding into out's dtype, sums in float32 at least
    tol = {torch.float16: 2e-3, torch.bfloat16: 1.6e-2, torch.float32: 1e-5,
           torch.float64: 1e-6}[got.dtype]
    if "float64" not in L["dtypes"] and got.dtype == torch.float64:
        tol = 1e-5  # float32 sums, a float64 out
    g = _np(got)
    assert np.abs(g - ref).max() <= tol * np.abs(ref).max(), (L, np.abs(g - ref).max())
    if L["out"] == "full":  # only the channel-diagonal changes, bit for bit
        Co = got.shape[1]
        off = ~torch.eye(Co, dtype=torch.bool)[None, :, None, None, :, None, None]
        off = off.expand(got.shape)
        assert torch.equal(got[off], out0[off])


@settings(max_examples=40)
@given(layers())
def test_the_torch_baseline_is_the_operation(L):
    """Eager, and the form torch.compile traces (torch_expr's fused windows), run eagerly
    here (compiling each example would take minutes); against the numpy reference."""
    from unittest import mock

    import torch

    from convcov import torch_expr

    out0, gamma, mu, c, ref = _case(L)
    args = (*L["k"], L["s"], L["p"], L["d"], L["G"])
    out = out0.clone()
    assert torch_expr.accumulate(out, gamma, mu, c, *args) is out
    _assert_matches(out, out0, ref, L)
    with mock.patch.object(torch.compiler, "is_compiling", lambda: True):
        fused = torch_expr.accumulate(out0.clone(), gamma, mu, c, *args)
    _assert_matches(fused, out0, ref, L)
    S = torch_expr.patch_moment(gamma, mu, *args)
    f64 = torch.float64 in (mu.dtype, None if gamma is None else gamma.dtype)
    assert S.dtype == (torch.float64 if f64 else torch.float32)
    assert S.shape == (L["B"], L["G"], *ref.shape[2:4], *ref.shape[2:4])


def test_the_compiled_torch_baseline_is_the_operation():
    """One small shape through torch.compile itself (stride, padding, groups, a full
    out and gamma, mixed dtypes)."""
    import torch

    from convcov import torch_expr

    L = dict(B=2, G=2, Ci=4, Co=6, H=7, W=6, k=(3, 2), s=(2, 1), p=(1, 0), d=(1, 2),
             gamma="full", out="full", c="vector",
             dtypes=["float32", "float16", "float32", "float32"], seed=3)
    out0, gamma, mu, c, ref = _case(L)
    compiled = torch.compile(torch_expr.accumulate, dynamic=False, fullgraph=True)
    out = out0.clone()
    compiled(out, gamma, mu, c, *L["k"], L["s"], L["p"], L["d"], L["G"])
    _assert_matches(out, out0, ref, L)


def test_torch_compile_is_fresh_for_each_workload(monkeypatch):
    """Each workload gets its own compiled function, after torch.compiler.reset: no
    compiled function sees two shapes, so none passes torch.compile's recompile limit
    and none is timed eagerly by accident."""
    import torch

    seen, resets = [], []

    def fake_compile(fn, **kwargs):
        assert kwargs == dict(dynamic=False, fullgraph=True)
        shapes = set()
        seen.append(shapes)

        def compiled(out, *args):
            shapes.add(tuple(out.shape))
            return fn(out, *args)

        return compiled

    monkeypatch.setattr(torch, "compile", fake_compile)
    monkeypatch.setattr(bench._Host, "copy_bandwidth", lambda self: 1e10)  # not measured
    monkeypatch.setattr(torch.compiler, "reset", lambda: resets.append(1))
    monkeypatch.setitem(bench.SUITES, "layers", [  # two small layers of two shapes
        bench.Workload("a", 2, 4, 4, 8, 3, "diag", "diag", padding=1, groups=2,
                       suite="layers"),
        bench.Workload("b", 2, 4, 6, 7, 1, "full", "full", stride=2, suite="layers")])
    result = bench.run("cpu", None, ["numpy"], repeat=2, budget_s=0.01, suite="layers")
    used = [s for s in seen if s]
    assert len(used) == 2 and all(len(s) == 1 for s in used) and used[0] != used[1]
    assert len(resets) == 2
    rows = {(r["workload"], r["impl"]): r for r in result["rows"]}
    assert set(rows) == {(w, i) for w in "ab" for i in ("numpy", "torch", "torch.compile")}
    for w in "ab":  # checked, then timed; the speed-up is the
        best = min(rows[w, "torch"]["median_us"], rows[w, "torch.compile"]["median_us"])
        assert rows[w, "torch.compile"]["rel_error"] < 1e-5  # faster baseline's
        assert rows[w, "numpy"]["speedup"] == pytest.approx(best / rows[w, "numpy"]["median_us"])


def test_summary_geomean_and_worst():
    rows = [dict(workload=w, impl=i, median_us=t, floor_us=1.0, fraction=1.0 / t,
                 rel_error=None, calls=3, speedup=sp)
            for w, i, t, sp in [("a", "cupy", 2.0, 4.0), ("b", "cupy", 8.0, 1.0),
                                ("a", "torch", 8.0, None), ("b", "torch", 8.0, None)]]
    rows.append(dict(workload="c", impl="cupy (failed: ValueError: x)", median_us=math.nan,
                     floor_us=1.0, fraction=math.nan, rel_error=None, calls=0, speedup=None))
    result = dict(workloads=[dict(name=n, suite="layers") for n in "abc"], rows=rows)
    s = bench.summary(result)["layers"]
    cupy = s["impls"]["cupy"]
    assert cupy["fraction"]["geomean"] == pytest.approx(0.25)  # sqrt(1/2 * 1/8)
    assert (cupy["fraction"]["worst"], cupy["fraction"]["worst_workload"]) == (0.125, "b")
    assert cupy["speedup"]["geomean"] == pytest.approx(2.0)
    assert (cupy["speedup"]["worst"], cupy["speedup"]["worst_workload"]) == (1.0, "b")
    assert cupy["failed"] == ["c"] and cupy["measured"] == 2
    assert "speedup" not in s["impls"]["torch"]
