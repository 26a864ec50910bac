"""The public entry points: argument normalisation, validation, dispatch.

Owns ``accumulate`` and ``patch_moment``. Every check of SPEC section 3 happens here,
once, before any backend runs, so a rejected call leaves ``out`` bit-identical. Backends
receive a :class:`Problem`: checked shapes, conv parameters as pairs, the layouts, dtype
names, the accumulation dtype and the arrays (numpy views of host arrays; the user's
objects for CUDA arrays).

Must not: compute (that is the backends' job), or copy ``out`` / ``gamma``.
"""

from __future__ import annotations

import numbers
import operator
from dataclasses import dataclass
from typing import Any

import numpy as np

from . import _arrays, _registry
from ._arrays import FLOAT_DTYPES, ArrayInfo
from ._errors import ShapeError


@dataclass(slots=True)  # not frozen: a frozen __init__ costs microseconds per call
class Problem:
    """One validated call, in the names of SPEC section 1."""

    out: Any  # full (B, Co, Ho, Wo, Co, Ho, Wo) or diagonal (B, Co, Ho, Wo, Ho, Wo)
    gamma: Any  # full (B, Ci, H, W, Ci, H, W), diagonal (B, Ci, H, W, H, W), or None
    mu: Any  # (B, Ci, H, W)
    c: Any  # (Co,) array (stride 0 when the user gave a 0-d array), or None ...
    c_value: float  # ... then every channel uses this number
    out_info: ArrayInfo
    gamma_info: ArrayInfo | None
    mu_info: ArrayInfo
    c_info: ArrayInfo | None  # describes the user's c (0-d or 1-d)
    full_out: bool
    full_gamma: bool
    B: int
    Ci: int
    Co: int
    G: int
    H: int
    W: int
    Ho: int
    Wo: int
    kh: int
    kw: int
    sh: int
    sw: int
    ph: int
    pw: int
    dh: int
    dw: int
    acc: str  # "float32" or "float64": the dtype sums are accumulated in
    kind: str  # array kind of the call ("numpy", "torch", "cupy", "cai")
    device: tuple  # ("cpu", None) or ("cuda", ordinal)

    @property
    def empty(self) -> bool:
        return 0 in (self.B, self.Co, self.Ho, self.Wo)


def _int(name, v):
    if isinstance(v, bool) or isinstance(v, (float, complex)):
        raise TypeError(f"{name}: expected an int; got {v!r}")
    try:
        return operator.index(v)
    except TypeError:
        raise TypeError(f"{name}: expected an int; got {v!r}") from None


def _pair(name, v, minimum):
    if isinstance(v, (tuple, list)):
        if len(v) != 2:
            raise ShapeError(f"{name}: expected an int or a pair; got {tuple(v)!r}")
        pair = (_int(name, v[0]), _int(name, v[1]))
    else:
        pair = (_int(name, v),) * 2
    if min(pair) < minimum:
        raise ShapeError(f"{name}: expected values >= {minimum}; got {v!r}")
    return pair


def _kernel(kernel_size, groups):
    """(kh, kw) and, for a 4-item weight shape, (Co, Ci // groups) to check later."""
    if isinstance(kernel_size, (tuple, list)) or hasattr(kernel_size, "__len__"):
        ks = tuple(kernel_size)
        if len(ks) == 4:
            w = tuple(_int("kernel_size", v) for v in ks)
            if min(w[2:]) < 1:
                raise ShapeError(f"kernel_size: expected kh, kw >= 1; got weight shape {w}")
            return w[2:], w[:2]
    return _pair("kernel_size", kernel_size, 1), None


def _check_dtype(name, a: ArrayInfo):
    if a.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name}: expected a float16, bfloat16, float32 or float64 array; "
                        f"got dtype {a.dtype}")
    if a.strides is None:
        raise TypeError(f"{name}: strides must be whole multiples of the item size")


def _expect(name, got, expected, what):
    if tuple(got) != tuple(expected):
        raise ShapeError(f"{name}: expected shape {what} = {tuple(expected)}; got {tuple(got)}")


def normalise(out, gamma, mu, c, kernel_size, stride, padding, dilation, groups) -> Problem:
    """Validate one call and describe it as a :class:`Problem` (no side effects)."""
    G = _int("groups", groups)
    if G < 1:
        raise ShapeError(f"groups: expected >= 1; got {G}")
    (kh, kw), weight = _kernel(kernel_size, G)
    sh, sw = _pair("stride", stride, 1)
    ph, pw = _pair("padding", padding, 0)
    dh, dw = _pair("dilation", dilation, 1)

    mu_i = _arrays.info(mu, "mu")
    out_i = _arrays.info(out, "out")
    gamma_i = None if gamma is None else _arrays.info(gamma, "gamma")
    c_i = None
    if isinstance(c, (bool, np.bool_)) or not isinstance(c, numbers.Number):
        if isinstance(c, (bool, np.bool_)):
            raise TypeError(f"c: expected a float, a 0-d or a 1-d float array; got {c!r}")
        c_i = _arrays.info(c, "c")
    elif isinstance(c, numbers.Complex) and not isinstance(c, numbers.Real):
        raise TypeError(f"c: expected a real number; got {c!r}")

    arrays = [("out", out_i), ("gamma", gamma_i), ("mu", mu_i), ("c", c_i)]
    arrays = [(n, a) for n, a in arrays if a is not None]
    kinds = {(a.kind, a.device) for _, a in arrays}
    if len(kinds) > 1:
        got = ", ".join(f"{n}: {a.kind} on {_device_str(a.device)}" for n, a in arrays)
        raise TypeError(f"all arrays must be of one kind on one device; got {got}")
    for n, a in arrays:
        _check_dtype(n, a)
    device_type = mu_i.device[0]
    if device_type not in ("cpu", "cuda"):
        raise TypeError(f"mu: arrays on {device_type!r} devices are not supported "
                        "(only CPU and CUDA)")

    # Shapes, in the order the data flows: mu defines B, Ci, H, W; out defines Co.
    if len(mu_i.shape) != 4:
        raise ShapeError(f"mu: expected 4 dims (B, Ci, H, W); got shape {mu_i.shape}")
    B, Ci, H, W = mu_i.shape
    Ho = _out_size(H, kh, sh, ph, dh, "H", "kh")
    Wo = _out_size(W, kw, sw, pw, dw, "W", "kw")
    if len(out_i.shape) == 7:
        Co = out_i.shape[1]
        _expect("out", out_i.shape, (B, Co, Ho, Wo, Co, Ho, Wo), "(B, Co, Ho, Wo, Co, Ho, Wo)")
    elif len(out_i.shape) == 6:
        Co = out_i.shape[1]
        _expect("out", out_i.shape, (B, Co, Ho, Wo, Ho, Wo), "(B, Co, Ho, Wo, Ho, Wo)")
    else:
        raise ShapeError(f"out: expected 7 dims (B, Co, Ho, Wo, Co, Ho, Wo) or 6 dims "
                         f"(B, Co, Ho, Wo, Ho, Wo); got shape {out_i.shape}")
    if Ci % G:
        raise ShapeError(f"groups: Ci = {Ci} (mu.shape[1]) is not divisible by groups = {G}")
    if Co % G:
        raise ShapeError(f"groups: Co = {Co} (out.shape[1]) is not divisible by groups = {G}")
    if weight is not None and weight != (Co, Ci // G):
        raise ShapeError(f"kernel_size: weight shape expected (Co, Ci // groups, kh, kw) = "
                         f"{(Co, Ci // G, kh, kw)}; got {(*weight, kh, kw)}")
    if gamma_i is not None:
        if len(gamma_i.shape) == 7:
            _expect("gamma", gamma_i.shape, (B, Ci, H, W, Ci, H, W), "(B, Ci, H, W, Ci, H, W)")
        elif len(gamma_i.shape) == 6:
            _expect("gamma", gamma_i.shape, (B, Ci, H, W, H, W), "(B, Ci, H, W, H, W)")
        else:
            raise ShapeError(f"gamma: expected 7 dims (B, Ci, H, W, Ci, H, W), 6 dims "
                             f"(B, Ci, H, W, H, W) or None; got shape {gamma_i.shape}")
    if c_i is not None and c_i.shape not in ((), (Co,)):
        raise ShapeError(f"c: expected a number, a 0-d array or shape (Co,) = ({Co},); "
                         f"got shape {c_i.shape}")

    # Memory: out is written in place, so it must be writable and alias no input.
    if out_i.readonly:
        raise ValueError("out: is read-only; accumulate writes into it in place")
    for n, a, x in (("gamma", gamma_i, gamma), ("mu", mu_i, mu), ("c", c_i, c)):
        if a is not None and _arrays.overlaps(out_i, out, a, x):
            raise ValueError(f"out: shares memory with {n}; pass separate arrays")

    acc = "float64" if any(a.dtype == "float64" for _, a in arrays) else "float32"
    host = device_type == "cpu"
    out_arr, gamma_arr, mu_arr, c_arr = out, gamma, mu, c
    if host:
        out_arr = _arrays.host_view(out, out_i.dtype)
        mu_arr = _arrays.host_view(mu, mu_i.dtype)
        gamma_arr = None if gamma is None else _arrays.host_view(gamma, gamma_i.dtype)
        if c_i is not None:
            c_arr = _arrays.host_view(c, c_i.dtype)
            if c_arr.ndim == 0:
                c_arr = np.broadcast_to(c_arr, (Co,))
    c_value = 0.0
    if c_i is None:
        c_value, c_arr = float(c), None
    return Problem(
        out_arr, gamma_arr, mu_arr, c_arr, c_value, out_i, gamma_i, mu_i, c_i,
        len(out_i.shape) == 7, gamma_i is not None and len(gamma_i.shape) == 7,
        B, Ci, Co, G, H, W, Ho, Wo, kh, kw, sh, sw, ph, pw, dh, dw, acc,
        mu_i.kind, mu_i.device,
    )


def _device_str(device):
    return device[0] if device[1] is None else f"{device[0]}:{device[1]}"


def _out_size(n, k, s, p, d, dim, kdim):
    span = d * (k - 1) + 1
    if n + 2 * p < span:
        raise ShapeError(
            f"mu: padded input {dim} + 2*padding = {n + 2 * p} is smaller than the dilated "
            f"kernel dilation*({kdim}-1)+1 = {span}")
    return (n + 2 * p - span) // s + 1


def _dtypes(p: Problem) -> frozenset:
    infos = (p.out_info, p.gamma_info, p.mu_info, p.c_info)
    return frozenset(a.dtype for a in infos if a is not None)


def accumulate(out, gamma, mu, c, kernel_size, *, stride=1, padding=0, dilation=1,
               groups=1, backend=None):
    """Add the weight-noise covariance term of a 2-D convolution into ``out``, in place.

    ``out[b, c0, i0, j0, (c0,) i1, j1] += c[c0] * S[b, g(c0), i0, j0, i1, j1]`` with ``S``
    the patch moment of SPEC section 1 (see :func:`patch_moment`). Only the
    channel-diagonal of a full-layout ``out`` changes. Returns ``out`` itself.

    >>> import numpy as np, convcov
    >>> mu = np.ones((1, 2, 4, 4), np.float32)
    >>> out = np.zeros((1, 3, 2, 2, 3, 2, 2), np.float32)
    >>> convcov.accumulate(out, None, mu, 0.5, 3, backend="numpy")[0, 1, 0, 0, 1, 1, 1]
    np.float32(9.0)
    """
    p = normalise(out, gamma, mu, c, kernel_size, stride, padding, dilation, groups)
    b = _registry.select(backend, p.device[0], _dtypes(p))
    if not p.empty:
        b.accumulate(p)
    return out


def patch_moment(gamma, mu, kernel_size, *, stride=1, padding=0, dilation=1, groups=1,
                 backend=None):
    """``S[b, g, i0, j0, i1, j1]``: the per-group patch second moment of SPEC section 1.

    Shape ``(B, G, Ho, Wo, Ho, Wo)``, same array library and device as ``mu``, float32
    (float64 when any input is float64). ``accumulate`` adds ``c[c0] * S[:, g(c0)]`` to
    the diagonal of ``out``; this is that ``S`` on its own, Co / G times smaller.

    >>> import numpy as np, convcov
    >>> S = convcov.patch_moment(None, np.ones((1, 1, 3, 3)), 2, backend="numpy")
    >>> S.shape, float(S[0, 0, 0, 0, 1, 1])
    ((1, 1, 2, 2, 2, 2), 4.0)
    """
    G = _int("groups", groups)
    mu_i = _arrays.info(mu, "mu")
    if G < 1:
        raise ShapeError(f"groups: expected >= 1; got {G}")
    (kh, kw), weight = _kernel(kernel_size, G)
    if len(mu_i.shape) != 4:
        raise ShapeError(f"mu: expected 4 dims (B, Ci, H, W); got shape {mu_i.shape}")
    B, Ci, H, W = mu_i.shape
    if weight is not None and (weight[1] * G != Ci or weight[0] % G):
        raise ShapeError(f"kernel_size: weight shape expected (Co, Ci // groups, kh, kw) "
                         f"with Ci // groups = {Ci // G} and Co divisible by {G}; "
                         f"got {(*weight, kh, kw)}")
    sh, sw = _pair("stride", stride, 1)
    ph, pw = _pair("padding", padding, 0)
    dh, dw = _pair("dilation", dilation, 1)
    Ho = _out_size(H, kh, sh, ph, dh, "H", "kh")
    Wo = _out_size(W, kw, sw, pw, dw, "W", "kw")
    infos = [mu_i] + ([] if gamma is None else [_arrays.info(gamma, "gamma")])
    for n, a in zip(("mu", "gamma"), infos):
        _check_dtype(n, a)
    if Ci % G:
        raise ShapeError(f"groups: Ci = {Ci} (mu.shape[1]) is not divisible by groups = {G}")
    dtypes = {a.dtype for a in infos}
    # Select before allocating, so a bad backend name costs nothing.
    device = mu_i.device[0]
    if device in ("cpu", "cuda"):
        _registry.select(backend, device, frozenset(dtypes))
    S = _arrays.zeros_like_kind(mu, mu_i, (B, G, Ho, Wo, Ho, Wo),
                                "float64" if "float64" in dtypes else "float32")
    # S is "accumulate into zeros with one output channel per group and c = 1".
    return accumulate(S, gamma, mu, 1.0, (kh, kw), stride=(sh, sw), padding=(ph, pw),
                      dilation=(dh, dw), groups=G, backend=backend)
