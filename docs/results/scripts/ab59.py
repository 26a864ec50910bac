"""Do the partial line ends of out's rows cost mid's update its time?

ab58.py: every lean mapping updates mid's out-diagonal rows (784 bytes, 16 * co bytes past
a 128-byte line) in 53.5-56 µs, the same bytes contiguous in 43. cc_stream takes 51-52.
This widens each row's read-modify-write to whole 32-, 64- or 128-byte pieces (the
elements outside the row written back as they were, bit for bit), to see whether the
partial pieces at the rows' ends are what costs. A probe, not a candidate as it stands:
the library may not write elements outside the diagonal, even unchanged, while another
stream may be writing them. Checked against torch: the diagonal updated, every other
element bit-identical."""
import sys

import cupy as cp
import torch

from _timing import gpu_median, mid_inputs

SRC = r"""
typedef long long i64;
// A warp a row (b, co, i): floats [start, start + n) at b*so0 + co*so1 + i*sr, widened to
// [start & -A, roundup(start + n, A)) (A floats, a multiple of 4); R rows a warp.
template <int R, int A>
__global__ void __launch_bounds__(256) wr3(float* out, const float* S, const float* c, int Co,
                                           int n, i64 so0, i64 so1, i64 sr, i64 nrows) {
  const int lane = threadIdx.x & 31;
  const i64 r0 = ((i64)blockIdx.x * 8 + (threadIdx.x >> 5)) * R;
  if (r0 >= nrows) return;
  const i64 slab = r0 / n;
  const int i = (int)(r0 - slab * n), b = (int)(slab / Co), co = (int)(slab - (i64)b * Co);
  const float cc = c[co];
  float4 o[R][2], s[R][2];
  i64 lo[R];
  int nv[R], skip[R];
#pragma unroll
  for (int r = 0; r < R; ++r) {
    const i64 start = b * so0 + co * so1 + (i64)(i + r) * sr;
    lo[r] = start & ~(i64)(A - 1);
    const i64 hi = (start + n + A - 1) & ~(i64)(A - 1);
    nv[r] = (int)((hi - lo[r]) >> 2);
    skip[r] = (int)((start - lo[r]) >> 2);  // vectors before the row's first
    const float* srow = S + ((i64)b * n + i + r) * n;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int v = lane + 32 * h, j = v - skip[r];
      if (v < nv[r]) {
        o[r][h] = __ldg((const float4*)(out + lo[r] + 4 * v));
        if (j >= 0 && 4 * j < n) s[r][h] = __ldg((const float4*)(srow + 4 * j));
      }
    }
  }
#pragma unroll
  for (int r = 0; r < R; ++r)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int v = lane + 32 * h, j = v - skip[r];
      if (v >= nv[r]) continue;
      float4 x = o[r][h];
      if (j >= 0 && 4 * j < n) {
        x.x = fmaf(cc, s[r][h].x, x.x); x.y = fmaf(cc, s[r][h].y, x.y);
        x.z = fmaf(cc, s[r][h].z, x.z); x.w = fmaf(cc, s[r][h].w, x.w);
      }
      *(float4*)(out + lo[r] + 4 * v) = x;
    }
}
"""
VARIANTS = [(r, a) for r in (1, 2) for a in (4, 8, 16, 32)]  # A in floats: 16, 32, 64, 128 B
names = [f"wr3<{r}, {a}>" for r, a in VARIANTS]
mod = cp.RawModule(code=SRC, options=("-std=c++14",), name_expressions=names)

dev, bw, w, x = mid_inputs()
out = x["out"]
del x
B, Co, Ho = out.shape[0], out.shape[1], out.shape[2]
n = Ho * Ho
so = out.stride()
S = torch.rand(B, n, n, device="cuda")
c = 1 + torch.rand(Co, device="cuda") * 1e-3
nbytes = 2 * B * Co * n * n * 4




def variant(name):
    k = mod.get_function(name)
    r = int(name[4])
    nrows = B * Co * n
    args = (cp.uint64(out.data_ptr()), cp.uint64(S.data_ptr()), cp.uint64(c.data_ptr()),
            cp.int32(Co), cp.int32(n), cp.int64(so[0]), cp.int64(so[1] + so[4]),
            cp.int64(so[3]), cp.int64(nrows))
    return lambda: k((-(-nrows // (8 * r)),), (256,), args)


for name in names:
    want = out.clone()
    torch.diagonal(want, dim1=1, dim2=4).add_(
        c * S.view(B, Ho, Ho, Ho, Ho).unsqueeze(-1))
    variant(name)(); torch.cuda.synchronize()
    d = torch.diagonal(out, dim1=1, dim2=4) - torch.diagonal(want, dim1=1, dim2=4)
    err = (d.abs().max() / torch.diagonal(want, dim1=1, dim2=4).abs().max()).item()
    torch.diagonal(want, dim1=1, dim2=4).copy_(torch.diagonal(out, dim1=1, dim2=4))
    same_rest = torch.equal(want.view(torch.int32), out.view(torch.int32))
    del want, d
    if not (err < 1e-6 and same_rest):
        print(f"{name}: WRONG (diag rel err {err}, rest bit-identical {same_rest})", flush=True)
        sys.exit(1)
for rnd in range(2):
    for name in names:
        us = gpu_median(variant(name))
        print(f"r{rnd} {name:12s} {us:6.1f} us {nbytes/us/1e6:5.2f} TB/s (useful bytes)", flush=True)
