"""The built-in backends, one small module each; the module name is the backend's name.

Each module defines ``backend``, an instance of :class:`convcov.Backend`, and imports its
heavy library (numba, CuPy, numba.cuda) only when the module is imported, which the
registry does on first use. A backend receives a validated :class:`convcov._frontend.Problem`
and computes; it never re-validates, never copies ``out`` or ``gamma``.

This package is also the function ``convcov.backends()`` of SPEC section 2: Python binds a
package's submodule as an attribute of its parent on import, so a plain function called
``backends`` in ``convcov/__init__.py`` would be replaced by this package the moment a
backend module loads. Making the package callable keeps one name for both.
"""

import sys
import types


class _CallablePackage(types.ModuleType):
    def __call__(self):
        """Every known backend: ``(name, device, available, reason)``, in selection order.

        Probing a backend imports its library (numba, CuPy, numba.cuda), so this is
        slower than ``import convcov`` itself.
        """
        from .._registry import listing

        return listing()


sys.modules[__name__].__class__ = _CallablePackage
