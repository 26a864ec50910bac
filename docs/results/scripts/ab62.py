# Twenty-second session (H200): cc_cluster, one launch a call (measured, not kept).
# Needs the library with docs/results/scripts/cluster.patch applied (git apply), run from
# the repository root: python3 docs/results/scripts/ab62.py. Results: docs/performance.md,
# "Twenty-second device session"; log: docs/results/h200-2026-12-01-22-cluster.log.
"""Session 22, device call 1: cc_cluster (one launch a call) against the three launches.
Bits against the three-launch path on many geometries, then mid's GPU part and whole call."""
import statistics, sys, time
import numpy as np
import torch
import convcov
from convcov import _frontend
from convcov.backends import cupy as mod

BK = mod.backend
dev = torch.device("cuda")


def reset(cluster, threads=None, fill=None):
    mod._CLUSTER = cluster
    if threads:
        mod._CLUSTER_THREADS = threads
    if fill is not None:
        mod._CLUSTER_FILL = fill
    BK._plans.clear()
    _frontend._bound.clear()
    for k in [k for k in BK._modules if k[0] == "cluster"]:
        del BK._modules[k]
    for k in [k for k in BK._functions if k[0].startswith("cc_cluster")]:
        del BK._functions[k]


def took_cluster():
    plans = list(BK._plans.values())
    return len(plans) == 1 and len(plans[0].launches) == 1 and plans[0].launches[0].block == mod._CLUSTER_THREADS and plans[0].launches[0].smem > 0


def make(Bn, Ci, Co, G, H, W, k, stride, padding, dilation, out_form, g_form, dtype, seed=0, odd_strides=False, mu_perm=False):
    g = torch.Generator(device="cpu").manual_seed(seed)
    kh, kw = (k, k) if isinstance(k, int) else k
    sh, sw = (stride, stride) if isinstance(stride, int) else stride
    ph, pw = (padding, padding) if isinstance(padding, int) else padding
    dh, dw = (dilation, dilation) if isinstance(dilation, int) else dilation
    Ho = (H + 2 * ph - dh * (kh - 1) - 1) // sh + 1
    Wo = (W + 2 * pw - dw * (kw - 1) - 1) // sw + 1
    dt = getattr(torch, dtype)
    def rnd(*shape):
        return (torch.rand(*shape, generator=g) * 2 - 1).to(dt).to(dev)
    if mu_perm:
        mu = rnd(Bn, H, W, Ci).permute(0, 3, 1, 2)
    else:
        mu = rnd(Bn, Ci, H, W)
    if g_form == "full":
        gamma = rnd(Bn, Ci, H, W, Ci, H, W)
    elif g_form == "diag":
        gamma = rnd(Bn, Ci, H, W, H, W)
    else:
        gamma = None
    if out_form == "full":
        if odd_strides:
            out = rnd(Bn, Co + 1, Ho, Wo, Co, Ho, Wo)[:, 1:]
        else:
            out = rnd(Bn, Co, Ho, Wo, Co, Ho, Wo)
    else:
        if odd_strides:
            out = rnd(Bn, 2 * Co, Ho, Wo, Ho, Wo)[:, ::2]
        else:
            out = rnd(Bn, Co, Ho, Wo, Ho, Wo)
    c = rnd(Co)
    conv = dict(stride=(sh, sw), padding=(ph, pw), dilation=(dh, dw), groups=G)
    return out, gamma, mu, c, (kh, kw), conv


def bits(t):
    return t.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


CASES = [  # Bn, Ci, Co, G, H, W, k, stride, padding, dilation, out, gamma, dtype, extra
    (16, 32, 32, 1, 16, 16, 3, 1, 0, 1, "full", "full", "float32", {}),
    (16, 32, 32, 1, 16, 16, 3, 1, 0, 1, "full", None, "float32", {}),
    (2, 4, 6, 2, 7, 6, (3, 2), 1, (1, 0), 1, "full", "diag", "float32", {}),
    (2, 4, 4, 1, 9, 9, 3, 1, 1, 1, "diag", None, "float16", {}),
    (3, 6, 6, 3, 8, 8, 3, (1, 2), (1, 1), (1, 2), "full", "full", "float64", {}),
    (1, 2, 2, 1, 19, 19, 3, 1, 0, 1, "diag", "diag", "bfloat16", {}),
    (1, 2, 3, 1, 6, 6, (5, 5), 1, 2, 1, "full", "diag", "float32", {}),
    (2, 3, 5, 1, 7, 7, 3, 1, 0, 1, "full", "full", "float32", {}),
    (2, 4, 4, 2, 8, 8, 3, 1, 1, 1, "full", "diag", "float32", {"odd_strides": True}),
    (2, 4, 4, 2, 8, 8, 3, 1, 1, 1, "diag", "diag", "float16", {"odd_strides": True, "mu_perm": True}),
    (4, 8, 16, 4, 12, 10, (3, 4), 1, (2, 1), (1, 2), "diag", "full", "float32", {}),
    (2, 16, 16, 1, 20, 20, 3, 1, 1, 1, "diag", "diag", "float64", {}),
    (8, 16, 8, 2, 16, 16, 3, 1, 1, 1, "full", "full", "float16", {}),
]


def check_cases():
    mod._DIRECT_TERMS, mod._DIRECT_RATIO = -1, 0
    bad = 0
    for i, (Bn, Ci, Co, G, H, W, k, st, pd, dl, of, gf, dt, extra) in enumerate(CASES):
        out, gamma, mu, c, kk, conv = make(Bn, Ci, Co, G, H, W, k, st, pd, dl, of, gf, dt, seed=i, **extra)
        if i == 3:  # Inf and NaN in mu next to the padding
            mu[0, 0, 0, 0] = float("inf"); mu[1, 1, 3, 8] = float("nan")
        reset(False)
        o3 = out.clone(); convcov.accumulate(o3, gamma, mu, c, kk, backend="cupy", **conv)
        reset(True, fill=0.0)
        oc = out.clone(); convcov.accumulate(oc, gamma, mu, c, kk, backend="cupy", **conv)
        took = took_cluster()
        torch.cuda.synchronize()
        same = torch.equal(bits(o3), bits(oc))
        changed = not torch.equal(bits(out), bits(oc))
        # the untouched off-diagonal of a full-layout out, and the reference (float64) on a sample
        print(f"case {i:2d} {dt:9s} out={of} gamma={gf} took_cluster={took} same_bits={same} changed={changed}", flush=True)
        bad += (not took) + (not same) + (not changed)
    # the fast path too (bound launcher), on case 0 again
    out, gamma, mu, c, kk, conv = make(*CASES[0][:13])
    reset(False); o3 = out.clone()
    for _ in range(3): convcov.accumulate(o3, gamma, mu, c, kk, **conv)
    reset(True, fill=0.9); oc = out.clone()
    for _ in range(3): convcov.accumulate(oc, gamma, mu, c, kk, **conv)
    torch.cuda.synchronize()
    print("fast path x3 same bits:", torch.equal(bits(o3), bits(oc)), "cluster:", took_cluster())
    mod._DIRECT_TERMS, mod._DIRECT_RATIO = 1 << 22, 2
    return bad


def gpu_part(call, n=50, reps=7):
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    ts = []
    for _ in range(reps):
        torch.cuda.synchronize()
        e0.record()
        for _ in range(n):
            call()
        e1.record(); e1.synchronize()
        ts.append(e0.elapsed_time(e1) * 1000 / n)
    return statistics.median(ts)


def whole(call, n=300):
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    ts = []
    for _ in range(n):
        torch.cuda.synchronize()
        e0.record(); call(); e1.record(); e1.synchronize()
        ts.append(e0.elapsed_time(e1) * 1000)
    return statistics.median(ts)


def occ(ln):
    import ctypes, os
    lib = ctypes.CDLL("libcuda.so.1", mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
    fn = lib.cuOccupancyMaxActiveClusters
    fn.argtypes = (ctypes.POINTER(ctypes.c_int), ctypes.c_void_p, ctypes.POINTER(mod._CULaunchConfig))
    fn.restype = ctypes.c_int
    out = []
    for grid in (8, 128):
        cfg = mod._CULaunchConfig(grid, 1, 1, ln.block, 1, 1, ln.smem, None, None, 0)
        n = ctypes.c_int(-1)
        out.append((fn(ctypes.byref(n), ln.func, ctypes.byref(cfg)), n.value))
    return out


def timing():
    out, gamma, mu, c, kk, conv = make(*CASES[0][:13])
    call = lambda: convcov.accumulate(out, gamma, mu, c, kk, **conv)
    res = {}
    for rnd in range(2):
        for name, cl, th in (("three", False, None), ("cluster-1024", True, 1024), ("cluster-512", True, 512)):
            reset(cl, threads=th, fill=0.0)
            for _ in range(5): call()
            took = took_cluster()
            if cl:
                ln = list(BK._plans.values())[0].launches[0]
                mc = (BK._max_clusters(ln.func, ln.block, ln.smem), occ(ln), ln.smem)
            else:
                mc = None
            gp, wc = gpu_part(call), whole(call)
            res.setdefault(name, []).append((gp, wc))
            print(f"round {rnd} {name:13s} cluster={took} max_clusters={mc} gpu_part {gp:7.1f} us  whole call {wc:7.1f} us", flush=True)
    # gamma=None mid
    return res


if __name__ == "__main__":
    print(torch.__version__, torch.cuda.get_device_name(), flush=True)
    timing()
    print("BAD", check_cases(), flush=True)
