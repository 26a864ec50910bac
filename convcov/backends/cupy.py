"""``cupy``: CUDA C++ kernels compiled by CuPy (NVRTC); the automatic first choice for CUDA arrays.

Owns the CUDA C++ source below (``SOURCE``), its compilation into ``cupy.RawModule`` objects
(one module a kernel instantiation, compiled when a call first launches it, once per
process, cached on disk by CuPy), the choice of kernels and launch sizes for one
call, and the launch itself on the arrays' device and on their library's current stream:
torch's for torch tensors, CuPy's for CuPy arrays; for other ``__cuda_array_interface__``
objects (numba device arrays) the stream ``out`` names, after the streams the inputs name
(``convcov._arrays.launch_streams``).

Design (docs/cupy.md "The design", docs/backends.md "The GPU design"). The operation is
memory-bound: gamma's channel diagonal is read once and out's channel diagonal read and
written once, everything else stays on the chip. One kernel, ``cc_walk``, does it for every
layer: a block walks one diagonal ``i1 - i0`` of S's planes ``S[b, g, i0, :, i1, :]``; each
plane ``Q_u`` of the group's channel sum of ``gamma + mu (x) mu`` that the diagonal reads
is summed into shared memory once (gamma streamed; where planes are small, lanes of a
warp share each element's channel sum and add their parts by shuffles), row-filtered
along ``ji`` into a ring of planes ``T_u``, and each plane of S is ``kh`` reads of the
ring (the filter along ``ii``); then ``c[c0] * S`` goes into out for every output channel
of the group. Where many output channels share S (``_plan.STREAM_BYTES``), ``cc_walk``
stores S instead and ``cc_stream`` adds ``c[c0] * S`` into out in address order, S
re-read from L2. The sizes (planes of S a step, tiles of a plane, segments of a diagonal,
lanes a channel sum) come from ``convcov.backends._plan.walk``, which the ``numba_cuda``
backend shares. Where a plane of the input fits a warp and c * S goes straight into out,
``cc_plane`` walks a wrapped diagonal with a warp instead of a block (``_plan.plane``): Q
in registers, its row filter through the warp's own shared memory, the ring of T in
registers (the kernel compiled for the layer's ``kh``, ``sh``, ``dh``), the next plane's
gamma and the next step's out copied ahead into shared memory, no block-wide barrier.

Scratch: S, only where it goes through memory (``B*G*(Ho*Wo)**2`` accumulation-type
elements), allocated stream-ordered from the arrays' library. A tile of Q in shared memory
keeps zeros where a position lies in the padding, so an absent term adds an exact zero
and NaN/Inf in ``mu`` never meets a padded zero. Index arithmetic is 64-bit wherever an
offset can pass 2**31; the arithmetic uses explicit IEEE (non flush-to-zero)
instructions because CuPy compiles with ``-ftz=true``; results are rounded once into
``out``'s dtype (float64 sums reach float16/bfloat16 through round-to-odd float32, a
single correct rounding).

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
stream object made current around them for any other (``_stream_object``). ``cc_walk``
takes dynamic shared memory (``_plan.WALK_SMEM`` at most, below CUDA's 48 KiB). Repeated
small calls are the user's to capture into a CUDA graph (``torch.cuda.graphs``, or
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
    "out", "gamma", "mu", "c", "s",            # device addresses (gamma, c: 0 when absent)
    "src",                                     # out's values are read here (out: in place)
    "B", "G", "Cg", "Cog", "H", "W", "Ho", "Wo",
    "kh", "kw", "sh", "sw", "ph", "pw", "dh", "dw",
    "so0", "so1", "so2", "so3", "so4", "so5",  # out (b, c0, i0, j0, i1, j1), diagonal folded
    "sg0", "sg1", "sg2", "sg3", "sg4", "sg5",  # gamma (b, ci, x0, y0, x1, y1), diagonal folded
    "sm0", "sm1", "sm2", "sm3",                # mu (b, ci, x, y)
    "sc",                                      # c (0 for a 0-d c)
    "dt_out", "dt_gamma", "dt_mu", "dt_c",     # dtype codes (_DTYPES) for run-time typed loads
    "n",                                       # work items of this launch
    # cc_walk (_plan.Walk): planes of S a step, segments of a diagonal, tiles of a plane,
    # the staged planes of Q and their rows' pitch, the ring of T and its rows' pitch,
    # the lanes sharing an element's channel sum, c's values in shared memory (1) or not
    "runp", "seglen", "nseg", "tj0", "tj1", "ntj1", "ntile", "nq", "wq", "nslot", "tp", "nch",
    "csm",
    "nseg_rows", "seg_len",                    # cc_stream: rows of out[b, c0], their length
    "qrows", "qpitch", "qcol", "nst", "nso",   # cc_plane: a warp's plane of Q, channels staged
    "nchunk", "chunk",                         # cc_vjp_gamma: a group's channels in chunks
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
#ifndef INFLIGHT
#define INFLIGHT 64  // bytes of one input or output a thread has in flight in cc_walk's loops
#endif
// channels whose loads are in flight together when each load is BYTES bytes
#define LOADS_IN(INF, BYTES) ((INF) / (BYTES) < 1 ? 1 : (INF) / (BYTES) > 8 ? 8 : (INF) / (BYTES))
#define LOADS_FOR(BYTES) LOADS_IN(INFLIGHT, BYTES)

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
// HINT 0: read-only path (data reused from L1/L2: mu, c). HINT 1: streaming, evict
// first (gamma and out are touched once; keeping them out of L2 leaves room for S). HINT 2:
// plain (shared memory: the ring of T).
template <int BYTES> struct Chunk;
template <> struct Chunk<2> { typedef unsigned short type; };
template <> struct Chunk<4> { typedef unsigned int type; };
template <> struct Chunk<8> { typedef uint2 type; };
template <> struct Chunk<16> { typedef uint4 type; };

template <int HINT, typename C> __device__ __forceinline__ C ldh(const C* p) {
#ifdef __CUDA_ARCH__
  return HINT == 1 ? __ldcs(p) : HINT == 0 ? __ldg(p) : *p;
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

// Asynchronous copies of 16-byte chunks from global into shared memory (sm_80 on; before
// it, and in the host build, plain copies): the data bypass the registers, so a warp can
// have the next plane's loads in flight while it works on this one.
template <int BYTES>
__device__ __forceinline__ void cp_async(void* smem, const void* global) {
#pragma unroll
  for (int i = 0; i < BYTES / 16; ++i) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::
                 "r"((unsigned)__cvta_generic_to_shared((char*)smem + 16 * i)),
                 "l"((const char*)global + 16 * i) : "memory");
#else
    reinterpret_cast<uint4*>(smem)[i] = reinterpret_cast<const uint4*>(global)[i];
#endif
  }
}
__device__ __forceinline__ void cp_commit() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.commit_group;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void cp_wait_all() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.wait_all;\n" ::: "memory");
#endif
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

struct anyt {};  // gamma and mu run-time typed (mixed dtypes): the code is a kernel argument

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

// ---------------------------------------------------------------- out += c * S
// ---------------------------------------------------------------- the walk: S, and out
// (docs/cupy.md "The design"; t counts planes of S along a diagonal, u planes of Q along a
// block's segment.) A block takes one (b, g), one diagonal di = i1 - i0 of S's planes
// S[b, g, i0, :, i1, :] (or a segment of it: the planes t in [t_first, t_end), at
// i0 = max(0, -di) + t, i1 = i0 + di) and one tile of each plane (j0 in [J0, J0 + tj0),
// j1 in [J1, J1 + tj1)). With x0 = xs + u and x1 = x0 + di*sh,
//   Q_u[y0, y1] = sum over ci of the group of gamma[b, ci, x0, y0, (ci,) x1, y1]
//                                            + mu[b, ci, x0, y0] * mu[b, ci, x1, y1],
//   T_u[j0, j1] = sum over ji of Q_u[j0*sw + ji*dw - pw, j1*sw + ji*dw - pw],
//   S_t         = sum over ii of T_u, u = (t - t_first)*sh + ii*dh (x0 and x1 in the input).
// The block walks its segment R planes of S a step. The planes Q_u that a step reads
// first are summed from gamma and mu into shared memory, nq at a time (each element of
// gamma the block needs is read once, VG elements a load, UNROLL channels in flight), and
// row-filtered into a ring of nslot planes of T; each plane of S is then kh reads of the
// ring, and c[c0] * S goes into out for every output channel of the group (STORE 0,
// add_cs) or S itself into the scratch for cc_stream (STORE 1). A tile of Q keeps zeros
// where y0 or y1 lies in the padding (written when a block starts a tile, never again),
// so an absent term adds nothing and NaN or Inf in mu never meets a padded zero; planes
// with x0 or x1 in the padding are skipped. Grid: x, a few waves of blocks
// (_plan.WALK_GRID_PER_SM), each looping over items, the longest diagonals first (they
// take longest).
#ifdef __CUDA_ARCH__
extern __shared__ __align__(16) unsigned char walk_smem[];
#define TID ((int)threadIdx.x)
#define NTHR ((int)blockDim.x)
#define SYNC() __syncthreads()
#else
// The host build runs one thread a block (TID 0 of 1): it takes every item of each phase
// in turn, and the barriers have nothing to order.
static unsigned char walk_smem[1 << 16] __attribute__((aligned(16)));
#define TID 0
#define NTHR 1
#define SYNC()
#endif

__device__ __forceinline__ int imin(int x, int y) { return x < y ? x : y; }
__device__ __forceinline__ int imax(int x, int y) { return x > y ? x : y; }

// The items (a, b, c) of an (any) x nb x nc space that one thread of a block takes: TID
// first, then every NTHR-th, carried as three counters (no division per item).
struct Items {
  int a, b, c, da, db, dc, nb, nc;
  __device__ __forceinline__ Items(int nb_, int nc_) : nb(nb_), nc(nc_) {
    const int n = nb * nc;
    a = TID / n; b = (TID - a * n) / nc; c = TID - a * n - b * nc;
    da = NTHR / n; db = (NTHR - da * n) / nc; dc = NTHR - da * n - db * nc;
  }
  __device__ __forceinline__ void next() {
    c += dc; if (c >= nc) { c -= nc; ++b; }
    b += db; if (b >= nb) { b -= nb; ++a; }
    a += da;
  }
};

// VG elements of an input (gamma or mu): a typed one stays raw from its load until its
// values are wanted, so that a thread issues all of a step's loads before its first sum
// (a warp issues in order); a run-time typed one (anyt: mixed dtypes) converts at once.
template <typename Acc, typename T, int VG> struct In {
  Raw<T, VG> r;
  template <int HINT> __device__ __forceinline__ void load(const void* p, i64 off, int) {
    ldraw<T, VG, HINT>((const T*)p + off, r);
  }
  __device__ __forceinline__ void get(Acc (&v)[VG]) const {
    T t[VG];
    unpack<T, VG>(r, t);
#pragma unroll
    for (int e = 0; e < VG; ++e) v[e] = Cv<Acc>::from(t[e]);
  }
};
template <typename Acc, int VG> struct In<Acc, anyt, VG> {
  Acc x[VG];
  template <int HINT> __device__ __forceinline__ void load(const void* p, i64 off, int dt) {
    ldv_any<Acc, VG>(p, off, dt, x);
  }
  __device__ __forceinline__ void get(Acc (&v)[VG]) const {
#pragma unroll
    for (int e = 0; e < VG; ++e) v[e] = x[e];
  }
};


// s += sum over Cg channels of VG elements of an input at off + ci * step, INFLIGHT bytes of
// loads in flight before their sums.
template <typename Acc, typename T, int VG, int HINT>
__device__ __forceinline__ void sum_channels(Acc (&s)[VG], const void* p, i64 off, i64 step,
                                             i64 Cg, int dt) {
  enum { UNROLL = LOADS_FOR(VG * (int)sizeof(T)) };
  i64 ci = 0;
  for (; ci + UNROLL <= Cg; ci += UNROLL, off += UNROLL * step) {
    In<Acc, T, VG> x[UNROLL];
#pragma unroll
    for (int k = 0; k < UNROLL; ++k) x[k].template load<HINT>(p, off + k * step, dt);
#pragma unroll
    for (int k = 0; k < UNROLL; ++k) {
      Acc v[VG];
      x[k].get(v);
#pragma unroll
      for (int e = 0; e < VG; ++e) s[e] = aadd(s[e], v[e]);
    }
  }
  for (; ci < Cg; ++ci, off += step) {
    In<Acc, T, VG> x;
    x.template load<HINT>(p, off, dt);
    Acc v[VG];
    x.get(v);
#pragma unroll
    for (int e = 0; e < VG; ++e) s[e] = aadd(s[e], v[e]);
  }
}

// s += sum over Cg channels of mu[o0] * mu[o1 .. o1 + VG) (mu is small: its loads hit the
// caches), INFLIGHT bytes of loads in flight.
template <typename Acc, typename T, int VG>
__device__ __forceinline__ void sum_products(Acc (&s)[VG], const void* mu, i64 o0, i64 o1,
                                             i64 step, i64 Cg, int dt) {
  enum { UNROLL = LOADS_FOR(VG * (int)sizeof(T)) };
  i64 ci = 0;
  for (; ci + UNROLL <= Cg; ci += UNROLL, o0 += UNROLL * step, o1 += UNROLL * step) {
    In<Acc, T, 1> m0[UNROLL];
    In<Acc, T, VG> m1[UNROLL];
#pragma unroll
    for (int k = 0; k < UNROLL; ++k) {
      m0[k].template load<0>(mu, o0 + k * step, dt);
      m1[k].template load<0>(mu, o1 + k * step, dt);
    }
#pragma unroll
    for (int k = 0; k < UNROLL; ++k) {
      Acc m[1], v[VG];
      m0[k].get(m);
      m1[k].get(v);
#pragma unroll
      for (int e = 0; e < VG; ++e) s[e] = afma(m[0], v[e], s[e]);
    }
  }
  for (; ci < Cg; ++ci, o0 += step, o1 += step) {
    In<Acc, T, 1> m0;
    In<Acc, T, VG> m1;
    m0.template load<0>(mu, o0, dt);
    m1.template load<0>(mu, o1, dt);
    Acc m[1], v[VG];
    m0.get(m);
    m1.get(v);
#pragma unroll
    for (int e = 0; e < VG; ++e) s[e] = afma(m[0], v[e], s[e]);
  }
}

// s += sum over Cg channels of gamma[og ..] + mu[o0] * mu[o1 ..] (VG elements along a row),
// each chunk's loads of gamma and mu issued together before their sums (one latency a
// chunk, not one an array); gamma (where present) read once: streaming loads.
template <typename Acc, typename T, int VG, int INF>
__device__ __forceinline__ void sum_terms(Acc (&s)[VG], const void* gamma, i64 og, i64 gstep,
                                          const void* mu, i64 o0, i64 o1, i64 mstep, i64 Cg) {
  enum { UNROLL = LOADS_IN(INF, VG * (int)sizeof(T)) };
  for (i64 ci = 0; ci < Cg; ci += UNROLL, og += UNROLL * gstep, o0 += UNROLL * mstep,
       o1 += UNROLL * mstep) {
    In<Acc, T, VG> x[UNROLL], m1[UNROLL];
    In<Acc, T, 1> m0[UNROLL];
#pragma unroll
    for (int k = 0; k < UNROLL; ++k) {
      if (ci + k < Cg) {
        if (gamma) x[k].template load<1>(gamma, og + k * gstep, 0);
        m0[k].template load<0>(mu, o0 + k * mstep, 0);
        m1[k].template load<0>(mu, o1 + k * mstep, 0);
      }
    }
#pragma unroll
    for (int k = 0; k < UNROLL; ++k) {
      if (ci + k < Cg) {
        Acc v[VG], m[1], w[VG];
        if (gamma) {
          x[k].get(v);
#pragma unroll
          for (int e = 0; e < VG; ++e) s[e] = aadd(s[e], v[e]);
        }
        m0[k].get(m);
        m1[k].get(w);
#pragma unroll
        for (int e = 0; e < VG; ++e) s[e] = afma(m[0], w[e], s[e]);
      }
    }
  }
}

// op[k * so1] = os[k * so1] + c[c0 + k] * s for the group's Cog output channels k (c0 its
// first), c's values from cs (shared memory) or, without cs, from c itself; V elements a
// load and a store, INFLIGHT bytes of loads of out in flight before their stores.
template <typename To, typename Acc, int V, int INF = INFLIGHT>
__device__ __forceinline__ void add_cs(To* op, const To* os, i64 so1, int Cog, const Acc* cs,
                                       const Args& a, i64 c0, const Acc (&s)[V]) {
  enum { UNROLL = LOADS_IN(INF, V * (int)sizeof(To)) };
  for (int k0 = 0; k0 < Cog; k0 += UNROLL) {
    Raw<To, V> old[UNROLL];
#pragma unroll
    for (int k = 0; k < UNROLL; ++k)
      if (k0 + k < Cog) ldraw<To, V, 1>(os + (k0 + k) * so1, old[k]);
#pragma unroll
    for (int k = 0; k < UNROLL; ++k) {
      if (k0 + k < Cog) {
        To o[V];
        unpack<To, V>(old[k], o);
        const Acc ck = cs ? cs[k0 + k] : c_of<Acc>(a, c0 + k0 + k);
#pragma unroll
        for (int e = 0; e < V; ++e) Cv<Acc>::to(o[e], afma(ck, s[e], Cv<Acc>::from(o[e])));
        stv<To, V, 1>(op + (k0 + k) * so1, o);
      }
    }
  }
}

#ifndef WALK_BLOCKS
// blocks a multiprocessor ptxas sizes the registers for (64 each, some spilled): more
// blocks hide more of a step's latency (mb-dw-s2 0.109 -> 0.125 of the floor on an H100)
#define WALK_BLOCKS 4
#endif
template <typename To, typename Tin, typename Acc, int V, int VG, int STORE>
__global__ void __launch_bounds__(THREADS, WALK_BLOCKS) cc_walk(const Args a) {
#ifndef __CUDA_ARCH__
  if (threadIdx.x) return;
#endif
  enum { VT = 4 };  // rows of T a thread forms at once (one column: no bank conflicts)
  const int H = (int)a.H, W = (int)a.W, Ho = (int)a.Ho, Wo = (int)a.Wo;
  const int kh = (int)a.kh, kw = (int)a.kw, sh = (int)a.sh, sw = (int)a.sw;
  const int ph = (int)a.ph, pw = (int)a.pw, dh = (int)a.dh, dw = (int)a.dw;
  const int R = (int)a.runp, seglen = (int)a.seglen, nseg = (int)a.nseg;
  const int tj0 = (int)a.tj0, tj1 = (int)a.tj1, ntj1 = (int)a.ntj1, ntile = (int)a.ntile;
  const int nq = (int)a.nq, nslot = (int)a.nslot, wq = (int)a.wq, tp = (int)a.tp;
  // nch lanes (a power of two, within a warp: items are lane-aligned) share an element's
  // channel sum, channels ci = ch mod nch each, summed across the lanes in a fixed order.
  const int nch = (int)a.nch;
  int lnch = 0;
  while ((1 << lnch) < nch) ++lnch;
  const int hq = (tj0 - 1) * sw + (kw - 1) * dw + 1;   // rows of a tile of Q
  const int span1 = (tj1 - 1) * sw + (kw - 1) * dw + 1;  // its columns that T reads
  const int dt_g = (int)a.dt_gamma, dt_mu = (int)a.dt_mu;
  const void* gamma = (const void*)a.gamma;
  const void* mu = (const void*)a.mu;
  Acc* Q = reinterpret_cast<Acc*>(walk_smem);
  Acc* Tr = Q + nq * hq * wq;
  Acc* cs = Tr + nslot * tj0 * tp;  // c of the group's output channels (STORE 0)
  const i64 BG = a.B * a.G, HoWo = (i64)Ho * Wo;
  // The residues u mod sh that some ii reaches (a plane of another residue is never read;
  // strides past 64 count every plane).
  u64 reach = 0;
  for (int ii = 0; ii < kh && sh <= 64; ++ii) reach |= 1ull << ((ii * dh) % sh);
  // A block takes many items (the grid is a few waves, _plan.walk): what depends only on
  // the launch is set up once. The items of phases 2 and 3, a thread's first and its step:
  const Items items_t((tj0 + VT - 1) / VT, tj1), items_s(tj0, tj1 / V);
  Items items_q(1, 1);  // phase 1's: the tile's rows and vectors
  int tile_q = -1;  // the tile whose zeros Q holds and whose rows items_q takes
  for (i64 id = blockIdx.x; id < a.n; id += gridDim.x) {
    // id = ((rank * nseg + seg) * ntile + tile) * B*G + (b*G + g)
    i64 rest, bg, b, g, rs, tl;
    divmod(id, BG, rest, bg);
    divmod(bg, a.G, b, g);
    divmod(rest, (i64)ntile, rs, tl);
    const int tile = (int)tl, rank = (int)(rs / nseg), seg = (int)(rs - (i64)rank * nseg);
    const int di = rank == 0 ? 0 : (rank & 1 ? -(rank + 1) / 2 : rank / 2);
    const int L = Ho - (di < 0 ? -di : di), t_first = seg * seglen;
    if (t_first >= L) continue;  // (uniform across the block)
    const int t_end = imin(L, t_first + seglen);
    const int J0 = tile / ntj1 * tj0, J1 = (tile - tile / ntj1 * ntj1) * tj1;
    const int i0d = di < 0 ? -di : 0, dx = di * sh, xs = (i0d + t_first) * sh - ph;
    const int ulo = imax(0, -dx) - xs, uhi = imin(H, H - dx) - xs;  // x0, x1 in the input
    // The tile of Q: rows y0 - Y0lo, columns y1 - base1 (16-byte aligned vectors).
    const int Y0lo = J0 * sw - pw, Y1lo = J1 * sw - pw;
    const int off = ((Y1lo % 4) + 4) % 4, base1 = Y1lo - off;
    const int y0a = imax(0, Y0lo), y0b = imin(W, Y0lo + hq);
    const int y1a = imax(0, Y1lo) / VG * VG, y1b = imin(W, Y1lo + span1);
    const int nrow = y0b - y0a, nvec = y1b > y1a ? (y1b - y1a + VG - 1) / VG : 0;
    const i64 ogb = b * a.sg0 + g * a.Cg * a.sg1, omb = b * a.sm0 + g * a.Cg * a.sm1;
    auto wanted = [&](int u) {  // plane u of Q is inside the input and read by some S_t
      return u >= ulo && u < uhi && (sh > 64 || ((reach >> (u % sh)) & 1));
    };
    // Q's zeros (the padding) and phase 1's items are those of the tile: set when the
    // tile changes (Q's planes are whole 16-byte vectors: wq a multiple of 4, Q aligned)
    if (tile != tile_q) {
      tile_q = tile;
      for (int e = TID; e < nq * hq * wq * (int)sizeof(Acc) / 16; e += NTHR)
        reinterpret_cast<uint4*>(Q)[e] = uint4{0u, 0u, 0u, 0u};
      if (nrow > 0 && nvec > 0) items_q = Items(nrow, nvec << lnch);
    }
    for (int k = TID; k < (STORE || !a.csm ? 0 : (int)a.Cog); k += NTHR)
      cs[k] = c_of<Acc>(a, g * a.Cog + k);
    SYNC();
    int u_next = 0;  // the first plane of Q not yet in the ring
    for (int t0 = t_first; t0 < t_end; t0 += R) {
      const int t1 = imin(t_end, t0 + R);
      const int u_need = (t1 - 1 - t_first) * sh + (kh - 1) * dh;
      while (u_next <= u_need) {
        const int ub = u_next, nb = imin(nq, u_need + 1 - ub), sb = ub % nslot;
        u_next += nb;
        // 1. Q_u for u in [ub, ub + nb): plane p = u - ub of the staging area
        if (nrow > 0 && nvec > 0) {
          int pa = -1;
          bool ok = false;
          for (Items w = items_q; w.a < nb; w.next()) {
            if (w.a != pa) { pa = w.a; ok = wanted(ub + pa); }
            if (!ok) continue;  // (uniform across an element's lanes, as the loop's test)
            const int ch = w.c & (nch - 1);
            const int x0 = xs + ub + w.a, x1 = x0 + dx, y0 = y0a + w.b;
            const int y1 = y1a + (w.c >> lnch) * VG;
            const i64 nci = (a.Cg - ch + nch - 1) >> lnch;  // this lane's channels
            Acc s[VG];
#pragma unroll
            for (int e = 0; e < VG; ++e) s[e] = (Acc)0;
            if (gamma)  // gamma is read once: streaming loads (evict first)
              sum_channels<Acc, Tin, VG, 1>(
                  s, gamma, ogb + ch * a.sg1 + x0 * a.sg2 + y0 * a.sg3 + x1 * a.sg4 + y1 * a.sg5,
                  a.sg1 << lnch, nci, dt_g);
            const i64 om0 = omb + ch * a.sm1 + x0 * a.sm2 + y0 * a.sm3;
            const i64 om1 = omb + ch * a.sm1 + x1 * a.sm2 + y1 * a.sm3;
            sum_products<Acc, Tin, VG>(s, mu, om0, om1, a.sm1 << lnch, nci, dt_mu);
            Acc* qr = Q + (w.a * hq + (y0 - Y0lo)) * wq;
            const int lc = y1 - base1;
#ifdef __CUDA_ARCH__
            const unsigned lanes = nch == 32 ? 0xffffffffu
                                             : ((1u << nch) - 1) << ((TID & 31) & ~(nch - 1));
            for (int d = nch >> 1; d > 0; d >>= 1) {
#pragma unroll
              for (int e = 0; e < VG; ++e) s[e] = aadd(s[e], __shfl_xor_sync(lanes, s[e], d));
            }
            if (ch) continue;
            const bool add = false;
#else  // one thread takes an element's lanes in turn: the first stores, the others add
            const bool add = ch != 0;
#endif
            if (!add && lc >= 0 && lc + VG <= wq) {
              stv<Acc, VG, 0>(qr + lc, s);
            } else {  // a vector across the tile's edge: its elements inside it
#pragma unroll
              for (int e = 0; e < VG; ++e)
                if (lc + e >= 0 && lc + e < wq) qr[lc + e] = add ? qr[lc + e] + s[e] : s[e];
            }
          }
        }
        SYNC();
        // 2. T_u from Q_u, into the ring's slot u mod nslot: VT rows of one column a thread
        {
          int pa = -1, slot = 0;
          bool ok = false;
          for (Items w = items_t; w.a < nb; w.next()) {
            if (w.a != pa) {
              pa = w.a; ok = wanted(ub + pa); slot = sb + pa;
              if (slot >= nslot) slot -= nslot;
            }
            if (!ok) continue;
            const int r0 = w.b * VT, c1 = w.c;
            const Acc* q = Q + (w.a * hq + r0 * sw) * wq + c1 * sw + off;
            Acc t[VT];
#pragma unroll
            for (int e = 0; e < VT; ++e) t[e] = (Acc)0;
            for (int ji = 0; ji < kw; ++ji, q += dw * (wq + 1)) {
#pragma unroll
              for (int e = 0; e < VT; ++e)
                if (r0 + e < tj0) t[e] = aadd(t[e], q[e * sw * wq]);
            }
            Acc* tr = Tr + (slot * tj0 + r0) * tp + c1;
#pragma unroll
            for (int e = 0; e < VT; ++e)
              if (r0 + e < tj0) tr[e * tp] = t[e];
          }
        }
        SYNC();
      }
      // 3. S_t for t in [t0, t1), and out
      const int s0 = ((t0 - t_first) * sh) % nslot;
      for (Items w = items_s; w.a < t1 - t0; w.next()) {
        const int j0 = J0 + w.b, j1 = J1 + w.c * V, i0 = i0d + t0 + w.a, i1 = i0 + di;
        if (j0 >= Wo || j1 >= Wo) continue;
        int sl = s0 + w.a * sh;
        if (sl >= nslot) sl -= nslot;
        Acc s[V];
#pragma unroll
        for (int e = 0; e < V; ++e) s[e] = (Acc)0;
        for (int ii = 0, u = (t0 + w.a - t_first) * sh; ii < kh; ++ii, u += dh) {
          if (u >= ulo && u < uhi) {
            Acc v[V];
            ldv<Acc, V, 2>(Tr + (sl * tj0 + w.b) * tp + w.c * V, v);  // (shared: plain loads)
#pragma unroll
            for (int e = 0; e < V; ++e) s[e] = aadd(s[e], v[e]);
          }
          sl += dh;
          if (sl >= nslot) sl -= nslot;
        }
        if (STORE) {
          To o[V];
#pragma unroll
          for (int e = 0; e < V; ++e) Cv<Acc>::to(o[e], s[e]);
          stv<To, V, 0>((To*)a.s + ((bg * Ho + i0) * Wo + j0) * HoWo + i1 * Wo + j1, o);
        } else {
          const i64 oo = b * a.so0 + g * a.Cog * a.so1 + i0 * a.so2 + j0 * a.so3 + i1 * a.so4 + j1 * a.so5;
          add_cs<To, Acc, V>((To*)a.out + oo, (const To*)a.src + oo, a.so1, (int)a.Cog,
                             a.csm ? cs : nullptr, a, g * a.Cog, s);
        }
      }
      SYNC();  // before the next step's T reuses the ring
    }
  }
}

// ---------------------------------------------------------------- the plane walk
// Where a plane of the input fits a warp (W and Wo multiples of 8, at most 16) and c * S
// goes straight into out: a warp takes one (b, g) and walks one wrapped diagonal of S's
// planes alone, so no step waits at a block-wide barrier. Lane l holds row l >> 1,
// columns [8 (l & 1), +8) of a plane: of Q_u (its group's channel sum, formed in
// registers, one vector of gamma a channel), then of T_u and S_t (rows j0, columns j1).
// The first nst channels of each plane's gamma and the first nso output channels of each
// step's out come by asynchronous copies into the warp's staging areas, issued a plane
// (a step) ahead, while the warp works on the one before; the others by loads when used.
// T_u is Q_u row-filtered through the warp's own plane of shared memory (qrows x qpitch,
// Q_u's rows from row pw and its columns from column qcol, the zero border around it the
// padding: no bounds checks); the planes of T that S_t sums are a ring in registers (KH,
// SH, DH compiled in, so its slots are registers): slot s of S_t's ring holds the plane of
// input rows x0 = i0 * SH - ph + s, x1 = x0 + di * SH. Items: (b, g, k) for k in [0, Ho):
// the warp walks i0 = 0 .. Ho - 1 with i1 = (i0 + k) mod Ho (the diagonal k, then k - Ho),
// so every item is Ho steps and the consecutive warps of one (b, g) read the same rows x0
// of gamma, and of out the same i0, at once: neighbouring 32-byte rows, fetched together.
#define PLANE_V """ + str(_plan.PLANE_V) + r"""  // _plan.PLANE_V
// INFLIGHT of cc_plane: 32 bytes keep it within 128 registers (64 spill); a warp's load
// of a plane's row vectors is 512 bytes already
#define PLANE_INFLIGHT 32
// Two blocks a multiprocessor, 128 registers: at three (80) ptxas spills, and mb-dw and
// grp8 run 1.1-1.4x slower on an H100.
template <typename T, typename Acc, int KH, int SH, int DH>
__global__ void __launch_bounds__(THREADS, 2) cc_plane(const Args a) {
  enum { NS = DH * (KH - 1) + 1, V = PLANE_V, WARPS = THREADS / 32 };
#ifdef __CUDA_ARCH__
  enum { NL = 1 };  // one lane a thread
  const int lane0 = (int)(threadIdx.x & 31);
#define PLANE_SYNC() __syncwarp()
#else
  enum { NL = 32 };  // the host build: the warp's first thread runs its 32 lanes in turn
  if (threadIdx.x & 31) return;
  const int lane0 = 0;
#define PLANE_SYNC()
#endif
  const int warp = (int)(threadIdx.x >> 5);
  const int H = (int)a.H, W = (int)a.W, Ho = (int)a.Ho, Wo = (int)a.Wo;
  const int kw = (int)a.kw, sw = (int)a.sw, dw = (int)a.dw, ph = (int)a.ph, pw = (int)a.pw;
  const int qp = (int)a.qpitch, qn = (int)(a.qrows * a.qpitch), qc = (int)a.qcol - pw;
  const int Cog = (int)a.Cog, nst = (int)a.nst, nso = (int)a.nso;
  const void* gamma = (const void*)a.gamma;
  const void* mu = (const void*)a.mu;
  Acc* Qs = reinterpret_cast<Acc*>(walk_smem) + warp * qn;
  // the staging areas: lane l's vector of gamma's staged channel ch at (ch * 32 + l) * V,
  // of out's staged output channel k at Os + (k * 32 + l) * V
  T* Gs = reinterpret_cast<T*>(reinterpret_cast<Acc*>(walk_smem) + WARPS * qn) +
          warp * (nst + nso) * 32 * V;
  T* Os = Gs + nst * 32 * V;
  for (int l = 0; l < NL; ++l)
    for (int e = lane0 + l; e < qn; e += 32) Qs[e] = (Acc)0;
  PLANE_SYNC();
  Acc r[NL][NS][V];  // the ring of T: slot s holds the plane of rows x0 = i0 * SH - ph + s

  for (i64 id = (i64)blockIdx.x * WARPS + warp; id < a.n; id += (i64)gridDim.x * WARPS) {
    i64 bg, kd, b, g;
    divmod(id, (i64)Ho, bg, kd);
    divmod(bg, a.G, b, g);
    const i64 ogb = b * a.sg0 + g * a.Cg * a.sg1, omb = b * a.sm0 + g * a.Cg * a.sm1;
    const i64 oob = b * a.so0 + g * Cog * a.so1;
    // copies of the first nst channels of plane (x0, x1)'s gamma, and of the first nso
    // output channels of out's plane (i0, i1), into the staging areas
    int sx0 = -1, sx1 = -1;  // the plane staged (-1: none)
    auto stage = [&](int x0, int x1) {
      if (nst == 0) return;
      for (int l = 0; l < NL; ++l) {
        const int lane = lane0 + l, y = lane >> 1, y1 = (lane & 1) * V;
        if (y >= W || y1 >= W) continue;
        const T* src = (const T*)gamma + ogb + x0 * a.sg2 + y * a.sg3 + x1 * a.sg4 + y1;
        for (int ch = 0; ch < nst; ++ch)
          cp_async<V * (int)sizeof(T)>(Gs + (ch * 32 + lane) * V, src + ch * a.sg1);
      }
      cp_commit();
      sx0 = x0; sx1 = x1;
    };
    auto stage_out = [&](int i0, int i1) {
      if (nso == 0) return;
      for (int l = 0; l < NL; ++l) {
        const int lane = lane0 + l, j0 = lane >> 1, j1 = (lane & 1) * V;
        if (j0 >= Wo || j1 >= Wo) continue;
        const T* src = (const T*)a.src + oob + i0 * a.so2 + j0 * a.so3 + i1 * a.so4 + j1;
        for (int k = 0; k < nso; ++k)
          cp_async<V * (int)sizeof(T)>(Os + (k * 32 + lane) * V, src + k * a.so1);
      }
      cp_commit();
    };
    // i1 = (i0 + kd) mod Ho: the diagonal kd, then from the wrap on the diagonal kd - Ho
    for (int i0 = 0, t = 0, di = (int)kd; i0 < Ho; ++i0, ++t) {
      if (i0 == Ho - di) { di -= Ho; t = 0; }  // (a new diagonal: the ring starts again)
      const int i1 = i0 + di, dx = di * SH;
      if (i0 == 0) stage_out(i0, i1);  // (the item's first step: the others are staged ahead)
      // the ring moved on by SH planes; the planes it lacks formed (all of them at first)
      if (t > 0) {
        for (int l = 0; l < NL; ++l)
#pragma unroll
          for (int s = 0; s + SH < NS; ++s)
#pragma unroll
            for (int e = 0; e < V; ++e) r[l][s][e] = r[l][s + SH][e];
      }
      // (one copy of the plane's code, not unrolled: its result enters the ring's slot
      // by constant indices)
#pragma unroll 1
      for (int s = t == 0 ? 0 : (NS > SH ? NS - SH : 0); s < NS; ++s) {
        const int x0 = i0 * SH - ph + s, x1 = x0 + dx;
        Acc tn[NL][V];
        for (int l = 0; l < NL; ++l)
#pragma unroll
          for (int e = 0; e < V; ++e) tn[l][e] = (Acc)0;
        if (x0 >= 0 && x0 < H && x1 >= 0 && x1 < H) {  // (uniform across the warp)
          if (sx0 != x0 || sx1 != x1) stage(x0, x1);  // (not staged ahead)
          cp_wait_all();  // (a lane reads only the vectors it copied)
          for (int l = 0; l < NL; ++l) {  // Q_u: a lane's row y, columns [y1, y1 + V)
            const int lane = lane0 + l, y = lane >> 1, y1 = (lane & 1) * V;
            if (y >= W || y1 >= W) continue;
            Acc q[V];
#pragma unroll
            for (int e = 0; e < V; ++e) q[e] = (Acc)0;
            for (int ch = 0; ch < nst; ++ch) {
              T v[V];
              ldv<T, V, 2>(Gs + (ch * 32 + lane) * V, v);
#pragma unroll
              for (int e = 0; e < V; ++e) q[e] = aadd(q[e], Cv<Acc>::from(v[e]));
            }
            const i64 o0 = omb + x0 * a.sm2 + y * a.sm3, o1 = omb + x1 * a.sm2 + y1;
            sum_terms<Acc, T, V, PLANE_INFLIGHT>(q, nullptr, 0, 0, mu, o0, o1, a.sm1, nst);
            sum_terms<Acc, T, V, PLANE_INFLIGHT>(
                q, gamma, ogb + x0 * a.sg2 + y * a.sg3 + x1 * a.sg4 + y1 + nst * a.sg1, a.sg1,
                mu, o0 + nst * a.sm1, o1 + nst * a.sm1, a.sm1, a.Cg - nst);
            stv<Acc, V, 0>(Qs + (y + pw) * qp + a.qcol + y1, q);
          }
          sx0 = -1;
          PLANE_SYNC();
          {  // the next plane of the walk (within the item), staged while this one is used
            int sn = s + 1, i0n = i0, dn = di;
            if (sn >= NS) {
              ++i0n;
              sn = NS > SH ? NS - SH : 0;
              if (i0n == Ho - dn) { dn -= Ho; sn = 0; }
            }
            const int x0n = i0n * SH - ph + sn, x1n = x0n + dn * SH;
            if (i0n < Ho && x0n >= 0 && x0n < H && x1n >= 0 && x1n < H) stage(x0n, x1n);
          }
          for (int l = 0; l < NL; ++l) {  // T_u: a lane's row j0, columns [j1, j1 + V)
            const int lane = lane0 + l, j0 = lane >> 1, j1 = (lane & 1) * V;
            if (j0 >= Wo || j1 >= Wo) continue;
            const Acc* q = Qs + j0 * sw * qp + j1 * sw + qc;
            for (int ji = 0; ji < kw; ++ji, q += dw * (qp + 1)) {
#pragma unroll
              for (int e = 0; e < V; ++e) tn[l][e] = aadd(tn[l][e], q[e * sw]);
            }
          }
          PLANE_SYNC();  // before the next plane's Q overwrites this one
        }
        for (int l = 0; l < NL; ++l)
#pragma unroll
          for (int k = 0; k < NS; ++k)
            if (k == s) {
#pragma unroll
              for (int e = 0; e < V; ++e) r[l][k][e] = tn[l][e];
            }
      }
      for (int l = 0; l < NL; ++l) {  // S_t, and c * S_t into out
        const int lane = lane0 + l, j0 = lane >> 1, j1 = (lane & 1) * V;
        if (j0 >= Wo || j1 >= Wo) continue;
        Acc s[V];
#pragma unroll
        for (int e = 0; e < V; ++e) s[e] = r[l][0][e];
#pragma unroll
        for (int ii = 1; ii < KH; ++ii)
#pragma unroll
          for (int e = 0; e < V; ++e) s[e] = aadd(s[e], r[l][ii * DH][e]);
        const i64 oo = oob + i0 * a.so2 + j0 * a.so3 + i1 * a.so4 + j1;
        cp_wait_all();
        for (int k = 0; k < nso; ++k) {  // the staged output channels
          T o[V];
          ldv<T, V, 2>(Os + (k * 32 + lane) * V, o);
          const Acc ck = c_of<Acc>(a, g * Cog + k);
#pragma unroll
          for (int e = 0; e < V; ++e) Cv<Acc>::to(o[e], afma(ck, s[e], Cv<Acc>::from(o[e])));
          stv<T, V, 1>((T*)a.out + oo + k * a.so1, o);
        }
        add_cs<T, Acc, V, PLANE_INFLIGHT>((T*)a.out + oo + nso * a.so1,
                                          (const T*)a.src + oo + nso * a.so1, a.so1, Cog - nso,
                                          nullptr, a, g * Cog + nso, s);
      }
      if (i0 + 1 < Ho) {  // the next step's out, staged while its planes are formed
        const int dn = i0 + 1 == Ho - di ? di - Ho : di;
        stage_out(i0 + 1, i0 + 1 + dn);
      }
    }
  }
}

// ---------------------------------------------------------------- out += c * S, streamed
// Where each group has many output channels, S (Co / G times smaller than out) is written
// once by cc_walk (STORE) and out is streamed in address order, as a copy is: per (b, c0),
// its nseg_rows rows of seg_len contiguous elements (one row for a contiguous block, else
// one per p0), V elements a load, STREAM_U loads a thread in flight, S re-read from L2.
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
    for (i64 r = blockIdx.y * blockDim.y + threadIdx.y; r < a.nseg_rows; r += (i64)gridDim.y * blockDim.y) {
      const int i0 = (int)r / Wo, j0 = (int)r - i0 * Wo;
      To* o = (To*)a.out + b * a.so0 + c0 * a.so1 + (a.nseg_rows > 1 ? i0 * a.so2 + j0 * a.so3 : 0);
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


def _widths(itemsize, most=16):
    """Vector widths (elements) the kernels are instantiated for: up to ``most`` bytes."""
    return [v for v in (1, 2, 4, 8, 16) if v * itemsize <= most]


_SIZE = {"f16": 2, "bf16": 2, "float": 4, "double": 8}


def _family_names(family):
    """name_expressions of one RawModule: a storage type and an accumulation type."""
    kind, cxx, acc = family[:3]
    if kind == "plane":  # the plane walk, its ring's extent (kh, sh, dh) compiled in
        return ["cc_plane<{}, {}, {}, {}, {}>".format(cxx, acc, *family[3:])]
    if kind == "vjp":  # the backward: grad_gamma stored as cxx (or only D, stored as acc)
        stores = dict.fromkeys((cxx, acc))
        return ([f"cc_vjp_gamma<{t}, {acc}, {v}>" for t in stores for v in _widths(_SIZE[t])]
                + [f"cc_vjp_link<{acc}>", f"cc_vjp_mu<{acc}>"])
    most = _plan.VECTOR_BYTES
    vgs = (1, *(b // _SIZE[cxx] for b in (16, 32) if b <= most))
    # cc_walk adding into an out of type cxx (gamma and mu typed cxx, or run-time typed),
    # and storing S (type acc) from gamma and mu of type cxx (or run-time typed)
    return ([f"cc_walk<{cxx}, {cxx}, {acc}, {v}, {vg}, 0>" for v in _widths(_SIZE[cxx], most)
             for vg in vgs]
            + [f"cc_walk<{cxx}, anyt, {acc}, {v}, 1, 0>" for v in _widths(_SIZE[cxx], most)]
            + [f"cc_walk<{acc}, {cxx}, {acc}, {v}, {vg}, 1>" for v in _widths(_SIZE[acc], most)
               for vg in vgs]
            + [f"cc_walk<{acc}, anyt, {acc}, {v}, 1, 1>" for v in _widths(_SIZE[acc], most)]
            + [f"cc_stream<{cxx}, {acc}, {v}>" for v in _widths(_SIZE[cxx])])


#: The kernels' ``Args`` struct as a NumPy dtype: ``_ARGS_STRUCT``'s layout (every field 8
#: bytes, in order, no padding; c_value is written as its float64 bits). CuPy passes a
#: structured scalar by value, and the driver copies sizeof(Args) bytes from its data: the
#: struct, as the kernel declares it. One subarray field, not one field a member: CuPy
#: reads the dtype's description on every launch, which costs per field.
_ARGS = np.dtype([("words", "<i8", (len(_FIELDS),))])
#: Args slots a forward call writes, in the order _launch gives their values: the
#: addresses of out, gamma, mu, c, S and src, and c's bits when c is a number (c_value).
_CALL_SLOTS = np.array([_SLOT[n] for n in ("out", "gamma", "mu", "c", "s", "src", "c_value")])
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
    elements of the accumulation type (S, where it goes through memory; else 0)."""

    __slots__ = ("scratch", "acc")

    def __init__(self, launches, s_items, acc):
        super().__init__(launches)
        self.scratch, self.acc = s_items, acc


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
        self._modules = {}  # name expression -> cupy.RawModule
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
        """The kernel ``name`` (a ``cupy.RawKernel``; one of its ``family``'s
        instantiations), loaded on device ``dev`` (current), compiling once."""
        f = self._functions.get((name, dev))
        if f is None:
            with self._lock:
                f = self._functions.get((name, dev))
                if f is None:
                    mod = self._modules.get(name)
                    if mod is None:  # a module a kernel: a call compiles only what it runs
                        mod = self._cp.RawModule(code=SOURCE, options=_OPTIONS,
                                                 name_expressions=[name])
                        self._modules[name] = mod
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
        """The launches of one call signature (docs/cupy.md, "The design"): cc_walk, adding
        c * S into out, or, where many output channels share S, storing S for cc_stream."""
        oi, gi, mi, ci = p.out_info, p.gamma_info, p.mu_info, p.c_info
        B, G, W, Ho, Wo = p.B, p.G, p.W, p.Ho, p.Wo
        Cog = p.Co // G
        acc = p.acc
        acc_cxx, acc_size = _ACC_CXX[acc], _DTYPES[acc][2]
        sms, _ = self._sm_threads(dev)

        # Strides in elements, the channel diagonal folded into one stride.
        so = diag_strides(oi.strides, p.full_out)
        sg = (0,) * 6 if gi is None else diag_strides(gi.strides, p.full_gamma)
        sm = tuple(mi.strides)
        sc = 0 if ci is None or ci.shape == () else ci.strides[0]
        base = dict(
            B=B, G=G, Cg=p.Ci // G, Cog=Cog, H=p.H, W=W, Ho=Ho, Wo=Wo, kh=p.kh, kw=p.kw,
            sh=p.sh, sw=p.sw, ph=p.ph, pw=p.pw, dh=p.dh, dw=p.dw, sc=sc,
            dt_out=_DTYPES[oi.dtype][0], dt_gamma=_DTYPES[gi.dtype][0] if gi else 0,
            dt_mu=_DTYPES[mi.dtype][0], dt_c=_DTYPES[ci.dtype][0] if ci else 0,
        )
        base.update({f"so{i}": v for i, v in enumerate(so)})
        base.update({f"sg{i}": v for i, v in enumerate(sg)})
        base.update({f"sm{i}": v for i, v in enumerate(sm)})

        def launch(name, family, grid, block=_BLOCK, smem=0, **kw):
            vals = [0] * len(_FIELDS)
            for k, v in {**base, **kw}.items():
                vals[_SLOT[k]] = int(v)
            return _Launch(self._function(name, family, dev), grid, block,
                           np.array(vals, np.int64), smem)

        o_cxx, o_size = _DTYPES[oi.dtype][1], _DTYPES[oi.dtype][2]
        # gamma and mu typed when they share a dtype (VG of them a 16-byte load along a
        # row y1 where the layout allows); else run-time typed, one a load.
        dtypes = {mi.dtype} | ({gi.dtype} if gi else set())
        if len(dtypes) == 1:
            in_cxx, in_size = _DTYPES[mi.dtype][1], _DTYPES[mi.dtype][2]
            mu_row = (in_size, (sm[3],), sm[:3], mi.ptr)
            vg = (vector_width(in_size, W, (sg[5],), (W,), sg[:5], gi.ptr, (mu_row,)) if gi
                  else vector_width(in_size, W, (sm[3],), (W,), sm[:3], mi.ptr))
            vg = _plan.widen(vg, in_size, W) if vg * in_size == 16 else 1
        else:
            in_cxx, vg = "anyt", 1
        # S through memory where many output channels share it and out's rows (i1, j1) are
        # contiguous (cc_stream streams them); else c * S straight into out.
        stream = (Cog * o_size >= _plan.STREAM_BYTES
                  and contiguous((so[4], so[5]), (Ho, Wo)))
        if stream:
            v = _plan.widen(max(w for w in _widths(acc_size) if Wo % w == 0), acc_size, Wo)
        else:
            v = _plan.widen(vector_width(o_size, Wo, (so[5],), (Wo,), so[:5], oi.ptr), o_size, Wo)
        if not stream and in_cxx != o_cxx:  # gamma and mu typed only as out's dtype
            in_cxx, vg = "anyt", 1  # (the family's type)
        # The plane walk where the planes fit a warp: one dtype, 16-byte aligned rows
        pl = (_plan.plane(B, G, p.Ci // G, Cog, Ho, W, Wo, p.kh, p.kw, p.sw, p.dh, p.dw,
                          p.pw, acc_size, in_size if gi else 0)
              if not stream and in_cxx == o_cxx and vg * in_size >= 16 and v * o_size >= 16
              else None)
        if pl is not None:
            family = ("plane", o_cxx, acc_cxx, p.kh, p.sh, p.dh)
            warps = _THREADS // 32
            grid = (min(-(-pl.n // warps), _plan.MAX_GRID_X),)
            return _Plan([launch(_family_names(family)[0], family, grid, smem=warps * pl.smem,
                                 n=pl.n, qrows=pl.qrows, qpitch=pl.qpitch, qcol=pl.qcol,
                                 nst=pl.nst, nso=pl.nso)],
                         0, acc)
        wk = _plan.walk(B, G, p.Ci // G, W, Ho, Wo, p.kh, p.kw, p.sh, p.sw, p.dh, p.dw, v,
                        vg, acc_size, 0 if stream else Cog, sms)
        sizes = dict(n=wk.n, runp=wk.R, seglen=wk.seglen, nseg=wk.nseg, tj0=wk.tj0,
                     tj1=wk.tj1, ntj1=wk.ntj1, ntile=wk.ntile, nq=wk.nq, wq=wk.wq,
                     nslot=wk.nslot, tp=wk.tp, nch=wk.nch, csm=wk.csm)
        if not stream:
            return _Plan([launch(f"cc_walk<{o_cxx}, {in_cxx}, {acc_cxx}, {v}, {vg}, 0>",
                                 ("fast", o_cxx, acc_cxx), wk.grid, smem=wk.smem, **sizes)],
                         0, acc)
        family = ("fast", o_cxx if in_cxx == "anyt" else in_cxx, acc_cxx)
        walk = launch(f"cc_walk<{acc_cxx}, {in_cxx}, {acc_cxx}, {v}, {vg}, 1>", family,
                      wk.grid, smem=wk.smem, **sizes)
        rows = 1 if contiguous(so[2:], (Ho, Wo, Ho, Wo)) else Ho * Wo
        seg = (Ho * Wo) ** 2 // rows
        v3 = vector_width(o_size, seg, so[2:] if rows == 1 else (so[4], so[5]),
                          (Ho, Wo, Ho, Wo) if rows == 1 else (Ho, Wo),
                          so[:2] if rows == 1 else so[:4], oi.ptr)
        grid, block = _plan.stream_grid(B * p.Co, rows, seg // v3)
        add = launch(f"cc_stream<{o_cxx}, {acc_cxx}, {v3}>", ("fast", o_cxx, acc_cxx), grid,
                     block, nseg_rows=rows, seg_len=seg)
        return _Plan([walk, add], B * G * (Ho * Wo) ** 2, acc)

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
            args = _fill(plan, _CALL_SLOTS, (optr, gptr, mptr, cptr, s_ptr,
                                             optr if src is None else src,
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

        def run(out, gamma, mu, c, optr, gptr, mptr, cptr, c_value):
            prev = get_device()
            if prev != dev:
                set_device(dev)
            try:
                stream = stream_of(dev)
                owner, s_ptr = torch_scratch(nbytes, dev, stream) if nbytes else (None, 0)
                args = _fill(plan, _CALL_SLOTS, (optr, gptr, mptr, cptr, s_ptr, optr,
                                                 _c_bits(cptr, c_value)))
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
