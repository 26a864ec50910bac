"""``cupy``: CUDA C++ kernels compiled by CuPy (NVRTC); the automatic first choice for CUDA arrays.

Owns the CUDA C++ source below (``SOURCE``), its compilation into ``cupy.RawModule`` objects
(templated on the storage and accumulation types: one module per type family, compiled
once per process, cached on disk by CuPy), the choice of kernels and launch sizes for one
call, and the launch itself on the arrays' device and on their library's current stream:
torch's for torch tensors, CuPy's for CuPy arrays; for other ``__cuda_array_interface__``
objects (numba device arrays) the stream ``out`` names, after the streams the inputs name
(``convcov._arrays.launch_streams``).

Design (docs/backends.md "The GPU design", docs/cupy.md). The operation is memory-bound;
``convcov.backends._plan`` chooses, from the problem's quantities, at most three launches:

* ``cc_gsum`` (where S is formed from T) reads the channel-diagonal of ``gamma`` exactly
  once, streaming, 16 bytes a load where the layout allows, and writes the per-group
  channel sum of ``gamma + mu (x) mu``: ``T[b, g, x0, y0, x1, y1]``.
* ``cc_fused`` forms V consecutive values of a row of ``S[b, g, p0, :]`` in registers
  (the kh x kw box filter of T, or the channel sum inside the box filter straight from
  ``gamma`` and ``mu`` where that is fewer terms than T has elements) and adds
  ``c[c0] * S`` into ``out``'s channel-diagonal for a chunk of the group's output
  channels, V elements a load: S never reaches memory.
* ``cc_planes`` (depthwise layers, in place of T: ``_plan.by_planes``): a block sums the
  planes ``P[x0, :, x1, :]`` of gamma + mu (x) mu that a run of planes of S along one
  diagonal ``i1 - i0`` reads into shared memory, once each, then forms those planes of S
  from there and adds ``c[c0] * S`` into out: one launch, no T.
* ``cc_stream`` (where many channels share each long row of S): ``cc_fused`` writes S,
  and this kernel streams ``out[b, c0] += c[c0] * S[b, g]`` in address order.

Scratch: T and S where they are formed, one buffer of accumulation-type elements,
allocated stream-ordered from the arrays' library (nothing grows with Ci*Ci or Co).
Terms with a position in the padding are skipped (SPEC section 1), so NaN/Inf in ``mu``
never meets a padded zero. Index arithmetic is 64-bit wherever an offset can pass
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
stream object made current around them for any other (``_stream_object``). Only
``cc_planes`` uses shared memory (dynamic, at most 48 KiB a block); the other kernels'
reuse is served by L1/L2. Repeated small calls are the
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
from . import _plan

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
    "src",                                     # out's values are read here (out: in place)
    "B", "G", "Cg", "Cog", "H", "W", "Ho", "Wo",
    "kh", "kw", "sh", "sw", "ph", "pw", "dh", "dw",
    "so0", "so1", "so2", "so3", "so4", "so5",  # out (b, c0, i0, j0, i1, j1), diagonal folded
    "sg0", "sg1", "sg2", "sg3", "sg4", "sg5",  # gamma (b, ci, x0, y0, x1, y1), diagonal folded
    "sm0", "sm1", "sm2", "sm3",                # mu (b, ci, x, y)
    "sc",                                      # c (0 for a 0-d c)
    "dt_out", "dt_gamma", "dt_mu", "dt_c",     # dtype codes (_DTYPES) for run-time typed loads
    "nchunk", "chunk",                         # output channels of a group split in chunks
    "to_s",                                    # cc_fused writes S (c = 1), not out
    "nseg", "seg_len",                         # cc_stream: rows of out[b, c0], their length
    "n",                                       # work items of this launch
    "runp", "wq",                              # cc_planes: planes of S a block, P's row
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

// Work slice z of the fused kernels: its (b, g) and its chunk [c0_first, c0_end) of the
// group's output channels.
struct Slice { i64 b, g, bg, c0_first, c0_end; };
__device__ __forceinline__ Slice slice_of(const Args& a, i64 z) {
  Slice r;
  i64 chunk;
  divmod(z, a.nchunk, r.bg, chunk);
  divmod(r.bg, a.G, r.b, r.g);
  r.c0_first = r.g * a.Cog + chunk * a.chunk;
  r.c0_end = lmin(r.c0_first + a.chunk, (r.g + 1) * a.Cog);
  return r;
}

// ---------------------------------------------------------------- kernel 2: S and out
// One thread: V consecutive output positions q = (i1, j1) of one p0 = (i0, j0) of one
// (b, g), and a chunk of the group's output channels. It forms those V values of
// S[b, g, p0, :] in registers,
//   from T (SRC_T = 1): the kh x kw box filter of T along the diagonal offset, kh*kw
//       loads an element from L1/L2;
//   or from gamma and mu (SRC_T = 0): the channel sum inside the box filter, Cg*kh*kw
//       terms an element (gamma absent: the Gram matrix of mu's patches),
// the terms walked as one flat sequence, KU of them a step with every load of a step
// issued before its sums (the loads hit the caches: latency, not bandwidth, bounds them).
// Then it adds c[c0] * S into out's channel-diagonal for every channel of its chunk, V
// elements a load and a store (16 bytes where out's (i1, j1) plane is contiguous and
// aligned: V > 1), UNROLL channels' loads in flight before their stores. S never reaches
// memory, which is what makes a depthwise layer (S as large as out) cost what out costs.
// Grid: x over q, y over p0, z over (b, g, chunk); y and z loop, so any size fits. Terms
// with a position in the padding are skipped (SPEC section 1). In-plane offsets of
// gamma's and mu's (x1, y1) are 32-bit (the host checks they fit), the rest 64-bit.
// Channels whose loads of out are in flight together: 8 (at 2 blocks a multiprocessor, for
// its registers) was 1-30% slower on every layer of the suite (H200).
#define UNROLL_OUT 4
// out[op + c0 * so1] = src[os + c0 * so1] + c[c0] * s for the channels [c0_first, c0_end),
// V elements a load and a store, UNROLL_OUT channels' loads in flight before their stores.
template <typename To, typename Acc, int V>
__device__ __forceinline__ void add_cs(const Args& a, To* op, const To* os, i64 c0_first,
                                       i64 c0_end, const Acc (&s)[V]) {
  for (i64 c0 = c0_first; c0 < c0_end; c0 += UNROLL_OUT) {
    Raw<To, V> old[UNROLL_OUT];
#pragma unroll
    for (int u = 0; u < UNROLL_OUT; ++u)
      if (c0 + u < c0_end) ldraw<To, V, 1>(os + (c0 + u) * a.so1, old[u]);
#pragma unroll
    for (int u = 0; u < UNROLL_OUT; ++u) {
      if (c0 + u < c0_end) {
        const Acc cv = c_of<Acc>(a, c0 + u);
        To o[V];
        unpack<To, V>(old[u], o);
#pragma unroll
        for (int e = 0; e < V; ++e) Cv<Acc>::to(o[e], afma(cv, s[e], Cv<Acc>::from(o[e])));
        stv<To, V, 1>(op + (c0 + u) * a.so1, o);
      }
    }
  }
}

// Blocks a multiprocessor from T (at most 80 registers; the direct source: 2, 128): 4 spills.
#define FUSED_T_BLOCKS 3
template <typename To, typename Tg, typename Acc, int V, int SRC_T>
__global__ void __launch_bounds__(THREADS, SRC_T ? FUSED_T_BLOCKS : 2) cc_fused(const Args a) {
  enum { KU = SRC_T ? (V >= 2 ? 16 / V : 8) : (V >= 2 ? (8 / V > 0 ? 8 / V : 1) : 4) };
  const int H = (int)a.H, W = (int)a.W, Wo = (int)a.Wo, HoWo = (int)(a.Ho * a.Wo);
  const int kh = (int)a.kh, kw = (int)a.kw, sh = (int)a.sh, sw = (int)a.sw;
  const int ph = (int)a.ph, pw = (int)a.pw, dh = (int)a.dh, dw = (int)a.dw;
  const int dt_g = (int)a.dt_gamma, dt_mu = (int)a.dt_mu;
  const int sg4 = (int)a.sg4, sg5 = (int)a.sg5, sm2 = (int)a.sm2, sm3 = (int)a.sm3;
  const void* gamma = (const void*)a.gamma;
  const void* mu = (const void*)a.mu;
  To* out = (To*)(a.to_s ? a.s : a.out);
  const i64 HW = (i64)H * W;
  const int nterm = kh * kw * (SRC_T ? 1 : (int)a.Cg);
  const i64 nz = a.B * a.G * a.nchunk, nqv = HoWo / V, nw = HoWo * nqv;
  for (i64 z = blockIdx.z; z < nz; z += gridDim.z) {
    const Slice sl = slice_of(a, z);
    const i64 b = sl.b, g = sl.g, bg = sl.bg, c0_first = sl.c0_first, c0_end = sl.c0_end;
    for (i64 w = thread_index(); w < nw; w += grid_stride()) {
      i64 p64, qv;
      divmod(w, nqv, p64, qv);
      const int p0 = (int)p64, q = (int)qv * V;
      const int i0 = p0 / Wo, j0 = p0 - i0 * Wo;
      int x1b[V], y1b[V];  // (x1, y1) of this thread's positions at kernel offset (0, 0)
      const int i1q = q / Wo, j1q = q - i1q * Wo;
      {
        int i1 = i1q, j1 = j1q;
#pragma unroll
        for (int e = 0; e < V; ++e) {
          x1b[e] = i1 * sh - ph; y1b[e] = j1 * sw - pw;
          if (++j1 == Wo) { j1 = 0; ++i1; }
        }
      }
      const i64 oq = i1q * a.so4 + j1q * a.so5;
      const int x0b = i0 * sh - ph, y0b = j0 * sw - pw;
      Acc s[V];
#pragma unroll
      for (int e = 0; e < V; ++e) s[e] = (Acc)0;
      int ii = 0, ji = 0, ci = 0;  // the next term's kernel offset (and channel)
      for (int t0 = 0; t0 < nterm; t0 += KU) {
        if (SRC_T) {
          Acc tv[KU][V];
#pragma unroll
          for (int u = 0; u < KU; ++u) {
            const int dx = ii * dh, dy = ji * dw, x0 = x0b + dx, y0 = y0b + dy;
            const bool row = t0 + u < nterm && (unsigned)x0 < (unsigned)H && (unsigned)y0 < (unsigned)W;
            const Acc* tr = (const Acc*)a.t + (bg * HW + (row ? x0 * W + y0 : 0)) * HW;
#pragma unroll
            for (int e = 0; e < V; ++e) {
              const int x1 = x1b[e] + dx, y1 = y1b[e] + dy;
              tv[u][e] = row && (unsigned)x1 < (unsigned)H && (unsigned)y1 < (unsigned)W
                         ? ldh<0>(tr + x1 * W + y1) : (Acc)0;
            }
            if (++ji == kw) { ji = 0; ++ii; }
          }
#pragma unroll
          for (int u = 0; u < KU; ++u)
#pragma unroll
            for (int e = 0; e < V; ++e) s[e] = aadd(s[e], tv[u][e]);
        } else {
          Acc m0[KU], gv[KU][V], m1[KU][V];
          unsigned present[KU];  // bit e: term u is inside the input for element e
#pragma unroll
          for (int u = 0; u < KU; ++u) {
            const int dx = ii * dh, dy = ji * dw, x0 = x0b + dx, y0 = y0b + dy;
            const bool row = t0 + u < nterm && (unsigned)x0 < (unsigned)H && (unsigned)y0 < (unsigned)W;
            const i64 cig = g * a.Cg + ci;
            const i64 om = b * a.sm0 + cig * a.sm1;
            const i64 og = b * a.sg0 + cig * a.sg1 + x0 * a.sg2 + y0 * a.sg3;
            m0[u] = row ? Ld<Acc, Tg>::one(mu, om + x0 * sm2 + y0 * sm3, dt_mu) : (Acc)0;
            present[u] = 0;
#pragma unroll
            for (int e = 0; e < V; ++e) {
              const int x1 = x1b[e] + dx, y1 = y1b[e] + dy;
              const bool in = row && (unsigned)x1 < (unsigned)H && (unsigned)y1 < (unsigned)W;
              present[u] |= (unsigned)in << e;
              gv[u][e] = in && gamma ? Ld<Acc, Tg>::one(gamma, og + (x1 * sg4 + y1 * sg5), dt_g)
                                     : (Acc)0;
              m1[u][e] = in ? Ld<Acc, Tg>::one(mu, om + (x1 * sm2 + y1 * sm3), dt_mu) : (Acc)0;
            }
            if (++ci == (int)a.Cg) { ci = 0; if (++ji == kw) { ji = 0; ++ii; } }
          }
          // An absent term is skipped, not added as 0 * mu: mu may be Inf.
#pragma unroll
          for (int u = 0; u < KU; ++u)
#pragma unroll
            for (int e = 0; e < V; ++e)
              if ((present[u] >> e) & 1u) s[e] = afma(m0[u], m1[u][e], aadd(s[e], gv[u][e]));
        }
      }
      To* op = out + b * a.so0 + i0 * a.so2 + j0 * a.so3 + oq;
      const To* os = (const To*)a.src + (op - out);  // op's element of src (not for to_s)
      if (a.to_s) {  // S itself (Acc = To): stored, not added
        To o[V];
#pragma unroll
        for (int e = 0; e < V; ++e) Cv<Acc>::to(o[e], s[e]);
        stv<To, V, 0>(op + c0_first * a.so1, o);
        continue;
      }
      add_cs<To, Acc, V>(a, op, os, c0_first, c0_end, s);
    }
  }
}

// ---------------------------------------------------------------- kernel 2': S by planes
// cc_planes forms S from gamma and mu through shared memory, with no T. A plane of S,
// S[b, g, i0, :, i1, :], is the sum over ii of a diagonal kw-term box filter of one plane
// of the channel sum P[x0, :, x1, :] = sum over ci of the group of gamma + mu (x) mu, at
// x0 = i0*sh + ii*dh - ph, x1 = x0 + (i1 - i0)*sh. A block takes a run of R consecutive
// planes of S along one diagonal i1 - i0 (_plan.planes): the U = sh*(R-1) + dh*(kh-1) + 1
// planes of P they read are summed once each, straight from gamma and mu, VG elements
// along y1 a load, into shared memory (a plane: Wp rows y0 + pw, Wq columns y1 + pw, the
// columns stored by class modulo sw, Wc = Wq / sw a class, so that the V columns
// (j1 + e)*sw + ji*dw of a term are consecutive words; what lies in the padding stays
// zero from the block's start, so an absent term adds nothing and NaN/Inf in mu never
// meets a padded zero). Each element of S is then kh*kw reads of shared memory, and
// c[c0] * S goes into out for the chunk's channels (add_cs). gamma is read U / R times
// (the overlap from L2, where the neighbouring run read it), and nothing the size of T or
// S goes through memory. Grid: x over (diagonal, run), z over (b, g, chunk); both loop.
#ifdef __CUDA_ARCH__
extern __shared__ __align__(16) unsigned char planes_smem[];
#define BLOCK_SYNC() __syncthreads()
#define COOP_FIRST ((int)threadIdx.x)
#define COOP_STEP ((int)blockDim.x)
#else
// The host build runs a block's threads in turn: each fills all of P (the same values each
// time), then forms its own elements.
static unsigned char planes_smem[1 << 16];
#define BLOCK_SYNC()
#define COOP_FIRST 0
#define COOP_STEP 1
#endif
// Blocks a multiprocessor, so 64 registers: 3 (80 registers) took mb-dw 1605 -> 1764 us (H200).
#ifndef PLANES_BLOCKS
#define PLANES_BLOCKS 4
#endif
template <typename To, typename Tg, typename Acc, int V, int VG>
__global__ void __launch_bounds__(THREADS, PLANES_BLOCKS) cc_planes(const Args a) {
  const int H = (int)a.H, W = (int)a.W, Ho = (int)a.Ho, Wo = (int)a.Wo;
  const int kh = (int)a.kh, kw = (int)a.kw, sh = (int)a.sh, sw = (int)a.sw;
  const int ph = (int)a.ph, pw = (int)a.pw, dh = (int)a.dh, dw = (int)a.dw;
  const int dt_g = (int)a.dt_gamma, dt_mu = (int)a.dt_mu, R = (int)a.runp, Wq = (int)a.wq;
  const int U = sh * (R - 1) + dh * (kh - 1) + 1, Wp = sw * (Wo - 1) + dw * (kw - 1) + 1;
  const int PP = Wp * Wq, Wc = Wq / sw, nqv = Wo / V, per_plane = Wo * nqv;
  const int nrun = (Ho + R - 1) / R;
  // The rows y0 and vectors of y1 that some element reads, inside the input.
  const int nrow = W < Wp - pw ? W : Wp - pw, nvec = (nrow + VG - 1) / VG, per_u = nrow * nvec;
  const void* gamma = (const void*)a.gamma;
  const void* mu = (const void*)a.mu;
  To* out = (To*)a.out;
  Acc* P = reinterpret_cast<Acc*>(planes_smem);
  for (int e = COOP_FIRST; e < U * PP; e += COOP_STEP) P[e] = (Acc)0;  // the padding
  const int dwm = dw % sw, dwq = dw / sw;  // a step of dw columns: of classes, of places
  const i64 nz = a.B * a.G * a.nchunk, nx = (i64)(2 * Ho - 1) * nrun;
  for (i64 z = blockIdx.z; z < nz; z += gridDim.z) {
    const Slice sl = slice_of(a, z);
    const i64 b = sl.b, c0_first = sl.c0_first, c0_end = sl.c0_end;
    const i64 og_b = b * a.sg0 + sl.g * a.Cg * a.sg1, om_b = b * a.sm0 + sl.g * a.Cg * a.sm1;
    for (i64 xb = blockIdx.x; xb < nx; xb += gridDim.x) {
      const int d = (int)(xb / nrun), di = d - (Ho - 1), t0 = (int)(xb - (i64)d * nrun) * R;
      const int L = Ho - (di < 0 ? -di : di);  // planes on this diagonal
      if (t0 >= L) continue;  // (uniform across the block)
      const int nt = L - t0 < R ? L - t0 : R;
      const int i0a = t0 + (di < 0 ? -di : 0), i1a = t0 + (di > 0 ? di : 0);
      const int x0a = i0a * sh - ph, dx = (i1a - i0a) * sh;
      u64 run = 0, used = 0;  // bit u: plane u of P is read by one of the run's nt planes of S
      for (int t = 0; t < nt; ++t) run |= 1ull << (t * sh);
      for (int ii = 0; ii < kh; ++ii) used |= run << (ii * dh);
      BLOCK_SYNC();  // the previous run's reads of P are done (and the padding's zeros)
      for (int n = COOP_FIRST; n < U * per_u; n += COOP_STEP) {
        const int u = n / per_u, r = n - u * per_u, y0 = r / nvec, y1 = (r - y0 * nvec) * VG;
        if ((used >> u) & 1u) {
          const int x0 = x0a + u, x1 = x0 + dx;
          Acc s[VG];
#pragma unroll
          for (int e = 0; e < VG; ++e) s[e] = (Acc)0;
          if ((unsigned)x0 < (unsigned)H && (unsigned)x1 < (unsigned)H) {
            i64 og = og_b + x0 * a.sg2 + y0 * a.sg3 + x1 * a.sg4 + y1 * a.sg5;
            i64 om0 = om_b + x0 * a.sm2 + y0 * a.sm3, om1 = om_b + x1 * a.sm2 + y1 * a.sm3;
#pragma unroll 2
            for (i64 ci = 0; ci < a.Cg; ++ci, og += a.sg1, om0 += a.sm1, om1 += a.sm1) {
              Acc gv[VG], m1[VG];
              if (gamma) Ld<Acc, Tg>::template vec<VG>(gamma, og, dt_g, gv);
              const Acc m0 = Ld<Acc, Tg>::one(mu, om0, dt_mu);
              Ld<Acc, Tg>::template vec<VG>(mu, om1, dt_mu, m1);
#pragma unroll
              for (int e = 0; e < VG; ++e) s[e] = afma(m0, m1[e], gamma ? aadd(s[e], gv[e]) : s[e]);
            }
          }
          Acc* pp = P + u * PP + (y0 + pw) * Wq;
          int cm = (y1 + pw) % sw, cq = (y1 + pw) / sw;  // column y1 + pw: class, place
#pragma unroll
          for (int e = 0; e < VG; ++e) {
            pp[cm * Wc + cq] = s[e];
            if (++cm == sw) { cm = 0; ++cq; }
          }
        }
      }
      BLOCK_SYNC();
      for (int w = (int)threadIdx.x; w < nt * per_plane; w += (int)blockDim.x) {
        const int tt = w / per_plane, r = w - tt * per_plane, j0 = r / nqv;
        const int j1 = (r - j0 * nqv) * V;
        To* op = out + b * a.so0 + (i0a + tt) * a.so2 + j0 * a.so3 + (i1a + tt) * a.so4 + j1 * a.so5;
        const To* os = (const To*)a.src + (op - out);
        Raw<To, V> old;  // the first channel's out, loaded before S is formed
        ldraw<To, V, 1>(os + c0_first * a.so1, old);
        Acc s[V];
#pragma unroll
        for (int e = 0; e < V; ++e) s[e] = (Acc)0;
        // Term (ii, ji): row j0*sw + ji*dw of plane tt*sh + ii*dh; columns
        // (j1 + e)*sw + ji*dw, of class (ji*dw) % sw: V consecutive places.
        const Acc* pr = P + tt * sh * PP + j0 * sw * Wq + j1;
        for (int ji = 0, cm = 0, cq = 0; ji < kw; ++ji, pr += dw * Wq, cm += dwm, cq += dwq) {
          if (cm >= sw) { cm -= sw; ++cq; }
          for (int ii = 0; ii < kh; ++ii) {
            const Acc* q = pr + ii * dh * PP + cm * Wc + cq;
#pragma unroll
            for (int e = 0; e < V; ++e) s[e] = aadd(s[e], q[e]);
          }
        }
        {
          const Acc cv = c_of<Acc>(a, c0_first);
          To o[V];
          unpack<To, V>(old, o);
#pragma unroll
          for (int e = 0; e < V; ++e) Cv<Acc>::to(o[e], afma(cv, s[e], Cv<Acc>::from(o[e])));
          stv<To, V, 1>(op + c0_first * a.so1, o);
        }
        add_cs<To, Acc, V>(a, op, os, c0_first + 1, c0_end, s);
      }
    }
  }
}

// ---------------------------------------------------------------- kernel 3: out += c * S
// Where each group has many output channels, S (Co / G times smaller than out) is written
// once by cc_fused (to_s) and out is streamed in address order, as a copy is: per (b, c0),
// its nseg rows of seg_len contiguous elements (one row for a contiguous block, else one
// per p0), V elements a load, STREAM_U loads a thread in flight, S re-read from L2.
// Grid: x over a row's vectors, y over rows, z over (b, c0); each loops.
#define STREAM_U 4
template <typename To, typename Acc, int V>
__global__ void __launch_bounds__(THREADS) cc_stream(const Args a) {
  const int Wo = (int)a.Wo;
  const i64 HoWo = a.Ho * a.Wo, nv = a.seg_len / V, Co = a.G * a.Cog;
  const i64 step = (i64)gridDim.x * STREAM_U * blockDim.x;
  for (i64 z = blockIdx.z; z < a.B * Co; z += gridDim.z) {
    i64 b, c0;
    divmod(z, Co, b, c0);
    const Acc cv = c_of<Acc>(a, c0);
    const Acc* s_bg = (const Acc*)a.s + (b * a.G + c0 / a.Cog) * HoWo * HoWo;
    for (i64 r = blockIdx.y * blockDim.y + threadIdx.y; r < a.nseg; r += (i64)gridDim.y * blockDim.y) {
      const int i0 = (int)r / Wo, j0 = (int)r - i0 * Wo;
      To* o = (To*)a.out + b * a.so0 + c0 * a.so1 + (a.nseg > 1 ? i0 * a.so2 + j0 * a.so3 : 0);
      const To* os = (const To*)a.src + (o - (To*)a.out);
      const Acc* sr = s_bg + r * a.seg_len;
      for (i64 n0 = (i64)blockIdx.x * STREAM_U * blockDim.x + threadIdx.x; n0 < nv; n0 += step) {
        Raw<To, V> old[STREAM_U];
        Acc sv[STREAM_U][V];
#pragma unroll
        for (int u = 0; u < STREAM_U; ++u) {
          const i64 n = n0 + (i64)u * blockDim.x;
          if (n < nv) {
            ldraw<To, V, 1>(os + n * V, old[u]);
            ldv_as<Acc, Acc, V>(sr, n * V, sv[u]);
          }
        }
#pragma unroll
        for (int u = 0; u < STREAM_U; ++u) {
          const i64 n = n0 + (i64)u * blockDim.x;
          if (n < nv) {
            To t[V];
            unpack<To, V>(old[u], t);
#pragma unroll
            for (int e = 0; e < V; ++e) Cv<Acc>::to(t[e], afma(cv, sv[u][e], Cv<Acc>::from(t[e])));
            stv<To, V, 1>(o + n * V, t);
          }
        }
      }
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

_THREADS = _plan.THREADS
_OPTIONS = ("-std=c++14",)
_MU_CPT = 16  # channels a thread of cc_vjp_mu sums (MU_CPT in SOURCE)

#: Channels of grad_gamma one cc_vjp_gamma thread stores (None: all of the group's, split
#: only when that under-fills the device). Not yet measured on the H200: a knob to try.
_VJP_CHUNK = None


def _widths(itemsize):
    """Vector widths (elements) that the fast kernels are instantiated for: up to 16 bytes."""
    return [v for v in (1, 2, 4, 8) if v * itemsize <= 16]


def _family_names(family):
    """name_expressions of one RawModule: a storage type and an accumulation type."""
    kind, cxx, acc = family
    if kind == "vjp":  # the backward: grad_gamma stored as cxx (or only D, stored as acc)
        stores = dict.fromkeys((cxx, acc))
        return ([f"cc_vjp_gamma<{t}, {acc}, {v}>" for t in stores
                 for v in _widths({"f16": 2, "bf16": 2, "float": 4, "double": 8}[t])]
                + [f"cc_vjp_link<{acc}>", f"cc_vjp_mu<{acc}>"])
    size = {"f16": 2, "bf16": 2, "float": 4, "double": 8}[cxx]
    return ([f"cc_gsum<{cxx}, {cxx}, {acc}, {v}>" for v in _widths(size)]
            + [f"cc_gsum<{cxx}, anyt, {acc}, 1>"]
            + [f"cc_fused<{cxx}, {tg}, {acc}, {v}, {src_t}>" for v in _widths(size)
               for tg, src_t in ((cxx, 0), ("anyt", 0), (cxx, 1))]
            + [f"cc_planes<{cxx}, {tg}, {acc}, {v}, {vg}>" for v in _widths(size)
               for tg, vg in ((cxx, 1), (cxx, 16 // size), ("anyt", 1))]
            + [f"cc_stream<{cxx}, {acc}, {v}>" for v in _widths(size)])


#: The kernels' ``Args`` struct as a NumPy dtype: ``_ARGS_STRUCT``'s layout (every field 8
#: bytes, in order, no padding; c_value is written as its float64 bits). CuPy passes a
#: structured scalar by value, and the driver copies sizeof(Args) bytes from its data: the
#: struct, as the kernel declares it. One subarray field, not one field a member: CuPy
#: reads the dtype's description on every launch, which costs per field.
_ARGS = np.dtype([("words", "<i8", (len(_FIELDS),))])
#: Args slots a forward call writes, in the order _launch gives their values: the
#: addresses of out, gamma, mu, c, T, S and src, and c's bits when c is a number (c_value).
_CALL_SLOTS = np.array([_SLOT[n] for n in ("out", "gamma", "mu", "c", "t", "s", "src",
                                           "c_value")])
_BLOCK = (_THREADS,)


class _Launch:
    """One kernel launch of a plan: the kernel (a ``cupy.RawKernel``), its grid and block
    (tuples), and its Args as an int64 template with the address slots empty."""

    __slots__ = ("func", "grid", "block", "args", "smem")

    def __init__(self, func, grid, block, args, smem=0):
        self.func, self.grid, self.block, self.args, self.smem = func, grid, block, args, smem


class _Launches:
    """A plan's launches, their Args templates as one int64 array (a row a launch) that a
    call copies and fills (``_fill``), and (kernel, grid, block) per launch for
    ``_launch_all``."""

    __slots__ = ("launches", "template", "calls")

    def __init__(self, launches):
        self.launches = launches
        self.template = np.stack([ln.args for ln in launches])
        self.calls = tuple((ln.func, ln.grid, ln.block, ln.smem) for ln in launches)


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
    for (kernel, grid, block, smem), a in zip(plan.calls, args.view(_ARGS)):
        kernel(grid, block, (a,), shared_mem=smem)


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
    elements of the accumulation type, S first (where it goes through memory; padded to
    256 bytes), T (where S is formed from it) at ``t_offset`` bytes."""

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
        HW = H * W
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
            nchunk=1, chunk=Cog,
        )
        base.update({f"so{i}": v for i, v in enumerate(so)})
        base.update({f"sg{i}": v for i, v in enumerate(sg)})
        base.update({f"sm{i}": v for i, v in enumerate(sm)})

        def launch(name, family, n, grid=None, block=_BLOCK, smem=0, **kw):
            vals = [0] * len(_FIELDS)
            for k, v in {**base, "n": n, **kw}.items():
                vals[_SLOT[k]] = int(v)
            if grid is None:
                grid = (min(-(-n // _THREADS), 2**31 - 1),)
            return _Launch(self._function(name, family, dev), grid, block,
                           np.array(vals, np.int64), smem)

        m_size = _DTYPES[mi.dtype][2]
        o_cxx, o_size = _DTYPES[oi.dtype][1], _DTYPES[oi.dtype][2]
        HoWo = Ho * Wo
        # out's vector width along its (i1, j1) plane (1: any strides).
        v = vector_width(o_size, HoWo, (so[4], so[5]), (Ho, Wo), so[:4], oi.ptr)
        # The direct source's in-plane offsets of gamma and mu are 32-bit.
        fits = all(abs(sx) * (H - 1) + abs(sy) * (W - 1) < 2**31
                   for sx, sy in ((sg[4], sg[5]), (sm[2], sm[3])))
        acc_size = 8 if acc == "float64" else 4
        # S through memory, then out streamed (cc_stream): out's rows must be contiguous.
        stream = (contiguous((so[4], so[5]), (Ho, Wo))
                  and _plan.stream_s(Cog, Ho, Wo))
        # gamma and mu typed when they share the written array's dtype; else run-time typed.
        stored = {mi.dtype} | ({gi.dtype} if gi else set())
        src_t = 0 if _plan.direct_source(B, G, Cg, H, W, Ho, Wo, p.kh, p.kw) and fits else 1
        pl = _plan.planes_for(p, so, sg, sm, acc_size, capacity) \
            if src_t and _plan.by_planes(Cog) else None
        if pl is not None:  # S from gamma through shared memory (cc_planes), in place of T
            tg = o_cxx if stored == {oi.dtype} else "anyt"
            return _Plan([launch(f"cc_planes<{o_cxx}, {tg}, {acc_cxx}, {pl.V}, {pl.VG}>",
                                 ("fast", o_cxx, acc_cxx), 0, grid=pl.grid, smem=pl.smem,
                                 runp=pl.runp, wq=pl.wq, nchunk=pl.nchunk, chunk=pl.chunk)],
                         0, 0, acc)
        launches = []
        if src_t:
            # Kernel 1 (T) is typed on gamma's storage (mu's without gamma); mu of another
            # dtype than gamma's is read run-time typed, one q a thread.
            g_dtype = gi.dtype if gi else mi.dtype
            g_cxx, g_size = _DTYPES[g_dtype][1], _DTYPES[g_dtype][2]
            mu_vec = (m_size, (sm[2], sm[3]), (sm[0], sm[1]), mi.ptr)
            m_cxx = g_cxx if mi.dtype == g_dtype else "anyt"
            if m_cxx == "anyt":
                v1 = 1
            elif gi is None:
                v1 = vector_width(m_size, HW, (sm[2], sm[3]), (H, W), (sm[0], sm[1]), mi.ptr)
            else:
                v1 = vector_width(g_size, HW, (sg[4], sg[5]), (H, W), sg[:4], gi.ptr, (mu_vec,))
            launches.append(launch(f"cc_gsum<{g_cxx}, {m_cxx}, {acc_cxx}, {v1}>",
                                   ("fast", g_cxx, acc_cxx), B * G * HW * (HW // v1)))
        t_items = B * G * HW * HW if src_t else 0
        if stream:
            # cc_fused writes S[b, g] (a contiguous diagonal layout of G channels, c = 1),
            # then cc_stream adds c[c0] * S into out, row by row.
            vs = max(w for w in _widths(acc_size) if HoWo % w == 0)
            t = _plan.tiling(B, G, 1, Ho, Wo, vs, capacity)
            tg = acc_cxx if src_t or stored == {acc} else "anyt"
            s_strides = (G * HoWo * HoWo, HoWo * HoWo, Wo * HoWo, HoWo, Wo, 1)
            launches.append(launch(
                f"cc_fused<{acc_cxx}, {tg}, {acc_cxx}, {vs}, {src_t}>",
                ("fast", acc_cxx, acc_cxx), 0, grid=t.grid, block=t.block, nchunk=t.nchunk,
                chunk=t.chunk, to_s=1, Cog=1, dt_out=_DTYPES[acc][0],
                **{f"so{i}": x for i, x in enumerate(s_strides)}))
            rows = 1 if contiguous(so[2:], (Ho, Wo, Ho, Wo)) else HoWo
            seg = HoWo * HoWo // rows
            v3 = v if rows > 1 else vector_width(o_size, seg, so[2:], (Ho, Wo, Ho, Wo), so[:2],
                                                 oi.ptr)
            grid, block = _plan.stream_grid(B * G * Cog, rows, seg // v3)
            launches.append(launch(f"cc_stream<{o_cxx}, {acc_cxx}, {v3}>",
                                   ("fast", o_cxx, acc_cxx), 0, grid=grid, block=block,
                                   nseg=rows, seg_len=seg))
            return _Plan(launches, B * G * HoWo * HoWo, t_items, acc)
        tg = o_cxx if src_t or stored == {oi.dtype} else "anyt"
        t = _plan.tiling(B, G, Cog, Ho, Wo, v, capacity)
        launches.append(launch(f"cc_fused<{o_cxx}, {tg}, {acc_cxx}, {v}, {src_t}>",
                               ("fast", o_cxx, acc_cxx), 0, grid=t.grid, block=t.block,
                               nchunk=t.nchunk, chunk=t.chunk))
        return _Plan(launches, 0, t_items, acc)

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
            return _Launch(self._function(name, family, dev),
                           (min(-(-n // _THREADS), 2**31 - 1),), _BLOCK, np.array(vals, np.int64))

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

    def accumulate_apart(self, p, source) -> None:
        # out's values read from source: its strides are out's (the contract), and the
        # same address modulo 16 keeps the plan's vector width valid for both.
        src = source.data.ptr if hasattr(source, "data") and hasattr(source.data, "ptr") \
            else None
        if p.kind != "cupy" or src is None or src % 16 != p.out_info.ptr % 16:
            return super().accumulate_apart(p, source)
        self._on_device(p.device, self._run, p, src)

    def _run(self, dev, p, src=None):
        stream, _ = self._streams(p, dev)  # (the forward writes one array: none to follow)
        self._launch(dev, self._plan_of(dev, p), p.kind, stream, p.out_info.ptr,
                     0 if p.gamma_info is None else p.gamma_info.ptr, p.mu_info.ptr,
                     0 if p.c_info is None else p.c_info.ptr, p.c_value, src)

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

    def _launch(self, dev, plan, kind, stream, optr, gptr, mptr, cptr, c_value, src=None):
        """Launch a plan on ``dev`` (current) on ``stream`` (``_streams``): the addresses
        of out, gamma, mu and c (0 for an absent gamma, which the kernels test, and for a
        number c, which they then take from c_value), and of out's values (``src``: out
        itself unless given)."""
        with self._scratch(kind, plan, dev, stream) as s_ptr:
            args = _fill(plan, _CALL_SLOTS, (optr, gptr, mptr, cptr, s_ptr + plan.t_offset,
                                             s_ptr, optr if src is None else src,
                                             _c_bits(cptr, c_value)))
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
                                                 s_ptr, optr, _c_bits(cptr, c_value)))
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
