"""``numba_cuda``: Numba CUDA kernels; the seed thread's question, answered in Numba.

Owns the ``numba.cuda`` kernels below, their compilation (lazily, once per combination of
array dtypes, cached on disk by Numba), the launch sizes for one call (read off the
device: multiprocessor count, threads per multiprocessor) and the launch itself
on the arrays' device and on their library's current stream: torch's for torch tensors,
CuPy's for CuPy arrays; for other ``__cuda_array_interface__`` objects the stream ``out``
names, after the streams the inputs name (``convcov._arrays.launch_streams``).
docs/numba_cuda.md explains the design in the thread's terms.

The operation is memory-bound, so the kernels are built around the bytes SPEC section 5
counts. With ``T[b, g, x0, y0, x1, y1]`` the channel sum over group ``g`` of
``gamma[b, ci, x0, y0, ci, x1, y1] + mu[b, ci, x0, y0] * mu[b, ci, x1, y1]`` (input
positions), ``S`` is the kh x kw box filter of ``T`` along each diagonal offset. Large
problems take three launches through one scratch buffer (S, then T: the size of S plus
the gamma channel sum, the bound SPEC allows), the design of the ``cupy`` backend:

* ``gsum`` reads the channel-diagonal of ``gamma`` exactly once, with 16-byte
  evict-first loads, four channels a step (gamma's and mu's loads in flight together),
  and writes ``T`` (the Gram matrix of ``mu`` rides along).
* ``sbox_walk`` forms ``S`` by walks along its diagonals, the last kh - 1 row sums of
  ``T`` in registers: kw reads of ``T`` an element (stride and dilation 1 along the rows,
  kh <= 7); ``sbox`` forms each element from kh*kw reads (every other case).
* ``stream`` adds ``c[c0] * S[b, g(c0)]`` into ``out`` in address order, 16-byte
  vectors (out wider than 16 bits loaded through the read-only path, 16-bit out
  evict-first): a flat axpy per (b, c0) for a contiguous diagonal layout; for
  16-bit ``out`` four output channels share each vector of ``S`` a thread loads. A
  contiguous full layout takes ``stream_rows``: its rows are evenly spaced, so a thread
  finds its positions with one 32-bit division.

Small problems (the seed's toy) and large strides take one launch, ``direct``: S straight
from gamma and mu, then ``out`` for a chunk of the group's output channels. Each kernel
has one thread per element of its result, in the result's flat order, and comes from a
factory per vector width and accumulation type (compile-time constants of the closure).
Numba has no syntax for 16-byte accesses or cache qualifiers: ``_LDV``/``_STV`` are
intrinsics (LLVM vector loads and stores; inline PTX for ``.cs`` / ``.nc``).

The backward (``patch_moment_vjp``, docs/autograd.md; correct on the H200, not yet fast) is two
gathers with no scratch and no atomics: ``_vjp_gamma_kernel`` (one block per row
(b, g, x0, y0) of the gradient of the group's gamma sum; each thread sums the <= kh*kw
grad_S values that read its (x1, y1) and stores the rounded value to every channel of the
group, coalesced) and ``_vjp_mu_kernel`` (a thread per input position and four channels
of one group; for each offset that reads the position, a loop over q of
mu[X_o(q)] * (grad_S[p, q] + grad_S[q, p])). docs/numba_cuda.md, "Backward", has the rest.

A term with a position in the padding is skipped (SPEC section 1), so NaN/Inf in ``mu``
never meets a padded zero. Index arithmetic is 64-bit (correct past 2**31 elements).
Sums run in the accumulation dtype (``Problem.acc``); ``out`` is rounded once into its
dtype (float64 sums reach bfloat16 through round-to-odd float32: one rounding).

Arrays travel as raw device pointers plus element strides (``CPointer`` kernel arguments),
so every stride, torch's bfloat16 (its ``__cuda_array_interface__`` is unusable) and any
library work alike, with no array objects to build per call. Kernels are compiled with an
explicit signature per dtype combination, so Numba's kernel call passes the arguments
without type resolution. A call signature's launches are planned once (``_plan``:
kernels, launch sizes, every argument but the addresses and the number c); a call fills
those in and launches each kernel through Numba's public kernel call,
``kernel[grid, block, stream, 0](*args)``, on the stream object of
``cuda.external_stream(handle)`` (one per handle, reused: ``_numba_stream``). Where
repeated calls should cost fewer launches, capture them with ``torch.cuda.graphs``.

Scratch (S and T) comes from the arrays' library, on the launch stream: torch's caching
allocator (``_arrays.torch_scratch``) and CuPy's pool order a freed block's reuse on the
stream it was taken on, so their block is given back once the launches are queued.
Generic CUDA arrays take a Numba device array (``cuda.device_array(..., stream=)``).
Numba's memory manager may be a plugin (RMM's), and the plugin interface has no stream:
such a plugin may hand a freed block out again before the kernels queued on the launch
stream have run. So that block is kept alive, with an event recorded after the launches
(``cuda.event``, ``Event.record``), until a later call finds the event completed
(``Event.query``) and drops it (``_hold``, ``_release``): no host wait, whatever the
memory manager.

Under Numba's CUDA simulator (``NUMBA_ENABLE_CUDASIM=1``, CI without a GPU) the same
kernels run on the CPU: the backend then declares ``device = "cpu"`` and receives numpy
host views (bfloat16 as uint16 bits), so the shared property test can run it on tiny
shapes; pointers are then 1-D numpy views of the memory. It is never chosen
automatically for host arrays (the registry's automatic order for those is numba, numpy).

Must not: copy ``out`` or ``gamma``; synchronise the device; allocate more than S and T
(the backward allocates nothing);
import numba.cuda before the backend is used (``import convcov`` stays GPU-free).
"""

from __future__ import annotations

import atexit
import collections
import dataclasses
import functools
import sys
import threading

import numpy as np

from .._arrays import (
    CAPTURED,
    ITEMSIZE,
    contiguous,
    current_stream,
    diag_strides,
    host_view,
    launch_streams,
    torch_scratch,
    vector_width,
)
from .._errors import BackendError
from .._registry import Backend

try:
    import numba
    from numba import cuda
    from numba.cuda import types as nbt
    from numba.cuda.core import config as _nbconfig

    _IMPORT_ERROR = None
    SIM = bool(_nbconfig.ENABLE_CUDASIM)
except Exception as exc:  # numba-cuda or its CUDA bindings missing: _probe says so
    _IMPORT_ERROR = exc
    SIM = False

#: Threads per block: a multiple of the warp size that lets 8 blocks share a multiprocessor
#: (2048 threads on every GPU since Volta). The simulator runs one Python thread per CUDA
#: thread (and polls them all), so it gets small blocks: fewer threads, faster runs.
THREADS = 8 if SIM else 256
#: Largest grid launched: every block of work gets its own block (the kernels' grid-stride
#: loops take what is left). Blocks are scheduled in index order, so the work is swept in
#: address order: a grid capped at 32 waves, each block looping, had the resident blocks
#: working on a dozen batches at once, whose S no longer fitted in L2 (the out update of
#: `big` ran at 2.6 TB/s). The simulator, one Python thread per CUDA thread, gets one wave.
MAX_GRID = 2**31 - 1
#: Smallest grid launched: Numba's kernel call warns (NumbaPerformanceWarning) below 128
#: blocks, which small problems have by design; the blocks past the work exit at once.
MIN_GRID = 128
#: Problems whose S has at most this many (ii, ji, ci) terms take the one-launch kernel:
#: there, launches cost more than the arithmetic.
DIRECT_TERMS = 1 << 22
#: ... and so do problems where kh*kw*(Ho*Wo)**2 <= DIRECT_RATIO * (H*W)**2 (large strides).
DIRECT_RATIO = 2
#: The out update's per-vector index divisions in 32 bits when the values fit (_div), for
#: out wider than 16 bits (see _make_stream).
FAST_DIV = True
#: ... and the index divisions that run once a thread: gsum's and sbox_walk's position,
#: and the update's tile where FAST_DIV applies (H200, ABAB in one process: mid
#: 115.0 -> 113.7 us of GPU time, big-f32 5500 -> 5464,
#: big-f16's update 1689 -> 1697 us with them, so 16-bit out keeps its 64-bit ones).
DIV32 = True
#: Terms of S whose loads the one-launch kernel issues together (its problems are
#: latency-bound; 16 and 32 left toy's kernel at 12 us on the H200, 2026-11-30).
DIRECT_UNROLL = 8
#: A stream thread's share of the update: P positions (vectors of up to 16 bytes) for CH
#: output channels, which share each vector of S. Float32 out: 4 positions, 1 channel
#: (80 registers, 3 blocks a multiprocessor). 16-bit out with float32 sums reads 32 bytes
#: of S a 16-byte vector of out, so several channels share them: 1 position for 4
#: channels, out kept in 32-bit words (64 registers, 4 blocks). On the H200 (2026-11-30,
#: big-f16's update): 1697-1706 us, against 1733-1735 at 2 positions for 2 channels (78
#: registers, 3 blocks; same process), 1989 at 1 position for 2 channels (54 registers,
#: 4 blocks) and 2414 at 2 positions with out unpacked into halves (91 registers, 2 blocks).
STREAM_P, STREAM_CH = 4, 1
STREAM_P_16, STREAM_CH_16 = 1, 4
#: The out update's rows variant where it applies (_stream_kernel: a full-layout out's
#: evenly spaced rows): 32-bit index divisions only, one a thread instead of two a
#: position. H200, 2026-11-30, ABAB in one process (ab52.py): mid's GPU part 107.8-108.1
#: -> 100.4-100.5 µs, same bits. False: the general kernel everywhere (an A/B knob).
STREAM_ROWS = True
#: S by walks along its diagonals (sbox_walk) where the rows have stride 1 and dilation
#: 1 and kh <= WALK_KMAX (row sums kept in registers); else one thread an element (sbox).
SBOX_WALK = True
WALK_KMAX = 7
#: Steps of a walk whose loads are issued together. LLVM hoists every load offset of a
#: round out of the loop as a 64-bit constant: 8 steps took 136 registers (one block of
#: 256 threads a multiprocessor), 4 took 84 and 2 took 80 (three blocks); big-f16's walk
#: 163 -> 132 -> 124 us, mid's 9.0 -> 8.2 -> 7.6 us, same bits (H200, 2026-11-30, ab32.py).
WALK_U = 2
#: The walk takes the (b, g) planes last to first: the end of T, which gsum wrote last,
#: is still in L2, and the S it leaves in L2 is the S the update reads first.
WALK_BACKWARDS = True
#: The 3x3 walk's inner rounds (no bounds tests, one base a round) where a diagonal's
#: rows and columns are inside; False: every round tested (an A/B knob).
WALK_INNER = True
#: The 3 x 3 walk with its width a compile-time constant (sbox_walk's V = 33: every
#: column's loads of a round issued before their sums); False: the width read at run time.
WALK_KW = True
#: Cache qualifier of the loads of gamma, touched once: "cs", evict-first (or "": none;
#: the out update's are OUT_WIDE and OUT_16 below) ...
STREAMING = "cs"
#: ... and of the loads of data re-read from the caches (S, T, mu): "nc", the
#: read-only path (or "": a plain load).
READONLY = "nc"
#: The out update's qualifiers, (load, store), for out wider than 16 bits and for 16-bit
#: out. The read-only path is correct for out here: each element is loaded once, by the
#: thread that then stores it, and the store depends on the load. A/B on the H200
#: (2026-11-30, against .cs for all): big-f32's update 3317 -> 3298 us with .nc loads and
#: plain stores; big-f16's went 1675 -> 1692 us with plain stores, so 16-bit keeps .cs.
OUT_WIDE, OUT_16 = ("nc", ""), ("cs", "cs")


def _stream_shape(itemsize, acc):
    """(P, CH) of the stream kernel for out elements of ``itemsize`` and sums of ``acc``."""
    if itemsize == 2:
        return (STREAM_P_16, STREAM_CH_16) if acc == "float32" else (2, 1)
    return STREAM_P, STREAM_CH


# ---------------------------------------------------------------------------------------
# Element access. bfloat16 travels as uint16 bits (no CUDA-array-interface type code and
# no numpy dtype); every other dtype is loaded natively. Loads return the accumulation
# type (that of ``zero``); stores round once into the element type.
# ---------------------------------------------------------------------------------------
if _IMPORT_ERROR is None:
    if SIM:
        def _f32_from_bits(u):
            return np.array(u & 0xFFFFFFFF, np.uint32).view(np.float32)[()]

        def _f32_bits(f):
            return int(np.array(f, np.float32).view(np.uint32))
    else:
        @cuda.jit(device=True)
        def _f32_from_bits(u):
            return cuda.libdevice.int_as_float(numba.int32(u))

        @cuda.jit(device=True)
        def _f32_bits(f):
            return numba.int64(cuda.libdevice.float_as_int(f)) & 0xFFFFFFFF

    @cuda.jit(device=True)
    def _bf16_value(u):
        """float32 value of bfloat16 bits ``u`` (exact: bf16 is float32's top half)."""
        return _f32_from_bits(numba.int64(u) << 16)

    @cuda.jit(device=True)
    def _bf16_bits(v):
        """bfloat16 bits of ``v`` (float32 or float64), rounded once to nearest-even."""
        f = numba.float32(v)
        u = _f32_bits(f)
        if f != f:  # NaN: keep the sign, make it quiet
            return ((u >> 16) | 0x40) & 0xFFFF
        if numba.float64(f) != v:
            # float64 -> float32 was inexact: turn it into round-to-odd (truncate, set the
            # last bit), so the rounding to bfloat16 below is the only one that counts.
            if abs(f) > abs(v):
                u -= 1
            u |= 1
        return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) & 0xFFFF

    @cuda.jit(device=True)
    def _div(a, b):
        """a // b for a >= 0, b > 0: an unsigned 32-bit division when both fit in 32 bits
        (the GPU has no 64-bit divide: it is a long emulated sequence)."""
        if (a | b) >> 32 == 0:
            return numba.int64(numba.uint32(a) // numba.uint32(b))
        return a // b

    @cuda.jit(device=True)
    def _div64(a, b):
        return a // b

    @cuda.jit(device=True)
    def _div32(a, b):
        """a // b for 0 <= a, b < 2**32, as the host checked (no 64-bit path compiled)."""
        return numba.int64(numba.uint32(a) // numba.uint32(b))

    if SIM:
        def _to_acc(v, zero):
            if isinstance(v, np.uint16):
                return type(zero)(_bf16_value(v))
            return type(zero)(v)

        def _store(ptr, i, v):
            if ptr.dtype == np.uint16:
                ptr[i] = numba.uint16(_bf16_bits(v))
            else:
                ptr[i] = v

        def _to_elem(ptr, v):
            return numba.uint16(_bf16_bits(v)) if ptr.dtype == np.uint16 else v
    else:
        from numba.cuda.extending import overload

        def _to_acc(v, zero):  # typed below, per element type, at compile time
            raise NotImplementedError

        def _store(ptr, i, v):
            raise NotImplementedError

        def _to_elem(ptr, v):  # v as ptr's element (bfloat16: its bits); float dtypes
            raise NotImplementedError  # convert when the value is stored

        @overload(_to_acc, target="cuda")
        def _to_acc_typed(v, zero):
            # A conversion, not ``zero + v``: that would cost an add per load (it cannot
            # be folded, -0.0 + 0.0 is +0.0).
            if v == nbt.uint16:
                if zero == nbt.float32:
                    return lambda v, zero: _bf16_value(v)
                return lambda v, zero: numba.float64(_bf16_value(v))
            if v == zero:
                return lambda v, zero: v
            if zero == nbt.float32:
                return lambda v, zero: numba.float32(v)
            return lambda v, zero: numba.float64(v)

        @overload(_store, target="cuda")
        def _store_typed(ptr, i, v):
            if ptr.dtype == nbt.uint16:
                def impl(ptr, i, v):
                    ptr[i] = numba.uint16(_bf16_bits(v))
            else:
                def impl(ptr, i, v):
                    ptr[i] = v
            return impl

        @overload(_to_elem, target="cuda")
        def _to_elem_typed(ptr, v):
            if ptr.dtype == nbt.uint16:
                return lambda ptr, v: numba.uint16(_bf16_bits(v))
            return lambda ptr, v: v

# ---------------------------------------------------------------------------------------
# Vector loads and stores. Numba has no syntax for a 16-byte access, so
# ``_LDV[n, hint](ptr, i)`` is an intrinsic that loads ptr[i : i + n] as one vector
# (ld.global.v4.f32 / v2.f64, or v4.b32 words for eight 16-bit values) and returns the n
# elements as a tuple, and ``_STV[n, hint](ptr, i, arr, k)`` stores arr[k : k + n] (a
# local array of ptr's element type) the same way. ``hint`` is a PTX cache qualifier:
# "cs" (evict-first) for the data touched once (gamma, out), "nc" (the read-only path)
# for the data re-read from the caches (S, T, mu), "" for none; with one, the access is
# inline PTX, at most 16 bytes an instruction. On the H200 (2026-11-30) neither qualifier
# moved `big` beyond the noise by itself (.cs: 8066 against 8158 us; .nc: 5963-5990
# against 5938 us); they are the habits of the cupy backend's kernels, and the whole
# suite ran with them. The caller guarantees the alignment (n * itemsize bytes, at most
# 16; checked on the host by convcov._arrays.vector_width). Under the simulator they are
# plain indexing.
# ---------------------------------------------------------------------------------------
if _IMPORT_ERROR is None:
    if not SIM:
        from llvmlite import ir
        from numba.cuda.extending import intrinsic

        _I32 = ir.IntType(32)

        def _regs(context, elem, n):
            """How n elements travel in registers: (register type, count, PTX type,
            inline-asm constraint letter). 16-bit elements go in pairs as 32-bit words."""
            lt = context.get_value_type(elem)
            size = context.get_abi_sizeof(lt)
            if size < 4 and n * size >= 4:
                return _I32, n * size // 4, "b32", "r"
            if size == 2:
                return ir.IntType(16), 1, "b16", "h"
            return lt, n, {4: "f32", 8: "f64"}[size], {4: "f", 8: "d"}[size]

        def _ptx_vec(count):
            return "" if count == 1 else f".v{count}"

        def _ptx_list(first, count):
            regs = ", ".join(f"${first + k}" for k in range(count))
            return regs if count == 1 else "{" + regs + "}"

    def _make_ldv(n, hint, raw=False):
        if SIM:
            if raw:
                def ldv(ptr, i):
                    return tuple(np.ascontiguousarray(ptr[i:i + n]).view(np.uint32))
                return ldv

            def ldv(ptr, i):
                return tuple(ptr[i + k] for k in range(n))
            return ldv

        @intrinsic
        def ldv(typingctx, ptr, i):
            if raw:  # 16-bit elements, returned as the n // 2 words that hold them
                sig = nbt.UniTuple(nbt.uint32, n // 2)(ptr, i)
            else:
                sig = nbt.UniTuple(ptr.dtype, n)(ptr, i)

            def codegen(context, builder, sig, args):
                p, idx = args
                lt = context.get_value_type(sig.args[0].dtype)
                rt, count, ptx_t, letter = _regs(context, sig.args[0].dtype, n)
                addr = builder.gep(p, [idx])
                if hint:
                    # At most 16 bytes an instruction (32-byte accesses need sm_100).
                    per = max(1, 16 // context.get_abi_sizeof(rt))
                    regs = []
                    for first in range(0, count, per):
                        m = min(per, count - first)
                        ty = rt if m == 1 else ir.LiteralStructType([rt] * m)
                        fn = ir.FunctionType(ty, [ir.IntType(64)])
                        code = ("{ .reg .u64 a; cvta.to.global.u64 a, $%d; "
                                "ld.global.%s%s.%s %s, [a]; }"
                                % (m, hint, _ptx_vec(m), ptx_t, _ptx_list(0, m)))
                        cons = ",".join(["=" + letter] * m) + ",l"
                        part = builder.gep(builder.bitcast(addr, rt.as_pointer()),
                                           [ir.Constant(ir.IntType(64), first)])
                        r = builder.asm(fn, code, cons, [builder.ptrtoint(part, ir.IntType(64))],
                                        side_effect=False)
                        regs += [r] if m == 1 else [builder.extract_value(r, k) for k in range(m)]
                else:
                    vt = ir.VectorType(rt, count)
                    v = builder.load(builder.bitcast(addr, vt.as_pointer()),
                                     align=min(16, n * context.get_abi_sizeof(lt)))
                    regs = [builder.extract_element(v, ir.Constant(_I32, k)) for k in range(count)]
                if raw:
                    vals = regs
                elif context.get_abi_sizeof(lt) == 2 and n >= 2:
                    # 32-bit words of 16-bit elements: split them, low half first
                    vals = []
                    for word in regs:
                        for shift in (0, 16):
                            half = builder.trunc(builder.lshr(word, ir.Constant(_I32, shift)),
                                                 ir.IntType(16))
                            vals.append(builder.bitcast(half, lt))
                else:
                    vals = [builder.bitcast(r, lt) for r in regs]
                return context.make_tuple(builder, sig.return_type, vals)

            return sig, codegen
        return ldv

    def _make_stv(n, hint, raw=False):
        if SIM:
            if raw:
                def stv(ptr, i, arr, k):
                    ptr[i:i + n] = np.ascontiguousarray(arr[k:k + n // 2]).view(ptr.dtype)
                return stv

            def stv(ptr, i, arr, k):
                for e in range(n):
                    ptr[i + e] = arr[k + e]
            return stv

        @intrinsic
        def stv(typingctx, ptr, i, arr, k):
            if arr.dtype != (nbt.uint32 if raw else ptr.dtype):
                return None
            sig = nbt.void(ptr, i, arr, k)

            def codegen(context, builder, sig, args):
                p, idx, a, start = args
                data = context.make_array(sig.args[2])(context, builder, a).data
                m = n // 2 if raw else n  # raw: arr holds the words of n 16-bit elements
                vals = [builder.load(builder.gep(
                            data, [builder.add(start, ir.Constant(start.type, e))]))
                        for e in range(m)]
                lt = context.get_value_type(sig.args[0].dtype)
                size = context.get_abi_sizeof(lt)
                rt, count, ptx_t, letter = _regs(context, sig.args[0].dtype, n)
                if raw:
                    regs = vals
                elif size == 2 and n >= 2:  # 16-bit elements: pack pairs into words
                    i16 = ir.IntType(16)
                    regs = [builder.or_(
                                builder.zext(builder.bitcast(vals[2 * w], i16), _I32),
                                builder.shl(builder.zext(builder.bitcast(vals[2 * w + 1], i16),
                                                         _I32),
                                            ir.Constant(_I32, 16)))
                            for w in range(count)]
                else:
                    regs = [builder.bitcast(v, rt) for v in vals]
                addr = builder.gep(p, [idx])
                if hint:
                    per = max(1, 16 // context.get_abi_sizeof(rt))  # <= 16 bytes a store
                    for first in range(0, count, per):
                        m = min(per, count - first)
                        fn = ir.FunctionType(ir.VoidType(), [ir.IntType(64)] + [rt] * m)
                        code = ("{ .reg .u64 a; cvta.to.global.u64 a, $0; "
                                "st.global.%s%s.%s [a], %s; }"
                                % (hint, _ptx_vec(m), ptx_t, _ptx_list(1, m)))
                        cons = "l," + ",".join([letter] * m) + ",~{memory}"
                        part = builder.gep(builder.bitcast(addr, rt.as_pointer()),
                                           [ir.Constant(ir.IntType(64), first)])
                        builder.asm(fn, code, cons, [builder.ptrtoint(part, ir.IntType(64))]
                                    + regs[first:first + m], side_effect=True)
                else:
                    vt = ir.VectorType(rt, count)
                    vec = ir.Constant(vt, ir.Undefined)
                    for e, r in enumerate(regs):
                        vec = builder.insert_element(vec, r, ir.Constant(_I32, e))
                    builder.store(vec, builder.bitcast(addr, vt.as_pointer()),
                                  align=min(16, n * size))
                return context.get_dummy_value()

            return sig, codegen
        return stv

    _LDV = {(n, h): _make_ldv(n, h) for n in (1, 2, 4, 8) for h in ("", "cs", "nc")}
    _STV = {(n, h): _make_stv(n, h) for n in (1, 2, 4, 8) for h in ("", "cs")}
    # The same for n 16-bit elements kept as their n // 2 32-bit words (``_LDW`` returns
    # the words, ``_STW`` stores words from a local uint32 array): a thread that unpacks
    # 16-bit vectors only where it uses them holds half the registers (the paired-channel
    # stream for 16-bit out: 91 registers with halves, see _make_stream).
    _LDW = {(n, h): _make_ldv(n, h, raw=True) for n in (2, 4, 8) for h in ("", "cs")}
    _STW = {(n, h): _make_stv(n, h, raw=True) for n in (2, 4, 8) for h in ("", "cs")}

    # float16 bits (the low 16 bits of an integer) to float32, exactly, and float32 to
    # float16 bits, rounded to nearest even (cvt.f32.f16 and cvt.rn.f16.f32).
    if SIM:
        def _f16_value(u):
            return np.float32(np.uint16(int(u) & 0xFFFF).view(np.float16))

        def _f16_bits(f):
            return int(np.float16(np.float32(f)).view(np.uint16))
    else:
        @intrinsic
        def _f16_value(typingctx, u):
            sig = nbt.float32(u)

            def codegen(context, builder, sig, args):
                h = builder.bitcast(builder.trunc(args[0], ir.IntType(16)), ir.HalfType())
                return builder.fpext(h, ir.FloatType())
            return sig, codegen

        @intrinsic
        def _f16_bits(typingctx, f):
            if f != nbt.float32:
                return None
            sig = nbt.uint32(f)

            def codegen(context, builder, sig, args):
                h = builder.bitcast(builder.fptrunc(args[0], ir.HalfType()), ir.IntType(16))
                return builder.zext(h, _I32)
            return sig, codegen

# ---------------------------------------------------------------------------------------
# The forward kernels. Index names follow SPEC section 1. Arrays are (pointer, base,
# strides): element [i, j, ...] is ptr[base + i*s0 + j*s1 + ...]; the channel stride of
# out and gamma is the channel-diagonal's (s1 + s4 for full layouts). geo = (B, G, Cg,
# Cog, H, W, Ho, Wo, kh, kw, sh, sw, ph, pw, dh, dw), Cg = Ci // G, Cog = Co // G.
# ``zero`` is 0 in the accumulation dtype (it types the sums). One thread per element of
# the result, in its flat order (consecutive threads, consecutive addresses), with the
# grid's stride. Each kernel is made by a factory per vector width V (elements a thread
# loads at once) and accumulation type ACC: both are compile-time constants of the
# closure, so the loops over them unroll into registers.
# ---------------------------------------------------------------------------------------
if _IMPORT_ERROR is None:

    def _make_gsum(V, ACC, OT):
        """T[b, g, x0, y0, q] = sum over ci of group g of gamma[b, ci, x0, y0, (ci,) q]
        + mu[b, ci, x0, y0] * mu[b, ci, q], V consecutive q a thread (V > 1: q contiguous
        in gamma and mu, rows aligned). Four channels a step: their 4 x V gamma values
        are in flight before the first is added. Reads gamma's channel-diagonal once."""
        ldg, ldm, stt = _LDV[V, STREAMING], _LDV[V, READONLY], _STV[V, ""]
        div = _div if DIV32 else _div64

        def gsum(tptr, gptr, gbase, gst, has_g, mptr, mbase, mst, geo, n, zero):
            G, Cg, W = geo[1], geo[2], geo[5]
            HW = geo[4] * W
            nqv = HW // V
            gsc, msc = gst[1], mst[1]
            idx = cuda.grid(1)
            while idx < n:
                row = div(idx, nqv)  # (b, g, x0, y0)
                q = (idx - row * nqv) * V
                bg = div(row, HW)
                p = row - bg * HW
                b = div(bg, G)
                g = bg - b * G
                x0 = div(p, W)
                y0 = p - x0 * W
                gb = gbase + b * gst[0] + g * Cg * gsc
                mb = mbase + b * mst[0] + g * Cg * msc
                og = gb + x0 * gst[2] + y0 * gst[3]
                omr = mb + x0 * mst[2] + y0 * mst[3]
                if V > 1:
                    og += q
                    omc = mb + q
                else:
                    x1 = q // W
                    og += x1 * gst[4] + (q - x1 * W) * gst[5]
                    omc = mb + x1 * mst[2] + (q - x1 * W) * mst[3]
                acc = cuda.local.array(V, ACC)
                for e in range(V):
                    acc[e] = zero
                ci = 0
                while ci + 4 <= Cg:
                    # Every load of the four channels before the first sum (summing
                    # gamma first made the loads of mu wait for gamma's, from DRAM).
                    r0 = mptr[omr]
                    r1 = mptr[omr + msc]
                    r2 = mptr[omr + 2 * msc]
                    r3 = mptr[omr + 3 * msc]
                    m0 = ldm(mptr, omc)
                    m1 = ldm(mptr, omc + msc)
                    m2 = ldm(mptr, omc + 2 * msc)
                    m3 = ldm(mptr, omc + 3 * msc)
                    if has_g:
                        g0 = ldg(gptr, og)
                        g1 = ldg(gptr, og + gsc)
                        g2 = ldg(gptr, og + 2 * gsc)
                        g3 = ldg(gptr, og + 3 * gsc)
                        for e in range(V):
                            acc[e] += ((_to_acc(g0[e], zero) + _to_acc(g1[e], zero))
                                       + (_to_acc(g2[e], zero) + _to_acc(g3[e], zero)))
                    for e in range(V):
                        acc[e] += _to_acc(r0, zero) * _to_acc(m0[e], zero)
                        acc[e] += _to_acc(r1, zero) * _to_acc(m1[e], zero)
                        acc[e] += _to_acc(r2, zero) * _to_acc(m2[e], zero)
                        acc[e] += _to_acc(r3, zero) * _to_acc(m3[e], zero)
                    og += 4 * gsc
                    omr += 4 * msc
                    omc += 4 * msc
                    ci += 4
                while ci < Cg:
                    if has_g:
                        g0 = ldg(gptr, og)
                        for e in range(V):
                            acc[e] += _to_acc(g0[e], zero)
                    mr = _to_acc(mptr[omr], zero)
                    mc = ldm(mptr, omc)
                    for e in range(V):
                        acc[e] += mr * _to_acc(mc[e], zero)
                    og += gsc
                    omr += msc
                    omc += msc
                    ci += 1
                stt(tptr, row * HW + q, acc, 0)
                idx += cuda.gridsize(1)

        return gsum

    def _make_sbox(V, ACC, OT):
        """S[b, g, p0, q], the kh x kw box filter of T (contiguous) along the diagonal
        offsets. The term of kernel offset (ii, ji) sits at the fixed distance
        ii*DI + ji*DJ from that of (0, 0), whatever the stride; elements with every term
        inside the input skip the bounds checks, the others drop the terms with a
        position in the padding (SPEC section 1). Reads hit L2, so the kernel is
        latency-bound: nine loads are issued before they are summed."""
        ld = _LDV[1, READONLY]

        def sbox(sptr, tptr, geo, n, zero):
            H, W, Ho, Wo, kh, kw = geo[4], geo[5], geo[6], geo[7], geo[8], geo[9]
            sh, sw, ph, pw, dh, dw = geo[10], geo[11], geo[12], geo[13], geo[14], geo[15]
            HW = H * W
            HoWo = Ho * Wo
            noff = kh * kw
            DI = dh * (W * HW + W)
            DJ = dw * (HW + 1)
            span_h = (kh - 1) * dh
            span_w = (kw - 1) * dw
            Wo32 = numba.uint32(Wo)
            e = cuda.grid(1)
            while e < n:
                row = e // HoWo
                bg = row // HoWo
                # Positions fit 32 bits: unsigned 32-bit division is several times
                # cheaper than the signed 64-bit floor division of int64 operands.
                q = numba.uint32(e - row * HoWo)
                p0 = numba.uint32(row - bg * HoWo)
                i0 = p0 // Wo32
                i1 = q // Wo32
                x0b = numba.int64(i0) * sh - ph  # input positions of offset (0, 0)
                x1b = numba.int64(i1) * sh - ph
                y0b = numba.int64(p0 - i0 * Wo32) * sw - pw
                y1b = numba.int64(q - i1 * Wo32) * sw - pw
                inside = ((x0b >= 0) & (x0b + span_h < H) & (y0b >= 0) & (y0b + span_w < W)
                          & (x1b >= 0) & (x1b + span_h < H) & (y1b >= 0) & (y1b + span_w < W))
                off = bg * HW * HW + (x0b * W + y0b) * HW + x1b * W + y1b
                s = zero
                if inside and kh == 3 and kw == 3:
                    # The common 3x3 kernel away from the padding: nine unconditional
                    # loads, issued back to back (the general loop branches around
                    # each one).
                    v0 = ld(tptr, off)[0]
                    v1 = ld(tptr, off + DJ)[0]
                    v2 = ld(tptr, off + 2 * DJ)[0]
                    v3 = ld(tptr, off + DI)[0]
                    v4 = ld(tptr, off + DI + DJ)[0]
                    v5 = ld(tptr, off + DI + 2 * DJ)[0]
                    v6 = ld(tptr, off + 2 * DI)[0]
                    v7 = ld(tptr, off + 2 * DI + DJ)[0]
                    v8 = ld(tptr, off + 2 * DI + 2 * DJ)[0]
                    s = s + v0 + v1 + v2 + v3 + v4 + v5 + v6 + v7 + v8
                else:
                    ii = 0
                    ji = 0
                    t = 0
                    while t < noff:
                        tv = cuda.local.array(9, ACC)
                        for u in range(9):
                            ok = t + u < noff
                            if not inside:
                                x0 = x0b + ii * dh
                                x1 = x1b + ii * dh
                                y0 = y0b + ji * dw
                                y1 = y1b + ji * dw
                                ok = (ok & (x0 >= 0) & (x0 < H) & (x1 >= 0) & (x1 < H)
                                      & (y0 >= 0) & (y0 < W) & (y1 >= 0) & (y1 < W))
                            tv[u] = ld(tptr, off)[0] if ok else zero
                            off += DJ
                            ji += 1
                            if ji == kw:
                                ji = 0
                                ii += 1
                                off += DI - kw * DJ
                        for u in range(9):
                            s += tv[u]
                        t += 9
                sptr[e] = s
                e += cuda.gridsize(1)

        return sbox

    @cuda.jit(device=True)
    def _push(r, new, kh):
        """The ring of sbox_walk's last kh - 1 row sums (kh <= 7), oldest first, after
        the row sum ``new`` joined it."""
        return (r[1] if kh > 2 else new, r[2] if kh > 3 else new, r[3] if kh > 4 else new,
                r[4] if kh > 5 else new, r[5] if kh > 6 else new, new)

    @cuda.jit(device=True)
    def _ring_sum(r, kh, zero):
        """The sum of the ring's kh - 1 row sums, oldest first (constant indices: a
        tuple indexed by a variable would live in local memory)."""
        s = r[0] if kh > 1 else zero
        s = s + r[1] if kh > 2 else s
        s = s + r[2] if kh > 3 else s
        s = s + r[3] if kh > 4 else s
        s = s + r[4] if kh > 5 else s
        return s + r[5] if kh > 6 else s

    def _make_sbox_walk(V, ACC, OT):
        """S for stride 1 and dilation 1 along the rows (the usual conv): a walk along each
        diagonal. S[., i0, j0, i0 + d, j1] is the sum over ii of the row terms
        R(x) = sum over ji of T[x, y0b + ji*dw, x + d, y1b + ji*dw] at x = i0 - ph + ii;
        the next i0 of the diagonal reuses kh - 1 of them. One thread a (b, g, d, j0, j1),
        j1 fastest (coalesced reads of T and writes of S), walking i0: kw loads an
        element instead of sbox's kh*kw, which made sbox L2-bound. Row sums are summed
        fresh each step (no running subtraction: Inf - Inf would turn a sum into NaN);
        the last kh - 1 live in registers (kh <= WALK_KMAX); WALK_U steps' loads are
        issued before their sums. V is the kernel's shape where it is a compile-time
        constant: 3 (kh = 3, kw read from geo), 33 (3 x 3: every column's loads of a
        round are issued before their sums; with kw read at run time each column's sums
        held the next column's loads, a warp issuing in order), else 0 (any kh <= 7 and
        kw read from geo). A term outside the input is a 0 then, added to a sum that
        starts at +0 (the same bits as leaving it out: such a sum is never -0)."""
        ld = _LDV[1, READONLY]
        U, KH, KW, BACK, INNER = WALK_U, V % 10, V // 10, WALK_BACKWARDS, WALK_INNER
        KWU = max(KW, 1) * U
        div = _div if DIV32 else _div64

        def sbox_walk(sptr, tptr, geo, n, zero):
            H, W, Ho, Wo = geo[4], geo[5], geo[6], geo[7]
            kw = KW if KW else geo[9]
            kh = KH if KH else geo[8]
            sw, ph, pw, dw = geo[11], geo[12], geo[13], geo[15]
            HW = H * W
            HoWo = Ho * Wo
            DI = W * HW + W
            DJ = dw * (HW + 1)
            DS = HoWo * Wo + Wo  # S's step from i0 to i0 + 1 along a diagonal
            nd = 2 * Ho - 1
            WoWo = Wo * Wo
            Wo32 = numba.uint32(Wo)
            e = cuda.grid(1)
            while e < n:
                bgd = div(e, WoWo)
                bg = div(bgd, nd)
                d = bgd - bg * nd - (Ho - 1)
                if BACK:  # the last (b, g) first: the T that gsum wrote last is in L2
                    bg = geo[0] * geo[1] - 1 - bg
                # (j0, j1) fit 32 bits: unsigned 32-bit division is the cheap one.
                jj = numba.uint32(e - bgd * WoWo)
                j0 = jj // Wo32
                j1 = jj - j0 * Wo32
                y0b = numba.int64(j0) * sw - pw
                y1b = numba.int64(j1) * sw - pw
                cols = 0  # bit ji: both columns of kernel offset ji inside the input
                for ji in range(kw):
                    y0 = y0b + ji * dw
                    y1 = y1b + ji * dw
                    if (y0 >= 0) & (y0 < W) & (y1 >= 0) & (y1 < W):
                        cols |= 1 << ji
                i0 = -d if d < 0 else 0
                i0e = Ho - d if d > 0 else Ho  # i0 + d stays in [0, Ho)
                xlo = -d if d < 0 else 0
                xhi = H - d if d > 0 else H  # rows x with x and x + d inside
                # Row x of this diagonal starts at tb + x * DI (only read when inside).
                tb = bg * HW * HW + d * W + y0b * HW + y1b
                sd = bg * HoWo * HoWo + numba.int64(j0) * HoWo + d * Wo + j1
                # The last kh - 1 row sums, oldest first: r[0] = R(i0 - ph), ...; six
                # scalars, not a local array, which Numba's loops left in local memory.
                r = (zero, zero, zero, zero, zero, zero)
                x = i0 - ph
                for _ in range(kh - 1):
                    rx = zero
                    if KW:
                        tv = cuda.local.array(KWU, ACC)
                        for ji in range(KW):
                            ok = (x >= xlo) & (x < xhi) & ((cols >> ji) & 1 == 1)
                            tv[ji] = ld(tptr, tb + x * DI + ji * DJ)[0] if ok else zero
                        for ji in range(KW):
                            rx += tv[ji]
                    elif (x >= xlo) & (x < xhi):
                        for ji in range(kw):
                            if (cols >> ji) & 1:
                                rx += ld(tptr, tb + x * DI + ji * DJ)[0]
                    r = _push(r, rx, kh)
                    x += 1
                # Inner rounds first (3 x 3 kernel): all U steps on the diagonal, every
                # row and column inside, so no bounds tests, and bases stepped a round at
                # a time (22 instructions a step in the sm_90 SASS, against 54). With the
                # tests of the rounds below on every load the walk was issue-bound (ncu,
                # big-f16: 75M warp instructions in 124 us): big-f16's walk 121.7 -> 89.9
                # us, mid's 7.7 -> 6.0 us, same bits (H200, 2026-11-30, ab42.py). Columns
                # or first rounds in the padding take the loop below.
                rounds = min(i0e - i0, xhi - x) // U
                if not INNER or KW == 0 or cols != (1 << kw) - 1 or x < xlo or rounds < 0:
                    rounds = 0
                rb = tb + x * DI  # row x's T, and S at i0, stepped a round at a time
                sb = sd + i0 * DS
                for _ in range(rounds):
                    tv = cuda.local.array(KWU, ACC)
                    for ji in range(KW):
                        for u in range(U):
                            tv[ji * U + u] = ld(tptr, rb + (u * DI + ji * DJ))[0]
                    for u in range(U):
                        rx = zero
                        for ji in range(KW):
                            rx += tv[ji * U + u]
                        sptr[sb + u * DS] = _ring_sum(r, kh, zero) + rx
                        r = _push(r, rx, kh)
                    rb += U * DI
                    sb += U * DS
                i0 += rounds * U
                x += rounds * U
                while i0 < i0e:
                    rs = cuda.local.array(U, ACC)
                    for u in range(U):
                        rs[u] = zero
                    if KW:  # every column's loads, then the sums
                        tv = cuda.local.array(KWU, ACC)
                        for ji in range(KW):
                            on = (cols >> ji) & 1 == 1
                            for u in range(U):
                                xu = x + u
                                ok = on & (i0 + u < i0e) & (xu >= xlo) & (xu < xhi)
                                tv[ji * U + u] = ld(tptr, tb + xu * DI + ji * DJ)[0] if ok else zero
                        for ji in range(KW):
                            for u in range(U):
                                rs[u] += tv[ji * U + u]
                    for ji in range(0 if KW else kw):
                        if (cols >> ji) & 1:
                            tv = cuda.local.array(U, ACC)
                            for u in range(U):
                                xu = x + u
                                ok = (i0 + u < i0e) & (xu >= xlo) & (xu < xhi)
                                tv[u] = ld(tptr, tb + xu * DI + ji * DJ)[0] if ok else zero
                            for u in range(U):
                                rs[u] += tv[u]
                    for u in range(U):
                        if i0 + u < i0e:
                            sptr[sd + (i0 + u) * DS] = _ring_sum(r, kh, zero) + rs[u]
                            r = _push(r, rs[u], kh)
                    i0 += U
                    x += U
                e += cuda.gridsize(1)

        return sbox_walk

    def _make_stream(V, ACC, OT, MODE="any"):
        """out[b, c0, i0, j0, (c0,) i1, j1] += c[c0] * S[b, g(c0)] in address order.
        out[b, c0] is ``nseg`` segments of ``seg_len`` elements contiguous in S[b, g]: one
        (the whole plane: a flat axpy, for a contiguous diagonal-layout out) or one per
        (i0, j0). A block takes a tile of blockDim x P vector positions for CH output
        channels of one group (_stream_shape); each thread loads its P vectors of S once
        for its CH channels, and all its vectors of out before it stores any. V > 1
        only when the segments are contiguous and aligned in out (checked on the host).

        MODE "any" takes every layout; "rows" (STREAM_ROWS, _stream_kernel) takes
        segments that are contiguous in out and evenly spaced (out[b, c0]'s (i0, j0) rows
        at one stride, as in a contiguous full-layout out) with positions and tiles under
        2**31: its index divisions are plain 32-bit ones, and a thread finds its P
        positions with one division instead of two a position."""
        P, CH = _stream_shape(OT.bitwidth // 8, str(ACC))
        # 16-bit out with float32 sums, in vectors: out stays in 32-bit words (two
        # elements each) from its load to its store, unpacked only for the arithmetic.
        RAW = OT.bitwidth == 16 and ACC == nbt.float32 and V >= 2
        NW = V // 2 if RAW else V  # words (RAW) or elements of out a vector
        load_hint, store_hint = OUT_16 if OT.bitwidth == 16 else OUT_WIDE
        if RAW:
            ldo, st = _LDW[V, load_hint], _STW[V, store_hint]
            half = _f16_value if OT == nbt.float16 else _bf16_value
            bits = _f16_bits if OT == nbt.float16 else _bf16_bits

            @cuda.jit(device=True)
            def update(optr, ov, i, c, sv, j, zero):
                """Word i of out (two elements, low half first) + c * sv[j : j + 2]."""
                lo = half(ov[i] & 0xFFFF) + c * sv[j]
                hi = half(ov[i] >> 16) + c * sv[j + 1]
                return bits(lo) | (bits(hi) << 16)
        else:
            ldo, st = _LDV[V, load_hint], _STV[V, store_hint]

            @cuda.jit(device=True)
            def update(optr, ov, i, c, sv, j, zero):
                """Element i of out + c * sv[j]."""
                return _to_elem(optr, _to_acc(ov[i], zero) + c * sv[j])
        lds = _LDV[V, READONLY]
        # 32-bit divisions for the segments' index arithmetic (H200, 2026-11-30, ABAB in one
        # process): mid's update 62-63 -> 60 us, big-f32's (no segments) 3297 -> 3304;
        # not for 16-bit out, whose kernel sits at the 64-register edge of 4 blocks a
        # multiprocessor (big-f16's update 1689-1694 -> 1701-1706 us with them).
        div = _div if FAST_DIV and OT.bitwidth > 16 else _div64
        tdiv = div if DIV32 else _div64  # 16-bit out: 64-bit (1689 -> 1697 us, ab28.py)
        PV, PCW = P * V, P * CH * NW  # constants: the size of a local array must be one
        WT = nbt.uint32 if RAW else OT
        EW = V // NW  # elements a word of ov

        if MODE == "rows":  # the host checked that the values fit: no 64-bit fallback
            div = tdiv = _div32

        def stream(optr, obase, ost, cptr, cbase, cst, has_c, cval, sptr, geo, nseg, seg_len,
                   tiles, zero):
            G, Cog, Wo = geo[1], geo[3], geo[7]
            nvec = seg_len // V
            nf = nseg * nvec
            nt = cuda.blockDim.x
            tid = cuda.threadIdx.x
            ncb = (Cog + CH - 1) // CH
            ntiles = geo[0] * G * ncb * tiles
            if MODE == "rows":
                # Position k of a thread is k * nt vectors after its first: dr rows and
                # dv vectors on, plus one row when the vectors wrap (dv < nvec).
                dr = div(nt, nvec)
                dv = nt - dr * nvec
            tile = cuda.blockIdx.x
            while tile < ntiles:  # block-uniform
                r1 = tdiv(tile, tiles)  # neighbouring blocks: neighbouring memory
                tin = tile - r1 * tiles
                bg = tdiv(r1, ncb)
                b = tdiv(bg, G)
                cb = r1 - bg * ncb
                c0 = (bg - b * G) * Cog + cb * CH
                nch = min(CH, Cog - cb * CH)  # channels of this tile
                ob = obase + b * ost[0] + c0 * ost[1]
                sb = bg * nseg * seg_len
                oo = cuda.local.array(P, nbt.int64)
                ov = cuda.local.array(PCW, WT)  # as loaded: converted where used
                sv = cuda.local.array(PV, ACC)
                if MODE == "rows":
                    f = tin * P * nt + tid  # the first position
                    r = div(f, nvec)
                    v = f - r * nvec
                for k in range(P):
                    f = (tin * P + k) * nt + tid
                    if MODE == "rows" and k > 0:
                        r += dr
                        v += dv
                        if v >= nvec:
                            r += 1
                            v -= nvec
                    if f < nf:
                        if MODE == "rows":  # rows at one stride, S's segments contiguous
                            off = ob + r * ost[3] + v * V
                            si = sb + f * V
                        elif nseg == 1:  # one flat axpy
                            off = ob + f * V
                            si = sb + f * V
                        else:
                            r = div(f, nvec)
                            v = f - r * nvec
                            i0 = div(r, Wo)
                            off = ob + i0 * ost[2] + (r - i0 * Wo) * ost[3]
                            if V > 1:
                                off += v * V
                            else:
                                i1 = div(v, Wo)
                                off += i1 * ost[4] + (v - i1 * Wo) * ost[5]
                            si = sb + r * seg_len + v * V
                        oo[k] = off
                        y = lds(sptr, si)
                        for e in range(V):
                            sv[k * V + e] = y[e]
                        for ch in range(CH):
                            # past the group's last channel: channel c0 again (never stored)
                            x = ldo(optr, off + min(ch, nch - 1) * ost[1])
                            for w in range(NW):
                                ov[(k * CH + ch) * NW + w] = x[w]
                cc = cuda.local.array(CH, ACC)
                for ch in range(CH):
                    cc[ch] = (_to_acc(cptr[cbase + (c0 + min(ch, nch - 1)) * cst], zero)
                              if has_c else cval)
                res = cuda.local.array(PCW, WT)
                for k in range(P):
                    for ch in range(CH):
                        for w in range(NW):
                            i = (k * CH + ch) * NW + w
                            res[i] = update(optr, ov, i, cc[ch], sv, k * V + EW * w, zero)
                for k in range(P):
                    if (tin * P + k) * nt + tid < nf:
                        for ch in range(CH):
                            if ch < nch:
                                st(optr, oo[k] + ch * ost[1], res, (k * CH + ch) * NW)
                tile += cuda.gridDim.x

        return stream

    def _make_stream_rows(V, ACC, OT):
        return _make_stream(V, ACC, OT, "rows")

    def _make_direct(V, ACC, OT):
        """The one-launch kernel for small problems: S straight from gamma and mu (the
        channel sum inside the box filter), then out for a chunk of the group's output
        channels; any strides. The (ii, ji, ci) terms are walked as one flat sequence,
        DIRECT_UNROLL at a time with predicated loads: small problems are latency-bound,
        so several terms' loads must be in flight together."""
        U = DIRECT_UNROLL

        def direct(optr, obase, ost, gptr, gbase, gst, has_g, mptr, mbase, mst,
                   cptr, cbase, cst, has_c, cval, geo, nchunk, chunk, n, zero):
            G, Cg, Cog = geo[1], geo[2], geo[3]
            H, W, Ho, Wo, kh, kw = geo[4], geo[5], geo[6], geo[7], geo[8], geo[9]
            sh, sw, ph, pw, dh, dw = geo[10], geo[11], geo[12], geo[13], geo[14], geo[15]
            HoWo = Ho * Wo
            nterm = kh * kw * Cg
            gsc, msc = gst[1], mst[1]
            idx = cuda.grid(1)
            while idx < n:
                r1 = idx // HoWo
                q = idx - r1 * HoWo
                row = r1 // nchunk
                part = r1 - row * nchunk
                bg = row // HoWo
                p0 = row - bg * HoWo
                b = bg // G
                g = bg - b * G
                i0 = p0 // Wo
                j0 = p0 - i0 * Wo
                i1 = q // Wo
                j1 = q - i1 * Wo
                ogb = gbase + b * gst[0] + g * Cg * gsc
                omb = mbase + b * mst[0] + g * Cg * msc
                s = zero
                ii = 0
                ji = 0
                ci = 0
                t = 0
                while t < nterm:
                    gv = cuda.local.array(U, ACC)
                    m0 = cuda.local.array(U, ACC)
                    m1 = cuda.local.array(U, ACC)
                    for u in range(U):
                        x0 = i0 * sh + ii * dh - ph
                        x1 = i1 * sh + ii * dh - ph
                        y0 = j0 * sw + ji * dw - pw
                        y1 = j1 * sw + ji * dw - pw
                        ok = ((t + u < nterm) & (x0 >= 0) & (x0 < H) & (x1 >= 0) & (x1 < H)
                              & (y0 >= 0) & (y0 < W) & (y1 >= 0) & (y1 < W))
                        gv[u] = zero
                        m0[u] = zero
                        m1[u] = zero
                        if ok:
                            if has_g:
                                gv[u] = _to_acc(gptr[ogb + ci * gsc + x0 * gst[2] + y0 * gst[3]
                                                     + x1 * gst[4] + y1 * gst[5]], zero)
                            m0[u] = _to_acc(mptr[omb + ci * msc + x0 * mst[2] + y0 * mst[3]], zero)
                            m1[u] = _to_acc(mptr[omb + ci * msc + x1 * mst[2] + y1 * mst[3]], zero)
                        ci += 1
                        if ci == Cg:
                            ci = 0
                            ji += 1
                            if ji == kw:
                                ji = 0
                                ii += 1
                    for u in range(U):
                        s = m0[u] * m1[u] + (s + gv[u])
                    t += U
                c_first = g * Cog + part * chunk
                oo = obase + b * ost[0] + i0 * ost[2] + j0 * ost[3] + i1 * ost[4] + j1 * ost[5]
                for c0 in range(c_first, min(c_first + chunk, (g + 1) * Cog)):
                    o = oo + c0 * ost[1]
                    cc = _to_acc(cptr[cbase + c0 * cst], zero) if has_c else cval
                    _store(optr, o, _to_acc(optr[o], zero) + cc * s)
                idx += cuda.gridsize(1)

        return direct


# ---------------------------------------------------------------------------------------
# The backward.
# ---------------------------------------------------------------------------------------
if _IMPORT_ERROR is None:

    # -------------------------------------------------------------------------------------
    # The backward (Backend.patch_moment_vjp, docs/autograd.md): two gathers, no atomics,
    # no scratch. Every output element is written by exactly one thread, once.
    # -------------------------------------------------------------------------------------

    @cuda.jit(device=True)
    def _tap(x, pad, k, d, s, n_out):
        """Output index i with i*s + k*d - pad == x, or -1 when there is none in [0, n_out)."""
        num = x + pad - k * d
        if num < 0:
            return -1
        i = num // s
        if i * s != num or i >= n_out:
            return -1
        return i

    @cuda.jit(device=True)
    def _vjp_gamma_rows(sptr, sbase, sst, gptr, gbase, gst, geo, zero):
        """dΓ[b, g, x0, y0, x1, y1] = sum over offsets (ii, ji) that read that input pair of
        grad_S[b, g, i0, j0, i1, j1], stored to the channel-diagonal of every channel of
        group g. One block per row (b, g, x0, y0); threads along (x1, y1): the writes (the
        bulk of the bytes) are coalesced, and so are the reads of grad_S along (i1, j1)
        for stride 1. Positions in the padding are never produced: absent terms."""
        B, G, Cg = geo[0], geo[1], geo[2]
        H, W, Ho, Wo, kh, kw = geo[4], geo[5], geo[6], geo[7], geo[8], geo[9]
        sh, sw, ph, pw, dh, dw = geo[10], geo[11], geo[12], geo[13], geo[14], geo[15]
        HW = H * W
        tid = cuda.threadIdx.x
        nt = cuda.blockDim.x
        gsc = gst[1]
        blk = cuda.blockIdx.x
        while blk < B * G * HW:
            bg = blk // HW
            q0 = blk - bg * HW
            b = bg // G
            g = bg - b * G
            x0 = q0 // W
            y0 = q0 - x0 * W
            srow = sbase + b * sst[0] + g * sst[1]
            grow = gbase + b * gst[0] + g * Cg * gsc + x0 * gst[2] + y0 * gst[3]
            q1 = tid
            while q1 < HW:
                x1 = q1 // W
                y1 = q1 - x1 * W
                s = zero
                for ii in range(kh):
                    i0 = _tap(x0, ph, ii, dh, sh, Ho)
                    i1 = _tap(x1, ph, ii, dh, sh, Ho)
                    if (i0 >= 0) & (i1 >= 0):
                        for ji in range(kw):
                            j0 = _tap(y0, pw, ji, dw, sw, Wo)
                            j1 = _tap(y1, pw, ji, dw, sw, Wo)
                            if (j0 >= 0) & (j1 >= 0):
                                s += _to_acc(sptr[srow + i0 * sst[2] + j0 * sst[3]
                                                  + i1 * sst[4] + j1 * sst[5]], zero)
                o = grow + x1 * gst[4] + y1 * gst[5]
                for _ in range(Cg):  # the same value for each channel of the group
                    _store(gptr, o, s)
                    o += gsc
                q1 += nt
            blk += cuda.gridDim.x

    @cuda.jit(device=True)
    def _vjp_mu_rows(sptr, sbase, sst, mptr, mbase, mst, dptr, dbase, dst, geo, zero):
        """dmu[b, ci, x, y] = sum over offsets o with (x, y) = X_o(p) of
        sum over q with X_o(q) inside of mu[b, ci, X_o(q)] * (grad_S[p, q] + grad_S[q, p]).

        One block per (b, g, four channels, tile of blockDim input positions); a thread
        owns one position (x, y) and the four channels (clamped past the group's last,
        stores dropped): each grad_S pair it loads serves four multiply-adds. Within a
        warp, the mu loads are uniform (broadcast), grad_S[q, p] is coalesced (consecutive
        p for stride 1), grad_S[p, q] walks one row per thread (each 32-byte sector serves
        8 consecutive q from L1)."""
        B, G, Cg = geo[0], geo[1], geo[2]
        H, W, Ho, Wo, kh, kw = geo[4], geo[5], geo[6], geo[7], geo[8], geo[9]
        sh, sw, ph, pw, dh, dw = geo[10], geo[11], geo[12], geo[13], geo[14], geo[15]
        HW = H * W
        tid = cuda.threadIdx.x
        nt = cuda.blockDim.x
        tiles = (HW + nt - 1) // nt
        cblocks = (Cg + 3) // 4
        msc = mst[1]
        blk = cuda.blockIdx.x
        while blk < B * G * cblocks * tiles:
            r = blk // tiles
            xy = (blk - r * tiles) * nt + tid
            bg = r // cblocks
            c_lo = (r - bg * cblocks) * 4
            b = bg // G
            g = bg - b * G
            if xy < HW:
                x = xy // W
                y = xy - x * W
                last = Cg - 1
                n = min(4, Cg - c_lo)
                c0 = g * Cg + c_lo
                o1 = min(c_lo + 1, last) - c_lo
                o2 = min(c_lo + 2, last) - c_lo
                o3 = min(c_lo + 3, last) - c_lo
                mb = mbase + b * mst[0] + c0 * msc
                srow = sbase + b * sst[0] + g * sst[1]
                a0 = a1 = a2 = a3 = zero
                for ii in range(kh):
                    i0 = _tap(x, ph, ii, dh, sh, Ho)
                    if i0 < 0:
                        continue
                    for ji in range(kw):
                        j0 = _tap(y, pw, ji, dw, sw, Wo)
                        if j0 < 0:
                            continue
                        sp = srow + i0 * sst[2] + j0 * sst[3]  # grad_S[p, :]
                        sq = srow + i0 * sst[4] + j0 * sst[5]  # grad_S[:, p]
                        for i1 in range(Ho):
                            x1 = i1 * sh + ii * dh - ph
                            if (x1 < 0) | (x1 >= H):
                                continue
                            for j1 in range(Wo):
                                y1 = j1 * sw + ji * dw - pw
                                if (y1 < 0) | (y1 >= W):
                                    continue
                                t = (_to_acc(sptr[sp + i1 * sst[4] + j1 * sst[5]], zero)
                                     + _to_acc(sptr[sq + i1 * sst[2] + j1 * sst[3]], zero))
                                m = mb + x1 * mst[2] + y1 * mst[3]
                                a0 += _to_acc(mptr[m], zero) * t
                                a1 += _to_acc(mptr[m + o1 * msc], zero) * t
                                a2 += _to_acc(mptr[m + o2 * msc], zero) * t
                                a3 += _to_acc(mptr[m + o3 * msc], zero) * t
                d = dbase + b * dst[0] + c0 * dst[1] + x * dst[2] + y * dst[3]
                _store(dptr, d, a0)
                if n > 1:
                    _store(dptr, d + dst[1], a1)
                if n > 2:
                    _store(dptr, d + 2 * dst[1], a2)
                if n > 3:
                    _store(dptr, d + 3 * dst[1], a3)
            blk += cuda.gridDim.x

    def _vjp_gamma_kernel(sptr, sbase, sst, gptr, gbase, gst, geo, zero):
        _vjp_gamma_rows(sptr, sbase, sst, gptr, gbase, gst, geo, zero)

    def _vjp_mu_kernel(sptr, sbase, sst, mptr, mbase, mst, dptr, dbase, dst, geo, zero):
        _vjp_mu_rows(sptr, sbase, sst, mptr, mbase, mst, dptr, dbase, dst, geo, zero)


# ---------------------------------------------------------------------------------------
# Host side: compilation, arrays as (pointer, base, strides), devices, streams, launch.
# ---------------------------------------------------------------------------------------

#: Element type of the pointer for each dtype name (bfloat16 as its uint16 bits).
_PTR_TYPE = {"float16": "float16", "bfloat16": "uint16", "float32": "float32",
             "float64": "float64"}

_lock = threading.Lock()
_compiled: dict = {}  # (kernel name, element types, acc, V) -> Numba's dispatcher
_streams: dict = {}  # stream handle -> the driver binding's CUstream (a non-owning wrapper)
_numba_streams: dict = {}  # stream handle -> what Numba's kernel call takes for it
_limits: dict = {}  # device id -> Limits
_plans: dict = {}  # (device id, Problem.layout_key()) -> _Plan
_held: dict = {}  # device id -> deque of (event, scratch) of generic arrays' calls (_hold)
_held_lock = threading.Lock()  # not _lock: that one is held while a kernel compiles
_drv = None  # cuda.bindings.driver, imported on first use (_driver)


def _signature(name, elems, acc):
    """Numba signature of kernel ``name``; ``elems`` are the pointers' element type names."""
    i64, A = nbt.int64, getattr(nbt, acc)
    ptr = [nbt.CPointer(getattr(nbt, e)) for e in elems]
    t6, t4, geo = nbt.UniTuple(i64, 6), nbt.UniTuple(i64, 4), nbt.UniTuple(i64, 16)
    acc_ptr = nbt.CPointer(A)
    if name == "gsum":  # T, gamma, mu
        args = (acc_ptr, ptr[0], i64, t6, i64, ptr[1], i64, t4, geo, i64, A)
    elif name in ("sbox", "sbox_walk"):  # S, T
        args = (acc_ptr, acc_ptr, geo, i64, A)
    elif name.startswith("stream"):  # out, c, S
        args = (ptr[0], i64, t6, ptr[1], i64, i64, i64, A, acc_ptr, geo, i64, i64, i64, A)
    elif name == "direct":  # out, gamma, mu, c
        args = (ptr[0], i64, t6, ptr[1], i64, t6, i64, ptr[2], i64, t4,
                ptr[3], i64, i64, i64, A, geo, i64, i64, i64, A)
    elif name == "vjp_gamma":  # grad_S, grad_gamma
        args = (ptr[0], i64, t6, ptr[1], i64, t6, geo, A)
    else:  # vjp_mu: grad_S, mu, grad_mu
        args = (ptr[0], i64, t6, ptr[1], i64, t4, ptr[2], i64, t4, geo, A)
    return nbt.void(*args)


#: The forward kernels' factories, all called as factory(V, ACC, OT): vector width, the
#: accumulation type and the element type of the first pointer (those that need none of
#: them ignore it; each is a compile-time constant of the kernel it returns).
_FACTORIES = {"gsum": "_make_gsum", "sbox": "_make_sbox", "sbox_walk": "_make_sbox_walk",
              "stream": "_make_stream", "stream_rows": "_make_stream_rows",
              "direct": "_make_direct"}


def _kernel_function(name, elems, acc, V=1):
    """The Python function of kernel ``name`` for these pointer element types, accumulation
    dtype and vector width, before Numba compiles it (also what
    tests/_compile_numba_cuda.py compiles for sm_90 without a GPU)."""
    if name in _FACTORIES:
        # OT: the element type of the first pointer (out's, for stream)
        ot = getattr(nbt, elems[0]) if elems else None
        return globals()[_FACTORIES[name]](V, getattr(nbt, acc), ot)
    return {"vjp_gamma": _vjp_gamma_kernel, "vjp_mu": _vjp_mu_kernel}[name]


def _kernel(name, elems, acc, V=1):
    """The compiled kernel ``name`` for these pointer element types, accumulation dtype and
    vector width (compiled once)."""
    key = (name, elems, acc, V)
    k = _compiled.get(key)
    if k is None:
        with _lock:
            k = _compiled.get(key)
            if k is None:
                fn = _kernel_function(name, elems, acc, V)
                if SIM:
                    k = cuda.jit(fn)
                else:
                    # An explicit signature compiles eagerly, once, for exactly these
                    # types; cache=True keeps the machine code on disk across processes.
                    k = cuda.jit(_signature(name, elems, acc), cache=True)(fn)
                _compiled[key] = k
    return k


class Limits:
    """What the launch sizes are computed from, read off one device."""

    def __init__(self, sms, threads_per_sm):
        self.sms = sms
        self.threads_per_sm = threads_per_sm

    @property
    def capacity(self):
        """Threads resident on the whole device at once."""
        return self.sms * self.threads_per_sm

    def grid(self, n_blocks, block):
        """Blocks to launch for ``n_blocks`` blocks of work (the kernels loop with the
        grid's stride beyond MAX_GRID; under the simulator, beyond one wave)."""
        if SIM:
            return max(1, min(n_blocks, self.sms * max(1, self.threads_per_sm // block)))
        return max(MIN_GRID, min(n_blocks, MAX_GRID))


def _block(n):
    """Threads per block for rows of ``n`` elements: whole warps, at most THREADS (the
    simulator, where each thread is a Python thread, gets exactly ``n``, at most THREADS)."""
    if SIM:
        return max(1, min(THREADS, n))
    return max(32, min(THREADS, -(-n // 32) * 32))


def _device_limits(dev_id):
    lim = _limits.get(dev_id)
    if lim is None:
        if SIM:
            lim = Limits(2, 2 * THREADS)
        else:
            d = cuda.get_current_device()
            lim = Limits(d.MULTIPROCESSOR_COUNT, d.MAX_THREADS_PER_MULTIPROCESSOR)
        _limits[dev_id] = lim
    return lim


def _sim_pointer(a):
    """(1-D numpy view of an array's memory, element offset of a[0, ..., 0], strides)."""
    strides = tuple(s // a.itemsize for s in a.strides)
    if a.size == 0:
        return np.zeros(1, a.dtype), 0, strides
    # Flip the axes with negative strides so that the view starts at the lowest address.
    low = a[tuple(slice(None, None, -1) if s < 0 else slice(None) for s in strides)]
    base = sum((n - 1) * -s for n, s in zip(a.shape, strides) if s < 0)
    span = sum((n - 1) * abs(s) for n, s in zip(a.shape, strides)) + 1
    flat = np.lib.stride_tricks.as_strided(low, (span,), (a.itemsize,),
                                           writeable=a.flags.writeable)
    if not a.flags.writeable:
        # The simulator copies every array argument back after a launch, which a
        # read-only input (a broadcast 0-d c) refuses: give it a copy (simulator only).
        flat = flat.copy()
    return flat, base, strides


def _dummy(ptr, elem):
    """A pointer for an absent argument (gamma None, c a number), never dereferenced.
    On the device any address will do; the simulator copies each array argument back
    after a launch, so there it must not alias a real one (out, say)."""
    return np.zeros(1, np.uint16 if elem == "uint16" else elem) if SIM else ptr


def _pointer(arr, info):
    """(pointer, base, element strides) of one array as the kernels take it."""
    if SIM:
        return _sim_pointer(arr)
    return info.ptr, 0, info.strides


def _driver():
    """cuda.bindings.driver (the cuda-python package Numba runs on), imported on first use."""
    global _drv
    if _drv is None:
        from cuda.bindings import driver

        _drv = driver
    return _drv


def _driver_stream(handle):
    """The driver binding's view of a stream handle (owns nothing, so one per handle is
    reused)."""
    st = _streams.get(handle)
    if st is None:
        _driver()
        if len(_streams) > 1024:  # streams come and go: keep the table bounded
            _streams.clear()
        st = _streams[handle] = _drv.CUstream(handle)
    return st


def _numba_stream(handle):
    """What Numba's kernel call and allocations take for the stream of raw ``handle``
    (its context current): 0 for the null handle (Numba's default stream, the legacy
    one), ``cuda.legacy_default_stream()`` and ``cuda.per_thread_default_stream()`` for
    CU_STREAM_LEGACY and CU_STREAM_PER_THREAD, else ``cuda.external_stream(handle)``.
    Numba never destroys an external stream (the object holds the handle and nothing
    else), so one object per handle serves every call; reusing it also lets Numba's
    kernel call reuse its launch configuration for a grid, block and stream."""
    st = _numba_streams.get(handle)
    if st is None:
        if handle == 0:
            st = 0
        elif handle == 1:
            st = cuda.legacy_default_stream()
        elif handle == 2:
            st = cuda.per_thread_default_stream()
        else:
            st = cuda.external_stream(handle)
        if len(_numba_streams) > 1024:  # streams come and go: keep the table bounded
            _numba_streams.clear()
        _numba_streams[handle] = st
    return st


def _launch_stream(call, dev_id):
    """(the raw handle of a call's launch stream, the raw handles of the streams to make
    wait for its launches afterwards: ``_follow``), as ``launch_streams`` picks them; the
    launch stream made to wait for the other streams its generic CUDA arrays name."""
    handle, waits, then = launch_streams(call.kind, dev_id, call.infos, call.written)
    stream = _driver_stream(handle)
    drv = _driver()
    if call.kind == "cai" and handle not in (0, 1):
        err, status = drv.cuStreamIsCapturing(stream)
        if status != drv.CUstreamCaptureStatus.CU_STREAM_CAPTURE_STATUS_NONE:
            raise BackendError(f"numba_cuda: {CAPTURED}")
    for w in waits:
        _wait(stream, w)
    return handle, then


def _wait(stream, other):
    """Make driver stream ``stream`` wait for the work queued so far on the stream of raw
    handle ``other``: an event recorded there, no host wait."""
    drv = _driver()
    err, event = drv.cuEventCreate(drv.CUevent_flags.CU_EVENT_DISABLE_TIMING)
    if err == drv.CUresult.CUDA_SUCCESS:
        err, = drv.cuEventRecord(event, _driver_stream(other))
        if err == drv.CUresult.CUDA_SUCCESS:
            err, = drv.cuStreamWaitEvent(stream, event, 0)
        drv.cuEventDestroy(event)  # released once the wait is done with it
    if err != drv.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"numba_cuda: waiting for stream {other:#x} failed: {err!r}")


def _follow(handle, then):
    """Make the streams of raw handles ``then`` wait for the launches queued on stream
    ``handle``: the other streams a call writes arrays for (``launch_streams``)."""
    for t in then:
        _wait(_driver_stream(t), handle)


def _workspace(kind, dev, n, acc, handle, stream):
    """Scratch for S and T, ``n`` elements of ``acc`` on device ``dev``, from the arrays'
    own library, on the launch stream (raw ``handle``; ``stream``, Numba's object for
    it): (owner, address). torch's caching allocator and CuPy's pool order a freed
    block's reuse on the stream it was taken on, so their owner is dropped once the
    launches are queued; a Numba device array is held until they have run (_hold)."""
    n = max(n, 1)
    if kind == "torch":
        return torch_scratch(n * ITEMSIZE[acc], dev, handle)
    if kind == "cupy":
        cupy = sys.modules["cupy"]
        with cupy.cuda.Device(dev):
            t = cupy.empty(n, dtype=acc)
        return t, t.data.ptr
    t = cuda.device_array(n, dtype=acc, stream=stream)
    return t, t.__cuda_array_interface__["data"][0]


def _hold(dev, owner, stream):
    """Keep ``owner`` (a Numba device array of scratch on device ``dev``, its context
    current) until the work queued on ``stream`` so far has run: an event recorded
    there after the call's launches (``cuda.event``, ``Event.record``), with the owner
    beside it. Numba's allocations go through its memory manager, which may be a
    plugin (RMM's): the plugin interface has no stream, so a plugin may put a freed
    block back into its pool on a stream of its own, unordered with the launch stream,
    and give it out again while the kernels still use it. Nothing waits: _release drops
    the owners whose events have completed."""
    event = cuda.event(timing=False)
    event.record(stream)
    with _held_lock:
        held = _held.get(dev)
        if held is None:
            held = _held[dev] = collections.deque()
        held.append((event, owner))


def _release(dev):
    """Drop the scratch owners of device ``dev`` (its context current) whose calls'
    kernels have run, oldest first, up to the first whose event has not completed
    (``Event.query``: no wait; those behind it go at a later call)."""
    held = _held.get(dev)
    if not held:
        return
    done = []
    with _held_lock:
        while held and held[0][0].query():
            done.append(held.popleft())
    del done  # freed here, outside the lock


@atexit.register
def _release_all():  # while Numba and its memory manager are whole
    _held.clear()


class _Slot:
    """A launch argument that changes from call to call: an address, or the number c."""

    __slots__ = ("i",)

    def __init__(self, i):
        self.i = i


#: The per-call arguments of a plan's launches, in the order _run gives their values:
#: out, gamma (mu's address when gamma is None: never read), mu, c (out's address when c
#: is a number: never read), S, T, and the number c.
_OUT, _GAMMA, _MU, _C, _S, _T, _CVAL = (_Slot(i) for i in range(7))

class _Launch:
    """One kernel launch of a plan: the kernel, its grid and block, and its arguments
    with _Slot markers where a call's addresses (and the number c) go."""

    __slots__ = ("name", "elems", "acc", "V", "grid", "block", "args", "kernel")

    def __init__(self, name, elems, acc, V, grid, block, args):
        self.name, self.elems, self.acc, self.V = name, elems, acc, V
        self.grid, self.block, self.args = grid, block, args
        self.kernel = None

    def bind(self):
        """Compile the kernel (once, not mid-call)."""
        self.kernel = _kernel(self.name, self.elems, self.acc, self.V)

    def __call__(self, stream, values):
        """Launch on ``stream`` (what Numba's kernel call takes: _numba_stream) with
        ``values`` for the _Slot arguments, through Numba's kernel call: the kernel has
        one signature, so the arguments go in without type resolution."""
        args = tuple([values[a.i] if type(a) is _Slot else a for a in self.args])
        if SIM:
            self.kernel[self.grid, self.block](*args)
        else:
            self.kernel[self.grid, self.block, stream, 0](*args)


def _launch_once(name, elems, acc, grid, block, stream, args):
    """Launch a kernel whose arguments are all known (no _Slot): the backward's, which
    has no per-signature plan (it is not on anyone's hot path)."""
    launch = _Launch(name, elems, acc, 1, grid, block, args)
    launch.bind()
    launch(stream, ())


class _Plan:
    """The launches of one call signature and the scratch they need: ``scratch``
    elements of the accumulation type, S first (padded to 256 bytes), T ``t_offset``
    bytes in (no scratch for the one-launch path)."""

    __slots__ = ("launches", "scratch", "t_offset")

    def __init__(self, launches, scratch=0, t_offset=0):
        self.launches, self.scratch, self.t_offset = launches, scratch, t_offset


_ready: dict = {}  # device id -> handle of the context its kernels run in (Numba's)


def _current_context():
    """Handle of the CUDA context current on this thread (0: none)."""
    driver = _driver()
    err, ctx = driver.cuCtxGetCurrent()
    return int(ctx) if err == driver.CUresult.CUDA_SUCCESS else -1


def _direct(p):
    """Whether the one-launch kernel takes this problem: small ones (launches cost more
    than the arithmetic), and large strides, where T would hold mostly positions no
    output reads (not when T is no larger than S, as for 1x1 kernels)."""
    HW, HoWo = p.H * p.W, p.Ho * p.Wo
    terms = p.B * p.G * HoWo * HoWo * max(p.Ci // p.G, 1) * p.kh * p.kw
    sparse_t = HW * HW > HoWo * HoWo and p.kh * p.kw * HoWo * HoWo <= DIRECT_RATIO * HW * HW
    return terms <= DIRECT_TERMS or sparse_t


def _stream_kernel(p, ost, nseg, tiles, n_tiles, pos):
    """The out update's variant (_make_stream's MODE): "stream_rows" for segments that
    are out[b, c0]'s contiguous (i1, j1) planes at one stride along (i0, j0), where every
    index a thread divides fits in 32 bits (its positions reach tiles * THREADS * pos
    vectors); else "stream". (One segment, a diagonal layout's flat axpy, keeps
    the general kernel: the lean one was slower there, big-f32's update 3308 -> 3362 µs,
    H200, 2026-11-30, ab52.py.)"""
    if (STREAM_ROWS and nseg > 1 and max(n_tiles, tiles * THREADS * pos) < 2**31
            and contiguous(ost[4:], (p.Ho, p.Wo)) and ost[2] == p.Wo * ost[3]):
        return "stream_rows"
    return "stream"


def _plan(p, dev_id):
    """The launches of one call signature: kernels, launch sizes and every argument but
    the addresses (and the number c), which _run fills in per call (_Slot markers)."""
    acc = p.acc
    zero = np.dtype(acc).type(0) if SIM else 0.0
    lim = _device_limits(dev_id)
    out_t, mu_t = _PTR_TYPE[p.out_info.dtype], _PTR_TYPE[p.mu_info.dtype]
    _, obase, ost = _pointer(p.out, p.out_info)  # base and strides (addresses: per call)
    ost = diag_strides(ost, p.full_out)
    _, mbase, mst = _pointer(p.mu, p.mu_info)
    if p.gamma is None:  # never read: any valid address of a compiled type will do
        gamma_t, has_g, gbase, gst = mu_t, 0, mbase, (0,) * 6
    else:
        gamma_t, has_g = _PTR_TYPE[p.gamma_info.dtype], 1
        _, gbase, gst = _pointer(p.gamma, p.gamma_info)
        gst = diag_strides(gst, p.full_gamma)
    if p.c_info is None:  # a number: the pointer is a dummy that is never read
        c_t, has_c, cbase, cst = out_t, 0, 0, 0
    else:
        c_t, has_c = _PTR_TYPE[p.c_info.dtype], 1
        _, cbase, cst = _pointer(p.c, p.c_info)
        cst = cst[0] if cst else 0  # a 0-d c broadcasts: stride 0
    geo = (p.B, p.G, p.Ci // p.G, p.Co // p.G, p.H, p.W, p.Ho, p.Wo, p.kh, p.kw,
           p.sh, p.sw, p.ph, p.pw, p.dh, p.dw)
    HW, Cog, HoWo = p.H * p.W, p.Co // p.G, p.Ho * p.Wo
    launches = []

    def add(name, elems, V, n_blocks, args):
        launches.append(_Launch(name, elems, acc, V, lim.grid(n_blocks, THREADS), THREADS,
                                args))

    if _direct(p):
        # Split each group's output channels into chunks when one thread per element
        # of S would leave the device under-filled; every chunk recomputes S.
        items = p.B * p.G * HoWo * HoWo
        chunk = -(-Cog // max(1, min(Cog, -(-lim.capacity // items))))
        n = items * -(-Cog // chunk)
        add("direct", (out_t, gamma_t, mu_t, c_t), 1, -(-n // THREADS),
            (_OUT, obase, ost, _GAMMA, gbase, gst, has_g, _MU, mbase, mst,
             _C, cbase, cst, has_c, _CVAL, geo, n // items, chunk, n, zero))
        plan = _Plan(launches)
    else:
        # Three launches through one scratch buffer: S (padded to 256 bytes), then T.
        abytes = ITEMSIZE[acc]
        n_s = p.B * p.G * HoWo * HoWo
        n_t = p.B * p.G * HW * HW
        s_pad = -(-n_s * abytes // 256) * 256 // abytes
        if n_t:
            if p.gamma is None:
                V = vector_width(ITEMSIZE[p.mu_info.dtype], HW, mst[2:], (p.H, p.W), mst[:2],
                                 p.mu_info.ptr)
            else:
                V = vector_width(ITEMSIZE[p.gamma_info.dtype], HW, gst[4:], (p.H, p.W), gst[:4],
                                 p.gamma_info.ptr,
                                 ((ITEMSIZE[p.mu_info.dtype], mst[2:], mst[:2], p.mu_info.ptr),))
            n = n_t // V
            add("gsum", (gamma_t, mu_t), V, -(-n // THREADS),
                (_T, _GAMMA, gbase, gst, has_g, _MU, mbase, mst, geo, n, zero))
        if SBOX_WALK and p.sh == 1 and p.dh == 1 and p.kh <= WALK_KMAX:
            n = p.B * p.G * (2 * p.Ho - 1) * p.Wo * p.Wo
            kh = 3 if p.kh == 3 else 0  # compiled for the usual shapes, else for any
            if kh == 3 and p.kw == 3 and WALK_KW:
                kh = 33
            add("sbox_walk", (), kh, -(-n // THREADS), (_S, _T, geo, n, zero))
        else:
            add("sbox", (), 1, -(-n_s // THREADS), (_S, _T, geo, n_s, zero))
        # out[b, c0] as segments contiguous in S[b, g]: the whole (i0, j0, i1, j1) plane
        # when it is contiguous in out (a flat axpy), else one segment per (i0, j0).
        osize = ITEMSIZE[p.out_info.dtype]
        if contiguous(ost[2:], (p.Ho, p.Wo, p.Ho, p.Wo)):
            nseg, seg_len = 1, HoWo * HoWo
            V = vector_width(osize, seg_len, ost[2:], (p.Ho, p.Wo, p.Ho, p.Wo), ost[:2],
                             p.out_info.ptr)
        else:
            nseg, seg_len = HoWo, HoWo
            V = vector_width(osize, HoWo, ost[4:], (p.Ho, p.Wo), ost[:4], p.out_info.ptr)
        pos, ch = _stream_shape(osize, acc)
        tiles = -(-nseg * (seg_len // V) // (THREADS * pos))
        n_tiles = p.B * p.G * -(-Cog // ch) * tiles
        add(_stream_kernel(p, ost, nseg, tiles, n_tiles, pos), (out_t, c_t), V, n_tiles,
            (_OUT, obase, ost, _C, cbase, cst, has_c, _CVAL, _S, geo, nseg, seg_len, tiles,
             zero))
        plan = _Plan(launches, s_pad + n_t, s_pad * abytes)
    for launch in launches:
        launch.bind()
    return plan


def _launch_plan(plan, kind, handle, dev_id, acc, optr, gptr, mptr, cptr, c_value):
    """Launch a plan on the stream of raw ``handle`` (the arrays' library's current stream
    for torch, ``_launch_stream`` for any call) on ``dev_id`` (its context current):
    addresses of out, gamma, mu and c (0 for an absent gamma or a number c), and c_value,
    the number c. Scratch from the library (_workspace)."""
    stream = _numba_stream(handle)
    buf, sptr, tptr = None, 0, 0
    cai = kind == "cai"
    if plan.scratch:
        if cai:
            _release(dev_id)
        buf, sptr = _workspace(kind, dev_id, plan.scratch, acc, handle, stream)
        tptr = sptr + plan.t_offset
    # An absent gamma or a number c: any valid address (never read) of the right kind.
    values = (optr, gptr or mptr, mptr, cptr or optr, sptr, tptr, float(c_value))
    try:
        for launch in plan.launches:
            launch(stream, values)
    finally:
        if buf is not None and cai:  # also when a later launch failed: some are queued
            _hold(dev_id, buf, stream)
    del buf  # torch and CuPy: back to the stream's pool, behind the launches


class NumbaCudaBackend(Backend):
    name = "numba_cuda"
    device = "cpu" if SIM else "cuda"
    dtypes = frozenset({"float16", "bfloat16", "float32", "float64"})

    def _probe(self):
        if _IMPORT_ERROR is not None:
            return (f"numba-cuda is not installed or cannot load ({_IMPORT_ERROR}); "
                    "pip install 'numba-cuda[cu13]'")
        if SIM:
            return None
        try:
            if not cuda.is_available():
                return "no CUDA device (numba.cuda.is_available() is False)"
            # numba-cuda 0.30 registers np.row_stack when it first compiles, which numpy
            # 2.5 removed: say so here rather than fail inside the first call.
            import numba.cuda.np.arrayobj  # noqa: F401
        except Exception as exc:
            return f"numba-cuda cannot compile here (numpy {np.__version__}): {exc!r}"
        return None

    @staticmethod
    def _on_device(run, call):
        """run(call, device id) on the call's device (None under the simulator); its result."""
        if SIM:
            return run(call, None)
        dev = call.device[1]
        if dev is None:  # a CUDA array of unknown device: Numba's current one
            return run(call, cuda.get_current_device().id)
        ctx = _ready.get(dev)
        if ctx is not None and ctx == _current_context():
            # The device's context is current on this thread already (the arrays' library
            # made it so): Numba's context push and pop, several microseconds of the toy's
            # budget, are not needed for a launch.
            return run(call, dev)
        with cuda.gpus[dev]:
            result = run(call, dev)
            _ready[dev] = _current_context()
        return result

    def accumulate(self, p) -> None:
        self._on_device(self._run, p)

    @staticmethod
    def _plan_of(p, dev_id):
        key = (dev_id, p.layout_key())  # everything but the addresses
        plan = _plans.get(key)
        if plan is None:
            plan = _plan(p, dev_id)
            if len(_plans) > 512:  # many shapes: start over rather than grow
                _plans.clear()
            _plans[key] = plan
        return plan

    def _run(self, p, dev_id):
        plan = self._plan_of(p, dev_id)
        if SIM:
            acc = p.acc
            optr, mptr = _sim_pointer(p.out)[0], _sim_pointer(p.mu)[0]
            gptr = (_dummy(mptr, _PTR_TYPE[p.mu_info.dtype]) if p.gamma is None
                    else _sim_pointer(p.gamma)[0])
            cptr = (_dummy(optr, _PTR_TYPE[p.out_info.dtype]) if p.c is None
                    else _sim_pointer(p.c)[0])
            buf, sptr, tptr = None, 0, 0
            if plan.scratch:
                buf = np.empty(plan.scratch, acc)
                sptr, tptr = buf, buf[plan.t_offset // ITEMSIZE[acc]:]
            values = (optr, gptr, mptr, cptr, sptr, tptr, np.dtype(acc).type(p.c_value))
            for launch in plan.launches:
                launch(None, values)
            return
        handle, _ = _launch_stream(p, dev_id)  # (the forward writes one array: none to follow)
        _launch_plan(plan, p.kind, handle, dev_id, p.acc,
                     p.out_info.ptr, 0 if p.gamma is None else p.gamma_info.ptr,
                     p.mu_info.ptr, 0 if p.c is None else p.c_info.ptr, p.c_value)

    def bind(self, p):
        """The launcher of p's signature for the front end's fast path (Backend.bind): the
        plan is found once; a call checks the context, then reads the stream, takes scratch
        and launches (_launch_plan). The fast path binds torch calls only."""
        if SIM:  # the simulator takes numpy views: a Problem like p with the call's arrays
            # (the launcher keeps no array of this call alive)
            return functools.partial(self._run_sim_like, dataclasses.replace(
                p, out=None, gamma=None, mu=None, c=None))
        if p.device[1] is None or p.kind != "torch":
            return None
        dev_id, acc = p.device[1], p.acc
        plan = self._on_device(self._plan_of, p)  # its kernels compiled
        ctx = _ready[dev_id]  # the device's context, where they run (_on_device)

        def run(out, gamma, mu, c, optr, gptr, mptr, cptr, c_value):
            # _on_device's context check, inlined. The context current on the thread is
            # compared itself: a cheaper test (torch's current device and a per-thread
            # "ready" set, 2026-11-30) failed on the H200 x2, where a thread that had
            # launched was later left with no context current (CUDA_ERROR_INVALID_CONTEXT).
            handle = current_stream("torch", dev_id)
            if _current_context() == ctx:
                _launch_plan(plan, "torch", handle, dev_id, acc, optr, gptr, mptr, cptr,
                             c_value)
                return
            with cuda.gpus[dev_id]:
                _launch_plan(plan, "torch", handle, dev_id, acc, optr, gptr, mptr, cptr,
                             c_value)

        return run

    def _run_sim_like(self, p, out, gamma, mu, c, optr, gptr, mptr, cptr, c_value):
        c_view = None
        if cptr:
            c_view = host_view(c, p.c_info.dtype)
            if c_view.ndim == 0:
                c_view = np.broadcast_to(c_view, (p.Co,))
        self._run(dataclasses.replace(
            p, out=host_view(out, p.out_info.dtype), mu=host_view(mu, p.mu_info.dtype),
            gamma=None if gamma is None else host_view(gamma, p.gamma_info.dtype),
            c=c_view, c_value=c_value), None)

    def patch_moment_vjp(self, a) -> None:
        """The backward (docs/autograd.md, docs/numba_cuda.md "Backward"): one launch for
        the gamma gradient, one for the mu gradient, each only when wanted, on the
        arrays' library's current stream; no scratch, no synchronisation."""
        self._on_device(self._run_vjp, a)

    def _run_vjp(self, a, dev_id):
        acc = a.acc
        zero = np.dtype(acc).type(0) if SIM else 0.0
        lim = _device_limits(dev_id)
        handle, then = (None, ()) if SIM else _launch_stream(a, dev_id)
        stream = None if SIM else _numba_stream(handle)
        G, Cg, HW = a.G, a.Ci // a.G, a.H * a.W
        geo = (a.B, G, Cg, 0, a.H, a.W, a.Ho, a.Wo, a.kh, a.kw,
               a.sh, a.sw, a.ph, a.pw, a.dh, a.dw)
        s_t = _PTR_TYPE[a.grad_S_info.dtype]
        sptr, sbase, sst = _pointer(a.grad_S, a.grad_S_info)
        if a.grad_gamma is not None:
            g_t = _PTR_TYPE[a.grad_gamma_info.dtype]
            gptr, gbase, gst = _pointer(a.grad_gamma, a.grad_gamma_info)
            gst = diag_strides(gst, a.full_gamma)
            block = _block(HW)
            _launch_once("vjp_gamma", (s_t, g_t), acc, lim.grid(a.B * G * HW, block), block,
                         stream, (sptr, sbase, sst, gptr, gbase, gst, geo, zero))
        if a.grad_mu is not None:
            m_t, d_t = _PTR_TYPE[a.mu_info.dtype], _PTR_TYPE[a.grad_mu_info.dtype]
            mptr, mbase, mst = _pointer(a.mu, a.mu_info)
            dptr, dbase, dst = _pointer(a.grad_mu, a.grad_mu_info)
            block = _block(HW)
            n_blocks = a.B * G * -(-Cg // 4) * -(-HW // block)
            _launch_once("vjp_mu", (s_t, m_t, d_t), acc, lim.grid(n_blocks, block), block,
                         stream, (sptr, sbase, sst, mptr, mbase, mst, dptr, dbase, dst, geo,
                                  zero))
        _follow(handle, then)


backend = NumbaCudaBackend()
