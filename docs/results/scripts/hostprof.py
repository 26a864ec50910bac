"""Where the host time of a cupy `mid` call goes on the H200's host: each piece of the
fast path timed on its own with perf_counter, hot (called back to back) and right after
torch.cuda.synchronize() of a queued mid call (the bench's state), medians in µs.
Pieces: the front end alone (the bound launcher replaced by a no-op), the launcher alone
(real launches), and inside it cupy's _enter, torch's stream, the scratch, one _fill and
one launch of the channel sum; then a pure-Python key-sized tuple as a yardstick of the
CPU's state."""
import cupy
from _timing import bound_call, host_pieces

from convcov import _arrays
from convcov.backends import cupy as cb

x, call, front, entry = bound_call("mid", "cupy")
out, g, mu, c = x["out"], x["gamma"], x["mu"], x["c"]
run = entry.run
plan = next(iter(cb.backend._plans.values()))
ptrs = (out.data_ptr(), g.data_ptr(), mu.data_ptr(), c.data_ptr())
stream_of = _arrays.torch_stream_getter()
lk = cupy.cuda.driver.launchKernel
nbytes = plan.scratch * 4
s0 = stream_of(0)
ln0 = plan.launches[0]
blk, sp = _arrays.torch_scratch(nbytes, 0, s0, True)
filled = cb._fill(ln0, *ptrs, sp + plan.t_offset, sp, 0)


def scratch():
    b, p = _arrays.torch_scratch(nbytes, 0, s0, True)
    del b


pieces = {
    "whole call": call,
    "front end (no-op launcher)": front,
    "launcher (3 launches)": lambda: run(out, g, mu, c, *ptrs, 0.0),
    "_enter": lambda: cb.backend._enter(("cuda", 0)),
    "torch stream": lambda: stream_of(0),
    "scratch alloc+free": scratch,
    "_fill": lambda: cb._fill(ln0, *ptrs, 1, 2, 0),
    "one launch (gsum)": lambda: cb._cu_launch(lk, ln0, filled, s0),
    "yardstick tuple": lambda: (out.dtype, out.shape, out.stride(), out.device,
                                out.data_ptr() & 15, g.dtype, g.shape, g.stride(), g.device,
                                mu.dtype, mu.shape, mu.stride(), mu.device, c.dtype,
                                c.shape, c.stride(), c.device),
}
host_pieces(pieces, call, 28)
