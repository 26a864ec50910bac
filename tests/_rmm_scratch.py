"""numba_cuda's scratch under an external memory manager (RMM's Numba plugin, on a pool).

Run by tests/test_numba_cuda.py in a process of its own: Numba's memory manager must be
chosen before its first context. Exit 77 (the test skips) when RMM or a GPU is missing.

The plugin interface has no stream: RMM's plugin puts a freed block back into its pool
on its own stream, unordered with the stream the call's kernels run on. numba_cuda keeps
a generic array call's scratch alive until an event recorded after its launches has
completed (``numba_cuda._hold``), without waiting for it. This run checks that: Numba
device arrays whose interface names a non-blocking stream, the three-launch path (S and
T in scratch from Numba's allocator), and that stream held by a spin kernel, so the call
returns while its kernels are still queued. Then a block of the scratch's size is taken
from the plugin on the legacy default stream and filled, as any other code of the
program could. Had the scratch been freed, RMM's pool would give that block out again,
and the kernels would write their T and S into it. The filled block must come through
intact, out must match the numpy reference, and once the kernels have run a later
call's release drops the scratch. ``--no-guard`` drops the scratch as the call returns
instead, to show that this check catches the race.
"""

from __future__ import annotations

import sys

import numpy as np


def main(guard: bool) -> int:
    try:
        import rmm
        from rmm.allocators.numba import RMMNumbaManager
    except Exception as exc:
        print(f"RMM is not installed here ({exc!r})")
        return 77
    from numba import cuda

    if not cuda.is_available():
        print("no CUDA device")
        return 77
    rmm.reinitialize(pool_allocator=True, initial_pool_size=1 << 28)
    cuda.set_memory_manager(RMMNumbaManager)

    import convcov
    from convcov.backends import numba_cuda as mod

    from convcov.backends import _plan

    _plan.STREAM_BYTES = 0  # two launches: S in scratch
    if not guard:
        mod._hold = lambda dev, owner, stream: None  # the owner goes as the call returns
    scratch = []
    workspace = mod._workspace

    def recording(kind, dev, n, acc, *streams):
        owner, ptr = workspace(kind, dev, n, acc, *streams)
        scratch.append((ptr, max(n, 1), acc))
        return owner, ptr

    mod._workspace = recording

    from cuda.bindings import driver as drv

    err, handle = drv.cuStreamCreate(drv.CUstream_flags.CU_STREAM_NON_BLOCKING.value)
    assert err == drv.CUresult.CUDA_SUCCESS, err
    side = cuda.external_stream(int(handle))

    @cuda.jit
    def spin(rounds):
        for _ in range(rounds):
            cuda.nanosleep(1_000_000)

    rng = np.random.default_rng(5)
    B, Ci, Co, H, k = 2, 4, 4, 10, 3
    Ho = H - k + 1
    out = rng.standard_normal((B, Co, Ho, Ho, Ho, Ho)).astype(np.float32)
    gamma = rng.standard_normal((B, Ci, H, H, H, H)).astype(np.float32)
    mu = rng.standard_normal((B, Ci, H, H)).astype(np.float32)
    c = rng.standard_normal(Co).astype(np.float32)
    ref = convcov.accumulate(out.astype(np.float64), gamma.astype(np.float64),
                             mu.astype(np.float64), c.astype(np.float64), k,
                             backend="numpy")
    d = [cuda.to_device(x, stream=side) for x in (out, gamma, mu, c)]
    # Compiled first (a kernel compiled inside the timed call would outlast the spin).
    warm = cuda.to_device(out, stream=side)
    convcov.accumulate(warm, *d[1:], k, backend="numba_cuda")
    spin[1, 1, side](0)
    side.synchronize()
    scratch.clear()
    spin[1, 1, side](300)  # 0.3 s or so: the call's kernels wait behind it
    convcov.accumulate(*d, k, backend="numba_cuda")
    busy = drv.cuStreamQuery(handle)[0] == drv.CUresult.CUDA_ERROR_NOT_READY
    dev = cuda.get_current_device().id
    held = len(mod._held.get(dev, ()))  # the call's scratch (the warm call's is gone)
    (ptr, n, acc), = scratch
    manager = type(cuda.current_context().memory_manager)
    assert manager is RMMNumbaManager, f"Numba's memory manager is {manager}, not RMM's"
    # Legacy default stream: does not wait for the non-blocking stream.
    other = cuda.device_array(n, dtype=acc)
    reused = other.__cuda_array_interface__["data"][0] == ptr
    fill = np.full(n, 7.0, dtype=acc)
    other.copy_to_device(fill)
    cuda.synchronize()
    intact = bool(np.array_equal(other.copy_to_host(), fill))
    got = d[0].copy_to_host().astype(np.float64)
    err = float(np.max(np.abs(got - ref)) / np.max(np.abs(ref)))
    mod._release(dev)  # what the next call does first: the kernels have run
    released = not mod._held.get(dev)
    print(f"guard {guard}: kernels queued on return {busy}, scratch held {held}, "
          f"scratch block reused {reused}, other block intact {intact}, "
          f"released once the kernels ran {released}, out max relative error {err:.2e}")
    kept = held == 1 and released if guard else True
    return 0 if intact and err < 1e-5 and kept else 1


if __name__ == "__main__":
    sys.exit(main("--no-guard" not in sys.argv[1:]))
