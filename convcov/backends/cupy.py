"""``cupy``: CUDA C++ kernels compiled by CuPy (NVRTC); the automatic first choice for CUDA arrays.

Owns the CUDA C++ source below (``SOURCE``), its compilation into ``cupy.RawModule`` objects
(templated on the storage and accumulation types: one module per type family, compiled
once per process, cached on disk by CuPy), the choice of kernels and launch sizes for one
call, and the launch itself on the arrays' device and on their library's current stream:
torch's for torch tensors, CuPy's for CuPy arrays; for other ``__cuda_array_interface__``
objects (numba device arrays) the stream ``out`` names, after the streams the inputs name
(``convcov._arrays.launch_streams``).

Design (docs/cupy.md has the byte counts and the measurements). The operation is
memory-bound, so the kernels are built around the bytes SPEC section 5 counts:

* ``cc_gsum`` reads the channel-diagonal of ``gamma`` exactly once, streaming, 16 bytes a
  load where the layout allows, and writes the per-group channel sum of
  ``gamma + mu (x) mu``: ``T[b, g, x0, y0, x1, y1]`` (the Gram matrix of ``mu`` rides
  along in the same pass).
* ``cc_sbox_walk`` forms ``S[b, g, i0, j0, i1, j1]``, the kh x kw box filter of ``T``
  along the diagonal offsets, by walks along the diagonals that keep the last kh - 1 row
  sums in registers (kw loads an element); ``cc_sbox`` (kh*kw loads an element) takes
  the cases the walk does not (strides or dilations along the rows, kh > 7).
* ``cc_stream`` streams ``out[b, c0, i0, j0, (c0,) i1, j1] += c[c0] * S[b, g(c0)]`` in
  address order, 16 bytes a load, re-reading ``S[b, g]`` from L2 (once for two channels
  where ``out`` is 16-bit); a contiguous diagonal-layout ``out`` is one flat axpy per
  ``(b, c0)``.
* ``cc_direct`` does it all in one launch, the channel sum inside the box filter: for
  problems so small that launches cost more than the arithmetic (the seed's toy), and for
  large strides, where ``T`` would cover many positions that no output reads.

Scratch: S and T, one buffer of ``B*G*((Ho*Wo)**2 + (H*W)**2)`` accumulation-type
elements, allocated stream-ordered from the arrays' library (so nothing grows with Ci*Ci
or Co). Terms with a position in the padding are skipped (SPEC section 1), so NaN/Inf in
``mu`` never meets a padded zero. Index arithmetic is 64-bit wherever an offset can pass
2**31; the arithmetic uses explicit IEEE (non flush-to-zero) instructions because CuPy
compiles with ``-ftz=true``; results are rounded once into ``out``'s dtype (float64 sums
reach float16/bfloat16 through round-to-odd float32, a single correct rounding).

The backward (``patch_moment_vjp``, docs/autograd.md's contract; docs/cupy.md "Backward")
is three more kernels: ``cc_vjp_gamma`` gathers ``D``, the adjoint of the box filter, from
``grad_S`` and streams it (rounded once, 16-byte streaming stores) into the
channel-diagonal of ``grad_gamma`` for every channel of the group; ``cc_vjp_mu`` forms
``grad_mu = (D + D^T) mu`` over the position pairs some offset links (tables from
``cc_vjp_link``), skipping the others, so absent terms stay absent. Scratch: ``D`` and
the link tables, only when ``grad_mu`` is wanted.

Kernels take one ``Args`` struct by value: a call copies the plan's templates (one int64
row a launch), writes its addresses in, and launches each kernel with the public
``cupy.RawKernel.__call__``, the row passed as a one-element NumPy array of the struct's
dtype (``_ARGS``: CuPy's documented way to pass a custom structure by value). The launches
go on CuPy's current stream, which is the launch stream itself for CuPy arrays and a CuPy
stream object made current around them for any other (``_stream_object``). No shared
memory is used: every tile's reuse is served by L1/L2. Repeated small calls are the
user's to capture into a CUDA graph (``torch.cuda.graphs``, or
``torch.compile(mode="reduce-overhead")``): a launch on torch's current stream with
scratch from torch's allocator and no host wait is captured like any torch kernel.

Must not: copy ``out`` or ``gamma``; synchronise the device or wait on the host; keep
scratch from one call to the next; build CUDA graphs for the user; import cupy before the
backend is used (``import convcov`` stays GPU-free).
"""

from __future__ import annotations

import contextlib
import struct
import threading

import numpy as np

from .._arrays import (CAPTURED, contiguous, diag_strides, launch_streams, torch_scratch,
                       torch_stream_getter, vector_width)
from .._errors import BackendError
from .._registry import Backend

#: Dtype names -> (code used by the kernels' run-time typed loads, C++ storage type, bytes).
_DTYPES = {
    "float16": (0, "f16", 2),
    "bfloat16": (1, "bf16", 2),
    "float32": (2, "float", 4),
    "float64": (3, "double", 8),
}
_ACC_CXX = {"float32": "float", "float64": "double"}

#: Fields of the kernels' ``Args`` struct, all 8 bytes wide, in order. The CUDA struct is
#: generated from this list, so the Python packing and the C++ layout cannot drift apart.
_FIELDS = (
    "out", "gamma", "mu", "c", "t", "s",     # device addresses (gamma, c: 0 when absent)
    "B", "G", "Cg", "Cog", "H", "W", "Ho", "Wo",
    "kh", "kw", "sh", "sw", "ph", "pw", "dh", "dw",
    "so0", "so1", "so2", "so3", "so4", "so5",  # out (b, c0, i0, j0, i1, j1), diagonal folded
    "sg0", "sg1", "sg2", "sg3", "sg4", "sg5",  # gamma (b, ci, x0, y0, x1, y1), diagonal folded
    "sm0", "sm1", "sm2", "sm3",                # mu (b, ci, x, y)
    "sc",                                      # c (0 for a 0-d c)
    "dt_out", "dt_gamma", "dt_mu", "dt_c",     # dtype codes (_DTYPES) for run-time typed loads
    "nchunk", "chunk",                         # output channels of a group split in chunks
    "nseg", "seg_len", "tiles",                # cc_stream: out[b, c0] as contiguous segments
    "n",                                       # work items of this launch
    # the backward (patch_moment_vjp): grad_S in; grad_gamma, grad_mu out; D, link: scratch
    "gs", "gg", "gm", "dsc", "lnk",            # device addresses (0 when absent)
    "ss0", "ss1", "ss2", "ss3", "ss4", "ss5",  # grad_S (b, g, i0, j0, i1, j1)
    "sgg0", "sgg1", "sgg2", "sgg3", "sgg4", "sgg5",  # grad_gamma, diagonal folded
    "sgm0", "sgm1", "sgm2", "sgm3",            # grad_mu (b, ci, x, y)
    "dt_gs", "dt_gm",                          # dtype codes of grad_S and grad_mu
    "c_value",                                 # double: c when c is a Python number (last)
)
_SLOT = {name: i for i, name in enumerate(_FIELDS)}
_ARGS_STRUCT = "struct Args {\n" + "".join(
    f"  {'double' if f == 'c_value' else 'i64'} {f};\n" for f in _FIELDS) + "};\n"

SOURCE = r"""
// convcov: CUDA C++ kernels of the ``cupy`` backend (see convcov/backends/cupy.py).
// Index names follow SPEC.md: b batch, g group, c0 output channel, ci input channel,
// (i0, j0), (i1, j1) output positions, (x0, y0), (x1, y1) input positions, (ii, ji) the
// kernel offset. q is a flattened (i1, j1) or (x1, y1) position, p0 a flattened (i0, j0).
// Branches for a compiler without __CUDA_ARCH__ serve a host build of this source (the
// test suite compiles it as C++ with the host_* helpers, to check the index arithmetic
// of every kernel on machines without a GPU); NVRTC never sees them.
typedef long long i64;
typedef unsigned long long u64;
struct f16 { unsigned short b; };   // storage only: arithmetic happens in Acc
struct bf16 { unsigned short b; };
enum { DT_F16 = 0, DT_BF16 = 1, DT_F32 = 2, DT_F64 = 3 };
""" + _ARGS_STRUCT + r"""
#define THREADS 256
#define UNROLL 4          // loads in flight per thread in the streaming loops
// cc_gsum's blocks a multiprocessor, named to ptxas (0: none named): an A/B knob
// (CupyBackend's compile options, -D...), see cc_gsum.
#ifndef GSUM_MIN_BLOCKS
#define GSUM_MIN_BLOCKS 0
#endif
#if GSUM_MIN_BLOCKS > 0
#define GSUM_BOUNDS __launch_bounds__(THREADS, GSUM_MIN_BLOCKS)
#else
#define GSUM_BOUNDS __launch_bounds__(THREADS)
#endif
#define UNROLL_DIRECT 8   // ... in cc_direct, whose problems are small: latency-bound
                          // (16 and 32: toy's kernel no faster, H200 2026-11-30)

// ---------------------------------------------------------------- bits and conversions
__device__ __forceinline__ float u2f(unsigned u) { union { unsigned u; float f; } x; x.u = u; return x.f; }
__device__ __forceinline__ unsigned f2u(float f) { union { unsigned u; float f; } x; x.f = f; return x.u; }

// The f32 <-> f64 conversions are written out because CuPy compiles with -ftz=true,
// which would flush float32 subnormals to zero in plain C++ casts.
__device__ __forceinline__ double f2d(float f) {
#ifdef __CUDA_ARCH__
  double d; asm("cvt.f64.f32 %0, %1;" : "=d"(d) : "f"(f)); return d;
#else
  return (double)f;
#endif
}
__device__ __forceinline__ float d2f_rn(double d) {
#ifdef __CUDA_ARCH__
  float f; asm("cvt.rn.f32.f64 %0, %1;" : "=f"(f) : "d"(d)); return f;
#else
  return (float)d;
#endif
}
// Round to odd: float64 -> float32 -> float16/bfloat16 is then one correct rounding.
__device__ __forceinline__ float d2f_odd(double d) {
#ifdef __CUDA_ARCH__
  float f; asm("cvt.rz.f32.f64 %0, %1;" : "=f"(f) : "d"(d));
#else
  float f = host_d2f_rz(d);
#endif
  if (f2d(f) != d && f == f) f = u2f(f2u(f) | 1u);
  return f;
}
__device__ __forceinline__ float h2f(unsigned short h) {
#ifdef __CUDA_ARCH__
  float f; asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h)); return f;
#else
  return host_h2f(h);
#endif
}
__device__ __forceinline__ unsigned short f2h(float f) {
#ifdef __CUDA_ARCH__
  unsigned short h; asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f)); return h;
#else
  return host_f2h(f);
#endif
}
__device__ __forceinline__ float bf2f(unsigned short h) { return u2f((unsigned)h << 16); }
__device__ __forceinline__ unsigned short f2bf(float f) {  // round to nearest even
  unsigned x = f2u(f);
  if ((x & 0x7fffffffu) > 0x7f800000u) return (unsigned short)((x >> 16) | 0x40u);  // quiet NaN
  x += 0x7fffu + ((x >> 16) & 1u);
  return (unsigned short)(x >> 16);
}

// IEEE arithmetic in the accumulation type (no flush to zero, one rounding per FMA).
__device__ __forceinline__ float afma(float a, float b, float c) {
#ifdef __CUDA_ARCH__
  float r; asm("fma.rn.f32 %0, %1, %2, %3;" : "=f"(r) : "f"(a), "f"(b), "f"(c)); return r;
#else
  return host_fmaf(a, b, c);
#endif
}
__device__ __forceinline__ double afma(double a, double b, double c) {
#ifdef __CUDA_ARCH__
  double r; asm("fma.rn.f64 %0, %1, %2, %3;" : "=d"(r) : "d"(a), "d"(b), "d"(c)); return r;
#else
  return host_fma(a, b, c);
#endif
}
__device__ __forceinline__ float aadd(float a, float b) {
#ifdef __CUDA_ARCH__
  float r; asm("add.rn.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b)); return r;
#else
  return a + b;
#endif
}
__device__ __forceinline__ double aadd(double a, double b) {
#ifdef __CUDA_ARCH__
  double r; asm("add.rn.f64 %0, %1, %2;" : "=d"(r) : "d"(a), "d"(b)); return r;
#else
  return a + b;
#endif
}

// Storage -> Acc and Acc -> storage (one rounding).
template <typename Acc> struct Cv;
template <> struct Cv<float> {
  static __device__ __forceinline__ float from(f16 x) { return h2f(x.b); }
  static __device__ __forceinline__ float from(bf16 x) { return bf2f(x.b); }
  static __device__ __forceinline__ float from(float x) { return x; }
  static __device__ __forceinline__ float from(double x) { return d2f_rn(x); }  // unused: f64 => Acc f64
  static __device__ __forceinline__ void to(f16& o, float a) { o.b = f2h(a); }
  static __device__ __forceinline__ void to(bf16& o, float a) { o.b = f2bf(a); }
  static __device__ __forceinline__ void to(float& o, float a) { o = a; }
  static __device__ __forceinline__ void to(double& o, float a) { o = f2d(a); }
};
template <> struct Cv<double> {
  static __device__ __forceinline__ double from(f16 x) { return f2d(h2f(x.b)); }
  static __device__ __forceinline__ double from(bf16 x) { return f2d(bf2f(x.b)); }
  static __device__ __forceinline__ double from(float x) { return f2d(x); }
  static __device__ __forceinline__ double from(double x) { return x; }
  static __device__ __forceinline__ void to(f16& o, double a) { o.b = f2h(d2f_odd(a)); }
  static __device__ __forceinline__ void to(bf16& o, double a) { o.b = f2bf(d2f_odd(a)); }
  static __device__ __forceinline__ void to(float& o, double a) { o = d2f_rn(a); }
  static __device__ __forceinline__ void to(double& o, double a) { o = a; }
};

// ---------------------------------------------------------------- loads and stores
// HINT 0: read-only path (data reused from L1/L2: mu, T, c). HINT 1: streaming, evict
// first (gamma and out are touched once; keeping them out of L2 leaves room for T).
template <int BYTES> struct Chunk;
template <> struct Chunk<2> { typedef unsigned short type; };
template <> struct Chunk<4> { typedef unsigned int type; };
template <> struct Chunk<8> { typedef uint2 type; };
template <> struct Chunk<16> { typedef uint4 type; };

template <int HINT, typename C> __device__ __forceinline__ C ldh(const C* p) {
#ifdef __CUDA_ARCH__
  return HINT ? __ldcs(p) : __ldg(p);
#else
  return *p;
#endif
}
template <int HINT, typename C> __device__ __forceinline__ void sth(C* p, C v) {
#ifdef __CUDA_ARCH__
  if (HINT) __stcs(p, v); else *p = v;
#else
  *p = v;
#endif
}

// V elements of T as raw 16-byte (or smaller) chunks: loaded now, unpacked when used, so
// that a 16-bit vector's unpacking does not make the next load wait for this one.
template <typename T, int V> struct Raw {
  enum { NB = V * (int)sizeof(T), CB = NB > 16 ? 16 : NB };
  typedef typename Chunk<CB>::type C;
  C c[NB / CB];
};
template <typename T, int V, int HINT>
__device__ __forceinline__ void ldraw(const T* p, Raw<T, V>& r) {
  const typename Raw<T, V>::C* s = reinterpret_cast<const typename Raw<T, V>::C*>(p);
#pragma unroll
  for (int i = 0; i < Raw<T, V>::NB / Raw<T, V>::CB; ++i) r.c[i] = ldh<HINT>(s + i);
}
template <typename T, int V>
__device__ __forceinline__ void unpack(const Raw<T, V>& r, T (&t)[V]) {
  union { typename Raw<T, V>::C c[Raw<T, V>::NB / Raw<T, V>::CB]; T t[V]; } u;
#pragma unroll
  for (int i = 0; i < Raw<T, V>::NB / Raw<T, V>::CB; ++i) u.c[i] = r.c[i];
#pragma unroll
  for (int e = 0; e < V; ++e) t[e] = u.t[e];
}

// V consecutive elements of T, in chunks of at most 16 bytes; the caller guarantees that
// p is aligned to min(16, V * sizeof(T)) bytes.
template <typename T, int V, int HINT>
__device__ __forceinline__ void ldv(const T* p, T (&r)[V]) {
  Raw<T, V> w;
  ldraw<T, V, HINT>(p, w);
  unpack<T, V>(w, r);
}
template <typename T, int V, int HINT>
__device__ __forceinline__ void stv(T* p, const T (&r)[V]) {
  enum { NB = V * (int)sizeof(T), CB = NB > 16 ? 16 : NB };
  typedef typename Chunk<CB>::type C;
  union { C c[NB / CB]; T t[V]; } u;
#pragma unroll
  for (int e = 0; e < V; ++e) u.t[e] = r[e];
  C* d = reinterpret_cast<C*>(p);
#pragma unroll
  for (int i = 0; i < NB / CB; ++i) sth<HINT>(d + i, u.c[i]);
}

// Run-time typed access, for the small arrays (mu, c) and the generic kernel: the dtype
// code is uniform across the grid, so the switch costs a few instructions, not divergence.
template <typename Acc, int HINT>
__device__ __forceinline__ Acc ld_any(const void* base, i64 off, int dt) {
  switch (dt) {
    case DT_F16: { f16 x; x.b = ldh<HINT>((const unsigned short*)base + off); return Cv<Acc>::from(x); }
    case DT_BF16: { bf16 x; x.b = ldh<HINT>((const unsigned short*)base + off); return Cv<Acc>::from(x); }
    case DT_F32: return Cv<Acc>::from(ldh<HINT>((const float*)base + off));
    default: return Cv<Acc>::from(ldh<HINT>((const double*)base + off));
  }
}
template <typename Acc, typename T, int V>
__device__ __forceinline__ void ldv_as(const void* base, i64 off, Acc (&r)[V]) {
  T t[V];
  ldv<T, V, 0>((const T*)base + off, t);
#pragma unroll
  for (int e = 0; e < V; ++e) r[e] = Cv<Acc>::from(t[e]);
}
template <typename Acc, int V>
__device__ __forceinline__ void ldv_any(const void* base, i64 off, int dt, Acc (&r)[V]) {
  switch (dt) {
    case DT_F16: ldv_as<Acc, f16, V>(base, off, r); break;
    case DT_BF16: ldv_as<Acc, bf16, V>(base, off, r); break;
    case DT_F32: ldv_as<Acc, float, V>(base, off, r); break;
    default: ldv_as<Acc, double, V>(base, off, r); break;
  }
}
template <typename Acc>
__device__ __forceinline__ void st_any(void* base, i64 off, int dt, Acc v) {
  switch (dt) {
    case DT_F16: { f16 x; Cv<Acc>::to(x, v); sth<1>((unsigned short*)base + off, x.b); break; }
    case DT_BF16: { bf16 x; Cv<Acc>::to(x, v); sth<1>((unsigned short*)base + off, x.b); break; }
    case DT_F32: { float x; Cv<Acc>::to(x, v); sth<1>((float*)base + off, x); break; }
    default: { double x; Cv<Acc>::to(x, v); sth<1>((double*)base + off, x); break; }
  }
}

// Element access through a storage type T known at compile time (the usual case: the
// arrays share a dtype) or run-time typed (T = anyt, for mixed dtypes; the code is a
// kernel argument). one/vec load into Acc, put rounds once and stores.
struct anyt {};
template <typename Acc, typename T> struct Ld {
  static __device__ __forceinline__ Acc one(const void* base, i64 off, int) {
    T t[1];
    ldv<T, 1, 0>((const T*)base + off, t);
    return Cv<Acc>::from(t[0]);
  }
  static __device__ __forceinline__ Acc one_stream(const void* base, i64 off, int) {
    T t[1];
    ldv<T, 1, 1>((const T*)base + off, t);
    return Cv<Acc>::from(t[0]);
  }
  template <int V>
  static __device__ __forceinline__ void vec(const void* base, i64 off, int, Acc (&r)[V]) {
    ldv_as<Acc, T, V>(base, off, r);
  }
  static __device__ __forceinline__ void put(void* base, i64 off, int, Acc v) {
    T t[1];
    Cv<Acc>::to(t[0], v);
    stv<T, 1, 1>((T*)base + off, t);
  }
};
template <typename Acc> struct Ld<Acc, anyt> {
  static __device__ __forceinline__ Acc one(const void* base, i64 off, int dt) {
    return ld_any<Acc, 0>(base, off, dt);
  }
  static __device__ __forceinline__ Acc one_stream(const void* base, i64 off, int dt) {
    return ld_any<Acc, 1>(base, off, dt);
  }
  template <int V>
  static __device__ __forceinline__ void vec(const void* base, i64 off, int dt, Acc (&r)[V]) {
    ldv_any<Acc, V>(base, off, dt, r);
  }
  static __device__ __forceinline__ void put(void* base, i64 off, int dt, Acc v) {
    st_any<Acc>(base, off, dt, v);
  }
};

// 64-bit quotient and remainder, through 32-bit division when both operands fit (the
// usual case: a 64-bit division is a long software sequence on the GPU).
__device__ __forceinline__ void divmod(i64 a, i64 b, i64& q, i64& r) {
  if ((((u64)a) | ((u64)b)) < 0x100000000ull) {
    unsigned qq = (unsigned)a / (unsigned)b;
    q = (i64)qq;
  } else {
    q = a / b;
  }
  r = a - q * b;
}

__device__ __forceinline__ i64 lmin(i64 x, i64 y) { return x < y ? x : y; }
__device__ __forceinline__ i64 thread_index() { return (i64)blockIdx.x * blockDim.x + threadIdx.x; }
__device__ __forceinline__ i64 grid_stride() { return (i64)gridDim.x * blockDim.x; }

template <typename Acc>
__device__ __forceinline__ Acc c_of(const Args& a, i64 c0) {
  return a.c ? ld_any<Acc, 0>((const void*)a.c, c0 * a.sc, (int)a.dt_c) : Cv<Acc>::from(a.c_value);
}

// ---------------------------------------------------------------- kernel 1: T
// One channel's mu: mu[b, ci, x0, y0] (the row) and V values mu[b, ci, q] (the column),
// loaded by load() and read, converted, by row() and col(). A typed mu stays raw between
// the two, so that cc_gsum can issue all of a step's loads before its first sum (a warp
// issues in order: a conversion placed between two loads holds the second one until the
// first one's data is back); a run-time typed mu (anyt, mixed dtypes) converts at once.
template <typename Acc, typename Tm, int V> struct MuPair {
  Raw<Tm, 1> r;
  Raw<Tm, V> c;
  __device__ __forceinline__ void load(const void* mu, i64 orow, i64 ocol, int) {
    ldraw<Tm, 1, 0>((const Tm*)mu + orow, r);
    ldraw<Tm, V, 0>((const Tm*)mu + ocol, c);
  }
  __device__ __forceinline__ Acc row() const { Tm t[1]; unpack<Tm, 1>(r, t); return Cv<Acc>::from(t[0]); }
  __device__ __forceinline__ void col(Acc (&m)[V]) const {
    Tm t[V];
    unpack<Tm, V>(c, t);
#pragma unroll
    for (int e = 0; e < V; ++e) m[e] = Cv<Acc>::from(t[e]);
  }
};
template <typename Acc, int V> struct MuPair<Acc, anyt, V> {
  Acc r, c[V];
  __device__ __forceinline__ void load(const void* mu, i64 orow, i64 ocol, int dt) {
    r = ld_any<Acc, 0>(mu, orow, dt);
    ldv_any<Acc, V>(mu, ocol, dt, c);
  }
  __device__ __forceinline__ Acc row() const { return r; }
  __device__ __forceinline__ void col(Acc (&m)[V]) const {
#pragma unroll
    for (int e = 0; e < V; ++e) m[e] = c[e];
  }
};

// T[b, g, x0, y0, q] = sum over ci of group g of gamma[b, ci, x0, y0, (ci,) q] + mu[b, ci, x0, y0] * mu[b, ci, q]
// for V consecutive q per thread. V > 1 only when q is contiguous in gamma and mu and
// every row is aligned to the vector (checked on the host); V == 1 takes any strides.
// Tg is gamma's storage type (gamma absent: a.gamma == 0), Tm mu's (or anyt).
// Positions (< H*W < 2**31) are 32-bit; offsets into arrays are 64-bit.
template <typename Tg, typename Tm, typename Acc, int V>
__global__ void GSUM_BOUNDS cc_gsum(const Args a) {
  const int W = (int)a.W, HW = (int)(a.H * a.W), nqv = HW / V;
  const Tg* gamma = (const Tg*)a.gamma;
  const void* mu = (const void*)a.mu;
  Acc* T = (Acc*)a.t;
  const int dt_mu = (int)a.dt_mu;
  for (i64 idx = thread_index(); idx < a.n; idx += grid_stride()) {
    i64 row, qv64, bg, p64, b, g;
    divmod(idx, nqv, row, qv64);  // row = (b, g, x0, y0)
    divmod(row, HW, bg, p64);
    divmod(bg, a.G, b, g);
    const int p = (int)p64, x0 = p / W, y0 = p - x0 * W, q = (int)qv64 * V;
    const i64 ci0 = g * a.Cg;
    i64 og = b * a.sg0 + ci0 * a.sg1 + x0 * a.sg2 + y0 * a.sg3;
    i64 om_row = b * a.sm0 + ci0 * a.sm1 + x0 * a.sm2 + y0 * a.sm3;
    i64 om_col = b * a.sm0 + ci0 * a.sm1;
    if (V > 1) {
      og += q; om_col += q;
    } else {
      const int x1 = q / W, y1 = q - x1 * W;
      og += x1 * a.sg4 + y1 * a.sg5;
      om_col += x1 * a.sm2 + y1 * a.sm3;
    }
    Acc acc[V];
#pragma unroll
    for (int e = 0; e < V; ++e) acc[e] = (Acc)0;
    i64 ci = 0;
    // UNROLL channels a step, every load of the step (gamma's from DRAM, mu's from the
    // caches) issued before the first sum, the values kept raw until then, and the
    // step's gamma terms summed pairwise. Summed channel by channel (until commit
    // d9814ea), ptxas placed the fourth gamma load and the loads of mu between the
    // sums (sm_90 SASS), each waiting for the data before it: big-f16's cc_gsum
    // 1074 -> 1051 us on the H200 (float32 2045 -> 2047, mid 38.7 -> 38.3). The step takes 89 registers for float16 (2 blocks
    // a multiprocessor): naming 4 blocks (64 registers) spilled and took 1115 us.
    for (; ci + UNROLL <= a.Cg; ci += UNROLL) {
      Raw<Tg, V> gr[UNROLL];
      MuPair<Acc, Tm, V> mp[UNROLL];
#pragma unroll
      for (int u = 0; u < UNROLL; ++u) mp[u].load(mu, om_row + u * a.sm1, om_col + u * a.sm1, dt_mu);
      if (gamma) {
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) ldraw<Tg, V, 1>(gamma + og + u * a.sg1, gr[u]);
        Tg gv[UNROLL][V];
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) unpack<Tg, V>(gr[u], gv[u]);
#pragma unroll
        for (int e = 0; e < V; ++e) {
          Acc gs[UNROLL];
#pragma unroll
          for (int u = 0; u < UNROLL; ++u) gs[u] = Cv<Acc>::from(gv[u][e]);
#pragma unroll
          for (int w = 1; w < UNROLL; w *= 2)
#pragma unroll
            for (int u = 0; u + w < UNROLL; u += 2 * w) gs[u] = aadd(gs[u], gs[u + w]);
          acc[e] = aadd(acc[e], gs[0]);
        }
      }
#pragma unroll
      for (int u = 0; u < UNROLL; ++u) {
        Acc mc[V];
        mp[u].col(mc);
        const Acc mr = mp[u].row();
#pragma unroll
        for (int e = 0; e < V; ++e) acc[e] = afma(mr, mc[e], acc[e]);
      }
      og += UNROLL * a.sg1; om_row += UNROLL * a.sm1; om_col += UNROLL * a.sm1;
    }
    for (; ci < a.Cg; ++ci) {
      Tg gv[V];
      if (gamma) ldv<Tg, V, 1>(gamma + og, gv);
      Acc mc[V];
      const Acc mr = Ld<Acc, Tm>::one(mu, om_row, dt_mu);
      Ld<Acc, Tm>::template vec<V>(mu, om_col, dt_mu, mc);
#pragma unroll
      for (int e = 0; e < V; ++e) {
        Acc s = gamma ? aadd(acc[e], Cv<Acc>::from(gv[e])) : acc[e];
        acc[e] = afma(mr, mc[e], s);
      }
      og += a.sg1; om_row += a.sm1; om_col += a.sm1;
    }
    stv<Acc, V, 0>(T + row * HW + q, acc);
  }
}

// ---------------------------------------------------------------- kernel 2: S
// S[b, g, p0, q] = the kh x kw box filter of T along the diagonal offsets. One thread an
// element of S, in S's flat order: consecutive threads take consecutive q (coalesced
// reads of T, coalesced writes of S) and no thread idles at the end of a row (rows of
// HoWo elements rarely fill whole blocks: mid's 196 left 62% of a row-per-block tile
// idle). T is contiguous, so the term of kernel offset (ii, ji) sits at a fixed distance
// ii * DI + ji * DJ from the term of (0, 0) whatever the stride: elements whose every
// term is inside the input (the interior) skip the bounds checks; the others check each
// term (the terms in the padding are skipped: SPEC section 1). The reads hit L2, so the
// kernel is latency-bound: each thread issues UNROLL_BOX loads before it sums them.
#define UNROLL_BOX 9
template <typename Acc>
__global__ void __launch_bounds__(THREADS) cc_sbox(const Args a) {
  const int H = (int)a.H, W = (int)a.W, Wo = (int)a.Wo;
  const i64 HoWo = a.Ho * a.Wo;
  const int kh = (int)a.kh, kw = (int)a.kw, sh = (int)a.sh, sw = (int)a.sw;
  const int ph = (int)a.ph, pw = (int)a.pw, dh = (int)a.dh, dw = (int)a.dw;
  const int noff = kh * kw, span_h = (kh - 1) * dh, span_w = (kw - 1) * dw;
  const i64 HW = a.H * a.W, DI = (i64)dh * (W * HW + W), DJ = (i64)dw * (HW + 1);
  const Acc* T = (const Acc*)a.t;
  Acc* S = (Acc*)a.s;
  for (i64 e = thread_index(); e < a.n; e += grid_stride()) {
    i64 row, q, bg, p0;
    divmod(e, HoWo, row, q);
    divmod(row, HoWo, bg, p0);
    const int i0 = (int)p0 / Wo, j0 = (int)p0 - i0 * Wo;
    const int i1 = (int)q / Wo, j1 = (int)q - i1 * Wo;
    const int x0b = i0 * sh - ph, y0b = j0 * sw - pw;  // input positions of offset (0, 0)
    const int x1b = i1 * sh - ph, y1b = j1 * sw - pw;
    const bool in_all = x0b >= 0 && x0b + span_h < H && y0b >= 0 && y0b + span_w < W
                        && x1b >= 0 && x1b + span_h < H && y1b >= 0 && y1b + span_w < W;
    // Tq may point outside T (padding): only the terms found inside are read.
    const Acc* Tq = T + bg * HW * HW + (i64)(x0b * W + y0b) * HW + (x1b * W + y1b);
    Acc s = (Acc)0;
    int ii = 0, ji = 0;
    i64 off = 0;
    for (int t = 0; t < noff; t += UNROLL_BOX) {
      Acc tv[UNROLL_BOX];
#pragma unroll
      for (int u = 0; u < UNROLL_BOX; ++u) {
        bool in = t + u < noff;
        if (!in_all) {
          const int x0 = x0b + ii * dh, x1 = x1b + ii * dh;
          const int y0 = y0b + ji * dw, y1 = y1b + ji * dw;
          in = in && (unsigned)x0 < (unsigned)H && (unsigned)x1 < (unsigned)H
               && (unsigned)y0 < (unsigned)W && (unsigned)y1 < (unsigned)W;
        }
        tv[u] = in ? ldh<0>(Tq + off) : (Acc)0;
        off += DJ;
        if (++ji == kw) { ji = 0; ++ii; off += DI - kw * DJ; }
      }
#pragma unroll
      for (int u = 0; u < UNROLL_BOX; ++u) s = aadd(s, tv[u]);
    }
    S[e] = s;
  }
}

// S again, for stride 1 and dilation 1 along the rows (the usual conv): a walk along
// each diagonal. S[., i0, j0, i0 + d, j1] is the sum over ii of the row terms
// R(x) = sum over ji of T[x, y0b + ji*dw, x + d, y1b + ji*dw] at x = i0 - ph + ii, and
// the next i0 on the same diagonal reuses kh - 1 of them. One thread a (b, g, d, j0, j1),
// j1 fastest (coalesced T reads and S writes), walking i0: kw loads an element instead of
// kh*kw (cc_sbox's nine loads of a 3x3 kernel made it L2-bound: big's S 421 -> 150 us on
// the H200, 2026-11-30; ncu: still latency-bound, 58% of the stalls wait for T). Row sums are summed fresh each step (no running subtraction:
// Inf - Inf would turn a sum into NaN). The last kh - 1 row sums live in registers: KH
// is kh when the host instantiated it (3), else 0 (kh <= WALK_KMAX, unrolled selects).
// U steps' loads are issued before their sums; with the width a compile-time constant
// (KW: 3, else 0 for any kw) every column's too: a warp issues in order, and with kw read
// at run time each column's adds held the next column's loads until its data came
// (sm_90 SASS: three memory latencies a round instead of one). A term outside the input
// or in a column in the padding is a 0 then, added to a sum that starts at +0 (the same
// bits as leaving it out: such a sum is never -0).
#define WALK_KMAX 7
#ifndef WALK_BACKWARDS
#define WALK_BACKWARDS 1
#endif
#ifndef WALK_INNER  // the inner rounds below (0: every round bounds-tested, an A/B knob)
#define WALK_INNER 1
#endif
// The ring of the last kh - 1 row sums, oldest first, after ``r`` joined it.
template <typename Acc, int KH, int RS>
__device__ __forceinline__ void ring_push(Acc (&ring)[RS], Acc r, int kh) {
#pragma unroll
  for (int v = 0; v < RS - 1; ++v) ring[v] = KH > 0 || v + 1 < kh - 1 ? ring[v + 1] : r;
  ring[RS - 1] = r;
}
template <typename Acc, int KH, int KW, int U>
__global__ void __launch_bounds__(THREADS) cc_sbox_walk(const Args a) {
  enum { R = KH > 0 ? KH - 1 : WALK_KMAX - 1, RS = R > 0 ? R : 1 };  // ring size
  enum { KWA = KW > 0 ? KW : 1 };  // the loads-first arrays' width (used when KW > 0)
  const int H = (int)a.H, W = (int)a.W, Ho = (int)a.Ho, Wo = (int)a.Wo;
  const int kh = KH > 0 ? KH : (int)a.kh, kw = KW > 0 ? KW : (int)a.kw, sw = (int)a.sw;
  const int ph = (int)a.ph, pw = (int)a.pw, dw = (int)a.dw, nd = 2 * Ho - 1, WoWo = Wo * Wo;
  const i64 HW = a.H * a.W, HoWo = a.Ho * a.Wo, DI = a.W * HW + a.W, DJ = a.dw * (HW + 1);
  // Planes of T and S under 2**31 elements (the usual case): 32-bit offsets in them.
  const bool narrow = HW * HW < 0x80000000ll && HoWo * HoWo < 0x80000000ll;
  const Acc* T = (const Acc*)a.t;
  Acc* S = (Acc*)a.s;
  for (i64 e = thread_index(); e < a.n; e += grid_stride()) {
    i64 bgd, jj, bg, dd;
    divmod(e, WoWo, bgd, jj);
    divmod(bgd, nd, bg, dd);
    // The (b, g) planes last to first: the end of T, which cc_gsum wrote last, is still
    // in L2, and the S left in L2 at the end is the S that cc_stream reads first.
    if (WALK_BACKWARDS) bg = a.B * a.G - 1 - bg;
    const int d = (int)dd - (Ho - 1), j0 = (int)jj / Wo, j1 = (int)jj - j0 * Wo;
    const int y0b = j0 * sw - pw, y1b = j1 * sw - pw;
    unsigned cols = 0;  // bit ji: both columns of kernel offset ji inside the input
    for (int ji = 0; ji < kw; ++ji) {
      const int y0 = y0b + ji * dw, y1 = y1b + ji * dw;
      if ((unsigned)y0 < (unsigned)W && (unsigned)y1 < (unsigned)W) cols |= 1u << ji;
    }
    const int i0s = d < 0 ? -d : 0, i0e = d > 0 ? Ho - d : Ho;  // i0 + d stays in [0, Ho)
    const int xlo = d < 0 ? -d : 0, xhi = d > 0 ? H - d : H;   // rows x with x, x + d inside
    // Row x of this diagonal starts at Tb + x * DI (x may be outside: only read inside).
    const Acc* Tb = T + bg * HW * HW + (i64)d * a.W + (i64)y0b * HW + y1b;
    Acc* Sd = S + bg * HoWo * HoWo + (i64)j0 * HoWo + (i64)d * Wo + j1;
    const i64 DS = HoWo * Wo + Wo;  // S's step from i0 to i0 + 1 on the diagonal
    const int DI32 = (int)DI, DJ32 = (int)DJ, DS32 = (int)DS;  // used when narrow
    Acc ring[RS];  // ring[ii] = R(i0 - ph + ii), ii < kh - 1
#pragma unroll
    for (int v = 0; v < RS; ++v) ring[v] = (Acc)0;
    int x = i0s - ph;
    for (int ii = 0; ii < kh - 1; ++ii, ++x) {  // the first kh - 1 row sums
      Acc r = (Acc)0;
      if (KW > 0) {
        Acc tv[KWA];
#pragma unroll
        for (int ji = 0; ji < KWA; ++ji)
          tv[ji] = x >= xlo && x < xhi && (cols >> ji & 1u) ? ldh<0>(Tb + x * DI + ji * DJ)
                                                            : (Acc)0;
#pragma unroll
        for (int ji = 0; ji < KWA; ++ji) r = aadd(r, tv[ji]);
      } else if (x >= xlo && x < xhi) {
        for (int ji = 0; ji < kw; ++ji)
          if (cols >> ji & 1u) r = aadd(r, ldh<0>(Tb + x * DI + ji * DJ));
      }
      ring_push<Acc, KH, RS>(ring, r, kh);
    }
    int i0 = i0s;
    // Inner rounds first: every row inside, all U steps on the diagonal, and 32-bit
    // offsets (narrow): no bounds tests and one multiply-add an address, 21 instructions
    // a step (sm_90 SASS). With the tests and 64-bit offsets of the rounds below every
    // round took 74 a step and the walk was issue-bound (ncu, big-f16: 80M warp
    // instructions in 109 us, a warp issuing every 11.9 cycles): big-f16's walk
    // 108.4 -> 88.1 us, mid's 6.9 -> 5.3 us, same bits (H200, 2026-11-30, ab42.py).
    // Columns or the first rounds in the padding take the loop below.
    const bool all_cols = cols == (1u << kw) - 1u;
    for (; WALK_INNER && KW > 0 && narrow && all_cols && i0 + U <= i0e && x >= xlo && x + U <= xhi;
         i0 += U, x += U) {
      Acc tv[KWA][U];
#pragma unroll
      for (int ji = 0; ji < KWA; ++ji) {
        const Acc* Tc = Tb + (x * DI32 + ji * DJ32);
#pragma unroll
        for (int u = 0; u < U; ++u) tv[ji][u] = ldh<0>(Tc + u * DI32);
      }
      Acc* Sr = Sd + i0 * DS32;
#pragma unroll
      for (int u = 0; u < U; ++u) {
        Acc r = (Acc)0;
#pragma unroll
        for (int ji = 0; ji < KWA; ++ji) r = aadd(r, tv[ji][u]);
        Acc s = (Acc)0;
#pragma unroll
        for (int v = 0; v < R; ++v) if (KH > 0 || v < kh - 1) s = aadd(s, ring[v]);
        Sr[u * DS32] = aadd(s, r);
        ring_push<Acc, KH, RS>(ring, r, kh);
      }
    }
    for (; i0 < i0e; i0 += U, x += U) {  // then U new ones a round
      Acc rs[U];
#pragma unroll
      for (int u = 0; u < U; ++u) rs[u] = (Acc)0;
      if (KW > 0) {  // every column's loads, then the sums
        Acc tv[KWA][U];
#pragma unroll
        for (int ji = 0; ji < KWA; ++ji)
#pragma unroll
          for (int u = 0; u < U; ++u) {
            const bool in = (cols >> ji & 1u) && i0 + u < i0e && x + u >= xlo && x + u < xhi;
            tv[ji][u] = in ? ldh<0>(Tb + (x + u) * DI + ji * DJ) : (Acc)0;
          }
#pragma unroll
        for (int ji = 0; ji < KWA; ++ji)
#pragma unroll
          for (int u = 0; u < U; ++u) rs[u] = aadd(rs[u], tv[ji][u]);
      }
      for (int ji = 0; KW == 0 && ji < kw; ++ji) {
        if (!(cols >> ji & 1u)) continue;
        Acc tv[U];
#pragma unroll
        for (int u = 0; u < U; ++u) {
          const bool in = i0 + u < i0e && x + u >= xlo && x + u < xhi;
          tv[u] = in ? ldh<0>(Tb + (x + u) * DI + ji * DJ) : (Acc)0;
        }
#pragma unroll
        for (int u = 0; u < U; ++u) rs[u] = aadd(rs[u], tv[u]);
      }
#pragma unroll
      for (int u = 0; u < U; ++u) {
        if (i0 + u < i0e) {
          Acc s = (Acc)0;
#pragma unroll
          for (int v = 0; v < R; ++v) if (KH > 0 || v < kh - 1) s = aadd(s, ring[v]);
          Sd[(i64)(i0 + u) * DS] = aadd(s, rs[u]);
          ring_push<Acc, KH, RS>(ring, rs[u], kh);
        }
      }
    }
  }
}

// ---------------------------------------------------------------- kernel 3: out += c * S
// A streaming kernel. out[b, c0] is nseg segments of seg_len elements that are
// contiguous in out and in S[b, g]: one segment (the whole (i0, j0, i1, j1) plane, for
// a contiguous diagonal-layout out) or one per (i0, j0). A block takes a tile of
// THREADS * P vector positions (consecutive threads: consecutive vectors of up to 16
// bytes) for CH output channels of one group; each thread loads its P vectors of S once
// for its CH channels and has all SU = P * CH vectors of out in flight before its first
// store. V == 1 (any strides): one segment per (i0, j0), (i1, j1) through out's strides.
// The loads of out are kept as raw 16-byte words until used: unpacking float16 right
// after each load made every load wait for the one before (one destination register in
// the SASS; big-f16's update 2051 -> 1717 us on the H200, 2026-11-30).
// CH = 2 for 16-bit out with float32 sums: each 16-byte vector of out needs 32 bytes of
// S, and sharing them between two channels took big-f16's update from 1717 to 1676 us;
// for float32 out it cost time (3300 -> 3365 us), so CH = 1 there (the host picks CH,
// _stream_ch). Keep the launch bounds as they are: naming a minimum of 1 block a
// multiprocessor let nvcc take 90 registers instead of 80 for float32 (2 blocks instead
// of 3): big-f32 6106 -> 6745 us.
// ROWS = 1 (the host checks it applies): segments contiguous in out whose (i0, j0) rows
// are at one stride (so2 == Wo * so3, a contiguous full-layout out), and fewer than 2**31
// vector positions. A thread then finds its P positions with one 32-bit division: the
// next is THREADS vectors on, dr rows and dv vectors (one row more when they wrap),
// instead of two divisions a position: 63 registers and 584 SASS instructions against 73
// and 984 (float32, NVRTC 13.5), mid's GPU part 103.3-103.6 -> 99.4-99.6 us on the H200,
// same bits (2026-11-30, ab53.py).
#define STREAM_SU 4
template <typename To, typename Acc, int V, int CH, int ROWS>
__global__ void __launch_bounds__(THREADS) cc_stream(const Args a) {
  // Out's loads: evict-first (.cs) for 16-bit out, the read-only path (.nc) for wider
  // (correct here: each element is loaded once, by the thread that then stores it, and its
  // store depends on the load); stores plain. A/B on the H200 (2026-11-30, against .cs
  // loads and stores): big-f32's update 3300-3307 -> 3243 us, big-f16's 1678 -> 1667 us.
  enum { P = STREAM_SU / CH, LH = sizeof(To) == 2 ? 1 : 0 };
  const int Wo = (int)a.Wo;
  const i64 HoWo = a.Ho * a.Wo, L = a.seg_len, nvec = L / V, nf = a.nseg * nvec;
  const i64 ncb = (a.Cog + CH - 1) / CH;
  const i64 ntiles = a.B * a.G * ncb * a.tiles;
  To* out = (To*)a.out;
  const Acc* S = (const Acc*)a.s;
  for (i64 tile = blockIdx.x; tile < ntiles; tile += gridDim.x) {
    i64 r1, tin, bg, cb, b, g;
    divmod(tile, a.tiles, r1, tin);  // neighbouring blocks: neighbouring memory
    divmod(r1, ncb, bg, cb);
    divmod(bg, a.G, b, g);
    const i64 c0_first = g * a.Cog + cb * CH;
    const int nch = (int)lmin(CH, (g + 1) * a.Cog - c0_first);  // channels of this tile
    const Acc* Sb = S + bg * HoWo * HoWo;
    To* ob = out + b * a.so0 + c0_first * a.so1;
    i64 oo[P];
    bool ok[P];
    Acc sv[P][V];
    Raw<To, V> ov[P][CH];
    unsigned rr = 0, vv = 0;
    const unsigned nv = ROWS ? (unsigned)nvec : 1u, dr = ROWS ? THREADS / nv : 0u,
                   dv = THREADS - dr * nv;
    if (ROWS) {
      const unsigned f0 = (unsigned)(tin * (THREADS * P)) + threadIdx.x;
      rr = f0 / nv;
      vv = f0 - rr * nv;
    }
#pragma unroll
    for (int k = 0; k < P; ++k) {
      const i64 f = tin * (THREADS * P) + k * THREADS + threadIdx.x;
      ok[k] = f < nf;
      i64 off, s_off;
      if (ROWS) {
        if (k > 0) {
          rr += dr;
          vv += dv;
          if (vv >= nv) {
            vv -= nv;
            ++rr;
          }
        }
        off = (i64)rr * a.so3 + (i64)(vv * V);
        s_off = f * V;
      } else if (a.nseg == 1) {  // one flat axpy: no index arithmetic
        off = f * V;
        s_off = f * V;
      } else {
        i64 r, v;
        divmod(f, nvec, r, v);
        const int i0 = (int)r / Wo, j0 = (int)r - i0 * Wo;
        off = i0 * a.so2 + j0 * a.so3;
        if (V > 1) {
          off += v * V;
        } else {
          const int i1 = (int)v / Wo, j1 = (int)v - i1 * Wo;
          off += i1 * a.so4 + j1 * a.so5;
        }
        s_off = r * L + v * V;
      }
      oo[k] = off;
      if (ok[k]) {
        ldv<Acc, V, 0>(Sb + s_off, sv[k]);
#pragma unroll
        for (int ch = 0; ch < CH; ++ch)
          if (ch == 0 || ch < nch) ldraw<To, V, LH>(ob + ch * a.so1 + off, ov[k][ch]);
      }
    }
    Acc cc[CH];
#pragma unroll
    for (int ch = 0; ch < CH; ++ch) cc[ch] = ch == 0 || ch < nch ? c_of<Acc>(a, c0_first + ch) : (Acc)0;
#pragma unroll
    for (int k = 0; k < P; ++k) {
      if (ok[k]) {
#pragma unroll
        for (int ch = 0; ch < CH; ++ch) {
          if (ch == 0 || ch < nch) {
            To o[V];
            unpack<To, V>(ov[k][ch], o);
#pragma unroll
            for (int e = 0; e < V; ++e) Cv<Acc>::to(o[e], afma(cc[ch], sv[k][e], Cv<Acc>::from(o[e])));
            stv<To, V, 0>(ob + ch * a.so1 + oo[k], o);
          }
        }
      }
    }
  }
}

// ---------------------------------------------------------------- one-launch kernel
// S straight from gamma and mu (the channel sum inside the box filter), then out; any
// strides. T is the storage type of out, gamma and mu, or anyt (run-time typed, for
// mixed dtypes). The (ii, ji, ci) terms are walked as one flat sequence, UNROLL_DIRECT at a
// time with predicated loads: small problems are latency-bound, so the loads of several
// terms must be in flight together.
template <typename T, typename Acc>
__global__ void __launch_bounds__(THREADS) cc_direct(const Args a) {
  const int H = (int)a.H, W = (int)a.W, Wo = (int)a.Wo, HoWo = (int)(a.Ho * a.Wo);
  const int kh = (int)a.kh, kw = (int)a.kw, sh = (int)a.sh, sw = (int)a.sw;
  const int ph = (int)a.ph, pw = (int)a.pw, dh = (int)a.dh, dw = (int)a.dw;
  const void* gamma = (const void*)a.gamma;
  const void* mu = (const void*)a.mu;
  void* out = (void*)a.out;
  const int dt_g = (int)a.dt_gamma, dt_mu = (int)a.dt_mu, dt_out = (int)a.dt_out;
  const i64 Cg = a.Cg, nterm = (i64)kh * kw * Cg;
  for (i64 idx = thread_index(); idx < a.n; idx += grid_stride()) {
    i64 r1, q, row, chunk, bg, p0, b, g;
    divmod(idx, HoWo, r1, q);
    divmod(r1, a.nchunk, row, chunk);
    divmod(row, HoWo, bg, p0);
    divmod(bg, a.G, b, g);
    const int i0 = (int)p0 / Wo, j0 = (int)p0 - i0 * Wo;
    const int i1 = (int)q / Wo, j1 = (int)q - i1 * Wo;
    const i64 ci0 = g * Cg;
    const i64 og_b = b * a.sg0 + ci0 * a.sg1, om_b = b * a.sm0 + ci0 * a.sm1;
    Acc s = (Acc)0;
    int ii = 0, ji = 0;
    i64 ci = 0;
    for (i64 t = 0; t < nterm; t += UNROLL_DIRECT) {
      Acc gv[UNROLL_DIRECT], m0[UNROLL_DIRECT], m1[UNROLL_DIRECT];
#pragma unroll
      for (int u = 0; u < UNROLL_DIRECT; ++u) {
        const int x0 = i0 * sh + ii * dh - ph, x1 = i1 * sh + ii * dh - ph;
        const int y0 = j0 * sw + ji * dw - pw, y1 = j1 * sw + ji * dw - pw;
        const bool in = t + u < nterm && (unsigned)x0 < (unsigned)H && (unsigned)x1 < (unsigned)H
                        && (unsigned)y0 < (unsigned)W && (unsigned)y1 < (unsigned)W;
        const i64 og = og_b + ci * a.sg1 + x0 * a.sg2 + y0 * a.sg3 + x1 * a.sg4 + y1 * a.sg5;
        const i64 om0 = om_b + ci * a.sm1 + x0 * a.sm2 + y0 * a.sm3;
        const i64 om1 = om_b + ci * a.sm1 + x1 * a.sm2 + y1 * a.sm3;
        gv[u] = in && gamma ? Ld<Acc, T>::one(gamma, og, dt_g) : (Acc)0;
        m0[u] = in ? Ld<Acc, T>::one(mu, om0, dt_mu) : (Acc)0;
        m1[u] = in ? Ld<Acc, T>::one(mu, om1, dt_mu) : (Acc)0;
        if (++ci == Cg) { ci = 0; if (++ji == kw) { ji = 0; ++ii; } }
      }
#pragma unroll
      for (int u = 0; u < UNROLL_DIRECT; ++u) s = afma(m0[u], m1[u], aadd(s, gv[u]));
    }
    const i64 c0_first = g * a.Cog + chunk * a.chunk;
    const i64 c0_end = lmin(c0_first + a.chunk, (g + 1) * a.Cog);
    const i64 oo = b * a.so0 + i0 * a.so2 + j0 * a.so3 + i1 * a.so4 + j1 * a.so5;
    for (i64 c0 = c0_first; c0 < c0_end; ++c0) {
      const i64 o = oo + c0 * a.so1;
      const Acc old = Ld<Acc, T>::one_stream(out, o, dt_out);
      Ld<Acc, T>::put(out, o, dt_out, afma(c_of<Acc>(a, c0), s, old));
    }
  }
}

// ================================================================ the backward
// patch_moment_vjp (docs/autograd.md): grad_S in, the gradients of gamma's channel-
// diagonal and of mu out. Both follow from one matrix per (b, g),
//   D[b, g, x0, y0, x1, y1] = sum over offsets (ii, ji) whose output positions
//       i0 = (x0 + ph - ii*dh) / sh, i1 = (x1 + ph - ii*dh) / sh (exact, in [0, Ho)),
//       j0, j1 likewise, exist: grad_S[b, g, i0, j0, i1, j1],
// the adjoint of the two-sided strided box filter (S reads the padded channel sum of
// gamma + mu (x) mu through it). Then dL/dgamma[b, ci, x, (ci,) x'] = D[b, g(ci), x, x']
// and, because the mu part of S is the same box filter applied to sum_ci mu (x) mu,
//   dL/dmu[b, ci, x] = sum over z linked to x of (D[x, z] + D[z, x]) * mu[b, ci, z],
// where z is linked to x when some offset reads both (x, z) for one pair of outputs:
// exactly the terms of the forward. Unlinked pairs are skipped, not multiplied by a zero
// D, so an Inf in mu reaches only what it reaches in the forward (SPEC section 1).

// Output index of input coordinate x seen through kernel offset k (k * dil), or -1.
__device__ __forceinline__ int out_index(int x, int pad, int kd, int s, int n_out) {
  const int a = x + pad - kd;
  if (a < 0) return -1;
  const int i = s == 1 ? a : a / s;
  return (i * s == a && i < n_out) ? i : -1;
}

// L[u, v] of one axis (H x H rows, then W x W columns): whether input coordinates u and v
// are read by one kernel offset for some pair of outputs. Tiny; read from L1 by cc_vjp_mu.
template <typename Acc>
__global__ void __launch_bounds__(THREADS) cc_vjp_link(const Args a) {
  const int H = (int)a.H, W = (int)a.W;
  unsigned char* L = (unsigned char*)a.lnk;
  for (i64 idx = thread_index(); idx < a.n; idx += grid_stride()) {
    const bool rows = idx < (i64)H * H;
    const int n = rows ? H : W, e = (int)(rows ? idx : idx - (i64)H * H);
    const int u = e / n, v = e - (e / n) * n;
    const int k = (int)(rows ? a.kh : a.kw), d = (int)(rows ? a.dh : a.dw);
    const int s = (int)(rows ? a.sh : a.sw), p = (int)(rows ? a.ph : a.pw);
    const int no = (int)(rows ? a.Ho : a.Wo);
    unsigned char linked = 0;
    for (int o = 0; o < k && !linked; ++o)
      linked = out_index(u, p, o * d, s, no) >= 0 && out_index(v, p, o * d, s, no) >= 0;
    L[idx] = linked;
  }
}

// D for V consecutive (x1, y1) of one (b, g, x0, y0) a thread, gathered from grad_S
// (any strides and dtype: run-time typed loads, mostly L2 hits: grad_S is Ci/G times
// smaller than grad_gamma). Then the memory-bound part: the same V values, rounded once
// into Tg, stored with streaming 16-byte stores into the channel-diagonal of grad_gamma
// for a chunk of the group's channels (a.chunk of them; a.nchunk chunks), and, when mu's
// gradient is wanted, D itself (Acc, contiguous) by the chunk-0 threads.
// V > 1 only when (x1, y1) is contiguous in grad_gamma and aligned (checked on the host).
template <typename Tg, typename Acc, int V>
__global__ void __launch_bounds__(THREADS) cc_vjp_gamma(const Args a) {
  const int H = (int)a.H, W = (int)a.W, HW = H * W, nqv = HW / V;
  const int Ho = (int)a.Ho, Wo = (int)a.Wo, kh = (int)a.kh, kw = (int)a.kw;
  const int sh = (int)a.sh, sw = (int)a.sw, ph = (int)a.ph, pw = (int)a.pw;
  const int dh = (int)a.dh, dw = (int)a.dw, dt = (int)a.dt_gs;
  const void* gs = (const void*)a.gs;
  Tg* gg = (Tg*)a.gg;
  Acc* D = (Acc*)a.dsc;
  for (i64 idx = thread_index(); idx < a.n; idx += grid_stride()) {
    i64 r1, qv, r2, p64, bg, ch, b, g;
    divmod(idx, nqv, r1, qv);  // neighbouring threads: neighbouring (x1, y1)
    divmod(r1, HW, r2, p64);
    divmod(r2, a.nchunk, bg, ch);
    divmod(bg, a.G, b, g);
    const int p = (int)p64, x0 = p / W, y0 = p - x0 * W, q = (int)qv * V;
    int x1[V], y1[V];
#pragma unroll
    for (int e = 0; e < V; ++e) { x1[e] = (q + e) / W; y1[e] = q + e - x1[e] * W; }
    Acc s[V];
#pragma unroll
    for (int e = 0; e < V; ++e) s[e] = (Acc)0;
    const i64 ob = b * a.ss0 + g * a.ss1;
    for (int ii = 0; ii < kh; ++ii) {
      const int i0 = out_index(x0, ph, ii * dh, sh, Ho);
      if (i0 < 0) continue;
      int i1[V];
#pragma unroll
      for (int e = 0; e < V; ++e) i1[e] = out_index(x1[e], ph, ii * dh, sh, Ho);
      for (int ji = 0; ji < kw; ++ji) {
        const int j0 = out_index(y0, pw, ji * dw, sw, Wo);
        if (j0 < 0) continue;
        const i64 o0 = ob + i0 * a.ss2 + j0 * a.ss3;
        Acc v[V];
#pragma unroll
        for (int e = 0; e < V; ++e) {  // V loads in flight; absent terms are not read
          const int j1 = out_index(y1[e], pw, ji * dw, sw, Wo);
          v[e] = (i1[e] >= 0 && j1 >= 0) ? ld_any<Acc, 0>(gs, o0 + i1[e] * a.ss4 + j1 * a.ss5, dt)
                                         : (Acc)0;
        }
#pragma unroll
        for (int e = 0; e < V; ++e) s[e] = aadd(s[e], v[e]);
      }
    }
    if (gg) {
      Tg t[V];
#pragma unroll
      for (int e = 0; e < V; ++e) Cv<Acc>::to(t[e], s[e]);  // rounded once, stored Cg times
      const i64 c_first = g * a.Cg + ch * a.chunk;
      const i64 c_end = lmin(c_first + a.chunk, (g + 1) * a.Cg);
      i64 og = b * a.sgg0 + c_first * a.sgg1 + x0 * a.sgg2 + y0 * a.sgg3;
      og += V > 1 ? (i64)q : x1[0] * a.sgg4 + y1[0] * a.sgg5;
      for (i64 c = c_first; c < c_end; ++c, og += a.sgg1) stv<Tg, V, 1>(gg + og, t);
    }
    if (D && ch == 0) stv<Acc, V, 0>(D + (bg * HW + p) * HW + q, s);
  }
}

// dL/dmu[b, ci, x0, y0] for up to MU_CPT channels of one group a thread (neighbouring
// threads: neighbouring (x0, y0), one channel block: mu's loads are warp broadcasts, the
// D[z, x] loads coalesced, the D[x, z] row reused from L1 along z). Any strides and
// dtypes for mu and grad_mu (run-time typed). Unlinked (x, z) are skipped (see above).
#ifndef MU_CPT
#define MU_CPT 16
#endif
template <typename Acc>
__global__ void __launch_bounds__(THREADS) cc_vjp_mu(const Args a) {
  const int H = (int)a.H, W = (int)a.W, HW = H * W, dt_mu = (int)a.dt_mu, dt_gm = (int)a.dt_gm;
  const i64 ncb = (a.Cg + MU_CPT - 1) / MU_CPT;
  const Acc* D = (const Acc*)a.dsc;
  const unsigned char* Lh = (const unsigned char*)a.lnk;
  const unsigned char* Lw = Lh + (i64)H * H;
  const void* mu = (const void*)a.mu;
  void* gm = (void*)a.gm;
  for (i64 idx = thread_index(); idx < a.n; idx += grid_stride()) {
    i64 r1, p64, bg, cb, b, g;
    divmod(idx, HW, r1, p64);
    divmod(r1, ncb, bg, cb);
    divmod(bg, a.G, b, g);
    const int p = (int)p64, x0 = p / W, y0 = p - x0 * W;
    const i64 c_first = g * a.Cg + cb * MU_CPT;
    const int nc = (int)lmin(MU_CPT, (g + 1) * a.Cg - c_first);
    const Acc* Drow = D + (bg * HW + p) * HW;  // D[x, z]
    const Acc* Dcol = D + bg * HW * HW + p;    // D[z, x] at z * HW
    const i64 om = b * a.sm0 + c_first * a.sm1;
    Acc s[MU_CPT];
#pragma unroll
    for (int c = 0; c < MU_CPT; ++c) s[c] = (Acc)0;
    for (int x1 = 0; x1 < H; ++x1) {
      if (!Lh[x0 * H + x1]) continue;
      const unsigned char* lw = Lw + y0 * W;
      for (int y1 = 0; y1 < W; ++y1) {
        if (!lw[y1]) continue;
        const int z = x1 * W + y1;
        const Acc k = aadd(ldh<0>(Drow + z), ldh<0>(Dcol + (i64)z * HW));
        const i64 oz = om + x1 * a.sm2 + y1 * a.sm3;
        Acc m[MU_CPT];
#pragma unroll
        for (int c = 0; c < MU_CPT; ++c) m[c] = c < nc ? ld_any<Acc, 0>(mu, oz + c * a.sm1, dt_mu) : (Acc)0;
#pragma unroll
        for (int c = 0; c < MU_CPT; ++c) s[c] = afma(m[c], k, s[c]);
      }
    }
    const i64 og = b * a.sgm0 + c_first * a.sgm1 + x0 * a.sgm2 + y0 * a.sgm3;
#pragma unroll
    for (int c = 0; c < MU_CPT; ++c)
      if (c < nc) st_any<Acc>(gm, og + c * a.sgm1, dt_gm, s[c]);
  }
}
"""

_THREADS = 256
_DIRECT_TERMS = 1 << 22  # below this many S terms, one launch beats two (launch-bound)
# ... and when the box filter reads few positions of T (large strides), T is mostly waste:
# one launch when kh*kw*(Ho*Wo)**2 <= _DIRECT_RATIO * (H*W)**2.
_DIRECT_RATIO = 2
_OPTIONS = ("-std=c++14",)
_MU_CPT = 16  # channels a thread of cc_vjp_mu sums (MU_CPT in SOURCE)
_STREAM_SU = 4  # cc_stream's vectors of out in flight a thread (STREAM_SU in SOURCE)
#: cc_stream's ROWS variant where it applies (a full-layout out's evenly spaced rows: one
#: index division a thread; mid's GPU part 103.5 -> 99.5 us, SOURCE); False: the general
#: one everywhere (an A/B knob).
_STREAM_ROWS = True
#: S by walks along its diagonals (cc_sbox_walk) where the rows have stride 1 and
#: dilation 1 and kh <= WALK_KMAX; else one thread an element (cc_sbox).
_SBOX_WALK = True
_WALK_KMAX = 7  # WALK_KMAX in SOURCE
#: Steps a walk issues the loads of at once (U in SOURCE). With the width read at run time
#: 8 beat 4 (big's S 165 -> 150 us); with the 3x3 width compiled in, 4 steps (44
#: registers) beat 8 (48), 16 (86) and 2 (48): big-f16's walk 115.5 -> 109 us (H200,
#: 2026-11-30, ab32.py, ab35.py).
_WALK_U = 4
#: The 3x3 walk with its width a compile-time constant (KW = 3 in SOURCE: every column's
#: loads of a round issued before their sums); False: the width read at run time.
_WALK_KW = True
#: Channels of grad_gamma one cc_vjp_gamma thread stores (None: all of the group's, split
#: only when that under-fills the device). Not yet measured on the H200: a knob to try.
_VJP_CHUNK = None


def _stream_ch(out_cxx, acc_cxx):
    """Output channels a cc_stream thread updates from each S vector it loads (CH in
    SOURCE): 2 where 16-bit out meets float32 S (S is the larger stream), else 1."""
    return 2 if out_cxx in ("f16", "bf16") and acc_cxx == "float" else 1


def _widths(itemsize):
    """Vector widths (elements) that the fast kernels are instantiated for: up to 16 bytes."""
    return [v for v in (1, 2, 4, 8) if v * itemsize <= 16]


def _family_names(family):
    """name_expressions of one RawModule: a storage type and an accumulation type."""
    kind, cxx, acc = family
    if kind == "generic":
        return [f"cc_direct<anyt, {acc}>"]
    if kind == "vjp":  # the backward: grad_gamma stored as cxx (or only D, stored as acc)
        stores = dict.fromkeys((cxx, acc))
        return ([f"cc_vjp_gamma<{t}, {acc}, {v}>" for t in stores
                 for v in _widths({"f16": 2, "bf16": 2, "float": 4, "double": 8}[t])]
                + [f"cc_vjp_link<{acc}>", f"cc_vjp_mu<{acc}>"])
    size = {"f16": 2, "bf16": 2, "float": 4, "double": 8}[cxx]
    return ([f"cc_gsum<{cxx}, {cxx}, {acc}, {v}>" for v in _widths(size)]
            + [f"cc_gsum<{cxx}, anyt, {acc}, 1>"]
            + [f"cc_stream<{cxx}, {acc}, {v}, {_stream_ch(cxx, acc)}, {rows}>"
               for v in _widths(size) for rows in (0, 1)]
            + [f"cc_sbox<{acc}>", f"cc_direct<{cxx}, {acc}>"]
            + [f"cc_sbox_walk<{acc}, {kh}, {kw}, {_WALK_U}>"
               for kh, kw in ((0, 0), (3, 0), (3, 3))])


#: The kernels' ``Args`` struct as a NumPy dtype: ``_ARGS_STRUCT``'s layout (every field 8
#: bytes, in order, no padding; c_value is written as its float64 bits). CuPy passes a
#: structured scalar by value, and the driver copies sizeof(Args) bytes from its data: the
#: struct, as the kernel declares it. One subarray field, not one field a member: CuPy
#: reads the dtype's description on every launch, which costs per field.
_ARGS = np.dtype([("words", "<i8", (len(_FIELDS),))])
#: Args slots a forward call writes, in the order _launch gives their values: the
#: addresses of out, gamma, mu, c, T and S, and c's bits when c is a number (c_value).
_CALL_SLOTS = np.array([_SLOT[n] for n in ("out", "gamma", "mu", "c", "t", "s", "c_value")])
_BLOCK = (_THREADS,)


class _Launch:
    """One kernel launch of a plan: the kernel (a ``cupy.RawKernel``), its grid (blocks of
    ``_THREADS``), and its Args as an int64 template with the address slots empty."""

    __slots__ = ("func", "grid", "args")

    def __init__(self, func, grid, args):
        self.func, self.grid, self.args = func, grid, args


class _Launches:
    """A plan's launches, their Args templates as one int64 array (a row a launch) that a
    call copies and fills (``_fill``), and (kernel, grid) per launch for ``_launch_all``."""

    __slots__ = ("launches", "template", "calls")

    def __init__(self, launches):
        self.launches = launches
        self.template = np.stack([ln.args for ln in launches])
        self.calls = tuple((ln.func, (ln.grid,)) for ln in launches)


def _fill(plan, slots, values):
    """A copy of ``plan``'s Args templates with ``values`` written into the Args ``slots``
    of every launch's row: a call's own arguments, so calls from several threads at once
    share nothing they write."""
    args = plan.template.copy()
    args[:, slots] = values
    return args


def _launch_all(plan, args):
    """Launch ``plan``'s kernels, launch i with row i of ``args`` (``_fill``) as its Args,
    on CuPy's current stream of the current device. Each row is viewed as a one-element
    array of ``_ARGS``; CuPy keeps it alive through the launch, and the driver has copied
    the parameters when the call returns."""
    for (kernel, grid), a in zip(plan.calls, args.view(_ARGS)):
        kernel(grid, _BLOCK, (a,))


def _wait(runtime, stream, other):
    """Make ``stream`` wait for the work queued on ``other`` so far: an event recorded
    there, no host wait."""
    event = runtime.eventCreateWithFlags(runtime.eventDisableTiming)
    try:
        runtime.eventRecord(event, other)
        runtime.streamWaitEvent(stream, event)
    finally:
        runtime.eventDestroy(event)  # released once the wait is done with it


class _StreamHandle:
    """A raw stream handle in the CUDA stream protocol (``__cuda_stream__``), for
    ``cupy.cuda.Stream.from_external``."""

    __slots__ = ("handle",)

    def __init__(self, handle):
        self.handle = handle

    def __cuda_stream__(self):
        return (0, self.handle)


class _Plan(_Launches):
    """The launches of one call signature, and the scratch they need: ``scratch``
    elements of the accumulation type, S first (padded to 256 bytes), T at ``t_offset``
    bytes."""

    __slots__ = ("scratch", "t_offset", "acc")

    def __init__(self, launches, s_items, t_items, acc):
        super().__init__(launches)
        size = 8 if acc == "float64" else 4
        s_pad = -(-s_items * size // _ALIGN) * _ALIGN // size
        self.acc = acc
        self.scratch, self.t_offset = s_pad + t_items, s_pad * size


class _VjpPlan(_Launches):
    """The launches of one backward call signature: cc_vjp_link (the axes' link tables),
    cc_vjp_gamma (D, grad_gamma), cc_vjp_mu (grad_mu), those needed. Scratch:
    ``scratch`` accumulation-type elements, D first (``B*G*(H*W)**2``, only when grad_mu
    is wanted), the link tables (``H*H + W*W`` bytes) at ``lnk_offset`` bytes."""

    __slots__ = ("scratch", "lnk_offset", "acc")

    def __init__(self, launches, d_items, lnk_bytes, acc):
        super().__init__(launches)
        size = 8 if acc == "float64" else 4
        d_bytes = -(-d_items * size // _ALIGN) * _ALIGN
        self.acc, self.lnk_offset = acc, d_bytes
        self.scratch = -(-(d_bytes + lnk_bytes) // size) if d_items or lnk_bytes else 0


#: Args slots of the backward's addresses, in the order _vjp_pointers returns them.
_VJP_PTR_SLOTS = np.array([_SLOT[n] for n in ("gs", "gg", "gm", "mu", "dsc", "lnk")])


def _vjp_pointers(a, plan, base):
    """Addresses for the backward's Args (``_VJP_PTR_SLOTS``), scratch at ``base``."""
    gg, gm = a.grad_gamma_info, a.grad_mu_info
    d = base if base and gm is not None else 0
    return (a.grad_S_info.ptr, 0 if gg is None else gg.ptr, 0 if gm is None else gm.ptr,
            a.mu_info.ptr, d, base + plan.lnk_offset if d else 0)


_DOUBLE = struct.Struct("<d")
_INT64 = struct.Struct("<q")
_ALIGN = 256  # bytes: scratch sub-buffers start on this boundary (vector loads need 16)
_NO_STREAM_CHANGE = contextlib.nullcontext()


def _c_bits(cptr, c_value):
    """The Args bits of c_value: c, when it is a Python number (cptr 0), as a float64."""
    return 0 if cptr else _INT64.unpack(_DOUBLE.pack(c_value))[0]


class CupyBackend(Backend):
    name = "cupy"
    device = "cuda"
    dtypes = frozenset({"float16", "bfloat16", "float32", "float64"})

    def __init__(self):
        self._lock = threading.Lock()  # guards compilation and the caches' first fill
        self._modules = {}  # family -> cupy.RawModule
        self._functions = {}  # (name expression, device) -> cupy.RawKernel loaded there
        self._plans = {}  # call signature (no pointers) -> _Plan
        self._device_info = {}  # device -> (multiprocessors, threads per multiprocessor)
        self._stream_objects = {}  # raw stream handle -> a CuPy stream object for it
        self._cp = None

    # ------------------------------------------------------------ availability
    def _probe(self):
        try:
            import cupy
        except Exception as exc:  # ImportError, or a broken install (missing CUDA libs)
            return f"not installed (import cupy failed: {exc})"
        try:
            n = cupy.cuda.runtime.getDeviceCount()
        except Exception as exc:  # no driver, or no device visible
            return f"no CUDA device ({type(exc).__name__}: {exc})"
        if n < 1:
            return "no CUDA device"
        self._cp = cupy
        return None

    # ------------------------------------------------------------ compilation
    def _function(self, name, family, dev):
        """The kernel ``name`` (a ``cupy.RawKernel`` of its family's ``RawModule``), loaded
        on device ``dev`` (current), compiling once."""
        f = self._functions.get((name, dev))
        if f is None:
            with self._lock:
                f = self._functions.get((name, dev))
                if f is None:
                    mod = self._modules.get(family)
                    if mod is None:
                        mod = self._cp.RawModule(code=SOURCE, options=_OPTIONS,
                                                 name_expressions=_family_names(family))
                        self._modules[family] = mod
                    f = mod.get_function(name)  # compiles (once) and loads on dev
                    self._functions[(name, dev)] = f
        return f

    def _sm_threads(self, dev):
        info = self._device_info.get(dev)
        if info is None:
            attrs = self._cp.cuda.Device(dev).attributes
            info = (attrs["MultiProcessorCount"], attrs["MaxThreadsPerMultiProcessor"])
            self._device_info[dev] = info
        return info

    # ------------------------------------------------------------ planning
    def _plan(self, p, dev):
        oi, gi, mi, ci = p.out_info, p.gamma_info, p.mu_info, p.c_info
        B, G, H, W, Ho, Wo = p.B, p.G, p.H, p.W, p.Ho, p.Wo
        Cg, Cog = p.Ci // G, p.Co // G
        HW, HoWo = H * W, Ho * Wo
        acc = p.acc
        acc_cxx = _ACC_CXX[acc]
        sms, threads_per_sm = self._sm_threads(dev)
        capacity = sms * threads_per_sm  # threads resident at once

        # Strides in elements, the channel diagonal folded into one stride.
        so = diag_strides(oi.strides, p.full_out)
        sg = (0,) * 6 if gi is None else diag_strides(gi.strides, p.full_gamma)
        sm = tuple(mi.strides)
        sc = 0 if ci is None or ci.shape == () else ci.strides[0]
        base = dict(
            B=B, G=G, Cg=Cg, Cog=Cog, H=H, W=W, Ho=Ho, Wo=Wo, kh=p.kh, kw=p.kw, sh=p.sh,
            sw=p.sw, ph=p.ph, pw=p.pw, dh=p.dh, dw=p.dw, sc=sc,
            dt_out=_DTYPES[oi.dtype][0], dt_gamma=_DTYPES[gi.dtype][0] if gi else 0,
            dt_mu=_DTYPES[mi.dtype][0], dt_c=_DTYPES[ci.dtype][0] if ci else 0,
            nchunk=1, chunk=Cog, nseg=1, seg_len=1, tiles=1,
        )
        base.update({f"so{i}": v for i, v in enumerate(so)})
        base.update({f"sg{i}": v for i, v in enumerate(sg)})
        base.update({f"sm{i}": v for i, v in enumerate(sm)})

        def launch(name, family, n, grid=None, **kw):
            vals = [0] * len(_FIELDS)
            for k, v in {**base, "n": n, **kw}.items():
                vals[_SLOT[k]] = int(v)
            if grid is None:
                grid = -(-n // _THREADS)
            return _Launch(self._function(name, family, dev), min(grid, 2**31 - 1),
                           np.array(vals, np.int64))

        def chunks(items, want):
            # Split each group's output channels into chunks when one chunk per row
            # would leave the device under-filled; every chunk recomputes S.
            nchunk = max(1, min(Cog, -(-want // max(items, 1))))
            chunk = -(-Cog // nchunk)
            return -(-Cog // chunk), chunk

        direct_terms = B * G * HoWo * HoWo * max(Cg, 1) * p.kh * p.kw
        # Large strides: T would cover mostly positions no output reads. (Not when T is
        # no larger than S, as for 1x1 kernels: the direct kernel's out-update, a loop
        # over the output channels in each thread, is the slower one on large problems.)
        sparse_t = HW * HW > HoWo * HoWo and p.kh * p.kw * HoWo * HoWo <= _DIRECT_RATIO * HW * HW
        if direct_terms <= _DIRECT_TERMS or sparse_t:
            items = B * G * HoWo * HoWo
            nchunk, chunk = chunks(items, capacity)
            # Typed when out, gamma and mu share a dtype (the usual case); else run-time typed.
            stored = {oi.dtype, mi.dtype} | ({gi.dtype} if gi else set())
            if len(stored) == 1:
                cxx = _DTYPES[oi.dtype][1]
                name, family = f"cc_direct<{cxx}, {acc_cxx}>", ("fast", cxx, acc_cxx)
            else:
                name, family = f"cc_direct<anyt, {acc_cxx}>", ("generic", "", acc_cxx)
            return _Plan([launch(name, family, items * nchunk, nchunk=nchunk, chunk=chunk)],
                         0, 0, acc)

        # Kernel 1 (T) is typed on gamma's storage (mu's without gamma); mu of another
        # dtype than gamma's is read run-time typed, one q a thread.
        g_dtype = gi.dtype if gi else mi.dtype
        g_cxx, g_size = _DTYPES[g_dtype][1], _DTYPES[g_dtype][2]
        m_size = _DTYPES[mi.dtype][2]
        mu_vec = (m_size, (sm[2], sm[3]), (sm[0], sm[1]), mi.ptr)
        m_cxx = g_cxx if mi.dtype == g_dtype else "anyt"
        if m_cxx == "anyt":
            v1 = 1
        elif gi is None:
            v1 = vector_width(m_size, HW, (sm[2], sm[3]), (H, W), (sm[0], sm[1]), mi.ptr)
        else:
            v1 = vector_width(g_size, HW, (sg[4], sg[5]), (H, W), sg[:4], gi.ptr, (mu_vec,))
        launches = []
        n1 = B * G * HW * (HW // v1)
        if n1:
            launches.append(launch(f"cc_gsum<{g_cxx}, {m_cxx}, {acc_cxx}, {v1}>",
                                   ("fast", g_cxx, acc_cxx), n1))
        o_cxx, o_size = _DTYPES[oi.dtype][1], _DTYPES[oi.dtype][2]
        family = ("fast", o_cxx, acc_cxx)
        # S, then out streamed in address order. A contiguous (i0, j0, i1, j1) block of
        # out is one segment a (b, c0): a plain axpy with S[b, g], vectorised when its
        # length and alignment allow; otherwise one segment per (i0, j0).
        n_s = B * G * HoWo * HoWo
        if _SBOX_WALK and p.sh == 1 and p.dh == 1 and p.kh <= _WALK_KMAX:
            kh = 3 if p.kh == 3 else 0  # the instantiated shapes (KH, KW in SOURCE)
            kw = 3 if kh == 3 and p.kw == 3 and _WALK_KW else 0
            launches.append(launch(f"cc_sbox_walk<{acc_cxx}, {kh}, {kw}, {_WALK_U}>", family,
                                   B * G * (2 * Ho - 1) * Wo * Wo))
        else:
            launches.append(launch(f"cc_sbox<{acc_cxx}>", family, n_s))
        if contiguous(so[2:], (Ho, Wo, Ho, Wo)):
            nseg, seg_len = 1, HoWo * HoWo
            v3 = vector_width(o_size, seg_len, so[2:], (Ho, Wo, Ho, Wo), so[:2], oi.ptr)
        else:
            nseg, seg_len = HoWo, HoWo
            v3 = vector_width(o_size, HoWo, (so[4], so[5]), (Ho, Wo), so[:4], oi.ptr)
        ch = _stream_ch(o_cxx, acc_cxx)
        tiles = -(-nseg * (seg_len // v3) // (_THREADS * (_STREAM_SU // ch)))
        # ROWS (SOURCE): rows at one stride, positions in 32 bits
        rows = int(_STREAM_ROWS and nseg > 1 and contiguous((so[4], so[5]), (Ho, Wo))
                   and so[2] == Wo * so[3] and tiles * _THREADS * _STREAM_SU < 2**31)
        launches.append(launch(f"cc_stream<{o_cxx}, {acc_cxx}, {v3}, {ch}, {rows}>", family, 0,
                               grid=B * G * -(-Cog // ch) * tiles, nseg=nseg,
                               seg_len=seg_len, tiles=tiles))
        return _Plan(launches, n_s, B * G * HW * HW, acc)

    def _vjp_plan(self, a, dev):
        """Launches for one backward call signature (see cc_vjp_gamma in SOURCE)."""
        B, G, H, W, Ho, Wo = a.B, a.G, a.H, a.W, a.Ho, a.Wo
        Cg, HW = a.Ci // G, a.H * a.W
        acc = a.acc
        acc_cxx, acc_size = _ACC_CXX[acc], 8 if acc == "float64" else 4
        sms, threads_per_sm = self._sm_threads(dev)
        capacity = sms * threads_per_sm
        gg, gm, mi, si = a.grad_gamma_info, a.grad_mu_info, a.mu_info, a.grad_S_info
        sgg = (0,) * 6 if gg is None else diag_strides(gg.strides, a.full_gamma)
        base = dict(B=B, G=G, Cg=Cg, H=H, W=W, Ho=Ho, Wo=Wo, kh=a.kh, kw=a.kw, sh=a.sh,
                    sw=a.sw, ph=a.ph, pw=a.pw, dh=a.dh, dw=a.dw,
                    dt_gs=_DTYPES[si.dtype][0], dt_mu=_DTYPES[mi.dtype][0],
                    dt_gm=_DTYPES[gm.dtype][0] if gm is not None else 0, nchunk=1, chunk=Cg)
        base.update({f"ss{i}": v for i, v in enumerate(si.strides)})
        base.update({f"sgg{i}": v for i, v in enumerate(sgg)})
        base.update({f"sm{i}": v for i, v in enumerate(mi.strides)})
        if gm is not None:
            base.update({f"sgm{i}": v for i, v in enumerate(gm.strides)})

        if gg is not None:  # vectors of grad_gamma (D, 256-byte aligned, follows)
            cxx, size = _DTYPES[gg.dtype][1], _DTYPES[gg.dtype][2]
            v = vector_width(size, HW, sgg[4:], (H, W), sgg[:4], gg.ptr)
        else:  # only D is stored
            cxx = acc_cxx
            v = max(w for w in _widths(acc_size) if HW % w == 0)
        family = ("vjp", cxx, acc_cxx)

        def launch(name, n, **kw):
            vals = [0] * len(_FIELDS)
            for k, val in {**base, "n": n, **kw}.items():
                vals[_SLOT[k]] = int(val)
            return _Launch(self._function(name, family, dev), min(-(-n // _THREADS), 2**31 - 1),
                           np.array(vals, np.int64))

        launches = []
        if gm is not None:
            launches.append(launch(f"cc_vjp_link<{acc_cxx}>", H * H + W * W))
        items = B * G * HW * (HW // v)
        nchunk = 1
        if gg is not None:  # split each group's channels when the rows alone under-fill
            nchunk = max(1, min(Cg, -(-capacity // items)))
        chunk = -(-Cg // nchunk)
        if gg is not None and _VJP_CHUNK:  # a tuning override (docs/cupy.md, Backward)
            chunk = max(1, min(Cg, _VJP_CHUNK))
        nchunk = -(-Cg // chunk)
        launches.append(launch(f"cc_vjp_gamma<{cxx}, {acc_cxx}, {v}>", items * nchunk,
                               nchunk=nchunk, chunk=chunk))
        if gm is not None:
            ncb = -(-Cg // _MU_CPT)
            launches.append(launch(f"cc_vjp_mu<{acc_cxx}>", B * G * ncb * HW))
        return _VjpPlan(launches, B * G * HW * HW if gm is not None else 0,
                        H * H + W * W if gm is not None else 0, acc)

    # ------------------------------------------------------------ the call
    @contextlib.contextmanager
    def _scratch(self, kind, plan, dev, stream):
        """The address of the plan's scratch (S and T; D and the link tables for the
        backward: ``plan.scratch`` accumulation-type elements; 0 when it has none) for the
        launches queued on ``stream`` inside the block. Allocated stream-ordered from the
        arrays' library (torch's caching allocator for torch tensors,
        ``convcov._arrays.torch_scratch``; CuPy's memory pool otherwise) and freed when the
        block ends: the memory is only reused by work queued behind the launches, and a
        CUDA-graph capture sees no foreign allocation."""
        if not plan.scratch:
            yield 0
        elif kind == "torch":
            buf, ptr = torch_scratch(plan.scratch * (8 if plan.acc == "float64" else 4), dev,
                                     stream)
            yield ptr
        else:
            cp = self._cp
            buf = cp.empty(plan.scratch, dtype=plan.acc)
            current = cp.cuda.get_current_stream(dev).ptr
            if stream == current:
                yield buf.data.ptr
                return
            # Not CuPy's current stream (a generic CUDA array's). CuPy's pool orders a
            # block's reuse by the stream current at allocation: the launch stream waits
            # for that stream's earlier users of the block, and that stream for our
            # kernels. (Allocating under the launch stream instead would leave a pool
            # arena behind for every stream.)
            _wait(cp.cuda.runtime, stream, current)
            try:
                yield buf.data.ptr
            finally:
                _wait(cp.cuda.runtime, current, stream)

    def _stream_object(self, handle):
        """A CuPy stream object for raw stream handle ``handle``, to make CuPy's current
        stream around launches (``with``): ``cupy.cuda.Stream.from_external`` where CuPy
        has it (14 and later), else ``cupy.cuda.ExternalStream``. It only holds the handle
        (device -1: the current one), so one object serves every call on that handle."""
        s = self._stream_objects.get(handle)
        if s is None:
            cuda = self._cp.cuda
            if hasattr(cuda.Stream, "from_external"):
                s = cuda.Stream.from_external(_StreamHandle(handle))
            else:
                s = cuda.ExternalStream(handle)
            if len(self._stream_objects) >= 64:  # many streams: start over rather than grow
                self._stream_objects.clear()
            self._stream_objects[handle] = s
        return s

    def _on_stream(self, kind, stream):
        """A context in which CuPy's current stream is the launch stream ``stream``: it
        already is for CuPy arrays (``launch_streams``)."""
        return _NO_STREAM_CHANGE if kind == "cupy" else self._stream_object(stream)

    def _streams(self, call, dev):
        """(the launch stream of a call, the streams to make wait for its launches
        afterwards: ``_follow``), as ``launch_streams`` picks them; the launch stream made
        to wait for the other streams its generic CUDA arrays name (an event recorded on
        each, no host wait)."""
        stream, waits, then = launch_streams(call.kind, dev, call.infos, call.written)
        if call.kind == "cai":
            if stream not in (0, 1) and self._stream_object(stream).is_capturing():
                raise BackendError(f"cupy: {CAPTURED}")
            runtime = self._cp.cuda.runtime
            for w in waits:
                _wait(runtime, stream, w)
        return stream, then

    def _follow(self, stream, then):
        """Make the streams ``then`` wait for the launches queued on ``stream``: the other
        streams a call writes arrays for (``launch_streams``)."""
        for t in then:
            _wait(self._cp.cuda.runtime, t, stream)

    def _enter(self, device):
        """(cupy, the device to run on, the device to restore afterwards or None)."""
        cp = self._cp
        if cp is None:  # selection probed another instance (tests): probe this one
            reason = self._probe()
            if reason is not None:
                raise RuntimeError(f"cupy: {reason}")
            cp = self._cp
        runtime = cp.cuda.runtime
        prev = runtime.getDevice()
        dev = device[1] if device[1] is not None else prev
        if dev != prev:
            runtime.setDevice(dev)
        return cp, dev, (prev if dev != prev else None)

    def _on_device(self, device, fn, *args):
        """fn(device id, *args) with the arrays' device current (restored after); its result."""
        cp, dev, prev = self._enter(device)
        try:
            return fn(dev, *args)
        finally:
            if prev is not None:
                cp.cuda.runtime.setDevice(prev)

    def accumulate(self, p) -> None:
        self._on_device(p.device, self._run, p)

    def _run(self, dev, p):
        stream, _ = self._streams(p, dev)  # (the forward writes one array: none to follow)
        self._launch(dev, self._plan_of(dev, p), p.kind, stream, p.out_info.ptr,
                     0 if p.gamma_info is None else p.gamma_info.ptr, p.mu_info.ptr,
                     0 if p.c_info is None else p.c_info.ptr, p.c_value)

    def _cached(self, key, make, *args):
        """The plan cached under ``key``, made by make(*args) the first time."""
        plan = self._plans.get(key)
        if plan is None:
            plan = make(*args)
            if len(self._plans) > 512:  # many shapes: start over rather than grow
                self._plans.clear()
            self._plans[key] = plan
        return plan

    def _plan_of(self, dev, p):
        return self._cached((dev, p.layout_key()), self._plan, p, dev)  # all but addresses

    def _launch(self, dev, plan, kind, stream, optr, gptr, mptr, cptr, c_value):
        """Launch a plan on ``dev`` (current) on ``stream`` (``_streams``): the addresses
        of out, gamma, mu and c (0 for an absent gamma, which the kernels test, and for a
        number c, which they then take from c_value)."""
        with self._scratch(kind, plan, dev, stream) as s_ptr:
            args = _fill(plan, _CALL_SLOTS, (optr, gptr, mptr, cptr, s_ptr + plan.t_offset,
                                             s_ptr, _c_bits(cptr, c_value)))
            with self._on_stream(kind, stream):
                _launch_all(plan, args)

    def bind(self, p):
        """The launcher of p's signature for the front end's fast path (Backend.bind): the
        plan, the stream getter and the scratch size are found once; a call makes the
        device current, reads torch's current stream, takes scratch from torch's allocator
        and launches (what ``accumulate`` does for torch tensors, without the lookups).
        The fast path binds torch calls only."""
        if p.device[1] is None or p.kind != "torch":
            return None
        plan = self._on_device(p.device, self._plan_of, p)  # compiled and loaded there
        dev = p.device[1]
        runtime = self._cp.cuda.runtime
        get_device, set_device = runtime.getDevice, runtime.setDevice
        stream_of, stream_object = torch_stream_getter(), self._stream_object
        nbytes = plan.scratch * (8 if plan.acc == "float64" else 4)
        t_offset = plan.t_offset

        def run(out, gamma, mu, c, optr, gptr, mptr, cptr, c_value):
            prev = get_device()
            if prev != dev:
                set_device(dev)
            try:
                stream = stream_of(dev)
                owner, s_ptr = torch_scratch(nbytes, dev, stream) if nbytes else (None, 0)
                args = _fill(plan, _CALL_SLOTS, (optr, gptr, mptr, cptr, s_ptr + t_offset,
                                                 s_ptr, _c_bits(cptr, c_value)))
                with stream_object(stream):
                    _launch_all(plan, args)
                del owner  # back to its stream-ordered pool, behind the launches
            finally:
                if prev != dev:
                    set_device(prev)

        return run

    def patch_moment_vjp(self, a) -> None:
        """The backward (docs/autograd.md's contract, docs/cupy.md "Backward"): overwrite
        ``a.grad_mu`` and the channel-diagonal of ``a.grad_gamma`` (each may be None)."""
        self._on_device(a.device, self._run_vjp, a)

    def _run_vjp(self, dev, a):
        gg, gm, mi, si = a.grad_gamma_info, a.grad_mu_info, a.mu_info, a.grad_S_info
        key = ("vjp", dev, a.acc, a.kh, a.kw, a.sh, a.sw, a.ph, a.pw, a.dh, a.dw, a.G,
               a.full_gamma, si.dtype, si.shape, si.strides, mi.dtype, mi.shape, mi.strides,
               None if gg is None else (gg.dtype, gg.shape, gg.strides, gg.ptr & 15),
               None if gm is None else (gm.dtype, gm.shape, gm.strides))
        plan = self._cached(key, self._vjp_plan, a, dev)
        stream, then = self._streams(a, dev)
        with self._scratch(a.kind, plan, dev, stream) as base:
            args = _fill(plan, _VJP_PTR_SLOTS, _vjp_pointers(a, plan, base))
            with self._on_stream(a.kind, stream):
                _launch_all(plan, args)
        self._follow(stream, then)


backend = CupyBackend()
