"""The 3x3 walk's occupancy: cupy's cc_sbox_walk compiled for 6 or 8 blocks of 256 a
multiprocessor (-DWALK_MIN_BLOCKS; locally 40 registers with 16 bytes of spills, 32
with 92) against none named (44 registers, five blocks); numba_cuda's walk capped at 64
or 40 registers (WALK_MAX_REGISTERS) against the compiler's 80 (three blocks). ABAB in
one process: whole call the bench's way, the GPU part, per-kernel times, bit-equality.
Run once (ninth session, 10:56 UTC); neither helped, and the two knobs were removed
afterwards: the run's code had cc_sbox_walk's launch bounds as WALK_BOUNDS (from
-DWALK_MIN_BLOCKS, like GSUM_BOUNDS) and numba_cuda's WALK_MAX_REGISTERS passed to
cuda.jit as max_registers, with cache=False for a capped walk."""
import sys

from _timing import abab, knob
from convcov import bench

dev = bench._Cuda()
bw = dev.copy_bandwidth()
print(f"copy bandwidth {bw/1e9:.0f} GB/s", flush=True)
names = sys.argv[1].split(",") if len(sys.argv) > 1 else ["big-f16", "mid"]
blocks = knob(cupy="_OPTIONS", recompile=True, convert=lambda v: ("-std=c++14",) + (
    (f"-DWALK_MIN_BLOCKS={v}",) if v != "0" else ()))
abab(dev, bw, names, ("cupy",), blocks, "WALK_MIN_BLOCKS", flags=("0", "6", "8"))
blocks("cupy", "0")
cap = knob(numba_cuda="WALK_MAX_REGISTERS", recompile=True,
           convert=lambda v: None if v == "0" else int(v))
abab(dev, bw, names, ("numba_cuda",), cap, "WALK_MAX_REGISTERS", flags=("0", "64", "40"))
cap("numba_cuda", "0")
