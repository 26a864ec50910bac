"""Test helpers: arrays of every kind, the literal-loop ground truth, and tolerances.

* :func:`make` turns a float64 numpy array into an array of a given kind (numpy, torch
  CPU/CUDA, cupy, numba device array), dtype and memory layout (contiguous, permuted
  storage, or a strided slice of a larger buffer), so backends see real-world strides.
* :func:`to_f64` brings any of them back as a float64 numpy array.
* :func:`op_loops` is the seed's ``op_slow`` generalised to stride, padding, dilation and
  groups, written as literal loops in float64: the ground truth on tiny shapes.
* :func:`tolerance` is the standard forward error bound of a floating-point sum.
* :func:`host_build` builds CUDA C++ source on the host as C++ (the kernels' host tests).
"""

from __future__ import annotations

import importlib.util
import os
import threading

import numpy as np

SIM = os.environ.get("NUMBA_ENABLE_CUDASIM") == "1"
HAS_TORCH = importlib.util.find_spec("torch") is not None


def torch_cuda() -> bool:
    if not HAS_TORCH:
        return False
    import torch

    return torch.cuda.is_available()


def has_cupy_gpu() -> bool:
    if importlib.util.find_spec("cupy") is None:
        return False
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


def kinds_for(device: str) -> list[str]:
    """Array kinds to test a backend of this device kind with, here."""
    if device == "cpu":
        return ["numpy"] + (["torch"] if HAS_TORCH else [])
    kinds = []
    if torch_cuda():
        kinds.append("torch_cuda")
    if has_cupy_gpu():
        kinds.append("cupy")
    if not SIM and kinds and importlib.util.find_spec("numba_cuda") is not None:
        kinds.append("numba")
    return kinds


def _layout_view(a: np.ndarray, layout: str, rng) -> tuple[np.ndarray, tuple]:
    """(base array, recipe) such that applying the recipe to base gives an array equal to a."""
    if layout == "contiguous" or a.ndim == 0:
        return a.copy(), ()
    if layout == "permuted":
        perm = tuple(rng.permutation(a.ndim))
        base = np.ascontiguousarray(a.transpose(perm))
        return base, ("permute", tuple(np.argsort(perm)))
    if layout == "broadcast":  # the first element along axis 0 for all: a zero stride
        return a[:1].copy(), ("broadcast", a.shape)
    if layout == "reversed":  # one axis backwards: a negative stride (numpy and CuPy)
        axis = int(rng.integers(a.ndim))
        index = [slice(None)] * a.ndim
        index[axis] = slice(None, None, -1)
        return np.ascontiguousarray(a[tuple(index)]), ("step", tuple(index))
    # "strided": every second element along one axis of a larger buffer
    axis = int(rng.integers(a.ndim))
    shape = list(a.shape)
    shape[axis] *= 2
    base = np.zeros(shape, a.dtype)
    index = [slice(None)] * a.ndim
    index[axis] = slice(None, None, 2)
    base[tuple(index)] = a
    return base, ("step", tuple(index))


def make(a: np.ndarray, kind: str, dtype: str, layout: str = "contiguous", rng=None):
    """Array of ``kind`` / ``dtype`` holding ``a`` (rounded to dtype), with ``layout``.
    ("broadcast" holds ``a``'s first slice along axis 0 in every slice: other values, read
    back with to_f64 as every test does.)"""
    rng = rng or np.random.default_rng(0)
    base, recipe = _layout_view(np.asarray(a, np.float64), layout, rng)
    if kind == "numpy":
        if dtype == "bfloat16":
            raise ValueError("numpy has no bfloat16")
        x = base.astype(dtype)
    elif kind in ("torch", "torch_cuda"):
        import torch

        x = torch.from_numpy(base).to(getattr(torch, dtype))
        if kind == "torch_cuda":
            x = x.cuda()
    elif kind == "cupy":
        import cupy

        x = cupy.asarray(base.astype(dtype))
    elif kind == "numba":
        from numba import cuda

        if recipe and recipe[0] == "permute":  # numba device arrays only transpose 2-D
            base, recipe = np.asarray(a, np.float64), ()
        x = cuda.to_device(np.ascontiguousarray(base.astype(dtype)))
    else:
        raise ValueError(kind)
    if recipe and recipe[0] == "broadcast":
        if kind.startswith("torch"):
            x = x.expand(*recipe[1])
        else:
            x = (np if kind == "numpy" else __import__("cupy")).broadcast_to(x, recipe[1])
    elif recipe and recipe[0] == "permute":
        x = x.permute(*recipe[1]) if kind.startswith("torch") else x.transpose(recipe[1])
    elif recipe and recipe[0] == "step":
        x = x[recipe[1]]
    return x


def to_f64(x) -> np.ndarray:
    """A float64 numpy *copy* (never a view: tests compare before and after)."""
    if isinstance(x, np.ndarray):
        return x.astype(np.float64)  # astype copies
    mod = type(x).__module__.split(".")[0]
    if mod == "torch":
        return np.array(x.detach().cpu().double().numpy(), copy=True)
    if mod == "cupy":
        import cupy

        return cupy.asnumpy(x).astype(np.float64)
    return np.asarray(x.copy_to_host(), np.float64)


def op_loops(out, gamma, mu, c, kh, kw, stride=(1, 1), padding=(0, 0), dilation=(1, 1),
             groups=1):
    """The seed's op_slow as literal float64 loops, with stride/padding/dilation/groups.

    ``out`` full (7-d) or diagonal (6-d); ``gamma`` full, diagonal or None; ``c`` (Co,).
    Returns a new array; terms with a position in the padding are skipped.
    """
    out = np.array(out, np.float64)
    B, Ci, H, W = mu.shape
    Co = out.shape[1]
    Ho, Wo = out.shape[2], out.shape[3]
    (sh, sw), (ph, pw), (dh, dw) = stride, padding, dilation
    full_out = out.ndim == 7
    per_g, cg = Co // groups, Ci // groups
    for b in range(B):
        for c0 in range(Co):
            g = c0 // per_g
            for i0 in range(Ho):
                for j0 in range(Wo):
                    for i1 in range(Ho):
                        for j1 in range(Wo):
                            s = 0.0
                            for ci in range(g * cg, (g + 1) * cg):
                                for ii in range(kh):
                                    for ji in range(kw):
                                        x0, y0 = i0 * sh + ii * dh - ph, j0 * sw + ji * dw - pw
                                        x1, y1 = i1 * sh + ii * dh - ph, j1 * sw + ji * dw - pw
                                        if not (0 <= x0 < H and 0 <= y0 < W
                                                and 0 <= x1 < H and 0 <= y1 < W):
                                            continue
                                        s += mu[b, ci, x0, y0] * mu[b, ci, x1, y1]
                                        if gamma is not None:
                                            s += (gamma[b, ci, x0, y0, ci, x1, y1]
                                                  if gamma.ndim == 7
                                                  else gamma[b, ci, x0, y0, x1, y1])
                            idx = ((b, c0, i0, j0, c0, i1, j1) if full_out
                                   else (b, c0, i0, j0, i1, j1))
                            out[idx] += c[c0] * s
    return out


#: Unit roundoff of each dtype.
UNIT = {"float16": 2.0**-11, "bfloat16": 2.0**-8, "float32": 2.0**-24, "float64": 2.0**-53}
#: Half the smallest subnormal of each dtype: the absolute error of rounding below its
#: normal range, where the relative bound UNIT no longer holds.
TINY = {"float16": 2.0**-25, "bfloat16": 2.0**-134, "float32": 2.0**-150, "float64": 0.0}


def tolerance(bound: np.ndarray, n_terms: int, acc: str, out_dtype: str) -> np.ndarray:
    """Forward error bound of ``round_out(out0 + sum of n_terms products)``.

    ``bound`` is the same sum on absolute values (|out0| + |c| * S(|gamma|, |mu|)). A sum of
    n terms accumulated in ``acc`` is off by at most about n * u_acc * bound; rounding into
    ``out`` adds u_out * |result| <= u_out * bound. The factor 2 covers products and FMA.
    Each rounding below a dtype's normal range is off by up to TINY absolutely instead.
    """
    return ((UNIT[out_dtype] + 2 * (n_terms + 2) * UNIT[acc]) * bound
            + TINY[out_dtype] + 2 * (n_terms + 2) * TINY[acc] + 1e-300)


class FakeCudaArray:
    """Looks like a CUDA array (``__cuda_array_interface__``), points nowhere: what
    validation and dispatch see of one, on machines without a GPU."""

    def __init__(self, shape, typestr="<f4", ptr=0x7F0000000000, stream=None):
        self.__cuda_array_interface__ = {"shape": shape, "typestr": typestr,
                                         "data": (ptr, False), "version": 3, "strides": None,
                                         "stream": stream}


def at_once(n: int, work) -> None:
    """Run ``work(i, start)`` in ``n`` threads, i = 0 .. n-1; ``start()`` returns once every
    thread has called it, so the calls that follow overlap. Fails, in the caller's thread,
    with what any thread raised."""
    barrier, errors = threading.Barrier(n), []

    def run(i):
        try:
            work(i, barrier.wait)
        except BaseException as exc:  # reported below, in the caller's thread
            barrier.abort()  # no thread waits for one that has failed
            errors.append(f"thread {i}: {exc!r}")

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors


def beside_a_capture(capture, work, timeout: float = 300) -> list:
    """Run ``work()`` in this thread while another thread runs ``capture(hold)``: the other
    thread begins a CUDA graph capture, calls ``hold()`` (which returns once ``work`` is
    done), and ends its capture. The exceptions the capturing thread raised, for the
    caller to check (an invalidated capture raises when it ends)."""
    capturing, done, errors = threading.Event(), threading.Event(), []

    def hold():
        capturing.set()
        done.wait(timeout)

    def other():
        try:
            capture(hold)
        except Exception as exc:  # reported to the caller
            errors.append(exc)
        finally:
            capturing.set()

    t = threading.Thread(target=other)
    t.start()
    try:
        assert capturing.wait(60)
        work()
    finally:
        done.set()
        t.join(timeout)
    return errors


def check_absent_terms_in_the_backward(backend: str) -> None:
    """docs/autograd.md's example: a term with a position in the padding is absent from S,
    not 0 * value, so a NaN in grad_S reaches only the inputs that S[p, q] really depends
    on. One row, kernel 3, padding 1: S[0, 2] is mu[0] * mu[2] (offset 1) alone; offset 2
    pairs mu[1] with the padding, so mu[1] must not see that NaN."""
    from convcov import _frontend

    mu = np.array([[[[1.0, 2.0, 3.0]]]])
    grad_S = np.ones((1, 1, 1, 3, 1, 3))
    grad_S[0, 0, 0, 0, 0, 2] = np.nan
    grad_mu, grad_gamma = np.empty_like(mu), np.empty((1, 1, 1, 3, 1, 3))
    _frontend.patch_moment_vjp(grad_S, mu, (1, 3), grad_gamma=grad_gamma, grad_mu=grad_mu,
                               padding=(0, 1), backend=backend)
    np.testing.assert_array_equal(np.isnan(grad_mu.ravel()), [True, False, True])
    nan = np.zeros((3, 3), bool)
    nan[0, 2] = True
    np.testing.assert_array_equal(np.isnan(grad_gamma.reshape(3, 3)), nan)


def host_build(directory, source: str):
    """CUDA C++ ``source`` (its host prelude first) built on the host as a C++ shared library
    in ``directory`` (a ``ctypes.CDLL``), or a skip where there is no C++ compiler."""
    import ctypes
    import shutil
    import subprocess

    import pytest

    cxx = shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        pytest.skip("no C++ compiler for the host build of the CUDA source")
    (directory / "k.cpp").write_text(source)
    subprocess.run([cxx, "-O1", "-std=c++14", "-shared", "-fPIC", "-w", "-o",
                    str(directory / "k.so"), str(directory / "k.cpp")], check=True)
    return ctypes.CDLL(str(directory / "k.so"))
