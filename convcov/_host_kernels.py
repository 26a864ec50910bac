"""conv2d_moments' own kernels on the host, compiled by Numba and run under the numba
backend's threading rules (:func:`convcov.backends.numba._call`): ``symmetrize``, the
result's exact symmetrisation; ``transpose`` and ``transpose_rows``, the orders of the
channels-last convolutions (:func:`convcov.moments._channels_last`); ``window_sums``, the
diagonal layout's convolution of each output channel's own block. Arrays are NumPy arrays of
one dtype (float32 or float64); nothing here validates.
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange

from .backends.numba import _call, _data, _jit, _offset, _renamed, _threads


#: The side of the tiles :func:`symmetrize` pairs (a tile and its mirror, both in L1): on
#: the 2-core host 2 x 4096^2 float32 in place 57 ms with tiles of 64, 44.5 ms with 16.
SYM_TILE = 16


def _symmetrize(A):
    """``A = (A + A^T) / 2`` in place for a stack ``(N, r, r)`` of C-contiguous square
    matrices, as ``0.5 a + 0.5 b`` (exactly ``(a + b) / 2`` rounded once; addition
    commutes, so A becomes bitwise symmetric). A job takes the rows of tiles k and
    nt - 1 - k (the same number of tile pairs for every job); a tile and its mirror are
    copied into two small buffers before either is written, by rows of the matrix
    (contiguous), and transposed there."""
    N, r = A.shape[0], A.shape[1]
    nt = (r + SYM_TILE - 1) // SYM_TILE
    half = (nt + 1) // 2
    for job in prange(N * half):
        n, k = job // half, job % half
        a = np.empty((SYM_TILE, SYM_TILE), A.dtype)
        b = np.empty((SYM_TILE, SYM_TILE), A.dtype)
        for t in range(1 if 2 * k + 1 == nt else 2):
            ti = k if t == 0 else nt - 1 - k
            i0, ni = ti * SYM_TILE, min(SYM_TILE, r - ti * SYM_TILE)
            for tj in range(ti, nt):  # the pair: tile (ti, tj) in a, its mirror in b
                j0, nj = tj * SYM_TILE, min(SYM_TILE, r - tj * SYM_TILE)
                for i in range(ni):
                    for j in range(nj):
                        a[i, j] = A[n, i0 + i, j0 + j]
                for j in range(nj):
                    for i in range(ni):
                        b[j, i] = A[n, j0 + j, i0 + i]
                for i in range(ni):
                    for j in range(nj):
                        a[i, j] = 0.5 * a[i, j] + 0.5 * b[j, i]
                for i in range(ni):
                    for j in range(nj):
                        A[n, i0 + i, j0 + j] = a[i, j]
                for j in range(nj):
                    for i in range(ni):
                        A[n, j0 + j, i0 + i] = a[i, j]


_sym_parallel = njit(parallel=True, **_jit)(_symmetrize)
_sym_serial = njit(**_jit)(_renamed(_symmetrize, "_symmetrize_serial"))


def symmetrize(A, D) -> None:
    """``D = (A + A^T) / 2`` (:func:`_symmetrize`) on NumPy arrays (float32 or float64,
    C-contiguous, one dtype; ``D`` is ``A`` or apart from it): conv2d_moments' exact
    symmetry on the host. Apart, A is copied into D and D symmetrised in place: writing
    the mirror tiles into memory not in the cache costs more than the copy."""
    if not np.may_share_memory(D, A):  # (apart: no byte in common; else D is A)
        np.copyto(D, A)
    _call(_sym_parallel, _sym_serial, D)


#: The side of the tiles :func:`transpose` moves (a tile's rows and columns both whole
#: cache lines in float32): conv2d_moments full on the 2-core host with 16 against 32,
#: strided 69-71 -> 63-66 ms, 64ch 74-79 -> 69-72 ms, 16ch 251-268 -> 233-242 ms.
SWAP_TILE = 32


def _transpose(src, dst):
    """``dst[i, j, k, y, x] = src[i, j, k, x, y]`` for 5-d arrays of any strides, by tiles."""
    N1, N2, N3, X, Y = src.shape
    nx, ny = (X + SWAP_TILE - 1) // SWAP_TILE, (Y + SWAP_TILE - 1) // SWAP_TILE
    for job in prange(N1 * N2 * N3 * nx * ny):
        jy, r1 = job % ny, job // ny
        jx, r2 = r1 % nx, r1 // nx
        k, r3 = r2 % N3, r2 // N3
        j, i = r3 % N2, r3 // N2
        s, d = src[i, j, k], dst[i, j, k]
        x0, y0 = jx * SWAP_TILE, jy * SWAP_TILE
        for y in range(y0, min(Y, y0 + SWAP_TILE)):
            for x in range(x0, min(X, x0 + SWAP_TILE)):
                d[y, x] = s[x, y]


def _transpose_rows(U, X, Y, jobs):
    """Each row of ``U`` ``(N, X * Y)`` (C-contiguous) from ``(X, Y)`` to ``(Y, X)`` order,
    in place: each of about ``jobs`` jobs copies its rows one at a time into a buffer and
    writes them back."""
    N = U.shape[0]
    per = max(1, N // jobs)
    for job in prange((N + per - 1) // per):
        row = np.empty(X * Y, U.dtype)
        for r in range(job * per, min(N, (job + 1) * per)):
            row[:] = U[r]
            for y in range(Y):
                for x in range(X):
                    U[r, y * X + x] = row[x * Y + y]


_swap_parallel = njit(parallel=True, **_jit)(_transpose)
_swap_serial = njit(**_jit)(_renamed(_transpose, "_transpose_serial"))
_rows_parallel = njit(parallel=True, **_jit)(_transpose_rows)
_rows_serial = njit(**_jit)(_renamed(_transpose_rows, "_transpose_rows_serial"))


def transpose(src, dst) -> None:
    """``dst[..., y, x] = src[..., x, y]`` (:func:`_transpose`) for NumPy arrays of one
    dtype (float32 or float64) with five axes of any strides, ``dst`` apart from ``src``:
    conv2d_moments' channels-last orders on the host."""
    _call(_swap_parallel, _swap_serial, src, dst)


def transpose_rows(U, X, Y) -> None:
    """Each row of the C-contiguous ``(N, X * Y)`` array ``U`` from ``(X, Y)`` to ``(Y, X)``
    order, in place (:func:`_transpose_rows`)."""
    _call(_rows_parallel, _rows_serial, U, X, Y, 8 * _threads())


def _window_sums(X, w, D, sh, sw, ph, pw, dh, dw):
    """``D[b, g*J + j, i, jo, :] = sum over c, u, v of w[g*J + j, c, u, v] X[b, g, j, c,
    i*sh - ph + u*dh, jo*sw - pw + v*dw, :]``, the terms in the padding absent. A job is
    one output row of one output channel, summed in place in D (in cache) input row by
    input row; consecutive jobs are consecutive rows, whose windows share input rows. X's
    last axis is contiguous, and X and D are read through pointers so that the sums
    vectorise."""
    B, G, J, Cg, H, W, Q = X.shape
    Ho, Wo, kh, kw = D.shape[2], D.shape[3], w.shape[2], w.shape[3]
    e = X.itemsize
    s0, s1, s2 = X.strides[0] // e, X.strides[1] // e, X.strides[2] // e
    s3, s4, s5 = X.strides[3] // e, X.strides[4] // e, X.strides[5] // e
    base, out = _data(X), _data(D)
    for job in prange(B * G * J * Ho):
        i, r1 = job % Ho, job // Ho
        j, r2 = r1 % J, r1 // J
        g, b = r2 % G, r2 // G
        c0 = g * J + j
        d = _offset(out, ((b * G * J + c0) * Ho + i) * Wo * Q)  # the row D[b, c0, i]
        for k in range(Wo * Q):
            d[k] = 0
        for c in range(Cg):
            for u in range(kh):
                x = i * sh - ph + u * dh
                if x < 0 or x >= H:
                    continue
                at = b * s0 + g * s1 + j * s2 + c * s3 + x * s4
                for v in range(kw):
                    wt = w[c0, c, u, v]
                    for jo in range(Wo):
                        y = jo * sw - pw + v * dw
                        if y < 0 or y >= W:
                            continue
                        row, acc = _offset(base, at + y * s5), _offset(d, jo * Q)
                        for q in range(Q):
                            acc[q] += wt * row[q]


_sums_parallel = njit(parallel=True, **_jit)(_window_sums)
_sums_serial = njit(**_jit)(_renamed(_window_sums, "_window_sums_serial"))


def window_sums(X, w, D, stride, padding, dilation) -> None:
    """Each output channel's convolution with its own kernel (:func:`_window_sums`): ``X``
    ``(B, G, J, Cg, H, W, Q)`` of any strides (its last axis contiguous), ``w`` ``(G * J,
    Cg, kh, kw)``, into the C-contiguous ``D`` ``(B, G * J, Ho, Wo, Q)``; one dtype."""
    if X.strides[6] != X.itemsize:
        X = np.ascontiguousarray(X)
    _call(_sums_parallel, _sums_serial, X, w, D, *stride, *padding, *dilation)
