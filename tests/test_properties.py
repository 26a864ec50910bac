"""Every backend against the numpy reference, on random problems (hypothesis).

One property, parametrised over every registered backend (built-in and plug-ins): for a
random problem (shapes, conv parameters, groups, layouts of ``out`` and ``gamma``, ``c``
as number / 0-d / 1-d, dtypes per array, array kind and memory layout per array; half of
them with the conv parameters and group structure of a layer of the bench's ``layers``
suite, scaled down) the
backend's ``out`` equals the reference's within the forward error bound of its dtypes,
and every element off the channel-diagonal stays bit-identical. Backends added later are
covered by registering; nothing here names them.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

import convcov
from convcov import _frontend, _registry, bench

from kinds import SIM, kinds_for, make, to_f64, tolerance

NAMES = _registry.names()
LAYOUTS = ("contiguous", "permuted", "strided")
#: ... and a negative stride, for the kinds that have them (torch and numba device arrays
#: do not)
REVERSED = {"numpy", "cupy"}
#: ... and for the inputs, a zero stride (one batch element's values for all, as from
#: broadcast_to or expand; numba device arrays have none)
BROADCAST = {"numpy", "cupy", "torch", "torch_cuda"}


#: The conv layers of ``convcov bench --suite layers`` (one workload a name), whose conv
#: parameters and group structure the problems below also take, at small sizes.
LAYERS = list({w.name: w for w in bench.LAYERS}.values())


@st.composite
def layer_problems(draw, small: bool):
    """A layer of the suite, scaled down: its kernel, stride, padding, dilation and the
    kind of its groups (one group, several, or depthwise) kept; channels a group, groups,
    batch and input size drawn small."""
    w = draw(st.sampled_from(LAYERS), label="layer")
    depthwise = w.groups == w.Ci == w.Co
    G = (draw(st.integers(1, 2 if small else 4)) if depthwise or w.groups > 1 else 1)
    cg = 1 if depthwise else draw(st.integers(1, min(w.Ci // w.groups, 2 if small else 5)))
    co_per_g = 1 if depthwise else draw(st.integers(1, min(w.Co // w.groups,
                                                           2 if small else 3)))
    span = w.dilation * (w.k - 1) + 1
    H = draw(st.integers(max(1, span - 2 * w.padding, w.stride),
                         span + (2 if small else 6) + w.stride))
    B = draw(st.integers(1, 1 if small else 2))
    return dict(B=B, Ci=G * cg, Co=G * co_per_g, G=G, H=H, W=H, k=(w.k, w.k),
                stride=(w.stride,) * 2, padding=(w.padding,) * 2, dilation=(w.dilation,) * 2)


@st.composite
def problems(draw, small: bool):
    """Sizes and conv parameters of one call (small: for the CUDA simulator): a layer of
    the suite's kind (layer_problems) or any other."""
    if draw(st.booleans(), label="a layer of the suite"):
        return draw(layer_problems(small))
    G = draw(st.integers(1, 2 if small else 3))
    # up to 5 input channels a group: numba's four-channel passes and their remainder
    cg = draw(st.integers(1, 2 if small else 5))
    co_per_g = draw(st.integers(1, 2 if small else 3))
    kh, kw = draw(st.integers(1, 3 if small else 5)), draw(st.integers(1, 3 if small else 5))
    sh, sw = draw(st.integers(1, 2 if small else 3)), draw(st.integers(1, 2 if small else 3))
    dh, dw = draw(st.integers(1, 2)), draw(st.integers(1, 2))
    ph, pw = draw(st.integers(0, 2)), draw(st.integers(0, 2))
    span_h, span_w = dh * (kh - 1) + 1, dw * (kw - 1) + 1
    extra = 2 if small else 6
    H = draw(st.integers(max(1, span_h - 2 * ph), span_h + extra))
    W = draw(st.integers(max(1, span_w - 2 * pw), span_w + extra))
    B = draw(st.integers(1, 1 if small else 3))
    if draw(st.integers(0, 30)) == 0:  # now and then an empty call
        B = 0
    return dict(B=B, Ci=G * cg, Co=G * co_per_g, G=G, H=H, W=W, k=(kh, kw), stride=(sh, sw),
                padding=(ph, pw), dilation=(dh, dw))


def backend_and_kinds(name: str):
    """The backend registered as ``name`` and the array kinds to test it with here
    (skips the test when it cannot run here)."""
    backend = _registry.get(name)
    reason = backend.unavailable_reason()
    if reason:
        pytest.skip(f"{name}: {reason}")
    kinds = kinds_for(backend.device)
    if not kinds:
        pytest.skip(f"{name}: no {backend.device} array library here")
    return backend, kinds


def run_case(name: str, data, small: bool) -> None:
    backend, kinds = backend_and_kinds(name)
    pr = data.draw(problems(small))
    kind = data.draw(st.sampled_from(kinds), label="kind")
    # bfloat16 arrays come from torch only (numpy, CuPy and numba have no bfloat16 dtype)
    dtypes = sorted(backend.dtypes if kind.startswith("torch")
                    else backend.dtypes - {"bfloat16"})
    dt = {a: data.draw(st.sampled_from(dtypes), label=f"{a} dtype")
          for a in ("out", "gamma", "mu", "c")}
    layouts = LAYOUTS + (("reversed",) if kind in REVERSED else ())
    in_layouts = layouts + (("broadcast",) if kind in BROADCAST else ())
    lay = {a: data.draw(st.sampled_from(layouts if a == "out" else in_layouts),
                        label=f"{a} layout")
           for a in ("out", "gamma", "mu")}
    full_out = data.draw(st.booleans(), label="full out")
    gamma_form = data.draw(st.sampled_from(["full", "diag", None]), label="gamma")
    c_form = data.draw(st.sampled_from(["number", "int", "0d", "1d"]), label="c")
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1), label="seed"))
    # numba device arrays cannot be 0-d (to_device gives shape (1,)) nor sliced when empty
    assume(kind != "numba" or (c_form != "0d" and pr["B"] > 0))

    B, Ci, Co, H, W = pr["B"], pr["Ci"], pr["Co"], pr["H"], pr["W"]
    (kh, kw), (sh, sw), (ph, pw), (dh, dw) = pr["k"], pr["stride"], pr["padding"], pr["dilation"]
    Ho = (H + 2 * ph - dh * (kh - 1) - 1) // sh + 1
    Wo = (W + 2 * pw - dw * (kw - 1) - 1) // sw + 1
    out_shape = (B, Co, Ho, Wo, Co, Ho, Wo) if full_out else (B, Co, Ho, Wo, Ho, Wo)
    gamma_shape = {"full": (B, Ci, H, W, Ci, H, W), "diag": (B, Ci, H, W, H, W)}.get(gamma_form)

    out = make(rng.standard_normal(out_shape), kind, dt["out"], lay["out"], rng)
    mu = make(rng.standard_normal((B, Ci, H, W)), kind, dt["mu"], lay["mu"], rng)
    # gamma and c of both signs: a covariance's off-diagonal entries can be negative, and
    # SPEC takes any real c (a sign lost anywhere shows)
    gamma = (None if gamma_shape is None else
             make(rng.standard_normal(gamma_shape), kind, dt["gamma"], lay["gamma"], rng))
    c_vals = rng.standard_normal(Co)
    if c_form == "number":
        c = float(c_vals[0])
    elif c_form == "int":  # a Python int (the fast paths key it apart from a float)
        c = int(np.round(3 * c_vals[0]))
    elif c_form == "0d":
        c = make(np.array(c_vals[0]), kind, dt["c"])
    else:
        c = make(c_vals, kind, dt["c"])

    # The reference sees exactly the values the backend sees (already rounded to dtype).
    out0, mu64 = to_f64(out), to_f64(mu)
    g64 = None if gamma is None else to_f64(gamma)
    c64 = float(c) if isinstance(c, (float, int)) else np.broadcast_to(to_f64(c), (Co,)).copy()
    kw_args = dict(stride=pr["stride"], padding=pr["padding"], dilation=pr["dilation"],
                   groups=pr["G"])
    ref = convcov.accumulate(out0.copy(), g64, mu64, c64, pr["k"], backend="numpy", **kw_args)
    bound = convcov.accumulate(np.abs(out0), None if g64 is None else np.abs(g64),
                               np.abs(mu64), np.abs(c64), pr["k"], backend="numpy", **kw_args)

    result = convcov.accumulate(out, gamma, mu, c, pr["k"], backend=name, **kw_args)
    assert result is out
    got = to_f64(out)

    inputs = [dt["out"], dt["mu"]] + ([dt["gamma"]] if gamma is not None else []) + (
        [dt["c"]] if c_form not in ("number", "int") else [])
    acc = "float64" if "float64" in inputs else "float32"
    tol = tolerance(bound, 2 * (Ci // pr["G"]) * kh * kw, acc, dt["out"])
    err = np.abs(got - ref)
    bad = ~(err <= tol)
    assert not bad.any(), (
        f"{name}: {bad.sum()} of {bad.size} elements off; worst error "
        f"{err[bad].max():.3g} vs tolerance {tol[bad][np.argmax(err[bad])]:.3g}")
    if full_out:  # off the channel-diagonal nothing changes, bit for bit
        off = np.ones(out_shape, bool)
        for c0 in range(Co):
            off[:, c0, :, :, c0] = False
        np.testing.assert_array_equal(got[off], out0[off])

    if kind.startswith("torch"):
        # The same call again, out reset: a torch call signature seen before takes the
        # front end's fast path (the backend's bound launcher, Backend.bind), which must
        # give the same bits.
        import torch

        out.copy_(torch.from_numpy(out0))
        taken = []
        fast = _frontend._torch_fast
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(_frontend, "_torch_fast", lambda *a: taken.append(fast(*a)) or taken[-1])
            assert convcov.accumulate(out, gamma, mu, c, pr["k"], backend=name, **kw_args) is out
        np.testing.assert_array_equal(to_f64(out), got)
        if type(backend).bind is not _registry.Backend.bind:
            assert taken == [True], f"the repeated call missed the fast path: {taken}"


@pytest.mark.parametrize("name", NAMES)
@given(data=st.data())
def test_backend_matches_reference(name, data):
    if SIM and name == "numba_cuda":
        pytest.skip("numba_cuda runs under the CUDA simulator: see the small-shape test")
    run_case(name, data, small=False)


@pytest.mark.skipif(not SIM, reason="the CUDA simulator is only used when there is no GPU")
@pytest.mark.parametrize("path", ["fused", "stream", "tiles", "segments"])
@settings(max_examples=40)
@given(data=st.data())
def test_numba_cuda_simulator_matches_reference(path, data):
    """Every plan of the walk, forced through convcov.backends._plan (as
    tests/test_cupy.py's _force): c * S added into out by the walk, or S through memory and
    streamed into out; planes in the smallest tiles; diagonals in segments of one plane."""
    from convcov.backends import _plan
    from convcov.backends import numba_cuda as mod

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(_plan, "STREAM_BYTES", 0 if path == "stream" else 1 << 60)
        if path == "tiles":
            mp.setattr(_plan, "WALK_SMEM", 1)
        if path == "segments":
            mp.setattr(_plan, "WALK_BLOCKS_PER_SM", 1 << 30)
        mp.setattr(mod, "_plans", {})  # plans remember the branch chosen
        mp.setattr(_frontend, "_bound", {})  # ... and so do the bound launchers
        run_case("numba_cuda", data, small=True)


@pytest.mark.parametrize("name", NAMES)
def test_number_c_beyond_float32_sums_in_float64(name):
    """A Python number c that float32 cannot hold (finite, above 3.4e38) with float32
    arrays: every backend sums in float64 (docs/api.md), so S = 0 gives zeros, not
    Inf * 0 = NaN, and a tiny S gives the finite products the reference gives. For torch
    tensors the call is made twice (a float32 signature bound first): the fast path must
    not sum such a c in float32."""
    _, kinds = backend_and_kinds(name)
    rng = np.random.default_rng(7)
    mu_tiny = rng.random((1, 2, 4, 4)) * 1e-17  # S ~ 1e-34: c * S ~ 1e5
    out0 = rng.standard_normal((1, 2, 2, 2, 2, 2))
    want = convcov.accumulate(out0.copy(), None, mu_tiny, 3e38 * 10, 3, backend="numpy")
    for kind in kinds:
        for mu_vals, expect in ((np.zeros((1, 2, 4, 4)), out0), (mu_tiny, want)):
            out = make(out0, kind, "float32")
            mu = make(mu_vals, kind, "float32")
            for c in (1.0, 3e39, 3e39) if kind.startswith("torch") else (3e39,):
                if c == 1.0:  # binds the float32 signature; then restore out
                    convcov.accumulate(out, None, mu, c, 3, backend=name)
                    out = make(out0, kind, "float32")
                    continue
                convcov.accumulate(out, None, mu, c, 3, backend=name)
                got = to_f64(out)
                assert np.isfinite(got).all(), f"{name}/{kind}: {got}"
                np.testing.assert_allclose(got, np.float32(expect), rtol=1e-6, err_msg=kind)
                out = make(out0, kind, "float32")
