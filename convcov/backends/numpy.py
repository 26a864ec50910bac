"""``numpy``: the reference backend. Plain, obviously correct, vectorised, float64.

How the seed's 9-deep loop becomes array expressions (docs/derivation.md has the math):

* ``S`` does not depend on the output channel ``c0``: compute it once per group ``g``
  and add ``c[c0] * S[:, g(c0)]`` into each output channel of that group.
* For one kernel offset ``(ii, ji)``, the positions read are a strided window of the
  input: ``x = i*sh + ii*dh - ph``. The outputs ``i`` whose position lies inside the
  input are a contiguous run, so each offset adds into one block of S (both of its
  position pairs cut to those runs) and the sum over ``(ii, ji)`` is a Python loop over
  ``kh * kw`` offsets, each a whole-array operation:
  - mu part: a Gram matrix over the group's channels,
    ``P[b, g, :, p]^T @ P[b, g, :, q]`` with ``P`` the window reshaped to (Cg, ni*nj);
  - gamma part: only the channel-diagonal ``gamma[b, ci, :, :, ci, :, :]`` is read (a
    strided view, no copy); it is summed over the group's channels once, and the same
    window is taken on both of its position pairs.
* A term is absent when either of its two positions falls in the padding: those are
  never read, so no padded copy exists (the memory does not grow with the padding) and a
  padded 0 is never multiplied by an Inf.

Temporaries: S and one offset's block of S (float64), the group channel-sum of gamma, and
one window of mu. Nothing grows with ``Ci * Ci``, with ``Co`` or with the padding:
``out`` is updated one output channel at a time.

The backward (:func:`patch_moment_vjp`, docs/autograd.md) is the same loop run
backwards: each offset's block of ``grad_S`` is added into the gradient of the group's
gamma sum (the window's adjoint is "add into the same window"), and the Gram matrix's
adjoint ``P (grad_S + grad_S^T)`` into the gradient of mu.
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import as_strided

from .._registry import Backend


def channel_diagonal(a: np.ndarray) -> np.ndarray:
    """View ``a[b, c, x, y, c, x', y']`` as ``(B, C, X, Y, X', Y')`` (full layout -> diagonal)."""
    B, C, X, Y, _, X1, Y1 = a.shape
    sb, sc, sx, sy, sc1, sx1, sy1 = a.strides
    return as_strided(a, (B, C, X, Y, X1, Y1), (sb, sc + sc1, sx, sy, sx1, sy1),
                      writeable=a.flags.writeable)


def inside(n_out, s, offset, n):
    """``(lo, hi, rows)``: the outputs ``lo <= i < hi`` whose input position
    ``i*s + offset`` lies in ``[0, n)`` (a contiguous run), and the slice of the input they
    read. Positions in the padding are absent terms, never read: no padded copy is made,
    so memory does not grow with the padding."""
    lo = min(n_out, max(0, -(offset // s)))  # ceil(-offset / s), clipped
    hi = max(lo, min(n_out, (n - 1 - offset) // s + 1))
    return lo, hi, slice(lo * s + offset, (hi - 1) * s + offset + 1 if hi > lo else 0, s)


def _offsets(p):
    """Per kernel offset (ii, ji): the output block it reaches, as slices of (i, j), and
    the input rows and columns it reads; offsets that reach no output are left out."""
    for ii in range(p.kh):
        i_lo, i_hi, rows = inside(p.Ho, p.sh, ii * p.dh - p.ph, p.H)
        for ji in range(p.kw):
            j_lo, j_hi, cols = inside(p.Wo, p.sw, ji * p.dw - p.pw, p.W)
            if i_lo < i_hi and j_lo < j_hi:
                yield (slice(i_lo, i_hi), slice(j_lo, j_hi)), (rows, cols)


def patch_moment(p) -> np.ndarray:
    """S[b, g, i0, j0, i1, j1] in float64, shape (B, G, Ho, Wo, Ho, Wo)."""
    B, G, Cg, H, W, Ho, Wo = p.B, p.G, p.Ci // p.G, p.H, p.W, p.Ho, p.Wo
    f64 = np.float64
    mu = p.mu.reshape(B, G, Cg, H, W)
    gsum = None
    if p.gamma is not None:
        diag = channel_diagonal(p.gamma) if p.full_gamma else p.gamma
        gsum = diag.reshape(B, G, Cg, H, W, H, W).sum(axis=2, dtype=f64)
    S = np.zeros((B, G, Ho, Wo, Ho, Wo), f64)
    for (oi, oj), (rows, cols) in _offsets(p):
        P = mu[:, :, :, rows, cols].astype(f64)  # (B, G, Cg, ni, nj)
        ni, nj = P.shape[3:]
        block = S[:, :, oi, oj, oi, oj]  # a view: the pairs this offset reaches
        P = P.reshape(B, G, Cg, ni * nj)
        block += np.matmul(P.transpose(0, 1, 3, 2), P).reshape(B, G, ni, nj, ni, nj)
        if gsum is not None:
            block += gsum[:, :, rows, cols, rows, cols]
    return S


def add_term(p, S, c, source=None, decode=None, encode=None) -> None:
    """``out = source + c[c0] * S[:, g(c0)]`` on out's channel diagonal (``source``: out
    itself unless given, of out's layout), summed in float64 and rounded once into out;
    ``decode`` / ``encode``: out's elements to and from float64 where numpy's casts do not
    serve (bfloat16's bits)."""
    per_group = p.Co // p.G
    src = p.out if source is None else source
    for c0 in range(p.Co):
        at = (slice(None), c0, slice(None), slice(None), c0) if p.full_out else (slice(None), c0)
        old = src[at] if decode is None else decode(src[at])
        new = old + c[c0] * S[:, c0 // per_group]
        p.out[at] = new if encode is None else encode(new)


def patch_moment_vjp(a) -> tuple[np.ndarray | None, np.ndarray | None]:
    """The adjoint of :func:`patch_moment` for ``grad_S``, in float64.

    Returns ``(dL/dΓ, dL/dmu)``: the gradient of the group channel-sum of gamma's
    channel-diagonal, shape (B, G, H, W, H, W) (every channel of group g gets this), and
    the gradient of mu, shape (B, Ci, H, W); each None when ``a`` does not ask for it.
    """
    B, G, Cg, H, W = a.B, a.G, a.Ci // a.G, a.H, a.W
    f64 = np.float64
    grad_S = np.asarray(a.grad_S, f64)
    grad_gamma = grad_mu = None
    if a.grad_gamma is not None:
        grad_gamma = np.zeros((B, G, H, W, H, W), f64)
    if a.grad_mu is not None:
        mu = a.mu.reshape(B, G, Cg, H, W)
        grad_mu = np.zeros((B, G, Cg, H, W), f64)
        sym = grad_S + grad_S.transpose(0, 1, 4, 5, 2, 3)  # S_mu = P^T P: dL/dP = P (T + T^T)
    for (oi, oj), (rows, cols) in _offsets(a):
        if grad_gamma is not None:
            # The forward read gsum[rows, cols, rows, cols] into this block; one offset's
            # positions are distinct, so its adjoint is a plain += into the same window.
            grad_gamma[:, :, rows, cols, rows, cols] += grad_S[:, :, oi, oj, oi, oj]
        if grad_mu is not None:
            P = mu[:, :, :, rows, cols].astype(f64)
            ni, nj = P.shape[3:]
            T = sym[:, :, oi, oj, oi, oj].reshape(B, G, ni * nj, ni * nj)
            grad_mu[:, :, :, rows, cols] += np.matmul(
                P.reshape(B, G, Cg, ni * nj), T).reshape(B, G, Cg, ni, nj)
    return grad_gamma, None if grad_mu is None else grad_mu.reshape(B, a.Ci, H, W)


class NumpyBackend(Backend):
    name = "numpy"
    device = "cpu"
    dtypes = frozenset({"float16", "float32", "float64"})

    def accumulate(self, p) -> None:
        c = np.full(p.Co, p.c_value) if p.c is None else p.c.astype(np.float64)
        add_term(p, patch_moment(p), c)

    def patch_moment_vjp(self, a) -> None:
        grad_gamma, grad_mu = patch_moment_vjp(a)
        if grad_mu is not None:
            a.grad_mu[...] = grad_mu  # rounded once into grad_mu's dtype
        if grad_gamma is not None:
            target = channel_diagonal(a.grad_gamma) if a.full_gamma else a.grad_gamma
            Cg = a.Ci // a.G
            grad_gamma = grad_gamma.astype(target.dtype)  # round once, not once per channel
            for g in range(a.G):  # every channel of group g gets the group's gradient
                target[:, g * Cg:(g + 1) * Cg] = grad_gamma[:, g, None]


backend = NumpyBackend()
