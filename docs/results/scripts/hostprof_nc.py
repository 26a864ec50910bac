"""hostprof.py for numba_cuda: each piece of its fast path on a `mid` call, timed with
perf_counter hot (back to back) and right after torch.cuda.synchronize() of a queued mid
call (the bench's state), medians in µs."""
from _timing import bound_call, host_pieces

from convcov import _arrays
from convcov.backends import numba_cuda as nc

x, call, front, entry = bound_call("mid", "numba_cuda")
out, g, mu, c = x["out"], x["gamma"], x["mu"], x["c"]
run = entry.run
plan = next(iter(nc._plans.values()))
ptrs = (out.data_ptr(), g.data_ptr(), mu.data_ptr(), c.data_ptr())
handle = _arrays.current_stream("torch", 0)
stream = nc._driver_stream(handle)
blk, sptr = _arrays.torch_scratch(plan.scratch * 4, 0, handle)
values = (ptrs[0], ptrs[1], ptrs[2], ptrs[3], sptr, sptr + plan.t_offset, nc._bits(0.0, "float32"))


def scratch():
    b, p = _arrays.torch_scratch(plan.scratch * 4, 0, handle)
    del b


pieces = {
    "whole call": call,
    "front end (no-op launcher)": front,
    "launcher (3 launches)": lambda: run(out, g, mu, c, *ptrs, 0.0),
    "_current_context": nc._current_context,
    "current_stream+_driver_stream": lambda: nc._driver_stream(_arrays.current_stream("torch", 0)),
    "scratch alloc+free": scratch,
    "one launch (first kernel)": lambda: plan.launches[0](stream, values),
}
host_pieces(pieces, call, 30)
