"""Compile numba_cuda's kernels for a real GPU (sm_90, the H200) on a machine without one.

Run as a script by tests/test_numba_cuda.py::test_every_kernel_compiles_for_the_gpu, in a
process of its own without Numba's CUDA simulator (CI runs the kernels under the
simulator, which executes their Python and never types or compiles them). Numba asks
the current device for its compute capability while it compiles; this pretends an sm_90
one. Each kernel variant of :func:`variants`
(every element type at every pointer of every kernel, with each accumulation dtype and
vector width the plans pair it with; ``--all``: every variant of :func:`requests`, all
the plans can ask for) goes through Numba and NVVM to PTX and through nvJitLink (ptxas)
to sm_90 code. Prints one line a variant and a count. Exits 1 on the first failure, and
77 when the compilers are not installed or this numba-cuda cannot compile without a
driver (the test then skips and says why). Importing this module does nothing: pytest's
doctest collection imports every module under tests/.
"""

import itertools
import sys

#: The kernels' pointer element types: the four storage dtypes, bfloat16 as its uint16 bits.
TYPES = ("float16", "uint16", "float32", "float64")
#: Vector widths for a first pointer of each type: V elements in one access of at most
#: 16 bytes (convcov._arrays.vector_width), or one at a time.
WIDTHS = {"float16": (1, 2, 4, 8), "uint16": (1, 2, 4, 8), "float32": (1, 2, 4),
          "float64": (1, 2)}
#: Each kernel's pointers, in _signature's order (fused_t reads T, not gamma and mu).
POINTERS = {"gsum": ("gamma", "mu"), "fused": ("out", "gamma", "mu", "c"),
            "fused_t": ("out", "c"), "stream": ("out", "c"),
            "planes": ("out", "gamma", "mu", "c"), "planes_vg": ("out", "gamma", "mu", "c"),
            "vjp_gamma": ("grad_S", "grad_gamma"), "vjp_mu": ("grad_S", "mu", "grad_mu")}


def requests():
    """Every (kernel, pointer element types, accumulation dtype, V) the plans can ask
    numba_cuda._kernel for, derived from their rules (tests/test_numba_cuda.py's
    test_compiled_variants_cover_every_request checks it against what the plans ask for):

    * each array of a call (out, gamma, mu, c; grad_S, mu, grad_gamma, grad_mu) in any of
      the four dtypes; an absent gamma reads as mu's type, a number c as out's; where the
      fused kernel writes S, out and c are the accumulation type;
    * sums in float64 when any array of the call is float64, else in float32, or in
      float64 when c is a number beyond float32's range. The kernels other than fused see
      some of the call's arrays only, so any of their type mixes can meet float64 sums;
      fused sees all four, so with none float64 only a number c (out's type) can;
    * V: gamma's vector width for gsum, out's (or S's) for fused, fused_t, stream and
      planes, 1 for the backward; planes_vg (16-byte vectors of gamma and mu) only where
      gamma and mu have out's dtype."""
    out = []
    for name, pointers in POINTERS.items():
        for elems in itertools.product(TYPES, repeat=len(pointers)):
            if name == "planes_vg" and elems[1:3] != elems[:1] * 2:
                continue  # (gamma and mu vectors only where they have out's dtype)
            accs = ("float64",) if "float64" in elems else ("float32", "float64")
            if name in ("fused", "planes", "planes_vg") and "float64" not in elems \
                    and elems[3] != elems[0]:
                accs = ("float32",)
            for acc in accs:
                widths = (1,) if name.startswith("vjp") else WIDTHS[elems[0]]
                out += [(name, elems, acc, V) for V in widths]
    return out


def variants(every=False):
    """The variants compiled (``every``: all of requests()): for each kernel, accumulation
    dtype and V, every element type the plans put at each pointer, uniform mixes first
    (the usual calls), then the fewest mixed ones that cover the rest. A pointer's
    element type reaches the arithmetic only through its load or store, which converts
    to or from the accumulation type (_to_acc, _store, the vector loads at width V), so
    a kernel compiles for a mix of element types when it does for each of them at that
    accumulation dtype and width; compiling every mix takes about six times as long."""
    reqs = requests()
    if every:
        return reqs

    def covers(r):  # (pointer, element type) pairs
        return set(enumerate(r[1]))

    out = []
    for key in dict.fromkeys((name, acc, V) for name, _, acc, V in reqs):
        rows = sorted((r for r in reqs if (r[0], r[2], r[3]) == key),
                      key=lambda r: len(set(r[1])))  # stable: uniform mixes first
        need = set().union(*map(covers, rows))
        while need:
            best = max(rows, key=lambda r: len(covers(r) & need))  # the first of the best
            out.append(best)
            need -= covers(best)
    return out


def main(argv=()):
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
    from numba.cuda.cudadrv.error import CudaSupportError

    from convcov.backends import numba_cuda as nc

    assert not nc.SIM, "run without NUMBA_ENABLE_CUDASIM"
    n = 0
    for name, elems, acc, V in variants(every="--all" in argv):
        label = f"{name} {elems} {acc} V={V}"
        try:
            ptx, _ = cuda.compile_ptx(nc._kernel_function(name, elems, acc, V),
                                      nc._signature(name, elems, acc), cc=(9, 0),
                                      launch_bounds=nc._launch_bounds(name))
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
    sys.exit(main(sys.argv[1:]))
