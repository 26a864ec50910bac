"""``convcov.conv2d_moments`` (SPEC section 6) against its definition, reality and autograd.

* :func:`reference` is the float64 ground truth, from the definition of
  ``y = conv2d(x, weight + dW) + bias + db`` in literal loops: every term
  ``(weight + dW)[c0, cl, ii, ji] * x[b, ci, x0, y0]`` of every output entry is listed
  (its weight, its input entry); ``K`` (the conv as a matrix) is summed from them, and
  ``Cov(y_r, y_s) = E[y_r y_s] - E[y_r] E[y_s]`` entry by entry: ``K Gamma K^T`` (a
  matrix product: the double sum over both entries' terms) plus, for each pair of terms
  that share one noisy weight, ``c * E[x_q x_q']``, plus ``c_bias[c0]`` for two entries of
  channel ``c0`` (one noisy bias).
* Every gamma form x layout x c form x c_bias against it, with stride, padding, dilation
  and groups; a hypothesis property over shapes, conv parameters, dtypes (float16,
  bfloat16, float32, float64), array kinds, ``out`` and backends, with the forward error
  bound of kinds.tolerance; exact symmetry; errors that leave ``out`` untouched.
* Monte Carlo (torch): sampled inputs and noisy weights and biases through
  ``torch.nn.functional.conv2d``, one layer and a stack of three (moments of a linear
  stack are exact when each layer's full gamma_out feeds the next).
* ``torch.autograd.gradcheck`` in every input.
"""

from __future__ import annotations

import itertools
import zlib
from unittest import mock

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import convcov
from convcov import moments
from kinds import host_build, kinds_for, make, to_f64, tolerance

torch = pytest.importorskip("torch")
F = torch.nn.functional

FORMS = ("none", "full", "diag", "var")
LAYOUTS = ("full", "diag", "var")
C_FORMS = ("none", "number", "channel", "weight")


def out_size(n, k, s, p, d):
    return (n + 2 * p - d * (k - 1) - 1) // s + 1


def reference(mu, gamma, weight, bias=None, c=None, c_bias=None, stride=(1, 1), padding=(0, 0),
              dilation=(1, 1), groups=1):
    """(mean (B, Co, Ho, Wo), covariance (B, Co, Ho, Wo, Co, Ho, Wo)) in float64."""
    mu, w = np.asarray(mu, np.float64), np.asarray(weight, np.float64)
    B, Ci, H, W = mu.shape
    Co, Cg, kh, kw = w.shape
    (sh, sw), (ph, pw), (dh, dw) = stride, padding, dilation
    Ho, Wo = out_size(H, kh, sh, ph, dh), out_size(W, kw, sw, pw, dw)
    n, m = Ci * H * W, Co * Ho * Wo
    Gam = np.zeros((B, n, n))  # gamma in the full layout, flattened
    if gamma is not None:
        g = np.asarray(gamma, np.float64)
        if g.ndim == 7:
            Gam = g.reshape(B, n, n).copy()
        elif g.ndim == 6:
            for ci in range(Ci):
                s = slice(ci * H * W, (ci + 1) * H * W)
                Gam[:, s, s] = g[:, ci].reshape(B, H * W, H * W)
        else:
            Gam[:, np.arange(n), np.arange(n)] = g.reshape(B, n)
    cw = np.zeros(w.shape)
    if c is not None:
        cv = np.asarray(c, np.float64)
        cw = cv if cv.ndim == 4 else np.broadcast_to(cv.reshape(-1, 1, 1, 1), w.shape)
    # The terms of y's entries: taps[weight index] = [(output entry, input entry), ...]
    taps = {}
    K = np.zeros((m, n))
    for c0, cl, ii, ji in itertools.product(range(Co), range(Cg), range(kh), range(kw)):
        ci = c0 // (Co // groups) * Cg + cl
        terms = []
        for i, j in itertools.product(range(Ho), range(Wo)):
            x0, y0 = i * sh + ii * dh - ph, j * sw + ji * dw - pw
            if 0 <= x0 < H and 0 <= y0 < W:
                r, q = (c0 * Ho + i) * Wo + j, (ci * H + x0) * W + y0
                K[r, q] += w[c0, cl, ii, ji]
                terms.append((r, q))
        taps[c0, cl, ii, ji] = terms
    muf = mu.reshape(B, n)
    mean = muf @ K.T
    if bias is not None:
        mean += np.repeat(np.asarray(bias, np.float64), Ho * Wo)
    cov = K @ Gam @ K.transpose()
    Exx = muf[:, :, None] * muf[:, None, :] + Gam  # E[x_q x_q']
    for widx, terms in taps.items():  # two terms sharing one noisy weight
        for (r, q), (s, q2) in itertools.product(terms, repeat=2):
            cov[:, r, s] += cw[widx] * Exx[:, q, q2]
    if c_bias is not None:
        cb = np.broadcast_to(np.asarray(c_bias, np.float64), (Co,))
        for c0 in range(Co):
            blk = slice(c0 * Ho * Wo, (c0 + 1) * Ho * Wo)
            cov[:, blk, blk] += cb[c0]
    return mean.reshape(B, Co, Ho, Wo), cov.reshape(B, Co, Ho, Wo, Co, Ho, Wo)


def in_layout(cov, layout):
    """The full covariance as the layout holds it: the channel-diagonal blocks, the variances."""
    if layout == "full":
        return cov
    B, Co, Ho, Wo = cov.shape[:4]
    d = np.stack([cov[:, k, :, :, k] for k in range(Co)], 1)
    if layout == "diag":
        return d
    return np.einsum("bcpqpq->bcpq", d)


def transposed(g, layout):
    """gamma_out with its two index sets swapped."""
    axes = {"full": (0, 4, 5, 6, 1, 2, 3), "diag": (0, 1, 4, 5, 2, 3), "var": (0, 1, 2, 3)}
    return g.transpose(axes[layout])


def problem(rng, B, Ci, Co, G, H, W, k, form, c_form, cb_form, sym=True):
    """Random float64 inputs: a positive semi-definite gamma of the form, c of its form."""
    Cg, (kh, kw) = Ci // G, k
    n = Ci * H * W
    A = rng.normal(size=(B, n, n))
    Gam = A @ A.transpose(0, 2, 1) / n
    if not sym:
        Gam = A / np.sqrt(n)
    gamma = {"none": None, "full": Gam.reshape(B, Ci, H, W, Ci, H, W),
             "diag": np.stack([Gam.reshape(B, Ci, H * W, Ci, H * W)[:, i, :, i]
                               for i in range(Ci)], 1).reshape(B, Ci, H, W, H, W),
             "var": rng.uniform(0.1, 1.0, (B, Ci, H, W))}[form]
    c = {"none": None, "number": 0.3, "channel": rng.uniform(0.1, 1, Co),
         "weight": rng.uniform(0.1, 1, (Co, Cg, kh, kw))}[c_form]
    c_bias = {"none": None, "number": 0.2, "channel": rng.uniform(0.1, 1, Co)}[cb_form]
    return dict(mu=rng.normal(size=(B, Ci, H, W)), gamma=gamma,
                weight=rng.normal(size=(Co, Cg, kh, kw)), bias=rng.normal(size=Co), c=c,
                c_bias=c_bias)


GEOMETRIES = {  # (B, Ci, Co, G, H, W, k, stride, padding, dilation)
    "plain": (2, 2, 3, 1, 4, 4, (2, 2), (1, 1), (0, 0), (1, 1)),
    "stride-pad-dil-groups": (1, 4, 2, 2, 5, 6, (3, 2), (2, 1), (1, 1), (1, 2)),
    "depthwise-multiplier": (2, 2, 4, 2, 5, 4, (3, 2), (2, 1), (1, 0), (1, 2)),
}


@pytest.mark.parametrize("geometry", GEOMETRIES)
@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("c_form", C_FORMS)
def test_every_form_and_layout_matches_the_definition(geometry, form, c_form):
    B, Ci, Co, G, H, W, k, s, p, d = GEOMETRIES[geometry]
    rng = np.random.default_rng(zlib.crc32(f"{geometry} {form} {c_form}".encode()))
    for cb_form in ("none", "number", "channel"):
        a = problem(rng, B, Ci, Co, G, H, W, k, form, c_form, cb_form)
        mean, cov = reference(**a, stride=s, padding=p, dilation=d, groups=G)
        for layout in LAYOUTS:
            mo, go = convcov.conv2d_moments(a["mu"], a["gamma"], a["weight"], a["bias"],
                                            a["c"], c_bias=a["c_bias"], stride=s, padding=p,
                                            dilation=d, groups=G, out_layout=layout,
                                            backend="numpy")
            assert go.dtype == np.float64 and go.flags.c_contiguous
            np.testing.assert_allclose(mo, mean, rtol=1e-12, atol=1e-12)
            np.testing.assert_allclose(go, in_layout(cov, layout), rtol=1e-11, atol=1e-11)
            np.testing.assert_array_equal(go, transposed(go, layout))


def test_a_nonsymmetric_gamma_counts_as_its_symmetric_part():
    """A covariance is symmetric; given one that is not, gamma_out is that of
    (gamma + gamma^T) / 2 (K gamma K^T is symmetrised)."""
    rng = np.random.default_rng(3)
    a = problem(rng, 1, 2, 2, 1, 4, 4, (2, 2), "full", "number", "none", sym=False)
    g = a["gamma"].reshape(1, 32, 32)
    sym = ((g + g.transpose(0, 2, 1)) / 2).reshape(a["gamma"].shape)
    _, got = convcov.conv2d_moments(a["mu"], a["gamma"], a["weight"], c=0.3, padding=1)
    _, want = convcov.conv2d_moments(a["mu"], sym, a["weight"], c=0.3, padding=1)
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("r", [1, 16, 17, 40])
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_host_symmetrisation_is_the_mean_with_the_transpose(r, dtype):
    """The host's tiles give 0.5 a + 0.5 a^T bit for bit, in place and apart, on sizes
    that are and are not whole tiles."""
    from convcov import _host_kernels as hk

    A = np.random.default_rng(r).standard_normal((3, r, r)).astype(dtype)
    want = 0.5 * A + 0.5 * A.transpose(0, 2, 1)
    D, before = np.full_like(A, np.nan), A.copy()
    hk.symmetrize(A, D)
    np.testing.assert_array_equal(D, want)
    np.testing.assert_array_equal(A, before)  # (apart: A as it was)
    hk.symmetrize(A, A)
    np.testing.assert_array_equal(A, want)


DTYPES = {"numpy": ("float16", "float32", "float64"),
          "torch": ("float16", "bfloat16", "float32", "float64")}


@settings(max_examples=150)
@given(data=st.data())
def test_random_problems_match_the_definition(data):
    """Any shapes, conv parameters, forms, layouts, dtypes per input, array kinds, an out
    of its own dtype or none, and the backends: within the forward error bound of a sum
    of products in the dtype computed in (float32, float64 when an input is), rounded
    once into the result's dtype; exactly symmetric."""
    draw = data.draw
    G = draw(st.integers(1, 2), label="groups")
    Ci, Co = G * draw(st.integers(1, 2)), G * draw(st.integers(1, 2))
    kh, kw = draw(st.integers(1, 3)), draw(st.integers(1, 3))
    s = (draw(st.integers(1, 2)), draw(st.integers(1, 2)))
    p = (draw(st.integers(0, 1)), draw(st.integers(0, 1)))
    d = (draw(st.integers(1, 2)), draw(st.integers(1, 2)))
    H = draw(st.integers(max(1, d[0] * (kh - 1) + 1 - 2 * p[0]), d[0] * (kh - 1) + 3))
    W = draw(st.integers(max(1, d[1] * (kw - 1) + 1 - 2 * p[1]), d[1] * (kw - 1) + 3))
    B = draw(st.integers(1, 2), label="B")
    form, layout = draw(st.sampled_from(FORMS)), draw(st.sampled_from(LAYOUTS))
    c_form = draw(st.sampled_from(C_FORMS))
    cb_form = draw(st.sampled_from(("none", "number", "channel")))
    kind = draw(st.sampled_from(("numpy", "torch")), label="kind")
    backend = draw(st.sampled_from((None, "numpy")), label="backend")
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1), label="seed"))
    a = problem(rng, B, Ci, Co, G, H, W, (kh, kw), form, c_form, cb_form)
    args, dts = {}, []
    for name, v in a.items():
        if v is None or isinstance(v, float):
            args[name] = v
            continue
        dt = draw(st.sampled_from(DTYPES[kind]), label=f"dtype of {name}")
        dts.append(dt)
        args[name] = make(v, kind, dt)
    out, out_dt = None, None
    if draw(st.booleans(), label="out given"):
        out_dt = draw(st.sampled_from(DTYPES[kind]), label="dtype of out")
        Ho, Wo = out_size(H, kh, s[0], p[0], d[0]), out_size(W, kw, s[1], p[1], d[1])
        shape = {"full": (B, Co, Ho, Wo, Co, Ho, Wo), "diag": (B, Co, Ho, Wo, Ho, Wo),
                 "var": (B, Co, Ho, Wo)}[layout]
        out = make(np.full(shape, np.nan), kind, out_dt)
        dts.append(out_dt)
    geo = dict(stride=s, padding=p, dilation=d, groups=G)
    # CUDA's ways here too: a grouped full layout's second convolution not grouped
    # (moments.UNGROUPED_ON), a depthwise full layout by convolutions, not dense matrices
    # (moments.DENSE_DEPTHWISE_ON), torch's full layout in NCHW order (not channels-last,
    # moments.CHANNELS_LAST_ON, whose chunks take one position or all), the diagonal
    # layout's second step by convolutions (not the host's window sums,
    # moments.WINDOW_SUMS_ON); the variances' window blocks a position, some, or all at once
    cuda_ways = ("cpu",) if draw(st.booleans(), label="CUDA's ways") else ()
    host_ways = ("cpu",) if not cuda_ways else ()
    chunk = draw(st.sampled_from((1, 300, 1 << 26)), label="entries a chunk")
    cl_chunk = draw(st.sampled_from((1, 1 << 21)), label="bytes a channels-last chunk")
    with mock.patch.object(moments, "UNGROUPED_ON", cuda_ways), \
            mock.patch.object(moments, "DENSE_DEPTHWISE_ON", host_ways), \
            mock.patch.object(moments, "CHANNELS_LAST_ON", host_ways), \
            mock.patch.object(moments, "WINDOW_SUMS_ON", host_ways), \
            mock.patch.object(moments, "_CL_CHUNK", cl_chunk), \
            mock.patch.dict(moments._BLOCK_ENTRIES, cpu=chunk):
        mo, go = convcov.conv2d_moments(args["mu"], args["gamma"], args["weight"],
                                        args["bias"], args["c"], c_bias=args["c_bias"],
                                        out_layout=layout, out=out, backend=backend, **geo)
    acc = "float64" if "float64" in dts else "float32"
    assert out is None or go is out
    assert str(mo.dtype).removeprefix("torch.") == acc
    assert str(go.dtype).removeprefix("torch.") == (out_dt or acc)

    # The reference sees the values the call saw (rounded to their dtypes); the bound is
    # the same sums on absolute values.
    vals = {k: (None if v is None else v if isinstance(v, float) else to_f64(v))
            for k, v in args.items()}
    mean, cov = reference(**vals, **geo)
    absv = {k: (None if v is None else abs(v) if isinstance(v, float) else np.abs(v))
            for k, v in vals.items()}
    bmean, bcov = reference(**absv, **geo)
    terms = (Ci // G * kh * kw) ** 2 + 2 * Ci // G * kh * kw + 4
    for got, want, bound, dt in ((mo, mean, bmean, acc),
                                 (go, in_layout(cov, layout), in_layout(bcov, layout),
                                  out_dt or acc)):
        err = np.abs(to_f64(got) - want)
        tol = tolerance(bound, terms, acc, dt)
        assert np.all(err <= tol), f"worst error {err.max():.3g}, tolerance {tol.max():.3g}"
    g64 = to_f64(go)
    np.testing.assert_array_equal(g64, transposed(g64, layout))


@pytest.mark.parametrize("kind", ["numpy", "torch"])
@pytest.mark.parametrize("layout", ["full", "diag"])
@pytest.mark.parametrize("form", FORMS)
def test_gamma_out_is_exactly_symmetric(kind, layout, form):
    rng = np.random.default_rng(7)
    a = problem(rng, 2, 4, 4, 2, 6, 5, (3, 3), form, "weight", "channel")
    args = {k: (v if v is None or isinstance(v, float) else make(v, kind, "float32"))
            for k, v in a.items()}
    _, go = convcov.conv2d_moments(args["mu"], args["gamma"], args["weight"], args["bias"],
                                   args["c"], c_bias=args["c_bias"], padding=1, groups=2,
                                   out_layout=layout)
    g = to_f64(go)
    assert np.array_equal(g, transposed(g, layout))


@pytest.mark.parametrize("kind", ["torch_cuda", "cupy", "numba"])
@pytest.mark.parametrize("geometry", GEOMETRIES)
@pytest.mark.parametrize("form", FORMS)
def test_cuda_arrays_match_the_definition(kind, geometry, form):
    """On a CUDA device (its own ways: a grouped full layout's second convolution not
    grouped), torch tensors, CuPy arrays and numba device arrays, float64 and float32,
    every layout and c form, with and without out (a permuted view where the kind has
    one)."""
    if kind not in kinds_for("cuda"):
        pytest.skip(f"no {kind} here")
    B, Ci, Co, G, H, W, k, s, p, d = GEOMETRIES[geometry]
    rng = np.random.default_rng(zlib.crc32(f"cuda {geometry} {form}".encode()))
    for c_form, dt in itertools.product(C_FORMS, ("float64", "float32")):
        a = problem(rng, B, Ci, Co, G, H, W, k, form, c_form, "channel")
        mean, cov = reference(**a, stride=s, padding=p, dilation=d, groups=G)
        t = {n: v if v is None or isinstance(v, float) else make(v, kind, dt)
             for n, v in a.items()}
        tol = 1e-11 if dt == "float64" else 2e-5 * max(1.0, np.abs(cov).max())
        for layout, with_out in itertools.product(LAYOUTS, (False, True)):
            want = in_layout(cov, layout)
            out = make(np.zeros(want.shape), kind, dt, "permuted") if with_out else None
            mo, go = convcov.conv2d_moments(t["mu"], t["gamma"], t["weight"], t["bias"],
                                            t["c"], c_bias=t["c_bias"], stride=s, padding=p,
                                            dilation=d, groups=G, out_layout=layout, out=out)
            assert type(go) is type(t["mu"]) and (out is None or go is out)
            np.testing.assert_allclose(to_f64(mo), mean, rtol=tol, atol=tol)
            np.testing.assert_allclose(to_f64(go), want, rtol=tol, atol=tol)


_ROWS_PRELUDE = r"""
#include <array>
#include <cmath>
#include <condition_variable>
#include <mutex>
#include <thread>
#include <cstdlib>
#include <cstring>
#include <vector>
struct float4 { float x, y, z, w; };
static float4 make_float4(float x, float y, float z, float w) { return {x, y, z, w}; }
#define __global__
#define __device__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __restrict__
struct dim3_ { unsigned x, y, z; };
static thread_local dim3_ threadIdx, blockIdx;  // a host thread a CUDA thread (var_tiles)
static dim3_ blockDim, gridDim;
// A block's shared memory: the kernel's statics, the host threads running one block at a time
#define __shared__ static
#define __align__(n) __attribute__((aligned(n)))
static std::mutex bar_m;
static std::condition_variable bar_cv;
static int bar_n = 1, bar_count = 0, bar_gen = 0;
static void __syncthreads() {
  std::unique_lock<std::mutex> lock(bar_m);
  const int gen = bar_gen;
  if (++bar_count == bar_n) bar_count = 0, ++bar_gen, bar_cv.notify_all();
  else bar_cv.wait(lock, [&] { return gen != bar_gen; });
}
template <class T> static T __ldg(const T* p) { return *p; }
// The warp's mma by replay: a driver runs each lane of a warp in turn twice; the first pass
// logs every lane's operands of each call, the second computes D from the whole warp's
// (operands come from memory, never from an earlier mma's result, in these kernels).
static int emu_pass, emu_calls, emu_count[32];
static std::vector<std::array<unsigned, 6>> emu_log;
static float emu_f(unsigned u) { float x; memcpy(&x, &u, 4); return x; }
static void mma_on_host(float (&d)[4], const unsigned (&a)[4], const unsigned (&b)[2]) {
  const int lane = threadIdx.x & 31;
  const size_t i = emu_calls++;
  if (emu_pass == 0) {
    if (emu_log.size() < 32 * (i + 1)) emu_log.resize(32 * (i + 1));
    emu_log[32 * i + lane] = {a[0], a[1], a[2], a[3], b[0], b[1]};
    return;
  }
  if (emu_log.size() < 32 * (i + 1)) abort();  // this lane calls more often than lane 31
  float A[16][8], Bm[8][8];
  for (int L = 0; L < 32; ++L) {
    const auto& r = emu_log[32 * i + L];
    for (int e = 0; e < 4; ++e) A[L / 4 + 8 * (e & 1)][L % 4 + 4 * (e >> 1)] = emu_f(r[e]);
    for (int h = 0; h < 2; ++h) Bm[L % 4 + 4 * h][L / 4] = emu_f(r[4 + h]);
  }
  for (int e = 0; e < 4; ++e) {
    float s = d[e];
    for (int k = 0; k < 8; ++k)
      s += A[lane / 4 + 8 * (e >> 1)][k] * Bm[k][2 * (lane % 4) + (e & 1)];
    d[e] = s;
  }
}
"""

_ROWS_CASES = [  # (B, Ci, Co, G, H, W, N, k, stride, padding, dilation)
    (2, 4, 6, 1, 7, 9, 37, (3, 3), (1, 1), (1, 1), (1, 1)),
    (1, 6, 4, 2, 8, 5, 130, (3, 2), (2, 1), (1, 0), (1, 2)),
    (1, 3, 9, 3, 6, 6, 40, (3, 3), (1, 2), (2, 1), (2, 1)),
    (1, 8, 70, 1, 5, 11, 129, (1, 1), (1, 1), (0, 0), (1, 1)),  # three channel tiles
    (1, 2, 20, 2, 9, 9, 5, (5, 5), (2, 2), (0, 0), (1, 1)),
    (2, 4, 12, 2, 6, 8, 576, (3, 3), (1, 1), (1, 1), (1, 1)),  # whole runs, vector stores
    (1, 20, 16, 1, 6, 6, 260, (3, 3), (1, 1), (1, 1), (1, 1)),  # three input channel steps
]


def test_rows_kernel_matches_literal_loops(tmp_path):
    """The CUDA rows kernel of the full layout (convcov.backends._cupy_moments), its source
    built on the host as C++, every block and thread in turn, with the backend's tiles and
    grid: the convolution of X's rows by literal loops, with stride, padding, dilation,
    groups, ragged tiles of n, columns and channels, stored as it is and transposed; and
    again on a grid of one block in y and z, whose blocks loop over the rest."""
    import ctypes

    from convcov.backends import _cupy_moments as cupy_moments

    exprs = [cupy_moments.name(cupy_moments.tiles(Co // G), k, s, d)
             for _, _, Co, G, _, _, _, k, s, _, d in _ROWS_CASES]
    drivers = "".join(
        f'extern "C" int run_{i}(const float* X, const float* Wr, float* Y, const int* a, '
        f"long long N, const unsigned* g) {{ gridDim.x = g[0]; gridDim.y = g[1]; "
        f"gridDim.z = g[2]; for (unsigned z = 0; z < g[2]; ++z) "
        f"for (unsigned y = 0; y < g[1]; ++y) for (unsigned x = 0; x < g[0]; ++x) {{ "
        f"blockIdx.x = x; blockIdx.y = y; blockIdx.z = z; "
        f"for (unsigned w = 0; w < 8; ++w) {{ emu_log.clear(); "
        f"for (emu_pass = 0; emu_pass < 2; ++emu_pass) for (unsigned l = 0; l < 32; ++l) {{ "
        f"threadIdx.x = 32 * w + l; emu_calls = 0; {e}(X, Wr, Y, a[0], a[1], "
        f"a[2], a[3], a[4], a[5], a[6], a[7], a[8], a[9], N, a[10], a[11], a[12], a[13]); "
        f"if (emu_pass == 0) emu_count[l] = emu_calls; "
        f"else if (emu_calls != emu_count[l] || emu_calls != emu_count[0]) return 1; "
        f"}} }} }} return 0; }}\n"
        for i, e in enumerate(exprs))
    lib = host_build(tmp_path, _ROWS_PRELUDE + cupy_moments.SOURCE + drivers)
    rng = np.random.default_rng(7)

    for i, (B, Ci, Co, G, H, W, N, k, s, p, d) in enumerate(_ROWS_CASES):
        X = rng.standard_normal((B, Ci, H, W, N)).astype(np.float32)
        w = rng.standard_normal((Co, Ci // G) + k).astype(np.float32)
        Cg, Cpg = Ci // G, Co // G
        Ho, Wo = out_size(H, k[0], s[0], p[0], d[0]), out_size(W, k[1], s[1], p[1], d[1])
        want = np.zeros((B, Co, Ho, Wo, N))
        for o, c, u, v, y, x in itertools.product(range(Co), range(Cg), range(k[0]),
                                                  range(k[1]), range(Ho), range(Wo)):
            iy, ix = y * s[0] + u * d[0] - p[0], x * s[1] + v * d[1] - p[1]
            if 0 <= iy < H and 0 <= ix < W:
                want[:, o, y, x] += w[o, c, u, v] * X[:, o // Cpg * Cg + c, iy, ix].astype(float)
        Wr = np.ascontiguousarray(w.reshape(G, Cpg, Cg, *k).transpose(0, 2, 3, 4, 1))
        cfg = cupy_moments.tiles(Cpg)
        full, args = cupy_moments.grid(B, G, Cpg, Ho, Wo, N, cfg)
        for g, tr in itertools.product((full, (full[0], 1, 1)), (False, True)):
            a = np.array([Cg, Cpg, G, B, H, W, Ho, Wo, p[0], p[1], *args, tr], np.int32)
            Y = np.full((B, N, Co, Ho, Wo) if tr else (B, Co, Ho, Wo, N), np.nan, np.float32)
            assert getattr(lib, f"run_{i}")(_ptr(X), _ptr(Wr), _ptr(Y), _ptr(a),
                                            ctypes.c_longlong(N),
                                            _ptr(np.array(g, np.uint32))) == 0, "warp diverged"
            Y = Y.transpose(0, 2, 3, 4, 1) if tr else Y  # NaN: unwritten entries show
            np.testing.assert_allclose(Y, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


def _ptr(a):
    """``a``'s first element's address, for the host build's kernels."""
    import ctypes

    return ctypes.c_void_p(a.ctypes.data)


def _c_args(args):
    """A launch's NumPy scalars as the host build's C arguments."""
    import ctypes

    conv = {np.uint64: ctypes.c_void_p, np.int64: ctypes.c_longlong, np.int32: ctypes.c_int}
    return [conv[type(a)](int(a)) for a in args]


def _threads_driver(name, params, call):
    """C++ of ``name(unsigned grid, params)``: the blocks of ``grid`` in turn, a host thread
    for each of a block's 128 CUDA threads (``__syncthreads`` the prelude's barrier), each
    running ``call``."""
    return (f'extern "C" void {name}(unsigned grid, {params}) {{ gridDim.x = grid; '
            f"blockDim.x = bar_n = 128; std::vector<std::thread> ts; "
            f"for (unsigned t = 0; t < 128; ++t) ts.emplace_back([=] {{ threadIdx.x = t; "
            f"for (unsigned x = 0; x < grid; ++x) {{ blockIdx.x = x; {call}; "
            f"__syncthreads(); }} }}); for (auto& th : ts) th.join(); }}\n")


def test_symmetrize_kernel_matches_the_definition(tmp_path):
    """The CUDA symmetrisation (convcov.backends._cupy_moments), its source built on the
    host as C++, every block and thread in turn, with the backend's grid and on a grid of
    one block in y and z (the loops past the grid): (A + A^T) / 2 bit for bit, in place and
    into another array, float32 and float64, ragged and whole tiles, with and without
    16-byte accesses."""
    import ctypes

    from convcov.backends import _cupy_moments as cupy_moments

    drivers = "".join(
        f'extern "C" void run_{T}(const {T}* A, {T}* D, long long r, long long B, int vec, '
        f"const unsigned* g) {{ gridDim.x = g[0]; gridDim.y = g[1]; gridDim.z = g[2]; "
        f"blockDim.x = 128; for (unsigned z = 0; z < g[2]; ++z) "
        f"for (unsigned y = 0; y < g[1]; ++y) for (unsigned x = 0; x < g[0]; ++x) {{ "
        f"blockIdx.x = x; blockIdx.y = y; blockIdx.z = z; "
        f"for (unsigned t = 0; t < 128; ++t) {{ threadIdx.x = t; "
        f"symmetrize<{T}>(A, D, r, B, vec); }} }} }}\n" for T in ("float", "double"))
    lib = host_build(tmp_path, _ROWS_PRELUDE + cupy_moments.SOURCE + drivers)
    rng = np.random.default_rng(11)

    for dt, T in ((np.float32, "float"), (np.float64, "double")):
        for B, r in ((1, 1), (3, 5), (2, 8), (1, 13), (2, 16), (1, 37), (1, 260)):
            A = rng.standard_normal((B, r, r)).astype(dt)
            want = dt(0.5) * A + dt(0.5) * A.transpose(0, 2, 1)
            full = cupy_moments.symmetrize_grid(B, r, A.itemsize)
            vecs = (0, 1) if r * A.itemsize % 16 == 0 else (0,)
            for g, vec, in_place in itertools.product((full, (full[0], 1, 1)), vecs,
                                                      (False, True)):
                src = A.copy()
                D = src if in_place else np.full_like(A, np.nan)
                getattr(lib, f"run_{T}")(_ptr(src), _ptr(D), ctypes.c_longlong(r),
                                         ctypes.c_longlong(B), ctypes.c_int(vec),
                                         _ptr(np.array(g, np.uint32)))
                np.testing.assert_array_equal(D, want)


_VAR_PARAMS = ("const T* g, const T* wt, T* P, long long sb, long long sc, long long sx, "
               "long long sy, long long sc1, long long sx1, long long sy1, int Cg, int G, "
               "int H, int W, int Wo, int KH, int KW, int SH, int SW, int PH, int PW, int DH, "
               "int DW, int B, int i0, int rows, int chunks, int TPC, int RS, int diag")
_VAR_CASES = [  # (B, Ci, Co, G, H, W, k, stride, padding, dilation)
    (2, 3, 5, 1, 5, 4, (3, 3), (1, 1), (1, 1), (1, 1)),  # a ragged chunk of channels
    (1, 4, 6, 2, 6, 7, (3, 2), (2, 1), (1, 0), (1, 2)),
    (2, 2, 2, 2, 5, 5, (3, 3), (2, 2), (1, 1), (1, 1)),  # depthwise
    (1, 21, 17, 1, 4, 3, (3, 3), (1, 1), (1, 1), (1, 1)),  # 16 column threads, two chunks
    (1, 1, 3, 1, 4, 5, (5, 5), (1, 1), (3, 0), (1, 1)),  # rows wholly in the padding
    (1, 9, 70, 1, 3, 4, (3, 3), (1, 1), (1, 1), (1, 1)),  # tiles: two chunks, ragged columns
]


def test_var_kernel_matches_the_definition(tmp_path, monkeypatch):
    """The variances layout's CUDA kernels (convcov.backends._cupy_moments.var_forms, and
    var_tiles for full gamma), their source built on the host as C++, every block and
    thread in turn (var_tiles: a host thread each, for the block's syncs), driven by the
    backend's own split, launches and sums of the partial sums: the diagonal of K gamma
    K^T by the literal-loops reference, for full and channel-diagonal gamma (views
    with their axes' strides permuted), float32 and float64, with stride, padding,
    dilation, groups, ragged chunks of channels, rows wholly in the padding, row segments
    and output rows over several launches, on the backend's grid and on one block; then
    conv2d_moments' variances layout through it."""
    import ctypes
    import re

    from convcov.backends import _cupy_moments as cupy_moments

    names = re.findall(r"(\w+)(?:,|$)", _VAR_PARAMS)
    inst = [(T, cc) for T, ccs in (("float", (1, 2, 4, 8, 16)), ("double", (1, 2, 4, 8)))
            for cc in ccs]
    drivers = "".join(
        f'extern "C" void run_{T}_{cc}(unsigned grid, {_VAR_PARAMS.replace("T*", T + "*")}) '
        f"{{ gridDim.x = grid; blockDim.x = 128; for (unsigned x = 0; x < grid; ++x) "
        f"for (unsigned t = 0; t < 128; ++t) {{ blockIdx.x = x; threadIdx.x = t; "
        f"var_forms<{T}, {cc}, {cupy_moments.VAR_NC}>({', '.join(names)}); }} }}\n"
        for T, cc in inst)
    tiles = _VAR_PARAMS.replace("int TPC, int RS, int diag", "int tiles")
    drivers += "".join(
        _threads_driver(f"tiles_{T}_{ct}", tiles.replace("T*", T + "*"),
                        f"var_tiles<{T}, {ct}>({', '.join(names[:-3])}, tiles)")
        for T in ("float", "double") for ct in (16, 32, 64))
    lib = host_build(tmp_path, _ROWS_PRELUDE + cupy_moments.SOURCE + drivers)
    one_block = [False]

    def launch(expr, device, grid, block, args):
        kernel, T, cc = re.fullmatch(r"var_(forms|tiles)<(\w+), (\d+)(?:, \d+)*>", expr).groups()
        assert block == 128
        getattr(lib, f"{'run' if kernel == 'forms' else 'tiles'}_{T}_{cc}")(
            ctypes.c_uint(1 if one_block[0] else grid[0]), *_c_args(args))

    monkeypatch.setattr(cupy_moments, "_launch", launch)
    rng = np.random.default_rng(12)
    for case, form, dt in itertools.product(_VAR_CASES, ("full", "diag"),
                                            (torch.float32, torch.float64)):
        B, Ci, Co, G, H, W, k, s, p, d = case
        a = problem(rng, B, Ci, Co, G, H, W, k, form, "none", "none", sym=False)
        # gamma's memory in another order: a view with permuted strides
        order = (0, 3, 1, 2, *range(4, a["gamma"].ndim))
        mem = torch.tensor(a["gamma"].transpose(order), dtype=dt).contiguous()
        g = mem.permute(np.argsort(order).tolist())
        w = torch.tensor(a["weight"], dtype=dt)
        want = in_layout(reference(a["mu"], a["gamma"], a["weight"], stride=s, padding=p,
                                   dilation=d, groups=G)[1], "var")
        tol = (1e-5 if dt == torch.float32 else 1e-12) * np.abs(want).max()
        for (threads, partials, one_block[0]), tiled in itertools.product(
                ((1 << 17, 1 << 24, False), (1 << 30, 64, False), (1 << 30, 1 << 24, True)),
                (False, True) if form == "full" else (False,)):
            monkeypatch.setattr(cupy_moments, "VAR_TILED_N", 0 if tiled else 1 << 30)
            monkeypatch.setattr(cupy_moments, "VAR_THREADS", threads)
            monkeypatch.setattr(cupy_moments, "VAR_PARTIALS", partials)
            v = cupy_moments.var_forms(g, w, s, p, d, G, form == "diag")
            assert v.dtype == dt and v.shape == want.shape
            np.testing.assert_allclose(v.numpy(), want, rtol=0, atol=tol)
    # conv2d_moments' variances layout with the kernel (a gamma of each form, c per channel)
    monkeypatch.setattr(moments._TorchOps, "kernels", lambda self, *xs: True)
    one_block[0] = False
    B, Ci, Co, G, H, W, k, s, p, d = _VAR_CASES[1]
    for form in ("full", "diag"):
        a = problem(rng, B, Ci, Co, G, H, W, k, form, "channel", "number")
        mean, cov = reference(**a, stride=s, padding=p, dilation=d, groups=G)
        t = {n: None if v is None else torch.as_tensor(v) for n, v in a.items()}
        _, v = convcov.conv2d_moments(t["mu"], t["gamma"], t["weight"], t["bias"], t["c"],
                                      c_bias=a["c_bias"], stride=s, padding=p, dilation=d,
                                      groups=G, out_layout="var")
        np.testing.assert_allclose(v.numpy(), in_layout(cov, "var"), rtol=1e-12)


_DEPTHWISE_CASES = [  # (B, Ci, Co, H, W, k, stride, padding, dilation); groups = Ci
    (2, 3, 3, 5, 6, (3, 3), (1, 1), (1, 1), (1, 1)),
    (1, 2, 4, 7, 5, (3, 2), (2, 1), (1, 0), (1, 2)),  # two output channels an input one
    (1, 2, 2, 6, 6, (5, 5), (1, 1), (2, 2), (1, 1)),
    (1, 1, 1, 12, 12, (3, 3), (1, 1), (1, 1), (1, 1)),  # two tiles of positions, ragged
    (1, 2, 2, 5, 5, (1, 1), (2, 2), (0, 0), (1, 1)),  # rows that no output reads
    (1, 1, 1, 4, 4, (3, 3), (1, 1), (3, 0), (1, 1)),  # rows wholly in the padding
    (1, 1, 2, 4, 13, (3, 3), (1, 1), (1, 1), (2, 1)),  # long rows, a ragged quad
]


def test_depthwise_kernel_matches_literal_loops(tmp_path, monkeypatch):
    """The full layout's CUDA kernel for one input channel a group
    (convcov.backends._cupy_moments.depthwise_full), its source built on the host as C++,
    every block and thread in turn (a host thread each, for the block's syncs), on the
    backend's grid and on a grid of one block: K gamma K^T by literal loops for a
    nonsymmetric gamma (a view with permuted strides), float32 and float64, with stride,
    padding, dilation, several output channels an input channel, ragged quads and tiles;
    then conv2d_moments' full layout through it."""
    import ctypes

    from convcov.backends import _cupy_moments as cupy_moments

    params = ("const T* g, const T* w, T* A, long long sb, long long sc, long long sx, "
              "long long sy, long long sc1, long long sx1, long long sy1, int M, int Co, "
              "int H, int W, int Ho, int Wo, int PH, int PW, long long items")
    names = ", ".join(a.split()[-1] for a in params.split(", "))
    inst = sorted({(T, cupy_moments.depthwise_name(T, k, s, d)) for T in ("float", "double")
                   for _, _, _, _, _, k, s, _, d in _DEPTHWISE_CASES})
    exprs = [e for _, e in inst]
    drivers = "".join(_threads_driver(f"dw_{i}", params.replace("T*", T + "*"), f"{e}({names})")
                      for i, (T, e) in enumerate(inst))
    lib = host_build(tmp_path, _ROWS_PRELUDE + cupy_moments.SOURCE + drivers)
    one_block, seen = [False], []

    def launch(expr, device, grid, block, args, shared_mem=0):
        assert block == 128 and shared_mem <= 48 << 10
        seen.append(expr)
        getattr(lib, f"dw_{exprs.index(expr)}")(ctypes.c_uint(1 if one_block[0] else grid[0]),
                                                *_c_args(args))

    monkeypatch.setattr(cupy_moments, "_launch", launch)
    rng = np.random.default_rng(13)
    for case, dt, one_block[0] in itertools.product(
            _DEPTHWISE_CASES, (torch.float32, torch.float64), (False, True)):
        B, Ci, Co, H, W, k, s, p, d = case
        a = problem(rng, B, Ci, Co, Ci, H, W, k, "full", "none", "none", sym=False)
        order = (0, 4, 1, 5, 2, 6, 3)  # gamma's memory in another order
        mem = torch.tensor(a["gamma"].transpose(order), dtype=dt).contiguous()
        g = mem.permute(np.argsort(order).tolist())
        w = torch.tensor(a["weight"], dtype=dt)
        want = reference(a["mu"], a["gamma"], a["weight"], stride=s, padding=p, dilation=d,
                         groups=Ci)[1]
        A = cupy_moments.depthwise_full(g, w, s, p, d, Ci)
        assert A.dtype == dt and A.shape == want.shape
        tol = (1e-5 if dt == torch.float32 else 1e-12) * np.abs(want).max()
        np.testing.assert_allclose(A.numpy(), want, rtol=0, atol=tol)
    # conv2d_moments' full layout with the kernel, then the symmetrisation (emulated)
    monkeypatch.setattr(moments._TorchOps, "kernels", lambda self, *xs: True)
    monkeypatch.setattr(cupy_moments, "symmetrize",
                        lambda A, D: D.copy_(0.5 * A + 0.5 * A.transpose(1, 2)))
    one_block[0], seen[:] = False, []
    B, Ci, Co, H, W, k, s, p, d = _DEPTHWISE_CASES[1]
    a = problem(rng, B, Ci, Co, Ci, H, W, k, "full", "channel", "number")
    mean, cov = reference(**a, stride=s, padding=p, dilation=d, groups=Ci)
    t = {n: None if v is None else torch.as_tensor(v) for n, v in a.items()}
    mo, go = convcov.conv2d_moments(t["mu"], t["gamma"], t["weight"], t["bias"], t["c"],
                                    c_bias=a["c_bias"], stride=s, padding=p, dilation=d,
                                    groups=Ci, out_layout="full")
    assert seen == [cupy_moments.depthwise_name("double", k, s, d)]
    np.testing.assert_allclose(mo.numpy(), mean, rtol=1e-12)
    np.testing.assert_allclose(go.numpy(), cov, rtol=1e-10, atol=1e-12 * np.abs(cov).max())
    assert torch.equal(go, torch.as_tensor(transposed(go.numpy(), "full")))
    # rows too long for the ring in a block's shared memory: the products, no kernel
    a = problem(rng, 1, 2, 2, 2, 3, 40, (3, 3), "full", "none", "none")
    _, cov = reference(**a, padding=(1, 1), groups=2)
    t = {n: None if v is None else torch.as_tensor(v) for n, v in a.items()}
    seen.clear()
    _, go = convcov.conv2d_moments(t["mu"], t["gamma"], t["weight"], padding=1, groups=2)
    assert seen == [] and not cupy_moments.depthwise_fits(40, 3, 1, 8)
    np.testing.assert_allclose(go.numpy(), cov, rtol=1e-10, atol=1e-12 * np.abs(cov).max())


def test_the_kernels_compile_for_the_gpu():
    """The CUDA source through NVRTC for the H100/H200's architecture (no GPU needed), with
    the rows kernel's instantiations the layers of the moments suite take, both
    symmetrisations and the variances' kernel for one and 16 channels (float32) and 8
    (float64)."""
    nvrtc = pytest.importorskip("cuda.bindings.nvrtc",
                                reason="NVRTC comes with the test extra's numba-cuda[cu13]")
    from convcov.backends import _cupy_moments as cupy_moments

    names = [cupy_moments.name(cupy_moments.tiles(Cpg), (3, 3), s, (1, 1))
             for Cpg, s in ((16, (1, 1)), (64, (1, 1)), (32, (2, 2)))]
    names += ["symmetrize<float>", "symmetrize<double>"]
    names += [f"var_forms<{T}, {cc}, {cupy_moments.VAR_NC}>"
              for T, cc in (("float", 1), ("float", 16), ("double", 8))]
    names += [f"var_tiles<{T}, {ct}>" for T, ct in (("float", 16), ("float", 64), ("double", 64))]
    names += [cupy_moments.depthwise_name(T, (3, 3), (1, 1), (1, 1)) for T in ("float", "double")]
    err, prog = nvrtc.nvrtcCreateProgram(cupy_moments.SOURCE.encode(), b"rows.cu", 0, [], [])
    try:
        for n in names:
            nvrtc.nvrtcAddNameExpression(prog, n.encode())
        opts = [b"-arch=sm_90", *(o.encode() for o in cupy_moments._OPTIONS)]
        err, = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)
        _, size = nvrtc.nvrtcGetProgramLogSize(prog)
        log = b" " * size
        nvrtc.nvrtcGetProgramLog(prog, log)
        assert err == nvrtc.nvrtcResult.NVRTC_SUCCESS, log.decode(errors="replace")
        for n in names:
            err, lowered = nvrtc.nvrtcGetLoweredName(prog, n.encode())
            assert err == nvrtc.nvrtcResult.NVRTC_SUCCESS and lowered, n
    finally:
        nvrtc.nvrtcDestroyProgram(prog)


def test_the_rows_kernel_only_where_its_tensor_core_product_exists(monkeypatch):
    """The rows kernel (TF32 mma.sync) is chosen on GPUs of compute capability 8.0 or
    later only; before that cuDNN's way, and the symmetrisation kernel either way."""
    from convcov import _registry

    monkeypatch.setattr(type(_registry.get("cupy")), "unavailable_reason", lambda self: None)
    ops = moments._TorchOps("float32", torch.device("cuda", 0))
    for capability, rows in (((7, 5), False), ((8, 0), True), ((9, 0), True)):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d, c=capability: c)
        assert ops.rows() is rows and ops.kernels() is True


@pytest.mark.parametrize("geometry", ["plain", "stride-pad-dil-groups"])
@pytest.mark.parametrize("layout", ["full", "diag"])
def test_the_rows_kernels_way_matches_the_definition(geometry, layout, monkeypatch):
    """The CUDA full layout's way (the rows kernel storing K gamma transposed, then the
    rows kernel on that), and the diagonal layout's (K gamma's rows, then each channel's
    block), then the symmetrisation kernel (in place, or into out), run on the host with
    the kernels emulated; a nonsymmetric gamma counts as its symmetric part."""
    from convcov.backends import _cupy_moments as cupy_moments

    def emulated(X, w, stride, padding, dilation, G, transposed=False):
        Y = F.conv3d(X, w[..., None], None, (*stride, 1), (*padding, 0), (*dilation, 1), G)
        return Y.permute(0, 4, 1, 2, 3).contiguous() if transposed else Y

    def symmetrize(A, D):
        return D.copy_(0.5 * A + 0.5 * A.transpose(1, 2))

    monkeypatch.setattr(cupy_moments, "rows_conv", emulated)
    monkeypatch.setattr(cupy_moments, "symmetrize", symmetrize)
    monkeypatch.setattr(moments._TorchOps, "rows", lambda self, *xs: True)
    monkeypatch.setattr(moments._TorchOps, "kernels", lambda self, *xs: True)
    monkeypatch.setattr(moments, "ROWS_MAX_CPG", 1 << 30)
    B, Ci, Co, G, H, W, k, s, p, d = GEOMETRIES[geometry]
    rng = np.random.default_rng(zlib.crc32(f"rows {geometry} {layout}".encode()))
    a = problem(rng, B, Ci, Co, G, H, W, k, "full", "channel", "channel", sym=False)
    g = a["gamma"].reshape(B, Ci * H * W, -1)
    sym = ((g + g.transpose(0, 2, 1)) / 2).reshape(a["gamma"].shape)
    mean, cov = reference(**dict(a, gamma=sym), stride=s, padding=p, dilation=d, groups=G)
    t = {n: None if v is None else torch.as_tensor(v) for n, v in a.items()}
    want = in_layout(cov, layout)
    for out in (None, torch.zeros(want.shape, dtype=torch.float64),
                torch.zeros(want.shape, dtype=torch.float32)):
        _, go = convcov.conv2d_moments(t["mu"], t["gamma"], t["weight"], t["bias"], t["c"],
                                       c_bias=t["c_bias"], stride=s, padding=p, dilation=d,
                                       groups=G, out_layout=layout, out=out)
        assert out is None or go is out
        tol = 1e-10 if go.dtype == torch.float64 else 1e-6 * np.abs(want).max()
        np.testing.assert_allclose(go.numpy(), want, rtol=tol, atol=tol)
        assert torch.equal(go, torch.as_tensor(transposed(go.numpy(), layout)))


def test_numba_device_arrays_follow_their_streams():
    """Numba device arrays on their own streams: computed after the stream mu names, on the
    one out names; new results name the stream computed on; the results are right."""
    if "numba" not in kinds_for("cuda"):
        pytest.skip("no numba device arrays here")
    from numba import cuda

    rng = np.random.default_rng(3)
    a = problem(rng, 2, 4, 6, 2, 6, 5, (3, 3), "full", "channel", "channel")
    mean, cov = reference(**a, padding=(1, 1), groups=2)
    s_in, s_out = cuda.stream(), cuda.stream()
    t = {n: v if v is None or isinstance(v, float) else
         cuda.to_device(np.asarray(v, np.float64), stream=s_in) for n, v in a.items()}
    mo, go = convcov.conv2d_moments(t["mu"], t["gamma"], t["weight"], t["bias"], t["c"],
                                    c_bias=t["c_bias"], padding=1, groups=2, out_layout="diag")
    stream = t["mu"].__cuda_array_interface__["stream"]
    assert stream is not None and mo.__cuda_array_interface__["stream"] == stream
    np.testing.assert_allclose(mo.copy_to_host(stream=s_in), mean, rtol=1e-11, atol=1e-11)
    np.testing.assert_allclose(go.copy_to_host(stream=s_in), in_layout(cov, "diag"),
                               rtol=1e-11, atol=1e-11)
    out = cuda.device_array(in_layout(cov, "full").shape, np.float64, stream=s_out)
    _, go = convcov.conv2d_moments(t["mu"], t["gamma"], t["weight"], t["bias"], t["c"],
                                   c_bias=t["c_bias"], padding=1, groups=2, out=out)
    assert go is out
    np.testing.assert_allclose(out.copy_to_host(stream=s_out), cov, rtol=1e-11, atol=1e-11)


def test_backends_give_the_same_result():
    rng = np.random.default_rng(5)
    a = problem(rng, 2, 3, 4, 1, 6, 6, (3, 3), "full", "channel", "none")
    results = [convcov.conv2d_moments(a["mu"], a["gamma"], a["weight"], c=a["c"], padding=1,
                                      backend=b)[1] for b in ("numpy", "numba", None)]
    for r in results[1:]:
        np.testing.assert_allclose(r, results[0], rtol=1e-12, atol=1e-12)


def test_empty_batch_and_the_bias_alone():
    mo, go = convcov.conv2d_moments(np.zeros((0, 2, 5, 5)), None, np.ones((3, 2, 3, 3)),
                                    c=0.1, padding=1)
    assert mo.shape == (0, 3, 5, 5) and go.shape == (0, 3, 5, 5, 3, 5, 5)
    # no input channel: y is the (noisy) bias alone
    mo, go = convcov.conv2d_moments(np.zeros((1, 0, 2, 2)), None, np.ones((2, 0, 1, 1)),
                                    np.array([1.0, 2.0]), 0.5, c_bias=np.array([0.1, 0.2]),
                                    out_layout="diag")
    np.testing.assert_array_equal(mo[0, :, 0, 0], [1.0, 2.0])
    np.testing.assert_allclose(go[0, 1], np.full((2, 2, 2, 2), 0.2))


def test_out_receives_gamma_out_rounded_once():
    rng = np.random.default_rng(1)
    a = problem(rng, 1, 2, 2, 1, 5, 5, (3, 3), "diag", "number", "number")
    ref = convcov.conv2d_moments(a["mu"].astype(np.float32), a["gamma"].astype(np.float32),
                                 a["weight"].astype(np.float32), c=0.3, c_bias=0.2)[1]
    out = np.zeros((1, 2, 3, 3, 2, 3, 3), np.float16)
    view = np.zeros((1, 2, 3, 3, 2, 3, 3, 2), np.float32)[..., 0]  # a strided out
    for o in (out, view):
        r = convcov.conv2d_moments(a["mu"].astype(np.float32), a["gamma"].astype(np.float32),
                                   a["weight"].astype(np.float32), c=0.3, c_bias=0.2, out=o)[1]
        assert r is o
        np.testing.assert_array_equal(o, ref.astype(o.dtype))


# ----------------------------------------------------------------------------------------
# Errors: every check before anything is written.

def _ok():
    return dict(mu=np.ones((2, 4, 5, 5)), gamma=None, weight=np.ones((6, 2, 3, 3)),
                bias=None, c=None)


@pytest.mark.parametrize("change, error, names", [
    (dict(mu=np.ones((2, 4, 5))), convcov.ShapeError, "mu"),
    (dict(weight=np.ones((6, 2, 3))), convcov.ShapeError, "weight"),
    (dict(weight=np.ones((6, 3, 3, 3))), convcov.ShapeError, "weight"),
    (dict(weight=np.ones((5, 2, 3, 3))), convcov.ShapeError, "groups"),
    (dict(mu=np.ones((2, 4, 1, 1))), convcov.ShapeError, "mu"),
    (dict(bias=np.ones(5)), convcov.ShapeError, "bias"),
    (dict(gamma=np.ones((2, 4, 5, 5, 5))), convcov.ShapeError, "gamma"),
    (dict(gamma=np.ones((2, 4, 5, 5, 4, 5, 4))), convcov.ShapeError, "gamma"),
    (dict(gamma=np.ones((1, 4, 5, 5))), convcov.ShapeError, "gamma"),
    (dict(c=np.ones(5)), convcov.ShapeError, "c"),
    (dict(c=np.ones((6, 2, 3, 2))), convcov.ShapeError, "c"),
    (dict(c_bias=np.ones(2)), convcov.ShapeError, "c_bias"),
    (dict(out_layout="half"), ValueError, "out_layout"),
    (dict(mu=np.ones((2, 4, 5, 5), np.int64)), TypeError, "mu"),
    (dict(weight=np.ones((6, 2, 3, 3), complex)), TypeError, "weight"),
    (dict(c=True), TypeError, "c"),
    (dict(c="0.1"), TypeError, "c"),
    (dict(weight=torch.ones(6, 2, 3, 3)), TypeError, "weight: torch"),
    (dict(backend="cuda"), convcov.BackendError, "unknown backend 'cuda'"),
    (dict(out=np.zeros((2, 6, 3, 3, 3, 3))), convcov.ShapeError, "out"),
    (dict(out=np.zeros((2, 6, 3, 3, 6, 3, 3), np.int32)), TypeError, "out"),
])
def test_bad_calls_raise_and_name_the_argument(change, error, names):
    args = {**_ok(), "groups": 2} | change
    with pytest.raises(error, match=names):
        convcov.conv2d_moments(**args)


def test_rejected_out_is_left_bit_identical():
    a = _ok()
    out = np.arange(2 * 6 * 81, dtype=np.float64).reshape(2, 6, 3, 3, 3, 3)
    before = out.copy()
    out.flags.writeable = False
    with pytest.raises(ValueError, match="read-only"):
        convcov.conv2d_moments(**a, groups=2, out_layout="diag", out=out)
    out.flags.writeable = True
    buf = np.zeros(2 * 6 * 81 + 200)
    mu = buf[:200].reshape(2, 4, 5, 5)  # out below shares memory with mu
    shared = buf[100:100 + 2 * 6 * 81].reshape(2, 6, 3, 3, 3, 3)
    with pytest.raises(ValueError, match="shares memory with mu"):
        convcov.conv2d_moments(mu, None, a["weight"], groups=2, out_layout="diag", out=shared)
    z = np.zeros((1, 6, 3, 3))  # a writable zero-stride out: two batches, one memory
    zero_stride = np.lib.stride_tricks.as_strided(z, (2, 6, 3, 3), (0, *z.strides[1:]))
    with pytest.raises(ValueError, match="share memory"):
        convcov.conv2d_moments(**a, groups=2, out_layout="var",
                               out=zero_stride)
    with pytest.raises(convcov.ShapeError, match="c"):
        convcov.conv2d_moments(**{**a, "c": np.ones(5)}, groups=2, out_layout="diag", out=out)
    np.testing.assert_array_equal(out, before)


# ----------------------------------------------------------------------------------------
# Monte Carlo: the moments of real noisy convolutions.
#
# n draws of (x, noisy weights, noisy bias), one grouped conv2d per layer (sample i is
# group i). Each sample mean and covariance element gets z = (estimate - exact) / its
# standard error (from the same draws' fourth moments for the covariance); under the
# exact moments the z are ~N(0, 1) but correlated (the draws are shared), so the checks
# are on their spread: max |z| <= 6, |mean z| <= 0.75, std z within [0.65, 1.35] (the
# bounds of tests/test_montecarlo.py). Over 10 other seeds of each case the mean and the
# covariance reached max |z| 4.6, |mean z| 0.38, std z 0.82..1.21; with c and c_bias 10 %
# too large, max |z| was 6.8 or more in every one, which the power check asserts here.

N_DRAWS = 20_000
LAYER_STACK = [  # (Ci, Co, k, stride, padding, dilation, groups)
    (2, 4, 3, 1, 1, 1, 2),
    (4, 3, 2, 2, 0, 1, 1),
    (3, 2, 2, 1, 1, 2, 1),
]


def _layers(rng, stack):
    out = []
    for Ci, Co, k, s, p, d, G in stack:
        w = rng.normal(0, 0.5, (Co, Ci // G, k, k))
        out.append(dict(weight=w, bias=rng.normal(0, 0.5, Co), c=rng.uniform(0.02, 0.1, w.shape),
                        c_bias=rng.uniform(0.02, 0.1, Co), stride=s, padding=p, dilation=d,
                        groups=G))
    return out


def _sample(rng, mu, gamma, layers, n):
    """n draws of the stack's output, flattened: (B, n, P)."""
    B, Ci, H, W = mu.shape
    chol = np.linalg.cholesky(gamma.reshape(B, Ci * H * W, Ci * H * W))
    z = rng.standard_normal((B, n, Ci * H * W))
    x = mu.reshape(B, 1, -1) + np.einsum("bpq,bnq->bnp", chol, z)
    y = torch.from_numpy(x.reshape(B, n * Ci, H, W))
    for L in layers:
        w = L["weight"] + np.sqrt(L["c"]) * rng.standard_normal((n, *L["weight"].shape))
        b = L["bias"] + np.sqrt(L["c_bias"]) * rng.standard_normal((n, L["bias"].size))
        Co, Cg = L["weight"].shape[:2]
        y = F.conv2d(y, torch.from_numpy(w.reshape(n * Co, Cg, *w.shape[3:])),
                     torch.from_numpy(b.reshape(-1)), L["stride"], L["padding"],
                     L["dilation"], n * L["groups"])
    return y.numpy().reshape(B, n, -1)


def _propagate(mu, gamma, layers, scale=1.0):
    g = torch.from_numpy(gamma)
    m = torch.from_numpy(mu)
    for L in layers:
        m, g = convcov.conv2d_moments(
            m, g, torch.from_numpy(L["weight"]), torch.from_numpy(L["bias"]),
            torch.from_numpy(L["c"] * scale), c_bias=torch.from_numpy(L["c_bias"] * scale),
            stride=L["stride"], padding=L["padding"], dilation=L["dilation"],
            groups=L["groups"])
    B = m.shape[0]
    return m.numpy().reshape(B, -1), g.numpy().reshape(B, m[0].numel(), m[0].numel())


def _z(samples, mean, cov):
    d = samples - mean[:, None]
    n = samples.shape[1]
    z_mean = d.mean(1) / (d.std(1) / np.sqrt(n))
    s = np.einsum("bnp,bnq->bpq", d, d) / n
    se = np.sqrt(np.maximum(np.einsum("bnp,bnq->bpq", d * d, d * d) / n - s * s, 0) / n)
    iu = np.triu_indices(cov.shape[1])
    return z_mean.ravel(), ((s - cov) / se)[:, iu[0], iu[1]].ravel()


def _bad(z):
    return [why for why, bad in (
        (f"max |z| {np.abs(z).max():.1f}", not np.abs(z).max() <= 6.0),
        (f"mean z {z.mean():+.2f}", not abs(z.mean()) <= 0.75),
        (f"std z {z.std():.2f}", not 0.65 <= z.std() <= 1.35)) if bad]


@pytest.mark.parametrize("depth", [1, 3], ids=["one layer", "a stack of three"])
def test_moments_match_monte_carlo(depth):
    rng = np.random.default_rng(depth)
    B, Ci, H, W = 2, 2, 6, 6
    n = Ci * H * W
    A = rng.normal(size=(B, n, n))
    gamma = (A @ A.transpose(0, 2, 1) / n + 0.1 * np.eye(n)).reshape(B, Ci, H, W, Ci, H, W)
    mu = rng.normal(0.5, 1.0, (B, Ci, H, W))
    layers = _layers(rng, LAYER_STACK[:depth])
    samples = _sample(rng, mu, gamma, layers, N_DRAWS)
    mean, cov = _propagate(mu, gamma, layers)
    z_mean, z_cov = _z(samples, mean, cov)
    assert not _bad(z_mean), _bad(z_mean)
    assert not _bad(z_cov), _bad(z_cov)
    # power: the same draws reject noise variances 10 % too large
    assert _bad(_z(samples, *_propagate(mu, gamma, layers, scale=1.1))[1])


# ----------------------------------------------------------------------------------------
# Autograd

@pytest.mark.parametrize("form, layout, c_form, cuda_ways", [
    ("full", "full", "number", False), ("full", "full", "channel", True),
    ("full", "diag", "weight", False),
    ("full", "diag", "number", True), ("full", "var", "channel", False),
    ("full", "var", "number", True), ("diag", "full", "weight", False),
    ("diag", "diag", "channel", False), ("diag", "var", "weight", True),
    ("var", "var", "weight", False), ("var", "diag", "number", False),
    ("none", "full", "channel", False),
])
def test_gradcheck_in_every_input(form, layout, c_form, cuda_ways, monkeypatch):
    """In float64, with CUDA's ways (see the property test) and the host's."""
    monkeypatch.setattr(moments, "UNGROUPED_ON", ("cpu",) if cuda_ways else ())
    monkeypatch.setattr(moments, "DENSE_DEPTHWISE_ON", () if cuda_ways else ("cpu",))
    monkeypatch.setitem(moments._BLOCK_ENTRIES, "cpu", 1)  # blocks a position at a time
    rng = np.random.default_rng(0)
    G = 2 if layout == "diag" or cuda_ways else 1
    a = problem(rng, 1, 2, 2, G, 3, 3, (2, 2), form, c_form, "channel")
    if c_form == "number":
        a["c"] = np.array(0.3)  # a 0-d tensor: it gets a gradient too
    names = [k for k, v in a.items() if v is not None]
    ts = [torch.from_numpy(np.asarray(a[k])).requires_grad_() for k in names]

    def f(*xs):
        kw = dict(zip(names, xs))
        return convcov.conv2d_moments(kw["mu"], kw.get("gamma"), kw["weight"], kw["bias"],
                                      kw["c"], c_bias=kw["c_bias"], padding=1, groups=G,
                                      out_layout=layout, backend="numpy")

    assert torch.autograd.gradcheck(f, ts)


@pytest.mark.parametrize("dense", [True, False], ids=["dense", "convolutions"])
def test_gradcheck_depthwise_full_layout(dense, monkeypatch):
    """A layer of one input channel a group, two output channels each, stride 2 and
    dilation: the full layout by dense convolution matrices (the host's way) and by
    grouped convolutions, gradients in every input."""
    monkeypatch.setattr(moments, "DENSE_DEPTHWISE_ON", ("cpu",) if dense else ())
    a = problem(np.random.default_rng(1), 1, 2, 4, 2, 5, 4, (3, 2), "full", "weight",
                "channel")
    names = [k for k, v in a.items() if v is not None]
    ts = [torch.from_numpy(np.asarray(a[k])).requires_grad_() for k in names]

    def f(*xs):
        kw = dict(zip(names, xs))
        return convcov.conv2d_moments(kw["mu"], kw["gamma"], kw["weight"], kw["bias"], kw["c"],
                                      c_bias=kw["c_bias"], stride=(2, 1), padding=(1, 0),
                                      dilation=(1, 2), groups=2, backend="numpy")

    assert torch.autograd.gradcheck(f, ts)


def test_nn_moments_reads_the_layer():
    import convcov.nn

    conv = torch.nn.Conv2d(4, 6, 3, stride=2, padding=1, groups=2).double()
    mu = torch.rand(2, 4, 7, 7, dtype=torch.float64)
    gamma = torch.rand(2, 4, 7, 7, dtype=torch.float64)
    m, v = convcov.nn.moments(conv, mu, gamma, c=0.01, c_bias=0.02, out_layout="var")
    m2, v2 = convcov.conv2d_moments(mu, gamma, conv.weight, conv.bias, 0.01, c_bias=0.02,
                                    stride=2, padding=1, groups=2, out_layout="var")
    torch.testing.assert_close(m, conv(mu))
    torch.testing.assert_close(v, v2)
    assert m.requires_grad  # through the layer's parameters


def test_no_grad_with_parameters_that_require_it():
    """Under no_grad (evaluation), a layer's parameters and a gamma that require grad: the
    host's full layout (channels-last, without autograd) gives what the recorded call
    gives, and records nothing."""
    import convcov.nn

    conv = torch.nn.Conv2d(4, 6, 3, padding=1, groups=2)
    a = problem(np.random.default_rng(2), 2, 4, 6, 2, 5, 6, (3, 3), "full", "number", "none")
    mu, gamma = (torch.from_numpy(a[k]).float() for k in ("mu", "gamma"))
    gamma.requires_grad_()
    want = [x.detach() for x in convcov.nn.moments(conv, mu, gamma, c=0.01)]
    with torch.no_grad():
        got = convcov.nn.moments(conv, mu, gamma, c=0.01)
    for g, w in zip(got, want):
        assert not g.requires_grad
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)


# ----------------------------------------------------------------------------------------
# The example and the benchmark run (small sizes: their checks, not their speed).

def test_the_stack_example_agrees_with_monte_carlo(capsys):
    import re
    import runpy
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "examples" / "moments_stack.py"
    runpy.run_path(str(path), run_name="example")["main"](["--small"])
    text = capsys.readouterr().out
    z = re.search(r"mean z (\S+), std z (\S+), max \|z\| (\S+);", text)
    assert abs(float(z[1])) < 0.75 and 0.65 < float(z[2]) < 1.35 and float(z[3]) < 6


def test_bench_checks_and_times_every_row(monkeypatch, capsys):
    from convcov import bench_moments, cli

    tiny = bench_moments.Layer("tiny", 2, 3, 5, 3, 1, 1, 1, 1)
    monkeypatch.setattr(bench_moments, "LAYERS", {"tiny": (tiny, tiny)})
    cli.main(["bench", "--suite", "moments", "--device", "cpu", "--workload", "tiny",
              "--repeat", "3", "--budget", "0"])
    text = capsys.readouterr().out
    for impl in ("conv2d_moments full", "conv2d_moments var (numpy)", "two conv2d"):
        assert impl in text
    rows = bench_moments.run("cpu", ["tiny"], repeat=3, budget_s=0)["rows"]
    timed = [r for r in rows if "seconds" in r]
    assert len(timed) >= 7 and all(r["error"] < 1e-5 for r in timed)
    assert all(0 < r["floor_s"] and r["of_floor"] == r["floor_s"] / r["seconds"]
               for r in timed)
    assert "of floor" in text

    with pytest.raises(ValueError, match="unknown layer"):
        bench_moments.run("cpu", ["nope"])


@pytest.mark.parametrize("layer", [(2, 2, 5, 3, 1, 1, 1), (4, 2, 6, 3, 2, 1, 2),
                                   (2, 4, 7, 3, 2, 0, 2), (2, 2, 6, 1, 2, 0, 1)],
                         ids=["3x3", "strided-groups", "unpadded", "1x1-s2"])
@pytest.mark.parametrize("layout", ["full", "diag", "var"])
def test_the_floor_counts_the_entries_of_gamma_the_result_depends_on(layer, layout):
    """The moments floor's bytes of gamma are the entries whose change moves the result:
    the entries where the gradient of a random weighting of the result is not zero."""
    from convcov import bench_moments

    Ci, Co, H, k, s, p, G = layer
    L = bench_moments.Layer("t", Ci, Co, H, k, s, p, G, 1)
    rng = np.random.default_rng(3)
    gamma = torch.from_numpy(rng.standard_normal((1, Ci, H, H, Ci, H, H))).requires_grad_()
    w = torch.from_numpy(rng.standard_normal((Co, Ci // G, k, k)))
    _, r = convcov.conv2d_moments(torch.zeros(1, Ci, H, H, dtype=torch.float64), gamma, w,
                                  stride=s, padding=p, groups=G, out_layout=layout)
    (r * torch.from_numpy(rng.standard_normal(r.shape))).sum().backward()
    nbytes, _ = bench_moments._work(L, layout, itemsize=1)
    assert nbytes - r[0].numel() == int((gamma.grad != 0).sum())
