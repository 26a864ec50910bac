"""``numba_cuda``: Numba CUDA kernels; the seed thread's question, answered in Numba.

Owns the ``numba.cuda`` kernels below, their compilation (lazily, once per combination of
array dtypes, cached on disk by Numba), the launch sizes for one call (read off the
device: multiprocessor count, threads and shared memory per block) and the launch itself
on the arrays' device and on their library's current stream: torch's for torch tensors,
CuPy's for CuPy arrays, the legacy default stream for other ``__cuda_array_interface__``
objects. docs/numba_cuda.md explains the design in the thread's terms.

The operation is memory-bound, so the kernels are built around the bytes SPEC section 5
counts. With ``T[b, g, x0, y0, x1, y1]`` the channel sum over group ``g`` of
``gamma[b, ci, x0, y0, ci, x1, y1] + mu[b, ci, x0, y0] * mu[b, ci, x1, y1]`` (input
positions), ``S`` is the kh x kw box filter of ``T`` along each diagonal offset:

* ``_t_kernel_*`` (body ``_t_rows``) reads the channel-diagonal of ``gamma`` exactly
  once and writes ``T`` (the one scratch array; its size is the gamma channel sum's,
  ``B * G * (H*W)**2`` accumulation-type elements). One block per pair of T rows
  (b, g, q0..q0+1), threads along the row (coalesced), eight loads of gamma in flight
  per thread. The Gram matrix of ``mu`` rides along in the same pass: the rows'
  ``mu[b, ci, x0, y0]`` are staged in dynamic shared memory once per block.
* ``_out_kernel_*`` (body ``_out_rows``): one block per row (b, g, i0, j0) of ``S``; each
  element of ``S`` is formed once from kh*kw reads of ``T`` (L1/L2 hits: ``T`` is Ci/G
  times smaller than gamma) and ``out[b, c0, i0, j0, (c0,) i1, j1] += c[c0] * S`` is
  streamed over the group's output channels, eight read-modify-writes in flight per
  thread, consecutive threads on consecutive ``(i1, j1)``; ``c`` is staged in dynamic
  shared memory. ``S`` is never stored.
* ``_fused_kernel_*`` (body ``_fused_body``) does both in one launch for small problems
  (the seed's toy): one block per (b, g, slice of output channels) builds that group's
  whole ``T`` in dynamic shared memory, sized at launch, then writes ``out`` from it.

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
explicit signature per dtype combination; the launch hands the flattened arguments to
``cuda.core.launch`` directly, which keeps a call's host time short (the seed's toy).

Under Numba's CUDA simulator (``NUMBA_ENABLE_CUDASIM=1``, CI without a GPU) the same
kernels run on the CPU: the backend then declares ``device = "cpu"`` and receives numpy
host views (bfloat16 as uint16 bits), so the shared property test can run it on tiny
shapes; pointers are then 1-D numpy views of the memory. It is never chosen
automatically for host arrays (the registry's automatic order for those is numba, numpy).

Must not: copy ``out`` or ``gamma``; synchronise the device; allocate more than ``T``
(the backward allocates nothing);
import numba.cuda before the backend is used (``import convcov`` stays GPU-free).
"""

from __future__ import annotations

import ctypes
import sys
import threading

import numpy as np

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
#: Grid sizes are capped at this many full waves of resident blocks.
WAVES = 1 if SIM else 32  # the simulator: few blocks, the grid-stride loops do the rest
#: Dynamic shared memory per block of the two-launch kernels (staged mu of the T kernel:
#: 2 rows per channel; staged c of the out kernel): small, so it never limits occupancy;
#: more channels than fit go in chunks.
STAGE_BYTES = 8192
#: The fused one-launch kernel is for problems whose per-(b, g) channel sum of gamma has at
#: most this many terms: there, launches cost more than the arithmetic.
FUSED_MAX_TERMS = 1 << 16

_ACC_BYTES = {"float32": 4, "float64": 8}

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
    else:
        from numba.cuda.extending import overload

        def _to_acc(v, zero):  # typed below, per element type, at compile time
            raise NotImplementedError

        def _store(ptr, i, v):
            raise NotImplementedError

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

# ---------------------------------------------------------------------------------------
# Device functions shared by the kernels. Index names follow SPEC section 1. Arrays are
# (pointer, base, strides): element [i, j, ...] is ptr[base + i*s0 + j*s1 + ...]; the
# channel stride of out and gamma is the channel-diagonal's (s1 + s4 for full layouts).
# geo = (B, G, Cg, Cog, H, W, Ho, Wo, kh, kw, sh, sw, ph, pw, dh, dw), Cg = Ci // G and
# Cog = Co // G. ``zero`` is 0 in the accumulation dtype (it types the sums).
# ---------------------------------------------------------------------------------------
if _IMPORT_ERROR is None:

    @cuda.jit(device=True)
    def _s_value(src, sbase, geo, i0, j0, i1, j1, zero):
        """S[b, g, i0, j0, i1, j1]: the kh x kw box filter of T = src[sbase:] along the
        diagonal offset (i1 - i0, j1 - j0); T holds (H*W)**2 values."""
        H, W, kh, kw = geo[4], geo[5], geo[8], geo[9]
        sh, sw, ph, pw, dh, dw = geo[10], geo[11], geo[12], geo[13], geo[14], geo[15]
        HW = H * W
        s = zero
        if HW == 0:
            return s
        for ii in range(kh):
            x0 = i0 * sh + ii * dh - ph
            x1 = i1 * sh + ii * dh - ph
            x_in = (x0 >= 0) & (x0 < H) & (x1 >= 0) & (x1 < H)
            # Clamped indices keep every load in bounds and unconditional, so the kh*kw
            # loads issue back to back; padded terms are then dropped by a select.
            row = sbase + (min(max(x0, 0), H - 1) * W) * HW + min(max(x1, 0), H - 1) * W
            for ji in range(kw):
                y0 = j0 * sw + ji * dw - pw
                y1 = j1 * sw + ji * dw - pw
                v = src[row + min(max(y0, 0), W - 1) * HW + min(max(y1, 0), W - 1)]
                if x_in & (y0 >= 0) & (y0 < W) & (y1 >= 0) & (y1 < W):
                    s += v
        return s

    @cuda.jit(device=True)
    def _stage_c(cs, n, cptr, cbase, cst, has_c, cval, c_first, zero):
        """cs[e] = c[c_first + e] (or the number c) for e < n, by the whole block."""
        e = cuda.threadIdx.x
        while e < n:
            cs[e] = _to_acc(cptr[cbase + (c_first + e) * cst], zero) if has_c else cval
            e += cuda.blockDim.x

    @cuda.jit(device=True)
    def _add_to_channels(optr, o, osc, cs, n, s, zero):
        """optr[o + k*osc] += cs[k] * s for k < n: one (i0, j0, i1, j1) of n channels."""
        k = 0
        # Eight channels at a time: all eight loads are issued before the first store (the
        # compiler cannot reorder them itself: it cannot prove the channels are distinct).
        # 16-wide batches (80 registers, 3 blocks per multiprocessor) measured no faster.
        while k + 8 <= n:
            v0 = _to_acc(optr[o], zero)
            v1 = _to_acc(optr[o + osc], zero)
            v2 = _to_acc(optr[o + 2 * osc], zero)
            v3 = _to_acc(optr[o + 3 * osc], zero)
            v4 = _to_acc(optr[o + 4 * osc], zero)
            v5 = _to_acc(optr[o + 5 * osc], zero)
            v6 = _to_acc(optr[o + 6 * osc], zero)
            v7 = _to_acc(optr[o + 7 * osc], zero)
            _store(optr, o, v0 + cs[k] * s)
            _store(optr, o + osc, v1 + cs[k + 1] * s)
            _store(optr, o + 2 * osc, v2 + cs[k + 2] * s)
            _store(optr, o + 3 * osc, v3 + cs[k + 3] * s)
            _store(optr, o + 4 * osc, v4 + cs[k + 4] * s)
            _store(optr, o + 5 * osc, v5 + cs[k + 5] * s)
            _store(optr, o + 6 * osc, v6 + cs[k + 6] * s)
            _store(optr, o + 7 * osc, v7 + cs[k + 7] * s)
            o += 8 * osc
            k += 8
        while k < n:
            _store(optr, o, _to_acc(optr[o], zero) + cs[k] * s)
            o += osc
            k += 1

    # -------------------------------------------------------------------------------------
    # The two-launch path. One block per row of the result (a fixed (b, g, q0) of T, a
    # fixed (b, g, i0, j0) of S), threads along the row: the row's indices are
    # block-uniform, consecutive threads touch consecutive (x1, y1) / (i1, j1), so every
    # access to gamma, T and out is coalesced, and a thread divides only its own column
    # index. Blocks walk the rows with the grid's stride (any number of rows fits any
    # grid; the stride is block-uniform, so every thread meets every barrier).
    # -------------------------------------------------------------------------------------

    @cuda.jit(device=True)
    def _t_rows(ms, tptr, gptr, gbase, gst, has_g, mptr, mbase, mst, geo, cap, zero):
        """Rows q0, q0+1 of T for one (b, g) per block: tptr[((b*G + g)*HW + q0)*HW + q1].

        gamma is streamed, eight loads in flight per thread (two rows, four channels).
        The two rows of a thread share its load of mu[b, ci, x1, y1]; their
        mu[b, ci, x0, y0], the same for the whole block, come from shared memory (``ms``,
        ``cap`` channels x 2 rows, converted once). More than ``cap`` channels (only for
        huge Ci / G) go in chunks, adding into the T rows already written.
        """
        B, G, Cg = geo[0], geo[1], geo[2]
        H, W = geo[4], geo[5]
        HW = H * W
        row_blocks = (HW + 1) // 2
        tid = cuda.threadIdx.x
        nt = cuda.blockDim.x
        gsc, msc = gst[1], mst[1]
        blk = cuda.blockIdx.x
        while blk < B * G * row_blocks:
            bg = blk // row_blocks
            q0 = (blk - bg * row_blocks) * 2
            b = bg // G
            g = bg - b * G
            two = q0 + 1 < HW  # block-uniform: is there a second row?
            qb = q0 + 1 if two else q0  # a missing second row repeats the first: never stored
            xa, xb = q0 // W, qb // W
            gbg = gbase + b * gst[0] + g * Cg * gsc
            ga = gbg + xa * gst[2] + (q0 - xa * W) * gst[3]
            gb = gbg + xb * gst[2] + (qb - xb * W) * gst[3]
            mbg = mbase + b * mst[0] + g * Cg * msc
            trow = (bg * HW + q0) * HW
            c_start = 0
            while True:  # channel chunks; one pass when Cg <= cap (always, in practice)
                n = min(cap, Cg - c_start)
                cuda.syncthreads()  # the previous chunk or row is done reading ms
                e = tid
                while e < 2 * n:
                    qr = qb if e % 2 else q0
                    xr = qr // W
                    ms[e] = _to_acc(mptr[mbg + (c_start + e // 2) * msc + xr * mst[2]
                                         + (qr - xr * W) * mst[3]], zero)
                    e += nt
                cuda.syncthreads()
                q1 = tid
                while q1 < HW:
                    x1 = q1 // W
                    y1 = q1 - x1 * W
                    if c_start == 0:
                        ta = tb = zero
                        if has_g:
                            oa = ga + x1 * gst[4] + y1 * gst[5]
                            ob = oa + (gb - ga)
                            last = Cg - 1
                            ci = 0
                            # Four channels a step; past the last channel the address is
                            # clamped (in bounds) and a select drops the value: no
                            # remainder loop, whose unrolled copies would cost registers.
                            while ci < Cg:
                                o1 = min(ci + 1, last) - ci
                                o2 = min(ci + 2, last) - ci
                                o3 = min(ci + 3, last) - ci
                                va = _to_acc(gptr[oa], zero)
                                vb = _to_acc(gptr[ob], zero)
                                wa = _to_acc(gptr[oa + o1 * gsc], zero)
                                wb = _to_acc(gptr[ob + o1 * gsc], zero)
                                xa_ = _to_acc(gptr[oa + o2 * gsc], zero)
                                xb_ = _to_acc(gptr[ob + o2 * gsc], zero)
                                ya = _to_acc(gptr[oa + o3 * gsc], zero)
                                yb = _to_acc(gptr[ob + o3 * gsc], zero)
                                if ci + 4 > Cg:
                                    if o3 == o2:
                                        ya = yb = zero
                                    if o2 == o1:
                                        xa_ = xb_ = zero
                                    if o1 == 0:
                                        wa = wb = zero
                                ta += (va + wa) + (xa_ + ya)
                                tb += (vb + wb) + (xb_ + yb)
                                oa += 4 * gsc
                                ob += 4 * gsc
                                ci += 4
                    else:
                        ta = tptr[trow + q1]
                        tb = tptr[trow + (HW if two else 0) + q1]
                    m1 = mbg + c_start * msc + x1 * mst[2] + y1 * mst[3]
                    for k in range(n):
                        u = _to_acc(mptr[m1], zero)
                        ta += ms[2 * k] * u
                        tb += ms[2 * k + 1] * u
                        m1 += msc
                    tptr[trow + q1] = ta
                    if two:
                        tptr[trow + HW + q1] = tb
                    q1 += nt
                c_start += n
                if c_start >= Cg:
                    break
            blk += cuda.gridDim.x

    @cuda.jit(device=True)
    def _out_rows(cs, optr, obase, ost, cptr, cbase, cst, has_c, cval, tptr, geo, cap, zero):
        """One row (b, g, i0, j0) of S per block: each S element formed once from T and
        added to every output channel of the group (c staged in shared memory, ``cap``
        channels at a time)."""
        B, G, Cog = geo[0], geo[1], geo[3]
        H, W, Ho, Wo = geo[4], geo[5], geo[6], geo[7]
        HW = H * W
        P = Ho * Wo
        osc = ost[1]
        tid = cuda.threadIdx.x
        nt = cuda.blockDim.x
        blk = cuda.blockIdx.x
        while blk < B * G * P:
            bg = blk // P
            p0 = blk - bg * P
            b = bg // G
            g = bg - b * G
            i0 = p0 // Wo
            j0 = p0 - i0 * Wo
            orow = obase + b * ost[0] + i0 * ost[2] + j0 * ost[3]
            c_start = 0
            while c_start < Cog:
                n = min(cap, Cog - c_start)
                cuda.syncthreads()  # the previous chunk or row is done reading cs
                _stage_c(cs, n, cptr, cbase, cst, has_c, cval, g * Cog + c_start, zero)
                cuda.syncthreads()
                p1 = tid
                while p1 < P:
                    i1 = p1 // Wo
                    j1 = p1 - i1 * Wo
                    s = _s_value(tptr, bg * HW * HW, geo, i0, j0, i1, j1, zero)
                    _add_to_channels(optr, orow + (g * Cog + c_start) * osc + i1 * ost[4]
                                     + j1 * ost[5], osc, cs, n, s, zero)
                    p1 += nt
                c_start += n
            blk += cuda.gridDim.x

    # -------------------------------------------------------------------------------------
    # The one-launch path for small problems: one block per (b, g, slice of the group's
    # output channels) builds that group's whole T in dynamic shared memory, then writes
    # out from it. The dynamic buffer holds T ((H*W)**2 values) then the slice's c values.
    # -------------------------------------------------------------------------------------

    @cuda.jit(device=True)
    def _t_value(gptr, gbase, gst, has_g, mptr, mbase, mst, b, g, Cg, x0, y0, x1, y1, zero):
        """T[b, g, x0, y0, x1, y1] (input positions, all inside the image)."""
        t = zero
        if has_g:
            go = (gbase + b * gst[0] + g * Cg * gst[1] + x0 * gst[2] + y0 * gst[3]
                  + x1 * gst[4] + y1 * gst[5])
            for ci in range(Cg):
                t += _to_acc(gptr[go + ci * gst[1]], zero)
        mb = mbase + b * mst[0] + g * Cg * mst[1]
        m0 = mb + x0 * mst[2] + y0 * mst[3]
        m1 = mb + x1 * mst[2] + y1 * mst[3]
        for ci in range(Cg):
            t += _to_acc(mptr[m0 + ci * mst[1]], zero) * _to_acc(mptr[m1 + ci * mst[1]], zero)
        return t

    @cuda.jit(device=True)
    def _fused_body(buf, optr, obase, ost, gptr, gbase, gst, has_g, mptr, mbase, mst,
                    cptr, cbase, cst, has_c, cval, geo, chunk, zero):
        G, Cg, Cog = geo[1], geo[2], geo[3]
        H, W, Ho, Wo = geo[4], geo[5], geo[6], geo[7]
        HW = H * W
        P = Ho * Wo
        parts = (Cog + chunk - 1) // chunk
        bg = cuda.blockIdx.x // parts
        c_lo = (cuda.blockIdx.x - bg * parts) * chunk
        n = min(chunk, Cog - c_lo)
        b = bg // G
        g = bg - b * G
        ts = buf[:HW * HW]
        cs = buf[HW * HW:]
        tid = cuda.threadIdx.x
        nt = cuda.blockDim.x
        q = tid
        while q < HW * HW:
            q0 = q // HW
            q1 = q - q0 * HW
            x0 = q0 // W
            x1 = q1 // W
            ts[q] = _t_value(gptr, gbase, gst, has_g, mptr, mbase, mst, b, g, Cg,
                             x0, q0 - x0 * W, x1, q1 - x1 * W, zero)
            q += nt
        _stage_c(cs, n, cptr, cbase, cst, has_c, cval, g * Cog + c_lo, zero)
        cuda.syncthreads()
        osc = ost[1]
        obg = obase + b * ost[0] + (g * Cog + c_lo) * osc
        p = tid
        while p < P * P:
            p0 = p // P
            p1 = p - p0 * P
            i0 = p0 // Wo
            i1 = p1 // Wo
            j0 = p0 - i0 * Wo
            j1 = p1 - i1 * Wo
            s = _s_value(ts, 0, geo, i0, j0, i1, j1, zero)
            _add_to_channels(optr, obg + i0 * ost[2] + j0 * ost[3] + i1 * ost[4] + j1 * ost[5],
                             osc, cs, n, s, zero)
            p += nt

    # Dynamic shared memory has one element type per kernel, fixed at compile time: one
    # thin kernel per accumulation dtype around each body.
    def _t_kernel_f32(tptr, gptr, gbase, gst, has_g, mptr, mbase, mst, geo, cap, zero):
        ms = cuda.shared.array(0, numba.float32)
        _t_rows(ms, tptr, gptr, gbase, gst, has_g, mptr, mbase, mst, geo, cap, zero)

    def _t_kernel_f64(tptr, gptr, gbase, gst, has_g, mptr, mbase, mst, geo, cap, zero):
        ms = cuda.shared.array(0, numba.float64)
        _t_rows(ms, tptr, gptr, gbase, gst, has_g, mptr, mbase, mst, geo, cap, zero)

    def _out_kernel_f32(optr, obase, ost, cptr, cbase, cst, has_c, cval, tptr, geo, cap, zero):
        cs = cuda.shared.array(0, numba.float32)
        _out_rows(cs, optr, obase, ost, cptr, cbase, cst, has_c, cval, tptr, geo, cap, zero)

    def _out_kernel_f64(optr, obase, ost, cptr, cbase, cst, has_c, cval, tptr, geo, cap, zero):
        cs = cuda.shared.array(0, numba.float64)
        _out_rows(cs, optr, obase, ost, cptr, cbase, cst, has_c, cval, tptr, geo, cap, zero)

    def _fused_kernel_f32(optr, obase, ost, gptr, gbase, gst, has_g, mptr, mbase, mst,
                          cptr, cbase, cst, has_c, cval, geo, chunk, zero):
        buf = cuda.shared.array(0, numba.float32)
        _fused_body(buf, optr, obase, ost, gptr, gbase, gst, has_g, mptr, mbase, mst,
                    cptr, cbase, cst, has_c, cval, geo, chunk, zero)

    def _fused_kernel_f64(optr, obase, ost, gptr, gbase, gst, has_g, mptr, mbase, mst,
                          cptr, cbase, cst, has_c, cval, geo, chunk, zero):
        buf = cuda.shared.array(0, numba.float64)
        _fused_body(buf, optr, obase, ost, gptr, gbase, gst, has_g, mptr, mbase, mst,
                    cptr, cbase, cst, has_c, cval, geo, chunk, zero)

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
                for ci in range(Cg):  # the same value for each channel of the group
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
_compiled: dict = {}  # (kernel name, element types) -> compiled kernel
_device_kernels: dict = {}  # (kernel name, element types, device id) -> cuda.core kernel
_streams: dict = {}  # stream handle -> cuda.core Stream (a non-owning wrapper)
_limits: dict = {}  # device id -> Limits


def _signature(name, elems, acc):
    """Numba signature of kernel ``name``; ``elems`` are the pointers' element type names."""
    i64, A = nbt.int64, getattr(nbt, acc)
    ptr = [nbt.CPointer(getattr(nbt, e)) for e in elems]
    t6, t4, geo = nbt.UniTuple(i64, 6), nbt.UniTuple(i64, 4), nbt.UniTuple(i64, 16)
    if name == "t":  # T, gamma, mu
        args = (nbt.CPointer(A), ptr[0], i64, t6, i64, ptr[1], i64, t4, geo, i64, A)
    elif name == "out":  # out, c
        args = (ptr[0], i64, t6, ptr[1], i64, i64, i64, A, nbt.CPointer(A), geo, i64, A)
    elif name == "fused":  # out, gamma, mu, c
        args = (ptr[0], i64, t6, ptr[1], i64, t6, i64, ptr[2], i64, t4,
                ptr[3], i64, i64, i64, A, geo, i64, A)
    elif name == "vjp_gamma":  # grad_S, grad_gamma
        args = (ptr[0], i64, t6, ptr[1], i64, t6, geo, A)
    else:  # vjp_mu: grad_S, mu, grad_mu
        args = (ptr[0], i64, t6, ptr[1], i64, t4, ptr[2], i64, t4, geo, A)
    return nbt.void(*args)


def _kernel(name, elems, acc):
    """The compiled kernel ``name`` for these pointer element types (compiled once)."""
    key = (name, elems, acc)
    k = _compiled.get(key)
    if k is None:
        with _lock:
            k = _compiled.get(key)
            if k is None:
                f64 = acc == "float64"
                fn = {"t": _t_kernel_f64 if f64 else _t_kernel_f32,
                      "out": _out_kernel_f64 if f64 else _out_kernel_f32,
                      "fused": _fused_kernel_f64 if f64 else _fused_kernel_f32,
                      "vjp_gamma": _vjp_gamma_kernel, "vjp_mu": _vjp_mu_kernel}[name]
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

    def __init__(self, sms, threads_per_sm, shared_per_block):
        self.sms = sms
        self.threads_per_sm = threads_per_sm
        self.shared_per_block = shared_per_block

    def grid(self, n_blocks, block):
        """Blocks to launch for ``n_blocks`` rows of work (the kernels loop over rows with
        the grid's stride): all of them up to WAVES full waves of the device, so that the
        hardware's block scheduler evens out the tail, and a loop beyond that."""
        resident = self.sms * max(1, self.threads_per_sm // block)
        return max(1, min(n_blocks, resident * WAVES))


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
            lim = Limits(2, 2 * THREADS, 48 * 1024)
        else:
            d = cuda.get_current_device()
            lim = Limits(d.MULTIPROCESSOR_COUNT, d.MAX_THREADS_PER_MULTIPROCESSOR,
                         d.MAX_SHARED_MEMORY_PER_BLOCK)
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


def _diag_strides(st, full):
    """Strides (b, channel-diagonal, x0, y0, x1, y1) of a full (7-d) or diagonal layout."""
    if full:
        return (st[0], st[1] + st[4], st[2], st[3], st[5], st[6])
    return tuple(st)


def _stream_handle(p):
    """The handle of the arrays' library's current stream on their device."""
    dev = p.device[1]
    if p.kind == "torch":
        return sys.modules["torch"].cuda.current_stream(dev).cuda_stream
    if p.kind == "cupy":
        return sys.modules["cupy"].cuda.get_current_stream(-1 if dev is None else dev).ptr
    return 0  # other CUDA arrays: the legacy default stream, ordered with blocking streams


def _core_stream(handle):
    """A cuda.core view of a stream handle (owns nothing, so one per handle is reused)."""
    s = _streams.get(handle)
    if s is None:
        from cuda.core import Stream

        if len(_streams) > 1024:  # streams come and go: keep the table bounded
            _streams.clear()
        s = _streams[handle] = Stream.from_handle(handle)
    return s


def _workspace(p, n, acc):
    """Scratch array for T of ``n`` elements, from the arrays' own library (stream-ordered
    caching allocators for torch and CuPy), and its device address."""
    n = max(n, 1)
    if p.kind == "torch":
        torch = sys.modules["torch"]
        t = torch.empty(n, dtype=getattr(torch, acc), device=p.out.device)
        return t, t.data_ptr()
    if p.kind == "cupy":
        cupy = sys.modules["cupy"]
        with cupy.cuda.Device(p.device[1]):
            t = cupy.empty(n, dtype=acc)
        return t, t.data.ptr
    t = cuda.device_array(n, dtype=acc)
    return t, t.__cuda_array_interface__["data"][0]


def _flatten(args, acc_ctype):
    """Kernel arguments as cuda.core takes them: tuples spread out (as Numba's ABI does),
    ints as 64-bit (pointers and int64 alike), floats as the accumulation type."""
    flat = []
    for a in args:
        if isinstance(a, tuple):
            flat.extend(a if min(a, default=0) >= 0 else [ctypes.c_int64(v) for v in a])
        elif isinstance(a, float):
            flat.append(acc_ctype(a))
        else:
            flat.append(a if a >= 0 else ctypes.c_int64(a))  # negative: strides of views
    return flat


def _overload(name, elems, acc):
    """Numba's compiled kernel object (the dispatcher has exactly one signature)."""
    return next(iter(_kernel(name, elems, acc).overloads.values()))


def _device_kernel(name, elems, acc, dev_id):
    """The cuda.core kernel of a compiled kernel, loaded into the current device's context."""
    key = (name, elems, acc, dev_id)
    k = _device_kernels.get(key)
    if k is None:
        overload = _overload(name, elems, acc)
        with _lock:
            k = _device_kernels.get(key)
            if k is None:
                k = _device_kernels[key] = overload._codelibrary.get_cufunc().kernel
    return k


#: Launch through cuda.core with the arguments flattened here, rather than through Numba's
#: per-argument marshalling in Python (~40 arguments a launch); False selects Numba's own
#: launch path (same kernels, same arguments: the H200 run checked both give equal bits).
FAST_LAUNCH = True


def _launch(name, elems, acc, dev_id, grid, block, shmem, stream, args):
    if SIM:
        _kernel(name, elems, acc)[grid, block, 0, shmem](*args)
        return
    if not FAST_LAUNCH:
        _overload(name, elems, acc).launch(args, (grid, 1, 1), (block, 1, 1), stream, shmem)
        return
    from cuda.core import LaunchConfig, launch

    kernel = _device_kernel(name, elems, acc, dev_id)
    cfg = LaunchConfig(grid=(grid, 1, 1), block=(block, 1, 1), shmem_size=shmem)
    launch(stream, cfg, kernel,
           *_flatten(args, ctypes.c_float if acc == "float32" else ctypes.c_double))


def _fused_chunk(p, lim):
    """Output channels per block of the one-launch kernel, or 0 when it does not apply:
    T of one (b, g) must fit in shared memory, and be cheap to build (small problems)."""
    HW = p.H * p.W
    Cog = p.Co // p.G
    room = lim.shared_per_block // _ACC_BYTES[p.acc] - HW * HW
    if room < 1 or (p.Ci // p.G) * HW * HW > FUSED_MAX_TERMS:
        return 0
    # Split a group's output channels over several blocks when there are fewer (b, g)
    # pairs than multiprocessors (each block rebuilds the small T).
    parts = max(1, min(Cog, -(-2 * lim.sms // (p.B * p.G))))
    chunk = -(-Cog // parts)
    return chunk if chunk <= room else 0


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
    def _on_device(run, call) -> None:
        """run(call, device id) on the call's device (None under the simulator)."""
        if SIM:
            run(call, None)
            return
        dev = call.device[1]
        if dev is None:  # a CUDA array of unknown device: Numba's current one
            run(call, cuda.get_current_device().id)
            return
        with cuda.gpus[dev]:
            run(call, dev)

    def accumulate(self, p) -> None:
        self._on_device(self._run, p)

    def _run(self, p, dev_id):
        acc = p.acc
        zero = np.dtype(acc).type(0) if SIM else 0.0
        lim = _device_limits(dev_id)
        out_t = _PTR_TYPE[p.out_info.dtype]
        mu_t = _PTR_TYPE[p.mu_info.dtype]
        optr, obase, ost = _pointer(p.out, p.out_info)
        ost = _diag_strides(ost, p.full_out)
        mptr, mbase, mst = _pointer(p.mu, p.mu_info)
        if p.gamma is None:  # never read: any valid address of a compiled type will do
            gamma_t, has_g, (gptr, gbase, gst) = mu_t, 0, (_dummy(mptr, mu_t), mbase, (0,) * 6)
        else:
            gamma_t, has_g = _PTR_TYPE[p.gamma_info.dtype], 1
            gptr, gbase, gst = _pointer(p.gamma, p.gamma_info)
            gst = _diag_strides(gst, p.full_gamma)
        if p.c_info is None:  # a number: the pointer is a dummy that is never read
            c_t, has_c, cptr, cbase, cst = out_t, 0, _dummy(optr, out_t), 0, 0
        else:
            c_t, has_c = _PTR_TYPE[p.c_info.dtype], 1
            cptr, cbase, cst = _pointer(p.c, p.c_info)
            cst = cst[0] if cst else 0  # a 0-d c broadcasts: stride 0
        cval = np.dtype(acc).type(p.c_value) if SIM else float(p.c_value)
        geo = (p.B, p.G, p.Ci // p.G, p.Co // p.G, p.H, p.W, p.Ho, p.Wo, p.kh, p.kw,
               p.sh, p.sw, p.ph, p.pw, p.dh, p.dw)
        HW = p.H * p.W
        stream = None if SIM else _core_stream(_stream_handle(p))

        Cog = p.Co // p.G
        abytes = _ACC_BYTES[acc]
        chunk = _fused_chunk(p, lim)
        if chunk:
            args = (optr, obase, ost, gptr, gbase, gst, has_g, mptr, mbase, mst,
                    cptr, cbase, cst, has_c, cval, geo, chunk, zero)
            _launch("fused", (out_t, gamma_t, mu_t, c_t), acc, dev_id,
                    p.B * p.G * -(-Cog // chunk), THREADS, (HW * HW + chunk) * abytes,
                    stream, args)
            return

        stage = min(STAGE_BYTES, lim.shared_per_block)
        n_t = p.B * p.G * HW * HW
        if SIM:
            tbuf = np.empty(max(n_t, 1), acc)
            tptr = tbuf
        else:
            tbuf, tptr = _workspace(p, n_t, acc)
        if n_t:
            cap = max(1, min(p.Ci // p.G, stage // (2 * abytes)))
            block = _block(HW)
            _launch("t", (gamma_t, mu_t), acc, dev_id,
                    lim.grid(p.B * p.G * -(-HW // 2), block), block, 2 * cap * abytes, stream,
                    (tptr, gptr, gbase, gst, has_g, mptr, mbase, mst, geo, cap, zero))
        P = p.Ho * p.Wo
        block = _block(P)
        cap = max(1, min(Cog, stage // abytes))
        _launch("out", (out_t, c_t), acc, dev_id, lim.grid(p.B * p.G * P, block), block,
                cap * abytes, stream,
                (optr, obase, ost, cptr, cbase, cst, has_c, cval, tptr, geo, cap, zero))
        del tbuf  # freed to the library's stream-ordered pool after the launches

    def patch_moment_vjp(self, a) -> None:
        """The backward (docs/autograd.md, docs/numba_cuda.md "Backward"): one launch for
        the gamma gradient, one for the mu gradient, each only when wanted, on the
        arrays' library's current stream; no scratch, no synchronisation."""
        self._on_device(self._run_vjp, a)

    def _run_vjp(self, a, dev_id):
        acc = a.acc
        zero = np.dtype(acc).type(0) if SIM else 0.0
        lim = _device_limits(dev_id)
        stream = None if SIM else _core_stream(_stream_handle(a))
        G, Cg, HW = a.G, a.Ci // a.G, a.H * a.W
        geo = (a.B, G, Cg, 0, a.H, a.W, a.Ho, a.Wo, a.kh, a.kw,
               a.sh, a.sw, a.ph, a.pw, a.dh, a.dw)
        s_t = _PTR_TYPE[a.grad_S_info.dtype]
        sptr, sbase, sst = _pointer(a.grad_S, a.grad_S_info)
        if a.grad_gamma is not None:
            g_t = _PTR_TYPE[a.grad_gamma_info.dtype]
            gptr, gbase, gst = _pointer(a.grad_gamma, a.grad_gamma_info)
            gst = _diag_strides(gst, a.full_gamma)
            block = _block(HW)
            _launch("vjp_gamma", (s_t, g_t), acc, dev_id, lim.grid(a.B * G * HW, block),
                    block, 0, stream, (sptr, sbase, sst, gptr, gbase, gst, geo, zero))
        if a.grad_mu is not None:
            m_t, d_t = _PTR_TYPE[a.mu_info.dtype], _PTR_TYPE[a.grad_mu_info.dtype]
            mptr, mbase, mst = _pointer(a.mu, a.mu_info)
            dptr, dbase, dst = _pointer(a.grad_mu, a.grad_mu_info)
            block = _block(HW)
            n_blocks = a.B * G * -(-Cg // 4) * -(-HW // block)
            _launch("vjp_mu", (s_t, m_t, d_t), acc, dev_id, lim.grid(n_blocks, block), block,
                    0, stream, (sptr, sbase, sst, mptr, mbase, mst, dptr, dbase, dst, geo,
                                zero))


backend = NumbaCudaBackend()
