"""``conv2d_moments``: the mean and covariance of a whole conv layer's output (SPEC section 6).

Owns the propagation of a mean ``mu`` and a covariance ``gamma`` through
``y = conv2d(x, weight + dW) + bias``: the mean ``conv2d(mu, weight, bias)``; the carried term
``K gamma K^T`` in the layout asked for (two convolutions, one along each position set of
``gamma``, the second one restricted to what the layout keeps); the weight-noise term
(``convcov.accumulate`` for a number or per-channel ``c``, one channel mixing per kernel
offset for a per-weight ``c``); the bias-noise term ``c_bias``; and the exact symmetrisation.
The derivation is docs/moments.md.

Validation reuses the front end's helpers (``_frontend``, ``_arrays``) and happens before
anything is written. NumPy arrays are computed with NumPy (BLAS through ``matmul``), torch
tensors with torch ops on their own device, so autograd differentiates every input. Both run
the same code through a small namespace of array operations (:class:`_NumpyOps`,
:class:`_TorchOps`), whose one convolution is 3-D: the trailing (or leading) axis with a
kernel of 1 carries the covariance's other index set along.

On CUDA without autograd (CuPy installed), full gamma's convolutions in float32 with few
output channels a group (compute capability 8.0 or later) are convcov's own kernel, and the
symmetrisation another (:mod:`convcov.backends._cupy_moments`; :func:`_rows_full`).

CuPy arrays and generic CUDA arrays (``__cuda_array_interface__``: numba device arrays) are
computed by the same torch ops, on torch tensors that share their memory (:func:`_shared`);
the results are handed back as arrays of the caller's kind (``out`` is written in place).

Must not import torch but for those: a torch tensor can only arrive when torch is already
imported.
"""

from __future__ import annotations

import contextlib
import importlib.util
import itertools
import math
import numbers
import sys
from dataclasses import dataclass

import numpy as np

from . import _arrays, _frontend, _registry
from ._errors import BackendError, ShapeError

LAYOUTS = ("full", "diag", "var")
#: Bytes of im2col columns the NumPy convolution builds at once (a cache-friendly chunk).
_CHUNK = 32 << 20
#: Entries a chunk holds, by device: the variances layout's window blocks of gamma (a
#: chunk of output rows, or of one row), the diagonal layout's blocks of output channels
#: with their products by the weights (:func:`_per_channel`). On the host a chunk in cache
#: (var on the 2-core host, 2^18 against 2^26: 16ch 32 -> 19 ms, 64ch 37 -> 22 ms); on
#: CUDA few launches.
_BLOCK_ENTRIES = {"cpu": 1 << 18, "cuda": 1 << 26}
#: Devices whose grouped full layout runs its second convolution as a 2-D convolution
#: batched over the riding index (:func:`_carried`), not as cuDNN's grouped 3-D one:
#: depthwise 24.1 -> 19.6 ms on the H200; on the host 1.15x slower.
UNGROUPED_ON = ("cuda",)
#: Devices whose full layout of a layer of one input channel a group (depthwise) is
#: matrix products with each output channel's dense convolution matrix
#: (:func:`_depthwise_dense`), not two grouped convolutions: on the 2-core host the two
#: convolutions of depthwise 8x8 (32 channels) take 88 -> 28 ms, 16x16 (16) 204 -> 88 ms
#: (oneDNN's depthwise convolutions run far below the matrix products' rate there,
#: despite the products' P / (kh kw) times the FLOPs); on an H100 the moments suite's
#: depthwise full layout 21.5 -> 18.8 ms.
DENSE_DEPTHWISE_ON = ("cpu", "cuda")
#: Devices whose full layout (torch tensors, no gradient) runs both convolutions in
#: channels-last order (:func:`_channels_last`): on the 2-core host oneDNN's channels-last
#: convolutions are 1.6-1.8x its NCHW ones; full layout 16ch 289-295 -> 231 ms, 64ch
#: 83-86 -> 69 ms, strided 72-76 -> 59-60 ms (float32, with c); diag's first (one group)
#: 16ch 154 -> 138 ms, strided 65-66 -> 57 ms, 64ch 46-49 either way.
CHANNELS_LAST_ON = ("cpu",)
#: Devices whose diagonal layout's second step (each output channel's convolution of its
#: own block, :func:`_per_channel`) is the host's window sums, not a convolution a channel:
#: diag on the 2-core host 16ch 170-174 -> 139-146 ms, 64ch 51-52 -> 44-47, strided 54-55 ->
#: 47-50, depthwise 1.4-1.5 -> 1.2-1.3 (torch; on NumPy arrays 1.1-1.35x likewise).
WINDOW_SUMS_ON = ("cpu",)
#: Bytes of gamma's rows a chunk of the channels-last path's first convolution takes (in
#: cache; no page faults of a gamma-sized buffer): against one chunk an image, 16ch 274 ->
#: 227 ms, 64ch 73 -> 60-70 ms, strided 79 -> 62 ms on the 2-core host.
_CL_CHUNK = 2 << 20
#: Output channels a group up to which full gamma's convolutions on CUDA are the rows
#: kernel (:func:`_rows_full`), not cuDNN's: H100, 16 -> 16 channels full 54.0 -> 27.3 ms
#: and diag 37.4 -> 27.2 ms; with 32 and 64 a group cuDNN's are faster (strided full 7.1
#: against 10.5 ms, 64ch 30.9 against 49.5 ms).
ROWS_MAX_CPG = 16


@dataclass
class _Call:
    """One validated call: sizes, conv parameters (made small where they cannot matter),
    forms of gamma ("none", "full", "diag", "var") and of c ("none", "channel", "weight")."""

    B: int
    Ci: int
    H: int
    W: int
    Co: int
    G: int
    kh: int
    kw: int
    Ho: int
    Wo: int
    stride: tuple
    padding: tuple
    dilation: tuple
    gamma_form: str
    c_form: str
    layout: str
    acc: str
    kind: str
    ordinal: int | None = None  # the CUDA device of generic CUDA arrays
    streams: tuple = ()  # theirs: (the stream computed on, the streams it waits for first)

    def out_shape(self, layout):
        B, Co, Ho, Wo = self.B, self.Co, self.Ho, self.Wo
        return {"full": (B, Co, Ho, Wo, Co, Ho, Wo), "diag": (B, Co, Ho, Wo, Ho, Wo),
                "var": (B, Co, Ho, Wo)}[layout]

    def ranges(self):
        """For each kernel row and column offset, the output rows (columns) ``[lo, hi)``
        whose input position under that offset is inside the image (not padding)."""
        def axis(n, n_out, k, s, p, d):
            return [(max(0, -((i * d - p) // s)), min(n_out, (n - 1 + p - i * d) // s + 1))
                    for i in range(k)]
        (sh, sw), (ph, pw), (dh, dw) = self.stride, self.padding, self.dilation
        return (axis(self.H, self.Ho, self.kh, sh, ph, dh),
                axis(self.W, self.Wo, self.kw, sw, pw, dw))

    @property
    def last(self):
        """The conv geometry on axes (H, W, E) of a 5-d array: the kernel on H, W, none on
        E (strides, paddings, dilations, and the kernel's place)."""
        return (*self.stride, 1), (*self.padding, 0), (*self.dilation, 1), "last"

    @property
    def first(self):
        """The conv geometry on axes (E, H, W): the kernel on the last two."""
        return (1, *self.stride), (0, *self.padding), (1, *self.dilation), "first"

    def runs(self, axis):
        """Output positions ``[a, b)`` along an axis in runs whose windows have the same
        kernel offsets ``[lo, hi)`` inside the image: ``(a, b, lo, hi)`` for each run (none
        for positions whose windows lie wholly in the padding)."""
        n_out, ranges = (self.Ho, self.Wo)[axis], self.ranges()[axis]
        cuts = sorted({0, n_out, *(v for r in ranges for v in r if 0 <= v <= n_out)})
        for a, b in zip(cuts, cuts[1:]):
            inside = [i for i, (lo, hi) in enumerate(ranges) if lo <= a < hi]
            if inside:
                yield a, b, inside[0], inside[-1] + 1

    def offsets(self):
        """Each kernel offset ``(u, v)`` that reads inside the image at some output
        position: ``(u, v, oi, oj, x, y)``, the output rows and columns (slices) whose input
        under it is inside, and the input rows and columns (slices) they read."""
        rh, rw = self.ranges()
        for u, v in itertools.product(range(self.kh), range(self.kw)):
            (lh, hh), (lw, hw) = rh[u], rw[v]
            if lh < hh and lw < hw:
                yield (u, v, slice(lh, hh), slice(lw, hw), self.window(0, u, lh, hh),
                       self.window(1, v, lw, hw))

    def window(self, axis, i, lo, hi):
        """The input slice that output positions ``[lo, hi)`` read under offset ``i``."""
        s, p, d = self.stride[axis], self.padding[axis], self.dilation[axis]
        return slice(lo * s + i * d - p, (hi - 1) * s + i * d - p + 1, s)


def _is_number(x) -> bool:
    return isinstance(x, numbers.Number) and not isinstance(x, (bool, np.bool_))


def _check(mu, gamma, weight, bias, c, c_bias, stride, padding, dilation, groups,
           out_layout, out, backend) -> _Call:
    """Every check of SPEC sections 3 and 6; raises before anything is computed."""
    if not isinstance(out_layout, str) or out_layout not in LAYOUTS:
        raise ValueError(f"out_layout: expected 'full', 'diag' or 'var'; got {out_layout!r}")
    infos = {}
    for n, x in (("mu", mu), ("gamma", gamma), ("weight", weight), ("bias", bias), ("c", c),
                 ("c_bias", c_bias), ("out", out)):
        if x is None or (n in ("c", "c_bias") and _is_number(x)):
            continue
        if isinstance(x, (bool, np.bool_, complex)):
            raise TypeError(f"{n}: expected a real number or a float array; got {x!r}")
        infos[n] = _arrays.info(x, n)
    _frontend._check_kinds(list(infos.items()))
    for n, a in infos.items():
        _frontend._check_dtype(n, a)
    kind = infos["mu"].kind
    device = _frontend._device_of(infos["mu"], [a for n, a in infos.items() if n != "mu"])
    if kind not in ("numpy", "torch", "cupy", "cai") or device[0] not in ("cpu", "cuda"):
        raise TypeError(f"conv2d_moments computes on numpy arrays, torch tensors (CPU or "
                        f"CUDA), CuPy arrays and numba device arrays; got {kind} arrays on "
                        f"{device[0]}")
    if kind in ("cupy", "cai") and importlib.util.find_spec("torch") is None:
        raise BackendError(f"conv2d_moments computes {'CuPy' if kind == 'cupy' else 'CUDA'} "
                           f"arrays with torch's convolutions (sharing their memory); torch "
                           f"is not installed")
    if kind == "cai":
        _frontend._check_streams(list(infos.items()))
    m, w = infos["mu"].shape, infos["weight"].shape
    if len(m) != 4:
        raise ShapeError(f"mu: expected 4 dims (B, Ci, H, W); got shape {m}")
    if len(w) != 4 or min(w[2:]) < 1:
        raise ShapeError(f"weight: expected 4 dims (Co, Ci // groups, kh, kw), kh, kw >= 1; "
                         f"got shape {w}")
    G, (kh, kw), _, s, p, d = _frontend.conv_params(tuple(w[2:]), stride, padding, dilation,
                                                    groups)
    (B, Ci, H, W), Co = m, w[0]
    for n, C in (("Ci", Ci), ("Co", Co)):
        if C % G:
            raise ShapeError(f"groups: {n} = {C} is not divisible by groups = {G}")
    _frontend._expect("weight", w, (Co, Ci // G, kh, kw), "(Co, Ci // groups, kh, kw)")
    Ho, Wo, sh, sw, dh, dw = _frontend._grid(H, W, kh, kw, *s, *p, *d)
    if "bias" in infos:
        _frontend._expect("bias", infos["bias"].shape, (Co,), "(Co,)")
    forms = {7: ("full", (B, Ci, H, W, Ci, H, W), "(B, Ci, H, W, Ci, H, W)"),
             6: ("diag", (B, Ci, H, W, H, W), "(B, Ci, H, W, H, W)"),
             4: ("var", (B, Ci, H, W), "(B, Ci, H, W)")}
    gamma_form = "none"
    if "gamma" in infos:
        g = infos["gamma"].shape
        if len(g) not in forms:
            raise ShapeError(f"gamma: expected 7 dims (B, Ci, H, W, Ci, H, W), 6 dims "
                             f"(B, Ci, H, W, H, W), 4 dims (B, Ci, H, W) or None; got shape {g}")
        gamma_form, expected, what = forms[len(g)]
        _frontend._expect("gamma", g, expected, what)
    c_form = "none" if c is None else "channel"
    if "c" in infos:
        shape = infos["c"].shape
        if shape == (Co, Ci // G, kh, kw):
            c_form = "weight"
        elif shape not in ((), (Co,)):
            raise ShapeError(f"c: expected a number, a 0-d array, shape (Co,) = ({Co},) or "
                             f"(Co, Ci // groups, kh, kw) = {(Co, Ci // G, kh, kw)}; got shape "
                             f"{shape}")
    if "c_bias" in infos and infos["c_bias"].shape not in ((), (Co,)):
        raise ShapeError(f"c_bias: expected a number, a 0-d array or shape (Co,) = ({Co},); "
                         f"got shape {infos['c_bias'].shape}")
    acc = "float64" if any(a.dtype == "float64" for a in infos.values()) else "float32"
    call = _Call(B, Ci, H, W, Co, G, kh, kw, Ho, Wo, (sh, sw), p, (dh, dw), gamma_form, c_form,
                 out_layout, acc, kind)
    if kind == "cai":  # computed on the stream out names (or, without out, mu's)
        first = infos.get("out", infos["mu"])
        launch, waits, _ = _arrays.launch_streams(
            kind, device[1], [first] + [a for a in infos.values() if a is not first])
        call.ordinal, call.streams = device[1] or 0, (launch, waits)
    if out is not None:
        o = infos["out"]
        shape = call.out_shape(out_layout)
        _frontend._expect("out", o.shape, shape, {
            "full": "(B, Co, Ho, Wo, Co, Ho, Wo)", "diag": "(B, Co, Ho, Wo, Ho, Wo)",
            "var": "(B, Co, Ho, Wo)"}[out_layout])
        if o.readonly:
            raise ValueError("out: is read-only; conv2d_moments writes gamma_out into it")
        if _arrays.self_overlapping(o) is not False:
            raise ValueError("out: some of its elements may share memory (a zero or "
                             "overlapping stride); pass an array whose elements are distinct")
        span = _arrays.span(o)
        for n, a in infos.items():
            if n != "out" and _arrays.overlaps(o, span, a, _arrays.span(a)) and \
                    _arrays.shares_memory(o, a):
                raise ValueError(f"out: shares memory with {n}; pass separate arrays")
    # The backend computes accumulate's calls, whose arrays are all in the dtype computed in.
    _registry.select(backend, device[0], frozenset({acc}))
    return call


class _NumpyOps:
    """Array operations on NumPy arrays, computing in ``dtype``."""

    device_type = "cpu"

    def __init__(self, dtype):
        self.dtype = np.dtype(dtype)

    def cast(self, x):
        return None if x is None else np.asarray(x, dtype=self.dtype)

    def zeros(self, shape):
        return np.zeros(shape, self.dtype)

    def empty(self, shape):
        return np.empty(shape, self.dtype)

    def arange(self, n):
        return np.arange(n)

    def perm(self, x, axes):
        return x.transpose(axes)

    def contiguous(self, x):
        return np.ascontiguousarray(x)

    def einsum(self, spec, *xs):
        return np.einsum(spec, *xs, optimize=True)

    def matmul(self, a, b, out=None):
        return np.matmul(a, b, out=out)

    def cat(self, xs, axis):
        return np.concatenate(xs, axis)

    def strides(self, x):
        """``x``'s strides in elements."""
        return tuple(s // x.itemsize for s in x.strides)

    def strided(self, x, start, shape, strides):
        """A read-only view of ``x``'s memory from its element at index ``start`` (strides
        in elements)."""
        x = x[tuple(slice(i, None) for i in start)]
        return np.lib.stride_tricks.as_strided(x, shape, [s * x.itemsize for s in strides],
                                               writeable=False)

    def sub(self, x, start, shape):
        """``x[start : start + shape]``, a writable view."""
        return x[tuple(slice(i, i + n) for i, n in zip(start, shape))]

    def grad(self, *xs) -> bool:
        return False

    def channels_last(self, *xs) -> bool:
        """Whether the full layout runs in channels-last order (:func:`_channels_last`)."""
        return False

    def kernels(self, *xs) -> bool:
        """Whether convcov's own CUDA kernels take these operands."""
        return False

    def rows(self, *xs) -> bool:
        """Whether full gamma's convolutions run as the CUDA rows kernel (:func:`_rows`)."""
        return False

    def conv(self, x, w, G, geo):
        """3-D convolution of ``x`` ``(N, C, D1, D2, D3)`` with ``w`` ``(Co, C // G, k1, k2,
        k3)``, geometry ``geo`` (:attr:`_Call.last` or :attr:`_Call.first`):
        ``(N, Co, O1, O2, O3)``. In chunks of images and of the axis the kernel does not
        touch (so memory stays bounded however long that axis is): im2col, then one matmul
        per group with the chunk's columns side by side."""
        s, p, d, place = geo
        free = 4 if place == "last" else 2  # the axis with kernel 1, stride 1, no padding
        N, C, D = x.shape[0], x.shape[1], x.shape[2:]
        k, (Co, Cg) = w.shape[2:], w.shape[:2]
        out = [(D[a] + 2 * p[a] - d[a] * (k[a] - 1) - 1) // s[a] + 1 for a in range(3)]
        Cpg, K = Co // G, math.prod(k)
        wm = w.reshape(G, Cpg, Cg * K)
        y = np.empty((N, G, Cpg, *out), self.dtype)
        per_image = K * C * math.prod(out) * self.dtype.itemsize
        E = x.shape[free]
        e_step = max(1, E * _CHUNK // per_image) if per_image > _CHUNK else E
        n_step = max(1, _CHUNK // per_image)
        for n0, e0 in itertools.product(range(0, N, n_step), range(0, E, e_step)):
            cut = [slice(n0, n0 + n_step), slice(None), slice(None), slice(None), slice(None)]
            cut[free] = slice(e0, e0 + e_step)
            xs = x[tuple(cut)]
            n, Dc = xs.shape[0], xs.shape[2:]
            Oc = [Dc[a] if a == free - 2 else out[a] for a in range(3)]
            xp = np.zeros((n, C) + tuple(Dc[a] + 2 * p[a] for a in range(3)), self.dtype)
            xp[(slice(None), slice(None)) + tuple(slice(p[a], p[a] + Dc[a]) for a in range(3))] = xs
            xp = xp.reshape(n, G, Cg, *xp.shape[2:])
            cols = np.empty((G, Cg, *k, n, *Oc), self.dtype)
            for off in itertools.product(*map(range, k)):
                window = tuple(slice(off[a] * d[a], off[a] * d[a] + s[a] * (Oc[a] - 1) + 1, s[a])
                               for a in range(3))
                cols[(slice(None), slice(None)) + off] = xp[(slice(None),) * 3 + window].transpose(
                    1, 2, 0, 3, 4, 5)
            r = np.matmul(wm, cols.reshape(G, Cg * K, -1)).reshape(G, Cpg, n, *Oc)
            cut[1] = slice(None)
            y[tuple(cut[:1] + [slice(None)] + cut[1:])] = r.transpose(2, 0, 1, 3, 4, 5)
        return y.reshape(N, Co, *out)

    def symmetric(self, A, out):
        """``(A + A^T) / 2`` of a stack of square matrices ``(N, r, r)`` (``A`` the caller's
        own: it may be overwritten), rounded once into ``out`` (a new array when None):
        bitwise symmetric, as addition commutes. On the host by the numba backend's tiles
        (:func:`convcov._host_kernels.symmetrize`: in place, or in out after a copy), 3-5x
        faster than strided copies; elsewhere the transposed copy goes in column strips
        (each read is contiguous) and the add is then contiguous."""
        direct = out is not None and out.dtype == self.dtype and self._c_contiguous(out)
        if self.device_type == "cpu" and not self.grad(A, out) and self._c_contiguous(A):
            from . import _host_kernels

            dst = out.reshape(A.shape) if direct else A
            _host_kernels.symmetrize(self.host(A), self.host(dst))
            return self.result(dst, out) if out is not None and not direct else dst
        dst = out.reshape(A.shape) if direct else self.empty(A.shape)
        for i in range(0, A.shape[1], 512):
            dst[:, :, i:i + 512] = self.perm(A[:, i:i + 512], (0, 2, 1))
        dst += A
        dst *= 0.5
        return self.result(dst, out) if out is not None and not direct else dst

    @staticmethod
    def _c_contiguous(x):
        return x.flags.c_contiguous

    @staticmethod
    def host(x):
        """``x`` as a NumPy array of its memory (the host's kernels take NumPy arrays)."""
        return x

    def result(self, x, out):
        if out is None:
            return np.ascontiguousarray(x)
        out[...] = x.reshape(out.shape)
        return out


class _TorchOps(_NumpyOps):
    """The same operations on torch tensors (any device), through differentiable torch ops."""

    def __init__(self, dtype, device):
        self.torch = sys.modules["torch"]
        self.dtype, self.device = getattr(self.torch, dtype), device
        self.device_type = device.type

    def cast(self, x):
        return None if x is None else x.to(self.dtype)

    def zeros(self, shape):
        return self.torch.zeros(shape, dtype=self.dtype, device=self.device)

    def empty(self, shape):
        return self.torch.empty(shape, dtype=self.dtype, device=self.device)

    def arange(self, n):
        return self.torch.arange(n, device=self.device)

    def perm(self, x, axes):
        return x.permute(axes)

    def contiguous(self, x):
        return x.contiguous()

    def einsum(self, spec, *xs):
        return self.torch.einsum(spec, *xs)

    def matmul(self, a, b, out=None):
        return self.torch.matmul(a, b, out=out)

    def cat(self, xs, axis):
        return self.torch.cat(xs, axis)

    def strides(self, x):
        return x.stride()

    def strided(self, x, start, shape, strides):  # one op, not a slice an axis
        return x.as_strided(shape, strides, x.storage_offset() + sum(
            i * s for i, s in zip(start, x.stride())))

    def sub(self, x, start, shape):
        return self.strided(x, start, shape, x.stride())

    def grad(self, *xs) -> bool:
        return self.torch.is_grad_enabled() and any(
            getattr(x, "requires_grad", False) for x in xs)

    def channels_last(self, *xs) -> bool:
        return self.device_type in CHANNELS_LAST_ON and not self.grad(*xs)

    def kernels(self, *xs) -> bool:
        """Whether convcov's own CUDA kernels (:mod:`convcov.backends._cupy_moments`) take
        these operands: CUDA, float32 or float64, no autograd, and CuPy to compile them
        (the cupy backend's probe says whether it can)."""
        return (self.device_type == "cuda" and self.dtype in (self.torch.float32,
                                                               self.torch.float64)
                and not self.grad(*xs) and _registry.get("cupy").unavailable_reason() is None)

    def rows(self, *xs) -> bool:
        # the rows kernel's TF32 mma.sync needs compute capability 8.0 (A100) or later
        return (self.dtype == self.torch.float32 and self.kernels(*xs)
                and self.torch.cuda.get_device_capability(self.device) >= (8, 0))

    def conv(self, x, w, G, geo):
        F = self.torch.nn.functional
        s, p, d, place = geo
        if place == "last" and x.shape[4] == 1:  # a plain 2-D convolution
            return F.conv2d(x[..., 0], w[..., 0], None, s[:2], p[:2], d[:2], G)[..., None]
        E = x.shape[2 if place == "first" else 4]
        if x.device.type == "cpu" and x.shape[0] == 1 and E % 2 == 0:
            # On the CPU torch takes its unblocked conv3d for one image of few planes, two
            # to three times slower than oneDNN's: two half images instead (the kernel
            # does not touch that axis, so its halves are independent).
            axis = 2 if place == "first" else 4
            y = F.conv3d(self.torch.cat(x.chunk(2, axis)), w, None, s, p, d, G)
            return self.torch.cat(y.chunk(2, 0), axis)
        return F.conv3d(x, w, None, s, p, d, G)

    def symmetric(self, A, out):
        if self.grad(A, out):
            S = ((A + A.transpose(1, 2)) * 0.5).contiguous()
            return S if out is None else out.copy_(S.reshape(out.shape))
        direct = out is not None and out.dtype == self.dtype and out.is_contiguous()
        if self.kernels() and A.is_contiguous():  # one read and one write (in place)
            from .backends._cupy_moments import symmetrize

            dst = symmetrize(A, out.view(A.shape) if direct else A)
        elif self.device_type == "cpu" and A.is_contiguous():
            return super().symmetric(A, out)
        else:
            # As NumPy's, with the halving fused into both passes: 0.5 a + 0.5 b is exactly
            # (a + b) / 2 rounded once (scaling by 0.5 is exact), and commutes.
            dst = out.view(A.shape) if direct else self.empty(A.shape)
            for i in range(0, A.shape[1], 512):
                self.torch.mul(A[:, i:i + 512].transpose(1, 2), 0.5, out=dst[:, :, i:i + 512])
            dst.add_(A, alpha=0.5)
        return self.result(dst, out) if out is not None and not direct else dst

    @staticmethod
    def _c_contiguous(x):
        return x.is_contiguous()

    @staticmethod
    def host(x):
        return x.numpy()

    def result(self, x, out):
        return x.contiguous() if out is None else out.copy_(x.reshape(out.shape))


def conv2d_moments(mu, gamma, weight, bias=None, c=None, *, c_bias=None, stride=1, padding=0,
                   dilation=1, groups=1, out_layout="full", out=None, backend=None):
    """Mean and covariance of ``y = conv2d(x, weight + dW) + bias`` (SPEC section 6).

    ``x`` has mean ``mu`` ``(B, Ci, H, W)`` and covariance ``gamma`` (None, full
    ``(B, Ci, H, W, Ci, H, W)``, channel-diagonal ``(B, Ci, H, W, H, W)`` or variances
    ``(B, Ci, H, W)``); ``dW`` is zero-mean independent noise of variance ``c`` (None, a
    number, ``(Co,)`` or per weight ``(Co, Ci // groups, kh, kw)``), the bias's noise has
    variance ``c_bias`` (None, a number or ``(Co,)``). Returns ``(mu_out, gamma_out)``:
    ``mu_out = conv2d(mu, weight, bias)`` ``(B, Co, Ho, Wo)`` and ``gamma_out`` in
    ``out_layout`` "full" ``(B, Co, Ho, Wo, Co, Ho, Wo)``, "diag" ``(B, Co, Ho, Wo, Ho, Wo)``
    (the channel-diagonal blocks) or "var" ``(B, Co, Ho, Wo)`` (the variances), exactly
    symmetric, written into ``out`` when given. ``backend`` chooses the backend of the
    ``accumulate`` calls (docs/moments.md). Differentiable on torch tensors.

    >>> import numpy as np, convcov
    >>> mu, w = np.ones((1, 1, 3, 3)), np.ones((1, 1, 2, 2))
    >>> m, v = convcov.conv2d_moments(mu, np.ones((1, 1, 3, 3)), w, c=0.5, out_layout="var")
    >>> float(m[0, 0, 0, 0]), float(v[0, 0, 0, 0])     # 4 * 1, 4 * 1 + 0.5 * 4 * (1 + 1)
    (4.0, 8.0)
    """
    if type(mu).__module__.startswith("dask."):
        from . import _dask  # imports dask: only for dask arrays (docs/dask.md)

        return _dask.conv2d_moments(mu, gamma, weight, bias, c, c_bias=c_bias, stride=stride,
                                    padding=padding, dilation=dilation, groups=groups,
                                    out_layout=out_layout, out=out, backend=backend)
    call = _check(mu, gamma, weight, bias, c, c_bias, stride, padding, dilation, groups,
                  out_layout, out, backend)
    if call.kind in ("cupy", "cai"):
        return _shared(call, (mu, gamma, weight, bias, c, c_bias), out, backend)
    return _moments(call, mu, gamma, weight, bias, c, c_bias, out, backend)


def _shared(call, inputs, out, backend):
    """:func:`_moments` of CuPy or generic CUDA arrays, on torch tensors that share their
    memory. CuPy arrays go through DLPack, which orders CuPy's current stream before
    torch's and back. Generic CUDA arrays (``torch.as_tensor`` of their
    ``__cuda_array_interface__``) are computed on the stream ``out`` names (``mu``'s without
    ``out``), after the other streams they name, as ``accumulate`` does
    (``_arrays.launch_streams``); the new arrays are numba device arrays that name it."""
    import torch

    if call.kind == "cupy":
        import cupy

        share, back, on = torch.from_dlpack, cupy.from_dlpack, contextlib.nullcontext()
    else:
        from numba import cuda

        dev = torch.device("cuda", call.ordinal)
        launch, waits = call.streams

        def stream(h):  # torch's object for a raw handle (0 and 1: the legacy default)
            return (torch.cuda.default_stream(dev) if h in (0, 1)
                    else torch.cuda.ExternalStream(h, device=dev))

        s = stream(launch)
        for h in waits:
            s.wait_stream(stream(h))
        on = torch.cuda.stream(s)

        def share(x):
            return torch.as_tensor(x, device=dev)

        def back(t):  # a numba device array on the tensor's memory, naming the launch stream
            desc = dict(t.__cuda_array_interface__, version=3,
                        stream=None if launch in (0, 1) else launch)
            with cuda.gpus[call.ordinal]:
                return cuda.from_cuda_array_interface(desc, owner=t, sync=False)

    def shared(x):  # a torch tensor on the array's memory
        return x if x is None or _is_number(x) else share(x)

    with on:
        mo, go = _moments(call, *map(shared, inputs), shared(out), backend)
        return back(mo), out if out is not None else back(go)


def _moments(call, mu, gamma, weight, bias, c, c_bias, out, backend):
    """:func:`conv2d_moments` of a validated call on NumPy arrays or torch tensors."""
    out_layout = call.layout
    o = _NumpyOps(call.acc) if call.kind == "numpy" else _TorchOps(call.acc, mu.device)
    mu_a, w_a, g_a = o.cast(mu), o.cast(weight), o.cast(gamma)
    B, Co, Ho, Wo = call.B, call.Co, call.Ho, call.Wo
    if 0 in (B, call.Ci, call.H, call.W, Co, Ho, Wo):  # sums over nothing
        mu_out, A, c = o.zeros((B, Co, Ho, Wo)), o.zeros(call.out_shape(out_layout)), None
    else:
        mu_out = o.conv(mu_a[..., None], w_a[..., None], call.G, call.last)[..., 0]
        A = _carried(o, call, g_a, w_a)
    if bias is not None:
        mu_out = mu_out + o.cast(bias).reshape(1, Co, 1, 1)
    if c is not None:
        _weight_noise(o, call, A, mu_a, g_a, c if _is_number(c) else o.cast(c), backend)
    if c_bias is not None:
        cb = _as_channels(o, c_bias, Co)
        _add_blocks(o, call, A, cb.reshape((1, Co) + (1,) * (2 if out_layout == "var" else 4)))
    mu_out = o.result(mu_out, None)
    if out_layout == "var":
        return mu_out, o.result(A, out)
    r = Co * Ho * Wo if out_layout == "full" else Ho * Wo
    S = o.symmetric(A.reshape(-1, r, r), out)
    return mu_out, S.reshape(call.out_shape(out_layout)) if out is None else out


def _as_channels(o, v, Co):
    """A number, 0-d or ``(Co,)`` array as a ``(Co,)`` array of the computing dtype."""
    return o.zeros(Co) + (v if _is_number(v) else o.cast(v))


def _embed(o, call, v):
    """Variances ``(B, Ci, H, W)`` as a channel-diagonal covariance ``(B, Ci, H, W, H, W)``."""
    B, Ci, P = call.B, call.Ci, call.H * call.W
    g = o.zeros((B, Ci, P * P))
    g[:, :, ::P + 1] = v.reshape(B, Ci, P)
    return g.reshape(B, Ci, call.H, call.W, call.H, call.W)


def _channel_diagonal(o, call, g):
    """gamma's channel-diagonal ``(B, Ci, H, W, H, W)`` (None without gamma)."""
    if call.gamma_form in ("none", "diag"):
        return g
    if call.gamma_form == "var":
        return _embed(o, call, g)
    B, Ci, H, W = call.B, call.Ci, call.H, call.W
    d = g.reshape(B, Ci, H * W, Ci, H * W).diagonal(0, 1, 3)  # (B, HW, HW, Ci)
    return o.contiguous(o.perm(d, (0, 3, 1, 2))).reshape(B, Ci, H, W, H, W)


def _carried(o, call, g, w):
    """``K gamma K^T`` in the call's layout, unsymmetrised (a fresh array).

    Every convolution runs on a 5-d array ``(N, C, H, W, E)`` whose trailing axis E (the
    other index set of the covariance) rides along untouched (kernel 1 on it): one index
    set is contracted at a time, each in the memory order the last step left, so no
    covariance-sized array is ever transposed. (The CUDA rows kernel convolves the outer
    index set only, and stores its first result transposed: :func:`_rows_full`.)"""
    B, Ci, H, W, Co, G, Ho, Wo = call.B, call.Ci, call.H, call.W, call.Co, call.G, call.Ho, call.Wo
    Cg, Cpg, kh, kw, P, Q = Ci // G, Co // G, call.kh, call.kw, call.H * call.W, Ho * Wo
    form, layout, w5 = call.gamma_form, call.layout, w[..., None]
    if form == "none":
        return o.zeros(call.out_shape(layout))
    if layout == "var":
        return _carried_variances(o, call, g, w)
    if form == "var":
        g, form = _embed(o, call, g), "diag"
    if form == "full" and layout == "full" and Cg == 1:
        if o.kernels(g, w):
            from .backends import _cupy_moments

            # one pass over gamma (H100, depthwise full 15.2 -> 6.9 ms, at 8x8 2.4 -> 0.69 ms)
            if _cupy_moments.depthwise_fits(W, kh, call.dilation[0], g.element_size()):
                return _cupy_moments.depthwise_full(g, w, call.stride, call.padding,
                                                    call.dilation, G)
        if o.device_type in DENSE_DEPTHWISE_ON:
            return _depthwise_dense(o, call, g, w)
    rows = form == "full" and Cpg <= ROWS_MAX_CPG and o.rows(g, w)
    if rows and layout == "full":
        return _rows_full(o, call, g, w)
    if rows and layout == "diag" and G == 1:
        # output channel c0's block from (K gamma)^T, gamma being symmetric
        T = _rows(o, call, g, w)  # (B, Co Q, Ci P): K gamma
        X2 = o.perm(T.reshape(B, Co, Q, Ci, H, W), (0, 1, 3, 4, 5, 2))  # (B, c0, cl, H, W, q)
        return _per_channel(o, call, X2, w5).reshape(call.out_shape("diag"))
    if form == "full":
        # The right index first, the left one as the batch: T[b, left, c1, q].
        if layout == "full" or G == 1:
            X1 = g.reshape(B * Ci * P, Ci, H, W, 1)
        else:  # only gamma's blocks within one group reach a channel's own block
            # gg: (B, Cg, H, W, Cg, H, W, G)
            gg = g.reshape(B, G, Cg, H, W, G, Cg, H, W).diagonal(0, 1, 5)
            X1 = o.perm(gg, (0, 1, 2, 3, 7, 4, 5, 6)).reshape(B * Cg * P, Ci, H, W, 1)
        if layout == "full" and o.channels_last(g, w):
            return _channels_last(o, call, g, w)
        if layout == "full":  # then the left index, the right one riding along
            T = o.conv(X1, w5, G, call.last).reshape(B, Ci, H, W, Co * Q)
            if G > 1 and o.device_type in UNGROUPED_ON:
                # the riding index as the batch: (K gamma K^T)^T, whose symmetric part
                # (all that is returned, after any term is added) is the same
                X2 = o.contiguous(o.perm(T, (0, 4, 1, 2, 3))).reshape(B * Co * Q, Ci, H, W, 1)
                return o.conv(X2, w5, G, call.last).reshape(call.out_shape("full"))
            return o.conv(T, w5, G, call.last).reshape(call.out_shape("full"))
        if G == 1 and o.channels_last(g, w):
            T = _right_channels_last(o, call, g, w, _into_nchw_order)
        else:
            T = o.conv(X1, w5, G, call.last)
        X2 = o.perm(T.reshape(B, Cg, H, W, Co, Q), (0, 4, 1, 2, 3, 5))  # (B, c0, cl, H, W, q)
    else:
        # Channel-diagonal gamma: no sum over input channels on the right (groups = Ci):
        # T[b, (g, cl, j), x, q] for output channel c1 = g * Cpg + j.
        w_ci = o.perm(w.reshape(G, Cpg, Cg, kh, kw), (0, 2, 1, 3, 4)).reshape(
            Ci * Cpg, 1, 1, kh, kw)
        T = o.conv(g.reshape(B, Ci, P, H, W), w_ci, Ci, call.first)
        T = T.reshape(B, G, Cg, Cpg, H, W, Q)
        if layout == "full":  # channels (g, cl) summed on the left, (j, q) riding along
            X2 = o.perm(T, (0, 1, 2, 4, 5, 3, 6)).reshape(B, Ci, H, W, Cpg * Q)
            R = o.conv(X2, w5, G, call.last)  # (B, (g, i), Ho, Wo, (j, q))
            if G == 1:
                return R.reshape(call.out_shape("full"))
            A = o.zeros(call.out_shape("full"))
            ar = o.arange(G)
            A.reshape(B, G, Cpg, Ho, Wo, G, Cpg, Ho, Wo)[:, ar, :, :, :, ar] = o.perm(
                R.reshape(B, G, Cpg, Ho, Wo, Cpg, Ho, Wo), (1, 0, 2, 3, 4, 5, 6, 7))
            return A
        X2 = o.perm(T, (0, 1, 3, 2, 4, 5, 6))  # (B, (g, j) = c0, cl, H, W, q)
    # The left index for output channel c0 alone: one group per output channel.
    return _per_channel(o, call, X2, w5).reshape(call.out_shape("diag"))


def _rows_full(o, call, g, w):
    """``K gamma K^T`` in the full layout by the CUDA rows kernel: ``Tt = (K gamma)^T`` (the
    kernel stores its result transposed), then ``K`` on ``Tt``'s rows: ``K gamma^T K^T``,
    whose symmetric part (all that is returned) is ``K gamma K^T``'s. Memory beyond gamma
    and the result: ``Tt``."""
    Tt = _rows(o, call, g, w, transposed=True)  # (B, n, m)
    return _rows(o, call, Tt, w).reshape(call.out_shape("full"))


def _rows(o, call, X, w, transposed=False):
    """``X`` ``(B, Ci H W, ...)``'s rows convolved on CUDA by
    :func:`convcov.backends._cupy_moments.rows_conv`: ``(B, Co Ho Wo, N)`` (``(B, N, Co Ho
    Wo)`` transposed). Against cuDNN's float32 convolutions: docs/moments.md, "On CUDA"."""
    from .backends._cupy_moments import rows_conv

    X5 = X.reshape(call.B, call.Ci, call.H, call.W, -1)
    Y = rows_conv(X5, w, call.stride, call.padding, call.dilation, call.G, transposed)
    m = call.Co * call.Ho * call.Wo
    return Y.reshape(call.B, -1, m) if transposed else Y.reshape(call.B, m, -1)


def _channels_last(o, call, g, w):
    """``K gamma K^T`` in the full layout, unsymmetrised, for torch tensors on the host: the
    two convolutions in channels-last order (oneDNN's fast one). The right index first
    (:func:`_right_channels_last`), its ``T`` moved into ``X2[b, co, q, p, c]`` (the rows
    in the result's order, each in ``(position, channel)`` order); then the left index,
    ``U = conv(X2)`` ``[b, co, q, q', co']``, each of whose rows is put in ``(co', q')``
    order in place. Memory beyond gamma: X2 (``B n m`` entries), the result (``B m^2``)
    and a chunk."""
    from . import _host_kernels as hk

    B, Ci, H, W, Co, Q = call.B, call.Ci, call.H, call.W, call.Co, call.Ho * call.Wo
    X2 = _right_channels_last(o, call, g, w, _into_rows_order)
    U = _conv_channels_last(o, call, X2.view(B * Co * Q, H, W, Ci), w)
    hk.transpose_rows(U.view(B * Co * Q, Q * Co).numpy(), Q, Co)
    return U.view(call.out_shape("full"))


def _right_channels_last(o, call, g, w, order):
    """The right index of gamma (``Cg = Ci``) convolved in channels-last order, in chunks of
    gamma's rows ``(b, p, all c)`` put in ``(p', c')`` order by the host's tiled
    transposes (:mod:`convcov._host_kernels`): each chunk's ``T[p, c, q, co]`` goes into
    the array ``order`` makes (``order(o, call)`` gives it and a function placing a chunk)."""
    from . import _host_kernels as hk

    B, Ci, H, W, P = call.B, call.Ci, call.H, call.W, call.H * call.W
    n = Ci * P
    out, place = order(o, call)
    g5 = g.detach().reshape(B, Ci, P, Ci, P).numpy()
    k = max(1, _CL_CHUNK // (Ci * n * g.element_size()))  # positions p a chunk
    X1 = o.empty(min(k, P) * Ci * n)
    for b, p0 in itertools.product(range(B), range(0, P, k)):
        p1 = min(P, p0 + k)
        X1c = X1[:(p1 - p0) * Ci * n].view(p1 - p0, Ci, P, Ci)
        hk.transpose(g5[b, :, p0:p1].transpose(1, 0, 2, 3)[None], X1c.numpy()[None])
        T = _conv_channels_last(o, call, X1c.view(-1, H, W, Ci), w).numpy()
        place(b, p0, p1, T.reshape(p1 - p0, Ci, call.Ho * call.Wo, call.Co))
    return out


def _into_rows_order(o, call):
    """``X2[b, co, q, p, c]`` and its placing of a chunk (a transpose batched over q)."""
    from . import _host_kernels as hk

    B, Ci, P, Co, Q = call.B, call.Ci, call.H * call.W, call.Co, call.Ho * call.Wo
    X2 = o.empty((B, Co, Q, P * Ci))
    X2n = X2.numpy()

    def place(b, p0, p1, T):  # T[p, c, q, co]
        hk.transpose(T.reshape(-1, Q, Co).transpose(1, 0, 2)[None, None],
                     X2n[b, :, :, p0 * Ci:p1 * Ci].transpose(1, 0, 2)[None, None])
    return X2, place


def _into_nchw_order(o, call):
    """``T[b, c, p, co, q]`` (the NCHW convolution's order) and its placing of a chunk."""
    from . import _host_kernels as hk

    B, Ci, P, Co, Q = call.B, call.Ci, call.H * call.W, call.Co, call.Ho * call.Wo
    T = o.empty((B, Ci, P, Co, Q))
    Tn = T.numpy()

    def place(b, p0, p1, t):  # t[p, c, q, co]
        hk.transpose(t[None], Tn[b, :, p0:p1].transpose(1, 0, 2, 3)[None])
    return T, place


def _conv_channels_last(o, call, X, w):
    """``(N, H, W, Ci) -> (N, Ho, Wo, Co)``, both channels-last in memory."""
    s, p, d = call.last[:3]
    return o.torch.nn.functional.conv2d(X.permute(0, 3, 1, 2), w, None, s[:2], p[:2], d[:2],
                                        call.G).permute(0, 2, 3, 1).contiguous()


def _depthwise_dense(o, call, g, w):
    """``K gamma K^T`` in the full layout for one input channel a group (``Cg = 1``), as
    two batched matrix products with each output channel's convolution matrix ``K_c``
    ``(Q, P)``: ``[b, c0, :, c1, :] = K_c0 gamma[b, c0 // Cpg, :, c1 // Cpg, :] K_c1^T``.
    ``K_c`` is the convolution of the unit images (every padding, stride and dilation
    is the convolution's own), so its entries are the weights themselves."""
    B, G, Co, H, W = call.B, call.G, call.Co, call.H, call.W
    P, CQ = H * W, Co // G * call.Ho * call.Wo
    units = o.zeros((P, G, P))
    ar = o.arange(P)
    units[ar, :, ar] = 1
    U = o.conv(units.reshape(P, G, H, W, 1), w[..., None], G, call.last)  # [p, (c, q)]
    K = o.perm(U.reshape(P, G, CQ), (1, 2, 0))  # [g, (j, q), p]: output channel g*Cpg + j
    # The right index first, T[(b, g0, p0), (g1, j1, q1)]: a product per column channel g1,
    # each into its own columns of T, so that the second needs no transposed copy.
    X, Kt = g.reshape(B * G * P, G, P), o.perm(K, (0, 2, 1))
    if o.grad(g, w):  # products into views are not differentiable: joined instead
        T = o.cat([o.matmul(X[:, g1], Kt[g1]) for g1 in range(G)], 1)
    else:
        T = o.empty((B * G * P, G * CQ))
        for g1 in range(G):
            o.matmul(X[:, g1], Kt[g1], out=T[:, g1 * CQ:(g1 + 1) * CQ])
    # then the left one, whose result is in the full layout's order [b, g0, (j0, q0), g1, ...]
    return o.matmul(K, T.reshape(B, G, P, G * CQ)).reshape(call.out_shape("full"))


def _per_channel(o, call, X2, w5):
    """The convolution of ``X2`` ``(B, *c0, Cg, H, W, Q)`` (any strides; the output channel
    c0 on one or two axes) with output channel c0's kernel on its own block: ``(B, Co,
    Ho, Wo, Q)``. For a chunk of output channels, their blocks side by side ``(c0, Cg, B H
    W Q)`` and each channel's kernel offsets applied as one matmul batched over c0,
    ``U[c0, o, b, x, y, q] = sum_cl w[c0, cl, o] X2[b, c0, cl, x, y, q]``; then the window
    sums ``D[b, c0, i, j, q] += U[c0, o, b, X_o(i), Y_o(j), q]``, one strided add per
    offset: against a convolution per output channel (cuDNN's, with one output channel),
    H100 diag 16ch 65.9 -> 38.3 ms, 64ch 32.1 -> 18.6 ms, strided 8.79 -> 7.59 ms. On the
    host (``WINDOW_SUMS_ON``) the window sums of :func:`convcov._host_kernels.window_sums`
    instead, without autograd."""
    B, (Cg, H, W, Q) = X2.shape[0], X2.shape[-4:]
    X7 = X2.reshape((B, 1) + X2.shape[1:]) if X2.ndim == 6 else X2  # (B, G', J, Cg, H, W, Q)
    if o.device_type in WINDOW_SUMS_ON and not o.grad(X2, w5):
        from . import _host_kernels

        D = o.empty((B, call.Co, call.Ho, call.Wo, Q))
        _host_kernels.window_sums(o.host(X7), o.host(o.contiguous(w5[..., 0])), o.host(D),
                                  call.stride, call.padding, call.dilation)
        return D
    if Cg == 1:  # a depthwise convolution, fast as it is (H100 depthwise 1.09 -> 0.65 ms)
        return o.conv(X2.reshape(B, call.Co, H, W, Q), w5, call.Co, call.last)
    (Gp, J), kh, kw, Ho, Wo = X7.shape[1:3], call.kh, call.kw, call.Ho, call.Wo
    wk = o.perm(w5.reshape(Gp, J, Cg, kh * kw), (0, 1, 3, 2))  # (G', J, K, Cg)
    D = o.zeros((B, Gp, J, Ho, Wo, Q))
    offsets = list(call.offsets())
    # a chunk's blocks and U together hold at most _BLOCK_ENTRIES entries (or one channel's)
    step = max(1, _BLOCK_ENTRIES[o.device_type] // (B * H * W * Q * (Cg + kh * kw)))
    for g, j0 in itertools.product(range(Gp), range(0, J, step)):
        j1 = min(J, j0 + step)
        Xc = o.contiguous(o.perm(X7[:, g, j0:j1], (1, 2, 0, 3, 4, 5)))  # (j, Cg, B, H, W, Q)
        U = (wk[g, j0:j1] @ Xc.reshape(j1 - j0, Cg, -1)).reshape(j1 - j0, kh, kw, B, H, W, Q)
        for u, v, oi, oj, x, y in offsets:
            part = D[:, g, j0:j1, oi, oj]  # added in place (a view, not setitem)
            part += o.perm(U[:, u, v, :, x, y], (1, 0, 2, 3, 4))
    return D.reshape(B, call.Co, Ho, Wo, Q)


def _carried_variances(o, call, g, w):
    """The diagonal of ``K gamma K^T``, ``(B, Co, Ho, Wo)``, without the rest: for a
    chunk of output positions (rows, or part of a row), the block of gamma that each
    position's windows read, ``(N, N)`` with ``N = Cg kh kw`` (``Cg`` blocks of ``(kh
    kw, kh kw)`` for a channel-diagonal gamma), and each output channel's quadratic form
    ``w^T block w`` as one matmul and a sum. The blocks are copied from strided views of
    gamma, one for each rectangle of positions whose windows have the same kernel
    offsets inside the image (:meth:`_Call.runs`: the inner rectangle, the edges, the
    corners), into one buffer whose terms in the padding are 0: all positions share one
    matmul. On CUDA the forms are read from gamma where it lies instead, by
    :func:`convcov.backends._cupy_moments.var_forms`."""
    B, Ci, G, Co, Ho, Wo = call.B, call.Ci, call.G, call.Co, call.Ho, call.Wo
    Cg, Cpg, kh, kw = Ci // G, Co // G, call.kh, call.kw
    if call.gamma_form == "var":  # independent entries: the squared weights
        return o.conv(g[..., None], (w * w)[..., None], G, call.last)[..., 0]
    full = call.gamma_form == "full"
    if o.kernels(g, w):
        # the forms read from gamma where it is, no copies of the blocks
        from .backends._cupy_moments import var_forms

        return var_forms(g, w, call.stride, call.padding, call.dilation, G,
                         call.gamma_form == "diag")
    (sh, sw), (ph, pw), (dh, dw) = call.stride, call.padding, call.dilation
    blk_shape = (Cg * kh * kw,) * 2 if full else (Cg, kh * kw, kh * kw)
    wr = o.perm(w.reshape(G, Cpg, Cg, kh, kw), (0, 2, 3, 4, 1))  # (G, Cg, kh, kw, Cpg)
    wr = wr.reshape((1, G, 1) + blk_shape[:-1] + (Cpg,))
    rh, rw = list(call.runs(0)), list(call.runs(1))
    # Where every position has a run, 0s only in the partial runs' blocks, not a memset of
    # all blocks (H100, CUDA graph replay: 16ch var 0.85 -> 0.77 ms, 64ch 1.82 -> 1.73 ms).
    covered = sum(r[1] - r[0] for r in rh) == Ho and sum(r[1] - r[0] for r in rw) == Wo
    # a chunk: rows of positions, or part of one row where a row's blocks are too many
    most, per_row = _BLOCK_ENTRIES[o.device_type], math.prod(blk_shape) * Wo
    rows, cols = (max(1, most // per_row), Wo) if per_row <= most else (
        1, max(1, most // math.prod(blk_shape)))
    A = o.empty((B, G, Cpg, Ho, Wo))
    sb, sc, sx, sy, *sc1, sx1, sy1 = o.strides(g)  # sc1: the second channel axis (full)
    for a, c in itertools.product(range(0, Ho, rows), range(0, Wo, cols)):
        b, e = min(Ho, a + rows), min(Wo, c + cols)
        blk = (o.empty if covered else o.zeros)((B, G, b - a, e - c, Cg, kh, kw) + (Cg,) * full
                                                + (kh, kw))
        for (i0, i1, hl, hh), (j0, j1, wl, wh) in itertools.product(rh, rw):
            i0, i1, j0, j1 = max(i0, a), min(i1, b), max(j0, c), min(j1, e)
            if i0 >= i1 or j0 >= j1:
                continue
            at, ker = (0, 0, i0 - a, j0 - c), (hh - hl, wh - wl)
            if covered and ker[0] * ker[1] < kh * kw:
                o.sub(blk, at + (0,) * (blk.ndim - 4), (B, G, i1 - i0, j1 - j0)
                      + blk.shape[4:])[...] = 0
            x0, y0 = i0 * sh + hl * dh - ph, j0 * sw + wl * dw - pw
            shape = (B, G, i1 - i0, j1 - j0, Cg, *ker) + (Cg,) * full + ker
            o.sub(blk, at + (0, hl, wl) + (0,) * full + (hl, wl), shape)[...] = o.strided(
                g, (0, 0, x0, y0) + (0,) * full + (x0, y0), shape,
                (sb, Cg * (sc + sum(sc1)), sh * (sx + sx1), sw * (sy + sy1), sc, dh * sx,
                 dw * sy, *sc1, dh * sx1, dw * sy1))
        q = ((blk.reshape((B, G, -1) + blk_shape) @ wr) * wr).sum(-2 if full else (-3, -2))
        A[:, :, :, a:b, c:e] = o.perm(q, (0, 1, 3, 2)).reshape(B, G, Cpg, b - a, e - c)
    return A.reshape(B, Co, Ho, Wo)


def _weight_noise(o, call, A, mu_a, g_a, c, backend):
    """Add the weight-noise term N into A (unsymmetrised, in the call's layout)."""
    B, Ci, H, W, G, Co, Ho, Wo = call.B, call.Ci, call.H, call.W, call.G, call.Co, call.Ho, call.Wo
    Cg, kh, kw = Ci // G, call.kh, call.kw
    if call.layout == "var":
        # N's diagonal: c-weighted window sums of mu**2 + gamma's diagonal: one conv.
        M = mu_a * mu_a
        if call.gamma_form == "var":
            M = M + g_a
        elif call.gamma_form != "none":
            n = Ci * H * W if call.gamma_form == "full" else H * W
            M = M + g_a.reshape(-1, n, n).diagonal(0, 1, 2).reshape(B, Ci, H, W)
        cw = c if call.c_form == "weight" else (
            o.zeros((Co, Cg, kh, kw)) + _as_channels(o, c, Co).reshape(Co, 1, 1, 1))
        A += o.conv(M[..., None], cw[..., None], G, call.last)[..., 0]
        return
    if call.c_form == "channel":
        g = _embed(o, call, g_a) if call.gamma_form == "var" else g_a
        _frontend.accumulate(A, g, mu_a, c, (kh, kw), stride=call.stride, padding=call.padding,
                             dilation=call.dilation, groups=G, backend=backend)
        return
    # Per-weight c: for each kernel offset, the window of M = mu mu^T + gamma's channel
    # diagonal that offset reads at both positions, mixed over each group's channels.
    gd = _channel_diagonal(o, call, g_a)
    M = mu_a.reshape(B, Ci, H, W, 1, 1) * mu_a.reshape(B, Ci, 1, 1, H, W)
    if gd is not None:
        M = M + gd
    N = o.zeros((B, G, Co // G, Ho, Wo, Ho, Wo))
    cg = c.reshape(G, Co // G, Cg, kh, kw)
    for u, v, oi, oj, x, y in call.offsets():
        ni, nj = oi.stop - oi.start, oj.stop - oj.start
        sub = M[:, :, x, y, x, y].reshape(B, G, Cg, ni, nj, ni, nj)
        N[:, :, :, oi, oj, oi, oj] += o.einsum("gjc,bgcpqrs->bgjpqrs", cg[..., u, v], sub)
    _add_blocks(o, call, A, N.reshape(B, Co, Ho, Wo, Ho, Wo))


def _add_blocks(o, call, A, D):
    """Add D (broadcastable to the diagonal layout) to each output channel's own block."""
    if call.layout != "full":
        A += D
        return
    ar = o.arange(call.Co)
    D = D + o.zeros((call.B, call.Co, call.Ho, call.Wo, call.Ho, call.Wo))
    A[:, ar, :, :, ar] += o.perm(D, (1, 0, 2, 3, 4, 5))
