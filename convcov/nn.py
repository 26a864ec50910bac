"""For users holding a ``torch.nn.Conv2d``: the layer's geometry, read from the layer.

Owns :func:`conv_params` (kernel size, stride, padding, dilation and groups of a conv
layer, as :func:`convcov.accumulate` takes them), :func:`weight_noise_covariance`
(``accumulate`` with them, allocating ``out`` when none is given) and :func:`moments`
(:func:`convcov.conv2d_moments` with the layer's weight, bias and geometry). Refuses what convcov
does not model, rather than computing something else: padding modes other than zeros, and
``padding="same"`` where torch would pad one side more than the other.

Importing this module imports torch; ``import convcov`` does not import it.
"""

import torch

from ._errors import ShapeError
from ._frontend import accumulate
from .moments import conv2d_moments


def conv_params(conv) -> dict:
    """The geometry of a 2-D conv layer as keyword arguments of :func:`convcov.accumulate`.

    ``kernel_size`` is the weight shape ``(Co, Ci // groups, kh, kw)``, so ``accumulate``
    also checks ``out`` and ``mu`` against the layer's channels. Works for
    ``torch.nn.Conv2d`` and anything with its attributes.

    >>> import torch, convcov.nn
    >>> conv = torch.nn.Conv2d(4, 8, 3, stride=2, padding="valid", groups=2)
    >>> p = convcov.nn.conv_params(conv)
    >>> p["kernel_size"], p["stride"], p["padding"], p["dilation"], p["groups"]
    ((8, 2, 3, 3), (2, 2), (0, 0), (1, 1), 2)
    """
    try:
        k, stride, padding = tuple(conv.kernel_size), tuple(conv.stride), conv.padding
        dilation, groups = tuple(conv.dilation), conv.groups
        Co, Ci = conv.out_channels, conv.in_channels
    except (AttributeError, TypeError):
        raise TypeError(f"conv: expected a torch.nn.Conv2d (or a module with its kernel_size, "
                        f"stride, padding, dilation, groups, in_channels, out_channels); "
                        f"got {type(conv).__qualname__}") from None
    if len(k) != 2:
        raise TypeError(f"conv: expected a 2-D convolution; got kernel_size {k}")
    mode = getattr(conv, "padding_mode", "zeros")
    if mode != "zeros":
        raise ValueError(f"conv.padding_mode: convcov models zero padding only; got {mode!r}")
    if padding == "valid":
        padding = (0, 0)
    elif padding == "same":
        # torch pads dilation * (k - 1) in all, the smaller half before: symmetric only
        # when that total is even.
        totals = [d * (n - 1) for d, n in zip(dilation, k)]
        if any(t % 2 for t in totals):
            raise ValueError(f"conv.padding: 'same' with kernel_size {k} and dilation "
                             f"{dilation} pads one side more than the other, which convcov "
                             f"does not model; pad the input and use padding=0 instead")
        padding = (totals[0] // 2, totals[1] // 2)
    return dict(kernel_size=(Co, Ci // groups, *k), stride=stride, padding=tuple(padding),
                dilation=dilation, groups=groups)


def weight_noise_covariance(conv, mu, gamma=None, *, c, out=None, layout="diag",
                            backend=None):
    """The weight-noise term of ``conv``'s output covariance, added into ``out``.

    :func:`convcov.accumulate` with ``conv``'s geometry (see :func:`conv_params`):
    ``mu`` ``(B, Ci, H, W)`` is the mean of the layer's input, ``gamma`` its covariance
    (full, diagonal or None), ``c`` the weight-noise variance (a number, 0-d, or one per
    output channel). Without ``out`` a zero tensor is allocated, in ``layout`` "diag"
    ``(B, Co, Ho, Wo, Ho, Wo)`` or "full" ``(B, Co, Ho, Wo, Co, Ho, Wo)``, with the dtype
    of ``mu`` and ``gamma`` promoted. Returns ``out``. Differentiable like ``accumulate``.

    >>> import torch, convcov.nn
    >>> conv = torch.nn.Conv2d(3, 4, 3, padding=1)
    >>> mu = torch.rand(2, 3, 5, 5)
    >>> convcov.nn.weight_noise_covariance(conv, mu, c=0.01, backend="numpy").shape
    torch.Size([2, 4, 5, 5, 5, 5])
    """
    params = conv_params(conv)
    if out is None:
        if layout not in ("diag", "full"):
            raise ValueError(f"layout: expected 'diag' or 'full'; got {layout!r}")
        if mu.dim() != 4:
            raise ShapeError(f"mu: expected 4 dims (B, Ci, H, W); got shape {tuple(mu.shape)}")
        B, _, H, W = mu.shape
        (kh, kw), (sh, sw) = params["kernel_size"][2:], params["stride"]
        (ph, pw), (dh, dw) = params["padding"], params["dilation"]
        Ho = (H + 2 * ph - dh * (kh - 1) - 1) // sh + 1
        Wo = (W + 2 * pw - dw * (kw - 1) - 1) // sw + 1
        Co = conv.out_channels
        shape = (B, Co, Ho, Wo, Ho, Wo) if layout == "diag" else (B, Co, Ho, Wo, Co, Ho, Wo)
        dtype = mu.dtype if gamma is None else torch.promote_types(mu.dtype, gamma.dtype)
        if min(Ho, Wo) < 1:  # let accumulate say what is wrong
            shape = (B, Co, 1, 1, 1, 1)
        out = mu.new_zeros(shape, dtype=dtype)
    return accumulate(out, gamma, mu, c, backend=backend, **params)


def moments(conv, mu, gamma=None, *, c=None, c_bias=None, out_layout="full", out=None,
            backend=None):
    """Mean and covariance of ``conv``'s output: :func:`convcov.conv2d_moments` with the
    layer's weight, bias and geometry (see :func:`conv_params`). ``c`` is the weights'
    noise variance (a number, ``(Co,)`` or one per weight, ``conv.weight``'s shape),
    ``c_bias`` the bias's. Returns ``(mu_out, gamma_out)``, differentiable in the
    layer's parameters too.

    >>> import torch, convcov.nn
    >>> conv = torch.nn.Conv2d(3, 4, 3, padding=1)
    >>> m, v = convcov.nn.moments(conv, torch.rand(2, 3, 5, 5), c=0.01, out_layout="var")
    >>> m.shape, v.shape
    (torch.Size([2, 4, 5, 5]), torch.Size([2, 4, 5, 5]))
    """
    p = conv_params(conv)
    return conv2d_moments(mu, gamma, conv.weight, conv.bias, c, c_bias=c_bias,
                          stride=p["stride"], padding=p["padding"], dilation=p["dilation"],
                          groups=p["groups"], out_layout=out_layout, out=out, backend=backend)
