"""``conv2d_moments``' own CUDA kernels (CUDA C++ compiled by CuPy): the convolution of a
covariance's rows, the symmetrisation, the variances layout's quadratic forms, and a
depthwise layer's full layout.

Owns ``SOURCE``'s kernels ``rows_conv``, ``symmetrize``, ``var_forms``, ``var_tiles`` and
``depthwise_full``, their compilation (one ``cupy.RawModule`` an instantiation, once per
process) and their launch on torch CUDA tensors, on torch's current stream.

``var_forms``: each output variance is the quadratic form ``w^T block w`` of its output
channel's weights ``w`` (``N = Cg kh kw`` of them) with the ``(N, N)`` block of gamma that
its position's window reads (docs/moments.md). The kernel reads each block where it lies
in gamma (any strides; no copy), each thread a few of a position's columns and a segment
of its rows for up to 16 output channels (8 in float64), and writes its partial sum; the
sum over a position's threads follows (a torch sum: no atomics, the same bits every run).
The threads of a warp take neighbouring columns of one position, and the threads of one
position's chunks of channels run in one block, reading the same entries of gamma.
``var_tiles`` makes the same partial sums for a full gamma's larger windows as a product
of tiles staged in shared memory: a block takes one position, up to 64 output channels and
64 columns, and reads each entry of the block once.

``symmetrize`` writes ``(A + A^T) / 2`` of each square matrix of a stack, in place or into
another array: a thread takes a tile on or right of the diagonal and its mirror, reads both
and writes both (no thread reads what another writes), so the stack is read once and
written once, against three reads and two writes for a transposed copy and an add.

``rows_conv``: for ``X`` of shape ``(B, Ci, H, W, N)`` and weights ``w`` ``(Co, Cg, kh, kw)``
in ``G`` groups it computes, in float32,

    Y[b, o, y, x, n] = sum over c < Cg, u < kh, v < kw of
                       w[o, c, u, v] X[b, g Cg + c, y sh + u dh - ph, x sw + v dw - pw, n]

(``g = o // (Co / G)``; terms in the padding absent): the convolution along a covariance's
outer index set, the inner one (``n``) riding along, stored as it is or transposed
(``(B, N, Co, Ho, Wo)``). ``conv2d_moments``' full layout is two of them, the first one
transposed; its diagonal layout starts with one (docs/moments.md, "On CUDA"). It is used
where cuDNN's float32 convolutions of those shapes are slower: few output channels a group.

Design. For one output position ``(y, x)`` and one kernel offset ``(u, v)`` the work is a
matrix product, ``Y[o, n] += sum_c w[o, c, u, v] X[c, iy, ix, n]``, given to the tensor
cores: TF32 ``mma.sync`` m16n8k8, its 16 rows ``n``, its 8 columns output channels, its 8
terms input channels. Each float32 operand is split into two TF32 numbers (``hi`` rounded,
``lo`` the rest rounded) and each product made of three (``lo hi``, ``hi lo``, ``hi hi``),
which keeps float32's accuracy ("3xTF32"). A warp holds ``8 NB`` output channels x ``16 NT``
values of ``n`` x ``PX`` output columns of one row; the rows of its products are mapped to
``n`` so that each lane's rows are one run of ``2 NT`` consecutive ``n``, which it loads
(16-byte loads) for its two input channels of the step and stores (16-byte stores; when
transposed, ``PX`` adjacent columns a store). For each step of 8 input channels and each
kernel row the warp splits the step's weights once, then for each of the
``(PX - 1) sw + (kw - 1) dw + 1`` input columns its columns read loads its runs, splits them
and makes the products of every tap that column feeds. Weights are reordered to ``(G, Cg,
kh, kw, Co / G)``. A block is 8 warps, ``xw`` along output columns (the fewest that cover the
row) and the rest along ``n``. The grid's x is the output row and column tile, fastest, so
that the blocks running together read the same input rows from L2; y the tile of ``n``; z
``(b, group, channel tile)``. Tiles of n and z beyond the grid's limits (65535) are looped
over. Warp-uniform: every branch around an ``mma.sync`` (all lanes must take it).

``depthwise_full``: ``K gamma K^T`` for one input channel a group, both convolutions in one
pass over gamma: a block takes a pair of output channels and 64 positions of the right
index set; for each input row the left windows read it makes the right convolution of
that row's entries into a ring in shared memory, then the left convolution from the ring
(the kernel's comment has the details). Its result is symmetrised afterwards, as the others.

Must not: wait on the host; import cupy before it is used.
"""

from __future__ import annotations

import sys
import threading

import numpy as np

SOURCE = r"""
// The tensor cores' TF32 product (mma.sync m16n8k8, documented in the PTX ISA): d += a b for
// a 16 x 8 A, an 8 x 8 B and a 16 x 8 D of float, spread over the warp's lanes (lane = 4 g +
// t): a[i] is A[g + 8 (i & 1)][t + 4 (i >> 1)], b[h] is B[t + 4 h][g], d[i] is
// D[g + 8 (i >> 1)][2 t + (i & 1)]. Every lane of the warp must call it together.
__device__ __forceinline__ void mma_tf32(float (&d)[4], const unsigned (&a)[4],
                                         const unsigned (&b)[2]) {
#ifdef __CUDA_ARCH__
  asm("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0, %1, %2, %3}, "
      "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
#else
  mma_on_host(d, a, b);  // the host build's emulation of the warp (tests)
#endif
}

// x rounded to TF32 (10 bits of mantissa; nearest, ties away), as the bits of a float
__device__ __forceinline__ unsigned tf32(float x) {
#ifdef __CUDA_ARCH__
  unsigned r;
  asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(r) : "f"(x));
  return r;
#else
  unsigned u;
  memcpy(&u, &x, 4);
  return (u + 0x1000u) & 0xffffe000u;
#endif
}

__device__ __forceinline__ float as_float(unsigned u) {
#ifdef __CUDA_ARCH__
  return __uint_as_float(u);
#else
  float x;
  memcpy(&x, &u, 4);
  return x;
#endif
}

// x = hi + lo + O(2^-22 x), both TF32: a product of two is three TF32 products, float32's
// accuracy ("3xTF32"; the lo lo term is below float32's rounding)
__device__ __forceinline__ void split(float x, unsigned& hi, unsigned& lo) {
  hi = tf32(x);
  lo = tf32(x - as_float(hi));
}

// RUN consecutive floats at p, entries n .. n + RUN - 1 of a row of N (zeros where !ok or
// past N), by 16-byte loads where vec
template <int RUN>
__device__ __forceinline__ void load_run(float (&x)[RUN], const float* p, bool ok,
                                         long long n, long long N, bool vec) {
  if (ok && vec && n + RUN <= N) {
#pragma unroll
    for (int h = 0; h < RUN; h += 4) {
      const float4 q = __ldg((const float4*)(p + h));
      x[h] = q.x, x[h + 1] = q.y, x[h + 2] = q.z, x[h + 3] = q.w;
    }
  } else {
#pragma unroll
    for (int h = 0; h < RUN; ++h) x[h] = ok && n + h < N ? __ldg(p + h) : 0.f;
  }
}

template <int NB, int NT, int PX, int KH, int KW, int SH, int SW, int DH, int DW>
__global__ void __launch_bounds__(256) rows_conv(
    const float* __restrict__ X, const float* __restrict__ Wr, float* __restrict__ Y,
    int Cg, int Cpg, int G, int B, int H, int W, int Ho, int Wo, int PH, int PW,
    long long N, int px_tiles, int o_tiles, int xw, int transposed)
{
  constexpr int NX = (PX - 1) * SW + (KW - 1) * DW + 1;  // input columns a warp reads
  constexpr int RUN = 2 * NT;  // consecutive n a lane loads and stores
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
  const int nw = 8 / xw;  // warps of a block along n
  const int py = blockIdx.x / px_tiles;
  const int px0 = (blockIdx.x % px_tiles * xw + warp % xw) * PX;
  const int Ci = Cg * G;
  const long long n_tiles = (N + 16 * NT - 1) / (16 * NT);
  const bool vec = N % 4 == 0;  // runs start on 16 bytes
  for (long long z = blockIdx.z; z < (long long)B * G * o_tiles; z += gridDim.z) {
    const int j0 = (int)(z % o_tiles) * 8 * NB;
    const int grp = (int)(z / o_tiles % G), b = (int)(z / o_tiles / G);
    if (px0 >= Wo) continue;  // warp-uniform; the kernel has no barrier
    const float* xb = X + (long long)(b * Ci + grp * Cg) * H * W * N;
    const float* wg = Wr + (long long)grp * Cg * KH * KW * Cpg;
    for (long long nt = (long long)blockIdx.y * nw + warp / xw; nt < n_tiles;
         nt += (long long)gridDim.y * nw) {
      // The warp's D is (16 NT n) x (8 NB o) for each of its PX columns; mma j of n-block
      // row m is n = n0 + RUN (m % 8) + 2 j + m / 8, so lane g's rows are its run of n
      const long long n = nt * 16 * NT + RUN * g;
      float acc[PX][NB][NT][4];
#pragma unroll
      for (int p = 0; p < PX; ++p)
#pragma unroll
        for (int i = 0; i < NB; ++i)
#pragma unroll
          for (int j = 0; j < NT; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[p][i][j][e] = 0.f;
      for (int c0 = 0; c0 < Cg; c0 += 8) {
        const int ca = c0 + t, cb = c0 + t + 4;  // the lane's k of A and B
        for (int u = 0; u < KH; ++u) {
          const int iy = py * SH + u * DH - PH;
          if (iy < 0 || iy >= H) continue;  // warp-uniform
          unsigned bh[KW][NB][2], bl[KW][NB][2];  // B[k][o] = w[o][c0 + k][u][v]
#pragma unroll
          for (int v = 0; v < KW; ++v)
#pragma unroll
            for (int i = 0; i < NB; ++i) {
              const int o = j0 + 8 * i + g;
              const float* w = wg + ((long long)u * KW + v) * Cpg + o;
              split(ca < Cg && o < Cpg ? __ldg(w + (long long)ca * KH * KW * Cpg) : 0.f,
                    bh[v][i][0], bl[v][i][0]);
              split(cb < Cg && o < Cpg ? __ldg(w + (long long)cb * KH * KW * Cpg) : 0.f,
                    bh[v][i][1], bl[v][i][1]);
            }
#pragma unroll
          for (int tx = 0; tx < NX; ++tx) {
            const int ix = px0 * SW - PW + tx;
            if (ix < 0 || ix >= W) continue;  // warp-uniform
            float xa[RUN], xc[RUN];  // channels ca and cb, the lane's run of n
            const float* r = xb + ((long long)iy * W + ix) * N + n;
            load_run(xa, r + (long long)ca * H * W * N, ca < Cg, n, N, vec);
            load_run(xc, r + (long long)cb * H * W * N, cb < Cg, n, N, vec);
            unsigned ah[NT][4], al[NT][4];
#pragma unroll
            for (int j = 0; j < NT; ++j) {
              split(xa[2 * j], ah[j][0], al[j][0]);
              split(xa[2 * j + 1], ah[j][1], al[j][1]);
              split(xc[2 * j], ah[j][2], al[j][2]);
              split(xc[2 * j + 1], ah[j][3], al[j][3]);
            }
#pragma unroll
            for (int v = 0; v < KW; ++v) {
              const int p = (tx - v * DW) / SW;  // the output column this tap feeds
              if (tx < v * DW || (tx - v * DW) % SW != 0 || p >= PX) continue;
#pragma unroll
              for (int i = 0; i < NB; ++i)
#pragma unroll
                for (int j = 0; j < NT; ++j) {
                  mma_tf32(acc[p][i][j], al[j], bh[v][i]);
                  mma_tf32(acc[p][i][j], ah[j], bl[v][i]);
                  mma_tf32(acc[p][i][j], ah[j], bh[v][i]);
                }
            }
          }
        }
      }
      // lane (g, t) holds, for o = j0 + 8 i + 2 t + e, the run n .. n + RUN - 1:
      // acc[p][i][j][e] at n + 2 j and acc[p][i][j][e + 2] at n + 2 j + 1
      if (transposed) {  // Y^T (B, N, Co Ho Wo): for each n and o, PX adjacent columns
        const long long Q = (long long)Ho * Wo;
        const bool vec4 = PX == 4 && Wo % 4 == 0;  // 16-byte stores (px0, Q, Wo multiples of 4)
#pragma unroll
        for (int i = 0; i < NB; ++i)
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const int o = j0 + 8 * i + 2 * t + e;
            if (o >= Cpg) continue;
#pragma unroll
            for (int h = 0; h < RUN; ++h) {
              if (n + h >= N) break;
              float* yr = Y + ((long long)b * N + n + h) * G * Cpg * Q + (grp * Cpg + o) * Q
                          + (long long)py * Wo + px0;
              const int j = h / 2, f = e + 2 * (h % 2);
              if (vec4) {
                *(float4*)yr = make_float4(acc[0][i][j][f], acc[1 % PX][i][j][f],
                                           acc[2 % PX][i][j][f], acc[3 % PX][i][j][f]);
              } else {
#pragma unroll
                for (int p = 0; p < PX; ++p)
                  if (px0 + p < Wo) yr[p] = acc[p][i][j][f];
              }
            }
          }
        continue;
      }
#pragma unroll
      for (int i = 0; i < NB; ++i)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int o = j0 + 8 * i + 2 * t + e;
          if (o >= Cpg) continue;
#pragma unroll
          for (int p = 0; p < PX; ++p) {
            if (px0 + p >= Wo) break;
            float* y = Y + (((long long)(b * G + grp) * Cpg + o) * Ho * Wo
                            + (long long)py * Wo + px0 + p) * N + n;
            float run[RUN];
#pragma unroll
            for (int h = 0; h < RUN; ++h) run[h] = acc[p][i][h / 2][e + 2 * (h % 2)];
            if (vec && n + RUN <= N) {
#pragma unroll
              for (int h = 0; h < RUN; h += 4)
                *(float4*)(y + h) = make_float4(run[h], run[h + 1], run[h + 2], run[h + 3]);
            } else {
#pragma unroll
              for (int h = 0; h < RUN; ++h)
                if (n + h < N) y[h] = run[h];
            }
          }
        }
    }
  }
}

// (A + A^T) / 2 of each (r, r) matrix of a stack of B, into D (D == A: in place). Thread
// (I, J), J >= I, takes the TS x TS tiles (I, J) and (J, I), rows of 32 bytes; the lanes of
// a warp take consecutive J, so the tile rows they read and write on the (I, J) side are
// contiguous, and whole 32-byte sectors on the mirror side.
template <typename T>
__global__ void __launch_bounds__(128) symmetrize(const T* A, T* D, long long r, long long B,
                                                  int vec)  // every tile row on 16 bytes
{
  constexpr int TS = 32 / sizeof(T), VS = 16 / sizeof(T);
  struct alignas(16) V { T x[VS]; };
  const long long tiles = (r + TS - 1) / TS;
  for (long long b = blockIdx.z; b < B; b += gridDim.z) {
    const T* a = A + b * r * r;
    T* d = D + b * r * r;
    for (long long I = blockIdx.y; I < tiles; I += gridDim.y) {
      const long long J = I + (long long)blockIdx.x * blockDim.x + threadIdx.x;
      if (J >= tiles) continue;
      const long long i0 = I * TS, j0 = J * TS;
      const bool whole = vec && j0 + TS <= r;  // (I, J) and (J, I) whole, as j0 >= i0
      // u[i][j] = a[i0 + i][j0 + j], v[j][i] = a[j0 + j][i0 + i]
      alignas(16) T u[TS][TS], v[TS][TS];
      auto load = [&](long long row0, long long col0, T (&x)[TS][TS]) {
#pragma unroll
        for (int i = 0; i < TS; ++i) {
          const T* p = a + (row0 + i) * r + col0;
          if (whole) {
#pragma unroll
            for (int h = 0; h < TS; h += VS) *(V*)&x[i][h] = *(const V*)(p + h);
          } else {
#pragma unroll
            for (int j = 0; j < TS; ++j)
              x[i][j] = row0 + i < r && col0 + j < r ? p[j] : T(0);
          }
        }
      };
      load(i0, j0, u);
      load(j0, i0, v);
#pragma unroll
      for (int i = 0; i < TS; ++i)
#pragma unroll
        for (int j = 0; j < TS; ++j) {
          // 0.5 u + 0.5 v is (u + v) / 2 rounded once (halving is exact); the two entries
          // get the one value: bitwise symmetric
          const T s = T(0.5) * u[i][j] + T(0.5) * v[j][i];
          u[i][j] = s;
          v[j][i] = s;
        }
      auto store = [&](long long row0, long long col0, T (&x)[TS][TS]) {
#pragma unroll
        for (int i = 0; i < TS; ++i) {
          T* p = d + (row0 + i) * r + col0;
          if (whole) {
#pragma unroll
            for (int h = 0; h < TS; h += VS) *(V*)(p + h) = *(const V*)&x[i][h];
          } else {
#pragma unroll
            for (int j = 0; j < TS; ++j)
              if (row0 + i < r && col0 + j < r) p[j] = x[i][j];
          }
        }
      };
      store(i0, j0, u);
      store(j0, i0, v);
    }
  }
}

// The variances layout's quadratic forms, in partial sums: for output position (i0 + ii, j)
// of image b and group grp, and output channel c of chunk k (channel grp Cpg + k CC + c),
//   P[b, grp, k CC + c, ii, j, rs TPC + ct] = sum over the thread's columns a' and rows a of
//                                            w[c, a'] w[c, a] gamma[a(i, j), a'(i, j)]
// where a = (cl, u, v) < N = Cg KH KW is input entry (grp Cg + cl, i SH + u DH - PH,
// j SW + v DW - PW) (terms in the padding absent), the thread's columns are c0 + ct,
// c0 + ct + TPC, ... below c1 and its rows r0 .. r1 - 1: the rows' segment rs of RS (all
// columns), or, for a channel-diagonal gamma (diag; sc1 is 0), channel rs's block alone
// (RS = Cg). The sum over a position's TPC RS slots is its variance. Each thread makes NC
// columns' sums U[n][c] = sum over a of w[c, a] gamma[a, a'_n] at once, so a row's CC
// weights (one vector load) serve NC CC products.
template <typename T, int CC, int NC>
__global__ void __launch_bounds__(128) var_forms(
    const T* __restrict__ g, const T* __restrict__ wt, T* __restrict__ P, long long sb,
    long long sc, long long sx, long long sy, long long sc1, long long sx1, long long sy1,
    int Cg, int G, int H, int W, int Wo, int KH, int KW, int SH, int SW, int PH, int PW,
    int DH, int DW, int B, int i0, int rows, int chunks, int TPC, int RS, int diag)
{
  struct alignas(CC * sizeof(T) < 16 ? CC * sizeof(T) : 16) WV { T x[CC]; };
  const int KK = KH * KW, N = Cg * KK, S = TPC * RS;
  const long long Cpad = (long long)chunks * CC;  // wt is (G, N, Cpad), 0 past Cpg
  const long long total = (long long)B * G * rows * Wo * chunks * S;
  for (long long t = (long long)blockIdx.x * blockDim.x + threadIdx.x; t < total;
       t += (long long)gridDim.x * blockDim.x) {
    // ct fastest (a warp's lanes: neighbouring columns of one position), then the chunks
    // of channels (the same entries of gamma, read by the warps of one block)
    long long q = t;
    const int ct = (int)(q % TPC);
    q /= TPC;
    const int k = (int)(q % chunks);
    q /= chunks;
    const int rs = (int)(q % RS);
    q /= RS;
    const int j = (int)(q % Wo);
    q /= Wo;
    const int ii = (int)(q % rows);
    q /= rows;
    const int grp = (int)(q % G), b = (int)(q / G), i = i0 + ii;
    int r0, r1, c0, c1;
    if (diag) {
      r0 = c0 = rs * KK;
      r1 = c1 = r0 + KK;
    } else {
      const int RL = (N + RS - 1) / RS;
      r0 = rs * RL;
      r1 = r0 + RL < N ? r0 + RL : N;
      c0 = 0;
      c1 = N;
    }
    const T* g0 = g + b * sb + (long long)grp * Cg * (sc + sc1);
    const T* wg = wt + (long long)grp * N * Cpad + k * CC;
    T part[CC];
#pragma unroll
    for (int c = 0; c < CC; ++c) part[c] = T(0);
    for (int m0 = c0 + ct; m0 < c1; m0 += NC * TPC) {
      long long co[NC];  // the columns' offsets in gamma, where ok
      bool ok[NC];
#pragma unroll
      for (int n = 0; n < NC; ++n) {
        const int a = m0 + n * TPC, cl = a / KK, u = a % KK / KW, v = a % KW;
        const int x = i * SH + u * DH - PH, y = j * SW + v * DW - PW;
        ok[n] = a < c1 && x >= 0 && x < H && y >= 0 && y < W;
        co[n] = cl * sc1 + x * sx1 + y * sy1;
      }
      T U[NC][CC];
#pragma unroll
      for (int n = 0; n < NC; ++n)
#pragma unroll
        for (int c = 0; c < CC; ++c) U[n][c] = T(0);
      int cl = r0 / KK, u = r0 % KK / KW, v = r0 % KW;
      for (int a = r0; a < r1; ++a) {
        const int x = i * SH + u * DH - PH, y = j * SW + v * DW - PW;
        if (x >= 0 && x < H && y >= 0 && y < W) {
          const T* gr = g0 + cl * sc + x * sx + y * sy;
          T gv[NC];
#pragma unroll
          for (int n = 0; n < NC; ++n) gv[n] = ok[n] ? __ldg(gr + co[n]) : T(0);
          const WV wv = *(const WV*)(wg + a * Cpad);
#pragma unroll
          for (int n = 0; n < NC; ++n)
#pragma unroll
            for (int c = 0; c < CC; ++c) U[n][c] += wv.x[c] * gv[n];
        }
        if (++v == KW) {
          v = 0;
          if (++u == KH) u = 0, ++cl;
        }
      }
#pragma unroll
      for (int n = 0; n < NC; ++n) {
        if (m0 + n * TPC >= c1) break;
        const WV wc = *(const WV*)(wg + (m0 + n * TPC) * Cpad);
#pragma unroll
        for (int c = 0; c < CC; ++c) part[c] += U[n][c] * wc.x[c];
      }
    }
    const long long plane = (long long)rows * Wo * S;  // between output channels
    T* p = P + ((long long)(b * G + grp) * Cpad + k * CC) * plane + ((long long)ii * Wo + j) * S
           + rs * TPC + ct;
#pragma unroll
    for (int c = 0; c < CC; ++c) p[c * plane] = part[c];
  }
}

// The same partial sums by tiles staged in shared memory: a block takes output position
// (i0 + ii, j) of image b and group grp, the CT output channels of chunk k and the NT
// columns a' of tile n, and writes, for each channel c of the chunk,
//   P[b, grp, k CT + c, ii, j, n] = sum over the tile's a' and all a of
//                                   w[c, a'] w[c, a] gamma[a(i, j), a'(i, j)].
// U[c][a'] = sum_a w[c, a] gamma[a, a'] is a product of tiles: for each KT rows a, the
// block stages those rows of its columns of gamma (each entry read once) and of the
// weights, and each thread adds a TM x TN piece of the product (TM channels, TN columns)
// from shared memory; then each thread sums U w[c, a'] over its columns, and the block
// those sums over its threads of a channel. For full gamma (a channel-diagonal one's
// blocks are sparse: var_forms).
template <typename T, int CT>
__global__ void __launch_bounds__(128) var_tiles(
    const T* __restrict__ g, const T* __restrict__ wt, T* __restrict__ P, long long sb,
    long long sc, long long sx, long long sy, long long sc1, long long sx1, long long sy1,
    int Cg, int G, int H, int W, int Wo, int KH, int KW, int SH, int SW, int PH, int PW,
    int DH, int DW, int B, int i0, int rows, int chunks, int tiles)
{
  constexpr int KT = 16, NT = 64, TM = CT / 16, TN = NT / 8;
  __shared__ __align__(16) T gs[KT][NT];
  __shared__ __align__(16) T ws[KT][CT];
  __shared__ T red[8][CT];
  __shared__ long long ro[2][KT];  // rows' offsets in gamma, -1 outside the block
  struct alignas(TM * sizeof(T) < 16 ? TM * sizeof(T) : 16) WV { T x[TM]; };
  struct alignas(16) GV { T x[TN]; };
  const int KK = KH * KW, N = Cg * KK, tc = threadIdx.x % 16, tn = threadIdx.x / 16;
  // a thread stages column e0 of the tile of gamma, its rows r0, r0 + 2, ...
  const int e0 = threadIdx.x % NT, r0 = threadIdx.x / NT;
  const long long Cpad = (long long)chunks * CT;
  const long long total = (long long)B * G * rows * Wo * chunks * tiles;
  for (long long t = blockIdx.x; t < total; t += gridDim.x) {
    long long q = t;
    const int n = (int)(q % tiles);
    q /= tiles;
    const int k = (int)(q % chunks);
    q /= chunks;
    const int j = (int)(q % Wo);
    q /= Wo;
    const int ii = (int)(q % rows);
    q /= rows;
    const int grp = (int)(q % G), b = (int)(q / G), i = i0 + ii;
    const T* g0 = g + b * sb + (long long)grp * Cg * (sc + sc1);
    const T* wg = wt + (long long)grp * N * Cpad + k * CT;
    long long co = -1;  // the staged column's offset in gamma, -1 outside the block
    const int a1 = n * NT + e0;
    {
      const int u = a1 % KK / KW, v = a1 % KW;
      const int x = i * SH + u * DH - PH, y = j * SW + v * DW - PW;
      if (a1 < N && x >= 0 && x < H && y >= 0 && y < W) co = a1 / KK * sc1 + x * sx1 + y * sy1;
    }
    T U[TM][TN];
#pragma unroll
    for (int m = 0; m < TM; ++m)
#pragma unroll
      for (int c = 0; c < TN; ++c) U[m][c] = T(0);
    // a tile's row offsets are made while the last tile is staged
    auto row = [&](int odd, int a) {
      const int cl = a / KK, u = a % KK / KW, v = a % KW;
      const int x = i * SH + u * DH - PH, y = j * SW + v * DW - PW;
      ro[odd][threadIdx.x] =
          a < N && x >= 0 && x < H && y >= 0 && y < W ? cl * sc + x * sx + y * sy : -1;
    };
    if (threadIdx.x < KT) row(0, threadIdx.x);
    for (int a0 = 0, odd = 0; a0 < N; a0 += KT, odd ^= 1) {
      __syncthreads();  // the last tile's products are done, this tile's rows made
#pragma unroll
      for (int r = r0; r < KT; r += 128 / NT) {
        const long long o = ro[odd][r];
        gs[r][e0] = o >= 0 && co >= 0 ? __ldg(g0 + o + co) : T(0);
      }
      if (threadIdx.x < KT) row(odd ^ 1, a0 + KT + threadIdx.x);
      for (int e = threadIdx.x; e < KT * CT; e += 128)
        ws[e / CT][e % CT] = a0 + e / CT < N ? wg[(a0 + e / CT) * Cpad + e % CT] : T(0);
      __syncthreads();
#pragma unroll
      for (int r = 0; r < KT; ++r) {
        const WV wv = *(const WV*)&ws[r][tc * TM];
        const GV gv = *(const GV*)&gs[r][tn * TN];
#pragma unroll
        for (int m = 0; m < TM; ++m)
#pragma unroll
          for (int c = 0; c < TN; ++c) U[m][c] += wv.x[m] * gv.x[c];
      }
    }
    T part[TM];
#pragma unroll
    for (int m = 0; m < TM; ++m) part[m] = T(0);
#pragma unroll
    for (int c = 0; c < TN; ++c) {
      const int a = n * NT + tn * TN + c;
      if (a < N) {
        const WV wc = *(const WV*)(wg + a * Cpad + tc * TM);
#pragma unroll
        for (int m = 0; m < TM; ++m) part[m] += U[m][c] * wc.x[m];
      }
    }
#pragma unroll
    for (int m = 0; m < TM; ++m) red[tn][tc * TM + m] = part[m];
    __syncthreads();
    if (threadIdx.x < CT) {
      T sum = T(0);
#pragma unroll
      for (int r = 0; r < 8; ++r) sum += red[r][threadIdx.x];
      P[((long long)(b * G + grp) * Cpad + k * CT + threadIdx.x) * rows * Wo * tiles
        + ((long long)ii * Wo + j) * tiles + n] = sum;
    }
  }
}

// K gamma K^T in the full layout for one input channel a group (Cg = 1: depthwise), one
// pass over gamma: for image b, output channels c0 and c1 (input channels c0 / M, c1 / M)
// and output positions p0 = (i0, j0), p1 = (i1, j1),
//   A[b, c0, p0, c1, p1] = sum over u, v of w[c0, u, v] T[x(i0, u), y(j0, v)],
//   T[x, y] = sum over u', v' of w[c1, u', v'] gamma[b, c0 / M, x, y, c1 / M, x(i1, u'),
//                                                    y(j1, v')]
// with x(i, u) = i SH + u DH - PH, y(j, v) = j SW + v DW - PW (terms in the padding absent).
// A block takes (b, c0, c1) and a tile of 16 quads of positions p1 (NJ = 4 neighbours
// along j1, whose windows share columns: NC loads a row of gamma for NJ of T's entries).
// For each row x that a row i0 reads, once, it makes T[x, y] for every y and each quad
// into a ring of R = (KH - 1) DH + 1 rows in shared memory (a window's rows span R), the
// 8 threads of a quad taking every 8th y; then the outputs of row i0 from the ring, the
// same threads taking every 8th j0. Each entry of gamma's block is read from memory once.
template <typename T, int KH, int KW, int SH, int SW, int DH, int DW>
__global__ void __launch_bounds__(128, 4) depthwise_full(
    const T* __restrict__ g, const T* __restrict__ w, T* __restrict__ A, long long sb,
    long long sc, long long sx, long long sy, long long sc1, long long sx1, long long sy1,
    int M, int Co, int H, int W, int Ho, int Wo, int PH, int PW, long long items)
{
  constexpr int NJ = 4, R = (KH - 1) * DH + 1, NC = (NJ - 1) * SW + (KW - 1) * DW + 1;
  struct alignas(16) V { T x[NJ]; };
#ifdef __CUDACC__
  extern __shared__ __align__(16) unsigned char ring_bytes[];
#else
  __shared__ __align__(16) unsigned char ring_bytes[48 << 10];  // the host build (tests)
#endif
  const int tq = threadIdx.x % 16, ty = threadIdx.x / 16;
  V* const ring = (V*)ring_bytes + tq;  // ring[(s W + y) 16]: quad tq's column
  const int JQ = (Wo + NJ - 1) / NJ, quads = Ho * JQ, tiles = (quads + 15) / 16;
  const long long Q = (long long)Ho * Wo;
  for (long long t = blockIdx.x; t < items; t += gridDim.x) {
    long long q = t;
    const int tile = (int)(q % tiles);
    q /= tiles;
    const int c1 = (int)(q % Co);
    q /= Co;
    const int c0 = (int)(q % Co);
    const long long b = q / Co;
    const int e = tile * 16 + tq, i1 = e / JQ, j1 = e % JQ * NJ;
    const bool live = e < quads;  // threads past the last quad only keep the syncs
    const T* gb = g + b * sb + (c0 / M) * sc + (c1 / M) * sc1;
    T wl[KH * KW], wr[KH * KW];
#pragma unroll
    for (int k = 0; k < KH * KW; ++k) {
      wl[k] = __ldg(w + (long long)c0 * KH * KW + k);
      wr[k] = __ldg(w + (long long)c1 * KH * KW + k);
    }
    T* a = A + (b * Co + c0) * Q * Co * Q + c1 * Q + (long long)i1 * Wo + j1;
    int held[R];  // the row x each slot of the ring holds
#pragma unroll
    for (int s = 0; s < R; ++s) held[s] = -1;
    for (int i0 = 0; i0 < Ho; ++i0) {
#pragma unroll
      for (int u = 0; u < KH; ++u) {  // the rows x that row i0 reads, into the ring
        const int x = i0 * SH + u * DH - PH;
        if (x < 0 || x >= H || held[x % R] == x) continue;
        held[x % R] = x;
        V* r = ring + (x % R) * W * 16;
        for (int y = ty; y < W && live; y += 8) {
          const T* gxy = gb + x * sx + y * sy;
          V acc = {};
#pragma unroll
          for (int u1 = 0; u1 < KH; ++u1) {
            const int x1 = i1 * SH + u1 * DH - PH;
            if (x1 < 0 || x1 >= H) continue;
            T col[NC];
#pragma unroll
            for (int c = 0; c < NC; ++c) {
              const int y1 = j1 * SW - PW + c;
              col[c] = y1 >= 0 && y1 < W ? __ldg(gxy + x1 * sx1 + y1 * sy1) : T(0);
            }
#pragma unroll
            for (int n = 0; n < NJ; ++n)
#pragma unroll
              for (int v1 = 0; v1 < KW; ++v1) acc.x[n] += wr[u1 * KW + v1] * col[n * SW + v1 * DW];
          }
          r[y * 16] = acc;
        }
      }
      __syncthreads();  // the ring's rows are made
      for (int j0 = ty; j0 < Wo && live; j0 += 8) {
        V o = {};
#pragma unroll
        for (int u = 0; u < KH; ++u) {
          const int x = i0 * SH + u * DH - PH;
          if (x < 0 || x >= H) continue;
          const V* r = ring + (x % R) * W * 16;
#pragma unroll
          for (int v = 0; v < KW; ++v) {
            const int y = j0 * SW + v * DW - PW;
            if (y < 0 || y >= W) continue;
            const V tv = r[y * 16];
#pragma unroll
            for (int n = 0; n < NJ; ++n) o.x[n] += wl[u * KW + v] * tv.x[n];
          }
        }
        T* out = a + (long long)(i0 * Wo + j0) * Co * Q;
#pragma unroll
        for (int n = 0; n < NJ; ++n)
          if (j1 + n < Wo) out[n] = o.x[n];
      }
      __syncthreads();  // row i0's outputs are read from the ring
    }
  }
}
"""

_OPTIONS = ("-std=c++14",)

_lock = threading.Lock()
_kernels = {}  # (name expression, device) -> cupy.RawKernel


#: A warp's tile by its blocks of 8 output channels NB: (NT, PX), ``16 NT`` entries of n x
#: ``PX`` output columns (H100, step one, 16ch with NB 2: (4, 4) 11.2 ms, (4, 2) 14.4, (2, 4)
#: 13.1; with NB 1 (4, 4) 14.7, (8, 2) 17.5; 64ch / strided with NB 4: (2, 4) 23.4 / 8.2,
#: (2, 2) 35.3 / 10.6).
_TILES = {1: (4, 4), 2: (4, 4), 4: (2, 4)}


def tiles(Cpg: int):
    """(NB, NT, PX): a warp's tile is ``8 NB`` output channels (the fewest blocks of 8 that
    cover ``Cpg``, at most 4) x ``16 NT`` entries of n x ``PX`` output columns."""
    nb = 1 if Cpg <= 8 else 2 if Cpg <= 16 else 4
    return (nb, *_TILES[nb])


def grid(B, G, Cpg, Ho, Wo, N, cfg):
    """The launch grid and the kernel's (px_tiles, o_tiles, xw) for one call: ``xw`` warps
    of a block along output columns (the fewest that cover the row, at most 8), the rest
    along n."""
    NB, NT, PX = cfg
    xw = 1
    while xw < 8 and xw * PX < Wo:
        xw *= 2
    px_tiles = -(-Wo // (xw * PX))
    o_tiles = -(-Cpg // (8 * NB))
    n_blocks = -(-N // (16 * NT * (8 // xw)))
    return ((Ho * px_tiles, min(n_blocks, 65535), min(B * G * o_tiles, 65535)),
            (px_tiles, o_tiles, xw))


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


def _out_size(H, W, kh, kw, stride, padding, dilation):
    """The output's ``(Ho, Wo)``."""
    return tuple((n + 2 * p - d * (k - 1) - 1) // s + 1
                 for n, k, s, p, d in zip((H, W), (kh, kw), stride, padding, dilation))


def rows_conv(X, w, stride, padding, dilation, G, transposed=False):
    """``Y`` above for torch float32 CUDA tensors ``X`` ``(B, Ci, H, W, N)`` and ``w``
    ``(Co, Ci / G, kh, kw)``; a new contiguous tensor, queued on torch's current
    stream; with ``transposed``, stored transposed: ``(B, N, Co, Ho, Wo)``."""
    torch = sys.modules["torch"]
    B, Ci, H, W, N = X.shape
    Co, Cg, kh, kw = w.shape
    Cpg = Co // G
    ph, pw = padding
    Ho, Wo = _out_size(H, W, kh, kw, stride, padding, dilation)
    Y = torch.empty((B, N, Co, Ho, Wo) if transposed else (B, Co, Ho, Wo, N), dtype=X.dtype,
                    device=X.device)
    if Y.numel() == 0:
        return Y
    X = X.contiguous()
    Wr = w.reshape(G, Cpg, Cg, kh, kw).permute(0, 2, 3, 4, 1).contiguous()
    cfg = tiles(Cpg)
    launch, args = grid(B, G, Cpg, Ho, Wo, N, cfg)
    i32 = np.int32
    _launch(name(cfg, (kh, kw), stride, dilation), X.device, launch, 256,
            (np.uint64(X.data_ptr()), np.uint64(Wr.data_ptr()), np.uint64(Y.data_ptr()),
             i32(Cg), i32(Cpg), i32(G), i32(B), i32(H), i32(W), i32(Ho), i32(Wo), i32(ph),
             i32(pw), np.int64(N), *map(i32, args), i32(transposed)))
    return Y


def symmetrize_grid(B, r, itemsize):
    """``symmetrize``'s launch grid for a stack of ``B`` ``(r, r)`` matrices (128 threads a
    block along ``J - I``, ``I`` on y, the matrix on z; beyond 65535 looped)."""
    tiles = -(-r // (32 // itemsize))
    return (-(-tiles // 128), min(tiles, 65535), min(B, 65535))


def symmetrize(A, D):
    """``D = (A + A^T) / 2`` for contiguous torch CUDA tensors ``A``, ``D`` ``(B, r, r)`` of
    one dtype, float32 or float64 (``D`` may be ``A``), queued on torch's current stream."""
    torch = sys.modules["torch"]
    B, r, _ = A.shape
    if A.numel() == 0:
        return D
    T = {torch.float32: "float", torch.float64: "double"}[A.dtype]
    vec = r * A.element_size() % 16 == 0 and A.data_ptr() % 16 == 0 == D.data_ptr() % 16
    _launch(f"symmetrize<{T}>", A.device, symmetrize_grid(B, r, A.element_size()), 128,
            (np.uint64(A.data_ptr()), np.uint64(D.data_ptr()), np.int64(r), np.int64(B),
             np.int32(vec)))
    return D


#: ``var_forms``' output channels a thread sums at once (at most), by item size (H100, the
#: kernel alone, float32: 16 against 8 channels, 16ch layer 0.63 against 0.87 ms, strided
#: 0.41 against 0.55 ms), and the columns it takes together.
VAR_CC = {4: 16, 8: 8}
VAR_NC = 2
#: Full gamma's forms of windows of at least this many entries by ``var_tiles`` (H100, the
#: kernel alone: 64ch 3.60 -> 1.42 ms, strided 0.45 -> 0.36 ms, 16ch 0.69 -> 0.62 ms;
#: depthwise (9) 0.18 against 0.31 ms).
VAR_TILED_N = 64
#: Threads a launch should have (row segments are added until it does; strided layer 0.66
#: -> 0.41 ms against 2^15) and the partial sums a launch may hold (output rows are split
#: over launches past it).
VAR_THREADS = 1 << 17
VAR_PARTIALS = 1 << 24


def var_plan(B, G, Cg, Cpg, KK, Ho, Wo, diag, itemsize):
    """``var_forms``' split of one call: ``(CC, chunks, TPC, RS, rows)``: ``CC`` output
    channels a thread (the fewest powers of two that cover ``Cpg``, at most ``VAR_CC``) in
    ``chunks``; ``TPC`` threads share a position's columns (a power of two, at most 32,
    each at least 8 columns) and ``RS`` its rows (the channels of a channel-diagonal gamma;
    otherwise segments of at least 32 rows, until ``VAR_THREADS``); ``rows`` output rows a
    launch."""
    CC = 1
    while CC < min(Cpg, VAR_CC[itemsize]):
        CC *= 2
    chunks = -(-Cpg // CC)
    cols = KK if diag else Cg * KK
    TPC = 1
    while TPC < 32 and 16 * TPC <= cols:
        TPC *= 2
    RS = Cg if diag else 1
    while not diag and B * G * Ho * Wo * chunks * TPC * RS < VAR_THREADS and cols >= 64 * RS:
        RS *= 2
    rows = max(1, min(Ho, VAR_PARTIALS // (B * G * chunks * CC * Wo * TPC * RS)))
    return CC, chunks, TPC, RS, rows


def var_forms(g, w, stride, padding, dilation, G, diag):
    """The diagonal of ``K gamma K^T``, ``(B, Co, Ho, Wo)``, for torch CUDA tensors of one
    dtype (float32 or float64, any strides): ``gamma`` full ``(B, Ci, H, W, Ci, H, W)``, or
    channel-diagonal ``(B, Ci, H, W, H, W)`` where ``diag``; ``w`` ``(Co, Ci / G, kh,
    kw)``. A new tensor, queued on torch's current stream: ``var_forms``' partial sums,
    then their sum."""
    torch = sys.modules["torch"]
    B, Ci, H, W = g.shape[:4]
    Co, Cg, kh, kw = w.shape
    Cpg, N = Co // G, Cg * kh * kw
    (sh, sw), (ph, pw), (dh, dw) = stride, padding, dilation
    Ho, Wo = _out_size(H, W, kh, kw, stride, padding, dilation)
    if B * Co * Ho * Wo == 0:
        return torch.empty((B, Co, Ho, Wo), dtype=g.dtype, device=g.device)
    T = {torch.float32: "float", torch.float64: "double"}[g.dtype]
    if not diag and N >= VAR_TILED_N:  # var_tiles: CT channels a block, tiles of 64 columns
        CC = 16
        while CC < min(Cpg, 64):
            CC *= 2
        chunks, S = -(-Cpg // CC), -(-N // 64)
        rows = max(1, min(Ho, VAR_PARTIALS // (B * G * chunks * CC * Wo * S)))
        expr, per_block, tail = f"var_tiles<{T}, {CC}>", 1, (chunks, S)
    else:
        CC, chunks, TPC, RS, rows = var_plan(B, G, Cg, Cpg, kh * kw, Ho, Wo, diag,
                                             g.element_size())
        S = TPC * RS
        expr, per_block = f"var_forms<{T}, {CC}, {VAR_NC}>", 128
        tail = (chunks, TPC, RS, diag)
    wt = torch.zeros((G, N, chunks * CC), dtype=g.dtype, device=g.device)
    wt[:, :, :Cpg] = w.reshape(G, Cpg, N).transpose(1, 2)
    sb, *st = g.stride()
    if diag:  # no second channel axis: its stride 0
        st = (*st[:3], 0, *st[3:])
    i32, i64 = np.int32, np.int64
    for i0 in range(0, Ho, rows):
        r = min(rows, Ho - i0)
        P = torch.empty((B, G, chunks * CC, r, Wo, S), dtype=g.dtype, device=g.device)
        total = B * G * r * Wo * chunks * S
        _launch(expr, g.device, (min(-(-total // per_block), 1 << 22),),
                128, (np.uint64(g.data_ptr()), np.uint64(wt.data_ptr()), np.uint64(P.data_ptr()),
                      *map(i64, (sb, *st)), *map(i32, (
                          Cg, G, H, W, Wo, kh, kw, sh, sw, ph, pw, dh, dw, B, i0, r, *tail))))
        part = P[:, :, :Cpg].sum(-1)
        if r == Ho:
            return part.reshape(B, Co, Ho, Wo)
        if i0 == 0:
            v = torch.empty((B, G, Cpg, Ho, Wo), dtype=g.dtype, device=g.device)
        v[:, :, :, i0:i0 + r] = part
    return v.reshape(B, Co, Ho, Wo)



#: Bytes of shared memory a block of ``depthwise_full`` may take (CUDA's default limit).
_SHARED_BYTES = 48 << 10


def _ring_bytes(W, kh, dh, itemsize):
    """Bytes of ``depthwise_full``'s ring: ``R`` rows of ``W`` entries for 16 quads of
    positions."""
    return ((kh - 1) * dh + 1) * W * 16 * 4 * itemsize


def depthwise_fits(W, kh, dh, itemsize) -> bool:
    """Whether ``depthwise_full``'s ring for input rows of ``W`` entries fits a block."""
    return _ring_bytes(W, kh, dh, itemsize) <= _SHARED_BYTES


def depthwise_name(T, k, stride, dilation) -> str:
    return "depthwise_full<{}, {}, {}, {}, {}, {}, {}>".format(T, *k, *stride, *dilation)


def depthwise_full(g, w, stride, padding, dilation, G):
    """``K gamma K^T`` in the full layout, ``(B, Co, Ho, Wo, Co, Ho, Wo)`` (unsymmetrised),
    for one input channel a group (``Ci = G``): torch CUDA tensors of one dtype (float32 or
    float64), ``gamma`` full ``(B, Ci, H, W, Ci, H, W)`` with any strides, ``w`` ``(Co, 1,
    kh, kw)``, where :func:`depthwise_fits` says so. A new tensor, queued on torch's current
    stream."""
    torch = sys.modules["torch"]
    B, Ci, H, W = g.shape[:4]
    Co, _, kh, kw = w.shape
    Ho, Wo = _out_size(H, W, kh, kw, stride, padding, dilation)
    A = torch.empty((B, Co, Ho, Wo, Co, Ho, Wo), dtype=g.dtype, device=g.device)
    if A.numel() == 0:
        return A
    items = B * Co * Co * -(-Ho * -(-Wo // 4) // 16)
    w = w.contiguous()
    T = {torch.float32: "float", torch.float64: "double"}[g.dtype]
    _launch(depthwise_name(T, (kh, kw), stride, dilation), g.device,
            (min(items, 1 << 22),), 128,
            (np.uint64(g.data_ptr()), np.uint64(w.data_ptr()), np.uint64(A.data_ptr()),
             *map(np.int64, g.stride()), *map(np.int32, (Co // G, Co, H, W, Ho, Wo, *padding)),
             np.int64(items)),
            shared_mem=_ring_bytes(W, kh, dilation[0], g.element_size()))
    return A

def _launch(expr, device, grid, block, args, shared_mem=0):
    """Kernel ``expr`` on torch's current stream of ``device`` (``shared_mem`` bytes of
    dynamic shared memory a block)."""
    import cupy

    from .cupy import _StreamHandle

    torch = sys.modules["torch"]
    handle = torch.cuda.current_stream(device).cuda_stream
    stream = (cupy.cuda.Stream.from_external(_StreamHandle(handle))
              if hasattr(cupy.cuda.Stream, "from_external") else cupy.cuda.ExternalStream(handle))
    with cupy.cuda.Device(device.index), stream:
        _kernel(expr, device.index)(grid, (block,), args, shared_mem=shared_mem)
