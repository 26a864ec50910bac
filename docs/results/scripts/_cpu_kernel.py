"""Shared by the CPU probes here (cpu_parts.py, cpu_pipe.py, cpu_pf_head.py): the bench's
``cpu`` inputs, the numba kernel's arguments for them as the backend makes them, and
variants of the kernel's source compiled like the kernel."""
import inspect
import textwrap

from numba import njit

import convcov
from convcov import bench
from convcov.backends import numba as nb

W = next(x for x in bench.WORKLOADS if x.name == "cpu")
DEV = bench._Host()
#: The kernel's source (``convcov.backends.numba._kernel``), for variants to edit.
SRC = textwrap.dedent(inspect.getsource(nb._kernel))


def phases(src):
    """(the kernel ``src`` with phase 2 cut, the kernel ``src`` with phase 1 cut)."""
    head, p2 = src.split("        # Phase 2:")
    return head, head.split("        # Phase 1:")[0] + "        # Phase 2:" + p2


def run_with(kernel, out, s):
    """``convcov.accumulate`` into ``out`` with input set ``s`` on the numba backend, its
    kernel replaced by ``kernel(prm, c_value, M)``."""
    real = nb._run
    nb._run = kernel
    try:
        convcov.accumulate(out, s["gamma"], s["mu"], s["c"], W.k, backend="numba")
    finally:
        nb._run = real


def inputs_and_calls(n=3):
    """(n input sets of the ``cpu`` workload, the kernel's (prm, c_value, M) for each):
    rotating sets, so that the 73 MB of a call do not sit in the 32 MB L3."""
    sets = [bench._inputs(DEV, W) for _ in range(n)]
    calls = []
    for s in sets:
        run_with(lambda prm, cv, M: calls.append((prm.copy(), cv, M)), s["out"], s)
    return sets, calls


def compiled(code, name, extra=None):
    """The kernel variant ``code`` (its function named ``_kernel``), compiled as the
    kernel is, under ``name``; ``extra``: names to add to or replace in its module."""
    ns = dict(nb.__dict__, **(extra or {}))
    exec(code.replace("def _kernel(", f"def {name}("), ns)
    return njit(parallel=True, nogil=True, error_model="numpy")(ns[name])


def with_prm(f, **values):
    """Kernel ``f`` called with some of its integer parameters (``nb._PRM`` names) set."""
    idx = {n: nb._PRM.index(n) for n in values}

    def g(prm, cv, M):
        q = prm.copy()
        for n, v in values.items():
            q[idx[n]] = v
        f(q, cv, M)

    return g
