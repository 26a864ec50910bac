"""``numpy``: the reference backend. Plain, obviously correct, vectorised, float64.

How the seed's 9-deep loop becomes array expressions (docs/derivation.md has the math):

* ``S`` does not depend on the output channel ``c0``: compute it once per group ``g``
  and add ``c[c0] * S[:, g(c0)]`` into each output channel of that group.
* For one kernel offset ``(ii, ji)``, the positions read are a strided window of the
  zero-padded input: ``x = i*sh + ii*dh`` over ``i < Ho``. So the sum over ``(ii, ji)``
  is a Python loop over ``kh * kw`` offsets, each a whole-array operation:
  - mu part: a Gram matrix over the group's channels,
    ``P[b, g, :, p]^T @ P[b, g, :, q]`` with ``P`` the window reshaped to (Cg, Ho*Wo);
  - gamma part: only the channel-diagonal ``gamma[b, ci, :, :, ci, :, :]`` is read (a
    strided view, no copy); it is summed over the group's channels once, padded, and the
    same window is taken on both of its position pairs.
* A term is 0 when either of its two positions falls in the padding. The gamma part
  gets this from the zero padding; for the mu part a padded 0 times an Inf would be NaN,
  so the offset's Gram matrix is masked instead (rows and columns of padded positions).

Temporaries: S and one offset's S (float64), the group channel-sum of gamma, mu and its
windows. Nothing grows with ``Ci * Ci`` or with ``Co``: ``out`` is updated one output
channel at a time.
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


def window(n_out, s, offset):
    """Slice of the padded axis read by kernel offset ``offset`` (= ii*dh) for all outputs."""
    return slice(offset, offset + (n_out - 1) * s + 1, s)


def patch_moment(p) -> np.ndarray:
    """S[b, g, i0, j0, i1, j1] in float64, shape (B, G, Ho, Wo, Ho, Wo)."""
    B, G, Cg, H, W, Ho, Wo = p.B, p.G, p.Ci // p.G, p.H, p.W, p.Ho, p.Wo
    f64 = np.float64
    mu_pad = np.zeros((B, p.Ci, H + 2 * p.ph, W + 2 * p.pw), f64)
    mu_pad[:, :, p.ph:p.ph + H, p.pw:p.pw + W] = p.mu
    gamma_pad = None
    if p.gamma is not None:
        diag = channel_diagonal(p.gamma) if p.full_gamma else p.gamma
        gsum = diag.reshape(B, G, Cg, H, W, H, W).sum(axis=2, dtype=f64)
        gamma_pad = np.zeros((B, G) + mu_pad.shape[2:] * 2, f64)
        gamma_pad[:, :, p.ph:p.ph + H, p.pw:p.pw + W, p.ph:p.ph + H, p.pw:p.pw + W] = gsum
    rows, cols = np.arange(Ho) * p.sh - p.ph, np.arange(Wo) * p.sw - p.pw
    S = np.zeros((B, G, Ho * Wo, Ho * Wo), f64)
    for ii in range(p.kh):
        wi = window(Ho, p.sh, ii * p.dh)
        x_in = (rows + ii * p.dh >= 0) & (rows + ii * p.dh < H)
        for ji in range(p.kw):
            wj = window(Wo, p.sw, ji * p.dw)
            P = mu_pad[:, :, wi, wj].reshape(B, G, Cg, Ho * Wo)
            gram = np.matmul(P.transpose(0, 1, 3, 2), P)
            inside = np.outer(x_in, (cols + ji * p.dw >= 0) & (cols + ji * p.dw < W)).ravel()
            if not inside.all():
                gram[..., ~inside, :] = 0.0
                gram[..., :, ~inside] = 0.0
            S += gram
            if gamma_pad is not None:
                S += gamma_pad[:, :, wi, wj, wi, wj].reshape(B, G, Ho * Wo, Ho * Wo)
    return S.reshape(B, G, Ho, Wo, Ho, Wo)


class NumpyBackend(Backend):
    name = "numpy"
    device = "cpu"
    dtypes = frozenset({"float16", "float32", "float64"})

    def accumulate(self, p) -> None:
        S = patch_moment(p)
        c = np.full(p.Co, p.c_value) if p.c is None else p.c.astype(np.float64)
        per_group = p.Co // p.G
        for c0 in range(p.Co):
            target = p.out[:, c0, :, :, c0] if p.full_out else p.out[:, c0]
            # Sum in float64, round once into out's dtype.
            target[...] = target + c[c0] * S[:, c0 // per_group]


backend = NumpyBackend()
