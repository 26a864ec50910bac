"""The backend registry and the rules for choosing a backend (SPEC section 4).

Owns: what a backend is (:class:`Backend`), the built-in backends (imported lazily, by
module path), third-party backends from the ``convcov.backends`` entry-point group,
``convcov.backends()`` and the selection order:

    ``backend=`` argument  >  ``CONVCOV_BACKEND`` (read per call)  >  automatic.

Both the argument and the variable may be one name or a comma-separated preference list:
the first backend that is available and runs on the arrays' device and dtypes wins.
Automatic order: ``cupy, numba_cuda`` for CUDA arrays, ``numba, numpy`` for host arrays.

It must not import a backend's module (and so numba, cupy, numba.cuda) before a backend
is needed: ``import convcov`` stays cheap and framework-free.
"""

from __future__ import annotations

import importlib
import os
import threading
import warnings
from typing import NamedTuple

from ._errors import BackendError

#: Built-in backends, by name -> module that defines ``backend``. One name everywhere.
BUILTIN = {
    "numpy": "convcov.backends.numpy",
    "numba": "convcov.backends.numba",
    "numba_cuda": "convcov.backends.numba_cuda",
    "cupy": "convcov.backends.cupy",
}

#: Automatic preference, by the arrays' device kind.
AUTO = {"cuda": ("cupy", "numba_cuda"), "cpu": ("numba", "numpy")}

ENV_VAR = "CONVCOV_BACKEND"


class Backend:
    """Base class of a backend. A backend computes; it never validates.

    Subclasses set ``name``, ``device`` ("cpu" or "cuda") and ``dtypes`` (the dtype
    names of SPEC section 2 it computes on), override :meth:`accumulate`, and override
    :meth:`_probe` when they can be missing (return the reason, or None when usable).

    ``accumulate(problem)`` receives a checked, normalised :class:`convcov._frontend.Problem`
    and adds ``c[c0] * S[b, g(c0)]`` into the channel-diagonal of ``problem.out``.
    Host backends get numpy views of host arrays; CUDA backends get the user's objects
    together with their :class:`convcov._arrays.ArrayInfo` (pointer, strides, device).
    """

    name: str = ""
    device: str = "cpu"
    dtypes: frozenset = frozenset({"float16", "float32", "float64"})

    _reason: str | None
    _probed = False

    def _probe(self) -> str | None:
        return None

    def unavailable_reason(self) -> str | None:
        """Why this backend cannot run here (None when it can). Probed once."""
        if not self._probed:
            try:
                self._reason = self._probe()
            except Exception as exc:  # a probe that raises is a backend that cannot run
                self._reason = f"its probe failed: {exc!r}"
            self._probed = True
        return self._reason

    def accumulate(self, problem) -> None:  # pragma: no cover - interface
        raise NotImplementedError

    def accumulate_apart(self, problem, source) -> None:
        """``problem.out = source + c[c0] * S`` on its channel diagonal, ``source`` (an
        array of out's kind, shape, dtype and strides, diagonal layout, its rows ``(i1,
        j1)`` contiguous) only read: for callers that may not write their ``out`` (dask's
        tasks). The default copies source into out and accumulates; a backend that can
        read one array and write another overrides it and saves the copy."""
        problem.out[...] = source
        self.accumulate(problem)

    def bind(self, problem):
        """A launcher for later calls with ``problem``'s signature, or None (the default).

        The front end's fast path for torch tensors and NumPy arrays
        (``_frontend._torch_fast``, ``_numpy_fast``) calls,
        for a signature that passed validation and ran once, ``run(out, gamma, mu, c,
        out_ptr, gamma_ptr, mu_ptr, c_ptr, c_value)``: the user's objects, their addresses
        (0 for an absent gamma or a c that is a number) and ``c_value``, c as a float when
        it is a number. It must do what ``accumulate`` does for a Problem that differs
        from ``problem`` only in those.
        """
        return None

    def patch_moment_vjp(self, adjoint) -> None:
        """The backward of ``patch_moment`` (optional; docs/autograd.md has the contract).

        ``adjoint`` is a checked :class:`convcov._frontend.Adjoint`: given ``grad_S``
        (the gradient of ``S``), overwrite ``adjoint.grad_mu`` and the channel-diagonal of
        ``adjoint.grad_gamma`` (each may be None: not wanted) with the gradients of mu and
        of gamma. Backends that have no backward keep this default; the front end then
        picks the next preference that has one, or raises this error.
        """
        raise BackendError(f"backend {self.name!r} has no backward (patch_moment_vjp) yet; "
                           "gradients need a backend that has one (numpy has)")

    def __repr__(self):
        return f"<convcov backend {self.name!r} ({self.device})>"


class BackendInfo(NamedTuple):
    """One row of ``convcov.backends()``."""

    name: str
    device: str
    available: bool
    reason: str  # why not available; "" when available


class _Unloadable(Backend):
    """Stands in for a backend whose module or entry point failed to import."""

    def __init__(self, name, device, reason):
        self.name, self.device, self._reason, self._probed = name, device, reason, True


_lock = threading.Lock()
_loaded: dict[str, Backend] = {}
_extra: dict[str, Backend] = {}  # registered at run time or through entry points
_entry_points_loaded = False

_BUILTIN_DEVICE = {"numpy": "cpu", "numba": "cpu", "numba_cuda": "cuda", "cupy": "cuda"}


#: Bumped whenever the set of backends changes: the front end's fast path keys on it.
generation = 0


def _changed() -> None:
    global generation
    _choices.clear()
    generation += 1


def register(backend: Backend) -> None:
    """Add (or replace) a backend under ``backend.name``."""
    if not isinstance(backend, Backend):
        raise TypeError(f"register: expected a convcov.Backend instance; got {backend!r}")
    if backend.device not in AUTO:
        raise ValueError(
            f"register: backend.device must be 'cpu' or 'cuda'; got {backend.device!r}")
    with _lock:
        _extra[backend.name] = backend
        _changed()


def unregister(name: str) -> None:
    with _lock:
        _extra.pop(name, None)
        _changed()


def _load_entry_points() -> None:
    global _entry_points_loaded
    if _entry_points_loaded:
        return
    from importlib.metadata import entry_points

    for ep in entry_points(group="convcov.backends"):
        if ep.name in BUILTIN:
            # A built-in's name always means the built-in: an installed package must not
            # change what "numpy" computes, and get() answers built-ins before it loads
            # entry points. (register_backend, called on purpose, may replace one.)
            warnings.warn(f"convcov: entry point {ep.name!r} = {ep.value!r} ignored: "
                          f"{ep.name!r} is a built-in backend", RuntimeWarning, stacklevel=2)
            continue
        try:
            obj = ep.load()
            backend = obj() if isinstance(obj, type) else obj
            if not isinstance(backend, Backend):
                raise TypeError(f"entry point {ep.value!r} is not a convcov.Backend")
        except Exception as exc:  # a broken plug-in must not break convcov
            backend = _Unloadable(ep.name, "cpu", f"entry point failed to load: {exc!r}")
        _extra.setdefault(ep.name, backend)
    _entry_points_loaded = True
    _changed()


def names() -> list[str]:
    _load_entry_points()
    return list(BUILTIN) + [n for n in _extra if n not in BUILTIN]


def get(name: str) -> Backend:
    """The backend called ``name``; BackendError listing the valid names if unknown."""
    if name in _extra:
        return _extra[name]
    b = _loaded.get(name)
    if b is not None:
        return b
    if name in BUILTIN:
        with _lock:
            if name not in _loaded:
                try:
                    _loaded[name] = importlib.import_module(BUILTIN[name]).backend
                except Exception as exc:  # listing backends must survive a broken one
                    _loaded[name] = _Unloadable(name, _BUILTIN_DEVICE[name],
                                                f"cannot import: {exc!r}")
            return _loaded[name]
    _load_entry_points()
    if name in _extra:
        return _extra[name]
    raise BackendError(f"unknown backend {name!r}; valid backends: {', '.join(names())}")


def listing() -> list[BackendInfo]:
    rows = []
    for n in names():
        b = get(n)
        reason = b.unavailable_reason()
        rows.append(BackendInfo(n, b.device, reason is None, reason or ""))
    return rows


def _parse(value, source) -> list[str]:
    if isinstance(value, str):
        prefs = [v.strip() for v in value.split(",") if v.strip()]
    elif isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value):
        prefs = list(value)
    else:
        raise TypeError(f"{source}: expected a backend name or a list of names; got {value!r}")
    if not prefs:
        raise BackendError(f"{source} is empty; valid backends: {', '.join(names())}")
    return prefs


def _refusal(b: Backend, device: str, dtypes: frozenset) -> str | None:
    """Why backend ``b`` cannot take this call (None when it can)."""
    if b.device != device:
        # built-ins by their declared device, so an error message imports nothing
        ok = [n for n in names()
              if (_BUILTIN_DEVICE[n] if n in BUILTIN else get(n).device) == device]
        return (f"{b.name}: runs on {b.device} arrays, these are {device} arrays "
                f"(backends for {device} arrays: {', '.join(ok)})")
    reason = b.unavailable_reason()
    if reason is not None:
        return f"{b.name}: {reason}"
    missing = sorted(dtypes - b.dtypes)
    if missing:
        return f"{b.name}: does not compute on {', '.join(missing)}"
    return None


_choices: dict = {}  # (request, env value, device, dtypes) -> Backend; cleared on register


def select(requested, device: str, dtypes: frozenset) -> Backend:
    """Pick the backend for one call (see the module docstring for the order).

    The choice is cached per (request, CONVCOV_BACKEND value, device, dtypes): availability
    is probed once per process anyway, and small calls cannot afford the search.
    """
    # A list is checked before the cache: a set or a dict must not pass for the list of
    # its names.
    request = (requested if requested is None or isinstance(requested, str)
               else tuple(_parse(requested, "backend=")))
    key = (request, os.environ.get(ENV_VAR), device, dtypes)
    b = _choices.get(key)
    if b is None:
        b = _choices[key] = _select(requested, device, dtypes)
    return b


def _select(requested, device: str, dtypes: frozenset) -> Backend:
    if requested is not None:
        prefs, source = _parse(requested, "backend="), "backend="
    elif os.environ.get(ENV_VAR, "").strip():
        prefs, source = _parse(os.environ[ENV_VAR], ENV_VAR), ENV_VAR
    else:
        prefs, source = list(AUTO[device]), "automatic choice"
    unknown = [n for n in prefs if n not in _extra and n not in BUILTIN]
    if unknown and set(unknown) - set(names()):
        # A typo is an error even when an earlier name would do: it would hide later.
        bad = [n for n in unknown if n not in names()]
        raise BackendError(f"unknown backend {bad[0]!r} in {source}; valid backends: "
                           f"{', '.join(names())}")
    refusals = []
    for n in prefs:
        b = get(n)
        why = _refusal(b, device, dtypes)
        if why is None:
            return b
        refusals.append(why)
    raise BackendError(f"no backend from {source} ({', '.join(prefs)}) can run this call: "
                       + "; ".join(refusals))
