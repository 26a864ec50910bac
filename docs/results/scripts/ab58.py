"""How fast can out's channel-diagonal rows be updated on `mid`, and with which mapping?

cupy's cc_stream updates mid's out diagonal (100352 rows of 784 bytes, one every 25088
bytes, 16 * co bytes past a 128-byte line) in about 51 µs (3.1 TB/s for the 157 MB read
and written), where the ninth session's probe read-modify-wrote the same bytes
contiguous in about 42 µs. That probe's rows variant (54 µs) divided 64-bit indices for
every vector, so it said little about the rows themselves. This times lean
out[b, co, row] += c[co] * S[b, row] kernels (and the same without S) on the rows and on
a contiguous buffer of the same bytes:

* wr1<P, S>: cc_stream's mapping (a block: 256 P consecutive vectors of one (b, co) plane,
  a thread's P vectors found by one 32-bit division and steps);
* wr2<R, S>: a warp a row (49 vectors: lanes 0-31, then 0-16), R consecutive rows a warp,
  all of a warp's loads before its first store.

Every variant's result is checked against torch on a copy of out."""
import sys

import cupy as cp
import torch

import convcov
from _timing import gpu_median, kernels, mid_inputs

SRC = r"""
typedef long long i64;
// Rows (b, co, i), n floats each, at b*so0 + co*so1 + i*sr floats; S[b, i, :] at (b*n + i)*n.
template <int P, int US>
__global__ void __launch_bounds__(256) wr1(float* out, const float* S, const float* c, int Co,
                                           int n, i64 so0, i64 so1, i64 sr, int tiles) {
  const unsigned nv = n >> 2, nf = n * nv, dr = 256 / nv, dv = 256 - dr * nv;
  const int tin = blockIdx.x % tiles, bc = blockIdx.x / tiles, b = bc / Co, co = bc - b * Co;
  float* ob = out + b * so0 + co * so1;
  const float* Sb = S + (i64)b * n * n;
  const unsigned f0 = tin * 256 * P + threadIdx.x;
  unsigned rr = f0 / nv, vv = f0 - rr * nv;
  float4 o[P], s[P];
  i64 off[P];
  bool ok[P];
#pragma unroll
  for (int k = 0; k < P; ++k) {
    if (k > 0) {
      rr += dr; vv += dv;
      if (vv >= nv) { vv -= nv; ++rr; }
    }
    const unsigned f = f0 + k * 256;
    ok[k] = f < nf;
    off[k] = (i64)rr * sr + vv * 4;
    if (ok[k]) {
      if (US) s[k] = __ldg((const float4*)(Sb + (i64)f * 4));
      o[k] = __ldg((const float4*)(ob + off[k]));
    }
  }
  const float cc = c[co];
#pragma unroll
  for (int k = 0; k < P; ++k) {
    if (!ok[k]) continue;
    float4 v = o[k];
    if (US) {
      v.x = fmaf(cc, s[k].x, v.x); v.y = fmaf(cc, s[k].y, v.y);
      v.z = fmaf(cc, s[k].z, v.z); v.w = fmaf(cc, s[k].w, v.w);
    } else {
      v.x *= cc; v.y *= cc; v.z *= cc; v.w *= cc;
    }
    *(float4*)(ob + off[k]) = v;
  }
}
// n == 196: 49 vectors a row.
template <int R, int US>
__global__ void __launch_bounds__(256) wr2(float* out, const float* S, const float* c, int Co,
                                           int n, i64 so0, i64 so1, i64 sr, i64 nrows) {
  const int lane = threadIdx.x & 31, nv = n >> 2;
  const i64 r0 = ((i64)blockIdx.x * 8 + (threadIdx.x >> 5)) * R;
  if (r0 >= nrows) return;
  const i64 slab = r0 / n;
  const int i = (int)(r0 - slab * n), b = (int)(slab / Co), co = (int)(slab - (i64)b * Co);
  float* orow = out + b * so0 + co * so1 + (i64)i * sr;
  const float* srow = S + ((i64)b * n + i) * n;
  float4 o[R][2], s[R][2];
#pragma unroll
  for (int r = 0; r < R; ++r)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int v = lane + 32 * h;
      if (v < nv) {
        if (US) s[r][h] = __ldg((const float4*)(srow + r * n + 4 * v));
        o[r][h] = __ldg((const float4*)(orow + r * sr + 4 * v));
      }
    }
  const float cc = c[co];
#pragma unroll
  for (int r = 0; r < R; ++r)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int v = lane + 32 * h;
      if (v >= nv) continue;
      float4 x = o[r][h];
      if (US) {
        x.x = fmaf(cc, s[r][h].x, x.x); x.y = fmaf(cc, s[r][h].y, x.y);
        x.z = fmaf(cc, s[r][h].z, x.z); x.w = fmaf(cc, s[r][h].w, x.w);
      } else {
        x.x *= cc; x.y *= cc; x.z *= cc; x.w *= cc;
      }
      *(float4*)(orow + r * sr + 4 * v) = x;
    }
}
"""
V1 = ((4, 1), (8, 1), (4, 0))
V2 = ((1, 1), (2, 1), (4, 1), (2, 0))
names = [f"wr1<{p}, {u}>" for p, u in V1] + [f"wr2<{r}, {u}>" for r, u in V2]
mod = cp.RawModule(code=SRC, options=("-std=c++14",), name_expressions=names)

dev, bw, w, x = mid_inputs()
out = x["out"]
B, Co, Ho = out.shape[0], out.shape[1], out.shape[2]
n = Ho * Ho
assert n == 196
so = out.stride()
rows = (out, so[0], so[1] + so[4], so[3])
flat = torch.rand(B, Co, n, n, device="cuda")
contig = (flat, Co * n * n, n * n, n)
S = torch.rand(B, n, n, device="cuda")
c = 1 + torch.rand(Co, device="cuda") * 1e-3
nbytes = 2 * B * Co * n * n * 4




def variant(name, src):
    t, s0, s1, sr = src
    k = mod.get_function(name)
    common = (cp.uint64(t.data_ptr()), cp.uint64(S.data_ptr()), cp.uint64(c.data_ptr()),
              cp.int32(Co), cp.int32(n), cp.int64(s0), cp.int64(s1), cp.int64(sr))
    if name.startswith("wr1"):
        p = int(name[4])
        tiles = -(-n * (n // 4) // (256 * p))
        return lambda: k((B * Co * tiles,), (256,), common + (cp.int32(tiles),))
    r = int(name[4])
    nrows = B * Co * n
    return lambda: k((-(-nrows // (8 * r)),), (256,), common + (cp.int64(nrows),))


def diag(t, src):
    return torch.diagonal(out, dim1=1, dim2=4) if t is out else t.view(B, Co, n, n).movedim(1, -1)


def check(name, src):
    """The variant once on src's rows; the rows against torch's update of a copy."""
    t = src[0]
    before = diag(t, src).clone().reshape(B, n, n, Co)
    variant(name, src)(); torch.cuda.synchronize()
    after = diag(t, src).reshape(B, n, n, Co)
    if ", 1>" in name:
        want = before + c * S.unsqueeze(-1)
    else:
        want = before * c
    return ((after - want).abs().max() / want.abs().max()).item()


call = lambda: convcov.accumulate(out, x["gamma"], x["mu"], x["c"], w.k, backend="cupy")  # noqa: E731
for rnd in range(2):
    print(f"round {rnd}: mid cupy kernels {kernels(call, n=10)}", flush=True)
    for name in names:
        for tag, src in (("rows", rows), ("contiguous", contig)):
            if rnd == 0:
                err = check(name, src)
                if not err < 1e-6:
                    print(f"  {name} {tag}: WRONG (rel err {err})", flush=True)
                    sys.exit(1)
            us = gpu_median(variant(name, src))
            print(f"  {name:12s} {tag:10s} {us:6.1f} us {nbytes/us/1e6:5.2f} TB/s", flush=True)
