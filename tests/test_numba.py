"""Tests specific to the ``numba`` backend (convcov/backends/numba.py).

The shared property test (test_properties.py) already compares every backend with the
numpy reference on random problems; this file covers what is particular to this one:
the float16 / bfloat16 bit conversions (exhaustively where possible), rounding once
into 16-bit outputs, torch bfloat16 CPU tensors, concurrent calls from several threads
and after a fork, any strides (negative ones too), the literal-loop ground truth,
non-finite values next to the padding, a result apart from out (dask's tasks), the walk
split into segments with both prefetches on, and that one compile serves every shape;
and the backward (``patch_moment_vjp``) against the numpy reference's: layouts, strides
(zero and negative), dtypes, non-finite values next to the padding, chunks, threads. The
cases cover windows that overlap (stride 1), strides with gaps between the
windows, padding wider than the kernel, and a large input with a small output, which
must not take memory of the order of the input's (H*W)**2.
"""

from __future__ import annotations

import itertools
import math
import os
import subprocess
import sys
import textwrap
import tracemalloc

import numpy as np
import pytest

numba = pytest.importorskip("numba")

import convcov  # noqa: E402
from convcov.backends import numba as nbb  # noqa: E402
from kinds import at_once, op_loops  # noqa: E402

pytestmark = [
    pytest.mark.skipif(nbb.backend.unavailable_reason() is not None,
                       reason="numba backend unavailable"),
    # the references cast overflowing and NaN values on purpose
    pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning",
                               "ignore:invalid value encountered:RuntimeWarning"),
]


# --------------------------------------------------------------------------- references
def _pair(v):
    return (v, v) if np.isscalar(v) else tuple(v)


def _geometry(H, W, k, stride, padding, dilation):
    """The conv parameters as pairs, and (Ho, Wo) as torch's conv2d gives them."""
    (kh, kw), (sh, sw), (ph, pw), (dh, dw) = map(_pair, (k, stride, padding, dilation))
    Ho = (H + 2 * ph - dh * (kh - 1) - 1) // sh + 1
    Wo = (W + 2 * pw - dw * (kw - 1) - 1) // sw + 1
    return (kh, kw), (sh, sw), (ph, pw), (dh, dw), Ho, Wo


def op_slow(out, gamma, mu, c, k, stride=1, padding=0, dilation=1, groups=1):
    """The literal float64 loops of tests/kinds.py, taking convcov's argument forms."""
    f64 = lambda a: None if a is None else np.asarray(a, np.float64)  # noqa: E731
    out = f64(out)
    c = np.broadcast_to(f64(c), (out.shape[1],))
    return op_loops(out, f64(gamma), f64(mu), c, *_pair(k), _pair(stride), _pair(padding),
                    _pair(dilation), groups)


def round_exact(d, mant_bits, min_exp, max_finite):
    """Round float64 values to a binary format with ``mant_bits`` significand bits
    (implicit bit included), smallest quantum 2**min_exp, round half to even; exact,
    element by element, with Python floats (no library conversion is trusted here)."""
    out = np.empty_like(np.asarray(d, np.float64))
    for i, v in enumerate(np.asarray(d, np.float64).ravel()):
        if not math.isfinite(v) or v == 0:
            out.flat[i] = v
            continue
        _, e = math.frexp(abs(v))  # abs(v) = m * 2**e, 0.5 <= m < 1
        q = 2.0 ** max(e - mant_bits, min_exp)
        lo = math.floor(abs(v) / q) * q  # exact: both are powers of two times integers
        hi = lo + q
        mid = lo + q / 2
        r = lo if abs(v) < mid else hi if abs(v) > mid else (lo if (lo / q) % 2 == 0 else hi)
        if r > max_finite:
            r = math.inf
        out.flat[i] = math.copysign(r, v)
    return out


def to_f16_exact(d):
    return round_exact(d, 11, -24, 65504.0)


def to_bf16_exact(d):
    return round_exact(d, 8, -133, float(np.float32(3.3895313892515355e38)))


def bf16_bits_to_f64(bits):
    return (np.asarray(bits, np.uint32) << 16).view(np.float32).astype(np.float64)


def f64_to_bf16_bits(d):
    """Exactly rounded bf16 bits of float64 values (via the exact rounding above)."""
    return (np.asarray(to_bf16_exact(d), np.float32).view(np.uint32) >> 16).astype(np.uint16)


# --------------------------------------------------------------------------- conversions
@numba.njit
def _decode_all(bits, how):
    """how: 0 float16 as the kernel does it, 1 float16 by integer arithmetic, 2 bfloat16."""
    out = np.empty(bits.shape[0], np.float32)
    for i in range(bits.shape[0]):
        if how == 0:
            out[i] = nbb._f16_decode(bits[i])
        elif how == 1:
            out[i] = nbb._f16_decode_bits(bits[i])
        else:
            out[i] = nbb._bf16_decode(bits[i])
    return out


@numba.njit
def _encode_all(x, how):
    """how: 0 float16 as the kernel does it (float32 or float64 in), 1 float16 by integer
    arithmetic (float32 in), 2 bfloat16."""
    out = np.empty(x.shape[0], np.uint16)
    for i in range(x.shape[0]):
        if how == 0:
            out[i] = nbb._f16_encode(x[i])
        elif how == 1:
            out[i] = nbb._f16_encode32_bits(np.float32(x[i]))
        else:
            out[i] = nbb._bf16_encode(x[i])
    return out


def _same_bits_or_both_nan(got_f64, ref_f64):
    got, ref = np.asarray(got_f64, np.float64), np.asarray(ref_f64, np.float64)
    both_nan = np.isnan(got) & np.isnan(ref)
    same = (got == ref) & (np.signbit(got) == np.signbit(ref))
    return both_nan | same


@pytest.mark.parametrize("how", [0, 1], ids=["kernel", "integer"])
def test_float16_decode_every_bit_pattern(how):
    bits = np.arange(2**16, dtype=np.uint16)
    got = _decode_all(bits, how)
    ref = bits.view(np.float16).astype(np.float32)
    assert _same_bits_or_both_nan(got, ref).all()


def test_bfloat16_decode_every_bit_pattern():
    bits = np.arange(2**16, dtype=np.uint16)
    got = _decode_all(bits, 2)
    ref = (bits.astype(np.uint32) << 16).view(np.float32)
    assert (got.view(np.uint32) == ref.view(np.uint32)).all()


def _hard_float32_values(rng):
    """Every float16 value, every midpoint between neighbours (ties), one float32 ulp on
    either side of each midpoint, the overflow boundary, specials and random values."""
    f16 = np.arange(2**16, dtype=np.uint16).view(np.float16)
    f16 = f16[np.isfinite(f16)].astype(np.float64)
    f16 = np.unique(f16)
    mids = ((f16[:-1] + f16[1:]) / 2).astype(np.float32)
    near = np.concatenate([np.nextafter(mids, np.float32(np.inf)),
                           np.nextafter(mids, np.float32(-np.inf))])
    special = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 65504, 65519.99, 65520, 65536,
                        1e-8, 2.0**-25, 2.0**-24, 3 * 2.0**-26, 1e30, -1e30, 3.4e38],
                       np.float32)
    rand = (rng.standard_normal(200_000) * np.exp(rng.uniform(-40, 40, 200_000))).astype(
        np.float32)
    return np.concatenate([f16.astype(np.float32), mids, near, special, rand])


@pytest.mark.parametrize("how", [0, 1], ids=["kernel", "integer"])
def test_float16_encode_float32_round_to_nearest_even(how):
    x = _hard_float32_values(np.random.default_rng(1))
    got = _encode_all(x, how).view(np.float16).astype(np.float64)
    ref = x.astype(np.float16).astype(np.float64)  # numpy: correctly rounded, RNE
    assert _same_bits_or_both_nan(got, ref).all()
    assert np.isnan(got[np.isnan(x)]).all()


def test_float16_encode_float64_rounds_once():
    """With float64 accumulation the result must be rounded once, not float64 -> float32
    -> float16 (double rounding): values just above a float16 tie, closer than a float32
    ulp, expose the difference."""
    rng = np.random.default_rng(2)
    f16 = np.unique(np.arange(2**15, dtype=np.uint16).view(np.float16)
                    [:31744].astype(np.float64))  # positive finite values
    mids = (f16[:-1] + f16[1:]) / 2
    eps = np.abs(mids) * 2.0**-40
    x = np.concatenate([mids + eps, mids - eps, -(mids + eps), mids,
                        rng.standard_normal(50_000) * np.exp(rng.uniform(-20, 12, 50_000))])
    got = _encode_all(x, 0).view(np.float16).astype(np.float64)
    ref = to_f16_exact(x)
    assert _same_bits_or_both_nan(got, ref).all()
    # The test can fail: the two-step rounding gets these wrong.
    two_step = x.astype(np.float32).astype(np.float16).astype(np.float64)
    assert (two_step != ref).sum() > 1000


def test_bfloat16_encode_round_to_nearest_even():
    rng = np.random.default_rng(3)
    bf = np.unique(bf16_bits_to_f64(np.arange(0, 0x7F80, 7, dtype=np.uint16)))
    mids = (bf[:-1] + bf[1:]) / 2
    x32 = np.concatenate([mids.astype(np.float32),
                          np.nextafter(mids.astype(np.float32), np.float32(np.inf)),
                          np.nextafter(mids.astype(np.float32), np.float32(-np.inf)),
                          (rng.standard_normal(100_000)
                           * np.exp(rng.uniform(-80, 80, 100_000))).astype(np.float32),
                          np.array([np.inf, -np.inf, 3.3895e38, -3.4e38, 1e-40, -0.0],
                                   np.float32)])
    got = _encode_all(x32, 2)
    assert (got == f64_to_bf16_bits(x32.astype(np.float64))).all()
    x64 = np.concatenate([mids * (1 + 2.0**-40), mids * (1 - 2.0**-40)])
    assert (_encode_all(x64, 2) == f64_to_bf16_bits(x64)).all()
    nan_bits = _encode_all(np.array([np.nan, -np.nan], np.float32), 2)
    assert np.isnan(bf16_bits_to_f64(nan_bits)).all()


# --------------------------------------------------------------------------- the operation
def _problem(rng, B, Ci, Co, H, W, k, stride=1, padding=0, dilation=1, groups=1,
             full=True, gamma=True, c_kind="array", dtype=np.float64):
    (kh, kw), (sh, sw), (ph, pw), (dh, dw), Ho, Wo = _geometry(H, W, k, stride, padding,
                                                               dilation)
    out = rng.standard_normal((B, Co, Ho, Wo, Co, Ho, Wo) if full
                              else (B, Co, Ho, Wo, Ho, Wo)).astype(dtype)
    g = (rng.standard_normal((B, Ci, H, W, Ci, H, W) if full else (B, Ci, H, W, H, W))
         .astype(dtype) if gamma else None)
    mu = rng.standard_normal((B, Ci, H, W)).astype(dtype)
    c = {"array": rng.standard_normal(Co).astype(dtype), "scalar": 0.75,
         "0d": np.array(1.25, dtype)}[c_kind]
    kwargs = dict(stride=stride, padding=padding, dilation=dilation, groups=groups)
    return out, g, mu, c, (kh, kw), kwargs


CASES = {
    "seed": dict(B=2, Ci=3, Co=3, H=5, W=5, k=3),
    "stride-pad": dict(B=1, Ci=2, Co=2, H=6, W=5, k=3, stride=2, padding=1),
    "dilation-groups": dict(B=1, Ci=4, Co=6, H=6, W=7, k=(2, 3), dilation=(2, 1),
                            padding=(1, 2), groups=2),
    "diag-no-gamma": dict(B=2, Ci=2, Co=4, H=5, W=4, k=(3, 2), stride=(1, 2), full=False,
                          gamma=False, c_kind="scalar"),
    "depthwise-0d-c": dict(B=1, Ci=3, Co=3, H=5, W=5, k=3, padding=2, groups=3, full=False,
                           c_kind="0d"),
    "kernel-larger-than-input": dict(B=1, Ci=1, Co=2, H=2, W=3, k=3, padding=(2, 1)),
    # five channels per group: four at a time, then one (the kernel's two paths)
    "five-channels": dict(B=1, Ci=5, Co=2, H=5, W=6, k=3, padding=1),
    "five-channels-no-gamma": dict(B=1, Ci=10, Co=4, H=4, W=5, k=2, groups=2, gamma=False,
                                   full=False),
    # strides larger than the kernel: gaps between the windows, inputs much larger than
    # the output (two channels a group; five: four at a time, then one; mu alone)
    "gaps": dict(B=2, Ci=4, Co=4, H=9, W=8, k=2, stride=(4, 3), padding=(1, 2), groups=2),
    "gaps-dilation-five": dict(B=1, Ci=10, Co=4, H=11, W=10, k=3, stride=(5, 4), padding=2,
                               dilation=(2, 3), groups=2, full=False),
    "gaps-no-gamma": dict(B=1, Ci=8, Co=2, H=12, W=9, k=3, stride=4, padding=1, gamma=False,
                          full=False),
    # padding wider than the kernel reaches: output rows and columns whose every term
    # lies in the padding, and T's rows wider than the input
    "wide-padding": dict(B=1, Ci=6, Co=3, H=4, W=5, k=(2, 3), stride=(1, 2),
                         padding=(3, 4), groups=3, full=False),
    # a kernel much wider than tall, and taller than wide
    "1x7": dict(B=1, Ci=2, Co=2, H=9, W=10, k=(1, 7), padding=(0, 3), dilation=(1, 2)),
    "7x1": dict(B=2, Ci=3, Co=3, H=10, W=6, k=(7, 1), stride=(2, 1), padding=(3, 0)),
}


@pytest.mark.parametrize("case", CASES)
def test_matches_literal_loops_float64(case):
    out, g, mu, c, k, kw = _problem(np.random.default_rng(4), **CASES[case])
    ref = op_slow(out, g, mu, c, k, **kw)
    got = convcov.accumulate(out.copy(), g, mu, c, k, backend="numba", **kw)
    np.testing.assert_allclose(got, ref, rtol=1e-12, atol=1e-12)


def test_patch_moment_matches_reference():
    _, g, mu, _, k, kw = _problem(np.random.default_rng(5), **CASES["dilation-groups"])
    S = convcov.patch_moment(g, mu, k, backend="numba", **kw)
    ref = convcov.patch_moment(g, mu, k, backend="numpy", **kw)
    assert S.dtype == np.float64 and S.shape == ref.shape
    np.testing.assert_allclose(S, ref, rtol=1e-12, atol=1e-12)


def _within_one_step(got, exact, to_exact, mant_bits, min_exp):
    """|got - round(exact)| <= one step of the 16-bit format there, element-wise."""
    got = np.asarray(got, np.float64)
    ref = to_exact(exact)
    _, e = np.frexp(np.maximum(np.abs(got), np.abs(ref)))
    step = np.ldexp(1.0, np.maximum(e - mant_bits, min_exp))
    return np.abs(got - ref) <= step


@pytest.mark.parametrize("case", ["seed", "stride-pad", "dilation-groups", "five-channels",
                                  "five-channels-no-gamma", "gaps", "gaps-dilation-five",
                                  "gaps-no-gamma"])
def test_float16_everywhere_rounded_once_from_float32_sums(case):
    rng = np.random.default_rng(6)
    out, g, mu, c, k, kw = _problem(rng, dtype=np.float16, **CASES[case])
    exact = op_slow(out, g, mu, c, k, **kw)  # float64 sums of the float16 inputs
    got = convcov.accumulate(out.copy(), g, mu, c, k, backend="numba", **kw)
    assert got.dtype == np.float16
    ref16 = to_f16_exact(exact)
    # Sums in float32 then one rounding: equal to the exactly rounded value, or one
    # float16 step away where the float32 sum sits within float32 error of a tie.
    assert _within_one_step(got, exact, to_f16_exact, 11, -24).all()
    assert (got.astype(np.float64) == ref16).mean() > 0.97


@pytest.mark.parametrize("case", ["stride-pad", "five-channels", "gaps-dilation-five"])
def test_mixed_dtypes_float64_accumulation(case):
    rng = np.random.default_rng(7)
    out, g, mu, c, k, kw = _problem(rng, **CASES[case])
    out16, g32, mu64 = out.astype(np.float16), g.astype(np.float32), mu
    exact = op_slow(out16, g32, mu64, c.astype(np.float16), k, **kw)
    got = convcov.accumulate(out16.copy(), g32, mu64, c.astype(np.float16), k,
                             backend="numba", **kw)
    # float64 in the mix: float64 sums, one correct rounding into float16.
    np.testing.assert_array_equal(got.astype(np.float64), to_f16_exact(exact))


@pytest.mark.parametrize("case", ["dilation-groups", "five-channels", "gaps"])
def test_torch_bfloat16_cpu_tensors_in_place(case):
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(8)
    out, g, mu, c, k, kw = _problem(rng, **CASES[case])

    def to_bf(a):
        return torch.from_numpy(np.asarray(a, np.float32)).to(torch.bfloat16)

    def as64(t):
        return t.to(torch.float64).numpy()

    out_t, g_t, mu_t, c_t = to_bf(out), to_bf(g), to_bf(mu), to_bf(c)
    exact = op_slow(as64(out_t), as64(g_t), as64(mu_t), as64(c_t), k, **kw)
    before = out_t.clone()
    ptr = out_t.data_ptr()
    res = convcov.accumulate(out_t, g_t, mu_t, c_t, k, backend="numba", **kw)
    assert res is out_t and out_t.data_ptr() == ptr and out_t.dtype == torch.bfloat16
    got = as64(out_t)
    ref = to_bf16_exact(exact)
    assert _within_one_step(got, exact, to_bf16_exact, 8, -133).all()
    assert (got == ref).mean() > 0.97
    # only the channel diagonal changed
    off = np.ones(out.shape, bool)
    for c0 in range(out.shape[1]):
        off[:, c0, :, :, c0] = False
    assert torch.equal(out_t.view(torch.int16)[torch.from_numpy(off)],
                       before.view(torch.int16)[torch.from_numpy(off)])


def test_off_diagonal_untouched_bitwise():
    rng = np.random.default_rng(9)
    out, g, mu, c, k, kw = _problem(rng, dtype=np.float32, **CASES["seed"])
    out[0, 0, 0, 0, 1, 0, 0] = np.nan  # an off-diagonal NaN must stay exactly as it is
    before = out.copy()
    convcov.accumulate(out, g, mu, c, k, backend="numba", **kw)
    changed = out.view(np.uint32) != before.view(np.uint32)
    for c0 in range(out.shape[1]):
        changed[:, c0, :, :, c0] = False
    assert not changed.any()
    assert (out[:, 1, :, :, 1] != before[:, 1, :, :, 1]).any()  # the diagonal did change


@pytest.mark.parametrize("case", ["dilation-groups", "five-channels", "gaps"])
def test_any_strides_including_negative(case):
    rng = np.random.default_rng(10)
    out, g, mu, c, k, kw = _problem(rng, dtype=np.float32, **CASES[case])
    # out: a reversed, permuted-and-back view inside a bigger array
    big_out = rng.standard_normal((out.shape[0], out.shape[1] + 1) + out.shape[2:] + (2,))
    big_out = big_out.astype(np.float32)
    view = big_out[:, :-1, ..., 0][:, ::-1, ::-1]  # negative strides on c0 and i0
    view[...] = out
    untouched = big_out[:, -1].copy(), big_out[..., 1].copy()
    # gamma: a transposed copy viewed back (non-contiguous, same values)
    g_nc = np.ascontiguousarray(g.transpose(0, 4, 5, 6, 1, 2, 3)).transpose(0, 4, 5, 6, 1, 2, 3)
    mu_nc = np.asfortranarray(mu[:, :, ::-1])[:, :, ::-1]  # F order, negative H stride
    c_nc = np.repeat(c[::-1], 2)[::-2]  # stride -2
    ref = convcov.accumulate(out.copy(), g, mu, c, k, backend="numpy", **kw)
    convcov.accumulate(view, g_nc, mu_nc, c_nc, k, backend="numba", **kw)
    np.testing.assert_allclose(view, ref, rtol=2e-5, atol=2e-5)
    np.testing.assert_array_equal(big_out[:, -1], untouched[0])
    np.testing.assert_array_equal(big_out[..., 1], untouched[1])


@pytest.mark.parametrize("case", ["stride-pad", "five-channels"])
def test_negative_strides_on_gamma_and_mu_channels(case):
    rng = np.random.default_rng(11)
    out, g, mu, c, k, kw = _problem(rng, **CASES[case])
    g_rev = np.ascontiguousarray(g[:, ::-1, :, :, ::-1])[:, ::-1, :, :, ::-1]
    mu_rev = np.ascontiguousarray(mu[:, ::-1])[:, ::-1]  # planes stay contiguous
    assert min(g_rev.strides) < 0 and min(mu_rev.strides) < 0
    ref = op_slow(out, g, mu, c, k, **kw)
    got = convcov.accumulate(out.copy(), g_rev, mu_rev, c, k, backend="numba", **kw)
    np.testing.assert_allclose(got, ref, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("case", ["stride-pad", "dilation-groups"])
def test_non_finite_values_propagate_like_the_reference(case):
    rng = np.random.default_rng(12)
    out, g, mu, c, k, kw = _problem(rng, **CASES[case])
    mu[0, 0, 0, 0] = np.inf  # next to the padding: must not become Inf * 0 = NaN there
    mu[0, 1, 3, 2] = -np.inf
    g[0, 1, 2, 2, 1, 2, 3] = np.nan
    g[0, 0, 1, 1, 1, 1, 1] = np.inf  # off the channel diagonal: never read
    ref = convcov.accumulate(out.copy(), g, mu, c, k, backend="numpy", **kw)
    got = convcov.accumulate(out.copy(), g, mu, c, k, backend="numba", **kw)
    assert np.isnan(ref).any() and np.isinf(ref).any() and np.isfinite(ref).any()
    np.testing.assert_array_equal(np.isnan(got), np.isnan(ref))
    np.testing.assert_array_equal(np.isposinf(got), np.isposinf(ref))
    np.testing.assert_array_equal(np.isneginf(got), np.isneginf(ref))
    fin = np.isfinite(ref)
    np.testing.assert_allclose(got[fin], ref[fin], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("rows", [1, 2, 3])
@pytest.mark.parametrize("full", [False, True], ids=["diag", "full"])
def test_rows_of_S_kept_before_the_update(monkeypatch, rows, full):
    """S's rows i0 formed a few at a time before each output channel's rows are updated
    in turn (S_ROWS_BYTES): one row, or a number that does not divide the 7 rows; both
    layouts, out's runs prefetched across the rows and channels."""
    from convcov import _frontend

    monkeypatch.setattr(_frontend, "_bound", {})
    monkeypatch.setattr(nbb, "PREFETCH_BYTES", 64)
    case = dict(B=1, Ci=4, Co=6, H=8, W=5, k=(2, 3), padding=(0, 1), groups=2, full=full)
    out, g, mu, c, k, kw = _problem(np.random.default_rng(21), dtype=np.float64, **case)
    Ho, Wo = 7, 5
    monkeypatch.setattr(nbb, "S_ROWS_BYTES", rows * Wo * Ho * Wo * 8)
    exact = op_slow(out, g, mu, c, k, **kw)
    got = convcov.accumulate(out.copy(), g, mu, c, k, backend="numba", **kw)
    np.testing.assert_allclose(got, exact, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("stride", [(2, 1), (1, 2), (4, 3)], ids=["rows", "columns", "gaps"])
@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.float64])
def test_segments_and_prefetching(monkeypatch, dtype, stride):
    """Small problems run as one segment of i0 a (b, g) pair; force a walk split into
    segments (rows x0 that two segments read are formed in both), prefetches of out's
    runs, on into the next block, and of gamma's rows a row y0 ahead. (Five channels a
    group: a four-channel pass, then one.)"""
    from convcov import _frontend

    monkeypatch.setattr(_frontend, "_bound", {})  # launchers bound afresh
    monkeypatch.setattr(nbb, "_threads", lambda: 23)  # a segment per one or two rows i0
    monkeypatch.setattr(nbb, "PREFETCH_BYTES", 64)
    monkeypatch.setattr(nbb, "GAMMA_PF_SPAN", 1 << 40)
    rng = np.random.default_rng(15)
    H, W = (9, 11) if stride == (4, 3) else (6, 7)
    case = dict(B=3, Ci=10, Co=4, H=H, W=W, k=3, stride=stride, padding=1, groups=2)
    out, g, mu, c, k, kw = _problem(rng, dtype=dtype, **case)
    g = np.ascontiguousarray(g[:, ::-1, :, :, ::-1])[:, ::-1, :, :, ::-1]  # negative strides
    exact = op_slow(out, g, mu, c, k, **kw)
    got = convcov.accumulate(out.copy(), g, mu, c, k, backend="numba", **kw)
    if dtype == np.float16:
        assert _within_one_step(got, exact, to_f16_exact, 11, -24).all()
    else:
        np.testing.assert_allclose(got, exact, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("streamed", [False, True], ids=["cached", "streamed"])
@pytest.mark.parametrize("dtype,gamma_dtype", [(np.float32, np.float32), (np.float16, np.float16),
                                               (np.float64, np.float64),
                                               (np.float32, np.float64)])
def test_result_apart_from_out(monkeypatch, dtype, gamma_dtype, streamed):
    """accumulate_apart (dask's tasks): the result goes to another array, out is only
    read; the same bits as the call in place, wherever the result lies in memory (its
    rows cut by cache lines anywhere, or its elements off their size) and whether it is
    streamed (non-temporal stores, as results of many MiB are) or not."""
    from convcov import _frontend
    from convcov.backends import numba as nbb

    if streamed:
        monkeypatch.setattr(nbb, "STREAM_FROM_BYTES", 0)
    rng = np.random.default_rng(16)
    case = dict(CASES["dilation-groups"], H=13, W=21)  # rows of 15 * 21 elements: lines cut them
    out, g, mu, c, k, kw = _problem(rng, dtype=dtype, **case)
    out = np.ascontiguousarray(out[:, :, :, :, 0])  # the diagonal layout
    g = g.astype(gamma_dtype)
    before = out.copy()
    want = convcov.accumulate(out.copy(), g, mu, c, k, backend="numba", **kw)
    conv = (k, kw["stride"], kw["padding"], kw["dilation"], kw["groups"])
    buf = np.empty(out.nbytes + 128, np.uint8)
    for shift in range(0, 64 + 1, out.itemsize if dtype == np.float64 else 2):
        new = buf[shift:shift + out.nbytes].view(dtype).reshape(out.shape)
        new[...] = np.nan
        got = _frontend.accumulate_apart(new, out, g, mu, c, *conv, "numba")
        assert got is new
        np.testing.assert_array_equal(out, before)
        np.testing.assert_array_equal(new, want, err_msg=f"result at byte {shift}")


def test_scalar_c_beyond_float32_does_not_make_nan():
    out = np.zeros((1, 2, 2, 2, 2, 2), np.float32)
    mu = np.zeros((1, 1, 4, 4), np.float32)
    convcov.accumulate(out, None, mu, 1e39, 3, backend="numba")
    assert (out == 0).all()  # S = 0; 1e39 as a float32 would be Inf and Inf * 0 NaN
    mu[:] = 1
    convcov.accumulate(out, None, mu, 1e-39, 3, backend="numba")
    assert np.isfinite(out).all() and (out > 0).all()


@pytest.mark.parametrize("stride", [1, 2])
@pytest.mark.parametrize("with_gamma", [True, False], ids=["gamma", "no-gamma"])
def test_non_finite_values_next_to_the_padding(stride, with_gamma):
    """A term with a position in the padding is absent, not 0 * Inf = NaN: Inf and NaN on
    the border of mu and gamma give Inf and NaN exactly where the reference has them (Q's
    zero border, T's edge columns formed apart, rows x0 and x1 in the padding skipped),
    with and without gamma."""
    rng = np.random.default_rng(8)
    mu = rng.random((1, 2, 5, 6))
    gamma = rng.random((1, 2, 5, 6, 5, 6)) * 0.1
    mu[0, 0, 0, 0] = np.inf  # a corner: its terms with the padding are absent
    gamma[0, 1, 2, 2, 0, 0] = np.nan  # position pairs that both strides reach
    gamma[0, 0, 4, 4, 2, 2] = -np.inf
    Ho, Wo = (5 + 2 - 3) // stride + 1, (6 + 2 - 3) // stride + 1
    out = rng.random((1, 2, Ho, Wo, Ho, Wo))
    kw = dict(stride=stride, padding=1)
    gamma = gamma if with_gamma else None
    ref = convcov.accumulate(out.copy(), gamma, mu, 0.5, 3, backend="numpy", **kw)
    got = convcov.accumulate(out.copy(), gamma, mu, 0.5, 3, backend="numba", **kw)
    assert np.isinf(ref).any() and np.isfinite(ref).any()
    assert np.isnan(ref).any() == with_gamma
    # assert_allclose compares the non-finite values exactly
    np.testing.assert_allclose(got, ref, rtol=1e-12, atol=0)


def test_one_compiled_kernel_per_accumulation_dtype():
    """Shapes, layouts, strides and input dtypes must not trigger new compiles."""
    rng = np.random.default_rng(13)
    for name, dt in [("seed", np.float32), ("stride-pad", np.float16),
                     ("diag-no-gamma", np.float32), ("dilation-groups", np.float64),
                     ("depthwise-0d-c", np.float64)]:
        out, g, mu, c, k, kw = _problem(rng, dtype=dt, **CASES[name])
        convcov.accumulate(out, g, mu, c, k, backend="numba", **kw)
        convcov.accumulate(out.astype(np.float32), None if g is None else g[:, ::-1],
                           mu.astype(np.float16), c, k, backend="numba", **kw)
    assert len(nbb._parallel.signatures) <= 2


# --------------------------------------------------------------------------- threads
def test_concurrent_calls_from_threads_are_correct():
    rng = np.random.default_rng(14)
    out, g, mu, c, k, kw = _problem(rng, B=2, Ci=4, Co=4, H=8, W=8, k=3, padding=1,
                                    dtype=np.float32)
    expected = convcov.accumulate(out.copy(), g, mu, c, k, backend="numba", **kw)
    n_threads, rounds = 6, 5
    outs = [[out.copy() for _ in range(rounds)] for _ in range(n_threads)]

    def work(i, start):
        start()
        for r in range(rounds):
            convcov.accumulate(outs[i][r], g, mu, c, k, backend="numba", **kw)

    at_once(n_threads, work)
    for row in outs:
        for o in row:
            np.testing.assert_array_equal(o, expected)  # same order of sums: bit-identical


_SUBPROCESS = textwrap.dedent("""
    import os, sys, threading, numpy as np, convcov
    rng = np.random.default_rng(0)
    mu = rng.standard_normal((2, 3, 7, 7)).astype(np.float32)
    g = rng.standard_normal((2, 3, 7, 7, 7, 7)).astype(np.float32)
    def call():
        out = np.zeros((2, 3, 5, 5, 5, 5), np.float32)
        return convcov.accumulate(out, g, mu, 0.5, 3, backend="numba")
    ref = convcov.accumulate(np.zeros((2, 3, 5, 5, 5, 5)), g, mu, 0.5, 3, backend="numpy")
    """)


def _run_python(code, env_extra):
    env = dict(os.environ, **env_extra)
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                          text=True, timeout=600, check=False)


def test_concurrent_calls_on_workqueue_layer_are_serialised():
    """Numba's workqueue layer aborts the process on concurrent use; the backend must
    notice that layer and serialise its own calls."""
    code = _SUBPROCESS + textwrap.dedent("""
        import numba
        res = [None] * 8
        def work(i):
            res[i] = [call() for _ in range(4)]
        ts = [threading.Thread(target=work, args=(i,)) for i in range(8)]
        [t.start() for t in ts]; [t.join() for t in ts]
        assert numba.threading_layer() == "workqueue", numba.threading_layer()
        for r in res:
            for o in r:
                np.testing.assert_allclose(o, ref, rtol=1e-5, atol=1e-5)
        print("ok")
        """)
    r = _run_python(code, {"NUMBA_THREADING_LAYER": "workqueue"})
    assert r.returncode == 0 and "ok" in r.stdout, r.stdout + r.stderr


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_call_in_forked_child_after_parent_used_it():
    """GNU OpenMP kills a forked child that starts a parallel region; the backend runs
    a serial compile there instead."""
    code = _SUBPROCESS + textwrap.dedent("""
        np.testing.assert_allclose(call(), ref, rtol=1e-5, atol=1e-5)  # parent: parallel
        pid = os.fork()
        if pid == 0:
            ok = np.allclose(call(), ref, rtol=1e-5, atol=1e-5)
            os._exit(0 if ok else 3)
        _, status = os.waitpid(pid, 0)
        assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, status
        print("ok")
        """)
    r = _run_python(code, {})
    assert r.returncode == 0 and "ok" in r.stdout, r.stdout + r.stderr


# --------------------------------------------------------------------------- the backward
# Backend.patch_moment_vjp (docs/autograd.md, "The backend contract"); gradcheck and the
# comparison with autograd through the plain expression run in test_autograd.py.
def _vjp_problem(rng, B, Ci, H, W, k, stride=1, padding=0, dilation=1, groups=1,
                 dtype=np.float64, **_):
    (kh, kw), (sh, sw), (ph, pw), (dh, dw), Ho, Wo = _geometry(H, W, k, stride, padding,
                                                               dilation)
    grad_S = rng.standard_normal((B, groups, Ho, Wo, Ho, Wo)).astype(dtype)
    mu = rng.standard_normal((B, Ci, H, W)).astype(dtype)
    kwargs = dict(stride=(sh, sw), padding=(ph, pw), dilation=(dh, dw), groups=groups)
    return grad_S, mu, (kh, kw), kwargs


def _vjp(grad_S, mu, k, kw, backend, full=False, dtypes=(None, None), gamma=True,
         want_mu=True, fill=np.nan):
    """(grad_gamma, grad_mu) from ``backend``; buffers pre-filled with ``fill`` (the
    backend must overwrite them), in the given dtypes (default: mu's)."""
    from convcov._frontend import patch_moment_vjp

    B, Ci, H, W = mu.shape
    gdt, mdt = (d or mu.dtype for d in dtypes)
    gg = (np.full((B, Ci, H, W, Ci, H, W) if full else (B, Ci, H, W, H, W), fill, gdt)
          if gamma else None)
    gm = np.full(mu.shape, fill, mdt) if want_mu else None
    patch_moment_vjp(grad_S, mu, k, grad_gamma=gg, grad_mu=gm, backend=backend, **kw)
    return gg, gm


def _diag_mask(shape):
    mask = np.zeros(shape, bool)
    for ci in range(shape[1]):
        mask[:, ci, :, :, ci] = True
    return mask


VJP_CASES = {name: CASES[name] for name in ("seed", "stride-pad", "dilation-groups",
                                              "depthwise-0d-c", "kernel-larger-than-input",
                                              "five-channels")}
VJP_CASES["stride-both-dilation"] = dict(B=2, Ci=2, H=7, W=6, k=3, stride=(2, 3),
                                         padding=(2, 1), dilation=(2, 1))
# dilation along the rows (dw > 1) too, with a wide kernel and padding on one side only
VJP_CASES["row-dilation"] = dict(B=1, Ci=3, H=6, W=9, k=(2, 3), stride=(1, 2),
                                 padding=(0, 2), dilation=(1, 2))
VJP_CASES["both-dilations"] = dict(B=2, Ci=2, H=8, W=8, k=3, stride=1, padding=1,
                                   dilation=(2, 3))
# gaps between the windows: grad_mu window by window
VJP_CASES["gaps"] = dict(B=2, Ci=4, H=12, W=11, k=2, stride=(5, 4), padding=1, groups=2)
VJP_CASES["gaps-dilation"] = dict(B=1, Ci=5, H=11, W=10, k=3, stride=(5, 4), padding=2,
                                  dilation=(2, 3))


@pytest.mark.parametrize("full", [False, True], ids=["diag", "full"])
@pytest.mark.parametrize("case", VJP_CASES)
def test_vjp_matches_numpy_reference_float64(case, full):
    grad_S, mu, k, kw = _vjp_problem(np.random.default_rng(20), **VJP_CASES[case])
    want = _vjp(grad_S, mu, k, kw, "numpy", full=full, fill=0.0)
    got = _vjp(grad_S, mu, k, kw, "numba", full=full, fill=0.0)
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-12)


def test_vjp_full_layout_writes_only_the_channel_diagonal():
    grad_S, mu, k, kw = _vjp_problem(np.random.default_rng(21), **CASES["dilation-groups"])
    gg, _ = _vjp(grad_S, mu, k, kw, "numba", full=True, fill=np.nan, want_mu=False)
    mask = _diag_mask(gg.shape)
    assert np.isnan(gg[~mask]).all()  # the caller's values, untouched
    want, _ = _vjp(grad_S, mu, k, kw, "numpy", full=True, fill=0.0, want_mu=False)
    np.testing.assert_allclose(gg[mask], want[mask], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("wanted", ["gamma", "mu"])
def test_vjp_only_what_is_wanted(wanted):
    grad_S, mu, k, kw = _vjp_problem(np.random.default_rng(22), **CASES["stride-pad"])
    flags = dict(gamma=wanted == "gamma", want_mu=wanted == "mu")
    got = _vjp(grad_S, mu, k, kw, "numba", **flags)
    want = _vjp(grad_S, mu, k, kw, "numpy", **flags)
    i = 0 if wanted == "gamma" else 1
    assert got[1 - i] is None
    np.testing.assert_allclose(got[i], want[i], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("case", ["dilation-groups", "gaps"])
def test_vjp_any_strides_zero_and_negative(case):
    """grad_S as autograd hands it for S.sum() (all strides 0) and permuted / reversed
    views; mu reversed in F order; gradients written into views of larger arrays."""
    rng = np.random.default_rng(23)
    grad_S, mu, k, kw = _vjp_problem(rng, dtype=np.float32, **VJP_CASES[case])
    mu_nc = np.asfortranarray(mu[:, ::-1, ::-1])[:, ::-1, ::-1]
    B, Ci, H, W = mu.shape
    for gS in (np.broadcast_to(np.float32(0.5), grad_S.shape),
               np.ascontiguousarray(grad_S.transpose(0, 1, 4, 5, 2, 3))
               .transpose(0, 1, 4, 5, 2, 3)[:, :, ::-1][:, :, ::-1]):
        want = _vjp(np.ascontiguousarray(gS), mu, k, kw, "numpy", fill=0.0)
        big_g = np.full((B, Ci + 1, H, W, H, W, 2), 9.0, np.float32)
        big_m = np.full((B, Ci, H + 1, W, 2), 9.0, np.float32)
        gg = big_g[:, 1:, ..., 0][:, ::-1, :, ::-1]
        gm = big_m[:, :, 1:, :, 1][:, :, ::-1]
        from convcov._frontend import patch_moment_vjp
        patch_moment_vjp(gS, mu_nc, k, grad_gamma=gg, grad_mu=gm, backend="numba", **kw)
        np.testing.assert_allclose(gg, want[0], rtol=1e-5, atol=1e-4)
        np.testing.assert_allclose(gm, want[1], rtol=1e-5, atol=1e-4)
        assert (big_g[:, 0] == 9).all() and (big_g[..., 1] == 9).all()
        assert (big_m[:, :, 0] == 9).all() and (big_m[..., 0] == 9).all()


@pytest.mark.parametrize("dtype", [np.float16, np.float32])
def test_vjp_16_and_32_bit_rounded_once(dtype):
    rng = np.random.default_rng(24)
    grad_S, mu, k, kw = _vjp_problem(rng, dtype=dtype, **CASES["five-channels"])
    exact = _vjp(grad_S.astype(np.float64), mu.astype(np.float64), k, kw, "numpy", fill=0.0)
    got = _vjp(grad_S, mu, k, kw, "numba")
    for g, e in zip(got, exact):
        assert g.dtype == dtype
        if dtype == np.float16:
            assert _within_one_step(g, e, to_f16_exact, 11, -24).all()
            assert (g.astype(np.float64) == to_f16_exact(e)).mean() > 0.97
        else:  # float64 sums, one rounding: the float64 reference rounded
            np.testing.assert_allclose(g, e.astype(np.float32), rtol=1e-6, atol=1e-6)


def test_vjp_mixed_dtypes():
    rng = np.random.default_rng(25)
    grad_S, mu, k, kw = _vjp_problem(rng, **CASES["stride-pad"])
    gS16, mu32 = grad_S.astype(np.float16), mu.astype(np.float32)
    exact = _vjp(gS16.astype(np.float64), mu32.astype(np.float64), k, kw, "numpy", fill=0.0)
    got = _vjp(gS16, mu32, k, kw, "numba", dtypes=(np.float16, np.float64))
    assert got[0].dtype == np.float16 and got[1].dtype == np.float64
    np.testing.assert_array_equal(got[0].astype(np.float64), to_f16_exact(exact[0]))
    np.testing.assert_allclose(got[1], exact[1], rtol=1e-12, atol=1e-12)


def test_vjp_torch_bfloat16():
    torch = pytest.importorskip("torch")
    from convcov._frontend import patch_moment_vjp

    rng = np.random.default_rng(26)
    grad_S, mu, k, kw = _vjp_problem(rng, dtype=np.float32, **CASES["dilation-groups"])
    gS_t = torch.from_numpy(grad_S).to(torch.bfloat16)
    mu_t = torch.from_numpy(mu).to(torch.bfloat16)
    exact = _vjp(gS_t.double().numpy(), mu_t.double().numpy(), k, kw, "numpy", fill=0.0)
    gg = torch.full(mu.shape + mu.shape[2:], float("nan"), dtype=torch.bfloat16)
    gm = torch.full(mu.shape, float("nan"), dtype=torch.bfloat16)
    patch_moment_vjp(gS_t, mu_t, k, grad_gamma=gg, grad_mu=gm, backend="numba", **kw)
    for g, e in zip((gg, gm), exact):
        got = g.double().numpy()
        assert _within_one_step(got, e, to_bf16_exact, 8, -133).all()
        assert (got == to_bf16_exact(e)).mean() > 0.97


def test_vjp_non_finite_values_near_the_padding():
    """Absent terms stay absent: NaN / Inf in grad_S on pairs with a padded position, and
    Inf in mu next to the padding, reach exactly the gradients the numpy reference has
    them reach (same NaN, +Inf and -Inf patterns), in both gradients."""
    rng = np.random.default_rng(27)
    non_finite_seen = 0
    for case, finite_mu in (("stride-pad", False), ("dilation-groups", True),
                            ("stride-both-dilation", False), ("row-dilation", False),
                            ("gaps", False), ("gaps-dilation", False)):
        grad_S, mu, k, kw = _vjp_problem(rng, **VJP_CASES[case])
        grad_S[0, 0, 0, 0, 0, -1] = np.nan
        grad_S[0, 0, -1, 0, 0, 0] = np.inf
        grad_S[0, -1, 0, -1, -1, 0] = -np.inf
        if not finite_mu:
            mu[0, 0, 0, 0] = np.inf
            mu[0, -1, -1, 1] = -np.inf
            mu[-1, 0, 1, -1] = np.nan
        want = _vjp(grad_S, mu, k, kw, "numpy", fill=0.0)
        got = _vjp(grad_S, mu, k, kw, "numba")
        for g, w in zip(got, want):
            assert np.isfinite(w).any()
            non_finite_seen += (~np.isfinite(w)).sum()
            np.testing.assert_array_equal(np.isnan(g), np.isnan(w))
            np.testing.assert_array_equal(np.isposinf(g), np.isposinf(w))
            np.testing.assert_array_equal(np.isneginf(g), np.isneginf(w))
            fin = np.isfinite(w)
            np.testing.assert_allclose(g[fin], w[fin], rtol=1e-12, atol=1e-12)
    assert non_finite_seen > 0


def test_vjp_absent_terms_one_row():
    """The case of test_autograd.py's test_absent_terms_stay_absent_in_the_backward."""
    from convcov._frontend import patch_moment_vjp

    mu = np.array([[[[1.0, 2.0, np.inf]]]])
    grad_S = np.ones((1, 1, 1, 3, 1, 3))
    grad_S[0, 0, 0, 0, 0, 2] = np.nan
    grad_mu, grad_gamma = np.empty_like(mu), np.empty((1, 1, 1, 3, 1, 3))
    patch_moment_vjp(grad_S, mu, (1, 3), grad_gamma=grad_gamma, grad_mu=grad_mu,
                     padding=(0, 1), backend="numba")
    want = _vjp(grad_S, mu, (1, 3), dict(padding=(0, 1)), "numpy", fill=0.0)
    np.testing.assert_array_equal(grad_mu, want[1])
    np.testing.assert_array_equal(grad_gamma, want[0])


def test_vjp_several_chunks_streaming_stores_and_one_compiled_kernel(monkeypatch):
    """Small problems run as one chunk with ordinary stores; force several chunks and the
    non-temporal stores of large ones, with overlapping windows and with gaps between
    them. One compile serves every dtype mix."""
    monkeypatch.setattr(nbb, "CHUNK_BYTES", 1)  # one (b, g) pair per chunk
    monkeypatch.setattr(nbb, "STREAM_FROM_BYTES", 0)
    rng = np.random.default_rng(28)
    for dtype, stride in itertools.product((np.float32, np.float16, np.float64),
                                           ((2, 1), (5, 4))):
        H, W = (6, 5) if stride == (2, 1) else (12, 11)
        grad_S, mu, k, kw = _vjp_problem(rng, 3, 10, H, W, 3, stride, padding=1, groups=2,
                                         dtype=dtype)
        want = _vjp(grad_S.astype(np.float64), mu.astype(np.float64), k, kw, "numpy",
                    fill=0.0)
        got = _vjp(grad_S, mu, k, kw, "numba", full=dtype == np.float32)
        mask = _diag_mask(got[0].shape) if dtype == np.float32 else Ellipsis
        tol = 1e-2 if dtype == np.float16 else 1e-5
        np.testing.assert_allclose(got[0][mask].ravel(), want[0].ravel(), rtol=tol, atol=tol)
        np.testing.assert_allclose(got[1], want[1], rtol=tol, atol=tol)
    assert len(nbb._vjp_parallel.signatures) == 1  # float64 sums for every dtype mix


def test_vjp_concurrent_calls_from_threads():
    rng = np.random.default_rng(29)
    grad_S, mu, k, kw = _vjp_problem(rng, B=2, Ci=4, H=8, W=8, k=3, padding=1,
                                     dtype=np.float32)
    expected = _vjp(grad_S, mu, k, kw, "numba")
    n_threads, rounds = 6, 4
    results = [[None] * rounds for _ in range(n_threads)]

    def work(i, start):
        start()
        for r in range(rounds):
            results[i][r] = _vjp(grad_S, mu, k, kw, "numba")

    at_once(n_threads, work)
    for row in results:
        for got in row:
            for a, b in zip(got, expected):
                np.testing.assert_array_equal(a, b)


# --------------------------------------------------------------------------- memory
MEMORY_CASES = {
    # mu alone, 256 x 256, a 2 x 2 output: (H*W)**2 float32 would be 16 GiB
    "no-gamma-256": dict(B=1, Ci=1, Co=1, H=256, W=256, k=3, stride=128, gamma=False,
                         full=False),
    # a diagonal gamma of 42 MB for a 6 x 6 output; the backward writes both gradients
    "diag-gamma-48": dict(B=1, Ci=2, Co=2, H=48, W=48, k=3, stride=8, padding=1, full=False),
}


@pytest.mark.parametrize("case", MEMORY_CASES)
def test_large_input_small_output_takes_memory_of_the_output(case):
    """Forward and backward of a call whose input is large and whose output is small:
    their temporaries (numpy's allocations are traced) are bounded by a small multiple of
    the output and grad_S, far below the (H*W)**2 values one (b, g) pair's input second
    moment would take; and the results are right."""
    from convcov._frontend import patch_moment_vjp

    rng = np.random.default_rng(30)
    out, g, mu, c, k, kw = _problem(rng, dtype=np.float32, **MEMORY_CASES[case])
    B, Ci, H, W = mu.shape
    grad_S = rng.standard_normal((B, kw["groups"]) + out.shape[2:]).astype(np.float32)
    bound = (1 << 20) + 4 * (out.nbytes + grad_S.nbytes)
    assert bound < (H * W) ** 2 * 4 / 16  # the test can tell
    work = out.copy()
    gg = None if g is None else np.full_like(g, np.nan)
    gm = np.full_like(mu, np.nan)
    # the kernels compiled (or loaded from the cache) outside the trace
    small = _problem(rng, B=1, Ci=1, Co=1, H=3, W=3, k=2, dtype=np.float32)
    convcov.accumulate(*small[:4], small[4], backend="numba")
    _vjp(*_vjp_problem(rng, B=1, Ci=1, H=3, W=3, k=2), "numba")
    tracemalloc.start()
    try:
        convcov.accumulate(work, g, mu, c, k, backend="numba", **kw)
        forward_peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.reset_peak()
        patch_moment_vjp(grad_S, mu, k, grad_gamma=gg, grad_mu=gm, backend="numba", **kw)
        backward_peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert forward_peak < bound and backward_peak < bound, (forward_peak, backward_peak)
    np.testing.assert_allclose(work, op_slow(out, g, mu, c, k, **kw), rtol=1e-5, atol=1e-4)
    want = _vjp(grad_S, mu, k, kw, "numpy", fill=0.0, gamma=g is not None)
    for got, w in zip((gg, gm), want):
        if w is not None:
            np.testing.assert_allclose(got, w, rtol=1e-5, atol=1e-4)
