"""The operation as a plain PyTorch expression: the baseline convcov is measured against.

Owns :func:`patch_moment` and :func:`accumulate` written with ordinary torch ops, the
strongest way we know to say the operation in plain torch (no custom kernels):

- the ``mu`` part is a Gram matrix of unfolded patches: ``F.unfold`` gives each group's
  patches as a ``(Cg*kh*kw, Ho*Wo)`` matrix, and one batched matmul forms ``P^T P``;
- the ``gamma`` part reads only gamma's channel-diagonal (a view, never a copy of the full
  layout), sums it over each group's channels once into ``T`` (``B, G, H, W, H, W``; a
  depthwise layer's ``T`` is gamma's own view, not a copy), then adds the ``kh x kw``
  shifted windows of ``T`` in place onto the Gram matrix. Each window is a strided slice;
  zero padding is handled by clipping each window to the positions inside the input, so
  ``T`` is never padded (no copy) and no padded term of gamma is computed;
- ``out``'s channel-diagonal, a view of either layout, gets one broadcast
  ``addcmul_(c, S)``: ``S`` is broadcast over each group's output channels, never
  expanded to ``Co`` copies.

Sums are in float32, float64 when any input is float64, as convcov's. Everything is
differentiable through torch autograd and traceable by ``torch.compile``. The ``mu`` part
multiplies the zero padding by ``mu`` (``F.unfold`` materialises the padded zeros), so it
assumes finite inputs: a padded 0 times an Inf gives NaN here, where the operation has no
such term. ``convcov bench`` times it eagerly and under ``torch.compile``; tests use it as
an independent cross-check. Importing this module imports torch.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _pair(v):
    return (int(v), int(v)) if isinstance(v, int) else (int(v[0]), int(v[1]))


def _out_size(n, k, s, p, d):
    return (n + 2 * p - d * (k - 1) - 1) // s + 1


def _valid(n_in, n_out, i, s, p, d):
    """Kernel offset ``i``'s window along one axis: ``(o0, o1, slice)`` where outputs
    ``o0 <= o < o1`` read input ``o*s + i*d - p`` inside ``[0, n_in)``, read by ``slice``."""
    o0 = max(0, -(-(p - i * d) // s))
    o1 = min(n_out, (n_in - 1 + p - i * d) // s + 1)
    x0 = o0 * s + i * d - p
    return o0, o1, slice(x0, x0 + (o1 - o0 - 1) * s + 1, s)


def _is_f64(*xs):
    return any(isinstance(x, torch.Tensor) and x.dtype == torch.float64 for x in xs)


def _moment(gamma, mu, kh, kw, stride, padding, dilation, groups, acc):
    """S as (B, G, Ho, Wo, Ho, Wo) in dtype ``acc``."""
    (sh, sw), (ph, pw), (dh, dw) = _pair(stride), _pair(padding), _pair(dilation)
    B, Ci, H, W = mu.shape
    G = groups
    Cg = Ci // G
    Ho, Wo = _out_size(H, kh, sh, ph, dh), _out_size(W, kw, sw, pw, dw)
    L = Ho * Wo
    # mu part: patches (B, Ci*kh*kw, L), channel-major, so each group's rows are contiguous
    P = F.unfold(mu.to(acc), (kh, kw), dilation=(dh, dw), padding=(ph, pw), stride=(sh, sw))
    P = P.reshape(B, G, Cg * kh * kw, L)
    S = torch.matmul(P.transpose(-2, -1), P).view(B, G, Ho, Wo, Ho, Wo)
    if gamma is None:
        return S
    if gamma.dim() == 7:  # the channel-diagonal only: (B, Ci, H, W, H, W), a view
        gamma = gamma.diagonal(dim1=1, dim2=4).movedim(-1, 1)
    if Cg == 1:  # depthwise: the group sum is gamma itself, read by the windows directly
        T = gamma
    else:
        T = gamma.unflatten(1, (G, Cg)).sum(2, dtype=acc)
    if torch.compiler.is_compiling():
        return _windows_fused(S, T, kh, kw, sh, sw, ph, pw, dh, dw)
    return _windows_in_place(S, T, kh, kw, sh, sw, ph, pw, dh, dw)


def _windows_in_place(S, T, kh, kw, sh, sw, ph, pw, dh, dw):
    """Eager: S += each window of T, in place, each clipped to the positions inside the
    input: kh*kw strided adds, no padded copy of T and no temporaries."""
    H, W = T.shape[2:4]
    Ho, Wo = S.shape[2:4]
    rows = [_valid(H, Ho, i, sh, ph, dh) for i in range(kh)]
    cols = [_valid(W, Wo, j, sw, pw, dw) for j in range(kw)]
    added = False
    for r0, r1, xs in rows:
        if r1 <= r0:
            continue
        for c0, c1, ys in cols:
            if c1 <= c0:
                continue
            S[:, :, r0:r1, c0:c1, r0:r1, c0:c1] += T[:, :, xs, ys, xs, ys]
            added = True
    if not added:  # every window in the padding: T still in the graph, gradient 0
        S = S + T.flatten()[:0].sum()
    return S


def _windows_fused(S, T, kh, kw, sh, sw, ph, pw, dh, dw):
    """Under torch.compile: S + the sum of the kh*kw strided windows of T padded once, as
    one functional expression, which inductor fuses into a single kernel (kh*kw loads per
    entry of S). In-place adds on slices, the eager form, compile to a chain of full
    copies of S instead, hundreds of times slower."""
    Ho, Wo = S.shape[2:4]
    Tp = F.pad(T, (pw, pw, ph, ph, pw, pw, ph, ph)) if ph or pw else T
    for i in range(kh):
        xs = slice(i * dh, i * dh + (Ho - 1) * sh + 1, sh)
        for j in range(kw):
            ys = slice(j * dw, j * dw + (Wo - 1) * sw + 1, sw)
            S = S + Tp[:, :, xs, ys, xs, ys]
    return S


def patch_moment(gamma, mu, kh, kw, stride=(1, 1), padding=(0, 0), dilation=(1, 1),
                 groups=1):
    """S, shape (B, G, Ho, Wo, Ho, Wo), in float32 (float64 if any input is float64).
    ``stride``, ``padding``, ``dilation``: int or pair."""
    acc = torch.float64 if _is_f64(gamma, mu) else torch.float32
    return _moment(gamma, mu, kh, kw, stride, padding, dilation, groups, acc)


def accumulate(out, gamma, mu, c, kh, kw, stride=(1, 1), padding=(0, 0), dilation=(1, 1),
               groups=1):
    """out[b, c0, i0, j0, (c0,) i1, j1] += c[c0] * S[b, g(c0), ...], in place on out's
    channel-diagonal (full layout) or on out (diagonal layout); returns out. ``c``: a
    number, a 0-d or a (Co,) tensor."""
    acc = torch.float64 if _is_f64(out, gamma, mu, c) else torch.float32
    S = _moment(gamma, mu, kh, kw, stride, padding, dilation, groups, acc)
    Co = out.shape[1]
    if out.dim() == 7:
        diag = out.diagonal(dim1=1, dim2=4).movedim(-1, 1)  # (B, Co, Ho, Wo, Ho, Wo), a view
    else:
        diag = out
    c = torch.as_tensor(c, dtype=acc, device=S.device).reshape(-1).expand(Co)
    diag.unflatten(1, (groups, Co // groups)).addcmul_(
        c.reshape(1, groups, Co // groups, 1, 1, 1, 1), S.unsqueeze(2))
    return out
