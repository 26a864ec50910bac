"""Generic CUDA arrays (``__cuda_array_interface__`` v3 producers other than torch and CuPy,
numba device arrays among them), on every CUDA backend: the streams they name and the
device they live on.

The arrays are CuPy's memory seen through a wrapper that exports only the interface, so a
test can say which stream the producer's pending work is on. Needs a GPU and CuPy; skips
otherwise (the host-side choices are in test_dispatch.py).
"""

from __future__ import annotations

import numpy as np
import pytest

import convcov
from convcov import _arrays
from kinds import beside_a_capture, has_cupy_gpu, to_f64

if not has_cupy_gpu():
    pytest.skip("needs CuPy and a CUDA device", allow_module_level=True)

import cupy

BACKENDS = [b.name for b in convcov.backends() if b.device == "cuda" and b.available]
backend_names = pytest.mark.parametrize("backend", BACKENDS)

#: A kernel that holds its stream for ``n`` clock cycles (20e6: about 10 ms on an H200):
#: whatever is queued behind it on that stream runs late, so a consumer that does not wait
#: for the stream reads the memory before it is written.
_SPIN = r'''extern "C" __global__ void spin(long long n) {
    long long t0 = clock64(); while (clock64() - t0 < n) {} }'''


@pytest.fixture(params=["fused", "stream"])
def path(request, monkeypatch):
    """Force, in both CUDA backends, one launch with no scratch memory (``fused``) or two
    launches with S in scratch memory (``stream``)."""
    from convcov import _frontend, _registry
    from convcov.backends import _plan
    from convcov.backends import numba_cuda as numba_cuda_mod

    # both: c * S straight into out, or S written, then out streamed
    monkeypatch.setattr(_plan, "STREAM_BYTES", 1 << 60 if request.param == "fused" else 0)
    # plans and bound launchers remember the path chosen
    monkeypatch.setattr(_registry.get("cupy"), "_plans", {})
    monkeypatch.setattr(numba_cuda_mod, "_plans", {})
    monkeypatch.setattr(_frontend, "_bound", {})
    return request.param


class Foreign:
    """A CUDA array known only by its ``__cuda_array_interface__``, naming ``stream`` (a
    raw handle, or None for "nothing pending")."""

    def __init__(self, a, stream):
        self.base = a  # keeps the memory alive
        cai = dict(a.__cuda_array_interface__)
        cai["stream"] = stream
        self.__cuda_array_interface__ = cai


def _problem(seed=3):
    """A full-layout out with groups, stride and padding; its expected result (float64)."""
    rng = np.random.default_rng(seed)
    B, Ci, Co, H, W, G = 2, 4, 6, 9, 8, 2
    conv = {"stride": (2, 1), "padding": (1, 1), "dilation": 1, "groups": G}
    Ho, Wo = (H + 2 - 3) // 2 + 1, W
    out = rng.standard_normal((B, Co, Ho, Wo, Co, Ho, Wo)).astype(np.float32)
    gamma = rng.standard_normal((B, Ci, H, W, Ci, H, W)).astype(np.float32)
    mu = rng.standard_normal((B, Ci, H, W)).astype(np.float32)
    c = rng.standard_normal(Co).astype(np.float32)
    want = to_f64(out).copy()
    convcov.accumulate(want, to_f64(gamma), to_f64(mu), to_f64(c), 3, backend="numpy",
                       **conv)
    return out, gamma, mu, c, conv, want


def _warm(backend, out, g, mu, c, conv):
    """One call of this signature on copies, waited for: the plan is compiled and loaded,
    so the calls under test launch at once, while the spin still holds its stream (a
    first call's compilation would outlast the spin and hide a missing wait)."""
    scratch = [Foreign(a.copy(), None) for a in (out, g, mu, c)]
    convcov.accumulate(*scratch, 3, backend=backend, **conv)
    cupy.cuda.Device().synchronize()


def _filled_late(a):
    """Zero ``a``, then give it back its values on a new non-blocking stream, behind a
    spin; that stream."""
    src = a.copy()
    a.fill(0)
    cupy.cuda.Device().synchronize()
    side = cupy.cuda.Stream(non_blocking=True)
    with side:
        cupy.RawKernel(_SPIN, "spin")((1,), (1,), (np.int64(20_000_000),))
        a[...] = src
    return side


def _close(got, want):
    np.testing.assert_allclose(to_f64(cupy.asnumpy(got)), want, rtol=2e-5,
                               atol=2e-5 * np.abs(want).max())


@backend_names
def test_launches_on_the_stream_out_names(backend, path):
    """out is filled on a non-blocking stream behind a spin, and its interface names that
    stream: the call must queue behind the fill, and a copy queued on that stream after
    the call must see the result. On the legacy default stream (which does not wait for
    non-blocking streams) it would read out before the fill."""
    out_h, gamma_h, mu_h, c_h, conv, want = _problem()
    out, g, mu, c = (cupy.asarray(a) for a in (out_h, gamma_h, mu_h, c_h))
    _warm(backend, out, g, mu, c, conv)
    side = _filled_late(out)
    # CuPy's current stream is the null stream here: only the interface names `side`.
    convcov.accumulate(*(Foreign(a, side.ptr) for a in (out, g, mu, c)), 3, backend=backend,
                       **conv)
    with side:
        got = out.copy()
    side.synchronize()
    _close(got, want)


@backend_names
def test_waits_for_the_streams_inputs_name(backend, path):
    """mu is written on a non-blocking stream behind a spin, and only mu's interface
    names that stream; out names none (launch on the legacy default stream). The call
    must wait for mu's stream (an event), not read mu before it is written."""
    out_h, gamma_h, mu_h, c_h, conv, want = _problem(4)
    out, g, mu, c = (cupy.asarray(a) for a in (out_h, gamma_h, mu_h, c_h))
    _warm(backend, out, g, mu, c, conv)
    side = _filled_late(mu)
    convcov.accumulate(Foreign(out, None), Foreign(g, None), Foreign(mu, side.ptr),
                       Foreign(c, None), 3, backend=backend, **conv)
    cupy.cuda.Device().synchronize()
    _close(out, want)


@backend_names
def test_device_of_an_array_that_names_none(backend):
    """An interface carries no device: the driver's record of the address gives it
    (``_arrays.pointer_device``), so such an array can be mixed with numba device arrays
    (which record theirs) without a false "different devices" error."""
    ncuda = pytest.importorskip("numba.cuda")
    out_h, gamma_h, mu_h, c_h, conv, want = _problem(5)
    dev = cupy.cuda.Device().id
    out = cupy.asarray(out_h)
    assert _arrays.info(Foreign(out, None), "out").device == ("cuda", dev)
    with ncuda.gpus[dev]:
        g, mu, c = (ncuda.to_device(a) for a in (gamma_h, mu_h, c_h))
    convcov.accumulate(Foreign(out, None), g, mu, c, 3, backend=backend, **conv)
    cupy.cuda.Device().synchronize()
    _close(out, want)
    # An empty out (Co = 0) may have no address for the driver to place: a no-op, not a
    # "different devices" error against mu's known device.
    empty = Foreign(cupy.zeros((2, 0, 5, 8, 5, 8), np.float32), None)
    convcov.accumulate(empty, None, mu, 1.0, 3, backend=backend, **conv)


def _current_context():
    """The CUDA context current on this thread (0: none), from the driver (cuda-python)."""
    driver = pytest.importorskip("cuda.bindings.driver")
    err, ctx = driver.cuCtxGetCurrent()
    assert err == driver.CUresult.CUDA_SUCCESS, err
    return 0 if ctx is None else int(ctx)


@backend_names
def test_arrays_that_name_no_device_from_a_fresh_thread(backend):
    """A thread that has made no CUDA call has no current context. The driver still says
    where an address lives there (``_arrays.pointer_device``, not None: None would fall
    back to the current device, wrong for memory on another GPU), and a whole call on such
    arrays from that thread is correct."""
    import threading

    out_h, gamma_h, mu_h, c_h, conv, want = _problem(10)
    out, g, mu, c = (cupy.asarray(a) for a in (out_h, gamma_h, mu_h, c_h))
    dev = cupy.cuda.Device().id
    _warm(backend, out, g, mu, c, conv)
    seen, errors = {}, []

    def fresh():
        try:
            seen["context before"] = _current_context()
            seen["device"] = _arrays.pointer_device(out.data.ptr)
            convcov.accumulate(*(Foreign(a, None) for a in (out, g, mu, c)), 3,
                               backend=backend, **conv)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    t = threading.Thread(target=fresh)
    t.start()
    t.join()
    assert not errors, errors
    assert seen == {"context before": 0, "device": dev}
    cupy.cuda.Device().synchronize()
    _close(out, want)


@backend_names
def test_patch_moment_of_numba_arrays_on_a_stream(backend):
    """S of numba device arrays that live on a non-blocking stream (copied there behind a
    spin) is allocated on that stream: its interface names the stream, the launch goes
    there after the copies, and a copy queued there next sees S."""
    ncuda = pytest.importorskip("numba.cuda")
    rng = np.random.default_rng(7)
    gamma_h = rng.standard_normal((2, 4, 6, 5, 6, 5)).astype(np.float32)
    mu_h = rng.standard_normal((2, 4, 6, 5)).astype(np.float32)
    conv = {"stride": (2, 1), "padding": (1, 1), "groups": 2}
    want = convcov.patch_moment(gamma_h.astype(np.float64), mu_h.astype(np.float64), 3,
                                backend="numpy", **conv)
    convcov.patch_moment(ncuda.to_device(gamma_h), ncuda.to_device(mu_h), 3,
                         backend=backend, **conv)  # warm: compiled and loaded
    cupy.cuda.Device().synchronize()
    side = cupy.cuda.Stream(non_blocking=True)
    stream = ncuda.external_stream(side.ptr)
    with side:
        cupy.RawKernel(_SPIN, "spin")((1,), (1,), (np.int64(20_000_000),))
    g, mu = ncuda.to_device(gamma_h, stream=stream), ncuda.to_device(mu_h, stream=stream)
    S = convcov.patch_moment(g, mu, 3, backend=backend, **conv)
    assert S.__cuda_array_interface__["stream"] == side.ptr
    got = S.copy_to_host(stream=stream)
    side.synchronize()
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


@backend_names
def test_a_stream_being_captured_is_refused(backend, path):
    """A CUDA graph would outlive the call's scratch memory: a call whose arrays name a
    stream being captured is refused, before anything is queued."""
    out_h, gamma_h, mu_h, c_h, conv, _ = _problem(8)
    out, g, mu, c = (cupy.asarray(a) for a in (out_h, gamma_h, mu_h, c_h))
    _warm(backend, out, g, mu, c, conv)
    side = cupy.cuda.Stream(non_blocking=True)
    with side:
        side.begin_capture()
        try:
            with pytest.raises(convcov.BackendError, match="being captured into a CUDA graph"):
                convcov.accumulate(*(Foreign(a, side.ptr) for a in (out, g, mu, c)), 3,
                                   backend=backend, **conv)
        finally:
            graph = side.end_capture()
    del graph
    np.testing.assert_array_equal(cupy.asnumpy(out), out_h)


@backend_names
@pytest.mark.parametrize("path", ["fused"], indirect=True)
def test_first_call_beside_a_global_capture(backend, path, monkeypatch):
    """Another thread captures a CUDA graph in global mode (torch.cuda.graph's default:
    while it captures, a potentially unsafe CUDA call from any thread in the default mode
    fails and invalidates that capture) while this thread makes its first call of a
    signature, so that the backend compiles and loads its kernels then. Both must work.
    One launch with no scratch: CuPy arrays made beforehand, on a stream of this thread
    (an allocation would be the array library's business)."""
    from convcov import _registry
    from convcov.backends import numba_cuda as numba_cuda_mod

    cupy_backend = _registry.get("cupy")
    for name in ("_modules", "_functions"):  # the kernels are loaded afresh
        monkeypatch.setattr(cupy_backend, name, {})
    monkeypatch.setattr(numba_cuda_mod, "_compiled", {})
    out_h, gamma_h, mu_h, c_h, conv, want = _problem(11)
    out, g, mu, c = (cupy.asarray(a) for a in (out_h, gamma_h, mu_h, c_h))
    x = cupy.arange(4096, dtype=cupy.float32)
    y = cupy.zeros_like(x)
    rt = cupy.cuda.runtime
    graphs = []
    cupy.cuda.Device().synchronize()

    def capture(hold):
        cs = cupy.cuda.Stream(non_blocking=True)
        rt.streamBeginCapture(cs.ptr, rt.streamCaptureModeGlobal)
        try:
            with cs:
                y[...] = x
                y[...] *= 2
            hold()
        finally:
            graphs.append(rt.streamEndCapture(cs.ptr))  # raises if invalidated
        exe = rt.graphInstantiate(graphs[0])
        rt.graphLaunch(exe, cs.ptr)
        cs.synchronize()
        rt.graphExecDestroy(exe)

    mine = cupy.cuda.Stream(non_blocking=True)

    def work():
        with mine:
            convcov.accumulate(out, g, mu, c, 3, backend=backend, **conv)

    errors = beside_a_capture(capture, work)
    mine.synchronize()
    for graph in graphs:
        rt.graphDestroy(graph)
    assert not errors, errors
    np.testing.assert_array_equal(cupy.asnumpy(y), 2 * cupy.asnumpy(x))
    _close(out, want)


@backend_names
def test_backward_orders_both_gradients_streams(backend):
    """The backward writes two arrays. grad_gamma names a stream held by a spin (the
    launch goes there, behind it) and grad_mu names another, idle one: a copy queued on
    grad_mu's stream after the call must wait for the launches, not read grad_mu before
    it is written."""
    from convcov._frontend import patch_moment_vjp

    rng = np.random.default_rng(12)
    B, Ci, H, W, G = 2, 4, 7, 6, 2
    conv = {"stride": (2, 1), "padding": (1, 0), "groups": G}
    Ho, Wo = (H + 2 - 3) // 2 + 1, W - 2
    grad_S_h = rng.standard_normal((B, G, Ho, Wo, Ho, Wo)).astype(np.float32)
    mu_h = rng.standard_normal((B, Ci, H, W)).astype(np.float32)
    want_gg, want_gm = np.empty((B, Ci, H, W, H, W)), np.empty((B, Ci, H, W))
    patch_moment_vjp(to_f64(grad_S_h), to_f64(mu_h), 3, grad_gamma=want_gg,
                     grad_mu=want_gm, backend="numpy", **conv)
    grad_S, mu = cupy.asarray(grad_S_h), cupy.asarray(mu_h)
    gg = cupy.full(want_gg.shape, np.nan, np.float32)
    gm = cupy.full(want_gm.shape, np.nan, np.float32)
    patch_moment_vjp(grad_S, mu, 3, grad_gamma=gg.copy(), grad_mu=gm.copy(),
                     backend=backend, **conv)  # warm: compiled and loaded
    cupy.cuda.Device().synchronize()
    held, idle = cupy.cuda.Stream(non_blocking=True), cupy.cuda.Stream(non_blocking=True)
    with held:
        cupy.RawKernel(_SPIN, "spin")((1,), (1,), (np.int64(20_000_000),))
    patch_moment_vjp(Foreign(grad_S, None), Foreign(mu, None), 3,
                     grad_gamma=Foreign(gg, held.ptr), grad_mu=Foreign(gm, idle.ptr),
                     backend=backend, **conv)
    with idle:
        got_gm = gm.copy()
    idle.synchronize()
    np.testing.assert_allclose(to_f64(cupy.asnumpy(got_gm)), want_gm, rtol=2e-5,
                               atol=2e-5 * np.abs(want_gm).max())
    held.synchronize()
    np.testing.assert_allclose(to_f64(cupy.asnumpy(gg)), want_gg, rtol=2e-5,
                               atol=2e-5 * np.abs(want_gg).max())


@pytest.mark.parametrize("path", ["stream"], indirect=True)
def test_cupy_scratch_comes_from_one_pool_arena(path):
    """Calls on generic CUDA arrays that name a new stream each time take the cupy
    backend's scratch from the arena of CuPy's current stream (ordered by events), so
    CuPy's pool does not grow by one arena per stream."""
    if "cupy" not in BACKENDS:
        pytest.skip("the cupy backend is not available")
    out_h, gamma_h, mu_h, c_h, conv, _ = _problem(9)
    out, g, mu, c = (cupy.asarray(a) for a in (out_h, gamma_h, mu_h, c_h))
    _warm("cupy", out, g, mu, c, conv)
    from convcov.backends import cupy as cupy_mod

    assert all(plan.scratch for plan in cupy_mod.backend._plans.values())  # T and S
    pool = cupy.get_default_memory_pool()
    before = pool.total_bytes()
    streams = []
    for _ in range(6):
        streams.append(cupy.cuda.Stream(non_blocking=True))
        convcov.accumulate(*(Foreign(a, streams[-1].ptr) for a in (out, g, mu, c)), 3,
                           backend="cupy", **conv)
    cupy.cuda.Device().synchronize()
    assert pool.total_bytes() == before


@backend_names
def test_second_gpu_array_that_names_no_device(backend):
    """Memory on the second GPU, seen through the interface alone, is computed there while
    the first GPU is current."""
    if cupy.cuda.runtime.getDeviceCount() < 2:
        pytest.skip("one CUDA device")
    out_h, gamma_h, mu_h, c_h, conv, want = _problem(6)
    with cupy.cuda.Device(1):
        out, g, mu, c = (cupy.asarray(a) for a in (out_h, gamma_h, mu_h, c_h))
    assert _arrays.info(Foreign(out, None), "out").device == ("cuda", 1)
    with cupy.cuda.Device(0):
        convcov.accumulate(*(Foreign(a, None) for a in (out, g, mu, c)), 3, backend=backend,
                           **conv)
    with cupy.cuda.Device(1):
        cupy.cuda.Device().synchronize()
        _close(out, want)


@backend_names
def test_a_stream_of_another_device_is_refused(backend):
    """Arrays on the first GPU whose interface names a stream of the second: a TypeError
    that says so, before anything is queued, out unchanged. (Before, numba_cuda launched
    on that stream, on the second GPU with the first's addresses, and returned; cupy
    failed with CUDA's "invalid resource handle".) The first GPU's own streams pass."""
    if cupy.cuda.runtime.getDeviceCount() < 2:
        pytest.skip("one CUDA device")
    out_h, gamma_h, mu_h, c_h, conv, want = _problem(11)
    with cupy.cuda.Device(0):
        out, g, mu, c = (cupy.asarray(a) for a in (out_h, gamma_h, mu_h, c_h))
        own = cupy.cuda.Stream(non_blocking=True)
    with cupy.cuda.Device(1):
        other = cupy.cuda.Stream(non_blocking=True)
    assert _arrays.stream_device(other.ptr) == 1 and _arrays.stream_device(own.ptr) == 0
    for bad in ("out", "mu"):
        named = {n: (other.ptr if n == bad else None) for n in ("out", "gamma", "mu", "c")}
        with cupy.cuda.Device(0), pytest.raises(
                TypeError, match=rf"{bad}: its __cuda_array_interface__ names stream "
                rf"{other.ptr:#x}, which belongs to cuda:1; the arrays are on cuda:0"):
            convcov.accumulate(*(Foreign(a, named[n]) for n, a in
                                 zip(("out", "gamma", "mu", "c"), (out, g, mu, c))), 3,
                               backend=backend, **conv)
    with cupy.cuda.Device(0):
        cupy.cuda.Device().synchronize()
        np.testing.assert_array_equal(cupy.asnumpy(out), out_h)
        convcov.accumulate(*(Foreign(a, own.ptr) for a in (out, g, mu, c)), 3,
                           backend=backend, **conv)
        own.synchronize()
        _close(out, want)
    with cupy.cuda.Device(1):
        cupy.cuda.Device().synchronize()  # the second GPU is unharmed
