"""Inputs at the edges: an ``out`` whose elements share memory at any size, conv parameters
beyond 64 bits, padding far larger than the input, a plug-in whose probe raises, a bound
signature called with other strides, and one rounding into 16-bit ``out`` on every backend.
Each refusal raises the right exception with a clear message and leaves ``out``
bit-identical; each valid call gives the reference's (or the literal loops') result."""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest
from numpy.lib.stride_tricks import as_strided

import convcov
from convcov import Backend, ShapeError, _registry

from kinds import HAS_TORCH, op_loops, to_f64, torch_cuda

HOST = ["numpy", "numba"]
needs_torch = pytest.mark.skipif(not HAS_TORCH, reason="torch is not installed")


def _host_kinds():
    return ["numpy", "torch"] if HAS_TORCH else ["numpy"]


def _as(kind, a):
    if kind == "torch":
        import torch

        return torch.from_numpy(a)
    return a


def _refused(out, exc, words, *args, **kwargs):
    """``convcov.accumulate(out, *args, **kwargs)`` raises exc, its message holds each of
    words, and out is bit-identical afterwards."""
    before = to_f64(out).tobytes()
    with pytest.raises(exc) as info:
        convcov.accumulate(out, *args, **kwargs)
    for w in words:
        assert w in str(info.value), f"{w!r} not in message: {info.value}"
    assert to_f64(out).tobytes() == before


# ------------------------------------------------------------------ out sharing memory
@pytest.mark.parametrize("kind", _host_kinds())
@pytest.mark.parametrize("backend", HOST)
def test_self_overlapping_out_refused_at_every_size(kind, backend):
    """Two equal strides on axes longer than 1: elements (.., 1, 0) and (.., 0, 1) meet.
    Refused for a small out and for one of more than 2**20 elements alike."""
    for n in (3, 33):  # 33**4 > 2**20
        base = np.zeros(n**4 + n, np.float32)
        out = as_strided(base, (1, 1, n, n, n, n), (0, 0, 4 * n**3, 4 * n**2, 4, 4))
        out = _as(kind, out)
        mu = _as(kind, np.ones((1, 1, n + 2, n + 2), np.float32))
        _refused(out, ValueError, ["out", "share memory"], None, mu, 1.0, 3, backend=backend)


@pytest.mark.parametrize("backend", HOST)
def test_interleaved_out_is_settled_exactly(backend):
    """Strides that do not nest, under a dense batch axis: (i1, j1) of lengths (3, 2) on
    strides (2, 3) never meet (offsets 0 2 4 3 5 7), so the call is valid and equals the
    literal loops; the same lengths on strides (1, 2) meet at offset 2 and are refused."""
    rng = np.random.default_rng(1)
    B, Ci, H, W = 2, 2, 5, 4  # k (3, 3): Ho, Wo = 3, 2
    gamma = rng.standard_normal((B, Ci, H, W, H, W))
    mu = rng.standard_normal((B, Ci, H, W))
    step = 8 * 64  # out's batch stride, in bytes, past the 63 elements the rest reaches
    base = np.zeros(B * 64)
    ok = as_strided(base, (B, 1, 3, 2, 3, 2), (step, 0, 8 * 8 * 3, 8 * 8, 16, 24))
    ok[...] = rng.standard_normal(ok.shape)
    want = op_loops(ok, gamma, mu, np.ones(1), 3, 3)
    convcov.accumulate(ok, gamma, mu, 1.0, 3, backend=backend)
    np.testing.assert_allclose(ok, want, rtol=1e-12, atol=1e-12)
    bad = as_strided(base, (B, 1, 3, 2, 3, 2), (step, 0, 8 * 8 * 3, 8 * 8, 8, 16))
    _refused(bad, ValueError, ["out", "share memory"], gamma, mu, 1.0, 3, backend=backend)


def test_out_whose_overlap_cannot_be_settled_cheaply_is_refused():
    """Four long axes on strides no cheap test decides (none nests, none a small multiple
    of another): refused with a message saying so, not guessed."""
    n, strides = 33, (41, 43, 47, 53)
    base = np.zeros(sum(s * (n - 1) for s in strides) + 1, np.float32)
    out = as_strided(base, (1, 1, n, n, n, n), (0, 0, *(4 * s for s in strides)))
    mu = np.ones((1, 1, n + 2, n + 2), np.float32)
    _refused(out, ValueError, ["out", "cannot be settled", "contiguous"], None, mu, 1.0, 3,
             backend="numpy")


# ------------------------------------------------------------------ huge conv parameters
@pytest.mark.parametrize("kind", _host_kinds())
@pytest.mark.parametrize("backend", HOST)
def test_huge_conv_parameters_compute_or_name_the_argument(kind, backend):
    """A stride with one output, or a dilation of a 1-wide kernel, changes nothing however
    large: the call computes (a padding that puts every position outside gives 0). A
    padding beyond 64-bit indexing is a ShapeError naming it."""
    rng = np.random.default_rng(2)
    mu64 = rng.standard_normal((1, 2, 5, 6))
    gamma64 = rng.standard_normal((1, 2, 5, 6, 5, 6))
    mu, gamma = _as(kind, mu64.astype(np.float32)), _as(kind, gamma64.astype(np.float32))
    for k, conv, like in [((1, 3), dict(stride=(2**63, 1)), dict(stride=(99, 1))),
                          ((1, 3), dict(dilation=(10**30, 2)), dict(dilation=(1, 2))),
                          (1, dict(stride=2**64, dilation=10**30), dict(stride=9)),
                          (1, dict(stride=2**62, padding=2**60), None)]:
        S = convcov.patch_moment(gamma, mu, k, backend=backend, **conv)
        want = (np.zeros((1, 1, 1, 1, 1, 1)) if like is None else
                convcov.patch_moment(gamma64, mu64, k, backend="numpy", **like))
        np.testing.assert_allclose(to_f64(S), want, rtol=1e-5, atol=1e-5)
        if kind == "torch":  # a call autograd records (torch's operators take int64)
            m = mu.detach().clone().requires_grad_()
            S = convcov.patch_moment(gamma, m, k, backend=backend, **conv)
            S.sum().backward()
            np.testing.assert_allclose(to_f64(S), want, rtol=1e-5, atol=1e-5)
            assert m.grad is not None and m.grad.shape == m.shape
    for conv in [dict(stride=2**62 + 1, padding=2**61), dict(stride=2**63, padding=2**62),
                 dict(padding=10**30, stride=10**31)]:
        Ho = (5 + 2 * conv["padding"] - 1) // conv["stride"] + 1
        Wo = (6 + 2 * conv["padding"] - 1) // conv["stride"] + 1
        out = _as(kind, np.zeros((1, 2, Ho, Wo, Ho, Wo), np.float32))
        _refused(out, ShapeError, ["padding", str(conv["padding"]), "64-bit"], gamma, mu, 1.0,
                 1, backend=backend, **conv)


# ------------------------------------------------------------------ the reference's memory
@pytest.mark.parametrize("H, k, s, p", [(3, 3, 3000, 3000), (7, 3, 40, 81), (6, 2, 5, 4)])
def test_reference_memory_does_not_grow_with_the_padding(H, k, s, p):
    """The numpy reference reads the input in place: its traced memory stays within S and
    the group channel sum (float64) plus a little, whatever the padding (a padded copy
    of this much padding would take petabytes in the first case), and it equals the
    literal loops."""
    rng = np.random.default_rng(3)
    B, Ci, Co, G = 1, 2, 2, 1
    Ho = (H + 2 * p - k) // s + 1
    mu = rng.standard_normal((B, Ci, H, H))
    gamma = rng.standard_normal((B, Ci, H, H, Ci, H, H))
    out = rng.standard_normal((B, Co, Ho, Ho, Ho, Ho))
    want = op_loops(out, gamma, mu, np.ones(Co), k, k, (s, s), (p, p))
    bound = 8 * (B * G * Ho**4 * 3 + B * G * H**4 + mu.size) + (1 << 16)
    tracemalloc.start()
    try:
        convcov.accumulate(out, gamma, mu, 1.0, k, stride=s, padding=p, backend="numpy")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak <= bound, (peak, bound)
    np.testing.assert_allclose(out, want, rtol=1e-12, atol=1e-12)


@needs_torch
@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_far_padding_on_every_dtype(dtype):
    """A padding past the input and the kernel's span (most windows lie wholly in it),
    in every dtype, bfloat16 included, equals the literal loops; the second call of the
    same signature (the front end's bound launcher) gives the same bits."""
    import torch

    rng = np.random.default_rng(4)
    H, W, k, s, p = 3, 2, (2, 1), (1, 2), (1, 4)
    Ho, Wo = H + 2 * p[0] - k[0] + 1, (W + 2 * p[1] - k[1]) // s[1] + 1
    t = getattr(torch, dtype)
    mu = torch.from_numpy(rng.standard_normal((1, 2, H, W))).to(t)
    gamma = torch.from_numpy(rng.standard_normal((1, 2, H, W, H, W))).to(t)
    out0 = torch.from_numpy(rng.standard_normal((1, 2, Ho, Wo, Ho, Wo))).to(t)
    want = op_loops(to_f64(out0), to_f64(gamma), to_f64(mu), np.array([0.5, -2.0]), *k, s, p)
    c = torch.tensor([0.5, -2.0], dtype=t)
    tol = {"bfloat16": 3e-2, "float16": 3e-3, "float32": 1e-5}[dtype]
    results = []
    for _ in range(2):
        out = out0.clone()
        convcov.accumulate(out, gamma, mu, c, k, stride=s, padding=p, backend="numba")
        np.testing.assert_allclose(to_f64(out), want, rtol=tol, atol=tol * np.abs(want).max())
        results.append(to_f64(out))
    np.testing.assert_array_equal(results[0], results[1])


# ------------------------------------------------------------------ a probe that raises
class _ProbeRaises(Backend):
    name, device = "probe_raises", "cpu"

    def _probe(self):
        raise RuntimeError("driver exploded")

    def accumulate(self, p):  # pragma: no cover - never selected
        raise AssertionError("an unavailable backend was called")


def test_a_plugin_whose_probe_raises_is_listed_unavailable():
    convcov.register_backend(_ProbeRaises())
    try:
        row = {b.name: b for b in convcov.backends()}["probe_raises"]
        assert not row.available and "driver exploded" in row.reason
        out = np.zeros((1, 1, 2, 2, 2, 2))
        mu = np.arange(16.0).reshape(1, 1, 4, 4)
        convcov.accumulate(out, None, mu, 1.0, 3, backend="probe_raises,numpy")
        np.testing.assert_array_equal(out, op_loops(np.zeros_like(out), None, mu,
                                                    np.ones(1), 3, 3))
        with pytest.raises(convcov.BackendError, match="driver exploded"):
            convcov.accumulate(out, None, mu, 1.0, 3, backend="probe_raises")
    finally:
        _registry.unregister("probe_raises")


# ------------------------------------------------------------------ bound signatures
@pytest.mark.parametrize("kind", _host_kinds())
def test_a_bound_signature_called_with_other_strides(kind):
    """Calls of one shape, repeated (so the front end binds the signature), then a view of
    the same shape with other strides (every other element of a wider buffer, and a
    transposed layout): each gives the reference, the off-diagonal and the memory between
    the view's elements untouched."""
    rng = np.random.default_rng(4)
    B, Ci, Co, H, k = 2, 3, 2, 6, 3
    Ho = H - k + 1
    shape = (B, Co, Ho, Ho, Co, Ho, Ho)
    gamma = rng.random((B, Ci, H, H, H, H)).astype(np.float32)
    mu = rng.standard_normal((B, Ci, H, H)).astype(np.float32)
    c = (rng.random(Co) + 0.5).astype(np.float32)
    out0 = rng.standard_normal(shape).astype(np.float32)
    want = convcov.accumulate(out0.astype(np.float64), gamma.astype(np.float64),
                              mu.astype(np.float64), c.astype(np.float64), k, backend="numpy")
    off = np.ones(shape, bool)
    for c0 in range(Co):
        off[:, c0, :, :, c0] = False
    wide = np.full(shape[:-1] + (2 * Ho,), 7.0, np.float32)
    wide[..., ::2] = out0
    views = [out0.copy() for _ in range(3)] + [wide[..., ::2], np.asfortranarray(out0)]
    for v in views:
        t = _as(kind, v)
        convcov.accumulate(t, _as(kind, gamma), _as(kind, mu), _as(kind, c), k,
                           backend="numba")
        np.testing.assert_allclose(v, want, rtol=1e-5, atol=1e-5)
        np.testing.assert_array_equal(v[off], out0[off])
    assert (wide[..., 1::2] == 7.0).all()


# ------------------------------------------------------------------ one rounding into 16 bits
def _round_to(x, bits):
    """x (float64, normal range) rounded to ``bits`` significant bits, half to even."""
    m, e = np.frexp(x)
    return np.ldexp(np.rint(np.ldexp(m, bits)), e - bits)


def _sixteen_bit_cases():
    cases = [("numpy", "numpy", "float16")]
    if HAS_TORCH:
        cases += [("numba", "torch", d) for d in ("float16", "bfloat16")]
    if torch_cuda():
        cases += [(b.name, "torch_cuda", d) for b in convcov.backends()
                  if b.device == "cuda" and b.available for d in ("float16", "bfloat16")]
    return [pytest.param(*c, id="-".join(c)) for c in cases]


@pytest.mark.parametrize("backend, kind, out_dtype", _sixteen_bit_cases())
@pytest.mark.parametrize("acc", ["float64", "float32"])
def test_sums_reach_16_bit_out_with_one_rounding(backend, kind, out_dtype, acc):
    """out + term with term = (half a step of out's format) + a little: one correct
    rounding of the sum goes away from out, a rounding to float32 first (from float64
    sums) lands on the tie and goes to even, back to out. Both signs; plus random terms,
    whose expected value is the sum in the accumulation dtype rounded once."""
    bits = {"float16": 11, "bfloat16": 8}[out_dtype]
    rng = np.random.default_rng(5)
    n = 8  # k = 1: S[i0, j0, i1, j1] is gamma[x0, y0, x1, y1], so each term is set directly
    e = rng.integers(-3, 4, (1, 1, n, n, n, n))
    even = 2 * rng.integers(0, 2 ** (bits - 2), e.shape)
    sign = rng.choice([-1.0, 1.0], e.shape)
    a = sign * np.ldexp(1 + even / 2.0 ** (bits - 1), e)  # even last bit: ties go to a
    half = np.ldexp(1.0, e - bits)
    little = half * 2.0 ** (-30 if acc == "float64" else -8)
    term = sign * (half + little)
    rand = rng.random(e.shape) < 0.5
    term[rand] = rng.standard_normal(rand.sum()) * half[rand] * 4
    term = term.astype(acc)
    if backend == "numpy" or acc == "float64":
        want = _round_to(a + term.astype(np.float64), bits)
    else:
        want = _round_to((a.astype(np.float32) + term).astype(np.float64), bits)
    assert (want[~rand] == a[~rand] + sign[~rand] * 2 * half[~rand]).all()  # away from a
    if kind == "numpy":
        out = a.astype(np.float16)
        gamma, mu = term, np.zeros((1, 1, n, n), acc)
    else:
        import torch

        dev = "cuda" if kind == "torch_cuda" else "cpu"
        out = torch.tensor(a, dtype=getattr(torch, out_dtype), device=dev)
        gamma = torch.tensor(term, device=dev)
        mu = torch.zeros((1, 1, n, n), dtype=getattr(torch, acc), device=dev)
    assert (to_f64(out) == a).all()
    convcov.accumulate(out, gamma, mu, 1.0, 1, backend=backend)
    got = to_f64(out)
    assert (got == want).all(), f"{(got != want).sum()} of {got.size} elements off"
