"""``numba_cuda``: Numba CUDA kernels, on the design and planner of the ``cupy`` backend.

Owns the ``numba.cuda`` kernels below, their compilation (once per combination of pointer
element types, accumulation dtype and vector width, with an explicit signature, cached on
disk by Numba), the launch plan of a call signature and the launches themselves, on the
arrays' device and their library's current stream: torch's for torch tensors, CuPy's for
CuPy arrays; for other ``__cuda_array_interface__`` objects the stream ``out`` names, after
the streams the inputs name (``convcov._arrays.launch_streams``).

Design (docs/numba_cuda.md; cupy's ``cc_walk`` and ``cc_stream``, docs/cupy.md), the
sizes from ``convcov.backends._plan``:

* ``walk`` (``_plan.walk``): a block takes one (b, g), one diagonal ``i1 - i0`` of S's
  planes ``S[b, g, i0, :, i1, :]`` (or a segment of it) and one tile of each plane. It
  sums the planes of gamma's channel diagonal + mu (x) mu over the group that its step
  needs into dynamic shared memory (each element of gamma it needs read once; a thread an
  element's whole channel sum: Numba's CUDA simulator, which CI runs, has no warp
  shuffles, so cupy's lanes sharing a sum, ``_plan.Walk.nch``, are not used), row-filters
  them into a ring of planes of T there, forms each plane of S as kh reads of the ring,
  and adds ``c[c0] * S`` into out for every output channel of the group, or stores S.
* ``stream``: where many output channels share S (``_plan.STREAM_BYTES``) and out's
  ``(i1, j1)`` rows are contiguous, ``walk`` stores S and this kernel streams
  ``out[b, c0] += c[c0] * S[b, g]`` in address order.
* ``plane`` (``_plan.plane``, cupy's ``cc_plane``): where a plane of the input fits a warp
  and ``c * S`` goes straight into out, a block of one warp walks a wrapped diagonal
  alone (the planes ``i1 = (i0 + k) mod Ho`` of one ``(b, g)``): the same sums, ``Q_u``
  in registers, its row filter through the block's own plane of shared memory, and the
  ring of ``T_u`` in registers (its extent compiled in).

Terms with a position in the padding are absent (SPEC section 1): shared memory holds
zeros there, never a product, so NaN/Inf in ``mu`` never meets a padded zero. Index
arithmetic is 64-bit (divisions in 32 bits where the operands fit). Sums run in
``Problem.acc``; results are rounded once into out's dtype (a float64 sum reaches
bfloat16 through round-to-odd float32). Numba has no syntax for 16-byte accesses or cache
qualifiers: ``_LDV``/``_STV`` are intrinsics (inline PTX).

Arrays travel as raw device pointers plus element strides (``CPointer`` arguments), so any
stride, torch's bfloat16 (as uint16 bits) and any library work alike. A signature's
launches are planned once (``_make_plan``); a call fills in its addresses and launches
each kernel with Numba's public kernel call on ``cuda.external_stream(handle)``. Scratch
(S, where it goes through memory) comes from the arrays' library on the launch stream
(torch's allocator, CuPy's pool); generic CUDA arrays take a Numba device array, kept
beside an event until its kernels have run (``_hold``), since a memory-manager plugin may
reuse a freed block on a stream of its own. The backward (``patch_moment_vjp``,
docs/autograd.md) is two gathers without scratch.

Under Numba's CUDA simulator (``NUMBA_ENABLE_CUDASIM=1``) the same kernels run on the CPU
on numpy host views (``device = "cpu"``, never chosen automatically), with small blocks.

Must not: copy ``out`` or ``gamma``; synchronise the device or wait on the host; import
numba.cuda before the backend is used (``import convcov`` stays GPU-free).
"""

from __future__ import annotations

import atexit
import collections
import dataclasses
import functools
import sys
import threading

import numpy as np

from .._arrays import (CAPTURED, ITEMSIZE, contiguous, current_stream, diag_strides,
                       host_view, launch_streams, torch_scratch, vector_width)
from .._errors import BackendError
from .._registry import Backend
from . import _plan

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

#: Numba's kernel call warns (NumbaPerformanceWarning) below this many blocks; small
#: grids are padded to it (the extra blocks find no work and exit).
MIN_BLOCKS = 128

# ---------------------------------------------------------------------------------------
# Element access: bfloat16 travels as uint16 bits; loads convert to the accumulation type
# (that of ``zero``), stores round once into the element type.
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
            # float64 -> float32 was inexact: make it round-to-odd (truncate, set the last
            # bit), so that the rounding to bfloat16 below is the only one that counts.
            if abs(f) > abs(v):
                u -= 1
            u |= 1
        return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) & 0xFFFF

    @cuda.jit(device=True)
    def _div(a, b):
        """a // b for a >= 0, b > 0: a 32-bit division when both fit (a 64-bit one is a
        long emulated sequence on the GPU)."""
        if (a | b) >> 32 == 0:
            return numba.int64(numba.uint32(a) // numba.uint32(b))
        return a // b

    if SIM:
        def _to_acc(v, zero):
            if isinstance(v, np.uint16):
                return type(zero)(_bf16_value(v))
            return type(zero)(v)

        def _store(ptr, i, v):
            ptr[i] = numba.uint16(_bf16_bits(v)) if ptr.dtype == np.uint16 else v

        def _to_elem(ptr, v):
            return numba.uint16(_bf16_bits(v)) if ptr.dtype == np.uint16 else v
    else:
        from numba.cuda.extending import overload

        def _to_acc(v, zero):  # typed below, per element type, at compile time
            raise NotImplementedError

        def _store(ptr, i, v):
            raise NotImplementedError

        def _to_elem(ptr, v):  # v as ptr's element (bfloat16: its bits)
            raise NotImplementedError

        @overload(_to_acc, target="cuda")
        def _to_acc_typed(v, zero):
            # A conversion, not ``zero + v``: that would cost an add a load.
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
# Vector loads and stores: ``_LDV[n, hint](ptr, i)`` returns ptr[i : i + n] as a tuple,
# ``_STV[n, hint](ptr, i, arr, k)`` stores arr[k : k + n] (a local array of ptr's element
# type); inline PTX, at most 16 bytes an instruction (16-bit elements in 32-bit words).
# ``hint``: "cs" evict-first (gamma and out, touched once), "nc" the read-only path (mu,
# re-read from the caches), "" none (S: stream's loads, where ptxas sank .nc loads past
# the stores into their branches, which left one vector of four not in flight; walk_s's
# stores, re-read by stream from L2). Loads are volatile
# asm: LLVM must not sink them into the branch of their first use either. The caller
# guarantees min(16, n * itemsize)-byte alignment (convcov._arrays.vector_width). Under
# the simulator: plain indexing.
# ---------------------------------------------------------------------------------------
if _IMPORT_ERROR is None:
    if SIM:
        def _make_ldv(n, hint):
            def ldv(ptr, i):
                return tuple(ptr[i + k] for k in range(n))
            return ldv

        def _make_stv(n, hint):
            def stv(ptr, i, arr, k):
                for e in range(n):
                    ptr[i + e] = arr[k + e]
            return stv
    else:
        from llvmlite import ir
        from numba.cuda.extending import intrinsic

        _I32, _I64 = ir.IntType(32), ir.IntType(64)

        def _regs(context, elem, n):
            """(register type, count, PTX type, asm constraint) of n elements."""
            size = context.get_abi_sizeof(context.get_value_type(elem))
            if size == 2:
                if n >= 2:
                    return _I32, n // 2, "b32", "r"
                return ir.IntType(16), 1, "b16", "h"
            return context.get_value_type(elem), n, f"f{8 * size}", "f" if size == 4 else "d"

        def _ptx(op, hint, m, ptx_t):
            return ".".join(filter(None, (op, "global", hint, f"v{m}" if m > 1 else "", ptx_t)))

        def _chunks(context, rt, count):
            per = max(1, 16 // context.get_abi_sizeof(rt))
            return [(first, min(per, count - first)) for first in range(0, count, per)]

        def _address(builder, p, idx, rt, first):
            addr = builder.gep(builder.bitcast(builder.gep(p, [idx]), rt.as_pointer()),
                               [ir.Constant(_I64, first)])
            return builder.ptrtoint(addr, _I64)

        def _make_ldv(n, hint):
            @intrinsic
            def ldv(typingctx, ptr, i):
                sig = nbt.UniTuple(ptr.dtype, n)(ptr, i)

                def codegen(context, builder, sig, args):
                    lt = context.get_value_type(sig.args[0].dtype)
                    rt, count, ptx_t, letter = _regs(context, sig.args[0].dtype, n)
                    regs = []
                    for first, m in _chunks(context, rt, count):
                        ty = rt if m == 1 else ir.LiteralStructType([rt] * m)
                        regs_ = ", ".join(f"${k}" for k in range(m))
                        code = ("{ .reg .u64 a; cvta.to.global.u64 a, $%d; %s %s, [a]; }"
                                % (m, _ptx("ld", hint, m, ptx_t),
                                   regs_ if m == 1 else "{" + regs_ + "}"))
                        r = builder.asm(ir.FunctionType(ty, [_I64]), code,
                                        ",".join(["=" + letter] * m) + ",l",
                                        [_address(builder, args[0], args[1], rt, first)],
                                        side_effect=True)
                        regs += [r] if m == 1 else [builder.extract_value(r, k) for k in range(m)]
                    if rt == _I32 and lt != _I32:  # words of two 16-bit elements, low first
                        vals = [builder.bitcast(builder.trunc(builder.lshr(
                                    w, ir.Constant(_I32, s)), ir.IntType(16)), lt)
                                for w in regs for s in (0, 16)]
                    else:
                        vals = [builder.bitcast(r, lt) for r in regs]
                    return context.make_tuple(builder, sig.return_type, vals)

                return sig, codegen
            return ldv

        def _make_stv(n, hint):
            @intrinsic
            def stv(typingctx, ptr, i, arr, k):
                if arr.dtype != ptr.dtype:
                    return None

                def codegen(context, builder, sig, args):
                    p, idx, a, start = args
                    data = context.make_array(sig.args[2])(context, builder, a).data
                    vals = [builder.load(builder.gep(
                                data, [builder.add(start, ir.Constant(start.type, e))]))
                            for e in range(n)]
                    rt, count, ptx_t, letter = _regs(context, sig.args[0].dtype, n)
                    if rt == _I32 and vals[0].type != _I32:  # pack 16-bit pairs into words
                        i16 = ir.IntType(16)
                        regs = [builder.or_(
                                    builder.zext(builder.bitcast(vals[2 * w], i16), _I32),
                                    builder.shl(builder.zext(builder.bitcast(
                                        vals[2 * w + 1], i16), _I32), ir.Constant(_I32, 16)))
                                for w in range(count)]
                    else:
                        regs = [builder.bitcast(v, rt) for v in vals]
                    for first, m in _chunks(context, rt, count):
                        regs_ = ", ".join(f"${1 + k}" for k in range(m))
                        code = ("{ .reg .u64 a; cvta.to.global.u64 a, $0; %s [a], %s; }"
                                % (_ptx("st", hint, m, ptx_t),
                                   regs_ if m == 1 else "{" + regs_ + "}"))
                        builder.asm(ir.FunctionType(ir.VoidType(), [_I64] + [rt] * m), code,
                                    "l," + ",".join([letter] * m) + ",~{memory}",
                                    [_address(builder, p, idx, rt, first)]
                                    + regs[first:first + m], side_effect=True)
                    return context.get_dummy_value()

                return nbt.void(ptr, i, arr, k), codegen
            return stv

    _LDV = {(n, h): _make_ldv(n, h) for n in (1, 2, 4, 8, 16) for h in ("", "cs", "nc")}
    _STV = {(n, h): _make_stv(n, h) for n in (1, 2, 4, 8, 16) for h in ("", "cs")}

# ---------------------------------------------------------------------------------------
# The forward kernels (cupy's SOURCE: cc_walk, cc_stream). Index names follow SPEC section
# 1. An array is (pointer, base, element strides): element [i, j, ...] is
# ptr[base + i*s0 + j*s1 + ...]; out's and gamma's channel stride is the channel-diagonal's.
# geo = (B, G, Cg, Cog, H, W, Ho, Wo, kh, kw, sh, sw, ph, pw, dh, dw); ``zero`` is 0 in the
# accumulation type (it types the sums). Each kernel comes from a factory whose arguments
# (vector widths, accumulation type ACC, out's element type OT, STORE) are compile-time
# constants, so ``for e in range(V)`` over a local array unrolls into registers.
# ---------------------------------------------------------------------------------------
if _IMPORT_ERROR is None:

    _i32 = numba.int32

    @cuda.jit(device=True)
    def _items(nb, nc, tid, nthr):
        """The first item (a, b, c) of an (any) x nb x nc space that thread ``tid`` of
        ``nthr`` takes, and the step (da, db, dc) to its next, every nthr-th (cupy's Items):
        a thread walks its items with _next, no division per item."""
        n = nb * nc
        a = _div(tid, n)
        b = _div(tid - a * n, nc)
        da = _div(nthr, n)
        db = _div(nthr - da * n, nc)
        return a, b, tid - a * n - b * nc, da, db, nthr - da * n - db * nc

    @cuda.jit(device=True)
    def _next(a, b, c, da, db, dc, nb, nc):
        """The item after (a, b, c) of _items' walk."""
        c += dc
        if c >= nc:
            c -= nc
            b += 1
        b += db
        if b >= nb:
            b -= nb
            a += 1
        return a + da, b, c

    @cuda.jit(device=True)
    def _wanted(u, ulo, uhi, sh, reach):
        """Whether the walk's plane u of Q is inside the input (x0 and x1) and read by some
        plane of S (its residue modulo sh is one ``reach`` has; strides past 64: all)."""
        return u >= ulo and u < uhi and (sh > 64 or ((reach >> (u % sh)) & 1) != 0)

    @cuda.jit(device=True)
    def _c_of(cptr, cbase, cst, has_c, cval, c0, zero):
        """c of output channel c0 in the accumulation type (cval: c as a number), as
        cupy's c_of."""
        return _to_acc(cptr[cbase + c0 * cst], zero) if has_c else cval

    def _make_terms(K, VG, ACC):
        """Device function: add K channels' terms of one cell of Q (VG consecutive y1) into
        ``s``: gamma's (has_g), then mu (x) mu's, each array's loads issued before its first
        sum (a warp issues in order)."""
        ldg, ldm, ld1, KV = _LDV[VG, "cs"], _LDV[VG, "nc"], _LDV[1, "nc"], K * VG

        @cuda.jit(device=True)
        def terms(s, gptr, og, gsc, has_g, mptr, om0, om1, msc, zero):
            if has_g:
                gv = cuda.local.array(KV, ACC)
                for k in range(K):
                    y = ldg(gptr, og + k * gsc)
                    for e in range(VG):
                        gv[k * VG + e] = _to_acc(y[e], zero)
                for k in range(K):
                    for e in range(VG):
                        s[e] += gv[k * VG + e]
            m0 = cuda.local.array(K, ACC)
            m1 = cuda.local.array(KV, ACC)
            for k in range(K):
                m0[k] = _to_acc(ld1(mptr, om0 + k * msc)[0], zero)
                y = ldm(mptr, om1 + k * msc)
                for e in range(VG):
                    m1[k * VG + e] = _to_acc(y[e], zero)
            for k in range(K):
                for e in range(VG):
                    s[e] += m0[k] * m1[k * VG + e]

        return terms

    def _make_channel_sum(K, VG, ACC):
        """Device function: add the Cg channels' terms of one cell of Q (VG consecutive y1)
        into ``s`` (_make_terms), K channels' loads in flight a pass, then one at a time."""
        terms_k, terms_1 = _make_terms(K, VG, ACC), _make_terms(1, VG, ACC)

        @cuda.jit(device=True)
        def channel_sum(s, gptr, og, gsc, has_g, mptr, om0, om1, msc, Cg, zero):
            ci = 0
            while ci + K <= Cg:
                terms_k(s, gptr, og + ci * gsc, gsc, has_g, mptr, om0 + ci * msc,
                        om1 + ci * msc, msc, zero)
                ci += K
            while ci < Cg:
                terms_1(s, gptr, og + ci * gsc, gsc, has_g, mptr, om0 + ci * msc,
                        om1 + ci * msc, msc, zero)
                ci += 1

        return channel_sum

    def _make_walk(V, VG, STORE, ACC, OT):
        """cupy's cc_walk (sizes: ``_plan.walk``, ``wk``). A block takes one (b, g), one
        diagonal di = i1 - i0 of S's planes S[b, g, i0, :, i1, :] (or a segment of it: the
        planes t in [t_first, t_end), at i0 = max(0, -di) + t, i1 = i0 + di) and one tile
        of each plane (j0 in [J0, J0 + tj0), j1 in [J1, J1 + tj1)). With x0 = xs + u and
        x1 = x0 + di*sh,
          Q_u[y0, y1] = sum over ci of the group of gamma[b, ci, x0, y0, (ci,) x1, y1]
                                                   + mu[b, ci, x0, y0] * mu[b, ci, x1, y1],
          T_u[j0, j1] = sum over ji of Q_u[j0*sw + ji*dw - pw, j1*sw + ji*dw - pw],
          S_t         = sum over ii of T_u, u = (t - t_first)*sh + ii*dh (x0, x1 inside).
        The block walks its segment R planes of S a step. The planes Q_u that a step reads
        first are summed from gamma and mu into dynamic shared memory, nq at a time (each
        element of gamma the block needs read once, VG elements a load, UNROLL channels in
        flight), then row-filtered into a ring of nslot planes of T there; each plane of
        S is then kh reads of the ring, and c[c0] * S goes into out for every output
        channel of the group (V elements a load and a store, UNROLL channels' loads in
        flight), or S itself into the scratch for ``stream`` (STORE). A tile of Q keeps
        zeros where y0 or y1 lies in the padding (written when the block starts, never
        again), so an absent term adds nothing and NaN or Inf in mu never meets a padded
        zero; planes with x0 or x1 in the padding are skipped. The threads of a block walk
        each phase's items together (_items), barriers between phases. Grid: x over the
        blocks' items, the longest diagonals first (they take longest), looping past it.
        Shared memory (``smem`` bytes, ACC elements): nq planes of Q (hq rows of wq), the
        ring (nslot planes of tj0 rows of tp), the group's Cog values of c (``csm``; else
        each is read from c where it is used)."""
        U, VT = _plan.UNROLL, 4  # VT: rows of T a thread forms at once (one column)
        UV = U * V  # a local array's size must be a constant, not an expression
        channel_sum = _make_channel_sum(U, VG, ACC)
        ldo, sto = _LDV[V, "cs"], _STV[V, "" if STORE else "cs"]

        def walk(optr, obase, ost, gptr, gbase, gst, has_g, mptr, mbase, mst, cptr, cbase,
                 cst, has_c, cval, geo, wk, n, zero):
            B, G, Cg, Cog = geo[0], geo[1], geo[2], geo[3]
            H, W, Ho, Wo, kh, kw = geo[4], geo[5], geo[6], geo[7], geo[8], geo[9]
            sh, sw, ph, pw, dh, dw = geo[10], geo[11], geo[12], geo[13], geo[14], geo[15]
            R, seglen, nseg, tj0, tj1, ntj1, ntile, nq, nslot, wq, tp, csm = wk
            hq = (tj0 - 1) * sw + (kw - 1) * dw + 1  # rows of a tile of Q
            span1 = (tj1 - 1) * sw + (kw - 1) * dw + 1  # its columns that T reads
            at_t = nq * hq * wq  # where the ring of T starts in shared memory
            at_c = at_t + nslot * tj0 * tp  # ... and c
            nrt = (tj0 + VT - 1) // VT  # row groups of T
            sm = cuda.shared.array(0, ACC)
            tid, nthr = cuda.threadIdx.x, cuda.blockDim.x
            reach = 0  # the residues u mod sh that some ii reaches
            for ii in range(kh if sh <= 64 else 0):
                reach |= 1 << ((ii * dh) % sh)
            bid = cuda.blockIdx.x
            while bid < n:  # bid = ((rank * nseg + seg) * ntile + tile) * B*G + (b*G + g)
                rest = _div(bid, B * G)
                b = _div(bid - rest * B * G, G)
                g = bid - rest * B * G - b * G
                rs = _div(rest, ntile)  # rank * nseg + seg
                tile = rest - rs * ntile
                rank = _div(rs, nseg)
                t_first = (rs - rank * nseg) * seglen
                di = -((rank + 1) >> 1) if rank & 1 else rank >> 1  # 0, -1, 1, -2, 2, ...
                L = Ho - abs(di)
                if t_first < L:  # (uniform across the block)
                    # (the block's values in 32 bits: fewer registers, ptxas spills less)
                    t_end = _i32(min(L, t_first + seglen))
                    J0 = _i32(_div(tile, ntj1) * tj0)
                    J1 = _i32((tile - _div(tile, ntj1) * ntj1) * tj1)
                    i0d = _i32(max(0, -di))
                    dx = _i32(di * sh)
                    xs = _i32((i0d + t_first) * sh - ph)
                    ulo = _i32(max(0, -dx) - xs)  # [ulo, uhi): x0 and x1 in the input
                    uhi = _i32(min(H, H - dx) - xs)
                    # The tile of Q: rows y0 - Y0lo, columns y1 - Y1lo + off (y1 - off
                    # a multiple of 4: aligned vectors, as cupy's).
                    Y0lo, Y1lo = _i32(J0 * sw - pw), _i32(J1 * sw - pw)
                    off = _i32(Y1lo & 3)
                    y0a, y1a = _i32(max(0, Y0lo)), _i32(max(0, Y1lo) // VG * VG)
                    nrow = _i32(min(W, Y0lo + hq) - y0a)
                    nvec = _i32((min(W, Y1lo + span1) - y1a + VG - 1) // VG)
                    ogb = gbase + b * gst[0] + g * Cg * gst[1]
                    omb = mbase + b * mst[0] + g * Cg * mst[1]
                    e = tid
                    while e < at_t:
                        sm[e] = zero
                        e += nthr
                    e = tid
                    while e < (0 if STORE or csm == 0 else Cog):
                        sm[at_c + e] = _c_of(cptr, cbase, cst, has_c, cval, g * Cog + e, zero)
                        e += nthr
                    cuda.syncthreads()
                    u_next = 0  # the first plane of Q not yet in the ring
                    t0 = t_first
                    while t0 < t_end:
                        t1 = min(t_end, t0 + R)
                        u_need = (t1 - 1 - t_first) * sh + (kh - 1) * dh
                        while u_next <= u_need:
                            ub = u_next
                            nb = min(nq, u_need + 1 - ub)
                            sb = ub % nslot
                            u_next += nb
                            # 1. Q_u for u in [ub, ub + nb): plane u - ub of the staging area
                            na = nb if nrow > 0 and nvec > 0 else 0
                            a, r, c, da, dr, dc = _items(max(nrow, 1), max(nvec, 1), tid, nthr)
                            pa, ok = -1, False
                            while a < na:
                                if a != pa:
                                    pa, ok = a, _wanted(ub + a, ulo, uhi, sh, reach)
                                if ok:
                                    x0 = xs + ub + a
                                    y0, y1 = y0a + r, y1a + c * VG
                                    og = (ogb + x0 * gst[2] + y0 * gst[3] + (x0 + dx) * gst[4]
                                          + y1 * gst[5])
                                    om0 = omb + x0 * mst[2] + y0 * mst[3]
                                    om1 = omb + (x0 + dx) * mst[2] + y1 * mst[3]
                                    s = cuda.local.array(VG, ACC)
                                    for e in range(VG):
                                        s[e] = zero
                                    channel_sum(s, gptr, og, gst[1], has_g, mptr, om0, om1,
                                                mst[1], Cg, zero)
                                    lc = y1 - Y1lo + off
                                    q = (a * hq + y0 - Y0lo) * wq + lc
                                    for e in range(VG):  # a vector across the tile's edge:
                                        if lc + e >= 0 and lc + e < wq:  # its part inside
                                            sm[q + e] = s[e]
                                a, r, c = _next(a, r, c, da, dr, dc, nrow, nvec)
                            cuda.syncthreads()
                            # 2. T_u from Q_u, into the ring's slot u mod nslot: VT rows of
                            # one column a thread
                            a, r, c, da, dr, dc = _items(nrt, tj1, tid, nthr)
                            pa, ok, slot = -1, False, 0
                            while a < nb:
                                if a != pa:
                                    pa, ok, slot = a, _wanted(ub + a, ulo, uhi, sh, reach), sb + a
                                    if slot >= nslot:
                                        slot -= nslot
                                if ok:
                                    r0 = r * VT
                                    t = cuda.local.array(VT, ACC)
                                    for e in range(VT):
                                        t[e] = zero
                                    q = (a * hq + r0 * sw) * wq + c * sw + off
                                    for _ in range(kw):
                                        for e in range(VT):
                                            if r0 + e < tj0:
                                                t[e] += sm[q + e * sw * wq]
                                        q += dw * (wq + 1)
                                    q = at_t + (slot * tj0 + r0) * tp + c
                                    for e in range(VT):
                                        if r0 + e < tj0:
                                            sm[q + e * tp] = t[e]
                                a, r, c = _next(a, r, c, da, dr, dc, nrt, tj1)
                            cuda.syncthreads()
                        # 3. S_t for t in [t0, t1), and out
                        s0 = (t0 - t_first) * sh % nslot
                        a, r, c, da, dr, dc = _items(tj0, tj1 // V, tid, nthr)
                        while a < t1 - t0:
                            j0, j1 = J0 + r, J1 + c * V
                            if j0 < Wo and j1 < Wo:
                                s = cuda.local.array(V, ACC)
                                for e in range(V):
                                    s[e] = zero
                                sl = s0 + a * sh
                                if sl >= nslot:
                                    sl -= nslot
                                u = (t0 + a - t_first) * sh
                                for _ in range(kh):
                                    if u >= ulo and u < uhi:
                                        q = at_t + (sl * tj0 + r) * tp + c * V
                                        for e in range(V):
                                            s[e] += sm[q + e]
                                    u += dh
                                    sl += dh
                                    if sl >= nslot:
                                        sl -= nslot
                                i0 = i0d + t0 + a
                                oo = (obase + b * ost[0] + i0 * ost[2] + j0 * ost[3]
                                      + (i0 + di) * ost[4] + j1 * ost[5])
                                res = cuda.local.array(V, OT)
                                if STORE:  # S (out is the scratch, OT the accumulation type)
                                    for e in range(V):
                                        res[e] = s[e]
                                    sto(optr, oo + g * ost[1], res, 0)
                                k = 0
                                while k < (0 if STORE else Cog):  # UNROLL channels a pass
                                    old = cuda.local.array(UV, OT)
                                    for w in range(U):
                                        if k + w < Cog:
                                            y = ldo(optr, oo + (g * Cog + k + w) * ost[1])
                                            for e in range(V):
                                                old[w * V + e] = y[e]
                                    for w in range(U):
                                        if k + w < Cog:
                                            cv = (sm[at_c + k + w] if csm else
                                                  _c_of(cptr, cbase, cst, has_c, cval,
                                                        g * Cog + k + w, zero))
                                            for e in range(V):
                                                res[e] = _to_elem(optr, _to_acc(
                                                    old[w * V + e], zero) + cv * s[e])
                                            sto(optr, oo + (g * Cog + k + w) * ost[1], res, 0)
                                    k += U
                            a, r, c = _next(a, r, c, da, dr, dc, tj0, tj1 // V)
                        cuda.syncthreads()  # before the next step's T reuses the ring
                        t0 += R
                bid += cuda.gridDim.x

        return walk

    def _make_plane(KH, SH, DH, ACC, OT):
        """cupy's cc_plane (sizes: ``_plan.plane``, ``pl``), where a plane of the input fits a
        warp and c * S goes straight into out. A block of one warp takes one item (below)
        and walks it alone: its barriers wait for its own lanes only. Lane l holds row
        l >> 1, columns [V (l & 1), +V) of a plane: of Q_u (the group's channel sum, formed in
        registers, a vector of gamma a channel), then of T_u and S_t (rows j0, columns j1).
        T_u is Q_u row-filtered through the block's plane of dynamic shared memory
        (``qrows`` x ``qpitch`` ACC elements, Q's rows from row pw and its columns from
        column ``qcol``; the zero border around them is the padding: no bounds checks). The
        NS = DH (KH - 1) + 1 planes of T that S_t sums are a ring in registers: slot s holds
        the plane of input rows x0 = i0 sh - ph + s, x1 = x0 + di sh. A step forms the SH
        planes it lacks (all NS at first) and pushes each in, the ring moving down a slot:
        SH, the slots a step moves it (min(sh, NS): past NS a step keeps none; sh itself
        comes from ``geo``), KH and DH are compile-time constants, so every index into the
        ring is one and it stays in registers (a store into slot s, chosen at run time, put
        it on the stack, even unrolled as cupy's "if k == s"). Items: (b, g, k), the planes
        i1 = (i0 + k) mod Ho for i0 = 0 .. Ho - 1 (the diagonal k, then k - Ho): Ho steps
        each, and consecutive blocks read neighbouring rows of gamma and out at once; a
        block loops over them. Under the simulator (4 threads a block, _dims) a thread takes
        NL lanes in turn."""
        V, NS = _plan.PLANE_V, DH * (KH - 1) + 1
        NL = 8 if SIM else 1  # lanes a thread: a warp's 32 over the block's threads
        KEEP = max(0, NS - SH)  # slots a step keeps
        # channels whose loads of gamma (or out) are in flight together: PLANE_INFLIGHT bytes
        UP = max(1, PLANE_INFLIGHT // (V * OT.bitwidth // 8))
        NLV, RING, UPV = NL * V, NL * NS * V, UP * V  # (local arrays' sizes: constants)
        channel_sum = _make_channel_sum(UP, V, ACC)
        ldo, sto = _LDV[V, "cs"], _STV[V, "cs"]

        def plane(optr, obase, ost, gptr, gbase, gst, has_g, mptr, mbase, mst, cptr, cbase,
                  cst, has_c, cval, geo, pl, n, zero):
            G, Cg, Cog = geo[1], geo[2], geo[3]
            H, W, Ho, Wo = geo[4], geo[5], geo[6], geo[7]
            kw, sh, sw, ph, pw, dw = geo[9], geo[10], geo[11], geo[12], geo[13], geo[15]
            qrows, qp, qcol = pl
            qc = qcol - pw  # T_u[j0, j1]'s first read: Q_u[j0 sw - pw, j1 sw - pw]
            sm = cuda.shared.array(0, ACC)
            tid, nthr = cuda.threadIdx.x, cuda.blockDim.x
            e = tid
            while e < qrows * qp:  # (the border is never written again)
                sm[e] = zero
                e += nthr
            cuda.syncthreads()
            r = cuda.local.array(RING, ACC)  # the ring: lane li's slot s at (li NS + s) V
            tn = cuda.local.array(NLV, ACC)  # the plane of T being formed, a lane's V
            bid = cuda.blockIdx.x
            while bid < n:  # bid = (b*G + g) * Ho + k
                bg = _div(bid, Ho)
                b = _div(bg, G)
                g = bg - b * G
                di = _i32(bid - bg * Ho)
                ogb = gbase + b * gst[0] + g * Cg * gst[1]
                omb = mbase + b * mst[0] + g * Cg * mst[1]
                oob = obase + b * ost[0] + g * Cog * ost[1]
                t = 0
                for i0 in range(Ho):  # i1 = (i0 + k) mod Ho: the diagonal k, then k - Ho
                    if i0 == Ho - di:  # a new diagonal: the ring starts again
                        di = _i32(di - Ho)
                        t = 0
                    dx = _i32(di * sh)
                    oot = oob + i0 * ost[2] + (i0 + di) * ost[4]
                    # the planes the ring lacks (all at first), pushed in order
                    s = 0 if t == 0 else KEEP
                    while s < NS:
                        x0 = i0 * sh - ph + s
                        x1 = x0 + dx
                        for e in range(NLV):
                            tn[e] = zero
                        if x0 >= 0 and x0 < H and x1 >= 0 and x1 < H:  # (uniform: barriers)
                            for li in range(NL):  # Q_u: a lane's row y0, columns [y1, y1 + V)
                                lane = tid * NL + li
                                y0, y1 = lane >> 1, (lane & 1) * V
                                if y0 < W and y1 < W:
                                    q = cuda.local.array(V, ACC)
                                    for e in range(V):
                                        q[e] = zero
                                    og = (ogb + x0 * gst[2] + y0 * gst[3] + x1 * gst[4]
                                          + y1 * gst[5])
                                    om0 = omb + x0 * mst[2] + y0 * mst[3]
                                    om1 = omb + x1 * mst[2] + y1 * mst[3]
                                    channel_sum(q, gptr, og, gst[1], has_g, mptr, om0, om1,
                                                mst[1], Cg, zero)
                                    at = (y0 + pw) * qp + qcol + y1
                                    for e in range(V):
                                        sm[at + e] = q[e]
                            cuda.syncthreads()
                            for li in range(NL):  # T_u: a lane's row j0, columns [j1, j1 + V)
                                lane = tid * NL + li
                                j0, j1 = lane >> 1, (lane & 1) * V
                                if j0 < Wo and j1 < Wo:
                                    at = j0 * sw * qp + j1 * sw + qc
                                    for _ in range(kw):
                                        for e in range(V):
                                            tn[li * V + e] += sm[at + e * sw]
                                        at += dw * (qp + 1)
                            cuda.syncthreads()  # before the next plane's Q overwrites this one
                        for li in range(NL):  # pushed: the ring moves down a slot
                            for k in range(NS - 1):
                                for e in range(V):
                                    r[(li * NS + k) * V + e] = r[(li * NS + k + 1) * V + e]
                            for e in range(V):
                                r[(li * NS + NS - 1) * V + e] = tn[li * V + e]
                        s += 1
                    for li in range(NL):  # S_t, and c * S_t into out
                        lane = tid * NL + li
                        j0, j1 = lane >> 1, (lane & 1) * V
                        if j0 < Wo and j1 < Wo:
                            sv = cuda.local.array(V, ACC)
                            for e in range(V):
                                sv[e] = r[li * NS * V + e]
                            for ii in range(1, KH):
                                for e in range(V):
                                    sv[e] += r[(li * NS + ii * DH) * V + e]
                            oo = oot + j0 * ost[3] + j1 * ost[5]
                            res = cuda.local.array(V, OT)
                            k = 0
                            while k < Cog:  # UP channels a pass
                                old = cuda.local.array(UPV, OT)
                                for w in range(UP):
                                    if k + w < Cog:
                                        vo = ldo(optr, oo + (k + w) * ost[1])
                                        for e in range(V):
                                            old[w * V + e] = vo[e]
                                for w in range(UP):
                                    if k + w < Cog:
                                        cv = _c_of(cptr, cbase, cst, has_c, cval,
                                                   g * Cog + k + w, zero)
                                        for e in range(V):
                                            res[e] = _to_elem(optr, _to_acc(
                                                old[w * V + e], zero) + cv * sv[e])
                                        sto(optr, oo + (k + w) * ost[1], res, 0)
                                k += UP
                    t += 1
                bid += cuda.gridDim.x

        return plane

    def _make_stream(V, ACC, OT):
        """out[b, c0] += c[c0] * S[b, g(c0)] in address order: per (b, c0) (blockIdx.z),
        its ``nseg`` rows (y) of ``seg_len`` contiguous elements (x; one row for a
        contiguous block, else one per p0), V elements a load, STREAM_U loads a thread in
        flight, S re-read from L2."""
        SU, lds, ldo, sto = _plan.STREAM_U, _LDV[V, ""], _LDV[V, "cs"], _STV[V, "cs"]
        SUV = SU * V  # a local array's size must be a constant

        def stream(optr, obase, ost, cptr, cbase, cst, has_c, cval, sptr, geo, nseg, seg_len,
                   zero):
            G, Cog, Wo = geo[1], geo[3], geo[7]
            HoWo = geo[6] * Wo
            nv = seg_len // V
            Co = G * Cog
            bx = cuda.blockDim.x
            z = cuda.blockIdx.z
            while z < geo[0] * Co:
                b = _div(z, Co)
                c0 = z - b * Co
                cv = _c_of(cptr, cbase, cst, has_c, cval, c0, zero)
                sb = (b * G + _div(c0, Cog)) * HoWo * HoWo
                r = cuda.blockIdx.y * cuda.blockDim.y + cuda.threadIdx.y
                while r < nseg:
                    i0 = _div(r, Wo)
                    o = obase + b * ost[0] + c0 * ost[1]
                    if nseg > 1:
                        o += i0 * ost[2] + (r - i0 * Wo) * ost[3]
                    sr = sb + r * seg_len
                    n0 = cuda.blockIdx.x * SU * bx + cuda.threadIdx.x
                    while n0 < nv:
                        old = cuda.local.array(SUV, OT)
                        sv = cuda.local.array(SUV, ACC)
                        for u in range(SU):  # past the end: the last vector, never stored
                            nu = min(n0 + u * bx, nv - 1) * V
                            y = ldo(optr, o + nu)
                            x = lds(sptr, sr + nu)
                            for e in range(V):
                                old[u * V + e] = y[e]
                                sv[u * V + e] = x[e]
                        res = cuda.local.array(V, OT)
                        for u in range(SU):
                            if u == 0 or n0 + u * bx < nv:  # u = 0: n0 < nv
                                for e in range(V):
                                    res[e] = _to_elem(optr, _to_acc(old[u * V + e], zero)
                                                      + cv * sv[u * V + e])
                                sto(optr, o + (n0 + u * bx) * V, res, 0)
                        n0 += cuda.gridDim.x * SU * bx
                    r += cuda.gridDim.y * cuda.blockDim.y
                z += cuda.gridDim.z

        return stream


# ---------------------------------------------------------------------------------------
# The backward (Backend.patch_moment_vjp, docs/autograd.md): two gathers, no atomics, no
# scratch. Every output element is written by exactly one thread, once.
# ---------------------------------------------------------------------------------------
if _IMPORT_ERROR is None:

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
_multiprocessors: dict = {}  # device id -> its multiprocessor count
_plans: dict = {}  # (device id, Problem.layout_key()) -> _Plan
_held: dict = {}  # device id -> deque of (event, scratch) of generic arrays' calls (_hold)
_held_lock = threading.Lock()  # not _lock: that one is held while a kernel compiles
_ready: dict = {}  # device id -> handle of the context its kernels run in (Numba's)
_drv = None  # cuda.bindings.driver, imported on first use (_driver)


def _signature(name, elems, acc):
    """Numba signature of kernel ``name``; ``elems`` are the pointers' element type names."""
    i64, A = nbt.int64, getattr(nbt, acc)
    ptr = [nbt.CPointer(getattr(nbt, e)) for e in elems]
    t6, t4, geo = nbt.UniTuple(i64, 6), nbt.UniTuple(i64, 4), nbt.UniTuple(i64, 16)
    a_ptr = nbt.CPointer(A)
    if name.startswith(("walk", "plane")):  # out (walk_s: S), gamma, mu, c
        o, g, m, c = ptr
        sizes = nbt.UniTuple(i64, 12 if name.startswith("walk") else 3)  # _plan.Walk, Plane
        args = (o, i64, t6, g, i64, t6, i64, m, i64, t4, c, i64, i64, i64, A, geo, sizes, i64,
                A)
    elif name == "stream":  # out, c
        args = (ptr[0], i64, t6, ptr[1], i64, i64, i64, A, a_ptr, geo, i64, i64, A)
    elif name == "vjp_gamma":  # grad_S, grad_gamma
        args = (ptr[0], i64, t6, ptr[1], i64, t6, geo, A)
    else:  # vjp_mu: grad_S, mu, grad_mu
        args = (ptr[0], i64, t6, ptr[1], i64, t4, ptr[2], i64, t4, geo, A)
    return nbt.void(*args)


def _kernel_function(name, elems, acc, V=1):
    """The Python function of kernel ``name`` before Numba compiles it (also what
    tests/_compile_numba_cuda.py compiles for sm_90 without a GPU). The walk's names:
    "walk" adds into out, "walk_s" stores S; "_vg16", "_vg32": gamma and mu read 16 or 32
    bytes a load (else one element). The plane walk's: "plane_KH_SH_DH" (_plane_name)."""
    A, OT = getattr(nbt, acc), getattr(nbt, elems[0])
    if name.startswith("plane"):
        KH, SH, DH = map(int, name.split("_")[1:])
        return _make_plane(KH, SH, DH, A, OT)
    if name.startswith("walk"):
        vg_bytes = int(name.rsplit("_vg", 1)[1]) if "_vg" in name else 0
        VG = max(1, vg_bytes // np.dtype(elems[2]).itemsize)
        return _make_walk(V, VG, name.startswith("walk_s"), A, OT)
    if name == "stream":
        return _make_stream(V, A, OT)
    return {"vjp_gamma": _vjp_gamma_kernel, "vjp_mu": _vjp_mu_kernel}[name]


#: Blocks a multiprocessor ptxas sizes the walk's registers for (cupy's WALK_BLOCKS): 2,
#: 128 registers a thread. Numba's walk would take about 180-250 (64-bit arithmetic,
#: 16-bit values a register each); at 128 ptxas spills some, at 80 (cupy's 3) several
#: times as much (docs/numba_cuda.md, "Registers"). Not timed yet.
WALK_BLOCKS = 2
#: Blocks of one warp a multiprocessor ptxas sizes the plane walk's registers for: 16, 128
#: registers a thread as the walk's, since the ring alone may take _plan.PLANE_RING and
#: Numba's 64-bit indices more than cupy's (80 a thread). Other bounds not timed.
PLANE_BLOCKS = 16
#: Bytes of gamma's (and out's) loads a lane of the plane walk has in flight (cupy's
#: PLANE_INFLIGHT): a warp's load is 512 bytes already, and the ring holds the registers.
PLANE_INFLIGHT = 32


def _launch_bounds(name):
    """Numba's ``launch_bounds`` of kernel ``name``: (threads a block, blocks a
    multiprocessor), the registers ptxas may use."""
    if name.startswith("plane"):  # one warp a block
        return (32, PLANE_BLOCKS)
    return (_plan.THREADS, WALK_BLOCKS if name.startswith("walk") else 1)


def _plane_name(kh, sh, dh):
    """The plane walk's kernel for a layer's kh, sh and dh: "plane_KH_SH_DH", the ring's
    extent compiled in. SH is the slots the ring moves on a step, min(sh, NS) (a stride
    past the ring's NS planes keeps none; the kernel takes sh itself from geo), and DH is
    1 where kh is (a ring of one plane): the layers that share a ring share a kernel."""
    ns = dh * (kh - 1) + 1
    return f"plane_{kh}_{min(sh, ns)}_{dh if kh > 1 else 1}"


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
                # An explicit signature compiles eagerly, once, for exactly these types;
                # cache=True keeps the machine code on disk across processes.
                k = cuda.jit(fn) if SIM else cuda.jit(
                    _signature(name, elems, acc), cache=True,
                    launch_bounds=_launch_bounds(name))(fn)
                _compiled[key] = k
    return k


def _sms(dev_id):
    """The device's multiprocessors (what _plan.walk fills; the simulator pretends one)."""
    n = _multiprocessors.get(dev_id)
    if n is None:
        n = _multiprocessors[dev_id] = 1 if SIM else cuda.get_current_device().MULTIPROCESSOR_COUNT
    return n


def _dims(grid, block):
    """(grid, block) as launched: the planned ones, with at least MIN_BLOCKS blocks (more
    along x); under the simulator, a Python thread per CUDA thread, at most 2 blocks an
    axis of at most 4 x 2 x 2 threads. Every kernel loops over what its grid leaves."""
    if SIM:
        return (tuple(min(g, 2) for g in grid),
                tuple(min(b, 4 if i == 0 else 2) for i, b in enumerate(block)))
    n = int(np.prod(grid))
    if n < MIN_BLOCKS:
        grid = (grid[0] * -(-MIN_BLOCKS // n),) + tuple(grid[1:])
    return tuple(grid), tuple(block)


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


def _dummy(elem):
    """A pointer for an argument a launch never reads (c a number, or where S is stored).
    On the device any address will do; the simulator copies each array argument back
    after a launch, so there it must alias no real one."""
    return np.zeros(1, np.uint16 if elem == "uint16" else elem) if SIM else 0


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
    """The driver binding's view of a stream handle (owns nothing: one per handle)."""
    st = _streams.get(handle)
    if st is None:
        _driver()
        if len(_streams) > 1024:  # streams come and go: keep the table bounded
            _streams.clear()
        st = _streams[handle] = _drv.CUstream(handle)
    return st


def _numba_stream(handle):
    """What Numba's kernel call and allocations take for the stream of raw ``handle``: 0,
    the legacy or per-thread default stream, else ``cuda.external_stream(handle)``, which
    holds only the handle (Numba never destroys it), so one object a handle serves all."""
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
    """(owner, address) of ``n`` elements of ``acc`` on device ``dev`` from the arrays'
    library on the launch stream (raw ``handle``; ``stream``: Numba's object). torch's
    allocator and CuPy's pool order a freed block's reuse on that stream, so their owner
    goes once the launches are queued; a Numba device array is held (_hold)."""
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
    """Keep ``owner`` (a Numba device array) beside an event recorded on ``stream`` after
    the call's launches: a memory-manager plugin (RMM's) frees on a stream of its own and
    could give the block out while the kernels still use it. Nothing waits: _release
    drops the owners whose events have completed."""
    event = cuda.event(timing=False)
    event.record(stream)
    with _held_lock:
        held = _held.get(dev)
        if held is None:
            held = _held[dev] = collections.deque()
        held.append((event, owner))


def _release(dev):
    """Drop the scratch owners of device ``dev`` whose events have completed, oldest first
    (``Event.query``: no wait)."""
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
#: out, gamma, mu, c, S, and the number c.
_OUT, _GAMMA, _MU, _C, _S, _CVAL = (_Slot(i) for i in range(6))


class _Launch:
    """One kernel launch of a plan: the kernel, its grid and block, the bytes of dynamic
    shared memory a block (``smem``), and its arguments with _Slot markers where a call's
    addresses (and the number c) go."""

    __slots__ = ("name", "elems", "acc", "V", "grid", "block", "args", "smem", "kernel")

    def __init__(self, name, elems, acc, V, grid, block, args, smem=0):
        self.name, self.elems, self.acc, self.V = name, elems, acc, V
        (self.grid, self.block), self.args, self.smem = _dims(grid, block), args, smem
        self.kernel = _kernel(name, elems, acc, V)  # compiled now, not mid-call

    def __call__(self, stream, values):
        """Launch on ``stream`` (_numba_stream) with ``values`` for the _Slot arguments,
        through Numba's kernel call (one signature: no type resolution)."""
        args = tuple([values[a.i] if type(a) is _Slot else a for a in self.args])
        if SIM:
            # The simulator's block manager polls its threads while holding the GIL, so
            # each cuda.syncthreads() waits out a thread switch interval (5 ms by
            # default): shortened for the launch (the walk's barriers, 10x faster here).
            interval = sys.getswitchinterval()
            sys.setswitchinterval(min(interval, 5e-5))
            try:
                self.kernel[self.grid, self.block, 0, self.smem](*args)
            finally:
                sys.setswitchinterval(interval)
        else:
            self.kernel[self.grid, self.block, stream, self.smem](*args)


class _Plan:
    """The launches of one call signature and the scratch they need: ``scratch``
    elements of the accumulation type (S, where it goes through memory; else 0)."""

    __slots__ = ("launches", "scratch")

    def __init__(self, launches, scratch=0):
        self.launches, self.scratch = launches, scratch


def _current_context():
    """Handle of the CUDA context current on this thread (-1: none could be read)."""
    driver = _driver()
    err, ctx = driver.cuCtxGetCurrent()
    return int(ctx) if err == driver.CUresult.CUDA_SUCCESS else -1


def _widths(itemsize):
    return [v for v in (1, 2, 4, 8) if v * itemsize <= 16]


def _make_plan(p, dev_id):
    """The launches of one call signature, as cupy's ``CupyBackend._plan`` chooses them
    (the same vector widths, STREAM_BYTES rule, ``_plan.plane`` rule and ``_plan.walk``
    sizes): kernels, launch sizes and every argument but the addresses and the number c."""
    acc = p.acc
    zero = np.dtype(acc).type(0) if SIM else 0.0
    B, G, W, Ho, Wo = p.B, p.G, p.W, p.Ho, p.Wo
    Cog, HoWo = p.Co // G, p.Ho * p.Wo
    oi, gi, mi = p.out_info, p.gamma_info, p.mu_info
    out_t, mu_t = _PTR_TYPE[oi.dtype], _PTR_TYPE[mi.dtype]
    _, obase, ost = _pointer(p.out, oi)  # base and strides (addresses: per call)
    ost = diag_strides(ost, p.full_out)
    _, mbase, mst = _pointer(p.mu, mi)
    if gi is None:  # gamma absent: never read (has_g 0); mu's address stands in
        gamma_t, gsrc, has_g, gbase, gst = mu_t, _MU, 0, mbase, (0,) * 6
    else:
        gamma_t, gsrc, has_g = _PTR_TYPE[gi.dtype], _GAMMA, 1
        _, gbase, gst = _pointer(p.gamma, gi)
        gst = diag_strides(gst, p.full_gamma)
    if p.c_info is None:
        c_t, csrc, has_c, cbase, cst = out_t, _dummy(out_t), 0, 0, 0
    else:
        c_t, csrc, has_c = _PTR_TYPE[p.c_info.dtype], _C, 1
        _, cbase, cst = _pointer(p.c, p.c_info)
        cst = cst[0] if cst else 0  # a 0-d c broadcasts: stride 0
    geo = (B, G, p.Ci // G, Cog, p.H, W, Ho, Wo, p.kh, p.kw, p.sh, p.sw, p.ph, p.pw, p.dh,
           p.dw)
    a_size, o_size = ITEMSIZE[acc], ITEMSIZE[oi.dtype]
    # gamma and mu VG elements (16 bytes, or 32: _plan.widen) along a row y1 a load, where
    # they share a dtype and the layout allows; else one.
    vg, in_size = 1, ITEMSIZE[mi.dtype]
    if gi is None or gi.dtype == mi.dtype:
        mu_row = (in_size, (mst[3],), mst[:3], mi.ptr)
        vg = (vector_width(in_size, W, (gst[5],), (W,), gst[:5], gi.ptr, (mu_row,)) if gi
              else vector_width(in_size, W, (mst[3],), (W,), mst[:3], mi.ptr))
        vg = _plan.widen(vg, in_size, W) if vg * in_size == 16 else 1
    # S through memory where many output channels share it and out's rows (i1, j1) are
    # contiguous (stream streams them); else c * S straight into out, V elements along j1
    # a load (up to 32 bytes: _plan.widen), and VG > 1 only where gamma and mu have out's
    # dtype (as cupy's families).
    stream = Cog * o_size >= _plan.STREAM_BYTES and contiguous(ost[4:], (Ho, Wo))
    if stream:
        v = _plan.widen(max(w for w in _widths(a_size) if Wo % w == 0), a_size, Wo)
    else:
        v = _plan.widen(vector_width(o_size, Wo, (ost[5],), (Wo,), ost[:5], oi.ptr), o_size, Wo)
        vg = vg if mi.dtype == oi.dtype else 1
    inputs = (gsrc, gbase, gst, has_g, _MU, mbase, mst)
    # The plane walk where the planes fit a warp (cupy's rule): c * S straight into out,
    # gamma and mu 16-byte vectors of out's dtype, out's rows 16-byte vectors.
    pl = (_plan.plane(B, G, p.Ci // G, Cog, Ho, W, Wo, p.kh, p.kw, p.sw, p.dh, p.dw, p.pw,
                      a_size)
          if not stream and vg * in_size >= 16 and v * o_size >= 16 else None)
    if pl is not None:
        return _Plan([_Launch(_plane_name(p.kh, p.sh, p.dh), (out_t, gamma_t, mu_t, c_t), acc,
                              _plan.PLANE_V, (min(pl.n, _plan.MAX_GRID_X),), (32,),
                              (_OUT, obase, ost, *inputs, csrc, cbase, cst, has_c, _CVAL, geo,
                               (pl.qrows, pl.qpitch, pl.qcol), pl.n, zero), pl.smem)])
    wk = _plan.walk(B, G, p.Ci // G, p.W, Ho, Wo, p.kh, p.kw, p.sh, p.sw, p.dh, p.dw, v, vg,
                    a_size, 0 if stream else Cog, _sms(dev_id))
    sizes = (wk.R, wk.seglen, wk.nseg, wk.tj0, wk.tj1, wk.ntj1, wk.ntile, wk.nq, wk.nslot,
             wk.wq, wk.tp, int(wk.csm))
    name = "walk" + ("_s" if stream else "") + (f"_vg{vg * in_size}" if vg > 1 else "")
    if not stream:
        return _Plan([_Launch(name, (out_t, gamma_t, mu_t, c_t), acc, v, wk.grid,
                              (_plan.THREADS,), (_OUT, obase, ost, *inputs, csrc, cbase, cst,
                                                 has_c, _CVAL, geo, sizes, wk.n, zero),
                              wk.smem)])
    # walk stores S[b, g] (contiguous: the layout of a diagonal out with one channel a
    # group, c unread), then stream adds c[c0] * S into out, a row a (b, c0) block where
    # that block is contiguous, else a row a (i0, j0).
    s_st = (G * HoWo * HoWo, HoWo * HoWo, Wo * HoWo, HoWo, Wo, 1)
    walk = _Launch(name, (acc, gamma_t, mu_t, acc), acc, v, wk.grid, (_plan.THREADS,),
                   (_S, 0, s_st, *inputs, _dummy(acc), 0, 0, 0, zero, geo, sizes, wk.n,
                    zero), wk.smem)
    rows = 1 if contiguous(ost[2:], (Ho, Wo, Ho, Wo)) else HoWo
    seg = HoWo * HoWo // rows
    v3 = (vector_width(o_size, seg, ost[2:], (Ho, Wo, Ho, Wo), ost[:2], oi.ptr) if rows == 1
          else vector_width(o_size, seg, ost[4:], (Ho, Wo), ost[:4], oi.ptr))
    add = _Launch("stream", (out_t, c_t), acc, v3, *_plan.stream_grid(B * p.Co, rows, seg // v3),
                  (_OUT, obase, ost, csrc, cbase, cst, has_c, _CVAL, _S, geo, rows, seg, zero))
    return _Plan([walk, add], B * G * HoWo * HoWo)


def _launch_plan(plan, kind, handle, dev_id, acc, optr, gptr, mptr, cptr, c_value):
    """Launch a plan on the stream of raw ``handle`` on ``dev_id`` (its context current):
    addresses of out, gamma, mu and c (0 for an absent gamma or a number c), and c_value,
    the number c. Scratch from the arrays' library (_workspace)."""
    stream = _numba_stream(handle)
    buf, sptr = None, 0
    cai = kind == "cai"
    if plan.scratch:
        if cai:
            _release(dev_id)
        buf, sptr = _workspace(kind, dev_id, plan.scratch, acc, handle, stream)
    values = (optr, gptr, mptr, cptr, sptr, float(c_value))
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
            plan = _make_plan(p, dev_id)
            if len(_plans) > 512:  # many shapes: start over rather than grow
                _plans.clear()
            _plans[key] = plan
        return plan

    def _run(self, p, dev_id):
        plan = self._plan_of(p, dev_id)
        if SIM:  # numpy views of the memory; scratch (S) a numpy buffer
            optr, mptr = _sim_pointer(p.out)[0], _sim_pointer(p.mu)[0]
            gptr = None if p.gamma is None else _sim_pointer(p.gamma)[0]
            cptr = None if p.c is None else _sim_pointer(p.c)[0]
            values = (optr, gptr, mptr, cptr, np.zeros(max(plan.scratch, 1), p.acc),
                      np.dtype(p.acc).type(p.c_value))
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
        handle, then = (None, ()) if SIM else _launch_stream(a, dev_id)
        stream = None if SIM else _numba_stream(handle)
        G, Cg, HW = a.G, a.Ci // a.G, a.H * a.W
        geo = (a.B, G, Cg, 0, a.H, a.W, a.Ho, a.Wo, a.kh, a.kw,
               a.sh, a.sw, a.ph, a.pw, a.dh, a.dw)
        s_t = _PTR_TYPE[a.grad_S_info.dtype]
        sptr, sbase, sst = _pointer(a.grad_S, a.grad_S_info)
        block = 4 if SIM else max(32, min(_plan.THREADS, -(-HW // 32) * 32))  # whole warps
        if a.grad_gamma is not None:  # a block a row (b, g, x0, y0), threads along (x1, y1)
            g_t = _PTR_TYPE[a.grad_gamma_info.dtype]
            gptr, gbase, gst = _pointer(a.grad_gamma, a.grad_gamma_info)
            gst = diag_strides(gst, a.full_gamma)
            _Launch("vjp_gamma", (s_t, g_t), acc, 1, (min(a.B * G * HW, _plan.MAX_GRID_X),),
                    (block,), (sptr, sbase, sst, gptr, gbase, gst, geo, zero))(stream, ())
        if a.grad_mu is not None:  # a block a (b, g, 4 channels, tile of input positions)
            m_t, d_t = _PTR_TYPE[a.mu_info.dtype], _PTR_TYPE[a.grad_mu_info.dtype]
            mptr, mbase, mst = _pointer(a.mu, a.mu_info)
            dptr, dbase, dst = _pointer(a.grad_mu, a.grad_mu_info)
            n_blocks = a.B * G * -(-Cg // 4) * -(-HW // block)
            _Launch("vjp_mu", (s_t, m_t, d_t), acc, 1, (min(n_blocks, _plan.MAX_GRID_X),), (block,),
                    (sptr, sbase, sst, mptr, mbase, mst, dptr, dbase, dst, geo, zero))(stream, ())
        _follow(handle, then)


backend = NumbaCudaBackend()
