"""Dask arrays: ``accumulate``, ``patch_moment`` and ``conv2d_moments`` as lazy dask graphs
(SPEC section 7; docs/dask.md).

Owns what a call on dask arrays becomes. Validation happens while the graph is built, from
shapes and dtypes only, through the front end's own checks (``_frontend._check`` on
ArrayInfos that describe each dask array as one array of its chunks' kind;
``check_patch_moment`` and ``moments._check`` on zero-stride stand-ins), so a bad call
raises exactly what the direct call raises and nothing is computed. The graph maps
convcov's direct call over batch chunks and, for ``accumulate``, over ``out``'s
output-channel chunks, their edges moved to group boundaries (a chunk then needs only its
groups' input channels and its slice of ``c``); every other axis is merged into whole
chunks, with a ``ChunkWarning`` when that moves more bytes than the call's largest chunk.
Each task calls the backend its chunk type selects (NumPy chunks: host backends; CuPy
chunks: CUDA backends).

Rules of the call: when ``mu`` is a dask array, ``out`` and ``gamma`` must be dask arrays
too; ``c`` (and ``conv2d_moments``' ``weight``, ``bias``, ``c_bias``) may be a number, a
small array of the chunks' kind (embedded in the graph) or a dask array. Dask arrays are
immutable, so ``accumulate`` returns a new dask array ``out + term``, and
``conv2d_moments`` takes no ``out``.

Imported by the front end (and ``moments``) only for dask arrays: ``import convcov``
imports no dask.
"""

from __future__ import annotations

import math
import numbers
import os
import sys
import threading
import warnings

import dask
import dask.array as da
import numpy as np
from dask.array.utils import meta_from_array
from dask.utils import format_bytes

from . import _arrays, _frontend, _registry
from ._errors import ChunkWarning, ShapeError


def _info(x, name: str) -> _arrays.ArrayInfo:
    """Dask array ``x`` described as one array of its chunks' kind: the ArrayInfo of its
    meta (kind, device, dtype) with ``x``'s shape and C-contiguous strides."""
    if not isinstance(x, da.Array):
        raise TypeError(f"{name}: mu is a dask array, so {name} must be one too; got "
                        f"{type(x).__module__}.{type(x).__qualname__}")
    if any(math.isnan(n) for n in x.shape):
        raise ShapeError(f"{name}: unknown chunk sizes, shape {x.shape}; call "
                         f"{name}.compute_chunk_sizes() first")
    i = _arrays.info(meta_from_array(x), name)
    if i.kind not in ("numpy", "cupy"):
        raise TypeError(f"{name}: dask arrays of {i.kind} chunks are not supported; "
                        "use NumPy or CuPy chunks")
    return i._replace(shape=tuple(x.shape), ptr=0, readonly=False, stream=None,
                      strides=None if i.strides is None else _contiguous(x.shape))


def _contiguous(shape) -> tuple:
    strides, n = [], 1
    for d in reversed(shape):
        strides.append(n)
        n *= max(d, 1)
    return tuple(reversed(strides))


def _c_info(c):
    """c's ArrayInfo (None for a number), with the direct call's refusals (normalise)."""
    if type(c) is float or type(c) is int:
        return None
    if isinstance(c, (bool, np.bool_)):
        raise TypeError(f"c: expected a float, a 0-d or a 1-d float array; got {c!r}")
    if isinstance(c, da.Array):
        return _info(c, "c")
    if not isinstance(c, numbers.Number):
        return _arrays.info(c, "c")
    if isinstance(c, numbers.Complex) and not isinstance(c, numbers.Real):
        raise TypeError(f"c: expected a real number; got {c!r}")
    return None


def _standin(x, name: str):
    """A zero-stride array of ``x``'s chunk kind, dtype and whole shape: what the front
    end's checks read (shape, strides, dtype, device), with one element of memory."""
    i = _info(x, name)
    dtype = meta_from_array(x).dtype
    if i.kind == "numpy":
        return np.broadcast_to(np.empty((), dtype), x.shape)
    cupy = sys.modules["cupy"]
    with cupy.cuda.Device(i.device[1]):
        return cupy.broadcast_to(cupy.empty((), dtype), x.shape)


def _largest_chunk(x) -> int:
    return math.prod(max(c, default=0) for c in x.chunks) * x.dtype.itemsize


def _moved(src: tuple, dst: tuple, itemsize: int) -> int:
    """Bytes that a rechunk from chunks ``src`` to ``dst`` moves: those of every block
    that is not already one of the new blocks."""
    kept, total = 1.0, itemsize
    for s, d in zip(src, dst):
        n = sum(s)
        total *= n
        if n:
            starts = set(zip(np.cumsum((0,) + d[:-1]).tolist(), d))
            same = sum(c for c, o in zip(s, np.cumsum((0,) + s[:-1]).tolist())
                       if (o, c) in starts)
            kept *= same / n
    return round(total * (1 - kept))


class _Merge:
    """Rechunks the call's arrays, counting the bytes moved; warns once at the end."""

    def __init__(self, call: str, arrays):
        self.call, self.moved, self.what = call, 0, []
        self.split = " (and out's channels, at group boundaries)" if call == "accumulate" else ""
        self.limit = max(_largest_chunk(a) for a in arrays if isinstance(a, da.Array))

    def __call__(self, x, chunks, name: str, axes: str):
        y = x.rechunk(chunks)
        moved = _moved(x.chunks, y.chunks, x.dtype.itemsize)
        if moved:
            self.moved += moved
            changed = [a for a, s, d in zip(axes, x.chunks, y.chunks) if s != d]
            self.what.append(f"{name} along {', '.join(changed)}")
        return y

    def warn(self):
        if self.moved > self.limit:
            what = "; ".join(dict.fromkeys(self.what))
            warnings.warn(ChunkWarning(
                f"convcov.{self.call}: merging chunks moves {format_bytes(self.moved)}, more "
                f"than the largest chunk ({format_bytes(self.limit)}): {what}. The work is "
                f"split along the batch{self.split}; give the other axes one chunk each to "
                "avoid the merge"), stacklevel=4)


def _settle(x):
    """A CuPy result, when CuPy's current stream is not the legacy default one, is waited
    for: dask may hand it to a task of another thread, on another stream."""
    cupy = sys.modules.get("cupy")
    if cupy is not None and isinstance(x, cupy.ndarray):
        stream = cupy.cuda.get_current_stream()
        if stream.ptr != 0:
            stream.synchronize()
    return x


def _block(x):
    """The one block of a blockwise argument whose other axes are one chunk each (given
    as nested lists: concatenating them would copy even a single block)."""
    while isinstance(x, list):
        (x,) = x
    return x


class _Lease:
    """The array interface of one buffer of a :class:`_Pool`: a NumPy array made from it
    (and every view of that array) holds the lease as its base, so the lease dies, and
    gives the buffer back, only once no array uses the memory."""

    __slots__ = ("__array_interface__", "_pool", "_buf")

    def __init__(self, pool, buf, shape, dtype):
        self._pool, self._buf = pool, buf
        self.__array_interface__ = {"shape": shape, "typestr": dtype.str, "version": 3,
                                    "data": (buf.__array_interface__["data"][0], False)}

    def __del__(self):
        self._pool.give_back(self._buf)


class _Pool:
    """Host memory for the results of the tasks (accumulate's new arrays, patch_moment's
    S, conv2d_moments' gamma_out), reused once dask drops them.

    A task's result is new memory (a chunk is never written). A new array of hundreds of
    megabytes costs the operating system a page fault and the zeroing of every page, more
    than the call itself on the host; a result that dask has dropped gives its buffer back
    here and the next task of that size reuses it. Buffers of at least ``smallest`` bytes;
    at most ``limit`` bytes are kept idle (the rest go back to the system)."""

    def __init__(self, limit: int, smallest: int = 1 << 20):
        self.limit, self.smallest, self.idle_bytes = limit, smallest, 0
        self._idle: dict[int, list] = {}
        self._lock = threading.RLock()  # re-entrant: a lease may die inside the lock (GC)

    def empty(self, shape, dtype):
        dtype = np.dtype(dtype)
        nbytes = math.prod(shape) * dtype.itemsize
        if nbytes < self.smallest:
            return np.empty(shape, dtype)
        with self._lock:
            bufs = self._idle.get(nbytes)
            buf = bufs.pop() if bufs else None
            if buf is not None:
                self.idle_bytes -= nbytes
        if buf is None:
            buf = np.empty(nbytes, np.uint8)
        return np.asarray(_Lease(self, buf, tuple(shape), dtype))

    def give_back(self, buf):
        with self._lock:
            if self.idle_bytes + buf.nbytes <= self.limit:
                self._idle.setdefault(buf.nbytes, []).append(buf)
                self.idle_bytes += buf.nbytes


def _physical_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):  # no sysconf (Windows): assume 8 GiB
        return 8 << 30


#: Idle result memory at most an eighth of the machine's.
_pool = _Pool(_physical_bytes() // 8)


def _accumulate_task(out, gamma, mu, c, kernel_size, stride, padding, dilation, groups,
                     backend):
    # A chunk is never written (other tasks may hold it): the result is new memory (the
    # host's from the result pool, CuPy's from CuPy's own), written straight from out
    # (accumulate_apart) where the backend can.
    gamma, mu, c = _block(gamma), _block(mu), _block(c)
    conv = (kernel_size, stride, padding, dilation, groups, backend)
    if type(out) is np.ndarray:
        return _frontend.accumulate_apart(_pool.empty(out.shape, out.dtype), out, gamma, mu,
                                          c, *conv)
    cupy = sys.modules.get("cupy")
    if cupy is not None and isinstance(out, cupy.ndarray):
        new = cupy.empty_like(out)
        return _settle(_frontend.accumulate_apart(new, out, gamma, mu, c, *conv))
    new = out.copy()
    _frontend.accumulate(new, gamma, mu, c, kernel_size, stride=stride, padding=padding,
                         dilation=dilation, groups=groups, backend=backend)
    return _settle(new)


def _patch_moment_task(gamma, mu, kernel_size, stride, padding, dilation, groups, backend):
    gamma, mu = _block(gamma), _block(mu)
    conv = (kernel_size, stride, padding, dilation, groups, backend)
    if type(mu) is np.ndarray:  # S into pooled host memory, zeroed (the direct call's S)
        shape, dtype, (k, s, p, d, G) = _frontend.check_patch_moment(gamma, mu, *conv)
        S = _pool.empty(shape, dtype)
        S.fill(0)
        return _frontend.accumulate_unrouted(S, gamma, mu, 1.0, k, s, p, d, G, backend)
    return _settle(_frontend.patch_moment_unrouted(gamma, mu, *conv))


def _batch_chunks(*arrays) -> tuple:
    """The batch chunks of the largest array: the one that a batch rechunk would cost most."""
    return max((a for a in arrays if a is not None), key=lambda a: a.nbytes).chunks[0]


def accumulate(out, gamma, mu, c, kernel_size, *, stride=1, padding=0, dilation=1,
               groups=1, backend=None):
    """``convcov.accumulate`` on dask arrays: a new dask array ``out + term``."""
    mu_i, out_i = _info(mu, "mu"), _info(out, "out")
    gamma_i = None if gamma is None else _info(gamma, "gamma")
    c_i = _c_info(c)
    (G, kh, kw, sh, sw, ph, pw, dh, dw, B, Ci, Co, H, W, Ho, Wo, _, _) = _frontend._check(
        out_i, gamma_i, mu_i, c_i, kernel_size, stride, padding, dilation, groups)
    if c_i is None:
        _frontend.c_float(c)
    _registry.select(backend, mu_i.device[0], frozenset(
        (out_i.dtype, mu_i.dtype, (gamma_i or mu_i).dtype, (c_i or mu_i).dtype)))
    if 0 in (B, Co, Ho, Wo, Ci, H, W):
        return out  # nothing to add (the direct call leaves out bit-identical)

    full, full_gamma = out.ndim == 7, gamma is not None and gamma.ndim == 7
    params = dict(kernel_size=(kh, kw), stride=(sh, sw), padding=(ph, pw),
                  dilation=(dh, dw), backend=backend)
    merge = _Merge("accumulate", (out, gamma, mu, c))
    batch = _batch_chunks(out, gamma, mu)
    # out's channel chunks, their edges moved down to group boundaries: a chunk then
    # holds whole groups, and no group's S is computed twice (groups=1: one chunk)
    per_o, per_i = Co // G, Ci // G
    edges = np.cumsum((0,) + out.chunks[1]).tolist()
    bounds = sorted({e // per_o * per_o for e in edges} | {Co})
    spans = list(zip(bounds[:-1], bounds[1:]))
    chans = tuple(b - a for a, b in spans)
    if full:
        out_t = merge(out, (batch, chans, -1, -1, chans, -1, -1), "out", "BCHWCHW")
    else:
        out_t = merge(out, (batch, chans, -1, -1, -1, -1), "out", "BCHWHW")
    o_ind = tuple("bcijCkl") if full else tuple("bcijkl")
    g_ind = tuple("bxhwXuv") if full_gamma else tuple("bxhwuv")
    results = []
    for a, b in spans:
        lo, hi = a // per_o * per_i, b // per_o * per_i
        mu_k = merge(mu[:, lo:hi], (batch, -1, -1, -1), "mu", "BCHW")
        gamma_k = None
        if gamma is not None:
            gamma_k = gamma[:, lo:hi, :, :, lo:hi] if full_gamma else gamma[:, lo:hi]
            gamma_k = merge(gamma_k, (batch,) + (-1,) * (gamma.ndim - 1), "gamma",
                            "BCHWCHW" if full_gamma else "BCHWHW")
        c_k, c_ind = c, None
        if c_i is not None and len(c_i.shape) == 1:
            c_k = c[a:b]
        if isinstance(c, da.Array):
            c_ind = ("c",) if c.ndim == 1 else ()
            c_k = merge(c_k, (-1,) * c.ndim, "c", "C")
        out_k = out_t[:, a:b, :, :, a:b] if full else out_t[:, a:b]
        results.append(da.blockwise(
            _accumulate_task, o_ind, out_k, o_ind, gamma_k, None if gamma is None else g_ind,
            mu_k, tuple("bxhw"), c_k, c_ind, dtype=out.dtype, meta=meta_from_array(out),
            concatenate=False, groups=(b - a) // per_o, **params))
    merge.warn()
    if full:  # the blocks off the channel diagonal are out's own, untouched
        results = [da.concatenate([r if m == k else out_t[:, a:b, :, :, a2:b2]
                                   for m, (a2, b2) in enumerate(spans)], axis=4)
                   for k, ((a, b), r) in enumerate(zip(spans, results))]
    return results[0] if len(results) == 1 else da.concatenate(results, axis=1)


def patch_moment(gamma, mu, kernel_size, *, stride=1, padding=0, dilation=1, groups=1,
                 backend=None):
    """``convcov.patch_moment`` on dask arrays: S as a dask array, chunked like the batch."""
    mu_s = _standin(mu, "mu")
    gamma_s = None if gamma is None else _standin(gamma, "gamma")
    shape, dtype, (k, s, p, d, G) = _frontend.check_patch_moment(
        gamma_s, mu_s, kernel_size, stride, padding, dilation, groups, backend)
    Ho, Wo = shape[2:4]
    # the direct call then accumulates into a zero S: the checks of that call (gamma's shape)
    mu_i = _info(mu, "mu")
    S_i = mu_i._replace(shape=shape, dtype=dtype, strides=_contiguous(shape))
    _frontend._check(S_i, None if gamma is None else _info(gamma, "gamma"), mu_i, None, k,
                     s, p, d, G)
    merge = _Merge("patch_moment", (gamma, mu))
    batch = _batch_chunks(gamma, mu)
    mu_t = merge(mu, (batch, -1, -1, -1), "mu", "BCHW")
    gamma_t = g_ind = None
    if gamma is not None:
        gamma_t = merge(gamma, (batch,) + (-1,) * (gamma.ndim - 1), "gamma",
                        "BCHWCHW" if gamma.ndim == 7 else "BCHWHW")
        g_ind = tuple("bxhwXuv") if gamma.ndim == 7 else tuple("bxhwuv")
    merge.warn()
    return da.blockwise(
        _patch_moment_task, tuple("bgijkl"), gamma_t, g_ind, mu_t, tuple("bxhw"),
        new_axes=dict(g=G, i=Ho, j=Wo, k=Ho, l=Wo), dtype=np.dtype(dtype),
        meta=meta_from_array(mu, ndim=6, dtype=dtype), concatenate=False,
        kernel_size=k, stride=s, padding=p, dilation=d, groups=G, backend=backend)


def _moments_task(mu, gamma, weight, bias, c, c_bias, out_tail, dtype, **params):
    from .moments import conv2d_moments

    # gamma_out into pooled host memory (the direct call writes it there, rounded once)
    out = _pool.empty((mu.shape[0],) + out_tail, dtype) if type(mu) is np.ndarray else None
    mu_out, gamma_out = conv2d_moments(mu, gamma, weight, bias, c, c_bias=c_bias, out=out,
                                       **params)
    return _settle(mu_out), _settle(gamma_out)


def conv2d_moments(mu, gamma, weight, bias=None, c=None, *, c_bias=None, stride=1, padding=0,
                   dilation=1, groups=1, out_layout="full", out=None, backend=None):
    """``convcov.conv2d_moments`` on dask arrays: ``(mu_out, gamma_out)``, dask arrays
    chunked like the batch. ``weight``, ``bias``, ``c``, ``c_bias`` may be dask arrays
    (merged into one chunk) or small arrays of the chunks' kind (embedded in the graph)."""
    from . import moments

    if out is not None:
        raise ValueError("out: dask arrays are never written; leave out=None and use the "
                         "returned gamma_out")
    small = {"weight": weight, "bias": bias, "c": c, "c_bias": c_bias}
    stand = {n: _standin(x, n) if isinstance(x, da.Array) else x for n, x in small.items()}
    call = moments._check(_standin(mu, "mu"), None if gamma is None else _standin(gamma, "gamma"),
                          stand["weight"], stand["bias"], stand["c"], stand["c_bias"], stride,
                          padding, dilation, groups, out_layout, None, backend)
    merge = _Merge("conv2d_moments", (mu, gamma, *small.values()))
    batch = _batch_chunks(gamma, mu)
    mus = merge(mu, (batch, -1, -1, -1), "mu", "BCHW").to_delayed().ravel()
    gammas = [None] * len(mus)
    if gamma is not None:
        axes = {7: "BCHWCHW", 6: "BCHWHW", 4: "BCHW"}[gamma.ndim]
        gammas = merge(gamma, (batch,) + (-1,) * (gamma.ndim - 1), "gamma",
                       axes).to_delayed().ravel()
    for n, x in small.items():
        if isinstance(x, da.Array):
            small[n] = merge(x, (-1,) * x.ndim, n, "CCHW"[:x.ndim]).to_delayed().ravel()[0]
    merge.warn()
    task = dask.delayed(_moments_task, nout=2, pure=True)
    params = dict(stride=stride, padding=padding, dilation=dilation, groups=groups,
                  out_layout=out_layout, backend=backend)
    dtype = np.dtype(call.acc)
    parts = [(n, task(m, g, *small.values(), out_tail=call.out_shape(out_layout)[1:],
                      dtype=dtype, **params)) for n, m, g in zip(batch, mus, gammas)]

    def gather(i, shape):
        return da.concatenate([da.from_delayed(p[i], (n,) + shape[1:], dtype=dtype,
                                               meta=meta_from_array(mu, len(shape), dtype))
                               for n, p in parts])

    return (gather(0, (call.B, call.Co, call.Ho, call.Wo)),
            gather(1, call.out_shape(out_layout)))
