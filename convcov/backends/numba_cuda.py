"""``numba_cuda``: Numba CUDA kernels, on the design and planner of the ``cupy`` backend.

Owns the ``numba.cuda`` kernels below, their compilation (once per combination of pointer
element types, accumulation dtype and vector width, with an explicit signature, cached on
disk by Numba), the launch plan of a call signature and the launches themselves, on the
arrays' device and their library's current stream: torch's for torch tensors, CuPy's for
CuPy arrays; for other ``__cuda_array_interface__`` objects the stream ``out`` names, after
the streams the inputs name (``convcov._arrays.launch_streams``).

Design (docs/backends.md "The GPU design", docs/numba_cuda.md). ``convcov.backends._plan``
chooses, from the problem's quantities, at most three launches, the kernels of cupy's
``SOURCE`` written in Numba:

* ``gsum`` (where S is formed from T) reads gamma's channel-diagonal once, V elements a
  load, and writes ``T[b, g, x0, y0, x1, y1]``, the group's channel sum of
  ``gamma + mu (x) mu``.
* ``fused`` / ``fused_t`` form V consecutive values of a row ``S[b, g, p0, :]`` in registers
  (straight from gamma and mu, or the kh x kw box filter of T) and add ``c[c0] * S`` into
  out's channel-diagonal for a chunk of the group's output channels: S never reaches
  memory.
* ``stream`` (where ``_plan.stream_s``): the fused kernel writes S instead, and this kernel
  streams ``out[b, c0] += c[c0] * S[b, g]`` in address order.
* ``planes`` (cupy's ``cc_planes``: depthwise layers where S would come from T,
  ``_plan.by_planes``, where ``_plan.planes`` fits): a block sums the planes
  ``P[x0, :, x1, :]`` of gamma + mu (x) mu that a run of planes of S along one diagonal
  ``i1 - i0`` reads into dynamic shared memory, once each, then forms those planes of S
  from there and adds ``c[c0] * S`` into out: one launch, no T.

Terms with a position in the padding are skipped (SPEC section 1), so NaN/Inf in ``mu``
never meets a padded zero. Index arithmetic is 64-bit (divisions in 32 bits where the
operands fit). Sums run in ``Problem.acc``; results are rounded once into out's dtype
(a float64 sum reaches bfloat16 through round-to-odd float32). Numba has no syntax for
16-byte accesses or cache qualifiers: ``_LDV``/``_STV`` are intrinsics (inline PTX).

Arrays travel as raw device pointers plus element strides (``CPointer`` arguments), so any
stride, torch's bfloat16 (as uint16 bits) and any library work alike. A signature's
launches are planned once (``_plan``); a call fills in its addresses and launches each
kernel with Numba's public kernel call on ``cuda.external_stream(handle)``. Scratch (S and
T) comes from the arrays' library on the launch stream (torch's allocator, CuPy's pool);
generic CUDA arrays take a Numba device array, kept beside an event until its kernels have
run (``_hold``), since a memory-manager plugin may reuse a freed block on a stream of its
own. The backward (``patch_moment_vjp``, docs/autograd.md) is two gathers without scratch.

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

    @cuda.jit(device=True)
    def _split(n, per, inner, width):
        """Item n of planes of ``per`` items, each a row of ``inner`` vectors of ``width``
        elements: (plane, row, first element), the planes kernel's (u, y0, y1) of its fill
        and (tt, j0, j1) of S."""
        a = _div(n, per)
        r = n - a * per
        c = _div(r, inner)
        return a, c, (r - c * inner) * width

    @cuda.jit(device=True)
    def _slice(z, nchunk, G, Cog, chunk):
        """Work slice z of the fused and planes kernels: its b, g and chunk
        [c_first, c_end) of the group's output channels (cupy's slice_of)."""
        bg = _div(z, nchunk)
        b = _div(bg, G)
        g = bg - b * G
        c_first = g * Cog + (z - bg * nchunk) * chunk
        return b, g, c_first, min(c_first + chunk, (g + 1) * Cog)

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
# ``hint``: "cs" evict-first (gamma and out, touched once), "nc" the read-only path (mu, T,
# re-read from the caches), "" none (S in stream: ptxas sinks .nc loads past the stores
# into their branches, which left one vector of four not in flight). Loads are volatile
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

    _LDV = {(n, h): _make_ldv(n, h) for n in (1, 2, 4, 8) for h in ("", "cs", "nc")}
    _STV = {(n, h): _make_stv(n, h) for n in (1, 2, 4, 8) for h in ("", "cs")}

# ---------------------------------------------------------------------------------------
# The forward kernels (cupy's SOURCE: cc_gsum, cc_fused, cc_stream, cc_planes). Index names
# follow SPEC section 1. An array is (pointer, base, element strides): element [i, j, ...] is
# ptr[base + i*s0 + j*s1 + ...]; out's and gamma's channel stride is the channel-diagonal's.
# geo = (B, G, Cg, Cog, H, W, Ho, Wo, kh, kw, sh, sw, ph, pw, dh, dw). ``zero`` is 0 in the
# accumulation type (it types the sums). Each kernel comes from a factory whose arguments
# (vector width V, accumulation type ACC, out's element type OT) are compile-time
# constants, so ``for e in range(V)`` over local arrays unrolls into registers.
# ---------------------------------------------------------------------------------------
if _IMPORT_ERROR is None:

    def _make_gsum(V, ACC, OT=None):
        """T[b, g, x0, y0, q] = sum over ci of group g of gamma[b, ci, x0, y0, (ci,) q]
        + mu[b, ci, x0, y0] * mu[b, ci, q], V consecutive q a thread (V > 1: q contiguous
        in gamma and mu, rows aligned). UNROLL channels a step, all their loads issued
        before the first sum (a warp issues in order)."""
        ldg, ldm, stt, U = _LDV[V, "cs"], _LDV[V, "nc"], _STV[V, ""], _plan.UNROLL
        UV = U * V  # a local array's size must be a constant, not an expression

        def gsum(tptr, gptr, gbase, gst, has_g, mptr, mbase, mst, geo, n, zero):
            G, Cg, W = geo[1], geo[2], geo[5]
            HW = geo[4] * W
            nqv = HW // V
            gsc, msc = gst[1], mst[1]
            use_g = has_g != 0
            idx = cuda.grid(1)
            while idx < n:
                row = _div(idx, nqv)  # (b, g, x0, y0)
                q = (idx - row * nqv) * V
                bg = _div(row, HW)
                p = row - bg * HW
                b = _div(bg, G)
                x0 = _div(p, W)
                y0 = p - x0 * W
                ci0 = (bg - b * G) * Cg
                og = gbase + b * gst[0] + ci0 * gsc + x0 * gst[2] + y0 * gst[3]
                omr = mbase + b * mst[0] + ci0 * msc + x0 * mst[2] + y0 * mst[3]
                if V > 1:
                    og += q
                    omc = mbase + b * mst[0] + ci0 * msc + q
                else:
                    x1 = _div(q, W)
                    og += x1 * gst[4] + (q - x1 * W) * gst[5]
                    omc = mbase + b * mst[0] + ci0 * msc + x1 * mst[2] + (q - x1 * W) * mst[3]
                acc = cuda.local.array(V, ACC)
                for e in range(V):
                    acc[e] = zero
                ci = 0
                while ci < Cg:
                    m = min(U, Cg - ci)  # channels of this step
                    mr = cuda.local.array(U, ACC)
                    mc = cuda.local.array(UV, ACC)
                    gv = cuda.local.array(UV, ACC)
                    # Straight-line code: every load issued before the first is used (a
                    # load under ``if u < m`` made the next channel's wait for it). Past the
                    # group's last channel: that one loaded again, its terms 0 (exact: a sum
                    # from +0 never is -0).
                    for u in range(U):
                        cu = min(u, m - 1)
                        y = ldm(mptr, omc + cu * msc)
                        r = _to_acc(mptr[omr + cu * msc], zero)
                        mr[u] = r if u < m else zero
                        for e in range(V):
                            mc[u * V + e] = _to_acc(y[e], zero) if u < m else zero
                    for u in range(U):  # gamma absent: mu's first row, read as 0
                        y = ldg(gptr, og + min(u, m - 1) * gsc)
                        for e in range(V):
                            gv[u * V + e] = _to_acc(y[e], zero) if u < m and use_g else zero
                    for u in range(U):
                        for e in range(V):
                            acc[e] = mr[u] * mc[u * V + e] + (acc[e] + gv[u * V + e])
                    og += U * gsc
                    omr += U * msc
                    omc += U * msc
                    ci += U
                stt(tptr, row * HW + q, acc, 0)
                idx += cuda.gridsize(1)

        return gsum

    def _make_fused(V, ACC, OT, SRC_T):
        """One thread: V consecutive q = (i1, j1) of one p0 = (i0, j0) of one (b, g), and a
        chunk of the group's output channels (blockIdx.z: (b, g, chunk); x: (p0, q)). It
        forms those V values of S[b, g, p0, :] in registers, from T (SRC_T: the kh x kw box
        filter of T, kh*kw cached loads an element) or from gamma and mu (Cg*kh*kw terms
        an element; gamma absent: the Gram matrix of mu's patches), the terms walked as
        one flat sequence, KU a step, every load of a step before its sums. Then it adds
        c[c0] * S into out's channel-diagonal for each channel of its chunk, V elements a
        load and a store, UNROLL channels' loads in flight; ``to_s``: stores S (out is
        then S, OT the accumulation type)."""
        # Terms a step: cupy's cc_fused KU (loads in flight for latency-bound gathers).
        KU = (16 // V if V >= 2 else 8) if SRC_T else (max(1, 8 // V) if V >= 2 else 4)
        U, ldn, ldo, sto = _plan.UNROLL, _LDV[1, "nc"], _LDV[V, "cs"], _STV[V, "cs"]
        UV, KUV = U * V, KU * V  # a local array's size must be a constant

        def fused(optr, obase, ost, gptr, gbase, gst, has_g, mptr, mbase, mst, cptr, cbase,
                  cst, has_c, cval, tptr, to_s, geo, nchunk, chunk, zero):
            B, G, Cg, Cog = geo[0], geo[1], geo[2], geo[3]
            H, W, Ho, Wo, kh, kw = geo[4], geo[5], geo[6], geo[7], geo[8], geo[9]
            sh, sw, ph, pw, dh, dw = geo[10], geo[11], geo[12], geo[13], geo[14], geo[15]
            HW, HoWo = H * W, Ho * Wo
            nqv = HoWo // V
            nw = HoWo * nqv
            nterm = kh * kw if SRC_T else kh * kw * Cg
            use_g = has_g != 0
            z = cuda.blockIdx.z
            while z < B * G * nchunk:
                b, g, c_first, c_end = _slice(z, nchunk, G, Cog, chunk)
                bg = b * G + g
                w = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
                while w < nw:
                    p0 = _div(w, nqv)
                    q = (w - p0 * nqv) * V
                    i0 = _div(p0, Wo)
                    j0 = p0 - i0 * Wo
                    i1 = _div(q, Wo)
                    j1 = q - i1 * Wo
                    oo = obase + b * ost[0] + i0 * ost[2] + j0 * ost[3] + i1 * ost[4] + j1 * ost[5]
                    x1b = cuda.local.array(V, nbt.int64)  # (x1, y1) at kernel offset (0, 0)
                    y1b = cuda.local.array(V, nbt.int64)
                    for e in range(V):
                        x1b[e] = i1 * sh - ph
                        y1b[e] = j1 * sw - pw
                        j1 += 1
                        if j1 == Wo:
                            j1 = 0
                            i1 += 1
                    x0b = i0 * sh - ph
                    y0b = j0 * sw - pw
                    s = cuda.local.array(V, ACC)
                    for e in range(V):
                        s[e] = zero
                    ii = ji = ci = 0  # the next term's kernel offset (and channel)
                    t0 = 0
                    while t0 < nterm:
                        tv = cuda.local.array(KUV, ACC)  # T, or gamma's terms
                        m1 = cuda.local.array(KUV, ACC)
                        m0 = cuda.local.array(KU, ACC)
                        present = 0  # bit u*V + e: term u is inside the input for element e
                        for u in range(KU):
                            x0 = x0b + ii * dh
                            y0 = y0b + ji * dw
                            row = (t0 + u < nterm) & (x0 >= 0) & (x0 < H) & (y0 >= 0) & (y0 < W)
                            cig = g * Cg + ci
                            om = mbase + b * mst[0] + cig * mst[1]
                            og = gbase + b * gst[0] + cig * gst[1] + x0 * gst[2] + y0 * gst[3]
                            tr = (bg * HW + x0 * W + y0) * HW
                            if not SRC_T:
                                m0[u] = (_to_acc(ldn(mptr, om + x0 * mst[2] + y0 * mst[3])[0],
                                                 zero) if row else zero)
                            for e in range(V):
                                x1 = x1b[e] + ii * dh
                                y1 = y1b[e] + ji * dw
                                ok = row & (x1 >= 0) & (x1 < H) & (y1 >= 0) & (y1 < W)
                                k = u * V + e
                                if SRC_T:
                                    tv[k] = ldn(tptr, tr + x1 * W + y1)[0] if ok else zero
                                else:
                                    present |= (1 << k) if ok else 0
                                    tv[k] = (_to_acc(ldn(gptr, og + x1 * gst[4] + y1 * gst[5])[0],
                                                     zero) if ok and use_g else zero)
                                    m1[k] = (_to_acc(ldn(mptr, om + x1 * mst[2] + y1 * mst[3])[0],
                                                     zero) if ok else zero)
                            if SRC_T:
                                ji += 1
                            else:
                                ci += 1
                                if ci == Cg:
                                    ci = 0
                                    ji += 1
                            if ji == kw:
                                ji = 0
                                ii += 1
                        # T is 0 where a term is absent; a gamma and mu term is skipped,
                        # not added as 0 * mu: mu may be Inf.
                        for u in range(KU):
                            for e in range(V):
                                k = u * V + e
                                if SRC_T:
                                    s[e] += tv[k]
                                elif (present >> k) & 1:
                                    s[e] = m0[u] * m1[k] + (s[e] + tv[k])
                        t0 += KU
                    res = cuda.local.array(V, OT)
                    if to_s:  # S itself, stored, not added
                        for e in range(V):
                            res[e] = _to_elem(optr, s[e])
                        sto(optr, oo + c_first * ost[1], res, 0)
                    c0 = c_first
                    while c0 < c_end and not to_s:
                        old = cuda.local.array(UV, OT)
                        for u in range(U):  # past the chunk: its last channel, never stored
                            y = ldo(optr, oo + min(c0 + u, c_end - 1) * ost[1])
                            for e in range(V):
                                old[u * V + e] = y[e]
                        for u in range(U):
                            if u == 0 or c0 + u < c_end:
                                cv = _to_acc(cptr[cbase + (c0 + u) * cst], zero) if has_c else cval
                                for e in range(V):
                                    res[e] = _to_elem(optr, _to_acc(old[u * V + e], zero)
                                                      + cv * s[e])
                                sto(optr, oo + (c0 + u) * ost[1], res, 0)
                        c0 += U
                    w += cuda.gridDim.x * cuda.blockDim.x
                z += cuda.gridDim.z

        return fused

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
                cv = _to_acc(cptr[cbase + c0 * cst], zero) if has_c else cval
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

    def _make_planes(V, ACC, OT, VG):
        """cupy's cc_planes (``_plan.planes``): S from gamma and mu through shared memory,
        no T. A plane S[b, g, i0, :, i1, :] is the sum over ii of a diagonal kw-term box
        filter of one plane P[x0, :, x1, :] of the group's channel sum of gamma + mu (x) mu
        (x0 = i0*sh + ii*dh - ph, x1 = x0 + (i1 - i0)*sh). A block (blockIdx.x: a diagonal
        i1 - i0 and a run of ``runp`` planes along it; z: (b, g, chunk)) sums the run's
        nu = sh*(runp-1) + dh*(kh-1) + 1 planes of P once each into dynamic shared memory
        (a plane: Wp rows y0 + pw, ``wq`` columns y1 + pw), VG elements of gamma and mu
        along y1 a load. The cells in the padding are zeroed when the block starts and never
        written, so an absent term adds nothing (NaN/Inf in mu never meets a padded zero).
        Then a thread forms V consecutive j1 of a row of S from kh*kw reads of shared memory
        each and adds c[c0] * S into out for the chunk's channels (the first channel's out
        loaded before S is formed, then as in fused, UNROLL channels' loads in flight)."""
        U, ldn, ldg = _plan.UNROLL, _LDV[1, "nc"], _LDV[VG, "nc"]
        ldo, sto = _LDV[V, "cs"], _STV[V, "cs"]
        UV = U * V  # a local array's size must be a constant

        def planes(optr, obase, ost, gptr, gbase, gst, has_g, mptr, mbase, mst, cptr, cbase,
                   cst, has_c, cval, geo, runp, wq, nchunk, chunk, zero):
            B, G, Cg, Cog = geo[0], geo[1], geo[2], geo[3]
            H, W, Ho, Wo, kh, kw = geo[4], geo[5], geo[6], geo[7], geo[8], geo[9]
            sh, sw, ph, pw, dh, dw = geo[10], geo[11], geo[12], geo[13], geo[14], geo[15]
            nu = sh * (runp - 1) + dh * (kh - 1) + 1  # planes of P a run reads
            Wp = sw * (Wo - 1) + dw * (kw - 1) + 1  # the columns y + pw a row of S spans
            PP = Wp * wq
            nqv = Wo // V
            per_plane = Wo * nqv
            nrun = (Ho + runp - 1) // runp
            nrow = min(W, Wp - pw)  # the rows y0 (and columns y1) read, inside the input
            nvec = (nrow + VG - 1) // VG
            per_u = nrow * nvec
            use_g = has_g != 0
            tid, nthr = cuda.threadIdx.x, cuda.blockDim.x
            P = cuda.shared.array(0, ACC)
            e = tid
            while e < nu * PP:  # the padding: zero for the whole block
                P[e] = zero
                e += nthr
            nx = (2 * Ho - 1) * nrun
            z = cuda.blockIdx.z
            while z < B * G * nchunk:
                b, g, c_first, c_end = _slice(z, nchunk, G, Cog, chunk)
                og_b = gbase + b * gst[0] + g * Cg * gst[1]
                om_b = mbase + b * mst[0] + g * Cg * mst[1]
                xb = cuda.blockIdx.x
                while xb < nx:
                    d = _div(xb, nrun)
                    di = d - (Ho - 1)  # the diagonal i1 - i0
                    t0 = (xb - d * nrun) * runp
                    L = Ho - abs(di)  # planes of S on it
                    if t0 < L:  # (uniform across the block)
                        nt = min(L - t0, runp)
                        i0a = t0 + (-di if di < 0 else 0)
                        i1a = t0 + (di if di > 0 else 0)
                        x0a = i0a * sh - ph
                        dx = (i1a - i0a) * sh
                        cuda.syncthreads()  # the previous run's reads of P are done
                        n = tid
                        while n < nu * per_u:
                            u, y0, y1 = _split(n, per_u, nvec, VG)
                            used = False  # plane u is read by one of the run's nt planes
                            for ii in range(kh):
                                k = u - ii * dh
                                if k >= 0:
                                    kq = _div(k, sh)
                                    if kq * sh == k and kq < nt:
                                        used = True
                            if used:
                                x0 = x0a + u
                                x1 = x0 + dx
                                s = cuda.local.array(VG, ACC)
                                for e in range(VG):
                                    s[e] = zero
                                if (x0 >= 0) & (x0 < H) & (x1 >= 0) & (x1 < H):
                                    og = (og_b + x0 * gst[2] + y0 * gst[3] + x1 * gst[4]
                                          + y1 * gst[5])
                                    om0 = om_b + x0 * mst[2] + y0 * mst[3]
                                    om1 = om_b + x1 * mst[2] + y1 * mst[3]
                                    for _ in range(Cg):
                                        m0 = _to_acc(ldn(mptr, om0)[0], zero)
                                        m1 = ldg(mptr, om1)
                                        if use_g:
                                            gv = ldg(gptr, og)
                                            for e in range(VG):
                                                s[e] = m0 * _to_acc(m1[e], zero) + (
                                                    s[e] + _to_acc(gv[e], zero))
                                        else:
                                            for e in range(VG):
                                                s[e] = m0 * _to_acc(m1[e], zero) + s[e]
                                        og += gst[1]
                                        om0 += mst[1]
                                        om1 += mst[1]
                                pp = u * PP + (y0 + pw) * wq + y1 + pw
                                for e in range(VG):
                                    P[pp + e] = s[e]
                            n += nthr
                        cuda.syncthreads()
                        w = tid
                        while w < nt * per_plane:
                            tt, j0, j1 = _split(w, per_plane, nqv, V)
                            oo = (obase + b * ost[0] + (i0a + tt) * ost[2] + j0 * ost[3]
                                  + (i1a + tt) * ost[4] + j1 * ost[5])
                            first = ldo(optr, oo + c_first * ost[1])  # before S is formed
                            s = cuda.local.array(V, ACC)
                            for e in range(V):
                                s[e] = zero
                            for ii in range(kh):
                                pr = (tt * sh + ii * dh) * PP + j0 * sw * wq + j1 * sw
                                for ji in range(kw):
                                    q = pr + ji * dw * (wq + 1)
                                    for e in range(V):
                                        s[e] += P[q + e * sw]
                            res = cuda.local.array(V, OT)
                            cv = _to_acc(cptr[cbase + c_first * cst], zero) if has_c else cval
                            for e in range(V):
                                res[e] = _to_elem(optr, _to_acc(first[e], zero) + cv * s[e])
                            sto(optr, oo + c_first * ost[1], res, 0)
                            c0 = c_first + 1
                            while c0 < c_end:  # the chunk's other channels, as in fused
                                old = cuda.local.array(UV, OT)
                                for u in range(U):  # past the chunk: its last, never stored
                                    y = ldo(optr, oo + min(c0 + u, c_end - 1) * ost[1])
                                    for e in range(V):
                                        old[u * V + e] = y[e]
                                for u in range(U):
                                    if u == 0 or c0 + u < c_end:
                                        cv = (_to_acc(cptr[cbase + (c0 + u) * cst], zero)
                                              if has_c else cval)
                                        for e in range(V):
                                            res[e] = _to_elem(optr, _to_acc(old[u * V + e], zero)
                                                              + cv * s[e])
                                        sto(optr, oo + (c0 + u) * ost[1], res, 0)
                                c0 += U
                            w += nthr
                    xb += cuda.gridDim.x
                z += cuda.gridDim.z

        return planes

    def _make_fused_s(V, ACC, OT):
        return _make_fused(V, ACC, OT, 0)

    def _make_fused_t(V, ACC, OT):
        return _make_fused(V, ACC, OT, 1)

    def _make_planes_1(V, ACC, OT):
        return _make_planes(V, ACC, OT, 1)

    def _make_planes_vg(V, ACC, OT):  # 16 bytes of gamma and mu (out's dtype) a load
        return _make_planes(V, ACC, OT, 16 // (OT.bitwidth // 8))


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
_capacities: dict = {}  # device id -> threads resident on it at once
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
    if name == "gsum":  # T, gamma, mu
        args = (a_ptr, ptr[0], i64, t6, i64, ptr[1], i64, t4, geo, i64, A)
    elif name.startswith("fused"):  # out, gamma, mu, c (fused_t: out, c; T's type for the rest)
        o, g, m, c = (ptr[0], a_ptr, a_ptr, ptr[1]) if name == "fused_t" else ptr
        args = (o, i64, t6, g, i64, t6, i64, m, i64, t4, c, i64, i64, i64, A, a_ptr, i64, geo,
                i64, i64, A)
    elif name == "stream":  # out, c
        args = (ptr[0], i64, t6, ptr[1], i64, i64, i64, A, a_ptr, geo, i64, i64, A)
    elif name.startswith("planes"):  # out, gamma, mu, c
        o, g, m, c = ptr
        args = (o, i64, t6, g, i64, t6, i64, m, i64, t4, c, i64, i64, i64, A, geo, i64, i64,
                i64, i64, A)
    elif name == "vjp_gamma":  # grad_S, grad_gamma
        args = (ptr[0], i64, t6, ptr[1], i64, t6, geo, A)
    else:  # vjp_mu: grad_S, mu, grad_mu
        args = (ptr[0], i64, t6, ptr[1], i64, t4, ptr[2], i64, t4, geo, A)
    return nbt.void(*args)


#: The forward kernels' factories, called as factory(V, ACC, OT): vector width, the
#: accumulation type and the first pointer's element type (compile-time constants).
_FACTORIES = {"gsum": "_make_gsum", "fused": "_make_fused_s", "fused_t": "_make_fused_t",
              "stream": "_make_stream", "planes": "_make_planes_1", "planes_vg": "_make_planes_vg"}


def _kernel_function(name, elems, acc, V=1):
    """The Python function of kernel ``name`` before Numba compiles it (also what
    tests/_compile_numba_cuda.py compiles for sm_90 without a GPU)."""
    if name in _FACTORIES:
        return globals()[_FACTORIES[name]](V, getattr(nbt, acc), getattr(nbt, elems[0]))
    return {"vjp_gamma": _vjp_gamma_kernel, "vjp_mu": _vjp_mu_kernel}[name]


def _launch_bounds(name):
    """Numba's ``launch_bounds`` of kernel ``name``: (threads a block, blocks a
    multiprocessor), the registers ptxas may use; cupy's: 2 blocks for the direct
    source, 3 from T (more spills); planes: 4 (64 registers), as cc_planes'."""
    if name.startswith("planes"):
        return (_plan.THREADS, 4)
    return (_plan.THREADS, 2 if name.startswith("fused") else 1)


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


def _capacity(dev_id):
    """Threads resident on the device at once (what _plan.tiling fills)."""
    cap = _capacities.get(dev_id)
    if cap is None:
        if SIM:
            cap = 64  # a pretended small device: tiny problems split channels into chunks
        else:
            d = cuda.get_current_device()
            cap = d.MULTIPROCESSOR_COUNT * d.MAX_THREADS_PER_MULTIPROCESSOR
        _capacities[dev_id] = cap
    return cap


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


def _grid1(n, block=_plan.THREADS):
    """1-D (grid, block) for ``n`` work items, a thread each."""
    return (min(-(-n // block), _plan.MAX_GRID_X),), (block,)


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
    """A pointer for an argument a launch never reads (gamma None, c a number, T or S where
    the plan has none). On the device any address will do; the simulator copies each
    array argument back after a launch, so there it must alias no real one."""
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
#: out, gamma, mu, c, S, T, and the number c.
_OUT, _GAMMA, _MU, _C, _S, _T, _CVAL = (_Slot(i) for i in range(7))


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
            self.kernel[self.grid, self.block, 0, self.smem](*args)
        else:
            self.kernel[self.grid, self.block, stream, self.smem](*args)


class _Plan:
    """The launches of one call signature and the scratch they need: ``scratch``
    elements of the accumulation type, S first (where it goes through memory; padded to
    256 bytes), T ``t_offset`` bytes in (where S is formed from it)."""

    __slots__ = ("launches", "scratch", "t_offset")

    def __init__(self, launches, scratch=0, t_offset=0):
        self.launches, self.scratch, self.t_offset = launches, scratch, t_offset


def _current_context():
    """Handle of the CUDA context current on this thread (-1: none could be read)."""
    driver = _driver()
    err, ctx = driver.cuCtxGetCurrent()
    return int(ctx) if err == driver.CUresult.CUDA_SUCCESS else -1


def _widths(itemsize):
    return [v for v in (1, 2, 4, 8) if v * itemsize <= 16]


def _make_plan(p, dev_id):
    """The launches of one call signature (cupy's plan, through ``_plan``'s functions):
    kernels, launch sizes and every argument but the addresses and the number c."""
    acc = p.acc
    zero = np.dtype(acc).type(0) if SIM else 0.0
    B, G, H, W, Ho, Wo, kh, kw = p.B, p.G, p.H, p.W, p.Ho, p.Wo, p.kh, p.kw
    Cg, Cog, HW, HoWo = p.Ci // G, p.Co // G, p.H * p.W, p.Ho * p.Wo
    oi, mi = p.out_info, p.mu_info
    out_t, mu_t = _PTR_TYPE[oi.dtype], _PTR_TYPE[mi.dtype]
    _, obase, ost = _pointer(p.out, oi)  # base and strides (addresses: per call)
    ost = diag_strides(ost, p.full_out)
    _, mbase, mst = _pointer(p.mu, mi)
    if p.gamma is None:
        # gamma absent: its loads read mu[0, ..., 0] (a valid, cached address), as 0
        gamma_t, gsrc, has_g, gbase, gst = mu_t, _MU, 0, mbase, (0,) * 6
    else:
        gamma_t, gsrc, has_g = _PTR_TYPE[p.gamma_info.dtype], _GAMMA, 1
        _, gbase, gst = _pointer(p.gamma, p.gamma_info)
        gst = diag_strides(gst, p.full_gamma)
    if p.c_info is None:
        c_t, csrc, has_c, cbase, cst = out_t, _dummy(out_t), 0, 0, 0
    else:
        c_t, csrc, has_c = _PTR_TYPE[p.c_info.dtype], _C, 1
        _, cbase, cst = _pointer(p.c, p.c_info)
        cst = cst[0] if cst else 0  # a 0-d c broadcasts: stride 0
    geo = (B, G, Cg, Cog, H, W, Ho, Wo, kh, kw, p.sh, p.sw, p.ph, p.pw, p.dh, p.dw)
    capacity = _capacity(dev_id)
    a_size, o_size = ITEMSIZE[acc], ITEMSIZE[oi.dtype]
    # out's vector width along its (i1, j1) plane (1: any strides).
    v = vector_width(o_size, HoWo, ost[4:], (Ho, Wo), ost[:4], oi.ptr)
    src_t = not _plan.direct_source(B, G, Cg, H, W, Ho, Wo, kh, kw)
    # S through memory, then out streamed: out's rows must be contiguous.
    stream = contiguous(ost[4:], (Ho, Wo)) and _plan.stream_s(Cog, Ho, Wo)
    n_t = B * G * HW * HW if src_t else 0
    s_pad = -(-B * G * HoWo * HoWo * a_size // 256) * 256 // a_size if stream else 0
    launches = []

    def add(name, elems, V, dims, args, smem=0):
        launches.append(_Launch(name, elems, acc, V, *dims, args, smem))

    pl = (_plan.planes_for(p, ost, gst, mst, a_size, capacity)
          if src_t and _plan.by_planes(Cog) else None)
    if pl is not None:  # S from gamma through shared memory (cupy's cc_planes), in place of T
        add("planes_vg" if pl.VG > 1 else "planes", (out_t, gamma_t, mu_t, c_t), pl.V,
            (pl.grid, (_plan.THREADS,)),
            (_OUT, obase, ost, gsrc, gbase, gst, has_g, _MU, mbase, mst, csrc, cbase, cst,
             has_c, _CVAL, geo, pl.runp, pl.wq, pl.nchunk, pl.chunk, zero), pl.smem)
        return _Plan(launches)
    if src_t:  # T, V elements of gamma (and mu) a load
        if p.gamma is None:
            V = vector_width(ITEMSIZE[mi.dtype], HW, mst[2:], (H, W), mst[:2], mi.ptr)
        else:
            V = vector_width(ITEMSIZE[p.gamma_info.dtype], HW, gst[4:], (H, W), gst[:4],
                             p.gamma_info.ptr, ((ITEMSIZE[mi.dtype], mst[2:], mst[:2], mi.ptr),))
        add("gsum", (gamma_t, mu_t), V, _grid1(n_t // V),
            (_T, gsrc, gbase, gst, has_g, _MU, mbase, mst, geo, n_t // V, zero))

    def fused(o_t, V, t, osrc, obase_, ost_, csrc_, cbase_, cst_, has_c_, c_t_, geo_, to_s):
        if src_t:  # gamma and mu unread
            name, elems, src = "fused_t", (o_t, c_t_), (_dummy(acc), 0, (0,) * 6, 0,
                                                       _dummy(acc), 0, (0,) * 4)
        else:
            name, elems = "fused", (o_t, gamma_t, mu_t, c_t_)
            src = (gsrc, gbase, gst, has_g, _MU, mbase, mst)
        add(name, elems, V, (t.grid, t.block),
            (osrc, obase_, ost_, *src, csrc_, cbase_, cst_, has_c_, _CVAL,
             _T if src_t else _dummy(acc), to_s, geo_, t.nchunk, t.chunk, zero))

    if not stream:
        fused(out_t, v, _plan.tiling(B, G, Cog, Ho, Wo, v, capacity), _OUT, obase, ost, csrc,
              cbase, cst, has_c, c_t, geo, 0)
        return _Plan(launches, n_t, 0)
    # The fused kernel writes S[b, g] (contiguous, one "channel" a group, c unread), then
    # stream adds c[c0] * S into out, row by row.
    vs = max(w for w in _widths(a_size) if HoWo % w == 0)
    s_st = (G * HoWo * HoWo, HoWo * HoWo, Wo * HoWo, HoWo, Wo, 1)
    fused(acc, vs, _plan.tiling(B, G, 1, Ho, Wo, vs, capacity), _S, 0, s_st, _dummy(acc), 0,
          0, 0, acc, geo[:3] + (1,) + geo[4:], 1)
    rows = 1 if contiguous(ost[2:], (Ho, Wo, Ho, Wo)) else HoWo
    seg = HoWo * HoWo // rows
    v3 = v if rows > 1 else vector_width(o_size, seg, ost[2:], (Ho, Wo, Ho, Wo), ost[:2],
                                         oi.ptr)
    add("stream", (out_t, c_t), v3, _plan.stream_grid(B * G * Cog, rows, seg // v3),
        (_OUT, obase, ost, csrc, cbase, cst, has_c, _CVAL, _S, geo, rows, seg, zero))
    return _Plan(launches, s_pad + n_t, s_pad * a_size)


def _launch_plan(plan, kind, handle, dev_id, acc, optr, gptr, mptr, cptr, c_value):
    """Launch a plan on the stream of raw ``handle`` on ``dev_id`` (its context current):
    addresses of out, gamma, mu and c (0 for an absent gamma or a number c), and c_value,
    the number c. Scratch from the arrays' library (_workspace)."""
    stream = _numba_stream(handle)
    buf, sptr, tptr = None, 0, 0
    cai = kind == "cai"
    if plan.scratch:
        if cai:
            _release(dev_id)
        buf, sptr = _workspace(kind, dev_id, plan.scratch, acc, handle, stream)
        tptr = sptr + plan.t_offset
    values = (optr, gptr, mptr, cptr, sptr, tptr, float(c_value))
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
        if SIM:  # numpy views of the memory; scratch a numpy buffer, S then T
            optr, mptr = _sim_pointer(p.out)[0], _sim_pointer(p.mu)[0]
            gptr = None if p.gamma is None else _sim_pointer(p.gamma)[0]
            cptr = None if p.c is None else _sim_pointer(p.c)[0]
            buf = np.zeros(max(plan.scratch, 1), p.acc)
            t0 = plan.t_offset // ITEMSIZE[p.acc]
            values = (optr, gptr, mptr, cptr, buf[:max(t0, 1)], buf[t0:],
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
