"""convcov: the weight-noise term of a 2-D convolution's output covariance, fast, for the
arrays you hold (numpy, torch, CuPy, numba).

Public API (SPEC.md sections 2 and 6): :func:`accumulate`, :func:`patch_moment`,
:func:`conv2d_moments` (the mean and covariance of a whole conv layer's output, docs/moments.md),
:func:`backends`, the errors :class:`ShapeError` and :class:`BackendError`, the warning
:class:`ChunkWarning` (dask arrays, docs/dask.md), and :class:`Backend` /
:func:`register_backend` for third-party backends.

Importing convcov imports numpy and nothing else heavy: no torch, CuPy, numba or dask.
"""

from . import backends  # callable: convcov.backends() lists the backends
from ._errors import BackendError, ChunkWarning, ShapeError
from ._frontend import accumulate, patch_moment
from ._registry import Backend, BackendInfo
from ._registry import register as register_backend
from .moments import conv2d_moments

__version__ = "0.1.0"


__all__ = ["accumulate", "patch_moment", "conv2d_moments", "backends", "Backend", "BackendInfo",
           "BackendError", "ChunkWarning", "ShapeError", "register_backend", "__version__"]
