"""The numpy reference against literal loops: the seed's own op_slow and its generalisation.

Also the invariants the fast backends lean on: S is symmetric for a symmetric gamma,
patch_moment is accumulate's factored form, and every backend agrees on the seed's example.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import convcov
from convcov import _registry

from kinds import HAS_TORCH, kinds_for, make, op_loops, to_f64


def op_slow(input, gamma, mu, c, weight_shape):
    """Verbatim from the seed thread (only the loop variable names are kept as they were)."""
    for bi in range(input.shape[0]):
        for c0 in range(input.shape[1]):
            for i0 in range(input.shape[2]):
                for j0 in range(input.shape[3]):
                    for i0p in range(input.shape[5]):
                        for j0p in range(input.shape[6]):
                            for ci in range(weight_shape[1]):
                                for ii in range(weight_shape[2]):
                                    for ji in range(weight_shape[3]):
                                        input[bi, c0, i0, j0, c0, i0p, j0p] += c[c0] * (
                                            mu[bi, ci, i0 + ii, j0 + ji] * mu[bi, ci, i0p + ii, j0p + ji]  # noqa: E501 (the seed's lines)
                                            + gamma[bi, ci, i0 + ii, j0 + ji, ci, i0p + ii, j0p + ji])  # noqa: E501
    return input


@pytest.fixture(scope="module")
def seed_case():
    """The seed's toy example: input (2,3,7,7,3,7,7), gamma (2,3,9,9,3,9,9), mu (2,3,9,9)."""
    rng = np.random.default_rng(2022)
    inp = rng.random((2, 3, 7, 7, 3, 7, 7)).astype(np.float32)
    gamma = rng.random((2, 3, 9, 9, 3, 9, 9)).astype(np.float32)
    mu = rng.random((2, 3, 9, 9)).astype(np.float32)
    c = np.full(3, 1.0, np.float32)
    ref = op_slow(inp.astype(np.float64), gamma.astype(np.float64), mu.astype(np.float64),
                  c.astype(np.float64), [3, 3, 3, 3])
    return inp, gamma, mu, c, ref


def _host_backends():
    return [n for n in _registry.names() if _registry.get(n).device == "cpu"]


@pytest.mark.parametrize("name", _host_backends())
def test_seed_example_equals_op_slow(seed_case, name):
    if _registry.get(name).unavailable_reason():
        pytest.skip(_registry.get(name).unavailable_reason())
    inp, gamma, mu, c, ref = seed_case
    out = inp.copy()
    convcov.accumulate(out, gamma, mu, c, [3, 3, 3, 3], backend=name)
    # float32 rounding: 54 float32 products summed into values ~30
    np.testing.assert_allclose(out, ref, rtol=2e-6, atol=0)


def test_seed_example_default_backend_with_torch(seed_case):
    torch = pytest.importorskip("torch")
    inp, gamma, mu, _, ref = seed_case
    out = torch.from_numpy(inp.copy())
    # as in the seed: a 0-d tensor c, and the weight shape as kernel_size
    res = convcov.accumulate(out, torch.from_numpy(gamma), torch.from_numpy(mu),
                             torch.tensor(1.0), [3, 3, 3, 3])
    assert res is out
    np.testing.assert_allclose(out.numpy(), ref, rtol=2e-6, atol=0)


@st.composite
def tiny(draw):
    G = draw(st.integers(1, 2))
    Ci, Co = G * draw(st.integers(1, 2)), G * draw(st.integers(1, 2))
    kh, kw = draw(st.integers(1, 3)), draw(st.integers(1, 3))
    s = (draw(st.integers(1, 2)), draw(st.integers(1, 2)))
    p = (draw(st.integers(0, 2)), draw(st.integers(0, 2)))
    d = (draw(st.integers(1, 2)), draw(st.integers(1, 2)))
    H = draw(st.integers(max(1, d[0] * (kh - 1) + 1 - 2 * p[0]), d[0] * (kh - 1) + 3))
    W = draw(st.integers(max(1, d[1] * (kw - 1) + 1 - 2 * p[1]), d[1] * (kw - 1) + 3))
    return dict(B=draw(st.integers(1, 2)), Ci=Ci, Co=Co, G=G, k=(kh, kw), s=s, p=p, d=d,
                H=H, W=W, full_out=draw(st.booleans()),
                gamma=draw(st.sampled_from(["full", "diag", None])),
                seed=draw(st.integers(0, 2**31)))


@settings(max_examples=150)
@given(case=tiny())
def test_reference_equals_literal_loops(case):
    rng = np.random.default_rng(case["seed"])
    B, Ci, Co, G, H, W = (case[k] for k in ("B", "Ci", "Co", "G", "H", "W"))
    (kh, kw), (sh, sw), (ph, pw), (dh, dw) = case["k"], case["s"], case["p"], case["d"]
    Ho = (H + 2 * ph - dh * (kh - 1) - 1) // sh + 1
    Wo = (W + 2 * pw - dw * (kw - 1) - 1) // sw + 1
    out = rng.standard_normal((B, Co, Ho, Wo, Co, Ho, Wo) if case["full_out"]
                              else (B, Co, Ho, Wo, Ho, Wo))
    gamma = {"full": lambda: rng.random((B, Ci, H, W, Ci, H, W)),
             "diag": lambda: rng.random((B, Ci, H, W, H, W)),
             None: lambda: None}[case["gamma"]]()
    mu = rng.standard_normal((B, Ci, H, W))
    c = rng.random(Co)
    want = op_loops(out, gamma, mu, c, kh, kw, case["s"], case["p"], case["d"], G)
    got = convcov.accumulate(out.copy(), gamma, mu, c, case["k"], stride=case["s"],
                             padding=case["p"], dilation=case["d"], groups=G, backend="numpy")
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)


def _symmetric_gamma(rng, B, Ci, H, W):
    a = rng.standard_normal((B, Ci, H * W, H * W))
    return (a @ a.transpose(0, 1, 3, 2)).reshape(B, Ci, H, W, H, W)


@pytest.mark.parametrize("name", _registry.names())
def test_patch_moment_symmetric_and_factored(name):
    """S is symmetric in (i0, j0) <-> (i1, j1) for a symmetric gamma, and accumulate adds
    exactly c[c0] * S[:, g(c0)] on the diagonal and nothing elsewhere."""
    b = _registry.get(name)
    if b.unavailable_reason():
        pytest.skip(b.unavailable_reason())
    kind = (kinds_for(b.device) or [None])[0]
    if kind is None:
        pytest.skip(f"no {b.device} arrays here")
    rng = np.random.default_rng(7)
    B, Ci, Co, G, H, W = 2, 4, 6, 2, 6, 5
    args = dict(stride=(1, 2), padding=(1, 0), dilation=(2, 1), groups=G)
    gamma = _symmetric_gamma(rng, B, Ci, H, W)
    mu = rng.standard_normal((B, Ci, H, W))
    S = to_f64(convcov.patch_moment(make(gamma, kind, "float64"), make(mu, kind, "float64"),
                                    (2, 3), backend=name, **args))
    Ho, Wo = 6, 2  # (6 + 2 - 2 - 1) // 1 + 1, (5 - 2 - 1) // 2 + 1
    assert S.shape == (B, G, Ho, Wo, Ho, Wo)
    np.testing.assert_allclose(S, S.transpose(0, 1, 4, 5, 2, 3), rtol=1e-12, atol=1e-12)

    out0 = rng.standard_normal((B, Co, Ho, Wo, Co, Ho, Wo))
    c = rng.random(Co)
    out = make(out0, kind, "float64")
    convcov.accumulate(out, make(gamma, kind, "float64"), make(mu, kind, "float64"),
                       make(c, kind, "float64"), (2, 3), backend=name, **args)
    want = out0.copy()
    for c0 in range(Co):
        want[:, c0, :, :, c0] += c[c0] * S[:, c0 // (Co // G)]
    np.testing.assert_allclose(to_f64(out), want, rtol=1e-12, atol=1e-12)


def test_patch_moment_dtype_and_kind():
    mu16 = np.ones((1, 2, 4, 4), np.float16)
    assert convcov.patch_moment(None, mu16, 3, backend="numpy").dtype == np.float32
    assert convcov.patch_moment(np.ones((1, 2, 4, 4, 4, 4)), mu16, 3,
                                backend="numpy").dtype == np.float64
    if HAS_TORCH:
        import torch

        S = convcov.patch_moment(None, torch.ones(1, 2, 4, 4), (1, 2, 3, 3))
        assert isinstance(S, torch.Tensor) and S.dtype == torch.float32
        assert float(S[0, 0, 0, 0, 0, 0]) == 2 * 9


@pytest.mark.parametrize("backend", ["numpy", "numba"])
def test_empty_dimensions_are_a_no_op(backend):
    """No batch, no output channel, no input channel, or an input of no positions (its
    windows all in the padding): out stays bit-identical, -0.0 included (adding c * 0
    would make it +0.0), with a Python-number c and with a c array."""
    for B, Ci, Co, H in [(0, 2, 2, 4), (2, 0, 2, 4), (2, 2, 0, 4), (2, 2, 2, 0)]:
        for c in (1.0, np.full(Co, 2.0)):
            pad = 2 if H == 0 else 0
            Ho = H + 2 * pad - 2
            out = np.full((B, Co, Ho, Ho, Co, Ho, Ho), -0.0)
            gamma = np.ones((B, Ci, H, H, H, H))
            res = convcov.accumulate(out, gamma, np.ones((B, Ci, H, H)), c, 3, padding=pad,
                                     backend=backend)
            assert res is out
            assert out.size == 0 or np.signbit(out).all(), (B, Ci, Co, H)


def test_nonfinite_propagate_and_padding_does_not_poison():
    mu = np.zeros((1, 1, 3, 3))
    mu[0, 0, 0, 0] = np.inf
    out = np.zeros((1, 1, 3, 3, 3, 3))
    convcov.accumulate(out, None, mu, 1.0, 3, padding=1, backend="numpy")
    # out[.., i0, j0, i1, j1] meets the Inf only where both windows hold it...
    assert np.isinf(out[0, 0, 0, 0, 0, 0]) and out[0, 0, 0, 0, 0, 0] > 0
    # ...and where one window holds Inf against a real 0 of the input: Inf * 0 = NaN
    assert np.isnan(out[0, 0, 0, 0, 1, 1])
    # while windows that only meet it against the padding stay finite: the term is absent
    assert out[0, 0, 2, 2, 2, 2] == 0.0
    nan_mu = np.ones((1, 1, 3, 3))
    nan_mu[0, 0, 1, 1] = np.nan
    out = np.zeros((1, 1, 1, 1, 1, 1))
    convcov.accumulate(out, None, nan_mu, 1.0, 3, backend="numpy")
    assert np.isnan(out).all()


def _cuda_kind_cases():
    backends = [b for b in convcov.backends() if b.device == "cuda" and b.available]
    kinds = kinds_for("cuda")
    if not backends or not kinds:
        return [pytest.param(None, None, marks=pytest.mark.skip(reason="no CUDA backend here"))]
    return [pytest.param(b.name, k, id=f"{b.name}-{k}") for b in backends for k in kinds]


@pytest.mark.parametrize("name, kind", _cuda_kind_cases())
def test_patch_moment_on_every_cuda_kind(name, kind):
    """S comes back in mu's library, on its device, float32 for float32 inputs, and equal
    to the reference: torch CUDA tensors, CuPy arrays and numba device arrays alike."""
    rng = np.random.default_rng(8)
    gamma = rng.standard_normal((2, 4, 6, 5, 6, 5))
    mu = rng.standard_normal((2, 4, 6, 5))
    args = dict(stride=(2, 1), padding=(1, 1), dilation=(1, 2), groups=2)
    g, m = make(gamma, kind, "float32"), make(mu, kind, "float32")
    S = convcov.patch_moment(g, m, 3, backend=name, **args)
    assert type(S).__module__.split(".")[0] == type(m).__module__.split(".")[0], type(S)
    if kind.startswith("torch"):
        assert S.device == m.device and str(S.dtype) == "torch.float32"
    else:
        assert str(np.dtype(S.dtype)) == "float32"
    want = convcov.patch_moment(to_f64(g), to_f64(m), 3, backend="numpy", **args)
    np.testing.assert_allclose(to_f64(S), want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
