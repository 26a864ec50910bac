"""Compile numba_cuda's kernels for a real GPU (sm_90, the H200) on a machine without one.

Run as a script by tests/test_numba_cuda.py::test_every_kernel_compiles_for_the_gpu, in a
process of its own without Numba's CUDA simulator (CI runs the kernels under the
simulator, which executes their Python and never types or compiles them). Numba asks
the current device for its compute capability while it compiles; this pretends an sm_90
one. Each kernel variant of :func:`variants`
(every element type at every pointer of every kernel with each accumulation dtype, and
every vector width; the plane walk at each size of its ring; ``--all``: every variant of
:func:`requests`, all the plans can ask for) goes through Numba and NVVM to PTX and
through nvJitLink (ptxas)
to sm_90 code, a process a core. Prints one line a variant (with ptxas's registers and
spill stores a thread) and a count. Exits 1 on the first failure, and
77 when the compilers are not installed or this numba-cuda cannot compile without a
driver (the test then skips and says why). Importing this module does nothing: pytest's
doctest collection imports every module under tests/.
"""

import concurrent.futures
import itertools
import os
import re
import sys

from convcov.backends import _plan

#: The kernels' pointer element types: the four storage dtypes, bfloat16 as its uint16 bits.
TYPES = ("float16", "uint16", "float32", "float64")
#: Vector widths for a first pointer of each type: V elements in one access of at most
#: 16 bytes (convcov._arrays.vector_width), or one at a time; the walk's also two such
#: accesses (32 bytes: convcov.backends._plan.widen).
WIDTHS = {"float16": (1, 2, 4, 8), "uint16": (1, 2, 4, 8), "float32": (1, 2, 4),
          "float64": (1, 2)}
WALK_WIDTHS = {t: w + (2 * w[-1],) for t, w in WIDTHS.items()}
#: Each kernel's pointers, in _signature's order (walk_s: out is S, c unread: both take
#: the accumulation type; "_vg16", "_vg32": gamma and mu 16 or 32 bytes a load).
_WALK, _WALK_S = ("out", "gamma", "mu", "c"), ("S", "gamma", "mu", "c")
POINTERS = {"walk": _WALK, "walk_vg16": _WALK, "walk_vg32": _WALK, "walk_s": _WALK_S,
            "walk_s_vg16": _WALK_S, "walk_s_vg32": _WALK_S, "stream": ("out", "c"),
            "vjp_gamma": ("grad_S", "grad_gamma"), "vjp_mu": ("grad_S", "mu", "grad_mu")}


def rings(acc):
    """The plane walk's rings (KH, SH, DH) as numba_cuda._plane_name names them, for sums
    in ``acc``: every kh and dh whose ring of NS = dh (kh - 1) + 1 planes fits
    _plan.PLANE_RING registers (_plan.plane's rule; dh 1 where kh is), each SH up to NS
    (a stride past NS moves the ring as NS does), the densest ring of each size first."""
    words = 2 if acc == "float64" else 1  # 32-bit registers an element
    most = _plan.PLANE_RING // (_plan.PLANE_V * words)
    return [(kh, sh, dh) for kh in range(most, 0, -1) for dh in range(1, most + 1)
            if dh * (kh - 1) + 1 <= most and (kh > 1 or dh == 1)
            for sh in range(1, dh * (kh - 1) + 2)]


def requests():
    """Every (kernel, pointer element types, accumulation dtype, V) the plans can ask
    numba_cuda._kernel for, derived from their rules (tests/test_numba_cuda.py's
    test_compiled_variants_cover_every_request checks it against what the plans ask for):

    * each array of a call (out, gamma, mu, c; grad_S, mu, grad_gamma, grad_mu) in any of
      the four dtypes; an absent gamma reads as mu's type, a number c as out's; where the
      walk stores S (walk_s), S and c are the accumulation type;
    * sums in float64 when any array of the call is float64, else in float32, or in
      float64 when c is a number beyond float32's range. stream and the backward see some
      of the call's arrays only, so any of their type mixes can meet float64 sums; walk
      sees all four, so with none float64 only a number c (out's type) can;
    * V: out's vector width (S's for walk_s; up to 32 bytes for the walks), 1 for the
      backward; the "_vg" walks (16 or 32 bytes of gamma and mu a load) only where gamma
      and mu share a dtype, and adding into out (walk_vg...) only where that is out's;
    * the plane walk ("plane_KH_SH_DH", V _plan.PLANE_V) only where gamma and mu have
      out's dtype (c any, its sums as walk's), at each of its rings (:func:`rings`); the
      widest element types first, so that variants() compiles each size of ring with them
      (the most registers)."""
    out = []
    for o, c in itertools.product(TYPES[::-1], repeat=2):
        accs = (("float64",) if "float64" in (o, c) else ("float32", "float64") if c == o
                else ("float32",))
        out += [(f"plane_{kh}_{sh}_{dh}", (o, o, o, c), acc, _plan.PLANE_V)
                for acc in accs for kh, sh, dh in rings(acc)]
    for name, pointers in POINTERS.items():
        for elems in itertools.product(TYPES, repeat=len(pointers)):
            if "_vg" in name and elems[1] != elems[2]:
                continue
            if name.startswith("walk_vg") and elems[1] != elems[0]:
                continue
            accs = ("float64",) if "float64" in elems else ("float32", "float64")
            if name.startswith("walk_s"):
                if elems[0] != elems[3] or elems[0] not in accs:
                    continue
                accs = (elems[0],)
            elif name.startswith("walk") and "float64" not in elems and elems[3] != elems[0]:
                accs = ("float32",)
            for acc in accs:
                widths = ((1,) if name.startswith("vjp") else WALK_WIDTHS[elems[0]]
                          if name.startswith("walk") else WIDTHS[elems[0]])
                out += [(name, elems, acc, V) for V in widths]
    return out


def features(r):
    """What compiling request ``r`` checks: each pointer's element type converted to and
    from its accumulation dtype (_to_acc, _store), and out's (S's) vector access of width
    V, for its element type and for the accumulation dtype. The plane walks are one
    kernel at each size of their ring (its registers, with the accumulation dtype's): KH,
    SH and DH beyond that only set which slots S reads and where a step starts."""
    name, elems, acc, V = r
    extra = set()
    if name.startswith("plane"):
        kh, _, dh = map(int, name.split("_")[1:])
        name = "plane"
        extra = {(name, "ring", dh * (kh - 1) + 1, acc)}
    return ({(name, i, t, acc) for i, t in enumerate(elems)}
            | {(name, "out", elems[0], V), (name, "acc", acc, V)} | extra)


def variants(every=False):
    """The variants compiled (``every``: all of requests()): the fewest, found greedily
    with uniform mixes first (the usual calls), whose :func:`features` cover those of
    every request. A pointer's element type reaches the arithmetic only through its load
    or store, which converts to or from the accumulation type, so a kernel compiles for a
    mix of element types, widths and accumulation dtypes when it does for each of them;
    compiling every mix takes about twenty times as long."""
    reqs = requests()
    if every:
        return reqs
    need = set().union(*map(features, reqs))
    rows = sorted(reqs, key=lambda r: len(set(r[1])))  # stable: uniform mixes first
    out = []
    while need:
        best = max(rows, key=lambda r: len(features(r) & need))  # the first of the best
        out.append(best)
        need -= features(best)
    return out


def _compile(variant):
    """Compile one variant for sm_90 (in a worker process): ("ok", label with ptxas's
    registers and spill stores a thread), ("FAILED", label and error), or ("skip", why)
    where this numba-cuda asks the CUDA driver while compiling."""
    from cuda.bindings import nvjitlink
    from numba import cuda
    from numba.cuda import dispatcher
    from numba.cuda.cudadrv.error import CudaSupportError

    from convcov.backends import numba_cuda as nc

    class _Sm90:
        compute_capability = (9, 0)

    dispatcher.get_current_device = lambda: _Sm90()  # Numba asks while it compiles
    assert not nc.SIM, "run without NUMBA_ENABLE_CUDASIM"
    name, elems, acc, V = variant
    label = f"{name} {elems} {acc} V={V}"
    try:
        ptx, _ = cuda.compile_ptx(nc._kernel_function(name, elems, acc, V),
                                  nc._signature(name, elems, acc), cc=(9, 0),
                                  launch_bounds=nc._launch_bounds(name))
        opts = ["-arch=sm_90", "-Xptxas=-v"]
        h = nvjitlink.create(len(opts), opts)
        try:
            data = ptx.encode()
            nvjitlink.add_data(h, nvjitlink.InputType.PTX, data, len(data), "k.ptx")
            nvjitlink.complete(h)
            log = bytearray(nvjitlink.get_info_log_size(h))
            nvjitlink.get_info_log(h, log)
        finally:
            nvjitlink.destroy(h)
    except CudaSupportError as exc:  # no driver, and the pretended device was not asked
        return "skip", (f"this numba-cuda asks the CUDA driver while compiling, so the "
                        f"pretended sm_90 device does not work here: {exc!r}"[:400])
    except Exception as exc:
        return "FAILED", f"{label}: {exc!r}"
    usage = re.findall(r"(\d+) bytes spill stores|Used (\d+) registers", log.decode())
    if not usage:  # some nvJitLink builds print no ptxas statistics
        return "ok", f"{label}: compiled (no register report from this nvJitLink)"
    spills, regs = (max(int(u[i] or 0) for u in usage) for i in (0, 1))
    return "ok", f"{label}: {regs} registers, {spills} bytes of spill stores"


def main(argv=()):
    try:
        import cuda.bindings.nvjitlink  # noqa: F401
        import numba.cuda.dispatcher  # noqa: F401
    except Exception as exc:  # the test extra's numba-cuda[cu13] brings both
        print(f"compilers not installed: {exc!r}")
        return 77
    n = 0
    # One process a core: each variant is a few seconds of Numba, NVVM and ptxas.
    with concurrent.futures.ProcessPoolExecutor(os.cpu_count() or 1) as pool:
        for status, text in pool.map(_compile, variants(every="--all" in argv)):
            if status != "ok":
                print(text if status == "skip" else f"FAILED {text}", flush=True)
                pool.shutdown(cancel_futures=True)
                return 77 if status == "skip" else 1
            print(f"ok {text}", flush=True)
            n += 1
    print(f"compiled {n} kernels for sm_90")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
