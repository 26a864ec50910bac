"""convcov: the weight-noise term of a 2-D convolution's output covariance, fast, for the
arrays you hold (numpy, torch, CuPy, numba).

Public API (SPEC.md section 2): :func:`accumulate`, :func:`patch_moment`,
:func:`backends`, the errors :class:`ShapeError` and :class:`BackendError`, and
:class:`Backend` / :func:`register_backend` for third-party backends.

Importing convcov imports numpy and nothing else heavy: no torch, CuPy or numba.
"""

from . import backends  # callable: convcov.backends() lists the backends
from ._errors import BackendError, ShapeError
from ._frontend import accumulate, patch_moment
from ._registry import Backend, BackendInfo
from ._registry import register as register_backend

__version__ = "0.1.0"


__all__ = ["accumulate", "patch_moment", "backends", "Backend", "BackendInfo",
           "BackendError", "ShapeError", "register_backend", "__version__"]
