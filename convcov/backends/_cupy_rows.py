"""The convolution of a covariance's rows on CUDA, for ``conv2d_moments`` (CUDA C++ by CuPy).

Owns ``SOURCE``'s kernel ``rows_conv``, its compilation (one ``cupy.RawModule`` an
instantiation, once per process) and its launch on torch CUDA tensors, on torch's current
stream. For ``X`` of shape ``(B, Ci, H, W, N)`` and weights ``w`` ``(Co, Cg, kh, kw)`` in
``G`` groups it computes, in float32,

    Y[b, o, y, x, n] = sum over c < Cg, u < kh, v < kw of
                       w[o, c, u, v] X[b, g Cg + c, y sh + u dh - ph, x sw + v dw - pw, n]

(``g = o // (Co / G)``; terms in the padding absent): the convolution along a covariance's
outer index set, the inner one (``n``) riding along, stored as it is or transposed
(``(B, N, Co, Ho, Wo)``). ``conv2d_moments``' full layout is two of them, the first one
transposed; its diagonal layout starts with one (docs/moments.md, "On CUDA"). It is used
where cuDNN's float32 convolutions of those shapes are slower: few output channels a group.

Design. The work is ``2 Cg kh kw`` flops per output entry on data read once, so it is bound
by the multiprocessors' fp32 FMA rate, not by memory (it reaches 0.3-0.4 of that rate), and
the kernel is a register-tiled product: a thread holds ``OT`` output channels x ``PT``
output columns x 4 values of ``n`` (lanes of a warp take consecutive ``n``, so a warp's
loads and stores are 128 contiguous bytes); for each input channel and kernel row it loads
the ``(PT - 1) sw + (kw - 1) dw + 1`` input columns its columns read (the next step's while
it computes this one's) and makes ``OT PT kw 4`` FMAs of them. A warp's weights are the same
for all its lanes (broadcast loads of ``w`` reordered to ``(G, Cg, kh, kw, Co / G)``). A
block is 8 warps, ``OW`` along output channels and ``8 / OW`` along columns. The grid's x is
the output row and column tile, fastest, so that the blocks running together read the same
input rows from L2; y the tile of ``n``; z ``(b, group, channel tile)``. Tiles of n and
z beyond the grid's limits (65535) are looped over.

Must not: wait on the host; import cupy before it is used.
"""

from __future__ import annotations

import sys
import threading

import numpy as np

SOURCE = r"""
// *p where ok, else 0, as one predicated load (H100: 1.25x faster than __ldg under a
// select, 16 -> 16 channels 18.4 -> 14.8 ms)
__device__ __forceinline__ float load_or_0(const float* p, bool ok) {
#ifdef __CUDA_ARCH__
  float v;
  asm volatile("{\n .reg .pred q;\n setp.ne.b32 q, %2, 0;\n mov.b32 %0, 0;\n"
               " @q ld.global.nc.f32 %0, [%1];\n}" : "=f"(v) : "l"(p), "r"((int)ok));
  return v;
#else
  return ok ? *p : 0.f;
#endif
}

template <int OT, int PT, int OW, int KH, int KW, int SH, int SW, int DH, int DW>
__global__ void __launch_bounds__(256) rows_conv(
    const float* __restrict__ X, const float* __restrict__ Wr, float* __restrict__ Y,
    int Cg, int Cpg, int G, int B, int H, int W, int Ho, int Wo, int PH, int PW,
    long long N, int px_tiles, int o_tiles, int transposed)
{
  constexpr int NX = (PT - 1) * SW + (KW - 1) * DW + 1;  // input columns a thread reads
  constexpr int PWARPS = 8 / OW;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int py = blockIdx.x / px_tiles;
  const int px0 = (blockIdx.x % px_tiles * PWARPS + warp / OW) * PT;
  const int Ci = Cg * G, steps = Cg * KH;
  const long long n_tiles = (N + 127) / 128;
  for (long long z = blockIdx.z; z < (long long)B * G * o_tiles; z += gridDim.z) {
    const int j0 = ((int)(z % o_tiles) * OW + warp % OW) * OT;
    const int g = (int)(z / o_tiles % G), b = (int)(z / o_tiles / G);
    if (j0 >= Cpg || px0 >= Wo) continue;  // warp-uniform; the kernel has no barrier
    const float* xb = X + (long long)(b * Ci + g * Cg) * H * W * N;
    const float* wg = Wr + (long long)g * Cg * KH * KW * Cpg + j0;
    for (long long nt = blockIdx.y; nt < n_tiles; nt += gridDim.y) {
      const long long n0 = nt * 128 + lane;
      float acc[OT][PT][4], xn[NX][4];
#pragma unroll
      for (int i = 0; i < OT; ++i)
#pragma unroll
        for (int p = 0; p < PT; ++p)
#pragma unroll
          for (int e = 0; e < 4; ++e) acc[i][p][e] = 0.f;
      // input columns px0 sw - pw + t of kernel row u of channel c (0 in the padding)
      auto load = [&](int s, float (&x)[NX][4]) {
        const int c = s / KH, iy = py * SH + s % KH * DH - PH;
        const bool row_in = iy >= 0 && iy < H;
        const float* r = xb + ((long long)c * H + (row_in ? iy : 0)) * W * N;
#pragma unroll
        for (int t = 0; t < NX; ++t) {
          const int ix = px0 * SW - PW + t;
          const bool in = row_in && ix >= 0 && ix < W;
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const long long n = n0 + 32 * e;
            x[t][e] = load_or_0(r + (long long)ix * N + n, in && n < N);
          }
        }
      };
      load(0, xn);
      for (int s = 0; s < steps; ++s) {
        float x[NX][4];
#pragma unroll
        for (int t = 0; t < NX; ++t)
#pragma unroll
          for (int e = 0; e < 4; ++e) x[t][e] = xn[t][e];
        if (s + 1 < steps) load(s + 1, xn);
        const float* w = wg + (long long)s * KW * Cpg;
#pragma unroll
        for (int v = 0; v < KW; ++v) {
          float wv[OT];
#pragma unroll
          for (int i = 0; i < OT; ++i) wv[i] = j0 + i < Cpg ? __ldg(w + v * Cpg + i) : 0.f;
#pragma unroll
          for (int p = 0; p < PT; ++p)
#pragma unroll
            for (int i = 0; i < OT; ++i)
#pragma unroll
              for (int e = 0; e < 4; ++e)
                acc[i][p][e] = fmaf(wv[i], x[p * SW + v * DW][e], acc[i][p][e]);
        }
      }
      if (transposed) {  // Y^T (B, N, Co Ho Wo): for each n, a thread's PT columns adjacent
        const long long Q = (long long)Ho * Wo;
        const bool vec = PT == 4 && Wo % 4 == 0;  // 16-byte stores (px0, Q, Wo multiples of 4)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const long long n = n0 + 32 * e;
          if (n >= N) break;
          float* yr = Y + ((long long)b * N + n) * G * Cpg * Q + (g * Cpg + j0) * Q
                      + (long long)py * Wo + px0;
#pragma unroll
          for (int i = 0; i < OT; ++i) {
            if (j0 + i >= Cpg) break;
            if (vec) {
              *(float4*)(yr + i * Q) = make_float4(acc[i][0][e], acc[i][1 % PT][e],
                                                   acc[i][2 % PT][e], acc[i][3 % PT][e]);
            } else {
#pragma unroll
              for (int p = 0; p < PT; ++p)
                if (px0 + p < Wo) yr[i * Q + p] = acc[i][p][e];
            }
          }
        }
        continue;
      }
#pragma unroll
      for (int i = 0; i < OT; ++i) {
        if (j0 + i >= Cpg) break;
        float* yo = Y + ((long long)(b * G + g) * Cpg + j0 + i) * Ho * Wo * N;
#pragma unroll
        for (int p = 0; p < PT; ++p) {
          if (px0 + p >= Wo) break;
          float* y = yo + ((long long)py * Wo + px0 + p) * N;
#pragma unroll
          for (int e = 0; e < 4; ++e)
            if (n0 + 32 * e < N) y[n0 + 32 * e] = acc[i][p][e];
        }
      }
    }
  }
}
"""

_OPTIONS = ("-std=c++14",)
#: Output channels and columns a thread holds (OT, PT): 128 accumulators, one block a
#: multiprocessor (H100, step one of 16ch / 64ch / strided: 14.8 / 29.7 / 9.5 ms; with
#: (8, 2) 25.1 / 53.7 / 14.9, with (4, 4) 24.5 / 51.6 / 17.1).
_OT, _PT = 8, 4

_lock = threading.Lock()
_kernels = {}  # (name expression, device) -> cupy.RawKernel


def tiles(Cpg: int):
    """(OT, PT, OW): OW warps of a block along output channels, the fewest that cover the
    group's ``Cpg`` channels (at most 8), the rest along columns."""
    ow = 1
    while ow < 8 and ow * _OT < Cpg:
        ow *= 2
    return _OT, _PT, ow


def grid(B, G, Cpg, Ho, Wo, N, cfg):
    """The launch grid and the kernel's (px_tiles, o_tiles) for one call."""
    OT, PT, OW = cfg
    px_tiles = -(-Wo // (8 // OW * PT))
    o_tiles = -(-Cpg // (OW * OT))
    return ((Ho * px_tiles, min(-(-N // 128), 65535), min(B * G * o_tiles, 65535)),
            px_tiles, o_tiles)


def name(cfg, k, stride, dilation) -> str:
    return "rows_conv<{}, {}, {}, {}, {}, {}, {}, {}, {}>".format(*cfg, *k, *stride,
                                                                  *dilation)


def _kernel(expr, dev):
    f = _kernels.get((expr, dev))
    if f is None:
        import cupy

        with _lock:
            f = _kernels.get((expr, dev))
            if f is None:
                with cupy.cuda.Device(dev):
                    mod = cupy.RawModule(code=SOURCE, options=_OPTIONS,
                                         name_expressions=[expr])
                    f = _kernels[(expr, dev)] = mod.get_function(expr)
    return f


def rows_conv(X, w, stride, padding, dilation, G, transposed=False):
    """``Y`` above for torch float32 CUDA tensors ``X`` ``(B, Ci, H, W, N)`` and ``w``
    ``(Co, Ci / G, kh, kw)``; a new contiguous tensor, queued on torch's current
    stream; with ``transposed``, stored transposed: ``(B, N, Co, Ho, Wo)``."""
    import cupy

    from .cupy import _StreamHandle

    torch = sys.modules["torch"]
    B, Ci, H, W, N = X.shape
    Co, Cg, kh, kw = w.shape
    Cpg = Co // G
    (sh, sw), (ph, pw), (dh, dw) = stride, padding, dilation
    Ho = (H + 2 * ph - dh * (kh - 1) - 1) // sh + 1
    Wo = (W + 2 * pw - dw * (kw - 1) - 1) // sw + 1
    Y = torch.empty((B, N, Co, Ho, Wo) if transposed else (B, Co, Ho, Wo, N), dtype=X.dtype,
                    device=X.device)
    if Y.numel() == 0:
        return Y
    X = X.contiguous()
    Wr = w.reshape(G, Cpg, Cg, kh, kw).permute(0, 2, 3, 4, 1).contiguous()
    cfg = tiles(Cpg)
    (gx, gy, gz), px_tiles, o_tiles = grid(B, G, Cpg, Ho, Wo, N, cfg)
    dev = X.device.index
    f = _kernel(name(cfg, (kh, kw), stride, dilation), dev)
    handle = torch.cuda.current_stream(X.device).cuda_stream
    stream = (cupy.cuda.Stream.from_external(_StreamHandle(handle))
              if hasattr(cupy.cuda.Stream, "from_external") else cupy.cuda.ExternalStream(handle))
    i32 = np.int32
    with cupy.cuda.Device(dev), stream:
        f((gx, gy, gz), (256,),
          (np.uint64(X.data_ptr()), np.uint64(Wr.data_ptr()), np.uint64(Y.data_ptr()),
           i32(Cg), i32(Cpg), i32(G), i32(B), i32(H), i32(W), i32(Ho), i32(Wo), i32(ph),
           i32(pw), np.int64(N), i32(px_tiles), i32(o_tiles), i32(transposed)))
    return Y
