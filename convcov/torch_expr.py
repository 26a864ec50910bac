"""The operation as a plain PyTorch expression: the baseline convcov is measured against.

Owns :func:`patch_moment` and :func:`accumulate` written with ordinary torch ops (strided
windows of the padded input, an einsum per kernel offset, a diagonal view of ``out``), the
way a researcher would write it without convcov. ``convcov bench`` times it eagerly and
under ``torch.compile``; tests use it as an independent cross-check. It assumes finite
inputs (a padded 0 times an Inf gives NaN here, where SPEC says the term is absent) and
allocates freely (a copy of gamma's diagonal, a Co-times-larger update): it is the
baseline, not the product. Importing this module imports torch.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _windows(n_out, s, d, k):
    return [slice(i * d, i * d + (n_out - 1) * s + 1, s) for i in range(k)]


def patch_moment(gamma, mu, kh, kw, stride=(1, 1), padding=(0, 0), dilation=(1, 1),
                 groups=1):
    """S, shape (B, G, Ho, Wo, Ho, Wo), in float32 (float64 if any input is float64)."""
    (sh, sw), (ph, pw), (dh, dw) = stride, padding, dilation
    B, Ci, H, W = mu.shape
    G, Cg = groups, Ci // groups
    Ho = (H + 2 * ph - dh * (kh - 1) - 1) // sh + 1
    Wo = (W + 2 * pw - dw * (kw - 1) - 1) // sw + 1
    f64 = mu.dtype == torch.float64 or (gamma is not None and gamma.dtype == torch.float64)
    acc = torch.float64 if f64 else torch.float32
    mu_pad = F.pad(mu.to(acc), (pw, pw, ph, ph))
    rows, cols = _windows(Ho, sh, dh, kh), _windows(Wo, sw, dw, kw)
    S = mu.new_zeros((B, G, Ho * Wo, Ho * Wo), dtype=acc)
    for wi in rows:
        for wj in cols:
            P = mu_pad[:, :, wi, wj].reshape(B, G, Cg, Ho * Wo)
            S = S + torch.einsum("bgcp,bgcq->bgpq", P, P)
    if gamma is not None:
        if gamma.dim() == 7:  # read only the channel-diagonal
            gamma = gamma.diagonal(dim1=1, dim2=4).permute(0, 5, 1, 2, 3, 4)
        gsum = gamma.reshape(B, G, Cg, H, W, H, W).sum(2, dtype=acc)
        gpad = F.pad(gsum, (pw, pw, ph, ph, pw, pw, ph, ph))
        for wi in rows:
            for wj in cols:
                S = S + gpad[:, :, wi, wj, wi, wj].reshape(B, G, Ho * Wo, Ho * Wo)
    return S.reshape(B, G, Ho, Wo, Ho, Wo)


def accumulate(out, gamma, mu, c, kh, kw, stride=(1, 1), padding=(0, 0), dilation=(1, 1),
               groups=1):
    """out[b, c0, i0, j0, (c0,) i1, j1] += c[c0] * S[b, g(c0), ...], in place; returns out."""
    S = patch_moment(gamma, mu, kh, kw, stride, padding, dilation, groups)
    Co = out.shape[1]
    c = torch.as_tensor(c, dtype=S.dtype, device=S.device).expand(Co)
    g_of_c0 = torch.arange(Co, device=S.device) // (Co // groups)
    delta = c[None, :, None, None, None, None] * S[:, g_of_c0]
    if out.dim() == 7:
        diag = out.diagonal(dim1=1, dim2=4)  # (B, Ho, Wo, Ho, Wo, Co), a view
        diag.copy_(diag + delta.permute(0, 2, 3, 4, 5, 1))
    else:
        out.copy_(out + delta)
    return out
