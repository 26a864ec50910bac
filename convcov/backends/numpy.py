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

The backward (:func:`patch_moment_vjp`, docs/autograd.md) is the same loop run
backwards: each offset's window of ``grad_S`` is added into the padded gradient of the
group's gamma sum (the window's adjoint is "add into the same window"), and the Gram
matrix's adjoint ``P (grad_S + grad_S^T)`` is added into the padded gradient of mu.
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


def patch_moment_vjp(a) -> tuple[np.ndarray | None, np.ndarray | None]:
    """The adjoint of :func:`patch_moment` for ``grad_S``, in float64.

    Returns ``(dL/dΓ, dL/dmu)``: the gradient of the group channel-sum of gamma's
    channel-diagonal, shape (B, G, H, W, H, W) (every channel of group g gets this), and
    the gradient of mu, shape (B, Ci, H, W); each None when ``a`` does not ask for it.
    """
    B, G, Cg, H, W, Ho, Wo = a.B, a.G, a.Ci // a.G, a.H, a.W, a.Ho, a.Wo
    f64 = np.float64
    Hp, Wp = H + 2 * a.ph, W + 2 * a.pw
    grad_S = np.asarray(a.grad_S, f64).reshape(B, G, Ho * Wo, Ho * Wo)
    need_gamma, need_mu = a.grad_gamma is not None, a.grad_mu is not None
    if need_gamma:
        grad_gamma_pad = np.zeros((B, G, Hp, Wp, Hp, Wp), f64)
        grad_S6 = grad_S.reshape(B, G, Ho, Wo, Ho, Wo)
    if need_mu:
        mu_pad = np.zeros((B, a.Ci, Hp, Wp), f64)
        mu_pad[:, :, a.ph:a.ph + H, a.pw:a.pw + W] = a.mu
        grad_mu_pad = np.zeros_like(mu_pad)
        sym = grad_S + grad_S.swapaxes(-1, -2)  # S_mu = P^T P, so dL/dP = P (T + T^T)
    rows, cols = np.arange(Ho) * a.sh - a.ph, np.arange(Wo) * a.sw - a.pw
    for ii in range(a.kh):
        wi = window(Ho, a.sh, ii * a.dh)
        x_in = (rows + ii * a.dh >= 0) & (rows + ii * a.dh < H)
        for ji in range(a.kw):
            wj = window(Wo, a.sw, ji * a.dw)
            if need_gamma:
                # Forward read gamma_pad[wi, wj, wi, wj]; the window positions of one
                # offset are distinct, so its adjoint is a plain += into the same window.
                # Padded positions are cropped below: the absent terms go nowhere.
                grad_gamma_pad[:, :, wi, wj, wi, wj] += grad_S6
            if need_mu:
                inside = np.outer(x_in, (cols + ji * a.dw >= 0) & (cols + ji * a.dw < W)).ravel()
                T = sym
                if not inside.all():  # as in the forward: absent terms, not 0 * value
                    T = sym.copy()
                    T[..., ~inside, :] = 0.0
                    T[..., :, ~inside] = 0.0
                P = mu_pad[:, :, wi, wj].reshape(B, G, Cg, Ho * Wo)
                grad_mu_pad[:, :, wi, wj] += np.matmul(P, T).reshape(B, a.Ci, Ho, Wo)
    crop = (slice(a.ph, a.ph + H), slice(a.pw, a.pw + W))
    grad_gamma = grad_gamma_pad[(slice(None),) * 2 + crop * 2] if need_gamma else None
    grad_mu = grad_mu_pad[(slice(None),) * 2 + crop] if need_mu else None
    return grad_gamma, grad_mu


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
