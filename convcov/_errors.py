"""The two exception types convcov adds to Python's own (TypeError, ValueError).

Every error is raised by the front end before anything is written, so a rejected call
leaves ``out`` bit-identical.
"""


class ShapeError(ValueError):
    """Shapes or conv parameters that disagree with each other (SPEC section 3)."""


class BackendError(RuntimeError):
    """Unknown backend, backend not installed / no device, or backend that cannot run
    on the arrays' device or dtypes."""
