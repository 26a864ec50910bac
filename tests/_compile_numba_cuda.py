"""Compile numba_cuda's kernels for a real GPU (sm_90, the H200) on a machine without one.

Run as a script by tests/test_numba_cuda.py::test_every_kernel_compiles_for_the_gpu, in a
process of its own without Numba's CUDA simulator (CI runs the kernels under the
simulator, which executes their Python and never types or compiles them). Numba asks
the current device for its compute capability while it compiles; this pretends an sm_90
one, as docs/results/scripts/numba_sass.py does. Each kernel variant the plans can ask
for goes through Numba and NVVM to PTX and through nvJitLink (ptxas) to sm_90 code.
Prints one line a variant and a count. Exits 1 on the first failure, and 77 when the
compilers are not installed or this numba-cuda cannot compile without a driver (the
test then skips and says why). Importing this module does nothing: pytest's doctest
collection imports every module under tests/.
"""

import sys


def variants():
    """(kernel, pointer element types, accumulation dtype, V) for every kernel and vector
    width the plans use, at each storage dtype and both accumulation dtypes; mixed
    element types where a plan mixes them (mu or c in another dtype)."""
    widths = {"float16": (1, 2, 4, 8), "uint16": (1, 2, 4, 8), "float32": (1, 2, 4),
              "float64": (1, 2)}
    pairs = [("float16", "float32"), ("uint16", "float32"), ("float32", "float32"),
             ("float64", "float64"), ("float16", "float64"), ("float32", "float64")]
    out = []
    for acc in ("float32", "float64"):
        out += [("sbox_walk", (), acc, kh) for kh in (0, 3, 33)] + [("sbox", (), acc, 1)]
    for t, acc in pairs:
        other = "float64" if acc == "float64" and t != "float64" else "float32"
        w = widths[t]
        out += [("gsum", (t, t), acc, v) for v in w]
        out += [(k, (t, t), acc, v) for k in ("stream", "stream_rows") for v in w]
        out += [("direct", (t, t, t, t), acc, 1)]
        if other != t:  # mu (gsum) and c (stream) in another dtype, read as that one
            out += [("gsum", (t, other), acc, v) for v in (w[0], w[-1])]
            out += [("stream", (t, other), acc, 1), ("direct", (t, other, other, other), acc, 1)]
        out += [("vjp_gamma", (acc, t), acc, 1), ("vjp_mu", (acc, t, t), acc, 1)]
    return out


def main():
    try:
        from cuda.bindings import nvjitlink
        from numba.cuda import dispatcher
    except Exception as exc:  # the test extra's numba-cuda[cu13] brings both
        print(f"compilers not installed: {exc!r}")
        return 77

    class _Sm90:
        compute_capability = (9, 0)

    dispatcher.get_current_device = lambda: _Sm90()
    from numba import cuda

    cuda.get_current_device = dispatcher.get_current_device  # _pdl's griddepcontrol asks

    from numba.cuda.cudadrv.error import CudaSupportError

    from convcov.backends import numba_cuda as nc

    assert not nc.SIM, "run without NUMBA_ENABLE_CUDASIM"
    n = 0
    for name, elems, acc, V in variants():
        label = f"{name} {elems} {acc} V={V}"
        try:
            ptx, _ = cuda.compile_ptx(nc._kernel_function(name, elems, acc, V),
                                      nc._signature(name, elems, acc), cc=(9, 0))
            opts = ["-arch=sm_90"]
            h = nvjitlink.create(len(opts), opts)
            try:
                data = ptx.encode()
                nvjitlink.add_data(h, nvjitlink.InputType.PTX, data, len(data), "k.ptx")
                nvjitlink.complete(h)
            finally:
                nvjitlink.destroy(h)
        except CudaSupportError as exc:  # no driver, and the pretended device was not asked
            print(f"this numba-cuda asks the CUDA driver while compiling, so the pretended "
                  f"sm_90 device does not work here: {exc!r}"[:400])
            return 77
        except Exception as exc:
            print(f"FAILED {label}: {exc!r}")
            return 1
        print(f"ok {label}", flush=True)
        n += 1
    print(f"compiled {n} kernels for sm_90")
    return 0


if __name__ == "__main__":
    sys.exit(main())
