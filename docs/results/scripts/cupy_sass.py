"""ptxas' resource report and the sm_90 SASS of chosen cupy kernels, on a machine without
a GPU: the backend's SOURCE through NVRTC (cuda-bindings' nvrtc, from the cuda-toolkit
wheels) straight to a cubin, then cuobjdump (the nvidia-cuda-cuobjdump wheel; its path
in CUOBJDUMP or on PATH). Writes k.cubin and k.sass in the current directory.

    python docs/results/scripts/cupy_sass.py "cc_gsum<f16, f16, float, 8>" [-DNAME=1 ...]

Used in the eighth session to read the order of loads and sums in cc_gsum and
cc_sbox_walk (docs/cupy.md). NVRTC here is the toolkit's (13.5 when this was written),
the H200's CuPy compiles with its own, so register counts can differ by a few."""
import os
import subprocess
import sys

from cuda.bindings import nvrtc

from convcov.backends import cupy as cb

names = [a for a in sys.argv[1:] if not a.startswith("-")]
defines = [a.encode() for a in sys.argv[1:] if a.startswith("-D")]
prog = nvrtc.nvrtcCreateProgram(cb.SOURCE.encode(), b"k.cu", 0, [], [])[1]
for n in names:
    nvrtc.nvrtcAddNameExpression(prog, n.encode())
opts = [b"-arch=sm_90", b"-std=c++14", b"-ftz=true", b"-Xptxas=-v", *defines]
err, = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)
_, size = nvrtc.nvrtcGetProgramLogSize(prog)
log = b" " * size
nvrtc.nvrtcGetProgramLog(prog, log)
print(log.decode(errors="replace"))
if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
    sys.exit(1)
_, size = nvrtc.nvrtcGetCUBINSize(prog)
cubin = b" " * size
nvrtc.nvrtcGetCUBIN(prog, cubin)
with open("k.cubin", "wb") as f:
    f.write(cubin)
for n in names:
    print(n, "->", nvrtc.nvrtcGetLoweredName(prog, n.encode())[1].decode())
sass = subprocess.run([os.environ.get("CUOBJDUMP", "cuobjdump"), "-sass", "k.cubin"],
                      capture_output=True, text=True)
with open("k.sass", "w") as f:
    f.write(sass.stdout + sass.stderr)
print(len(sass.stdout.splitlines()), "lines of SASS in k.sass")
