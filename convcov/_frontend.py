"""The public entry points: argument normalisation, validation, dispatch.

Owns ``accumulate`` and ``patch_moment``, and the backward entry ``patch_moment_vjp``.
Every check of SPEC section 3 happens here, once, before any backend runs, so a rejected
call leaves ``out`` bit-identical. Backends receive a :class:`Problem` (or, for the
backward, an :class:`Adjoint`): checked shapes, conv parameters as pairs, the layouts,
dtype names, the accumulation dtype and the arrays (numpy views of host arrays; the
user's objects for CUDA arrays).

Torch tensors that autograd records (grad mode on, an input requires grad), and any
tensor while ``torch.compile`` traces, are routed to convcov's torch operators
(``convcov/torch_ops.py``, imported then and only then): they give the gradients and keep
the compiled graph whole. Every other call takes the direct path below, unchanged.

Must not: compute (that is the backends' job), copy ``out`` / ``gamma``, or import torch.
"""

from __future__ import annotations

import numbers
import operator
import os
import sys
from dataclasses import dataclass
from typing import Any

import numpy as np

from . import _arrays, _registry
from ._arrays import FLOAT_DTYPES, ArrayInfo
from ._errors import BackendError, ShapeError

_ndarray = np.ndarray  # module globals: the hot path's first check costs one lookup
_modules = sys.modules
#: The largest finite float32. A finite number c beyond it would be Inf as a float32 (and
#: Inf * 0 NaN where S = 0), so a call with such a c sums in float64 (normalise).
_F32_MAX = float(np.finfo(np.float32).max)
#: The smallest normal float32. A nonzero c below it would lose most or all of its digits
#: as a float32 (1e-50 would be 0), so such a c sums in float64 too.
_F32_TINY = float(np.finfo(np.float32).tiny)


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
        """No term to add: no output element, or S a sum over nothing (no input channel,
        or an input of no positions, all of its window in the padding). Such a call
        leaves out bit-identical (out + c * 0 would turn -0.0 into +0.0)."""
        return 0 in (self.B, self.Co, self.Ho, self.Wo, self.Ci, self.H, self.W)

    def diagonal_bytes(self) -> tuple[int, int]:
        """(bytes of gamma's channel diagonal, 0 without gamma; bytes of out's): what the
        operation reads of gamma, and reads and writes of out (SPEC section 5)."""
        size = _arrays.ITEMSIZE
        g = self.gamma_info
        return (0 if g is None else self.B * self.Ci * (self.H * self.W) ** 2 * size[g.dtype],
                self.B * self.Co * (self.Ho * self.Wo) ** 2 * size[self.out_info.dtype])

    written = 1  # how many of infos (the first) the call writes: launch_streams

    @property
    def infos(self) -> tuple:
        """The arrays' ArrayInfos, the one written first (None for absent ones)."""
        return (self.out_info, self.gamma_info, self.mu_info, self.c_info)

    def layout_key(self) -> tuple:
        """What a GPU backend's launch plan depends on: the conv parameters, the
        accumulation dtype and each array's dtype, shape, strides and address modulo 16
        (which vector loads it allows); never the addresses themselves."""
        oi, gi, mi, ci = self.out_info, self.gamma_info, self.mu_info, self.c_info
        return (self.acc, self.kh, self.kw, self.sh, self.sw, self.ph, self.pw, self.dh,
                self.dw, self.G, oi.dtype, oi.shape, oi.strides, oi.ptr & 15,
                None if gi is None else (gi.dtype, gi.shape, gi.strides, gi.ptr & 15),
                mi.dtype, mi.shape, mi.strides, mi.ptr & 15,
                None if ci is None else (ci.dtype, ci.shape, ci.strides))


def _int(name, v):
    if isinstance(v, bool) or isinstance(v, (float, complex)):
        raise TypeError(f"{name}: expected an int; got {v!r}")
    try:
        return operator.index(v)
    except TypeError:
        raise TypeError(f"{name}: expected an int; got {v!r}") from None


def _sequence(v) -> bool:
    """Whether a conv parameter is given as a sequence (a tuple, a list, a 1-d array or
    tensor), not as one number (an int, a NumPy integer, a 0-d array)."""
    return (isinstance(v, (tuple, list))
            or (hasattr(v, "__len__") and not isinstance(v, (str, bytes))
                and getattr(v, "ndim", 1) != 0))


def _pair(name, v, minimum):
    if _sequence(v):
        v = tuple(v)
        if len(v) != 2:
            raise ShapeError(f"{name}: expected an int or a pair; got {v!r}")
        pair = (_int(name, v[0]), _int(name, v[1]))
    else:
        pair = (_int(name, v),) * 2
    if min(pair) < minimum:
        raise ShapeError(f"{name}: expected values >= {minimum}; got {v!r}")
    return pair


def _kernel(kernel_size, groups):
    """(kh, kw) and, for a 4-item weight shape, (Co, Ci // groups) to check later."""
    if _sequence(kernel_size):
        ks = tuple(kernel_size)
        if len(ks) == 4:
            w = tuple(_int("kernel_size", v) for v in ks)
            if min(w[2:]) < 1:
                raise ShapeError(f"kernel_size: expected kh, kw >= 1; got weight shape {w}")
            return w[2:], w[:2]
    return _pair("kernel_size", kernel_size, 1), None


def _check_dtype(name, a: ArrayInfo):
    if a.dtype not in FLOAT_DTYPES:
        why = ""
        if a.dtype[:1] in "<>" and a.dtype[1:2] == "f":  # numpy's or a CUDA array's name
            why = (" (its byte order is not the machine's: convert it, e.g. "
                   f"{name}.astype({name}.dtype.newbyteorder('=')))")
        raise TypeError(f"{name}: expected a float16, bfloat16, float32 or float64 array; "
                        f"got dtype {a.dtype}{why}")
    if a.strides is None:
        raise TypeError(f"{name}: strides must be whole multiples of the item size")


def _expect(name, got, expected, what):
    if tuple(got) != tuple(expected):
        raise ShapeError(f"{name}: expected shape {what} = {tuple(expected)}; got {tuple(got)}")


def _check_arrays(arrays):
    """The (name, ArrayInfo) pairs: of one kind on one device, a CPU or a CUDA one, each
    of a float dtype."""
    _check_kinds(arrays)
    for n, a in arrays:
        _check_dtype(n, a)
    device_type = arrays[0][1].device[0]  # (one for all, as _check_kinds made sure)
    if device_type not in ("cpu", "cuda"):
        raise TypeError(f"mu: arrays on {device_type!r} devices are not supported "
                        "(only CPU and CUDA)")


def _input(mu_i, G, kh, kw, sh, sw, ph, pw, dh, dw, weight=None, covariances=()):
    """``(B, Ci, H, W, Ho, Wo, sh, sw, dh, dw)``: the input's sizes from mu's shape, checked
    against groups, a weight shape ``(Co, Ci // G)`` (Co only as far as groups go) and the
    conv parameters (:func:`_grid`); each ``(name, ArrayInfo or None)`` of ``covariances``
    must be the input's full or diagonal covariance."""
    if len(mu_i.shape) != 4:
        raise ShapeError(f"mu: expected 4 dims (B, Ci, H, W); got shape {mu_i.shape}")
    B, Ci, H, W = mu_i.shape
    if Ci % G:
        raise ShapeError(f"groups: Ci = {Ci} (mu.shape[1]) is not divisible by groups = {G}")
    if weight is not None and (weight[1] * G != Ci or weight[0] % G):
        raise ShapeError(f"kernel_size: weight shape expected (Co, Ci // groups, kh, kw) "
                         f"with Ci // groups = {Ci // G} and Co divisible by {G}; "
                         f"got {(*weight, kh, kw)}")
    Ho, Wo, sh, sw, dh, dw = _grid(H, W, kh, kw, sh, sw, ph, pw, dh, dw)
    for name, g in covariances:
        if g is None:
            continue
        if len(g.shape) == 7:
            _expect(name, g.shape, (B, Ci, H, W, Ci, H, W), "(B, Ci, H, W, Ci, H, W)")
        elif len(g.shape) == 6:
            _expect(name, g.shape, (B, Ci, H, W, H, W), "(B, Ci, H, W, H, W)")
        else:
            raise ShapeError(f"{name}: expected 7 dims (B, Ci, H, W, Ci, H, W) or 6 dims "
                             f"(B, Ci, H, W, H, W); got shape {g.shape}")
    return B, Ci, H, W, Ho, Wo, sh, sw, dh, dw


_param_cache: dict = {}  # conv parameters as given (plain ints / tuples) -> parsed


def _remember(cache: dict, key, value) -> None:
    """cache[key] = value, the cache started over when full: a process that has seen many
    signatures keeps its newest ones fast rather than none."""
    if len(cache) >= 4096:
        cache.clear()
    cache[key] = value


def _plain_param(v) -> bool:
    """An int or a tuple of ints, exactly (so True never hits the cache entry of 1)."""
    if type(v) is int:
        return True
    if type(v) is tuple:
        for e in v:
            if type(e) is not int:
                return False
        return True
    return False


def conv_params(kernel_size, stride, padding, dilation, groups):
    """Checked conv parameters ``(G, (kh, kw), weight, (sh, sw), (ph, pw), (dh, dw))``;
    ``weight`` is ``(Co, Ci // G)`` of a 4-item kernel_size, else None. Parsed once per
    distinct set of plain-int arguments (small calls cannot afford the parsing)."""
    key = None
    if (_plain_param(kernel_size) and _plain_param(stride) and _plain_param(padding)
            and _plain_param(dilation) and type(groups) is int):
        key = (kernel_size, stride, padding, dilation, groups)
        hit = _param_cache.get(key)
        if hit is not None:
            return hit
    G = _int("groups", groups)
    if G < 1:
        raise ShapeError(f"groups: expected >= 1; got {G}")
    parsed = (G, *_kernel(kernel_size, G), _pair("stride", stride, 1),
              _pair("padding", padding, 0), _pair("dilation", dilation, 1))
    if key is not None:
        _remember(_param_cache, key, parsed)
    return parsed


_checked: dict = {}  # call signature (no addresses) -> what _check derived from it


def normalise(out, gamma, mu, c, kernel_size, stride, padding, dilation, groups) -> Problem:
    """Validate one call and describe it as a :class:`Problem` (no side effects).

    Everything but the aliasing check depends only on the call's signature (conv
    parameters; kind, device, dtype, shape, strides of each array; out's writability),
    so a signature that passed :func:`_check` once is not checked again: small calls
    cannot afford it (SPEC's toy workload is dominated by the host).
    """
    mu_i = _arrays.info(mu, "mu")
    out_i = _arrays.info(out, "out")
    gamma_i = None if gamma is None else _arrays.info(gamma, "gamma")
    c_i = None
    if type(c) is float or type(c) is int:  # the common case, before the slow ABC checks
        pass
    elif isinstance(c, (bool, np.bool_)) or not isinstance(c, numbers.Number):
        if isinstance(c, (bool, np.bool_)):
            raise TypeError(f"c: expected a float, a 0-d or a 1-d float array; got {c!r}")
        c_i = _arrays.info(c, "c")
    elif isinstance(c, numbers.Complex) and not isinstance(c, numbers.Real):
        raise TypeError(f"c: expected a real number; got {c!r}")

    key = chk = None
    if (_plain_param(kernel_size) and _plain_param(stride) and _plain_param(padding)
            and _plain_param(dilation) and type(groups) is int):
        # ArrayInfo[:5]: kind, device, dtype, shape, strides (not the address)
        key = (kernel_size, stride, padding, dilation, groups, mu_i[:5], out_i[:5],
               out_i.readonly, None if gamma_i is None else gamma_i[:5],
               None if c_i is None else c_i[:5])
        chk = _checked.get(key)
    if chk is None:
        chk = _check(out_i, gamma_i, mu_i, c_i, kernel_size, stride, padding, dilation, groups)
        if key is not None:
            _remember(_checked, key, chk)
    (G, kh, kw, sh, sw, ph, pw, dh, dw, B, Ci, Co, H, W, Ho, Wo, acc, spans) = chk
    if mu_i.kind == "cai":
        _check_streams((("out", out_i), ("gamma", gamma_i), ("mu", mu_i), ("c", c_i)))

    # Memory: out is written in place, so it must alias no input. (The bounds test first:
    # the exact one costs microseconds.)
    for n, a, span in (("gamma", gamma_i, spans[1]), ("mu", mu_i, spans[2]),
                       ("c", c_i, spans[3])):
        if _arrays.overlaps(out_i, spans[0], a, span) and _arrays.shares_memory(out_i, a):
            raise ValueError(f"out: shares memory with {n}; pass separate arrays")
    if mu_i.device[0] == "cuda":
        # A CUDA load from an address that is not a multiple of its size faults, and the
        # fault ends the CUDA context: the process's GPU work is lost, not just this call.
        for n, a in (("out", out_i), ("gamma", gamma_i), ("mu", mu_i), ("c", c_i)):
            if a is not None and a.ptr % _arrays.ITEMSIZE[a.dtype]:
                raise ValueError(f"{n}: its data address {a.ptr:#x} is not a multiple of "
                                 f"its item size ({_arrays.ITEMSIZE[a.dtype]} bytes)")

    out_arr, gamma_arr, mu_arr, c_arr = out, gamma, mu, c
    if mu_i.device[0] == "cpu":
        out_arr = _arrays.host_view(out, out_i.dtype)
        mu_arr = _arrays.host_view(mu, mu_i.dtype)
        gamma_arr = None if gamma is None else _arrays.host_view(gamma, gamma_i.dtype)
        if c_i is not None:
            c_arr = _arrays.host_view(c, c_i.dtype)
            if c_arr.ndim == 0:
                c_arr = np.broadcast_to(c_arr, (Co,))
    c_value = 0.0
    if c_i is None:
        c_value, c_arr = c_float(c), None
        if acc == "float32" and (_F32_MAX < abs(c_value) < float("inf")
                                 or 0 < abs(c_value) < _F32_TINY):
            # c is a Python float beyond float32's normal range: kept exact rather than
            # turned into Inf, 0 or a number with a few digits left
            acc = "float64"
    return Problem(
        out_arr, gamma_arr, mu_arr, c_arr, c_value, out_i, gamma_i, mu_i, c_i,
        len(out_i.shape) == 7, gamma_i is not None and len(gamma_i.shape) == 7,
        B, Ci, Co, G, H, W, Ho, Wo, kh, kw, sh, sw, ph, pw, dh, dw, acc,
        mu_i.kind, _device_of(mu_i, (out_i, gamma_i, c_i)),
    )


def c_float(c) -> float:
    """A number c as a float; a ValueError naming c when it is beyond float64's range (an
    int with more than 308 digits)."""
    try:
        return float(c)
    except OverflowError:
        raise ValueError(f"c: {type(c).__name__} too large for a float64 "
                         f"(about 1e{len(str(abs(int(c)))) - 1})") from None


def _check(out_i, gamma_i, mu_i, c_i, kernel_size, stride, padding, dilation, groups):
    """Every check of SPEC section 3 that does not need the addresses; raises on the first
    failure. Returns (G, kh, kw, sh, sw, ph, pw, dh, dw, B, Ci, Co, H, W, Ho, Wo, acc,
    spans): spans are the byte ranges (from the address) that out, gamma, mu and c can
    touch, None for an absent or empty array."""
    G, (kh, kw), weight, (sh, sw), (ph, pw), (dh, dw) = conv_params(
        kernel_size, stride, padding, dilation, groups)
    arrays = [(n, a) for n, a in (("out", out_i), ("gamma", gamma_i), ("mu", mu_i), ("c", c_i))
              if a is not None]
    _check_arrays(arrays)
    # Shapes, in the order the data flows: mu defines B, Ci, H, W; out defines Co.
    B, Ci, H, W, Ho, Wo, sh, sw, dh, dw = _input(mu_i, G, kh, kw, sh, sw, ph, pw, dh, dw,
                                                 covariances=[("gamma", gamma_i)])
    if len(out_i.shape) == 7:
        Co = out_i.shape[1]
        _expect("out", out_i.shape, (B, Co, Ho, Wo, Co, Ho, Wo), "(B, Co, Ho, Wo, Co, Ho, Wo)")
    elif len(out_i.shape) == 6:
        Co = out_i.shape[1]
        _expect("out", out_i.shape, (B, Co, Ho, Wo, Ho, Wo), "(B, Co, Ho, Wo, Ho, Wo)")
    else:
        raise ShapeError(f"out: expected 7 dims (B, Co, Ho, Wo, Co, Ho, Wo) or 6 dims "
                         f"(B, Co, Ho, Wo, Ho, Wo); got shape {out_i.shape}")
    if Co % G:
        raise ShapeError(f"groups: Co = {Co} (out.shape[1]) is not divisible by groups = {G}")
    if weight is not None and weight != (Co, Ci // G):
        raise ShapeError(f"kernel_size: weight shape expected (Co, Ci // groups, kh, kw) = "
                         f"{(Co, Ci // G, kh, kw)}; got {(*weight, kh, kw)}")
    if c_i is not None and c_i.shape not in ((), (Co,)):
        raise ShapeError(f"c: expected a number, a 0-d array or shape (Co,) = ({Co},); "
                         f"got shape {c_i.shape}")
    if out_i.readonly:
        raise ValueError("out: is read-only; accumulate writes into it in place")
    overlapping = _arrays.self_overlapping(out_i)
    if overlapping:
        raise ValueError("out: some of its elements share memory (a zero or overlapping "
                         "stride, as from expand or broadcast_to); accumulate writes into "
                         "each element, so pass an array whose elements are distinct")
    if overlapping is None:
        raise ValueError(f"out: its strides {out_i.strides} (in elements) interleave so that "
                         "whether two of its elements share memory cannot be settled "
                         "cheaply; pass a contiguous out or a view of one")

    acc = "float32"
    for _, a in arrays:
        if a.dtype == "float64":
            acc = "float64"
    return G, kh, kw, sh, sw, ph, pw, dh, dw, B, Ci, Co, H, W, Ho, Wo, acc, _spans(
        out_i, gamma_i, mu_i, c_i)


def _check_kinds(arrays):
    """TypeError unless the (name, ArrayInfo) pairs are of one kind on one device. A CUDA
    array whose ordinal is unknown (a generic one the driver does not place, such as an
    empty one with no address) goes with any ordinal."""
    if (len({(a.kind, a.device[0]) for _, a in arrays}) > 1
            or len({a.device[1] for _, a in arrays} - {None}) > 1):
        got = ", ".join(f"{n}: {a.kind} on {_device_str(a.device)}" for n, a in arrays)
        raise TypeError(f"all arrays must be of one kind on one device; got {got}")


def _check_streams(arrays):
    """TypeError when a generic CUDA array of the (name, ArrayInfo or None) pairs names a
    stream that belongs to another device than the arrays' (where the driver says:
    ``_arrays.stream_device``): a launch there would run on that device with this one's
    addresses. Checked on every call (after ``_check_kinds``): the streams are not part of
    the signature."""
    ordinals = {a.device[1] for _, a in arrays if a is not None} - {None}
    for n, a in arrays:
        if a is not None and a.stream is not None and ordinals:
            d = _arrays.stream_device(a.stream)
            if d is not None and d not in ordinals:
                raise TypeError(
                    f"{n}: its __cuda_array_interface__ names stream {a.stream:#x}, which "
                    f"belongs to cuda:{d}; the arrays are on cuda:{min(ordinals)}")


def _device_of(mu_i, others):
    """The call's device: mu's, or, where mu's CUDA ordinal is unknown, the first other
    array's known one (``_check_kinds`` has made sure there is at most one)."""
    if mu_i.device[1] is None:
        for a in others:
            if a is not None and a.device[1] is not None:
                return a.device
    return mu_i.device


def _spans(*infos):
    """Each array's byte span from its address (``_arrays.span``), None for an absent one."""
    return tuple(None if i is None else _arrays.span(i) for i in infos)


def _device_str(device):
    return device[0] if device[1] is None else f"{device[0]}:{device[1]}"


#: The largest padding that reaches the kernels. Every input position they form is then
#: below 2**62 in size: a valid call's stride and dilation reach no further than the
#: padded input, and a stride that does not matter is made small (below).
_PADDING_LIMIT = 1 << 60


def _axis(n, k, s, p, d, dim, kdim):
    """``(n_out, s, d)`` of one axis: its output size as torch's conv2d has it, and its
    stride and dilation made small where their size does not matter (one output: the
    least stride that gives one; a kernel of 1: dilation 1), so a huge but meaningless
    value computes and the same n_out comes out again. A ShapeError names a padding too
    large for 64-bit indexing."""
    if p > _PADDING_LIMIT:
        raise ShapeError(f"padding: {p} along {dim} is beyond what 64-bit indexing reaches "
                         f"(at most 2**60)")
    span = d * (k - 1) + 1
    if n + 2 * p < span:
        raise ShapeError(
            f"mu: padded input {dim} + 2*padding = {n + 2 * p} is smaller than the dilated "
            f"kernel dilation*({kdim}-1)+1 = {span}")
    n_out = (n + 2 * p - span) // s + 1
    return n_out, (n + 2 * p - span + 1 if n_out == 1 else s), (1 if k == 1 else d)


def _grid(H, W, kh, kw, sh, sw, ph, pw, dh, dw):
    """``(Ho, Wo, sh, sw, dh, dw)``: :func:`_axis` along H and W."""
    (Ho, sh, dh), (Wo, sw, dw) = (_axis(H, kh, sh, ph, dh, "H", "kh"),
                                  _axis(W, kw, sw, pw, dw, "W", "kw"))
    return Ho, Wo, sh, sw, dh, dw


def _dtypes(p: Problem) -> frozenset:
    # No generator: this runs on every call, and a generator costs twice as much.
    mu, gamma, c = p.mu_info.dtype, p.gamma_info, p.c_info
    return frozenset((p.out_info.dtype, mu, mu if gamma is None else gamma.dtype,
                      mu if c is None else c.dtype))


def accumulate(out, gamma, mu, c, kernel_size, *, stride=1, padding=0, dilation=1,
               groups=1, backend=None):
    """Add the weight-noise covariance term of a 2-D convolution into ``out``, in place.

    ``out[b, c0, i0, j0, (c0,) i1, j1] += c[c0] * S[b, g(c0), i0, j0, i1, j1]`` with ``S``
    the patch moment of SPEC section 1 (see :func:`patch_moment`). Only the
    channel-diagonal of a full-layout ``out`` changes. Returns ``out`` itself. On torch
    tensors it is an in-place op that autograd and ``torch.compile`` understand
    (docs/autograd.md).

    >>> import numpy as np, convcov
    >>> mu = np.ones((1, 2, 4, 4), np.float32)
    >>> out = np.zeros((1, 3, 2, 2, 3, 2, 2), np.float32)
    >>> convcov.accumulate(out, None, mu, 0.5, 3, backend="numpy")[0, 1, 0, 0, 1, 1, 1]
    np.float32(9.0)
    """
    fast_key = None
    tm = type(mu)
    if tm is not _ndarray:
        if tm is not _Tensor and tm.__module__.startswith("dask."):
            from . import _dask  # imports dask: only once a dask array is seen

            return _dask.accumulate(out, gamma, mu, c, kernel_size, stride=stride,
                                    padding=padding, dilation=dilation, groups=groups,
                                    backend=backend)
        plain = tm is _Tensor and not _is_compiling()
        if not plain and _traced(mu):  # (_traced binds _Tensor at the first torch tensor)
            # Torch while torch.compile or a tracer looks: the operator, before anything
            # reads data.
            return _ops().accumulate(out, gamma, mu, c, kernel_size, stride, padding,
                                     dilation, groups, backend)
        if tm is _Tensor:  # (not compiling: that returned above)
            # A plain torch tensor: a call signature seen before runs its bound launcher.
            fast_key = _torch_fast(out, gamma, mu, c, kernel_size, stride, padding, dilation,
                                   groups, backend)
            if fast_key is True:
                return out
    else:  # a NumPy array: likewise
        fast_key = _numpy_fast(out, gamma, mu, c, kernel_size, stride, padding, dilation,
                               groups, backend)
        if fast_key is True:
            return out
    p = normalise(out, gamma, mu, c, kernel_size, stride, padding, dilation, groups)
    b = _registry.select(backend, p.device[0], _dtypes(p))
    if p.kind == "torch":
        # Autograd records this call (out and mu are torch tensors now): the operator.
        if _grad_enabled() and (out.requires_grad or mu.requires_grad
                                or (gamma is not None and gamma.requires_grad)
                                or getattr(c, "requires_grad", False)):
            return _ops().accumulate(out, gamma, mu, c, kernel_size, stride, padding,
                                     dilation, groups, backend, p)
        _increment_version(out)  # count the write, as torch's in-place ops do
    if not p.empty:
        b.accumulate(p)
    if fast_key is not None:
        # The call went through: later calls with this signature may skip the above.
        _remember(_bound, fast_key, _bind(b, p))
    return out


# ---------------------------------------------------------------------------------------
# Torch tensors and NumPy arrays: the fast path of repeated call signatures.
#
# A small call's time is mostly the host's (SPEC's toy and mid workloads on a GPU, toy on
# the host): the validation above, though cached per signature, still describes each
# array (ArrayInfo), builds a Problem, selects a backend and lets the backend find its
# launch plan. A signature seen before (types, dtypes, devices, shapes, strides, address
# alignment, writeability, conv parameters, backend request, CONVCOV_BACKEND and the
# registry's generation) skips all of that: it keeps a _Bound (what validation derived,
# and the backend's launcher for it, Backend.bind), and a call only reads the addresses,
# checks the aliasing (and, for torch, the autograd routing and the write count) and
# launches. Exact classes only (no subclass; for torch, not while torch.compile looks).
# CuPy and numba device arrays take the full path: their descriptions
# (__cuda_array_interface__) cost what the full path's caches already save.

_Tensor = None  # torch.Tensor, once a torch tensor was seen (_traced binds it)
_environ_get, _ENV_KEY = os.environ.get, _registry.ENV_VAR  # CONVCOV_BACKEND, per call


class _Bound:
    """A validated call signature: its backend's launcher (Backend.bind) and, for gamma,
    mu and c, the open interval of (its address - out's address) in which it would
    overlap out (None: it cannot, being absent or empty, or out being empty)."""

    __slots__ = ("run", "g", "m", "c")

    def __init__(self, run, spans):
        self.run = run
        so = spans[0]
        # [o + so0, o + so1) and [x + sx0, x + sx1) meet iff so0 - sx1 < x - o < so1 - sx0
        self.g, self.m, self.c = (None if so is None or sx is None else
                                  (so[0] - sx[1], so[1] - sx[0]) for sx in spans[1:])


def _aliased(e: _Bound, o_ptr, g_ptr, m_ptr, c_ptr) -> bool:
    """Whether gamma, mu or c at these addresses would overlap out (the full path then
    raises the error): _arrays.overlaps on e's intervals, which this runs on every call."""
    g, m, c = e.g, e.m, e.c
    return ((g is not None and g[0] < g_ptr - o_ptr < g[1])
            or (m is not None and m[0] < m_ptr - o_ptr < m[1])
            or (c is not None and c[0] < c_ptr - o_ptr < c[1]))


_bound: dict = {}  # fast signature (_torch_fast, _numpy_fast) -> _Bound, or None: no fast path


def _noop(*args):
    pass


def _bind(b: _registry.Backend, p: Problem):
    """The fast path's entry for p's signature: None when the backend cannot bind."""
    run = _noop if p.empty else b.bind(p)
    return None if run is None else _Bound(
        run, _spans(p.out_info, p.gamma_info, p.mu_info, p.c_info))


def _number_c(tc, c):
    """(key, address 0, value) for a c of type tc that is a Python number in float32's
    normal range, or 0; None for anything else. (Beyond that range the full path decides
    the sums' dtype from c: normalise. NaN compares false, so it takes the full path too.)"""
    if (tc is float or tc is int) and (_F32_TINY <= c <= _F32_MAX or c == 0
                                       or -_F32_MAX <= c <= -_F32_TINY):
        return tc, 0, float(c)
    return None


def _plain_call(kernel_size, stride, padding, dilation, groups, backend) -> bool:
    """Conv parameters that are ints or tuples of ints and a backend that is a name or
    None: what a fast path's key may hold (anything else takes the full path)."""
    return ((type(kernel_size) is int or _plain_param(kernel_size))
            and (type(stride) is int or _plain_param(stride))
            and (type(padding) is int or _plain_param(padding))
            and (type(dilation) is int or _plain_param(dilation))
            and type(groups) is int and (backend is None or type(backend) is str))


def _torch_fast(out, gamma, mu, c, kernel_size, stride, padding, dilation, groups, backend):
    """Run a torch call whose signature is bound (True); else the signature's key, for
    accumulate to bind after its full path, or None when the call cannot take this path.

    The key holds everything normalise's checks and the backend's choice and launch plan
    depend on, read straight from the tensors; anything unusual (a subclass, a c that is
    neither a Python number nor a tensor, conv parameters that are not plain ints, a
    backend list, autograd recording, aliasing) takes the full path, which validates,
    routes and raises exactly as before.
    """
    T = _Tensor
    if type(out) is not T:
        return None
    tc = type(c)
    try:  # (a tensor without memory, sparse or vmap's, raises here: the full path says so)
        if tc is T:
            c_ptr = c.data_ptr()
            c_key, c_value = (c.dtype, c.shape, c.stride(), c.device, c_ptr & 15), 0.0
        else:
            number = _number_c(tc, c)
            if number is None:
                return None
            c_key, c_ptr, c_value = number
        if gamma is None:
            g_key, g_ptr = None, 0
        elif type(gamma) is T:
            g_ptr = gamma.data_ptr()
            g_key = (gamma.dtype, gamma.shape, gamma.stride(), gamma.device, g_ptr & 15)
        else:
            return None
        if not _plain_call(kernel_size, stride, padding, dilation, groups, backend):
            return None
        o_ptr, m_ptr = out.data_ptr(), mu.data_ptr()
        key = (kernel_size, stride, padding, dilation, groups, backend,
               _environ_get(_ENV_KEY), _registry.generation,
               out.dtype, out.shape, out.stride(), out.device, o_ptr & 15, g_key,
               mu.dtype, mu.shape, mu.stride(), mu.device, m_ptr & 15, c_key)
    except RuntimeError:
        return None
    e = _bound.get(key, key)
    if e is key:  # not seen: the full path, then bind
        return key
    if e is None or (_grad_enabled() and (
            out.requires_grad or mu.requires_grad or (g_key is not None and gamma.requires_grad)
            or (tc is T and c.requires_grad))):
        return None
    # A lazily negated view has its signature's key but not its values (the full path
    # refuses it); a tensor of another layout has no data pointer, so it raised above.
    if out.is_neg() or mu.is_neg() or (g_key is not None and gamma.is_neg()) or (
            tc is T and c.is_neg()):
        return None
    if _aliased(e, o_ptr, g_ptr, m_ptr, c_ptr):
        return None
    e.run(out, gamma, mu, c, o_ptr, g_ptr, m_ptr, c_ptr, c_value)
    # Count the write, as torch's in-place ops do; after the launch, which is what a
    # small call's time waits for (the full path counts first: no difference to autograd).
    _increment_version(out)
    return True


def _address(a) -> int:
    """The data address of a NumPy array, as NumPy publishes it."""
    return a.__array_interface__["data"][0]


def _numpy_fast(out, gamma, mu, c, kernel_size, stride, padding, dilation, groups, backend):
    """_torch_fast for NumPy arrays (mu is one): run a bound signature (True); else its
    key, or None when the call cannot take this path. No autograd, no version count;
    out's writeability is part of the key (the full path raises for a read-only out).

    It mirrors _torch_fast step for step, on purpose: both run before every small call's
    first kernel, and a helper shared by the two would cost a Python call for each array
    (about 50 ns each on this project's host, more on the GPU machines')."""
    if type(out) is not _ndarray:
        return None
    tc = type(c)
    if tc is _ndarray:
        c_ptr = _address(c)
        c_key, c_value = (c.dtype, c.shape, c.strides, c_ptr & 15), 0.0
    else:
        number = _number_c(tc, c)
        if number is None:
            return None
        c_key, c_ptr, c_value = number
    if gamma is None:
        g_key, g_ptr = None, 0
    elif type(gamma) is _ndarray:
        g_ptr = _address(gamma)
        g_key = (gamma.dtype, gamma.shape, gamma.strides, g_ptr & 15)
    else:
        return None
    if not _plain_call(kernel_size, stride, padding, dilation, groups, backend):
        return None
    o_ptr, m_ptr = _address(out), _address(mu)
    # "numpy" first: never equal to a torch signature's key, whose first item is an int
    # or a tuple, so no comparison reaches a NumPy dtype against a torch one
    key = ("numpy", kernel_size, stride, padding, dilation, groups, backend,
           _environ_get(_ENV_KEY), _registry.generation,
           out.dtype, out.shape, out.strides, out.flags.writeable, o_ptr & 15, g_key,
           mu.dtype, mu.shape, mu.strides, m_ptr & 15, c_key)
    e = _bound.get(key, key)
    if e is key:  # not seen: the full path, then bind
        return key
    if e is None or _aliased(e, o_ptr, g_ptr, m_ptr, c_ptr):
        return None
    e.run(out, gamma, mu, c, o_ptr, g_ptr, m_ptr, c_ptr, c_value)
    return True


def accumulate_unrouted(out, gamma, mu, c, kernel_size, stride, padding, dilation, groups,
                        backend):
    """:func:`accumulate` without the torch routing: the kernel of ``convcov::accumulate_``
    (torch_ops.py), which runs below autograd and counts the write itself."""
    p = normalise(out, gamma, mu, c, kernel_size, stride, padding, dilation, groups)
    b = _registry.select(backend, p.device[0], _dtypes(p))
    if not p.empty:
        b.accumulate(p)
    return out


def accumulate_apart(new, out, gamma, mu, c, kernel_size, stride, padding, dilation, groups,
                     backend):
    """``new = out + c * S`` for NumPy or CuPy arrays, ``out`` only read: :func:`accumulate`
    for a caller that may not write ``out`` (dask's tasks). ``new``: of out's kind, shape
    and dtype, apart from every input. Validated as the call into ``new``; out's values
    reach the backend as the source of Backend.accumulate_apart where the two share their
    strides and rows (i1, j1) are contiguous in the diagonal layout, else new gets a copy
    of out and the call runs in place."""
    p = normalise(new, gamma, mu, c, kernel_size, stride, padding, dilation, groups)
    b = _registry.select(backend, p.device[0], _dtypes(p))
    if (p.empty or p.full_out or out.strides != new.strides
            or p.out_info.strides[4:] != (p.Wo, 1)):
        new[...] = out
        if not p.empty:
            b.accumulate(p)
    else:
        b.accumulate_apart(p, out)
    return new


def patch_moment(gamma, mu, kernel_size, *, stride=1, padding=0, dilation=1, groups=1,
                 backend=None):
    """``S[b, g, i0, j0, i1, j1]``: the per-group patch second moment of SPEC section 1.

    Shape ``(B, G, Ho, Wo, Ho, Wo)``, same array library and device as ``mu``, float32
    (float64 when any input is float64). ``accumulate`` adds ``c[c0] * S[:, g(c0)]`` to
    the diagonal of ``out``; this is that ``S`` on its own, Co / G times smaller.
    Differentiable on torch tensors (docs/autograd.md).

    >>> import numpy as np, convcov
    >>> S = convcov.patch_moment(None, np.ones((1, 1, 3, 3)), 2, backend="numpy")
    >>> S.shape, float(S[0, 0, 0, 0, 1, 1])
    ((1, 1, 2, 2, 2, 2), 4.0)
    """
    if type(mu) is not _ndarray and type(mu).__module__.startswith("dask."):
        from . import _dask  # imports dask: only once a dask array is seen

        return _dask.patch_moment(gamma, mu, kernel_size, stride=stride, padding=padding,
                                  dilation=dilation, groups=groups, backend=backend)
    if type(mu) is not _ndarray and (_traced(mu) or _records(None, gamma, mu, None)):
        return _ops().patch_moment(gamma, mu, kernel_size, stride, padding, dilation, groups,
                                   backend)
    return patch_moment_unrouted(gamma, mu, kernel_size, stride, padding, dilation, groups,
                                 backend)


def check_patch_moment(gamma, mu, kernel_size, stride, padding, dilation, groups, backend):
    """Validate a ``patch_moment`` call; ``(shape of S, dtype name of S, conv parameters)``."""
    mu_i = _arrays.info(mu, "mu")
    G, (kh, kw), weight, (sh, sw), (ph, pw), (dh, dw) = conv_params(
        kernel_size, stride, padding, dilation, groups)
    arrays = [("mu", mu_i)] + ([] if gamma is None else [("gamma", _arrays.info(gamma, "gamma"))])
    _check_arrays(arrays)
    _check_streams(arrays)
    B, Ci, H, W, Ho, Wo, sh, sw, dh, dw = _input(mu_i, G, kh, kw, sh, sw, ph, pw, dh, dw,
                                                 weight, arrays[1:])
    dtypes = frozenset(a.dtype for _, a in arrays)
    _registry.select(backend, mu_i.device[0], dtypes)  # before allocating: a bad name costs nothing
    return ((B, G, Ho, Wo, Ho, Wo), "float64" if "float64" in dtypes else "float32",
            ((kh, kw), (sh, sw), (ph, pw), (dh, dw), G))


def patch_moment_unrouted(gamma, mu, kernel_size, stride, padding, dilation, groups, backend):
    """:func:`patch_moment` without the torch routing (the kernel of ``convcov::patch_moment``)."""
    shape, dtype, (k, s, p, d, G) = check_patch_moment(gamma, mu, kernel_size, stride, padding,
                                                        dilation, groups, backend)
    S = _arrays.zeros_like_kind(mu, _arrays.info(mu, "mu"), shape, dtype)
    # S is "accumulate into zeros with one output channel per group and c = 1".
    return accumulate_unrouted(S, gamma, mu, 1.0, k, s, p, d, G, backend)


# ---------------------------------------------------------------------------------------
# Torch: routing to the operators of torch_ops.py, and counting in-place writes.

_torch_ops = None  # convcov.torch_ops, once a call needed it (importing it imports torch)
_torch_plain: tuple = ()  # (torch.Tensor, torch.nn.Parameter), once a torch tensor was seen


def _is_compiling() -> bool:  # torch.compiler.is_compiling, once a torch tensor was seen
    return False


def _increment_version(t) -> None:  # torch.autograd.graph.increment_version, likewise
    raise AssertionError("only called for torch tensors, after _traced")


def _grad_enabled() -> bool:  # torch.is_grad_enabled, likewise
    raise AssertionError("only called for torch tensors, after _traced")


def _traced(mu) -> bool:
    """Whether ``mu`` is a torch tensor that ``torch.compile`` or a tracer is looking at:
    the call must then become convcov's operator (one graph node, not a graph break) and
    nothing may read its data. True for tensor subclasses (tracers' fake and functional
    tensors). Written so that Dynamo traces it: no import, no data pointer, no numpy.

    The first torch tensor binds the torch functions used on the hot path, so that later
    calls pay one type check and ``_is_compiling()`` (see ``accumulate``).
    """
    global _torch_plain, _is_compiling, _increment_version, _grad_enabled, _Tensor
    torch = _modules.get("torch")
    if torch is None or not isinstance(mu, torch.Tensor):
        return False
    if not _torch_plain:
        _is_compiling = torch.compiler.is_compiling
        _increment_version = torch.autograd.graph.increment_version
        _grad_enabled = torch.is_grad_enabled
        _torch_plain = (torch.Tensor, torch.nn.Parameter)
        _Tensor = torch.Tensor
    return type(mu) not in _torch_plain or _is_compiling()


def _records(out, gamma, mu, c) -> bool:
    """Whether autograd records a call on torch tensors: grad mode on and an input
    requires grad. Such calls go through the operator, which gives the gradients.
    (``accumulate`` inlines this, for arrays it has validated.)"""
    torch = _modules.get("torch")
    if torch is None or not torch.is_grad_enabled():
        return False
    T = torch.Tensor  # no generator, no _any_requires_grad: both cost more on this path
    return ((isinstance(mu, T) and mu.requires_grad) or (isinstance(out, T) and out.requires_grad)
            or (isinstance(gamma, T) and gamma.requires_grad)
            or (isinstance(c, T) and c.requires_grad))


def _ops():
    global _torch_ops
    if _torch_ops is None:
        from . import torch_ops

        _torch_ops = torch_ops
    return _torch_ops


# ---------------------------------------------------------------------------------------
# The backward: patch_moment_vjp (docs/autograd.md).


@dataclass(slots=True)
class Adjoint:
    """One validated backward call of ``patch_moment``: ``grad_S`` in, the gradients of mu
    and of gamma's channel-diagonal out. Names as in :class:`Problem`."""

    grad_S: Any  # (B, G, Ho, Wo, Ho, Wo), read
    grad_gamma: Any  # full (B, Ci, H, W, Ci, H, W), diagonal (B, Ci, H, W, H, W), or None
    grad_mu: Any  # (B, Ci, H, W), or None
    mu: Any  # (B, Ci, H, W), read
    grad_S_info: ArrayInfo
    grad_gamma_info: ArrayInfo | None
    grad_mu_info: ArrayInfo | None
    mu_info: ArrayInfo
    full_gamma: bool  # grad_gamma has the full layout: write only its channel-diagonal
    B: int
    Ci: int
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
    acc: str  # "float32" or "float64"
    kind: str
    device: tuple

    @property
    def empty(self) -> bool:
        return 0 in (self.B, self.Ci, self.H, self.W) or (self.grad_gamma is None
                                                        and self.grad_mu is None)

    written = 2  # grad_gamma and grad_mu (either may be absent): launch_streams

    @property
    def infos(self) -> tuple:
        """The arrays' ArrayInfos, the ones written first (None for absent ones)."""
        return (self.grad_gamma_info, self.grad_mu_info, self.grad_S_info, self.mu_info)


def patch_moment_vjp(grad_S, mu, kernel_size, *, grad_gamma=None, grad_mu=None, stride=1,
                     padding=0, dilation=1, groups=1, backend=None) -> None:
    """The backward of :func:`patch_moment`: given ``grad_S = dL/dS``, overwrite
    ``grad_mu`` with ``dL/dmu`` and the channel-diagonal of ``grad_gamma`` with ``dL/dgamma``.

    ``grad_S``: ``(B, G, Ho, Wo, Ho, Wo)``. ``grad_gamma``: full ``(B, Ci, H, W, Ci, H, W)``
    (only its channel-diagonal is written; the rest is the caller's, normally zeros) or
    diagonal ``(B, Ci, H, W, H, W)``; None when not wanted, likewise ``grad_mu``,
    ``(B, Ci, H, W)``. The forward's gamma is not needed: S is linear in it. Arrays of one
    kind on one device, any strides, float dtypes; sums in float32 or wider, each result
    rounded once into its array. The backend is chosen as for the forward, among those
    that have a backward. Torch autograd calls this through ``convcov::patch_moment_vjp``.

    >>> import numpy as np
    >>> from convcov._frontend import patch_moment_vjp
    >>> grad_mu = np.empty((1, 1, 3, 3))
    >>> patch_moment_vjp(np.ones((1, 1, 2, 2, 2, 2)), np.ones((1, 1, 3, 3)), 2,
    ...                  grad_mu=grad_mu, backend="numpy")
    >>> float(grad_mu[0, 0, 1, 1])  # the centre is in all 4 windows: 4 * 2 * (sum of 4 * 1)
    32.0
    """
    G, (kh, kw), weight, (sh, sw), (ph, pw), (dh, dw) = conv_params(
        kernel_size, stride, padding, dilation, groups)
    arrays = [("grad_S", _arrays.info(grad_S, "grad_S")), ("mu", _arrays.info(mu, "mu"))]
    if grad_gamma is not None:
        arrays.append(("grad_gamma", _arrays.info(grad_gamma, "grad_gamma")))
    if grad_mu is not None:
        arrays.append(("grad_mu", _arrays.info(grad_mu, "grad_mu")))
    infos = dict(arrays)
    _check_arrays(arrays)
    _check_streams(arrays)
    mu_i, S_i = infos["mu"], infos["grad_S"]
    gg_i, gm_i = infos.get("grad_gamma"), infos.get("grad_mu")
    B, Ci, H, W, Ho, Wo, sh, sw, dh, dw = _input(mu_i, G, kh, kw, sh, sw, ph, pw, dh, dw,
                                                 weight, [("grad_gamma", gg_i)])
    _expect("grad_S", S_i.shape, (B, G, Ho, Wo, Ho, Wo), "(B, G, Ho, Wo, Ho, Wo)")
    if gm_i is not None:
        _expect("grad_mu", gm_i.shape, (B, Ci, H, W), "(B, Ci, H, W)")
    # The gradients are written: writable, and sharing memory with nothing else here.
    written = [(n, infos[n], x) for n, x in (("grad_gamma", grad_gamma), ("grad_mu", grad_mu))
               if x is not None]
    for n, a, x in written:
        if a.readonly:
            raise ValueError(f"{n}: is read-only; patch_moment_vjp writes into it")
        others = [(m, infos[m], y) for m, y in (("grad_S", grad_S), ("mu", mu),
                                                 ("grad_gamma", grad_gamma))
                  if m != n and y is not None]
        for m, _ in _arrays.overlapping(a, x, others):
            raise ValueError(f"{n}: shares memory with {m}; pass separate arrays")
    dtypes = frozenset(a.dtype for _, a in arrays)
    acc = "float64" if "float64" in dtypes else "float32"
    device_type = mu_i.device[0]
    b = _select_vjp(backend, device_type, dtypes)
    host = device_type == "cpu"
    views = {n: _arrays.host_view(x, infos[n].dtype) if host else x
             for n, x in (("grad_S", grad_S), ("mu", mu), ("grad_gamma", grad_gamma),
                          ("grad_mu", grad_mu)) if x is not None}
    a = Adjoint(views["grad_S"], views.get("grad_gamma"), views.get("grad_mu"), views["mu"],
                S_i, gg_i, gm_i, mu_i, gg_i is not None and len(gg_i.shape) == 7,
                B, Ci, G, H, W, Ho, Wo, kh, kw, sh, sw, ph, pw, dh, dw, acc,
                mu_i.kind, _device_of(mu_i, (S_i, gg_i, gm_i)))
    if not a.empty:
        b.patch_moment_vjp(a)


def has_vjp(b: _registry.Backend) -> bool:
    """Whether backend ``b`` has its own backward (overrides ``patch_moment_vjp``)."""
    return type(b).patch_moment_vjp is not _registry.Backend.patch_moment_vjp


def _select_vjp(requested, device: str, dtypes: frozenset) -> _registry.Backend:
    """The forward's choice when it has a backward; else the next preference that has one
    (a name given alone, without a backward, is an error naming it)."""
    b = _registry.select(requested, device, dtypes)
    if has_vjp(b):
        return b
    if requested is not None:
        prefs, source = _registry._parse(requested, "backend="), "backend="
    elif os.environ.get(_registry.ENV_VAR, "").strip():
        prefs = _registry._parse(os.environ[_registry.ENV_VAR], _registry.ENV_VAR)
        source = _registry.ENV_VAR
    else:
        prefs, source = list(_registry.AUTO[device]), "automatic choice"
    refusals = []
    for n in prefs:
        cand = _registry.get(n)
        why = _registry._refusal(cand, device, dtypes)
        if why is None and not has_vjp(cand):
            why = f"{n}: has no backward (patch_moment_vjp) yet"
        if why is None:
            return cand
        refusals.append(why)
    raise BackendError(f"no backend from {source} ({', '.join(prefs)}) can run the backward "
                       "of this call: " + "; ".join(refusals))
