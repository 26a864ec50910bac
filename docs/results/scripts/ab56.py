"""How fast can gamma's channel-diagonal rows be read on `mid`, and in which order?

cupy's cc_gsum reads mid's gamma diagonal (131072 rows of 1 KB, one every 32 KB, over a
4.3 GB tensor) at about 3.5 TB/s (38-40 µs), where big-f16's contiguous rows read at 4.3.
The ninth session's probe (ab33.py) measured read-only kernels at 2.7 TB/s even on
contiguous bytes, so it says nothing about what the rows allow. This times read-and-sum
kernels (gamma only, no mu: T[b, p, q] = sum over ci of gamma[b, ci, p, ci, q]) in two
orders, several depths and grids, on the rows themselves and on a contiguous buffer of
the same bytes (the diagonal layout), beside the real cc_gsum of a mid call:

* A<U>: a thread owns (b, p, 4 q) and sums over ci, U channels' loads in flight (cc_gsum's
  order; its U loads lie in U channels, 8 MB apart);
* D<U, CU>: a block owns 4 U consecutive rows p and all q, channels outer: a step's U x CU
  loads lie in CU channels, U rows of each (32 KB apart, one 2 MB page).

Every variant's T is checked against torch's sum of the diagonal."""
import sys

import cupy as cp
import torch

import convcov
from _timing import gpu_median, kernels, mid_inputs

SRC = r"""
typedef long long i64;
__device__ __forceinline__ void add4(float4& a, const float4 v) {
  a.x += v.x; a.y += v.y; a.z += v.z; a.w += v.w;
}
// Row (b, ci, p) starts at b*sb + ci*sc + p*sp floats and holds HW floats.
template <int U>
__global__ void __launch_bounds__(256) rdA(const float* g, int B, int C, int HW, i64 sb,
                                           i64 sc, i64 sp, float* T) {
  const int nv = HW >> 2;
  const i64 items = (i64)B * HW * nv;
  for (i64 it = (i64)blockIdx.x * 256 + threadIdx.x; it < items; it += (i64)gridDim.x * 256) {
    const i64 r = it / nv;
    const int e = (int)(it - r * nv);
    const int b = (int)(r / HW), p = (int)(r - (i64)b * HW);
    const float* base = g + b * sb + p * sp + 4 * e;
    float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
    for (int ci = 0; ci < C; ci += U) {
      float4 v[U];
#pragma unroll
      for (int u = 0; u < U; ++u) v[u] = __ldcs((const float4*)(base + (i64)(ci + u) * sc));
#pragma unroll
      for (int u = 0; u < U; ++u) add4(acc, v[u]);
    }
    *(float4*)(T + r * HW + 4 * e) = acc;
  }
}
// HW == 256: 64 threads a row, 4 rows a pass, U passes a block.
template <int U, int CU>
__global__ void __launch_bounds__(256) rdD(const float* g, int B, int C, int HW, i64 sb,
                                           i64 sc, i64 sp, float* T) {
  const int lane = threadIdx.x & 63, rl = threadIdx.x >> 6;
  const int rpb = 4 * U;
  const i64 nrows = (i64)B * HW;
  for (i64 r0 = (i64)blockIdx.x * rpb; r0 < nrows; r0 += (i64)gridDim.x * rpb) {
    const int b = (int)(r0 / HW), p0 = (int)(r0 - (i64)b * HW) + rl;
    const float* base = g + b * sb + (i64)p0 * sp + 4 * lane;
    float4 acc[U];
#pragma unroll
    for (int u = 0; u < U; ++u) acc[u] = make_float4(0.f, 0.f, 0.f, 0.f);
    for (int ci = 0; ci < C; ci += CU) {
      float4 v[CU][U];
#pragma unroll
      for (int c = 0; c < CU; ++c)
#pragma unroll
        for (int u = 0; u < U; ++u)
          v[c][u] = __ldcs((const float4*)(base + (i64)(ci + c) * sc + (i64)(4 * u) * sp));
#pragma unroll
      for (int c = 0; c < CU; ++c)
#pragma unroll
        for (int u = 0; u < U; ++u) add4(acc[u], v[c][u]);
    }
#pragma unroll
    for (int u = 0; u < U; ++u) *(float4*)(T + (r0 + rl + 4 * u) * HW + 4 * lane) = acc[u];
  }
}
"""
A_US = (2, 4, 8)
D_UC = ((1, 4), (2, 1), (2, 2), (4, 1), (4, 2))
names = [f"rdA<{u}>" for u in A_US] + [f"rdD<{u}, {c}>" for u, c in D_UC]
mod = cp.RawModule(code=SRC, options=("-std=c++14",), name_expressions=names)

dev, bw, w, x = mid_inputs()
gamma = x["gamma"]
B, C, H = gamma.shape[0], gamma.shape[1], gamma.shape[2]
HW = H * H
assert HW == 256 and C % 8 == 0
nsm = torch.cuda.get_device_properties(0).multi_processor_count
s = gamma.stride()
rows = (gamma, s[0], s[1] + s[4], s[3])  # the real rows
flat = torch.rand(B * C * HW * HW, device="cuda")  # the same bytes, diagonal layout
flat_ref = flat.view(B, C, HW, HW).sum(1)
contig = (flat, C * HW * HW, HW * HW, HW)
ref = torch.diagonal(gamma, dim1=1, dim2=4).sum(-1).reshape(B, HW, HW)
T = torch.empty(B, HW, HW, device="cuda")
nbytes = B * C * HW * HW * 4




def variant(name, grid, src):
    t, sb, sc, sp = src
    k = mod.get_function(name)
    args = (cp.uint64(t.data_ptr()), cp.int32(B), cp.int32(C), cp.int32(HW), cp.int64(sb),
            cp.int64(sc), cp.int64(sp), cp.uint64(T.data_ptr()))
    return lambda: k((grid,), (256,), args)


plans = []
one_a = B * HW * (HW // 4) // 256
for u in A_US:
    for grid, gname in ((one_a, "one-shot"), (3 * nsm, "3/SM"), (4 * nsm, "4/SM")):
        plans.append((f"rdA<{u}>", grid, gname))
for u, c in D_UC:
    one_d = B * HW // (4 * u)
    plans.append((f"rdD<{u}, {c}>", one_d, "one-shot"))
    plans.append((f"rdD<{u}, {c}>", min(one_d, 4 * nsm), "<=4/SM"))

call = lambda: convcov.accumulate(x["out"], gamma, x["mu"], x["c"], w.k, backend="cupy")  # noqa: E731
for rnd in range(2):
    print(f"round {rnd}: mid cupy kernels {kernels(call, n=10)}", flush=True)
    for name, grid, gname in plans:
        for tag, src, want in (("rows", rows, ref), ("contiguous", contig, flat_ref)):
            f = variant(name, grid, src)
            T.fill_(float("nan"))
            f(); torch.cuda.synchronize()
            err = ((T - want).abs().max() / want.abs().max()).item()
            if not err < 1e-5:
                print(f"  {name} {gname} {tag}: WRONG (rel err {err})", flush=True)
                sys.exit(1)
            us = gpu_median(f)
            print(f"  {name:12s} grid {grid:5d} {gname:8s} {tag:10s} {us:6.1f} us "
                  f"{nbytes/us/1e6:5.2f} TB/s", flush=True)
