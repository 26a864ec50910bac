"""Thirteenth session. numba_cuda's lean out updates (STREAM_LEAN: stream_rows for a
full-layout out, stream_flat for a diagonal one) off and on, ABAB in one process, same
bits required: mid four rounds, big-f32 and big-f16 two; the registers of each plan's
kernels as the device's driver compiled them. Then the bound launcher: the twelfth
session's (its context check through cuCtxGetCurrent, then _launch_plan: stream, scratch,
launches) against this session's (torch's current device and the thread's ready set, the
stream and scratch looked up directly): mid and toy, four rounds each, whole call against
its GPU part. (Both launchers now write c through the words' float view.)

As run at 14:27 UTC (log: h200-2026-11-30-ab-13th-session.log). The flat variant was
dropped after this run (slower on big) and the knob is now STREAM_ROWS; the register
query printed None (numba's handle is a CUkernel, which cuFuncGetAttribute does not take)."""
from _timing import abab, knob

from convcov import _frontend, bench
from convcov.backends import numba_cuda as nc

dev = bench._Cuda()
bw = dev.copy_bandwidth()
print(f"copy {bw / 1e9:.0f} GB/s", flush=True)


set_lean = knob(numba_cuda="STREAM_LEAN")


def registers(name):
    """The registers of the kernels of workload ``name``'s plan, general and lean."""
    import convcov
    import torch

    w = {w.name: w for w in bench.WORKLOADS}[name]
    x = bench._inputs(dev, w)
    d = nc._driver()
    attr = d.CUfunction_attribute.CU_FUNC_ATTRIBUTE_NUM_REGS
    for flag in (False, True):
        set_lean("numba_cuda", flag)
        convcov.accumulate(x["out"], x["gamma"], x["mu"], x["c"], w.k, backend="numba_cuda")
        (plan,) = nc._plans.values()
        print(f"   {name} registers, lean={flag}: " + ", ".join(
            f"{ln.name}<V={ln.V}> {d.cuFuncGetAttribute(attr, ln.func)[1]}"
            for ln in plan.launches), flush=True)
    del x
    torch.cuda.empty_cache()


for name in ("mid", "big-f32", "big-f16"):
    registers(name)
abab(dev, bw, ["mid"], ["numba_cuda"], set_lean, "lean", rounds=4)
abab(dev, bw, ["big-f32", "big-f16"], ["numba_cuda"], set_lean, "lean", rounds=2)

new_bind = nc.NumbaCudaBackend.bind


def old_bind(self, p):
    """The twelfth session's bound launcher (commit 13d1945), as it was."""
    from numba import cuda

    if p.device[1] is None:
        return None
    dev_id, kind, acc = p.device[1], p.kind, p.acc
    plan = self._on_device(self._plan_of, p)

    def run(out, gamma, mu, c, optr, gptr, mptr, cptr, c_value):
        ctx = nc._ready.get(dev_id)
        if ctx is not None and ctx == nc._current_context():
            nc._launch_plan(plan, kind, dev_id, acc, optr, gptr, mptr, cptr, c_value)
            return
        with cuda.gpus[dev_id]:
            nc._launch_plan(plan, kind, dev_id, acc, optr, gptr, mptr, cptr, c_value)
            nc._ready[dev_id] = nc._current_context()

    return run


def set_bind(be, new):
    nc.NumbaCudaBackend.bind = new_bind if new else old_bind
    _frontend._bound.clear()


abab(dev, bw, ["mid", "toy"], ["numba_cuda"], set_bind, "new_bind", rounds=4)
