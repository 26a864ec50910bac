"""The ``cupy`` backend on a GPU: what the shared property test does not reach.

Both sources of S (straight from gamma and mu in one launch, and through the channel sum
T in two) forced on the same problems; fast (vectorised) and generic (strided) layouts;
float16/bfloat16; torch and CuPy arrays and numba device arrays; launches on a
non-default torch or CuPy stream; an ``out`` and a ``gamma`` of more than 2**31
elements; several threads at once; arrays on the second GPU. Without CuPy or a CUDA
device every GPU test skips and says why; the probe's reason is checked here too.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import numpy as np
import pytest

import convcov
from convcov import _frontend, _registry

from kinds import (at_once, check_absent_terms_in_the_backward, host_build, make, to_f64,
                   tolerance, torch_cuda)

BACKEND = _registry.get("cupy")
REASON = BACKEND.unavailable_reason()
gpu = pytest.mark.skipif(REASON is not None, reason=f"cupy: {REASON}")
need_torch = pytest.mark.skipif(not torch_cuda(), reason="torch with CUDA is not installed")


def test_probe_reason_is_clear():
    """Unavailable is reported with the cause, never as a crash (CI has no GPU)."""
    rows = {r.name: r for r in convcov.backends()}
    assert rows["cupy"].device == "cuda"
    if REASON is None:
        assert rows["cupy"].available
    else:
        assert REASON.startswith(("not installed", "no CUDA device")), REASON
        assert not rows["cupy"].available and rows["cupy"].reason == REASON


def test_module_import_does_not_import_cupy():
    code = ("import sys, convcov, convcov.backends.cupy as m; "
            "assert 'cupy' not in sys.modules, 'imported cupy'; "
            "assert m.backend.name == 'cupy'")
    subprocess.run([sys.executable, "-c", code], check=True)


# ------------------------------------------------------------------ helpers
#: The plans _force can force (every test of the host build takes each).
PATHS = ["plane", "fused", "stream", "tiles", "segments", "split"]


@pytest.fixture(params=PATHS)
def path(request, monkeypatch):
    """Force one plan (_force): a warp a diagonal where the planes fit a warp ("plane");
    else the block's walk, c * S added into out by cc_walk ("fused") or S
    through memory and cc_stream ("stream"); planes in small tiles, one plane of S a step
    ("tiles"); diagonals in segments of one plane ("segments"); every element's channel
    sum shared by as many lanes as the group's channels allow ("split")."""
    _force(monkeypatch, request.param)
    BACKEND._plans.clear()  # plans remember the path chosen
    monkeypatch.setattr(_frontend, "_bound", {})  # ... and so do the bound launchers
    yield request.param
    BACKEND._plans.clear()


def _kinds():
    kinds = []
    if torch_cuda():
        kinds.append("torch_cuda")
    if importlib.util.find_spec("cupy") is not None and REASON is None:
        kinds.append("cupy")
    return kinds


def _problem(rng, kind, dtypes, layouts, B=2, Ci=4, Co=6, G=2, H=7, W=6, k=(3, 2),
             stride=(1, 1), padding=(0, 0), dilation=(1, 1), full_out=True, gamma="full",
             c_form="1d"):
    kh, kw = k
    Ho = (H + 2 * padding[0] - dilation[0] * (kh - 1) - 1) // stride[0] + 1
    Wo = (W + 2 * padding[1] - dilation[1] * (kw - 1) - 1) // stride[1] + 1
    oshape = (B, Co, Ho, Wo, Co, Ho, Wo) if full_out else (B, Co, Ho, Wo, Ho, Wo)
    gshape = {"full": (B, Ci, H, W, Ci, H, W), "diag": (B, Ci, H, W, H, W)}.get(gamma)
    out = make(rng.standard_normal(oshape), kind, dtypes[0], layouts[0], rng)
    # gamma and c of both signs (a sign lost anywhere shows)
    g = (None if gshape is None else
         make(rng.standard_normal(gshape), kind, dtypes[1], layouts[1], rng))
    mu = make(rng.standard_normal((B, Ci, H, W)), kind, dtypes[2], layouts[2], rng)
    cv = rng.standard_normal(Co)
    c = float(cv[0]) if c_form == "number" else make(
        cv if c_form == "1d" else np.array(cv[0]), kind, dtypes[3])
    conv = dict(stride=stride, padding=padding, dilation=dilation, groups=G)
    return out, g, mu, c, k, conv


def _check(out, g, mu, c, k, conv, run=None, exact_nonfinite=False):
    """Run the cupy backend on the arrays and compare with the numpy reference.
    ``exact_nonfinite``: NaN, +Inf and -Inf must be exactly where the reference has them,
    the finite elements within the tolerance (else every element is compared so)."""
    out0, mu64 = to_f64(out), to_f64(mu)
    g64 = None if g is None else to_f64(g)
    Co = out0.shape[1]
    c64 = c if isinstance(c, float) else np.broadcast_to(to_f64(c), (Co,)).copy()
    ref = convcov.accumulate(out0.copy(), g64, mu64, c64, k, backend="numpy", **conv)
    bound = convcov.accumulate(np.abs(out0), None if g64 is None else np.abs(g64),
                               np.abs(mu64), np.abs(c64), k, backend="numpy", **conv)
    if run is None:
        assert convcov.accumulate(out, g, mu, c, k, backend="cupy", **conv) is out
    else:
        run()
    got = to_f64(out)
    names = [str(x.dtype).split(".")[-1] for x in (out, g, mu) if x is not None]
    acc = "float64" if "float64" in names or (
        not isinstance(c, float) and "float64" in str(c.dtype)) else "float32"
    Cg = mu64.shape[1] // conv["groups"]
    fin = np.ones(ref.shape, bool)
    if exact_nonfinite:
        for where in (np.isnan, np.isposinf, np.isneginf):
            np.testing.assert_array_equal(where(got), where(ref), err_msg=where.__name__)
        fin = np.isfinite(ref)
    tol = tolerance(bound[fin], 2 * Cg * k[0] * k[1], acc, names[0])
    bad = ~(np.abs(got[fin] - ref[fin]) <= tol)
    assert not bad.any(), f"{bad.sum()} of {bad.size} elements off"
    if out0.ndim == 7:  # off the channel-diagonal: bit-identical
        off = np.ones(out0.shape, bool)
        for c0 in range(Co):
            off[:, c0, :, :, c0] = False
        np.testing.assert_array_equal(got[off], out0[off])


# ------------------------------------------------------------------ correctness
CONV = [
    dict(),
    dict(stride=(2, 1), padding=(1, 2), dilation=(1, 2)),
    dict(H=9, W=9, k=(3, 3), stride=(1, 1), padding=(2, 2), G=1, Ci=3, Co=3),
    dict(H=8, W=8, k=(1, 1), G=2, Ci=4, Co=4),
    dict(H=9, W=6, k=(7, 2), padding=(2, 1)),  # a tall kernel
    dict(H=6, W=16, k=(3, 3), stride=(2, 2), padding=(1, 1), G=3, Ci=3, Co=6),  # depthwise
]


@gpu
@pytest.mark.parametrize("kind", _kinds())
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16", "float64"])
@pytest.mark.parametrize("conv", range(len(CONV)))
@pytest.mark.parametrize("form", [(True, "full"), (False, "diag"), (True, None), (False, "full")])
def test_matches_reference(path, kind, dtype, conv, form):
    if dtype == "bfloat16" and kind != "torch_cuda":
        pytest.skip("bfloat16 arrays come from torch")
    rng = np.random.default_rng(hash((kind, dtype, conv, form)) % 2**32)
    args = _problem(rng, kind, [dtype] * 4, ["contiguous"] * 3, full_out=form[0],
                    gamma=form[1], **CONV[conv])
    _check(*args)


@gpu
@pytest.mark.parametrize("kind", _kinds())
@pytest.mark.parametrize("layouts", [("permuted", "strided", "permuted"),
                                     ("strided", "permuted", "strided"),
                                     ("contiguous", "contiguous", "strided")])
@pytest.mark.parametrize("dtypes", [("float32",) * 4, ("float16", "float32", "float64", "float16"),
                                    ("float32", "float16", "float16", "float32")])
def test_views_and_mixed_dtypes(path, kind, layouts, dtypes):
    rng = np.random.default_rng(7)
    for full_out, gamma in ((True, "full"), (False, "diag")):
        _check(*_problem(rng, kind, dtypes, layouts, full_out=full_out, gamma=gamma,
                         c_form="0d", **CONV[1]))


@gpu
@need_torch
def test_misaligned_views_take_the_generic_path(path):
    """Views that start one element in cannot use 16-byte loads: still right."""
    import torch

    rng = np.random.default_rng(3)
    out, g, mu, c, k, conv = _problem(rng, "torch_cuda", ["float32"] * 4, ["contiguous"] * 3,
                                      H=8, W=8, k=(3, 3), full_out=False, gamma="diag")
    big = torch.zeros(out.numel() + 1, device="cuda")
    big[1:] = out.reshape(-1)
    out = big[1:].view(out.shape)
    gbig = torch.zeros(g.numel() + 1, device="cuda")
    gbig[1:] = g.reshape(-1)
    _check(out, gbig[1:].view(g.shape), mu, c, k, conv)


@gpu
@need_torch
def test_requires_grad_tensors():
    import torch

    rng = np.random.default_rng(4)
    out, g, mu, c, k, conv = _problem(rng, "torch_cuda", ["float32"] * 4, ["contiguous"] * 3)
    _check(out, g.requires_grad_(), mu.requires_grad_(), c, k, conv)
    assert isinstance(out, torch.Tensor)


@gpu
def test_numba_device_arrays():
    cuda = pytest.importorskip("numba.cuda")
    if not cuda.is_available():
        pytest.skip("numba.cuda sees no device")
    rng = np.random.default_rng(5)
    _check(*_problem(rng, "numba", ["float32"] * 4, ["contiguous"] * 3))


# ------------------------------------------------------------------ streams
@gpu
@need_torch
def test_runs_on_the_current_torch_stream(path):
    """Work queued on a side stream before the call must be seen by the call: if the
    kernel ran on another stream it would read ``out`` before the copy that fills it."""
    import torch

    rng = np.random.default_rng(6)
    out, g, mu, c, k, conv = _problem(rng, "torch_cuda", ["float32"] * 4, ["contiguous"] * 3)
    src = out.clone()
    expected = out.clone()
    convcov.accumulate(expected, g, mu, c, k, backend="cupy", **conv)
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        out.zero_()
        torch.cuda._sleep(20_000_000)  # ~10 ms of GPU time on this stream
        out.copy_(src)
        convcov.accumulate(out, g, mu, c, k, backend="cupy", **conv)
        got = out.clone()
    side.synchronize()
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


@gpu
def test_runs_on_the_current_cupy_stream(path):
    import cupy

    spin = cupy.RawKernel(r'''extern "C" __global__ void spin(long long n) {
        long long t0 = clock64(); while (clock64() - t0 < n) {} }''', "spin")
    rng = np.random.default_rng(8)
    out, g, mu, c, k, conv = _problem(rng, "cupy", ["float32"] * 4, ["contiguous"] * 3)
    src = out.copy()
    expected = out.copy()
    convcov.accumulate(expected, g, mu, c, k, backend="cupy", **conv)
    cupy.cuda.Device().synchronize()
    with cupy.cuda.Stream(non_blocking=True) as side:
        out.fill(0)
        spin((1,), (1,), (np.int64(20_000_000),))
        out[...] = src
        convcov.accumulate(out, g, mu, c, k, backend="cupy", **conv)
        got = out.copy()
    side.synchronize()
    np.testing.assert_array_equal(cupy.asnumpy(got), cupy.asnumpy(expected))


# ------------------------------------------------------------------ 64-bit indexing
@gpu
@need_torch
@pytest.mark.parametrize("layout", ["diag", "full"])
def test_more_than_2_31_elements(path, layout):
    """out (and, for diag, gamma) with more than 2**31 elements; checked on the GPU against
    the plain torch expression."""
    import torch

    from convcov import torch_expr

    if layout == "diag":  # (H*W)**2 = 218**4 > 2**31 for gamma; (Ho*Wo)**2 = 216**4 for out
        B, Ci, Co, H, k = 1, 1, 1, 218, 3
    else:  # full out: Co**2 * (Ho*Wo)**2 = 12**2 * 64**4 > 2**31
        B, Ci, Co, H, k = 1, 2, 12, 66, 3
    Ho = H - k + 1
    gen = torch.Generator(device="cuda").manual_seed(0)
    rand = lambda *s: torch.rand(s, generator=gen, device="cuda", dtype=torch.float16)  # noqa: E731
    oshape = (B, Co, Ho, Ho, Ho, Ho) if layout == "diag" else (B, Co, Ho, Ho, Co, Ho, Ho)
    out = rand(*oshape)
    gamma = rand(B, Ci, H, H, H, H) if layout == "diag" else None
    assert out.numel() > 2**31 and (gamma is None or gamma.numel() > 2**31)
    mu = rand(B, Ci, H, H)
    c = torch.rand(Co, generator=gen, device="cuda") + 0.5
    diag = (lambda o: o) if layout == "diag" else (
        lambda o: o.diagonal(dim1=1, dim2=4).permute(0, 5, 1, 2, 3, 4))
    before = diag(out).float()  # a copy of the channel-diagonal only
    if layout == "full":
        probe = out[0, 0, 0, 0, 1].clone()  # an off-diagonal slice: must not change
    convcov.accumulate(out, gamma, mu, c, k, backend="cupy")
    S = torch_expr.patch_moment(gamma, mu, k, k)  # (B, 1, Ho, Ho, Ho, Ho), float32
    want = before + c.view(1, Co, 1, 1, 1, 1) * S
    got = diag(out).float()
    err = (got - want).abs().max().item()
    assert err <= 2e-3 * want.abs().max().item(), err
    if layout == "full":
        assert torch.equal(out[0, 0, 0, 0, 1], probe)


# ------------------------------------------------------------------ threads, devices
def _twenty_calls(job, expected, own_stream, start):
    """A thread's part of the threads tests: once every thread is ready (start), 20
    calls on the job's arrays (out restored before each) on torch's current stream or
    on a stream of its own; the result must have expected's bits."""
    import torch

    out, g, mu, c, k, conv = job
    src = out.clone()
    stream = torch.cuda.Stream() if own_stream else torch.cuda.current_stream()
    torch.cuda.current_stream().synchronize()
    start()
    with torch.cuda.stream(stream):
        for _ in range(20):
            out.copy_(src)
            convcov.accumulate(out, g, mu, c, k, backend="cupy", **conv)
    stream.synchronize()
    assert torch.equal(out, expected), "wrong result"


@gpu
@need_torch
def test_threads_at_once():
    """Several Python threads, each with its own arrays, shapes, dtypes and torch stream."""
    import torch

    rng = np.random.default_rng(9)
    jobs = []
    for i in range(8):
        dtype = ["float32", "float16", "bfloat16", "float64"][i % 4]
        conv = CONV[i % len(CONV)]
        jobs.append(_problem(rng, "torch_cuda", [dtype] * 4, ["contiguous"] * 3,
                             full_out=bool(i % 2), gamma=["full", "diag", None][i % 3], **conv))
    expected = []
    for out, g, mu, c, k, conv in jobs:
        e = out.clone()
        convcov.accumulate(e, g, mu, c, k, backend="cupy", **conv)
        expected.append(e)
    torch.cuda.synchronize()

    at_once(len(jobs), lambda i, start: _twenty_calls(jobs[i], expected[i], i % 2, start))


@gpu
@need_torch
@pytest.mark.parametrize("path", ["fused", "stream"], indirect=True)
def test_threads_share_a_bound_signature(path):
    """Eight threads call one signature at once, each with its own arrays, half of them on
    one stream: the bound launcher's calls each fill their own copy of the plan's Args, and
    every result has the bits of the full path's."""
    import torch

    rng = np.random.default_rng(23)
    jobs = [_problem(rng, "torch_cuda", ["float32"] * 4, ["contiguous"] * 3) for _ in range(8)]
    expected = []
    for out, g, mu, c, k, conv in jobs:  # conv parameters as lists: the full path, unbound
        e = out.clone()
        convcov.accumulate(e, g, mu, c, list(k), backend="cupy",
                           **{n: list(v) if isinstance(v, tuple) else v for n, v in conv.items()})
        expected.append(e)
    assert not _frontend._bound
    torch.cuda.synchronize()

    at_once(len(jobs), lambda i, start: _twenty_calls(jobs[i], expected[i], i % 2, start))
    assert len(_frontend._bound) == 1


@gpu
@need_torch
@pytest.mark.parametrize("path", ["stream"], indirect=True)
def test_captured_calls_take_the_graphs_memory(path):
    """Bound calls captured into CUDA graphs (torch.cuda.graph, as docs/cupy.md suggests
    for repeated small calls) take their scratch from each graph's own pool: two graphs of
    one signature, replayed at once on two streams, each add their own term."""
    import torch

    rng = np.random.default_rng(22)
    jobs = [_problem(rng, "torch_cuda", ["float64"] * 4, ["contiguous"] * 3, B=3, Ci=6,
                     Co=6, H=12, W=11) for _ in range(2)]
    terms = []
    for out, g, mu, c, k, conv in jobs:  # eager: the full path, then the bound launcher
        for _ in range(2):
            o = out.clone()
            convcov.accumulate(o, g, mu, c, k, backend="cupy", **conv)
        terms.append(o - out)
    torch.cuda.synchronize()
    graphs, outs = [], []
    for out, g, mu, c, k, conv in jobs:
        o = out.clone()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            convcov.accumulate(o, g, mu, c, k, backend="cupy", **conv)
        graphs.append(graph)
        outs.append(o)
    streams = torch.cuda.Stream(), torch.cuda.Stream()
    torch.cuda.synchronize()
    for _ in range(5):
        for graph, stream in zip(graphs, streams):
            with torch.cuda.stream(stream):
                graph.replay()
    torch.cuda.synchronize()
    for o, (out, *_), term in zip(outs, jobs, terms):
        torch.testing.assert_close(o, out + 5 * term, rtol=1e-12, atol=1e-12)


@gpu
@need_torch
@pytest.mark.parametrize("path", ["fused", "stream"], indirect=True)
def test_repeated_calls_under_torch_compile_reduce_overhead(path):
    """docs/cupy.md's other way for repeated small calls: a step that calls accumulate,
    compiled with torch.compile(mode="reduce-overhead") (torch's CUDA graphs), called
    again and again with new values in its inputs: each result is the eager step's."""
    import torch

    rng = np.random.default_rng(24)
    out, g, mu, c, k, conv = _problem(rng, "torch_cuda", ["float32"] * 4, ["contiguous"] * 3)

    def step(out, g, mu, c):
        o = out.clone()
        convcov.accumulate(o, g, mu, c, k, backend="cupy", **conv)
        return o

    compiled = torch.compile(step, mode="reduce-overhead")
    for i in range(6):
        args = [x * (1 + 0.25 * i) for x in (out, g, mu, c)]
        got = compiled(*args).clone()  # (the graph's output is overwritten by its next run)
        torch.testing.assert_close(got, step(*args), rtol=1e-5, atol=1e-5)


@gpu
@need_torch
def test_second_gpu(monkeypatch):
    """Arrays on cuda:1 are computed there, whatever the current device is: the first
    call (the full path), a second one of the same signature (torch tensors: the bound
    launcher of the fast path) and a third from a fresh thread (no context current)."""
    import threading

    import torch

    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs (nvidia-h200-x2)")
    rng = np.random.default_rng(10)
    torch.cuda.set_device(0)
    full = []  # GPU calls that took the full path
    normalise = _frontend.normalise
    monkeypatch.setattr(_frontend, "normalise", lambda *a: (
        None if isinstance(a[0], np.ndarray) else full.append(1)) or normalise(*a))
    for kind in _kinds():
        out, g, mu, c, k, conv = _problem(rng, "numpy", ["float32"] * 4, ["contiguous"] * 3)
        if kind == "torch_cuda":
            move = lambda x: torch.from_numpy(x).to("cuda:1")  # noqa: E731
        else:
            import cupy

            def move(x):
                with cupy.cuda.Device(1):
                    return cupy.asarray(x)
        full.clear()
        for call in range(3):
            arrays = [move(x) for x in (out, g, mu, c)]
            if call < 2:
                _check(*arrays, k, conv)
                # the first call binds; for torch tensors the second takes the launcher
                assert len(full) == (1 if kind == "torch_cuda" else call + 1)
            else:
                errors = []

                def in_thread():  # (joined within this iteration: B023 does not apply)
                    try:
                        _check(*arrays, k, conv)  # noqa: B023
                        assert torch.cuda.current_device() == 0
                    except BaseException as e:  # noqa: BLE001 - reported below
                        errors.append(e)  # noqa: B023
                t = threading.Thread(target=in_thread)
                t.start()
                t.join()
                assert not errors, errors
                assert len(full) == (1 if kind == "torch_cuda" else 3)
            assert torch.cuda.current_device() == 0


# ------------------------------------------------------------------ the CUDA source on the host
# CI has no GPU: there, the kernels' source is compiled as plain C++ (every thread of every
# block run in turn; the source's non-__CUDA_ARCH__ branches exist for this) and driven by
# the backend's own planning code on numpy arrays. This checks the index arithmetic,
# strides, layouts, vector widths, tiling and dtype conversions of every kernel against
# the numpy reference; the GPU-only pieces (intrinsics, inline PTX, streams) are left to
# the tests above.
_HOST_PRELUDE = r"""
#include <cmath>
#include <cstring>
#define __device__
#define __global__
#define __forceinline__ inline
#define __launch_bounds__(...)
struct uint2 { unsigned x, y; };
struct uint4 { unsigned x, y, z, w; };
struct dim3_ { unsigned x, y, z; };
static dim3_ threadIdx, blockIdx, blockDim, gridDim;
static float host_d2f_rz(double d) {
  float f = (float)d;
  if (std::fabs((double)f) > std::fabs(d)) f = std::nextafter(f, 0.0f);
  return f;
}
static float host_h2f(unsigned short h) {
  unsigned s = (h & 0x8000u) << 16, e = (h >> 10) & 0x1f, m = h & 0x3ff, u;
  if (e == 0) { float v = (float)m * 5.9604644775390625e-8f; return s ? -v : v; }
  u = e == 0x1f ? (s | 0x7f800000u | (m << 13)) : (s | ((e + 112) << 23) | (m << 13));
  float f; std::memcpy(&f, &u, 4); return f;
}
static unsigned short host_f2h(float f) {
  unsigned x; std::memcpy(&x, &f, 4);
  unsigned sign = (x >> 16) & 0x8000u, ax = x & 0x7fffffffu;
  if (ax > 0x7f800000u) return sign | 0x7e00u;
  if (ax >= 0x477ff000u) return sign | 0x7c00u;
  if (ax < 0x38800000u) {  // float16 subnormal: a multiple of 2**-24, rounded to even
    float v; std::memcpy(&v, &ax, 4);
    return sign | (unsigned)std::nearbyint(v * 16777216.0f);
  }
  return sign | ((ax + 0xfffu + ((ax >> 13) & 1u) - 0x38000000u) >> 13);
}
static float host_fmaf(float a, float b, float c) { return std::fma(a, b, c); }
static double host_fma(double a, double b, double c) { return std::fma(a, b, c); }
"""


#: Every RawModule family the backend can ask for (CupyBackend._function's family keys).
FAMILIES = [
    (kind, cxx, acc) for kind in ("fast", "vjp") for cxx in ("f16", "bf16", "float", "double")
    for acc in ("float", "double") if not (cxx == "double" and acc == "float")]


#: The plane walk's instantiations the host build holds: its ring's extent (kh, sh, dh)
#: as the host tests' cases have it, for every storage type.
PLANE_FAMILIES = [("plane", cxx, acc, kh, sh, dh) for _, cxx, acc in FAMILIES[:7]
                  for kh in (1, 2, 3) for sh in (1, 2, 3) for dh in (1, 2)]


def _all_kernel_names():
    from convcov.backends import cupy as mod

    return list(dict.fromkeys(n for f in FAMILIES + PLANE_FAMILIES
                              for n in mod._family_names(f)))


#: The families compiled through NVRTC: every storage type with float sums, float and
#: double with double sums (a 16-bit type with double sums is the same templates), every
#: backward; for sm_90 (the H200), and one for sm_80 (the oldest the kernels are written
#: for).
_COMPILED = ([(f, "sm_90") for f in FAMILIES
              if f[0] == "vjp" or f[2] == "float" or f[1] in ("float", "double")]
             + [(("fast", "f16", "float"), "sm_80")]
             + [(f, arch) for f in (("plane", "f16", "float", 3, 1, 1),
                                    ("plane", "bf16", "float", 3, 2, 1),
                                    ("plane", "double", "double", 3, 1, 1))
                for arch in ("sm_90", "sm_80")])


@pytest.mark.parametrize("family, arch", _COMPILED,
                         ids=lambda x: "-".join(map(str, x)) if isinstance(x, tuple) else x)
def test_every_module_compiles_for_the_gpu(family, arch):
    """The CUDA source with each family's name expressions, through NVRTC for a real GPU
    architecture, as CuPy's RawModule compiles it there. NVRTC needs no GPU, so CI compiles
    what only a GPU machine would otherwise: the host build below is plain C++ and skips
    the device-only code (inline PTX, intrinsics)."""
    nvrtc = pytest.importorskip("cuda.bindings.nvrtc",
                                reason="NVRTC comes with the test extra's numba-cuda[cu13]")
    from convcov.backends import cupy as mod

    err, prog = nvrtc.nvrtcCreateProgram(mod.SOURCE.encode(), b"convcov.cu", 0, [], [])
    assert err == nvrtc.nvrtcResult.NVRTC_SUCCESS
    try:
        for name in mod._family_names(family):
            nvrtc.nvrtcAddNameExpression(prog, name.encode())
        opts = [f"-arch={arch}".encode(), *(o.encode() for o in mod._OPTIONS)]
        err, = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)
        _, size = nvrtc.nvrtcGetProgramLogSize(prog)
        log = b" " * size
        nvrtc.nvrtcGetProgramLog(prog, log)
        assert err == nvrtc.nvrtcResult.NVRTC_SUCCESS, log.decode(errors="replace")
        for name in mod._family_names(family):  # every kernel the plans name is in the module
            err, lowered = nvrtc.nvrtcGetLoweredName(prog, name.encode())
            assert err == nvrtc.nvrtcResult.NVRTC_SUCCESS and lowered, name
    finally:
        nvrtc.nvrtcDestroyProgram(prog)


@pytest.fixture(scope="module")
def host_kernels(tmp_path_factory):
    from convcov.backends import cupy as mod

    names = _all_kernel_names()
    # Every block of the grid in turn, every thread of a block in turn (the kernels share
    # nothing within a block).
    drivers = "".join(
        f'extern "C" void run_{i}(const Args* a, const unsigned* g) {{ '
        f"gridDim.x = g[0]; gridDim.y = g[1]; gridDim.z = g[2]; "
        f"blockDim.x = g[3]; blockDim.y = g[4]; blockDim.z = 1; threadIdx.z = 0; "
        f"for (unsigned z = 0; z < g[2]; ++z) for (unsigned y = 0; y < g[1]; ++y) "
        f"for (unsigned x = 0; x < g[0]; ++x) {{ blockIdx.x = x; blockIdx.y = y; "
        f"blockIdx.z = z; for (unsigned ty = 0; ty < g[4]; ++ty) "
        f"for (unsigned tx = 0; tx < g[3]; ++tx) {{ threadIdx.x = tx; threadIdx.y = ty; "
        f"{n}(*a); }} }} }}\n" for i, n in enumerate(names))
    lib = host_build(tmp_path_factory.mktemp("host_kernels"), _HOST_PRELUDE + mod.SOURCE + drivers)
    return lib, {n: i for i, n in enumerate(names)}


class _HostKernel:
    """Stands for a ``cupy.RawKernel`` on the host build: called as the backend calls a
    RawKernel, ``(grid, block, args)``, it runs the kernel's host build on the Args struct
    in ``args[0]``, a one-element array of ``_ARGS`` whose data address is what CuPy
    passes to the driver for such an argument. ``launched`` gets (name, ``watch()``) per
    call."""

    def __init__(self, name, host_kernels, launched, watch):
        self.name, self.host_kernels, self.launched, self.watch = (name, host_kernels,
                                                                    launched, watch)

    def __call__(self, grid, block, args, shared_mem=0):
        import ctypes

        from convcov.backends import cupy as mod

        (a,) = args
        assert isinstance(a, np.ndarray) and a.shape == (1,) and a.dtype == mod._ARGS
        assert a.itemsize == 8 * len(mod._FIELDS) and np.prod(block) == 256
        assert grid[0] < 2**31 and all(n <= 65535 for n in grid[1:])  # CUDA's limits
        assert shared_mem <= 48 * 1024
        self.launched.append((self.name, self.watch()))
        lib, index = self.host_kernels
        g = np.array([*grid, *(1,) * (3 - len(grid)), *block, *(1,) * (2 - len(block))],
                     np.uint32)
        getattr(lib, f"run_{index[self.name]}")(
            ctypes.c_void_p(a.__array_interface__["data"][0]),
            ctypes.c_void_p(g.__array_interface__["data"][0]))


def _host_backend(sms, host_kernels, launched=None, watch=lambda: None):
    """The cupy backend planning for the host build: its kernels are _HostKernels, and
    ``sms`` = (multiprocessors, threads each) pretends a device size."""
    from convcov.backends import cupy as mod

    launched = [] if launched is None else launched

    class Host(mod.CupyBackend):
        def _function(self, name, family, dev):
            assert name in mod._family_names(family), (name, family)
            return _HostKernel(name, host_kernels, launched, watch)

        def _sm_threads(self, dev):
            return sms

    return Host()


def _run_on_host(host_kernels, p, sms, src=None):
    """The backend's plan for p (numpy arrays), launched on the host build through the
    backend's own _fill and _launch_all; out's values read from ``src`` where given (the
    apart path)."""
    from convcov.backends import cupy as mod

    plan = _host_backend(sms, host_kernels)._plan(p, 0)
    scratch = np.full(plan.scratch + 64, np.nan, plan.acc)  # NaN: unwritten reads show
    base = scratch.ctypes.data + (-scratch.ctypes.data) % 256
    cptr = 0 if p.c_info is None else p.c_info.ptr
    args = mod._fill(plan, mod._CALL_SLOTS,
                     (p.out_info.ptr, 0 if p.gamma_info is None else p.gamma_info.ptr,
                      p.mu_info.ptr, cptr, base,
                      p.out_info.ptr if src is None else src.ctypes.data,
                      mod._c_bits(cptr, p.c_value)))
    mod._launch_all(plan, args)
    return [ln.func.name for ln in plan.launches]


def _host_call(host_kernels, out, g, mu, c, k, conv, sms=(4, 256)):
    """accumulate's validation, then the plan launched on the host build (_run_on_host)."""
    from convcov import _frontend

    p = _frontend.normalise(out, g, mu, c, k, conv["stride"], conv["padding"],
                            conv["dilation"], conv["groups"])
    return _run_on_host(host_kernels, p, sms)


_HOST_CASES = [  # (B, Ci, Co, G, H, W, k, stride, padding, dilation)
    (2, 4, 4, 1, 6, 6, (3, 3), (1, 1), (0, 0), (1, 1)),
    (2, 6, 4, 2, 8, 8, (3, 3), (1, 1), (1, 1), (1, 1)),
    (1, 5, 10, 1, 6, 7, (2, 3), (1, 1), (1, 0), (1, 1)),
    (2, 8, 8, 2, 8, 8, (3, 3), (2, 1), (2, 1), (1, 2)),
    (1, 9, 9, 3, 4, 8, (1, 1), (1, 1), (0, 0), (1, 1)),
    (1, 2, 2, 1, 19, 19, (3, 3), (1, 1), (1, 0), (1, 1)),  # rows longer than a block
    (1, 2, 3, 1, 20, 20, (3, 3), (1, 1), (0, 0), (1, 1)),  # several stream tiles, 8-wide
    (1, 2, 2, 1, 9, 5, (7, 2), (1, 1), (2, 1), (1, 1)),  # a tall kernel
    (1, 2, 2, 1, 9, 3, (8, 1), (1, 1), (1, 0), (1, 1)),  # taller than the input is wide
    (1, 3, 3, 3, 9, 7, (3, 3), (1, 2), (2, 1), (2, 1)),  # depthwise, unequal stride and dilation
    # from here on, planes that fit a warp (cc_plane on the "plane" path):
    (2, 4, 4, 4, 8, 8, (3, 3), (1, 1), (1, 1), (1, 1)),  # depthwise, 8 wide
    (1, 3, 6, 3, 5, 16, (3, 3), (2, 2), (1, 1), (1, 1)),  # two output channels a group, 16 wide
    (1, 4, 4, 2, 6, 16, (3, 3), (1, 1), (2, 2), (2, 2)),  # dilated: a ring of five planes
    (1, 2, 2, 1, 4, 16, (1, 1), (2, 2), (0, 0), (1, 1)),  # every other plane skipped
    (1, 5, 5, 1, 5, 8, (3, 3), (1, 1), (1, 1), (1, 1)),  # more channels than are copied ahead
]


_PLANE_CASES = 10  # the first of _HOST_CASES whose planes fit a warp


@pytest.mark.parametrize("forced", PATHS)
@pytest.mark.parametrize("c_form", ["number", "1d"])
def test_bound_launcher_on_host(host_kernels, monkeypatch, forced, c_form):
    """The bound launcher (the fast path of torch tensors), its kernels on the host build,
    with stand-ins for CuPy's runtime and stream objects, torch's stream getter and torch's
    allocator; the arrays on device 1 while device 0 is current. Each call launches every
    kernel with device 1 current and CuPy's current stream set to torch's stream of device
    1, takes its scratch (three launches: S and T) from torch's allocator for device 1 and
    that stream and gives it back once the launches are queued, makes device 0 current
    again, and adds the reference's term; calls share no state. A number c reaches the
    kernels with its sign bit: on an out of -0.0, c = 0.0 and c = -0.0 give the
    reference's signs, which differ."""
    import dataclasses
    import weakref
    from types import SimpleNamespace as NS

    from convcov import _frontend
    from convcov.backends import cupy as mod

    _force(monkeypatch, forced)
    state = {"device": 0, "stream": None}
    taken = []  # (nbytes, device, stream, the owner, weakly)

    class Runtime:
        def getDevice(self):
            return state["device"]

        def setDevice(self, dev):
            state["device"] = dev

    class StreamObject:  # what cupy.cuda.Stream.from_external gives: current inside `with`
        def __init__(self, handle):
            self.ptr, self.saved = handle, []

        def __enter__(self):
            self.saved.append(state["stream"])
            state["stream"] = self.ptr
            return self

        def __exit__(self, *exc):
            state["stream"] = self.saved.pop()

    class Stream:
        @staticmethod
        def from_external(obj):
            version, handle = obj.__cuda_stream__()
            assert version == 0
            return StreamObject(handle)

    class Owner:
        def __init__(self, nbytes):
            self.buf = np.full(nbytes // 8 + 64, np.nan)  # NaN: unwritten reads show

    def scratch(nbytes, dev, stream, current=False):
        owner = Owner(nbytes)
        taken.append((nbytes, dev, stream, weakref.ref(owner)))
        return owner, owner.buf.ctypes.data + (-owner.buf.ctypes.data) % 256

    monkeypatch.setattr(mod, "torch_stream_getter", lambda: lambda dev: 70 + dev)
    monkeypatch.setattr(mod, "torch_scratch", scratch)
    launched = []
    backend = _host_backend((4, 256), host_kernels, launched,
                            watch=lambda: (state["device"], state["stream"]))
    backend._cp = NS(cuda=NS(runtime=Runtime(), Stream=Stream))

    rng = np.random.default_rng(5)
    out, g, mu, c, k, conv = _problem(rng, "numpy", ["float32"] * 4, ["contiguous"] * 3,
                                      c_form=c_form)
    p = dataclasses.replace(
        _frontend.normalise(out, g, mu, c, k, conv["stride"], conv["padding"],
                            conv["dilation"], conv["groups"]),
        kind="torch", device=("cuda", 1))
    run = backend.bind(p)
    assert state == {"device": 0, "stream": None} and not taken
    plan = next(iter(backend._plans.values()))
    cptr = 0 if p.c_info is None else p.c_info.ptr

    def call(o, cv):
        launched.clear()
        taken.clear()
        run(None, None, None, None, o.ctypes.data, p.gamma_info.ptr, p.mu_info.ptr, cptr, cv)
        assert state == {"device": 0, "stream": None}
        _took([name for name, _ in launched], forced)
        assert all(at == (1, 71) for _, at in launched), launched
        if forced != "stream":  # no scratch
            assert not taken
        else:
            ((nbytes, dev, stream, owner),) = taken
            assert (nbytes, dev, stream) == (plan.scratch * 4, 1, 71)
            assert owner() is None  # given back

    for _ in range(2):
        o = out.copy()
        _check(o, g, mu, c, k, conv, run=lambda: call(o, p.c_value))  # noqa: B023
    if c_form == "number":
        signs = []
        for cv in (0.0, -0.0):
            o = np.full_like(out, -0.0)
            ref = convcov.accumulate(o.astype(np.float64), g.astype(np.float64),
                                     mu.astype(np.float64), cv, k, backend="numpy", **conv)
            call(o, cv)
            np.testing.assert_array_equal(np.signbit(o), np.signbit(ref))
            signs.append(np.signbit(o))
        assert not np.array_equal(*signs)


@pytest.mark.parametrize("case", range(len(_HOST_CASES)))
@pytest.mark.parametrize("dtype", ["float32", "float16", "float64"])
@pytest.mark.parametrize("forced", PATHS)
@pytest.mark.parametrize("form", [(False, "diag"), (True, "full"), (False, None)])
def test_cuda_source_on_host(host_kernels, monkeypatch, case, dtype, forced, form):
    B, Ci, Co, G, H, W, k, stride, padding, dilation = _HOST_CASES[case]
    _force(monkeypatch, forced)
    rng = np.random.default_rng(case)
    out, g, mu, c, k, conv = _problem(rng, "numpy", [dtype] * 4, ["contiguous"] * 3, B=B,
                                      Ci=Ci, Co=Co, G=G, H=H, W=W, k=k, stride=stride,
                                      padding=padding, dilation=dilation, full_out=form[0],
                                      gamma=form[1])
    from convcov import _frontend

    names = []
    run = lambda: names.extend(_run_on_host(host_kernels, _frontend.normalise(  # noqa: E731
        out, g, mu, c, k, conv["stride"], conv["padding"], conv["dilation"], conv["groups"]),
        (4, 256)))
    _check(out, g, mu, c, k, conv, run=run)
    if forced == "plane" and case >= _PLANE_CASES and dtype != "float64":  # (covered)
        assert [n.split("<")[0] for n in names] == ["cc_plane"], names


@pytest.mark.parametrize("seed", range(40))
def test_cuda_source_on_host_random(host_kernels, monkeypatch, seed):
    """Random sizes, conv parameters, dtype mixes, layouts (permuted, strided), paths and
    device sizes (which change the tilings)."""
    from convcov import _frontend

    rng = np.random.default_rng(1000 + seed)
    i = lambda lo, hi: int(rng.integers(lo, hi + 1))  # noqa: E731
    G, kh, kw, dh, dw, ph, pw = i(1, 3), i(1, 3), i(1, 3), i(1, 2), i(1, 2), i(0, 2), i(0, 2)
    span_h, span_w = dh * (kh - 1) + 1, dw * (kw - 1) + 1
    dims = dict(B=i(1, 2), Ci=G * i(1, 3), Co=G * i(1, 3), G=G,
                H=i(max(1, span_h - 2 * ph), span_h + 6), W=i(max(1, span_w - 2 * pw), span_w + 6),
                k=(kh, kw), stride=(i(1, 3), i(1, 3)), padding=(ph, pw), dilation=(dh, dw))
    dts = ["float16", "float32", "float64"]
    dtypes = [dts[i(0, 2)] for _ in range(4)] if rng.random() < 0.5 else [dts[i(0, 2)]] * 4
    lays = ["contiguous", "permuted", "strided"]
    layouts = [lays[i(0, 2)] for _ in range(3)] if rng.random() < 0.6 else ["contiguous"] * 3
    out, g, mu, c, k, conv = _problem(rng, "numpy", dtypes, layouts, full_out=bool(i(0, 1)),
                                      gamma=[None, "full", "diag"][i(0, 2)],
                                      c_form=["number", "0d", "1d"][i(0, 2)], **dims)
    if i(0, 1):
        _force(monkeypatch, PATHS[i(0, len(PATHS) - 1)])
    sms = [(4, 256), (1, 256), (132, 2048)][i(0, 2)]
    run = lambda: _run_on_host(host_kernels, _frontend.normalise(  # noqa: E731
        out, g, mu, c, k, conv["stride"], conv["padding"], conv["dilation"], conv["groups"]),
        sms)
    _check(out, g, mu, c, k, conv, run=run)


# ------------------------------------------------------------------ negative strides, Inf next
# to the padding, and the literal loops: on the host build (CI) and on a GPU
def _force(monkeypatch, forced):
    """Force a plan (PATHS): a warp a diagonal wherever the planes fit a warp ("plane") or
    never (the others); S through memory wherever out's rows allow it ("stream") or never
    (the others); the walk's tiles as small as they go, one plane of S a step, c
    read where it is used ("tiles": _plan.WALK_SMEM); every diagonal in segments of one
    plane ("segments"); the most lanes to an element's channel sum ("split":
    _plan.SPLIT_LOADS)."""
    from convcov.backends import _plan

    monkeypatch.setattr(_plan, "STREAM_BYTES", 0 if forced == "stream" else 1 << 60)
    if forced != "plane":
        monkeypatch.setattr(_plan, "plane", lambda *args, **kw: None)
    if forced == "tiles":
        monkeypatch.setattr(_plan, "WALK_SMEM", 1)
    if forced == "segments":
        monkeypatch.setattr(_plan, "WALK_BLOCKS_PER_SM", 1 << 30)
    if forced == "split":
        monkeypatch.setattr(_plan, "SPLIT_LOADS", 1 << 30)


def _took(names, forced, rows_contiguous=True):
    """The launches (_run_on_host's names) are the forced plan's (S through memory only
    where out's rows are contiguous)."""
    stream = forced == "stream" and rows_contiguous
    kernels = [n.split("<")[0] for n in names]
    if forced == "plane":  # (where the planes do not fit a warp, the walk)
        assert kernels in (["cc_plane"], ["cc_walk"]), names
        return
    assert kernels == (["cc_walk", "cc_stream"] if stream else ["cc_walk"]), names


#: Axes to reverse, by an array's number of dimensions.
_FLIPS = {
    "last": lambda nd: {nd - 1},
    "rows": lambda nd: {2, nd - 2},  # x (and x' / i1 of out and gamma)
    "channels": lambda nd: {1, nd - 3},  # both channel axes of a full layout
    "all": lambda nd: set(range(nd)),
}


def _reversed(x, axes, xp=np):
    """(view, buffer): x's values in a view with negative strides along ``axes`` (a copy
    reversed along them, reversed back), in the middle of a NaN buffer of three times its
    size (``xp``: numpy or cupy). Reads outside the view then bring NaN into out, and
    writes outside it land in the guards (checked by _guards_intact), not in other memory."""
    idx = tuple(slice(None, None, -1) if a in axes else slice(None) for a in range(x.ndim))
    r = np.ascontiguousarray(x[idx])
    n = r.size
    buf = np.full(3 * n, np.nan, r.dtype)
    buf[n:2 * n] = r.ravel()
    buf = xp.asarray(buf)
    view = buf[n:2 * n].reshape(r.shape)[idx]
    assert all(view.strides[a] < 0 for a in axes if x.shape[a] > 1)
    return view, buf


def _guards_intact(bufs):
    for buf in bufs:
        b = buf if isinstance(buf, np.ndarray) else buf.get()
        n = b.size // 3
        assert np.isnan(b[:n]).all() and np.isnan(b[2 * n:]).all(), "wrote outside the array"


def _flipped_problem(form, flip, xp=np, seed=0):
    """A float32 problem (stride 1, padding along the rows, groups) whose out, gamma, mu
    (and, for "all", c) have negative strides (_reversed). W = 5 and Wo = 4: with the
    strides' signs dropped, rows would pass as contiguous, aligned vectors."""
    rng = np.random.default_rng(seed)
    out, g, mu, c, k, conv = _problem(rng, "numpy", ["float32"] * 4, ["contiguous"] * 3,
                                      B=2, Ci=4, Co=4, G=2, H=4, W=5, k=(3, 2),
                                      padding=(1, 0), full_out=form[0], gamma=form[1])
    bufs = []
    arrays = []
    for x in (out, g, mu):
        if x is None:
            arrays.append(None)
            continue
        view, buf = _reversed(x, _FLIPS[flip](x.ndim), xp)
        arrays.append(view)
        bufs.append(buf)
    c = _reversed(c, {0}, xp)[0] if flip == "all" else xp.asarray(c)
    return (arrays[0], arrays[1], arrays[2], c, k, conv), bufs


@pytest.mark.parametrize("flip", list(_FLIPS))
@pytest.mark.parametrize("forced", PATHS)
@pytest.mark.parametrize("form", [(False, "diag"), (True, "full"), (False, None)])
def test_negative_strides_on_host(host_kernels, monkeypatch, form, forced, flip):
    """out, gamma and mu as views with negative strides (reversed along the last axis, the
    row axes, the channel axes or every axis, and c too for the last), on each path and in
    both out layouts (and gamma absent), against the numpy reference, on the host build.
    The plan's layout tests (contiguous, vector_width) must take a negative stride as not
    contiguous, and the kernels must step backwards with it: with abs() taken of the
    strides there, every other test of this file passes, while the three-launch path
    reads and writes the wrong elements, outside the arrays too (the NaN guards around
    each keep that in the test's own buffers)."""
    _force(monkeypatch, forced)
    args, bufs = _flipped_problem(form, flip, seed=len(flip))
    names = []
    _check(*args, run=lambda: names.extend(_host_call(host_kernels, *args)))
    _took(names, forced, rows_contiguous=flip == "channels")
    _guards_intact(bufs)


@gpu
@pytest.mark.parametrize("flip", list(_FLIPS))
@pytest.mark.parametrize("form", [(False, "diag"), (True, "full")])
def test_negative_strides(path, form, flip):
    """test_negative_strides_on_host on a GPU, with CuPy arrays (torch has no negative
    strides)."""
    if "cupy" not in _kinds():
        pytest.skip("negative strides come from CuPy arrays")
    import cupy

    args, bufs = _flipped_problem(form, flip, cupy, seed=len(flip))
    _check(*args)
    _guards_intact(bufs)


@pytest.mark.parametrize("forced", PATHS)
def test_apart_on_host(host_kernels, monkeypatch, forced):
    """out's values read from another array (accumulate_apart, dask's tasks): ``new =
    source + c * S`` on the channel diagonal, the rest of new and all of source untouched,
    on every path of the host build."""
    from kinds import op_loops

    from convcov import _frontend

    _force(monkeypatch, forced)
    rng = np.random.default_rng(11)
    for B, Ci, Co, G, H, W, k, s, pd, d in _HOST_CASES[:5]:
        Ho, Wo = ((n + 2 * q - e * (m - 1) - 1) // t + 1 for n, q, e, m, t in
                  ((H, pd[0], d[0], k[0], s[0]), (W, pd[1], d[1], k[1], s[1])))
        source = rng.normal(size=(B, Co, Ho, Wo, Ho, Wo)).astype(np.float32)
        gamma = rng.normal(size=(B, Ci, H, W, H, W)).astype(np.float32)
        mu, c = rng.normal(size=(B, Ci, H, W)).astype(np.float32), rng.random(Co)
        kept, new = source.copy(), np.full_like(source, np.nan)
        want = op_loops(source, gamma, mu, c, *k, s, pd, d, G)
        p = _frontend.normalise(new, gamma, mu, c, k, s, pd, d, G)
        _run_on_host(host_kernels, p, (4, 256), src=source)
        np.testing.assert_array_equal(source, kept)
        np.testing.assert_allclose(new, want, rtol=1e-5, atol=1e-5)


@gpu
def test_apart_on_the_gpu(path):
    """accumulate_apart on CuPy arrays: the same bits as the call in place on a copy of
    out with the result's alignment (the plan, and so the order of the sums, follows the
    layout), and out untouched; an odd-aligned result takes the copy and gives them too."""
    if "cupy" not in _kinds():
        pytest.skip("needs CuPy arrays")
    import cupy

    from convcov import _frontend

    rng = np.random.default_rng(12)
    B, Ci, Co, G, H, W, k, s, pd, d = _HOST_CASES[1]
    Ho, Wo = H + 2 * pd[0] - 2, W + 2 * pd[1] - 2
    out = cupy.asarray(rng.normal(size=(B, Co, Ho, Wo, Ho, Wo)), cupy.float32)
    gamma = cupy.asarray(rng.normal(size=(B, Ci, H, W, H, W)), cupy.float32)
    mu, c = cupy.asarray(rng.normal(size=(B, Ci, H, W)), cupy.float32), 0.25
    kept = out.copy()

    def alike(aligned):  # a new array like out: 16-byte aligned, or 4 bytes off
        return (cupy.empty_like(out) if aligned else
                cupy.empty(out.size + 1, out.dtype)[1:].reshape(out.shape))

    for aligned in (True, False):
        want, new = alike(aligned), alike(aligned)
        want[...] = out
        convcov.accumulate(want, gamma, mu, c, k, stride=s, padding=pd, dilation=d, groups=G)
        _frontend.accumulate_apart(new, out, gamma, mu, c, k, s, pd, d, G, None)
        assert bool(cupy.array_equal(new, want)) and bool(cupy.array_equal(out, kept))


#: (k, stride, padding, dilation): 3x3; a row stride; kh = 2, kw = 3 with column dilation.
_PAD_GEOMETRIES = [((3, 3), (1, 1), (1, 1), (1, 1)), ((3, 2), (2, 1), (1, 1), (1, 1)),
                   ((2, 3), (1, 2), (1, 2), (1, 2))]


def _nonfinite_problem(case, geometry, kind, dtype):
    """A problem with padding whose non-finite values sit next to it: for "mu", +Inf at
    mu[0, 0, 0, 0] and -Inf at the last corner of the second batch (every other mu and
    gamma value positive: a term present is finite or the corner's sign, so NaN only
    where +Inf meets -Inf); for "gamma", +Inf at the channel-diagonal's corner pair of
    gamma and NaN at a pair of the last row's ends, and (full gamma) +Inf off the channel
    diagonal, never read. out layouts and gamma forms change with the geometry."""
    k, stride, padding, dilation = _PAD_GEOMETRIES[geometry]
    forms = ([(False, None), (False, "diag"), (True, "full")] if case == "mu" else
             [(False, "diag"), (True, "full"), (False, "full")])
    full_out, gamma = forms[geometry]
    rng = np.random.default_rng(31 + geometry)
    out, g, mu, c, k, conv = _problem(rng, "numpy", ["float64"] * 4, ["contiguous"] * 3,
                                      B=2, Ci=4, Co=4, G=2, H=5, W=6, k=k, stride=stride,
                                      padding=padding, dilation=dilation, full_out=full_out,
                                      gamma=gamma)
    mu[...] = rng.random(mu.shape) + 0.25
    at = (lambda b, ci, p0, p1: (b, ci, *p0, ci, *p1)) if gamma == "full" else (
        lambda b, ci, p0, p1: (b, ci, *p0, *p1))
    if case == "mu":
        mu[0, 0, 0, 0] = np.inf
        mu[1, -1, -1, -1] = -np.inf
    else:
        g[at(0, 1, (0, 0), (0, 0))] = np.inf
        g[at(1, 2, (4, 0), (4, 5))] = np.nan
        if gamma == "full":
            g[0, 0, 0, 0, 1, 0, 0] = np.inf
    arrays = [None if x is None else make(x, kind, dtype) for x in (out, g, mu, c)]
    return (*arrays, k, conv)


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # the reference
@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("case", ["mu", "gamma"])
@pytest.mark.parametrize("forced", PATHS)
def test_nonfinite_next_to_padding_on_host(host_kernels, monkeypatch, forced, case, dtype):
    """SPEC section 1: a term with a position in the padding is absent, not 0 * value, and
    NaN/Inf propagate as IEEE says. Inf and NaN in mu or gamma next to the padding (the
    other values positive), three geometries, each
    path: NaN, +Inf and -Inf exactly where the numpy reference has them, the finite
    values within the tolerance. Loading a padded term's mu (as 0) beside an Inf, or
    adding the box filter's padded terms as 0 * T, gives NaN where the reference has Inf
    or a finite value."""
    _force(monkeypatch, forced)
    for geometry in range(len(_PAD_GEOMETRIES)):
        args = _nonfinite_problem(case, geometry, "numpy", dtype)
        names = []
        _check(*args, exact_nonfinite=True,
               run=lambda a=args, n=names: n.extend(_host_call(host_kernels, *a)))
        _took(names, forced)
        got = to_f64(args[0])
        assert np.isinf(got).any() and np.isfinite(got).any()


@gpu
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
@pytest.mark.parametrize("kind", _kinds())
@pytest.mark.parametrize("case", ["mu", "gamma"])
def test_nonfinite_next_to_padding(path, kind, case):
    """test_nonfinite_next_to_padding_on_host on a GPU (float32)."""
    for geometry in range(len(_PAD_GEOMETRIES)):
        _check(*_nonfinite_problem(case, geometry, kind, "float32"), exact_nonfinite=True)


#: (B, Ci, Co, G, H, W, k, stride, padding, dilation, full out, gamma, dtype): tiny, for
#: the literal loops.
_LOOP_CASES = [
    (1, 2, 2, 1, 4, 5, (3, 3), (1, 1), (1, 1), (1, 1), True, "full", "float64"),
    (1, 4, 4, 2, 5, 4, (2, 2), (2, 1), (0, 1), (1, 2), False, "diag", "float64"),
    (2, 2, 4, 2, 5, 5, (3, 2), (1, 2), (2, 0), (2, 1), False, None, "float64"),
    (1, 3, 3, 3, 4, 4, (1, 3), (1, 1), (0, 1), (1, 1), True, None, "float32"),
    (1, 2, 2, 1, 5, 3, (3, 1), (2, 1), (1, 0), (1, 1), False, "full", "float32"),
    (1, 2, 2, 2, 5, 8, (3, 3), (1, 1), (1, 1), (1, 1), False, "diag", "float64"),
    (1, 2, 4, 2, 4, 16, (3, 3), (2, 2), (1, 1), (1, 1), True, "full", "float32"),
]


def _loops_check(case, kind, run=None):
    """Run the cupy backend (or ``run()``) on _LOOP_CASES[case] and compare with
    kinds.op_loops, the literal float64 loops, not with the numpy backend."""
    from kinds import op_loops

    B, Ci, Co, G, H, W, k, stride, padding, dilation, full_out, gamma, dtype = \
        _LOOP_CASES[case]
    rng = np.random.default_rng(40 + case)
    out, g, mu, c, k, conv = _problem(rng, kind, [dtype] * 4, ["contiguous"] * 3, B=B, Ci=Ci,
                                      Co=Co, G=G, H=H, W=W, k=k, stride=stride,
                                      padding=padding, dilation=dilation, full_out=full_out,
                                      gamma=gamma)
    out0, g64, mu64, c64 = (None if x is None else to_f64(x) for x in (out, g, mu, c))
    want = op_loops(out0, g64, mu64, c64, *k, **conv)
    bound = op_loops(np.abs(out0), None if g64 is None else np.abs(g64), np.abs(mu64),
                     np.abs(c64), *k, **conv)
    if run is None:
        convcov.accumulate(out, g, mu, c, k, backend="cupy", **conv)
    else:
        run(out, g, mu, c, k, conv)
    got = to_f64(out)
    tol = tolerance(bound, 2 * (Ci // G) * k[0] * k[1], dtype, dtype)
    bad = ~(np.abs(got - want) <= tol)
    assert not bad.any(), f"{bad.sum()} of {bad.size} elements off the loops"
    return conv


@pytest.mark.parametrize("case", range(len(_LOOP_CASES)))
@pytest.mark.parametrize("forced", PATHS)
def test_cuda_source_on_host_matches_the_loops(host_kernels, monkeypatch, forced, case):
    """The host build against kinds.op_loops, the literal loops of the seed's op_slow
    (every other test here compares with the numpy backend, which could share a
    misreading of SPEC): stride, padding, dilation, groups, both out layouts, gamma full,
    diagonal and absent, float64 and float32, on each path; off the channel diagonal of
    a full out, the loops leave the values as they were."""
    _force(monkeypatch, forced)
    names = []
    _loops_check(case, "numpy", run=lambda *a: names.extend(_host_call(host_kernels, *a)))
    _took(names, forced)


@gpu
@pytest.mark.parametrize("kind", _kinds())
@pytest.mark.parametrize("case", range(len(_LOOP_CASES)))
def test_matches_the_loops(path, kind, case):
    """test_cuda_source_on_host_matches_the_loops on a GPU."""
    _loops_check(case, kind)


# ------------------------------------------------------------------ the backward
# patch_moment_vjp (docs/autograd.md): the kernels cc_vjp_link, cc_vjp_gamma, cc_vjp_mu,
# on the host build (everywhere) and on a GPU (torch and CuPy arrays), against the numpy
# backend's VJP in float64.
def _vjp_problem(rng, kind, dtypes, layouts, B=2, Ci=4, G=2, H=7, W=6, k=(3, 2),
                 stride=(1, 1), padding=(0, 0), dilation=(1, 1), gamma="diag", want_mu=True):
    """(grad_S, mu, grad_gamma, grad_mu, k, conv); dtypes/layouts: grad_S, mu, grad_gamma,
    grad_mu. The gradients are filled with NaN: every element the backend must write
    shows when it does not (and off the channel-diagonal of a full grad_gamma, they must
    stay NaN)."""
    kh, kw = k
    Ho = (H + 2 * padding[0] - dilation[0] * (kh - 1) - 1) // stride[0] + 1
    Wo = (W + 2 * padding[1] - dilation[1] * (kw - 1) - 1) // stride[1] + 1
    gS = make(rng.standard_normal((B, G, Ho, Wo, Ho, Wo)), kind, dtypes[0], layouts[0], rng)
    mu = make(rng.standard_normal((B, Ci, H, W)), kind, dtypes[1], layouts[1], rng)
    gshape = {"full": (B, Ci, H, W, Ci, H, W), "diag": (B, Ci, H, W, H, W)}.get(gamma)
    gg = None if gshape is None else make(np.full(gshape, np.nan), kind, dtypes[2],
                                          layouts[2], rng)
    gm = make(np.full((B, Ci, H, W), np.nan), kind, dtypes[3], layouts[3], rng) if want_mu \
        else None
    conv = dict(stride=stride, padding=padding, dilation=dilation, groups=G)
    return gS, mu, gg, gm, k, conv


def _vjp_check(gS, mu, gg, gm, k, conv, run, exact_nonfinite=False):
    """Run ``run()`` (which fills gg/gm) and compare with the numpy backend in float64."""
    from convcov import _frontend

    gS64, mu64 = to_f64(gS), to_f64(mu)
    full = gg is not None and len(gg.shape) == 7
    rg = None if gg is None else np.zeros(gg.shape)
    rm = None if gm is None else np.empty(gm.shape)
    bg = None if gg is None else np.zeros(gg.shape)
    bm = None if gm is None else np.empty(gm.shape)
    _frontend.patch_moment_vjp(gS64, mu64, k, grad_gamma=rg, grad_mu=rm, backend="numpy", **conv)
    _frontend.patch_moment_vjp(np.abs(gS64), np.abs(mu64), k, grad_gamma=bg, grad_mu=bm,
                               backend="numpy", **conv)
    run()
    names = [str(x.dtype).split(".")[-1] for x in (gS, mu, gg, gm) if x is not None]
    acc = "float64" if "float64" in names else "float32"
    _, Ci, H, W = mu64.shape
    kh, kw = k
    for got_arr, ref, bound, what, n_terms in ((gg, rg, bg, "grad_gamma", kh * kw),
                                               (gm, rm, bm, "grad_mu", 2 * kh * kw * H * W)):
        if got_arr is None:
            continue
        got = to_f64(got_arr)
        dtype = str(got_arr.dtype).split(".")[-1]
        if full and what == "grad_gamma":  # off the channel diagonal: still NaN
            off = np.ones(got.shape, bool)
            for c in range(Ci):
                off[:, c, :, :, c] = False
            assert np.isnan(got[off]).all(), "wrote off the channel diagonal"
            got, ref, bound = (np.stack([a[:, c, :, :, c] for c in range(Ci)], 1)
                               for a in (got, ref, bound))
        fin = np.isfinite(ref)
        if exact_nonfinite:
            np.testing.assert_array_equal(np.isnan(got), np.isnan(ref), err_msg=what)
            np.testing.assert_array_equal(np.isinf(got), np.isinf(ref), err_msg=what)
            got, ref, bound = got[fin], ref[fin], bound[fin]
        else:
            assert fin.all()
        tol = tolerance(bound, n_terms, acc, dtype)
        bad = ~(np.abs(got - ref) <= tol)
        assert not bad.any(), f"{what}: {bad.sum()} of {bad.size} elements off"


def _run_vjp_on_host(host_kernels, a, sms):
    """The backend's backward plan for the Adjoint a (numpy arrays), on the host build."""
    from convcov.backends import cupy as mod

    plan = _host_backend(sms, host_kernels)._vjp_plan(a, 0)
    scratch = np.full(plan.scratch + 64, np.nan, plan.acc)  # NaN: unwritten reads show
    base = scratch.ctypes.data + (-scratch.ctypes.data) % 256 if plan.scratch else 0
    mod._launch_all(plan, mod._fill(plan, mod._VJP_PTR_SLOTS, mod._vjp_pointers(a, plan, base)))
    return [ln.func.name for ln in plan.launches]


@pytest.fixture
def host_vjp(host_kernels):
    """A registered CPU backend 'cupy_host' whose backward is the cupy backend's plan and
    kernels run on the host build; ``host_vjp(sms)`` sets the pretended device size."""
    from convcov._registry import Backend

    state = {"sms": (4, 256), "launched": []}

    class HostVjp(Backend):
        name, device = "cupy_host", "cpu"

        def accumulate(self, p):  # pragma: no cover - only the backward is used
            raise NotImplementedError

        def patch_moment_vjp(self, a):
            state["launched"] = _run_vjp_on_host(host_kernels, a, state["sms"])

    _registry.register(HostVjp())
    yield state
    _registry.unregister("cupy_host")


def _vjp_on_host(gS, mu, gg, gm, k, conv):
    from convcov import _frontend

    return lambda: _frontend.patch_moment_vjp(gS, mu, k, grad_gamma=gg, grad_mu=gm,
                                              backend="cupy_host", **conv)


_VJP_HOST_CASES = _HOST_CASES + [
    (1, 3, 3, 3, 5, 7, (3, 3), (3, 2), (1, 1), (2, 1)),  # stride > kernel reach, groups
    (2, 4, 4, 1, 4, 4, (4, 4), (1, 1), (3, 3), (1, 1)),  # padding >= kernel - 1
]


@pytest.mark.parametrize("case", range(len(_VJP_HOST_CASES)))
@pytest.mark.parametrize("dtype", ["float32", "float16", "float64"])
@pytest.mark.parametrize("want", [("diag", True), ("full", True), ("diag", False),
                                  (None, True)])
def test_vjp_cuda_source_on_host(host_vjp, case, dtype, want):
    B, Ci, _, G, H, W, k, stride, padding, dilation = _VJP_HOST_CASES[case]
    rng = np.random.default_rng(case)
    args = _vjp_problem(rng, "numpy", [dtype] * 4, ["contiguous"] * 4, B=B, Ci=Ci, G=G, H=H,
                        W=W, k=k, stride=stride, padding=padding, dilation=dilation,
                        gamma=want[0], want_mu=want[1])
    _vjp_check(*args, run=_vjp_on_host(*args))
    names = " ".join(host_vjp["launched"])
    assert ("cc_vjp_mu" in names) == want[1] and "cc_vjp_gamma" in names
    if H * W % 4 == 0 and dtype == "float32":  # contiguous rows: 16-byte stores
        assert "cc_vjp_gamma<float, float, 4>" in names, names


@pytest.mark.parametrize("seed", range(60))
def test_vjp_cuda_source_on_host_random(host_vjp, monkeypatch, seed):
    """Random sizes, conv parameters, dtype mixes, layouts (permuted, strided, expanded
    grad_S with zero strides), misaligned views, and device sizes (channel chunks)."""
    from convcov.backends import cupy as mod

    rng = np.random.default_rng(2000 + seed)
    i = lambda lo, hi: int(rng.integers(lo, hi + 1))  # noqa: E731
    G, kh, kw, dh, dw, ph, pw = i(1, 3), i(1, 3), i(1, 3), i(1, 2), i(1, 2), i(0, 2), i(0, 2)
    span_h, span_w = dh * (kh - 1) + 1, dw * (kw - 1) + 1
    dims = dict(B=i(1, 2), Ci=G * i(1, 10), G=G, H=i(max(1, span_h - 2 * ph), span_h + 6),
                W=i(max(1, span_w - 2 * pw), span_w + 6), k=(kh, kw),
                stride=(i(1, 3), i(1, 3)), padding=(ph, pw), dilation=(dh, dw))
    dts = ["float16", "float32", "float64"]
    dtypes = [dts[i(0, 2)] for _ in range(4)] if rng.random() < 0.5 else [dts[i(0, 2)]] * 4
    lays = ["contiguous", "permuted", "strided"]
    layouts = [lays[i(0, 2)] for _ in range(4)] if rng.random() < 0.6 else ["contiguous"] * 4
    gamma, want_mu = [(None, True), ("full", True), ("diag", True), ("diag", False),
                      ("full", False)][i(0, 4)]
    gS, mu, gg, gm, k, conv = _vjp_problem(rng, "numpy", dtypes, layouts, gamma=gamma,
                                           want_mu=want_mu, **dims)
    if rng.random() < 0.2:  # autograd's expanded gradients: zero strides
        gS = np.broadcast_to(gS[:1, :, :1], gS.shape)
    if gg is not None and rng.random() < 0.2:  # misaligned: one element in
        flat = np.full(gg.size + 1, np.nan, gg.dtype)
        gg = flat[1:].reshape(gg.shape)
    host_vjp["sms"] = [(4, 256), (1, 256), (132, 2048)][i(0, 2)]
    if rng.random() < 0.25:  # the channel-chunk override
        monkeypatch.setattr(mod, "_VJP_CHUNK", i(1, 4))
    _vjp_check(gS, mu, gg, gm, k, conv, run=_vjp_on_host(gS, mu, gg, gm, k, conv))


@pytest.mark.parametrize("dtype", ["float32", "float64", "float16"])
def test_vjp_nonfinite_near_padding_on_host(host_vjp, dtype):
    """NaN/Inf in grad_S and Inf in mu, next to the padding: a term with a padded
    position is absent (skipped, not multiplied by 0), so non-finite values reach exactly
    what they reach in the numpy reference. grad_S positive: per-offset and summed
    products of an Inf then agree."""
    rng = np.random.default_rng(11)
    # Without padding, far-apart positions share no offset: an Inf in mu must not reach
    # them (their D is 0: skipped, not Inf * 0).
    for k, padding, stride in (((3, 3), (1, 1), (1, 1)), ((3, 2), (2, 1), (2, 1)),
                               ((1, 3), (0, 1), (1, 1)), ((3, 3), (0, 0), (1, 1)),
                               ((2, 3), (0, 1), (2, 1)), ((3, 1), (1, 0), (1, 2))):
        gS, mu, gg, gm, k, conv = _vjp_problem(rng, "numpy", [dtype] * 4, ["contiguous"] * 4,
                                               B=1, Ci=2, G=1, H=5, W=6, k=k, padding=padding,
                                               stride=stride, gamma="diag")
        gS[...] = rng.random(gS.shape) + 0.25
        gS[0, 0, 0, 0, 0, -1] = np.nan  # a corner pair: some of its offsets are padding
        gS[0, 0, -1, 0, 0, 1] = np.inf
        mu[0, 1, 0, 0] = np.inf  # a corner input
        mu[0, 0, -1, 2] = -np.inf
        _vjp_check(gS, mu, gg, gm, k, conv, run=_vjp_on_host(gS, mu, gg, gm, k, conv),
                   exact_nonfinite=True)


def test_vjp_absent_terms_example_on_host(host_vjp):
    """docs/autograd.md's example (tests/kinds.py), through the cupy kernels."""
    check_absent_terms_in_the_backward("cupy_host")


# ------------------------------------------------------------------ the backward on a GPU
def _vjp_on_gpu(gS, mu, gg, gm, k, conv):
    from convcov import _frontend

    return lambda: _frontend.patch_moment_vjp(gS, mu, k, grad_gamma=gg, grad_mu=gm,
                                              backend="cupy", **conv)


@gpu
@pytest.mark.parametrize("kind", _kinds())
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16", "float64"])
@pytest.mark.parametrize("conv", range(len(CONV)))
@pytest.mark.parametrize("want", [("diag", True), ("full", True), ("diag", False), (None, True)])
def test_vjp_matches_numpy(kind, dtype, conv, want):
    if dtype == "bfloat16" and kind != "torch_cuda":
        pytest.skip("bfloat16 arrays come from torch")
    dims = {k: v for k, v in CONV[conv].items() if k != "Co"}
    rng = np.random.default_rng(hash((kind, dtype, conv, want)) % 2**32)
    args = _vjp_problem(rng, kind, [dtype] * 4, ["contiguous"] * 4, gamma=want[0],
                        want_mu=want[1], **dims)
    _vjp_check(*args, run=_vjp_on_gpu(*args))


@gpu
@pytest.mark.parametrize("kind", _kinds())
@pytest.mark.parametrize("seed", range(12))
def test_vjp_views_dtypes_and_chunks(kind, seed, monkeypatch):
    """Permuted/strided views, mixed dtypes, zero-stride grad_S, misaligned grad_gamma,
    and (odd seeds) a pretended one-multiprocessor device: channel chunks."""
    import_torch = kind == "torch_cuda"
    rng = np.random.default_rng(3000 + seed)
    dts = ["float16", "float32", "float64"] + (["bfloat16"] if import_torch else [])
    dtypes = [dts[int(rng.integers(len(dts)))] for _ in range(4)]
    lays = ["contiguous", "permuted", "strided"]
    layouts = [lays[int(rng.integers(3))] for _ in range(4)]
    gamma = ["full", "diag", None][seed % 3]
    dims = {name: v for name, v in CONV[1 + seed % 2].items() if name != "Co"}
    gS, mu, gg, gm, k, conv = _vjp_problem(rng, kind, dtypes, layouts, gamma=gamma, **dims)
    if seed % 4 == 1:  # autograd's expanded gradients: zero strides
        if import_torch:
            gS = gS[:1].expand(gS.shape)
        else:
            import cupy

            gS = cupy.broadcast_to(gS[:1], gS.shape)
    if seed % 2:
        monkeypatch.setattr(BACKEND, "_sm_threads", lambda dev: (1, 256))
    BACKEND._plans.clear()
    try:
        _vjp_check(gS, mu, gg, gm, k, conv, run=_vjp_on_gpu(gS, mu, gg, gm, k, conv))
    finally:
        BACKEND._plans.clear()


@gpu
@need_torch
def test_vjp_runs_on_the_current_torch_stream():
    """grad_S is filled on a side stream behind ~10 ms of sleep; the backward, called on
    that stream, must see it."""
    import torch

    rng = np.random.default_rng(12)
    gS, mu, gg, gm, k, conv = _vjp_problem(rng, "torch_cuda", ["float32"] * 4,
                                           ["contiguous"] * 4, gamma="full")
    want_gg, want_gm = torch.zeros_like(gg), torch.empty_like(gm)
    _vjp_on_gpu(gS, mu, want_gg, want_gm, k, conv)()
    torch.cuda.synchronize()
    src = gS.clone()
    gg.zero_()
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        gS.zero_()
        torch.cuda._sleep(20_000_000)
        gS.copy_(src)
        _vjp_on_gpu(gS, mu, gg, gm, k, conv)()
        got_gg, got_gm = gg.clone(), gm.clone()
    side.synchronize()
    torch.testing.assert_close(got_gg, want_gg, rtol=0, atol=0)
    torch.testing.assert_close(got_gm, want_gm, rtol=0, atol=0)


@gpu
def test_vjp_runs_on_the_current_cupy_stream():
    import cupy

    spin = cupy.RawKernel(r'''extern "C" __global__ void spin(long long n) {
        long long t0 = clock64(); while (clock64() - t0 < n) {} }''', "spin")
    rng = np.random.default_rng(13)
    gS, mu, gg, gm, k, conv = _vjp_problem(rng, "cupy", ["float32"] * 4, ["contiguous"] * 4)
    want_gg, want_gm = cupy.empty_like(gg), cupy.empty_like(gm)
    _vjp_on_gpu(gS, mu, want_gg, want_gm, k, conv)()
    cupy.cuda.Device().synchronize()
    src = gS.copy()
    with cupy.cuda.Stream(non_blocking=True) as side:
        gS.fill(0)
        spin((1,), (1,), (np.int64(20_000_000),))
        gS[...] = src
        _vjp_on_gpu(gS, mu, gg, gm, k, conv)()
        got_gg, got_gm = gg.copy(), gm.copy()
    side.synchronize()
    np.testing.assert_array_equal(cupy.asnumpy(got_gg), cupy.asnumpy(want_gg))
    np.testing.assert_array_equal(cupy.asnumpy(got_gm), cupy.asnumpy(want_gm))


# CUDA-graph capture of forward + backward: tests/test_autograd.py::test_cuda_graph_capture


@gpu
@need_torch
def test_vjp_threads_at_once():
    """8 threads, each its own problem, dtype and torch stream, 10 backward calls each."""
    import torch

    rng = np.random.default_rng(14)
    jobs, expected = [], []
    for i in range(8):
        dtype = ["float32", "float16", "bfloat16", "float64"][i % 4]
        dims = {k: v for k, v in CONV[i % len(CONV)].items() if k != "Co"}
        jobs.append(_vjp_problem(rng, "torch_cuda", [dtype] * 4, ["contiguous"] * 4,
                                 gamma=["full", "diag", None][i % 3], **dims))
    for gS, mu, gg, gm, k, conv in jobs:
        e = (None if gg is None else gg.clone(), gm.clone())
        _vjp_on_gpu(gS, mu, *e, k, conv)()
        expected.append(e)
    torch.cuda.synchronize()

    def work(i, start):
        gS, mu, gg, gm, k, conv = jobs[i]
        stream = torch.cuda.Stream() if i % 2 else torch.cuda.current_stream()
        start()
        with torch.cuda.stream(stream):
            for _ in range(10):
                _vjp_on_gpu(gS, mu, gg, gm, k, conv)()
        stream.synchronize()
        for got, want in zip((gg, gm), expected[i]):
            assert got is None or torch.equal(got.nan_to_num(7.0), want.nan_to_num(7.0)), \
                "wrong result"

    at_once(len(jobs), work)


def test_many_output_channels_a_group_on_host(host_kernels):
    """A group of more output channels than a quarter of the walk's shared memory holds
    values of c (12,300 in float32), with out's rows (i1, j1) not contiguous (so c * S goes
    straight into out, not through S): c is read where it is used, the launch asks for no
    more than CUDA's 48 KiB of shared memory (_HostKernel checks it), and the result is
    the reference's."""
    rng = np.random.default_rng(7)
    Co = 12300
    out = rng.random((1, Co, 2, 2, 2, 4), np.float32)[..., ::2]
    mu = rng.random((1, 1, 2, 2), np.float32)
    c = rng.random(Co, np.float32)
    conv = dict(stride=1, padding=0, dilation=1, groups=1)
    names = []
    _check(out, None, mu, c, (1, 1), conv,
           run=lambda: names.extend(_host_call(host_kernels, out, None, mu, c, (1, 1), conv)))
    assert [n.split("<")[0] for n in names] == ["cc_walk"], names
