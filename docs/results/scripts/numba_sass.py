"""ptxas' resource report (through nvJitLink) and the sm_90 SASS (cuobjdump) of one
numba_cuda kernel, on a machine without a GPU. Numba asks the current device for its
compute capability when it compiles device functions; this pretends an sm_90 one.

    python docs/results/scripts/numba_sass.py sbox_walk 33 float32
    python docs/results/scripts/numba_sass.py stream 8 float32 float16 float32

Arguments: the kernel (a key of numba_cuda._FACTORIES), V, the accumulation dtype, the
pointers' element types (numba_cuda._signature). NJ="-maxrregcount=64 ..." adds
nvJitLink options; CUOBJDUMP names cuobjdump (the nvidia-cuda-cuobjdump wheel) when it
is not on PATH. Writes n.ptx, n.cubin and n.sass in the current directory. The H200
compiles through its driver's JIT, so its register counts can differ."""
import os
import re
import subprocess
import sys

from numba.cuda import dispatcher


class _Sm90:
    compute_capability = (9, 0)


dispatcher.get_current_device = lambda: _Sm90()

from cuda.bindings import nvjitlink  # noqa: E402
from numba import cuda  # noqa: E402

cuda.get_current_device = dispatcher.get_current_device  # numba_cuda's griddepcontrol asks

from convcov.backends import numba_cuda as nc  # noqa: E402

name, V, acc, elems = sys.argv[1], int(sys.argv[2]), sys.argv[3], tuple(sys.argv[4:])
ptx, _ = cuda.compile_ptx(nc._kernel_function(name, elems, acc, V),
                          nc._signature(name, elems, acc), cc=(9, 0))
with open("n.ptx", "w") as f:
    f.write(ptx)
print("PTX:", len(re.findall(r"ld\.global", ptx)), "global loads,",
      len(re.findall(r"st\.global", ptx)), "global stores,",
      len(re.findall(r"\.local", ptx)), "local accesses")
opts = ["-arch=sm_90", "-verbose"] + os.environ.get("NJ", "").split()
h = nvjitlink.create(len(opts), opts)
nvjitlink.add_data(h, nvjitlink.InputType.PTX, ptx.encode(), len(ptx.encode()), "n.ptx")
nvjitlink.complete(h)
log = bytearray(nvjitlink.get_info_log_size(h))
nvjitlink.get_info_log(h, log)
print(next((ln.split(": ", 1)[-1] for ln in bytes(log).decode(errors="replace").splitlines()
            if "registers" in ln), "no resource report"))
cubin = bytearray(nvjitlink.get_linked_cubin_size(h))
nvjitlink.get_linked_cubin(h, cubin)
nvjitlink.destroy(h)
with open("n.cubin", "wb") as f:
    f.write(bytes(cubin))
sass = subprocess.run([os.environ.get("CUOBJDUMP", "cuobjdump"), "-sass", "n.cubin"],
                      capture_output=True, text=True)
with open("n.sass", "w") as f:
    f.write(sass.stdout + sass.stderr)
print(len(sass.stdout.splitlines()), "lines of SASS in n.sass")
