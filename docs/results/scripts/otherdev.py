"""What a call does when a generic CUDA array names a stream of another device (x2)."""
import numpy as np
import cupy
import convcov
import sys
sys.path.insert(0, "tests")
from test_cuda_interface import Foreign, _problem

for backend in ("cupy", "numba_cuda"):
    out_h, gamma_h, mu_h, c_h, conv, want = _problem(3)
    with cupy.cuda.Device(0):
        out, g, mu, c = (cupy.asarray(a) for a in (out_h, gamma_h, mu_h, c_h))
    with cupy.cuda.Device(1):
        s1 = cupy.cuda.Stream(non_blocking=True)
    for which in ("out", "mu"):
        streams = {n: None for n in ("out", "g", "mu", "c")}
        streams[which] = s1.ptr
        args = [Foreign(a, streams[n]) for n, a in zip(("out", "g", "mu", "c"), (out, g, mu, c))]
        try:
            with cupy.cuda.Device(0):
                convcov.accumulate(*args, 3, backend=backend, **conv)
                cupy.cuda.Device(0).synchronize()
            print(backend, which, "no error")
        except Exception as e:
            print(backend, which, type(e).__module__, type(e).__name__, str(e)[:300])
        try:
            with cupy.cuda.Device(0):
                cupy.cuda.Device(0).synchronize()
                same = bool((cupy.asnumpy(out) == out_h).all())
            print("   out unchanged:", same)
            out[...] = cupy.asarray(out_h)
        except Exception as e:
            print("   device after:", type(e).__name__, str(e)[:200])
