"""Thirteenth session. cupy's cc_stream ROWS variant (_STREAM_ROWS: a full-layout out's
evenly spaced rows, a thread's positions from one division) off and on on `mid`, ABAB in
one process, four rounds, same bits required; then numba_cuda's final code on `mid`
(stream_rows and the new bound launcher) in the same process, two rounds."""
from _timing import abab, knob

from convcov import bench

dev = bench._Cuda()
bw = dev.copy_bandwidth()
print(f"copy {bw / 1e9:.0f} GB/s", flush=True)

abab(dev, bw, ["mid"], ["cupy"], knob(cupy="_STREAM_ROWS"), "rows", rounds=4)
abab(dev, bw, ["mid"], ["numba_cuda"], knob(numba_cuda="STREAM_ROWS"), "rows", rounds=2)
