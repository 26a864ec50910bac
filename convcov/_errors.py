"""The two exception types convcov adds to Python's own (TypeError, ValueError), and its
one warning.

Every error is raised by the front end before anything is written, so a rejected call
leaves ``out`` bit-identical.
"""


class ShapeError(ValueError):
    """Shapes or conv parameters that disagree with each other (SPEC section 3)."""


class BackendError(RuntimeError):
    """Unknown backend, backend not installed / no device, or backend that cannot run
    on the arrays' device or dtypes."""


class ChunkWarning(UserWarning):
    """A call on dask arrays merged chunks (a rechunk) that move more data than the
    call's largest chunk: work is split along the batch and out's channels only."""
