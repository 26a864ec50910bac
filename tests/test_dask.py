"""convcov on dask arrays (SPEC section 7, docs/dask.md).

Every result is compared with the direct call twice: bit for bit with direct calls on the
same chunks (the batch chunks and out's channel chunks the graph is made of), and within
the dtype's error bound with one direct call on the whole batch; on the threaded scheduler
and on a two-process ``distributed.LocalCluster``. Bad calls raise what the direct call
raises while the graph is built (a scheduler that fails if called proves nothing ran).
The cluster survives a worker killed mid-computation, and streams inputs four times its
memory limit with every worker's peak RSS below that limit. CuPy chunks run where CuPy
has a GPU.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
import time
import warnings

import numpy as np
import pytest

da = pytest.importorskip("dask.array")
distributed = pytest.importorskip("distributed")
import cloudpickle  # noqa: E402  (a dependency of dask)
import dask  # noqa: E402

import convcov  # noqa: E402
from convcov import ChunkWarning  # noqa: E402

from kinds import has_cupy_gpu, tolerance  # noqa: E402

# The workers run this module's helpers (_die_once, the RSS sampler): they cannot import
# it (tests/ is not on their path), so it travels by value.
cloudpickle.register_pickle_by_value(sys.modules[__name__])

LIMIT = 512 * 2**20  # each worker's memory limit


def _warm():
    """The numba kernels, compiled or loaded here first: the workers then load them from
    Numba's disk cache instead of compiling (tens of seconds on a 2-core machine)."""
    for dt in (np.float32, np.float64):
        convcov.accumulate(np.zeros((1, 2, 2, 2, 2, 2), dt), None, np.ones((1, 2, 4, 4), dt),
                           1.0, 3)


@pytest.fixture(scope="module")
def client():
    _warm()
    with distributed.LocalCluster(n_workers=2, processes=True, threads_per_worker=1,
                                  memory_limit=LIMIT, dashboard_address=None) as cluster, \
            distributed.Client(cluster) as c:
        yield c


def _forbidden(*args, **kwargs):
    raise AssertionError("something was computed")


def _bounds(chunks):
    e = np.cumsum((0,) + tuple(chunks)).tolist()
    return list(zip(e[:-1], e[1:]))


def _sel(ndim, b, ch):
    """Index of batch range b and channel range ch on both channel axes of a 7-d array."""
    b, ch = slice(*b), slice(*ch)
    return (b, ch, slice(None), slice(None), ch) if ndim == 7 else (b, ch)


def direct_on_chunks(out, gamma, mu, c, k, batch, out_c0_chunks, conv):
    """The direct calls the graph is made of: per batch chunk and per channel chunk of out
    (edges moved down to group boundaries), each on a copy of out's block."""
    G = conv.get("groups", 1)
    Co, Ci = out.shape[1], mu.shape[1]
    po, pi = Co // G, Ci // G
    edges = sorted({e // po * po for e in np.cumsum((0,) + out_c0_chunks).tolist()} | {Co})
    res = out.copy()
    for b in _bounds(batch):
        for a, e in zip(edges[:-1], edges[1:]):
            lo, hi = a // po * pi, e // po * pi
            blk = res[_sel(out.ndim, b, (a, e))].copy()
            g = None if gamma is None else gamma[_sel(gamma.ndim, b, (lo, hi))]
            cc = c[a:e] if getattr(c, "ndim", 0) == 1 else c
            convcov.accumulate(blk, g, mu[b[0]:b[1], lo:hi], cc, k,
                               **{**conv, "groups": (e - a) // po})
            res[_sel(out.ndim, b, (a, e))] = blk
    return res


def _dask(x, chunks):
    return da.from_array(x, chunks=tuple(chunks) + (-1,) * (x.ndim - len(chunks)))


def _grid(H, k, conv):
    def one(v, i):
        return v[i] if isinstance(v, tuple) else v
    s, p, d = (conv.get(n, dflt) for n, dflt in (("stride", 1), ("padding", 0),
                                                ("dilation", 1)))
    return tuple((H + 2 * one(p, i) - one(d, i) * (k - 1) - 1) // one(s, i) + 1
                 for i in (0, 1))


def problem(case, seed=0):
    """numpy arrays of a case: (out, gamma, mu, c)."""
    rng = np.random.default_rng(seed)
    B, Ci, Co, H, k = 4, case["Ci"], case["Co"], case["H"], case["k"]
    Ho, Wo = _grid(H, k, case["conv"])
    dt = case.get("dtypes", {})
    full = (Co,) if case["out"] == "full" else ()
    out = rng.random((B, Co, Ho, Wo) + full + (Ho, Wo)).astype(dt.get("out", np.float32))
    mu = rng.random((B, Ci, H, H)).astype(dt.get("mu", np.float32))
    gamma = None
    if case["gamma"]:
        gfull = (Ci,) if case["gamma"] == "full" else ()
        gamma = rng.random((B, Ci, H, H) + gfull + (H, H)).astype(dt.get("gamma", np.float32))
    c = {"number": 0.3, "0d": np.array(0.7, np.float32)}.get(case["c"])
    if c is None:
        c = rng.random(Co).astype(np.float32)
    return out, gamma, mu, c


CASES = [
    dict(id="diag-diag-groups2-channel-chunks", out="diag", gamma="diag", Ci=4, Co=6, H=6, k=3,
         conv=dict(padding=1, groups=2), c="vector",
         chunks=dict(out=(2, 3), gamma=(2, 2), mu=(2, 2)), warn=False),
    dict(id="full-full-stride2-dilation2", out="full", gamma="full", Ci=3, Co=4, H=7, k=3,
         conv=dict(stride=2, padding=1, dilation=2), c="number",
         chunks=dict(out=(1,), gamma=(2,), mu=(4,)), warn=False),
    dict(id="diag-none-depthwise-dask-c", out="diag", gamma=None, Ci=6, Co=6, H=5, k=3,
         conv=dict(padding=1, groups=6), c="dask",
         chunks=dict(out=(1, 2), mu=(2, 3), c=(4,)), warn=False),
    dict(id="diag-diag-groups1-channels-merged", out="diag", gamma="diag", Ci=4, Co=4, H=5,
         k=3, conv=dict(padding=1), c="vector",
         chunks=dict(out=(2, 2), gamma=(2,), mu=(2,)), warn=True),
    dict(id="full-diag-second-channel-axis-rechunked", out="full", gamma="diag", Ci=4, Co=6,
         H=5, k=3, conv=dict(padding=1, groups=2), c="0d",
         chunks=dict(out=(4, 3, -1, -1, 2), gamma=(4,), mu=(4,)), warn=True),
    dict(id="spatial-chunks-merged", out="diag", gamma="diag", Ci=2, Co=2, H=6, k=2,
         conv=dict(stride=(1, 2)), c="vector",
         chunks=dict(out=(2, -1, 2), gamma=(2, -1, 3, -1, 3), mu=(2, -1, 3)), warn=True),
    dict(id="mixed-dtypes-uneven-batch", out="diag", gamma="diag", Ci=2, Co=3, H=6, k=3,
         conv=dict(padding=(1, 0), dilation=(1, 2)), c="vector",
         dtypes=dict(out=np.float64, gamma=np.float32, mu=np.float16),
         chunks=dict(out=(3,), gamma=(3,), mu=(3,)), warn=False),
    dict(id="full-none-groups2-offdiagonal-blocks", out="full", gamma=None, Ci=2, Co=4, H=5,
         k=3, conv=dict(padding=1, groups=2), c="number",
         chunks=dict(out=(2, 2, -1, -1, 2)), warn=False),
]


@pytest.mark.parametrize("case", CASES, ids=[c["id"] for c in CASES])
def test_accumulate_equals_direct_calls(case, client):
    out, gamma, mu, c = problem(case)
    saved = out.copy()
    ch = case["chunks"]
    d_out, d_mu = _dask(out, ch["out"]), _dask(mu, ch["mu"] if "mu" in ch else (2,))
    d_gamma = None if gamma is None else _dask(gamma, ch["gamma"])
    d_c = _dask(c, ch["c"]) if case["c"] == "dask" else c
    k, conv = case["k"], case["conv"]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        r = convcov.accumulate(d_out, d_gamma, d_mu, d_c, k, **conv)
    assert any(issubclass(w.category, ChunkWarning) for w in caught) == case["warn"]
    assert isinstance(r, da.Array) and r.shape == out.shape and r.dtype == out.dtype
    batch = max((a for a in (d_out, d_gamma, d_mu) if a is not None),
                key=lambda a: a.nbytes).chunks[0]
    expected = direct_on_chunks(out, gamma, mu, c, k, batch, d_out.chunks[1], conv)
    np.testing.assert_array_equal(r.compute(scheduler="threads"), expected)
    np.testing.assert_array_equal(client.compute(r).result(), expected)
    assert np.array_equal(out, saved)  # the dask array's source is never written

    whole = convcov.accumulate(out.copy(), gamma, mu, c, k, **conv)
    f64 = [np.abs(np.asarray(x, np.float64)) for x in (out, mu, c)]
    bound = convcov.accumulate(f64[0], None if gamma is None else np.abs(gamma.astype(float)),
                               f64[1], f64[2], k, backend="numpy", **conv)
    dts = {a.dtype.name for a in (out, mu, gamma) if a is not None}
    acc = "float64" if "float64" in dts else "float32"
    tol = tolerance(bound, 2 * mu.shape[1] // conv.get("groups", 1) * k * k, acc,
                    out.dtype.name)
    assert (np.abs(expected - whole) <= 2 * tol).all()


PATCH_CASES = [
    dict(id="none-groups2-channels-merged", gamma=None, conv=dict(padding=1, groups=2),
         chunks=dict(mu=(1, 2)), warn=True),
    dict(id="diag-stride2", gamma="diag", conv=dict(stride=2), chunks=dict(mu=(2,), gamma=(2,)),
         warn=False),
    dict(id="full-dilation2", gamma="full", conv=dict(padding=2, dilation=2),
         chunks=dict(mu=(3,), gamma=(1, 1, -1, -1, 1)), warn=True),
]


@pytest.mark.parametrize("case", PATCH_CASES, ids=[c["id"] for c in PATCH_CASES])
def test_patch_moment_equals_direct_calls(case, client):
    _, gamma, mu, _ = problem(dict(case, out="diag", Ci=4, Co=4, H=6, k=3, c="number"))
    d_mu = _dask(mu, case["chunks"]["mu"])
    d_gamma = None if gamma is None else _dask(gamma, case["chunks"]["gamma"])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        S = convcov.patch_moment(d_gamma, d_mu, 3, **case["conv"])
    assert any(issubclass(w.category, ChunkWarning) for w in caught) == case["warn"]
    batch = (d_mu if d_gamma is None else d_gamma).chunks[0]
    expected = np.concatenate([convcov.patch_moment(
        None if gamma is None else gamma[slice(*b)], mu[slice(*b)], 3, **case["conv"])
        for b in _bounds(batch)])
    assert S.shape == expected.shape and S.dtype == expected.dtype
    np.testing.assert_array_equal(S.compute(scheduler="threads"), expected)
    np.testing.assert_array_equal(client.compute(S).result(), expected)
    whole = convcov.patch_moment(gamma, mu, 3, **case["conv"])
    np.testing.assert_allclose(expected, whole, rtol=1e-5)


MOMENT_CASES = [
    dict(id="diag-gamma-per-channel-c-bias", gamma="diag", layout="full",
         conv=dict(padding=1, groups=2), c="dask", c_bias=0.05),
    dict(id="var-gamma-per-weight-c", gamma="var", layout="diag", conv=dict(stride=2),
         c="weight", c_bias=None),
    dict(id="no-gamma-var-layout", gamma=None, layout="var", conv=dict(padding=1, dilation=2),
         c="number", c_bias=None),
]


@pytest.mark.parametrize("case", MOMENT_CASES, ids=[c["id"] for c in MOMENT_CASES])
def test_conv2d_moments_equals_direct_calls(case, client):
    moments = pytest.importorskip("convcov.moments")
    rng = np.random.default_rng(3)
    B, Ci, Co, H = 4, 4, 6, 7
    G = case["conv"].get("groups", 1)
    mu = rng.random((B, Ci, H, H))
    gamma = {None: None, "var": rng.random((B, Ci, H, H)),
             "diag": rng.random((B, Ci, H, H, H, H))}[case["gamma"]]
    weight, bias = rng.random((Co, Ci // G, 3, 3)) - 0.5, rng.random(Co)
    c = {"number": 0.1, "dask": rng.random(Co), "weight": rng.random((Co, Ci // G, 3, 3))}[
        case["c"]]
    kw = dict(case["conv"], c_bias=case["c_bias"], out_layout=case["layout"])
    d_mu = _dask(mu, (2,) if gamma is None else (1,))
    d_gamma = None if gamma is None else _dask(gamma, (1,))
    d_c = _dask(c, (2,)) if case["c"] == "dask" else c
    m, g = moments.conv2d_moments(d_mu, d_gamma, weight, bias, d_c, **kw)
    parts = [moments.conv2d_moments(mu[b0:b1], None if gamma is None else gamma[b0:b1], weight,
                                    bias, c, **kw)
             for b0, b1 in _bounds((d_mu if d_gamma is None else d_gamma).chunks[0])]
    expected = [np.concatenate([p[i] for p in parts]) for i in (0, 1)]
    for got in (dask.compute(m, g, scheduler="threads"), client.compute([m, g], sync=True)):
        np.testing.assert_array_equal(got[0], expected[0])
        np.testing.assert_array_equal(got[1], expected[1])
    whole = moments.conv2d_moments(mu, gamma, weight, bias, c, **kw)
    np.testing.assert_allclose(expected[1], whole[1], rtol=1e-12, atol=1e-12)
    with dask.config.set(scheduler=_forbidden):
        with pytest.raises(convcov.ShapeError, match="weight"):
            moments.conv2d_moments(d_mu, d_gamma, weight[:, :1], bias, d_c, **kw)
        with pytest.raises(ValueError, match="out: dask arrays are never written"):
            moments.conv2d_moments(d_mu, d_gamma, weight, bias, d_c, out=g, **kw)


def test_nothing_to_add_returns_out():
    out = da.ones((0, 2, 2, 2, 2, 2), chunks=1)
    assert convcov.accumulate(out, None, da.ones((0, 1, 4, 4)), 1.0, 3) is out
    assert convcov.accumulate(out, None, da.ones((0, 1, 4, 4)), np.ones(2), 3) is out
    out = da.ones((2, 0, 2, 2, 2, 2))
    assert convcov.accumulate(out, None, da.ones((2, 1, 4, 4)), 1.0, 3) is out
    S = convcov.patch_moment(None, da.ones((0, 2, 4, 4)), 3)
    assert S.compute(scheduler="sync").shape == (0, 1, 2, 2, 2, 2)


@pytest.mark.parametrize("backend", ["numba", "numpy"])
@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_a_task_writes_its_result_apart_and_leaves_its_chunk(backend, dtype):
    """What each accumulate task does (docs/dask.md, "Memory"): the result, new memory,
    bit for bit the in-place call's, its out chunk unchanged; also for a chunk whose rows
    are not contiguous (then copied first)."""
    from convcov import _frontend

    rng = np.random.default_rng(7)
    mu = rng.random((2, 4, 7, 7)).astype(dtype)
    gamma = rng.random((2, 4, 7, 7, 7, 7)).astype(np.float32)
    c = rng.random(6).astype(np.float32)
    conv = ((3, 3), (2, 1), (1, 0), (1, 2), 2, backend)
    base = rng.random((2, 6, 4, 3, 4, 3)).astype(dtype)
    for out in (base, base.transpose(0, 1, 3, 2, 5, 4).copy().transpose(0, 1, 3, 2, 5, 4)):
        saved = out.copy()
        new = _frontend.accumulate_apart(np.empty(out.shape, dtype), out, gamma, mu, c, *conv)
        want = convcov.accumulate(out.copy(), gamma, mu, c, 3, stride=(2, 1), padding=(1, 0),
                                  dilation=(1, 2), groups=2, backend=backend)
        np.testing.assert_array_equal(new, want)
        np.testing.assert_array_equal(out, saved)
        assert not np.array_equal(new, out)


@pytest.mark.parametrize("op", ["accumulate", "patch_moment", "conv2d_moments"])
def test_result_memory_is_reused_only_once_no_array_holds_it(op):
    """Results come from a pool of host buffers (docs/dask.md, "Memory"): a view of a
    dropped result chunk keeps its values while later results of its size are computed."""
    mu_np = np.ones((1, 4, 18, 18), np.float32)
    mu = da.from_array(mu_np, chunks=-1)
    out_np = np.zeros((1, 4, 16, 16, 16, 16), np.float32)  # results of 1 MiB: pooled
    w = np.ones((2, 4, 3, 3), np.float32)  # conv2d_moments: a full result of 1 MiB

    def call(x, c):  # (dask array, the direct call's result)
        if op == "accumulate":
            return (convcov.accumulate(da.from_array(out_np, chunks=-1), None, x, c, 3),
                    convcov.accumulate(out_np.copy(), None, mu_np, c, 3))
        if op == "patch_moment":
            return (convcov.patch_moment(None, x * c, 3, groups=4),
                    convcov.patch_moment(None, mu_np * c, 3, groups=4))
        return (convcov.conv2d_moments(x, None, w, c=c)[1],
                convcov.conv2d_moments(mu_np, None, w, c=c)[1])

    first, want = call(mu, 1.0)
    (held,) = dask.persist(first, scheduler="sync")
    chunk = held.to_delayed().ravel()[0].compute(scheduler="sync")  # the result itself
    view, kept = chunk[0, 1:2], want[0, 1:2].copy()
    del held, chunk
    for c in (2.0, 3.0, 4.0):
        later, want = call(mu, c)
        (later,) = dask.persist(later, scheduler="sync")
        np.testing.assert_array_equal(later.compute(scheduler="sync"), want)
        del later
    np.testing.assert_array_equal(view, kept)


def _base():
    rng = np.random.default_rng(1)
    return dict(out=rng.random((2, 4, 3, 3, 3, 3)).astype(np.float32),
                gamma=rng.random((2, 4, 5, 5, 5, 5)).astype(np.float32),
                mu=rng.random((2, 4, 5, 5)).astype(np.float32), c=0.5, kernel_size=3, kw={})


BAD = {
    "kernel": dict(kernel_size=4),
    "int-mu": dict(mu=np.ones((2, 4, 5, 5), np.int32)),
    "int-out": dict(out=np.ones((2, 4, 3, 3, 3, 3), np.int64)),
    "big-endian-gamma": dict(gamma=np.ones((2, 4, 5, 5, 5, 5), ">f4")),
    "c-length": dict(c=np.ones(3, np.float32)),
    "dask-c-length": dict(c="dask-3"),
    "c-complex": dict(c=1j),
    "c-bool": dict(c=True),
    "c-huge-int": dict(c=10**400),
    "groups": dict(kw=dict(groups=3)),
    "groups-out": dict(out=np.ones((2, 6, 3, 3, 3, 3), np.float32), kw=dict(groups=4)),
    "padding": dict(kw=dict(padding=-1)),
    "stride-float": dict(kw=dict(stride=1.5)),
    "gamma-ndim": dict(gamma=np.ones((2, 4, 5, 5, 5), np.float32)),
    "mu-ndim": dict(mu=np.ones((2, 4, 5), np.float32)),
    "out-batch": dict(out=np.ones((3, 4, 3, 3, 3, 3), np.float32)),
    "weight-shape": dict(kernel_size=(4, 2, 3, 3)),
    "backend-unknown": dict(kw=dict(backend="cuda")),
    "backend-device": dict(kw=dict(backend="cupy")),  # not installed, or not for host arrays
}


def _call(fn, a, dask_arrays):
    args = dict(a)
    if dask_arrays:
        for n in ("out", "gamma", "mu"):
            if args[n] is not None:
                args[n] = da.from_array(args[n], chunks=1)
    if isinstance(args["c"], str):  # "dask-3": a dask c of 3 entries (numpy for the direct call)
        c = np.ones(3, np.float32)
        args["c"] = da.from_array(c) if dask_arrays else c
    if fn is convcov.patch_moment:
        return fn(args["gamma"], args["mu"], args["kernel_size"], **args["kw"])
    return fn(args["out"], args["gamma"], args["mu"], args["c"], args["kernel_size"],
              **args["kw"])


def _raised(f):
    try:
        f()
    except Exception as exc:
        return type(exc), str(exc)
    return None


@pytest.mark.filterwarnings("ignore::convcov.ChunkWarning")  # the calls that pass, chunks=1
@pytest.mark.parametrize("fn", [convcov.accumulate, convcov.patch_moment],
                         ids=["accumulate", "patch_moment"])
@pytest.mark.parametrize("bad", BAD, ids=list(BAD))
def test_bad_calls_raise_what_the_direct_call_raises_at_build_time(fn, bad):
    a = {**_base(), **BAD[bad]}
    direct = _raised(lambda: _call(fn, a, False))
    assert direct is not None or fn is convcov.patch_moment  # (which takes no out, no c)
    with dask.config.set(scheduler=_forbidden):
        assert _raised(lambda: _call(fn, a, True)) == direct


def test_mixed_dask_and_other_arrays_are_refused():
    a = _base()
    mu = da.from_array(a["mu"])
    with pytest.raises(TypeError, match="out: mu is a dask array, so out must be one too"):
        convcov.accumulate(a["out"], None, mu, 1.0, 3)
    with pytest.raises(TypeError, match="gamma: mu is a dask array"):
        convcov.accumulate(da.from_array(a["out"]), a["gamma"], mu, 1.0, 3)
    with pytest.raises(TypeError, match="gamma: mu is a dask array"):
        convcov.patch_moment(a["gamma"], mu, 3)
    with pytest.raises(TypeError):  # numpy mu decides: a dask out is of another kind
        convcov.accumulate(da.from_array(a["out"]), None, a["mu"], 1.0, 3)
    with pytest.raises(convcov.ShapeError, match="unknown chunk sizes"):
        convcov.patch_moment(None, mu[mu[:, 0, 0, 0] > 2], 3)


def test_import_convcov_imports_no_dask():
    code = ("import sys, numpy as np, convcov; "
            "convcov.accumulate(np.zeros((1, 1, 2, 2, 2, 2)), None, np.ones((1, 1, 4, 4)), 1.0, 3,"
            " backend='numpy'); assert 'dask' not in sys.modules, 'imported dask'")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def _die_once(x, marker, block_id=None):
    """Ends its worker's process the first time it runs the last batch block."""
    if block_id[0] == 3 and not os.path.exists(marker):
        open(marker, "w").close()
        os._exit(1)
    return x


def test_a_killed_worker_is_survived(client, tmp_path):
    case = CASES[0]
    out, gamma, mu, c = problem(case, seed=2)
    marker = str(tmp_path / "died")
    d_mu = _dask(mu, (1,)).map_blocks(_die_once, marker=marker, dtype=mu.dtype)
    r = convcov.accumulate(_dask(out, (1,)), _dask(gamma, (1,)), d_mu, c, 3, **case["conv"])
    expected = direct_on_chunks(out, gamma, mu, c, 3, (1,) * 4, (6,), case["conv"])
    np.testing.assert_array_equal(client.compute(r).result(timeout=120), expected)
    assert os.path.exists(marker)  # a worker did die
    client.wait_for_workers(2, timeout=60)


def _start_sampling(dask_worker):
    """Samples this worker process's RSS every 5 ms, keeping the peak."""
    import threading

    import psutil

    proc, state = psutil.Process(), {"peak": 0, "run": True}

    def sample():
        while state["run"]:
            state["peak"] = max(state["peak"], proc.memory_info().rss)
            time.sleep(0.005)

    dask_worker.convcov_rss = state
    threading.Thread(target=sample, daemon=True).start()
    return proc.memory_info().rss


def _stop_sampling(dask_worker):
    state = dask_worker.convcov_rss
    state["run"] = False
    return state["peak"]


def test_inputs_four_times_the_memory_limit_stream(client):
    client.wait_for_workers(2, timeout=60)
    n_workers = len(client.scheduler_info()["workers"])
    Bc, C, H = 256, 4, 8  # gamma chunks of 16 MiB
    n_chunks = math.ceil(4 * n_workers * LIMIT / (Bc * C * H**4 * 4))
    B, f32 = n_chunks * Bc, np.float32
    level = ((da.arange(B, chunks=Bc) // Bc) % 3 + 1).astype(f32)  # 1, 2, 3 by chunk
    gamma = da.ones((B, C, H, H, H, H), dtype=f32, chunks=(Bc, -1, -1, -1, -1, -1))
    gamma = gamma * level[:, None, None, None, None, None]
    mu = da.ones((B, C, H, H), dtype=f32, chunks=(Bc, -1, -1, -1)) * level[:, None, None, None]
    out = da.zeros((B, C, 4, 4, 4, 4), dtype=f32, chunks=(Bc, -1, -1, -1, -1, -1))
    assert gamma.dtype == mu.dtype == f32
    assert gamma.nbytes + mu.nbytes >= 4 * n_workers * LIMIT
    conv = dict(stride=2, padding=1, groups=C)  # reads all of gamma: SPEC's r20-down
    per_sample = convcov.accumulate(out, gamma, mu, 0.1, 3, **conv).sum(axis=(1, 2, 3, 4, 5))
    baseline = client.run(_start_sampling)
    got = client.compute(per_sample).result(timeout=300)
    peaks = client.run(_stop_sampling)
    one = []
    for s in (1, 2, 3):
        o = np.zeros((1, C, 4, 4, 4, 4), f32)
        convcov.accumulate(o, np.full((1, C, H, H, H, H), s, f32), np.full((1, C, H, H), s, f32),
                           0.1, 3, **conv)
        one.append(o.sum())
    np.testing.assert_allclose(got, np.array(one)[np.arange(B) // Bc % 3], rtol=1e-5)
    assert set(peaks) == set(baseline)  # no worker was replaced while it ran
    assert max(peaks.values()) < LIMIT, (peaks, LIMIT)


def test_example_runs_on_the_cluster(client):
    path = os.path.join(os.path.dirname(__file__), "..", "examples", "dask_batch.py")
    r = subprocess.run([sys.executable, path, "--small", "--scheduler",
                        client.scheduler.address], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "times the cluster's memory limit" in r.stdout
    assert "agrees with the direct call" in r.stdout


def test_bench_dask_runs_small(client):
    pytest.importorskip("rich")
    from convcov import bench_dask

    result = bench_dask.run("cpu", C=4, H=8, per_chunk=2, chunks=3, repeat=1,
                            address=client.scheduler.address)
    paths = [row["path"] for row in result["rows"]]
    assert paths == ["direct", "dask threads", "dask distributed"]
    assert all(row["seconds"] > 0 for row in result["rows"])
    bench_dask.table(result)


@pytest.mark.gpu
@pytest.mark.skipif(not has_cupy_gpu(), reason="needs CuPy with a CUDA device")
def test_cupy_chunks():
    import cupy
    from dask.array.utils import meta_from_array

    case = CASES[0]
    out, gamma, mu, c = (None if x is None else cupy.asarray(x) for x in problem(case))
    ch = case["chunks"]

    def chunked(x, spec):
        return da.from_array(x, chunks=tuple(spec) + (-1,) * (x.ndim - len(spec)),
                             asarray=False)

    r = convcov.accumulate(chunked(out, ch["out"]), chunked(gamma, ch["gamma"]),
                           chunked(mu, ch["mu"]), c, 3, **case["conv"])
    assert isinstance(meta_from_array(r), cupy.ndarray)
    expected = direct_on_chunks(out, gamma, mu, c, 3, (2, 2), (3, 3), case["conv"])
    got = r.compute(scheduler="threads")
    assert isinstance(got, cupy.ndarray) and bool(cupy.array_equal(got, expected))
    S = convcov.patch_moment(chunked(gamma, ch["gamma"]), chunked(mu, ch["mu"]), 3,
                             **case["conv"])
    assert bool(cupy.allclose(S.compute(scheduler="threads"),
                              convcov.patch_moment(gamma, mu, 3, **case["conv"]), rtol=1e-5))
    # conv2d_moments on CuPy chunks: CuPy results, each chunk the direct call's
    rng = np.random.default_rng(5)
    mu_m, gamma_m = (cupy.asarray(rng.random(s)) for s in ((4, 4, 6, 6), (4, 4, 6, 6, 6, 6)))
    weight, c_m = cupy.asarray(rng.random((6, 2, 3, 3)) - 0.5), cupy.asarray(rng.random(6))
    kw = dict(padding=1, groups=2, out_layout="full")
    m, g = convcov.conv2d_moments(chunked(mu_m, (1,)), chunked(gamma_m, (1,)), weight, None,
                                  c_m, **kw)
    parts = [convcov.conv2d_moments(mu_m[b:b + 1], gamma_m[b:b + 1], weight, None, c_m, **kw)
             for b in range(4)]
    moments_expected = [cupy.concatenate([p[i] for p in parts]) for i in (0, 1)]
    for got, want in zip(dask.compute(m, g, scheduler="threads"), moments_expected):
        assert isinstance(got, cupy.ndarray) and bool(cupy.array_equal(got, want))
    try:
        from dask_cuda import LocalCUDACluster
    except ImportError:
        return
    with LocalCUDACluster(n_workers=1, dashboard_address=None) as cluster, \
            distributed.Client(cluster) as cuda_client:
        got = cuda_client.compute(r).result(timeout=120)
        assert isinstance(got, cupy.ndarray) and bool(cupy.array_equal(got, expected))
        for got, want in zip(cuda_client.compute([m, g], sync=True), moments_expected):
            assert isinstance(got, cupy.ndarray) and bool(cupy.array_equal(got, want))
