"""Programmatic dependent launch: the launch of a plan's later kernels that lets each start
while the kernel ahead of it on the stream drains (compute capability 9.0 and later).

Owns the switch (``ENABLED``), the test of a device, and the launch itself:
``cuLaunchKernelEx`` through cuda.bindings (which numba-cuda brings) with CUDA's
programmatic stream serialization attribute. The ``numba_cuda`` backend uses it for the
second and third kernels of a three-launch plan (S from T, then out from S); the first
kernel of a call is launched plainly, so it starts only after everything queued before
the call has finished. (The ``cupy`` backend does not: its kernels gained nothing from it
on the H200, docs/cupy.md.)

The kernels hold the other half of the contract:
* a kernel launched this way executes ``griddepcontrol.wait`` before its first load of
  global memory; the wait returns once the kernel ahead has completed and its memory
  (and, through it, the memory of all work before it) is visible; a no-op in a plain
  launch. Loads issued before the wait are not covered: an update that loaded its first
  ``out`` before the wait read stale values after a copy into ``out`` on the same stream
  (H200, 2026-11-30, tests/test_cupy.py::test_runs_on_the_current_torch_stream);
* a kernel whose follower may start early executes ``griddepcontrol.launch_dependents``:
  once all of its blocks have (or have exited), the follower's blocks may be scheduled
  onto the multiprocessors it leaves free.

Nothing waits on a kernel behind it, so the early blocks cannot deadlock: a block waits
only for a grid whose blocks have all started. Without cuda.bindings or on an older
device the launches are plain, and the same kernels give the same bits.
"""

from __future__ import annotations

import threading

#: Launch a plan's later kernels as programmatic dependents where the device and the
#: installed driver binding allow; False: plain launches (an A/B knob, read when a plan
#: is made).
ENABLED = True

_drv = None  # cuda.bindings.driver, imported by the first usable() that needs it


def usable(cc_major: int) -> bool:
    """Whether a plan for a device of compute capability ``cc_major``.x launches its later
    kernels as programmatic dependents."""
    global _drv
    if not ENABLED or cc_major < 9:
        return False
    if _drv is None:
        try:
            from cuda.bindings import driver
        except Exception:  # not installed: plain launches
            return False
        _drv = driver
    return True


class Launcher:
    """``cuLaunchKernelEx`` of one function (the driver's handle, as ``cuLaunchKernel``
    takes it), grid and block as a programmatic dependent of the kernel ahead of it; ``what``
    names the kernel in an error. Each thread keeps its own launch configuration, whose
    stream is set per call (the driver copies it at launch)."""

    __slots__ = ("func", "grid", "block", "what", "tls")

    def __init__(self, func, grid: int, block: int, what: str = "a kernel"):
        self.func, self.grid, self.block, self.what = func, grid, block, what
        self.tls = threading.local()

    def _config(self):
        attr = _drv.CUlaunchAttribute()
        attr.id = _drv.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
        attr.value.programmaticStreamSerializationAllowed = 1
        cfg = _drv.CUlaunchConfig()
        cfg.gridDimX, cfg.gridDimY, cfg.gridDimZ = self.grid, 1, 1
        cfg.blockDimX, cfg.blockDimY, cfg.blockDimZ = self.block, 1, 1
        cfg.sharedMemBytes = 0
        cfg.attrs = [attr]
        cfg.numAttrs = 1
        return cfg

    def __call__(self, stream, params: int) -> None:
        """Launch on ``stream`` (a raw handle or the driver's CUstream) with ``params``, the
        address of the kernel's array of parameter addresses."""
        try:
            cfg = self.tls.cfg
        except AttributeError:  # this thread's first launch of it
            cfg = self.tls.cfg = self._config()
        cfg.hStream = stream
        err, = _drv.cuLaunchKernelEx(cfg, self.func, params, 0)
        if err != _drv.CUresult.CUDA_SUCCESS:
            raise RuntimeError(f"launching {self.what} failed: {err!r}")
