"""``numba``: the fused, parallel CPU kernel; the default backend for host arrays.

Owns the Numba CPU implementation of SPEC section 1 and its run-time rules: how arrays
reach the kernel, which code is compiled, and how calls run on Numba's threading layer.

How it computes (docs/numba.md has the design notes and the measurements):

* One S row ``S[b, g, i0, j0, :, :]`` at a time, in a thread-local buffer, is added, times
  ``c[c0]``, into every output channel of the group; S never exists in memory. A term
  with a position in the padding is skipped, never multiplied: an Inf next to the padding
  stays an Inf. Two plans build the row, chosen per call signature (``_direct_plan``):
* The M plan, for windows that overlap a lot (stride 1): one chunk of ``(b, g)`` pairs at
  a time, in two parallel phases. Phase 1 builds, per pair, the group's input second
  moment on the channel diagonal, ``M[x0, y0, x1, y1] = sum over ci in g of
  gamma[b, ci, x0, y0, (ci,) x1, y1] + mu[b, ci, x0, y0] * mu[b, ci, x1, y1]``: each gamma
  element is read once, in its contiguous ``(x1, y1)`` plane, four channels per pass, and
  summed into a cache-sized buffer. Phase 2 is the kh x kw box filter: the row is the sum
  of the ``M[x0, y0]`` windows of the kernel offsets whose two positions both lie inside
  the input. With unit column stride M's planes hold the padding as zeros, so that every
  window is one contiguous run, summed four windows a pass.
* The direct plan, with no M: phase 2 alone, each row summed straight from the strided
  windows of gamma's channel-diagonal planes and of mu (four channels per pass). Its only
  temporaries are the per-thread rows. It reads ``kh*kw*Cg*(Ho*Wo)**2`` terms per pair
  where the M plan reads ``Cg*(H*W)**2`` into an ``(H*W)**2`` buffer, which it writes
  and reads ``kh*kw*(Ho*Wo)**2`` of back; a direct term costs about ``DIRECT_COST``
  contiguous ones, so it is taken when ``DIRECT_COST*Cg*kh*kw*(Ho*Wo)**2 <
  (Cg + 1)*(H*W)**2 + kh*kw*(Ho*Wo)**2`` (strides above 1, inputs much larger than the
  output, or few channels a group). The M plan's buffer, where it is used, is so below
  ``DIRECT_COST*kh*kw`` S blocks of one pair: it never grows with ``(H*W)**2`` past what
  the call computes.
* Parallel over ``(pair, x0)`` in phase 1 and ``(pair, i0)`` in phase 2: both cores are
  busy even for B = 1, G = 1. The channel-diagonal planes of gamma and rows of out are
  short and far apart, so the kernel prefetches a few kilobytes ahead in software.
* Arrays reach the kernel as raw addresses plus strides in elements (the front end's
  ``ArrayInfo``) and a dtype code, so the compiled code depends on no layout, stride,
  shape or input dtype: full and diagonal layouts are just strides (the channel diagonal
  of a full array has stride ``s_c + s_c'``), negative strides are plain pointer
  arithmetic, and the dtype code picks an inner loop at run time. The one specialisation
  is the accumulation dtype (float32 or float64): two compiles, cached on disk.
* float16 is converted by the CPU (F16C / Arm fcvt; an exact integer version elsewhere),
  bfloat16 by integer arithmetic (Numba has no 16-bit float arithmetic on the CPU). Sums
  run in float32 (float64 when an input is float64) and are rounded once into ``out``,
  to nearest even. From float64, the value is first rounded to float32 *to odd*, which
  makes the two steps equal to one correct rounding.

The backward (``patch_moment_vjp``, docs/autograd.md) is a second kernel of the same
build, parallel over ``(pair, x0)``: one row ``D[x0, y0, :, :]`` at a time, in a
thread-local buffer, is gathered from the grad_S windows (the forward's box filter
transposed; padded terms absent) and stored into every channel of the group's gamma
gradient (non-temporal stores when large). ``grad_mu`` reads ``grad_S + grad_S^T`` (a
chunk of pairs, as large as grad_S's blocks): either by rows, the row of the symmetrised
``D`` gathered the same way and dotted with mu's planes (a non-finite result is formed
again window by window, as the reference's products), or, where the input is much larger
than the output (``_vjp_windows``), window by window only. No temporary grows with
``(H*W)**2``. Sums always in float64: one compile.

Threads: the kernel releases the GIL. It relies on a thread-safe Numba threading layer
(``tbb`` or ``omp``, Numba's default order); if Numba ends up on ``workqueue``, which
aborts on concurrent use, this module serialises its calls. GNU OpenMP kills a forked
child that starts a parallel region after its parent used one, so such a child runs a
serial compile of the same kernel.

Must not: validate (the front end did), copy ``out`` or ``gamma``, allocate anything that
grows with ``Ci * Ci`` or ``Co`` (or with ``(H*W)**2`` where the output is smaller), or
change Numba's process-wide configuration.
"""
from __future__ import annotations

import os
import platform
import threading
from types import FunctionType

import numba
import numpy as np
from llvmlite import binding as llvm_binding
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic, overload

from .._arrays import ITEMSIZE as _ITEMSIZE, diag_strides
from .._registry import Backend

# ---------------------------------------------------------------------------------------
# Raw memory access. The front end hands over checked addresses and element strides;
# reading through typed pointers lets one compiled kernel serve every layout and dtype.

F16, BF16, F32, F64, ABSENT = 0, 1, 2, 3, -1
_CODE = {"float16": F16, "bfloat16": BF16, "float32": F32, "float64": F64}


def _pointer_to(nbtype):
    @intrinsic
    def pointer(typingctx, addr):
        def codegen(context, builder, sig, args):
            return builder.inttoptr(args[0], context.get_value_type(sig.return_type))

        return types.CPointer(nbtype)(addr), codegen

    return pointer


_u16_at = _pointer_to(types.uint16)  # float16 and bfloat16 are handled as their bits
_f32_at = _pointer_to(types.float32)
_f64_at = _pointer_to(types.float64)


@intrinsic
def _bits(typingctx, x):
    """float32 -> its bits, zero-extended to int64 (int64 keeps Numba's integer typing simple)."""

    def codegen(context, builder, sig, args):
        return builder.zext(builder.bitcast(args[0], ir.IntType(32)), ir.IntType(64))

    return types.int64(types.float32), codegen


@intrinsic
def _from_bits(typingctx, x):
    """Low 32 bits of an int64 -> the float32 with those bits."""

    def codegen(context, builder, sig, args):
        return builder.bitcast(builder.trunc(args[0], ir.IntType(32)), ir.FloatType())

    return types.float32(types.int64), codegen


@intrinsic
def _data(typingctx, arr):
    """Typed pointer to an array's first element. The kernel's own buffers are indexed
    through pointers too: a slice costs a reference count and bounds arithmetic, and an
    index into an array costs a negative-index check that stops LLVM from vectorising."""
    if not isinstance(arr, types.Array):
        return None

    def codegen(context, builder, sig, args):
        return context.make_array(sig.args[0])(context, builder, args[0]).data

    return types.CPointer(arr.dtype)(arr), codegen


@intrinsic
def _offset(typingctx, ptr, k):
    """``ptr + k`` elements."""
    if not isinstance(ptr, types.CPointer):
        return None

    def codegen(context, builder, sig, args):
        return builder.gep(args[0], [args[1]])

    return ptr(ptr, k), codegen


@intrinsic
def _store_nt(typingctx, ptr, k, value):
    """``ptr[k] = value`` as a non-temporal store (no read-for-ownership of the line)."""
    if not isinstance(ptr, types.CPointer) or value != ptr.dtype:
        return None

    def codegen(context, builder, sig, args):
        st = builder.store(args[2], builder.gep(args[0], [args[1]]))
        st.set_metadata("nontemporal", builder.module.add_metadata([ir.IntType(32)(1)]))
        return context.get_dummy_value()

    return types.none(ptr, k, value), codegen


@intrinsic
def _address_at(typingctx, ptr, k):
    """The byte address of ``ptr[k]``."""
    if not isinstance(ptr, types.CPointer):
        return None

    def codegen(context, builder, sig, args):
        return builder.ptrtoint(builder.gep(args[0], [args[1]]), ir.IntType(64))

    return types.int64(ptr, k), codegen


@intrinsic
def _axpy8_nt(typingctx, w, p, k, s, j, a):
    """``w[k:k+8] = p[k:k+8] + a * s[j:j+8]`` in float32 as one 32-byte non-temporal store
    (``w + k`` 32-byte aligned): LLVM stores a scalar loop's non-temporal values one at a
    time, this stores eight."""
    f32 = types.float32
    if not all(isinstance(x, types.CPointer) and x.dtype == f32 for x in (w, p, s)) or a != f32:
        return None

    def codegen(context, builder, sig, args):
        w_, p_, k_, s_, j_, a_ = args
        vt = ir.VectorType(ir.FloatType(), 8)
        pv = builder.load(builder.bitcast(builder.gep(p_, [k_]), vt.as_pointer()), align=4)
        sv = builder.load(builder.bitcast(builder.gep(s_, [j_]), vt.as_pointer()), align=4)
        av = ir.Constant(vt, ir.Undefined)
        for i in range(8):
            av = builder.insert_element(av, a_, ir.IntType(32)(i))
        st = builder.store(builder.fadd(pv, builder.fmul(av, sv)),
                           builder.bitcast(builder.gep(w_, [k_]), vt.as_pointer()), align=32)
        st.set_metadata("nontemporal", builder.module.add_metadata([ir.IntType(32)(1)]))
        return context.get_dummy_value()

    return types.none(w, p, k, s, j, a), codegen


@intrinsic
def _store_fence(typingctx):
    """A sequentially consistent fence (mfence on x86): makes the weakly ordered
    non-temporal stores visible before the parallel region's end."""

    def codegen(context, builder, sig, args):
        builder.fence("seq_cst")
        return context.get_dummy_value()

    return types.none(), codegen


def _prefetcher(rw, locality=3):
    """An intrinsic prefetching the line at a byte address: ``rw`` 0 read, 1 write;
    ``locality`` 3 (into every cache level: prefetcht0 / prefetchw) down to 0 (nta)."""

    @intrinsic
    def prefetch(typingctx, addr):
        def codegen(context, builder, sig, args):
            i8p = ir.IntType(8).as_pointer()
            i32 = ir.IntType(32)
            fn = cgutils.get_or_insert_function(
                builder.module, ir.FunctionType(ir.VoidType(), [i8p, i32, i32, i32]),
                "llvm.prefetch.p0")
            builder.call(fn, [builder.inttoptr(args[0], i8p), i32(rw), i32(locality),
                              i32(1)])
            return context.get_dummy_value()

        return types.none(addr), codegen

    return prefetch


# The channel-diagonal rows are short (one plane: H x W or Ho x Wo values) and far apart,
# so hardware prefetchers barely ramp up on them; asking for the next rows early keeps
# enough memory requests in flight. Arguments: byte addresses.
_prefetch_read = _prefetcher(0)
_prefetch_write = _prefetcher(1)


# ---------------------------------------------------------------------------------------
# float16 / bfloat16 conversions, exact and branch-light so loops over them vectorise.

# Helpers are compiled into the kernels (and cached with them); only kernels carry cache=True.
_inner = dict(nogil=True, error_model="numpy")
_jit = dict(_inner, cache=True)


@njit(**_inner)
def _keep(v):
    return v


@njit(**_inner)
def _f16_decode_bits(h):
    """float16 bits -> float32 (exact; Inf and NaN kept), by integer arithmetic."""
    h = np.int64(h)
    o = (h & 0x7FFF) << 13  # exponent and mantissa, aligned to float32's
    e = o & 0x0F800000
    o += (127 - 15) << 23  # rebias the exponent
    if e == 0x0F800000:  # Inf / NaN: exponent all ones again
        o += (128 - 16) << 23
    elif e == 0:  # zero / subnormal: the float subtraction renormalises, exactly
        o = _bits(_from_bits(o + (1 << 23)) - np.float32(6.103515625e-05))
    return _from_bits(o | ((h & 0x8000) << 16))


@njit(**_inner)
def _bf16_decode(h):
    """bfloat16 bits -> float32 (exact: bfloat16 is the top half of a float32)."""
    return _from_bits(np.int64(h) << 16)


@njit(**_inner)
def _f16_encode32_bits(f):
    """float32 -> float16 bits, round to nearest even; overflow -> Inf, NaN -> NaN; by
    integer arithmetic."""
    x = _bits(f)
    sign = x & 0x80000000
    x ^= sign
    if x >= 0x47800000:  # |f| >= 2**16 (or Inf / NaN): beyond the largest float16
        o = 0x7E00 if x > 0x7F800000 else 0x7C00
    elif x < 0x38800000:  # |f| < 2**-14: float16 subnormal or zero
        # Adding 0.5 puts the subnormal quantum 2**-24 in the float32's last place, so
        # the hardware's own round-to-nearest-even does the rounding.
        o = _bits(_from_bits(x) + np.float32(0.5)) - 0x3F000000
    else:
        mant_odd = (x >> 13) & 1
        x += ((15 - 127) << 23) + 0xFFF + mant_odd  # rebias; round half to even
        o = x >> 13
    return np.uint16(o | (sign >> 16))


@intrinsic
def _f16_decode_hw(typingctx, h):
    """float16 bits -> float32 with LLVM's ``fpext half``: one vcvtph2ps (F16C) or fcvt."""

    def codegen(context, builder, sig, args):
        return builder.fpext(builder.bitcast(args[0], ir.HalfType()), ir.FloatType())

    return types.float32(types.uint16), codegen


@intrinsic
def _f16_encode32_hw(typingctx, f):
    """float32 -> float16 bits with LLVM's ``fptrunc``: vcvtps2ph / fcvt, which round to
    nearest even (the default rounding mode, which Numba never changes)."""

    def codegen(context, builder, sig, args):
        return builder.bitcast(builder.fptrunc(args[0], ir.HalfType()), ir.IntType(16))

    return types.uint16(types.float32), codegen


def _half_in_hardware() -> bool:
    """Whether Numba's target converts float16 in hardware (x86 F16C, any 64-bit Arm).
    Elsewhere LLVM would call a runtime helper that Numba's JIT may not provide."""
    if platform.machine().lower() in ("aarch64", "arm64"):
        return True
    if numba.config.CPU_NAME:  # a chosen (portable) target: only its listed features
        return "+f16c" in (numba.config.CPU_FEATURES or "")
    return "+f16c" in llvm_binding.get_host_cpu_features().flatten().split(",")


# The hardware conversions are 3 to 7 times faster (measured: docs/numba.md); the integer
# versions are exact too and keep every other CPU working. Numba's cache key includes the
# CPU and its features, so a cache never crosses this choice.
if _half_in_hardware():
    _f16_decode, _f16_encode32 = _f16_decode_hw, _f16_encode32_hw
else:  # pragma: no cover - every CPU the project runs on has F16C
    _f16_decode, _f16_encode32 = _f16_decode_bits, _f16_encode32_bits


@njit(**_inner)
def _bf16_encode32(f):
    """float32 -> bfloat16 bits, round to nearest even; NaN stays a (quiet) NaN."""
    x = _bits(f)
    if (x & 0x7FFFFFFF) > 0x7F800000:
        return np.uint16((x >> 16) | 0x40)
    return np.uint16((x + 0x7FFF + ((x >> 16) & 1)) >> 16)


@njit(**_inner)
def _f32_round_odd(d):
    """float64 -> float32 rounded to odd: then one more rounding to a 16-bit float equals
    rounding ``d`` directly (float32 has more than 2 extra bits)."""
    f = np.float32(d)
    if np.float64(f) != d and d == d:
        x = _bits(f)
        if abs(np.float64(f)) > abs(d):
            x -= 1  # the magnitude was rounded up: truncate instead
        f = _from_bits(x | 1)
    return f


def _to_f32_once(v):  # pragma: no cover - replaced by the overload in compiled code
    raise NotImplementedError


@overload(_to_f32_once)
def _to_f32_once_impl(v):
    if v == types.float64:
        return lambda v: _f32_round_odd(v)
    return lambda v: np.float32(v)


@njit(**_inner)
def _f16_encode(v):
    return _f16_encode32(_to_f32_once(v))


@njit(**_inner)
def _bf16_encode(v):
    return _bf16_encode32(_to_f32_once(v))


@njit(**_inner)
def _f32_encode(v):
    return np.float32(v)


@njit(**_inner)
def _f64_encode(v):
    return np.float64(v)


def _like(v, buf):  # pragma: no cover - replaced by the overload in compiled code
    raise NotImplementedError


@overload(_like)
def _like_impl(v, buf):
    """``v`` converted to the dtype of array ``buf`` (the accumulation dtype)."""
    if buf.dtype == types.float32:
        return lambda v, buf: np.float32(v)
    return lambda v, buf: np.float64(v)


@njit(**_inner)
def _load(addr, code, k):
    """One element of any float dtype, as float64 (for ``c``: one load per S row)."""
    if code == F32:
        return np.float64(_f32_at(addr)[k])
    if code == F64:
        return _f64_at(addr)[k]
    if code == F16:
        return np.float64(_f16_decode(_u16_at(addr)[k]))
    return np.float64(_bf16_decode(_u16_at(addr)[k]))


# ---------------------------------------------------------------------------------------
# Inner loops. Each is written once and compiled per element decoder (and encoder), and
# dispatched on the dtype code by an ``*_any`` function; the contiguous case gets its own
# loop so that LLVM vectorises it.


def _plane_adder(dec):
    """A compiled ``add_plane`` with the element decoder ``dec`` built in (a decoder passed
    as an argument would make the kernel uncacheable)."""

    def add_plane(dst, ptr, off, sx, sy, H, W, scale):
        """``dst[x*W + y] += scale * dec(ptr[off + x*sx + y*sy])`` over an H x W plane."""
        if sy == 1 and sx == W:
            src = off
            for e in range(H * W):
                dst[e] += scale * dec(ptr[src + e])
        else:
            for x in range(H):
                d = _offset(dst, x * W)
                src = off + x * sx
                if sy == 1:
                    for y in range(W):
                        d[y] += scale * dec(ptr[src + y])
                else:
                    for y in range(W):
                        d[y] += scale * dec(ptr[src + y * sy])

    return njit(**_inner)(add_plane)


_add_plane_keep = _plane_adder(_keep)
_add_plane_f16 = _plane_adder(_f16_decode)
_add_plane_bf16 = _plane_adder(_bf16_decode)


def _pair_adder(dec):
    """A compiled ``add_pair``: one gamma plane plus ``mu0`` times one mu plane, both of
    one dtype, in a single pass over ``dst``."""

    def add_pair(dst, gp, goff, gsx, gsy, mp, moff, msx, msy, H, W, mu0):
        if gsy == 1 and gsx == W and msy == 1 and msx == W:
            for e in range(H * W):
                dst[e] += dec(gp[goff + e]) + mu0 * dec(mp[moff + e])
        else:
            for x in range(H):
                d = _offset(dst, x * W)
                ga, ma = goff + x * gsx, moff + x * msx
                for y in range(W):
                    d[y] += dec(gp[ga + y * gsy]) + mu0 * dec(mp[ma + y * msy])

    return njit(**_inner)(add_pair)


_add_pair_keep = _pair_adder(_keep)
_add_pair_f16 = _pair_adder(_f16_decode)
_add_pair_bf16 = _pair_adder(_bf16_decode)


@njit(**_inner)
def _add_pair_any(dst, addr, code, goff, gsx, gsy, maddr, moff, msx, msy, H, W, mu0):
    if code == F32:
        _add_pair_keep(dst, _f32_at(addr), goff, gsx, gsy, _f32_at(maddr), moff, msx, msy,
                       H, W, mu0)
    elif code == F64:
        _add_pair_keep(dst, _f64_at(addr), goff, gsx, gsy, _f64_at(maddr), moff, msx, msy,
                       H, W, mu0)
    elif code == F16:
        _add_pair_f16(dst, _u16_at(addr), goff, gsx, gsy, _u16_at(maddr), moff, msx, msy,
                      H, W, mu0)
    else:
        _add_pair_bf16(dst, _u16_at(addr), goff, gsx, gsy, _u16_at(maddr), moff, msx, msy,
                       H, W, mu0)


def _quad_adder(dec):
    """A compiled ``add_quad``: four channels at once, for contiguous planes of one dtype:
    ``dst += sum over q of (gamma_q + a_q * mu_q)``. One pass over ``dst`` per four
    channels instead of one per channel (phase 1 is partly compute-bound in cache).

    ``p0``-``p3``: byte addresses of four gamma planes to prefetch while summing (0: none),
    one line of each per 16 elements summed (two for 8-byte items), so the requests for
    the planes ahead are spread over the arithmetic instead of issued in one burst
    before it: on an Intel Xeon host that took the ``cpu`` workload's kernel from 7519 to
    6410 µs (on an AMD EPYC host it measured 4% slower in phase 1)."""

    def run(dst, gp, g0, g1, g2, g3, mp, m0, m1, m2, m3, a0, a1, a2, a3, n, with_gamma):
        if with_gamma:
            # Each gamma value in dst's dtype before the sum: float32 planes summed in
            # float32 would round where the accumulation dtype is float64.
            for e in range(n):
                dst[e] += (((_like(dec(gp[g0 + e]), dst) + _like(dec(gp[g1 + e]), dst))
                            + (_like(dec(gp[g2 + e]), dst) + _like(dec(gp[g3 + e]), dst)))
                           + ((a0 * dec(mp[m0 + e]) + a1 * dec(mp[m1 + e]))
                              + (a2 * dec(mp[m2 + e]) + a3 * dec(mp[m3 + e]))))
        else:
            for e in range(n):
                dst[e] += ((a0 * dec(mp[m0 + e]) + a1 * dec(mp[m1 + e]))
                           + (a2 * dec(mp[m2 + e]) + a3 * dec(mp[m3 + e])))

    run = njit(**_inner)(run)

    def add_quad(dst, gp, g0, g1, g2, g3, mp, m0, m1, m2, m3, a0, a1, a2, a3, n, with_gamma,
                 p0, p1, p2, p3, isz):
        full = n // 16 * 16 if with_gamma and (p0 != 0 or p1 != 0 or p2 != 0 or p3 != 0) else 0
        for blk in range(0, full, 16):
            off = blk * isz
            for p in (p0, p1, p2, p3):
                if p != 0:
                    _prefetch_read(p + off)
                    if isz == 8:
                        _prefetch_read(p + off + 64)
            # run()'s sum over a literal 16 elements (a count known only at run time, as
            # in a call to run, kept the loop from vectorising: 9.2 ms against 7.5).
            d = _offset(dst, blk)
            G0, G1 = _offset(gp, g0 + blk), _offset(gp, g1 + blk)
            G2, G3 = _offset(gp, g2 + blk), _offset(gp, g3 + blk)
            M0, M1 = _offset(mp, m0 + blk), _offset(mp, m1 + blk)
            M2, M3 = _offset(mp, m2 + blk), _offset(mp, m3 + blk)
            for e in range(16):
                d[e] += (((_like(dec(G0[e]), dst) + _like(dec(G1[e]), dst))
                          + (_like(dec(G2[e]), dst) + _like(dec(G3[e]), dst)))
                         + ((a0 * dec(M0[e]) + a1 * dec(M1[e]))
                            + (a2 * dec(M2[e]) + a3 * dec(M3[e]))))
        run(_offset(dst, full), gp, g0 + full, g1 + full, g2 + full, g3 + full, mp, m0 + full,
            m1 + full, m2 + full, m3 + full, a0, a1, a2, a3, n - full, with_gamma)

    return njit(**_inner)(add_quad)


_add_quad_keep = _quad_adder(_keep)
_add_quad_f16 = _quad_adder(_f16_decode)
_add_quad_bf16 = _quad_adder(_bf16_decode)


@njit(**_inner)
def _add_quad_any(dst, code, g_addr, g0, g1, g2, g3, m_addr, m0, m1, m2, m3,
                  a0, a1, a2, a3, n, with_gamma, p0, p1, p2, p3):
    isz = _itemsize(code)
    if code == F32:
        _add_quad_keep(dst, _f32_at(g_addr), g0, g1, g2, g3, _f32_at(m_addr), m0, m1, m2, m3,
                       a0, a1, a2, a3, n, with_gamma, p0, p1, p2, p3, isz)
    elif code == F64:
        _add_quad_keep(dst, _f64_at(g_addr), g0, g1, g2, g3, _f64_at(m_addr), m0, m1, m2, m3,
                       a0, a1, a2, a3, n, with_gamma, p0, p1, p2, p3, isz)
    elif code == F16:
        _add_quad_f16(dst, _u16_at(g_addr), g0, g1, g2, g3, _u16_at(m_addr), m0, m1, m2, m3,
                      a0, a1, a2, a3, n, with_gamma, p0, p1, p2, p3, isz)
    else:
        _add_quad_bf16(dst, _u16_at(g_addr), g0, g1, g2, g3, _u16_at(m_addr), m0, m1, m2, m3,
                       a0, a1, a2, a3, n, with_gamma, p0, p1, p2, p3, isz)


@njit(**_inner)
def _plane_ahead(addr, isz, at, g, Cg, g_c, g_y0, W, ahead):
    """The byte address of the gamma plane ``ahead`` planes into a phase-1 task's
    (y0, ci) order (``at``: the task's offset without channel and y0), or 0 past its end."""
    if ahead >= W * Cg:
        return 0
    return addr + (at + (g * Cg + ahead % Cg) * g_c + (ahead // Cg) * g_y0) * isz


@njit(**_inner)
def _add_plane_any(dst, addr, code, off, sx, sy, H, W, scale):
    if code == F32:
        _add_plane_keep(dst, _f32_at(addr), off, sx, sy, H, W, scale)
    elif code == F64:
        _add_plane_keep(dst, _f64_at(addr), off, sx, sy, H, W, scale)
    elif code == F16:
        _add_plane_f16(dst, _u16_at(addr), off, sx, sy, H, W, scale)
    else:
        _add_plane_bf16(dst, _u16_at(addr), off, sx, sy, H, W, scale)


def _nt_row_f32(w, p, off, n, srow, cc):  # pragma: no cover - replaced by the overload
    raise NotImplementedError


@overload(_nt_row_f32)
def _nt_row_f32_impl(w, p, off, n, srow, cc):
    """``w[off + e] = float32(p[off + e] + cc * srow[e])``, e < n, non-temporal: eight at a
    time where the sums are float32 (the same operations, so the same bits, as in place)."""
    if srow.dtype == types.float32:
        def impl(w, p, off, n, srow, cc):
            e = 0
            while e < n and _address_at(w, off + e) & 31 != 0:
                _store_nt(w, off + e, np.float32(p[off + e] + cc * srow[e]))
                e += 1
            while e + 8 <= n:
                _axpy8_nt(w, p, off + e, srow, e, cc)
                e += 8
            while e < n:
                _store_nt(w, off + e, np.float32(p[off + e] + cc * srow[e]))
                e += 1
        return impl

    def impl(w, p, off, n, srow, cc):
        for e in range(n):
            _store_nt(w, off + e, np.float32(p[off + e] + cc * srow[e]))
    return impl


def _row_adder(dec, enc, f32=False):
    """A compiled ``add_row`` with decoder and encoder of out's dtype built in (``f32``:
    out is float32, whose rows apart are stored eight values at a time)."""

    def add_row(ptr, off, si, sj, Ho, Wo, srow, cc, wptr, apart):
        """``ptr[off + i1*si + j1*sj] += cc * srow[i1*Wo + j1]``, rounded once into ptr's
        dtype; ``apart``: the sum goes to ``wptr`` instead (a contiguous plane only), ptr
        is only read."""
        if sj == 1 and si == Wo:  # a contiguous Ho x Wo plane: one run
            if apart and f32:
                _nt_row_f32(wptr, ptr, off, Ho * Wo, srow, cc)
                return
            if apart:
                for e in range(Ho * Wo):
                    _store_nt(wptr, off + e, enc(dec(ptr[off + e]) + cc * srow[e]))
                return
            for e in range(Ho * Wo):
                ptr[off + e] = enc(dec(ptr[off + e]) + cc * srow[e])
            return
        for i1 in range(Ho):
            s = _offset(srow, i1 * Wo)
            base = off + i1 * si
            if sj == 1:
                for j1 in range(Wo):
                    ptr[base + j1] = enc(dec(ptr[base + j1]) + cc * s[j1])
            else:
                for j1 in range(Wo):
                    k = base + j1 * sj
                    ptr[k] = enc(dec(ptr[k]) + cc * s[j1])

    return njit(**_inner)(add_row)


_add_row_f32 = _row_adder(_keep, _f32_encode, f32=True)
_add_row_f64 = _row_adder(_keep, _f64_encode)
_add_row_f16 = _row_adder(_f16_decode, _f16_encode)
_add_row_bf16 = _row_adder(_bf16_decode, _bf16_encode)


@njit(**_inner)
def _add_row_any(addr, code, off, si, sj, Ho, Wo, srow, cc, waddr):
    apart = waddr != addr
    if code == F32:
        _add_row_f32(_f32_at(addr), off, si, sj, Ho, Wo, srow, cc, _f32_at(waddr), apart)
    elif code == F64:
        _add_row_f64(_f64_at(addr), off, si, sj, Ho, Wo, srow, cc, _f64_at(waddr), apart)
    elif code == F16:
        _add_row_f16(_u16_at(addr), off, si, sj, Ho, Wo, srow, cc, _u16_at(waddr), apart)
    else:
        _add_row_bf16(_u16_at(addr), off, si, sj, Ho, Wo, srow, cc, _u16_at(waddr), apart)


def _window_adder(dec):
    """A compiled ``add_window`` with the source's element decoder built in."""

    def add_window(dst, ptr, off, si, sj, i_lo, i_hi, j_lo, j_hi, pitch, step, scale):
        """``dst[i*pitch + j*step] += scale * dec(ptr[off + i*si + j*sj])`` over the window
        ``i_lo <= i < i_hi``, ``j_lo <= j < j_hi``: a strided window of one plane (the
        forward's direct plan, in S coordinates) or its adjoint (the backward)."""
        nj = j_hi - j_lo
        for i in range(i_lo, i_hi):
            d = _offset(dst, i * pitch + j_lo * step)
            src = off + i * si + j_lo * sj
            if step == 1 and sj == 1:
                for j in range(nj):
                    d[j] += scale * dec(ptr[src + j])
            else:
                for j in range(nj):
                    d[j * step] += scale * dec(ptr[src + j * sj])

    return njit(**_inner)(add_window)


_add_window_keep = _window_adder(_keep)
_add_window_f16 = _window_adder(_f16_decode)
_add_window_bf16 = _window_adder(_bf16_decode)


@njit(**_inner)
def _add_window_any(dst, addr, code, off, si, sj, i_lo, i_hi, j_lo, j_hi, pitch, step, scale):
    if code == F32:
        _add_window_keep(dst, _f32_at(addr), off, si, sj, i_lo, i_hi, j_lo, j_hi, pitch, step,
                         scale)
    elif code == F64:
        _add_window_keep(dst, _f64_at(addr), off, si, sj, i_lo, i_hi, j_lo, j_hi, pitch, step,
                         scale)
    elif code == F16:
        _add_window_f16(dst, _u16_at(addr), off, si, sj, i_lo, i_hi, j_lo, j_hi, pitch, step,
                        scale)
    else:
        _add_window_bf16(dst, _u16_at(addr), off, si, sj, i_lo, i_hi, j_lo, j_hi, pitch, step,
                         scale)


def _window_quad_adder(dec):
    """A compiled ``add_window_quad``: the direct plan's inner loop, four channels per pass
    over ``dst`` (as phase 1's ``add_quad``). Over the window ``i_lo <= i < i_hi``,
    ``j_lo <= j < j_hi``: ``dst[i*pitch + j] += sum over q < 4 of (gamma_q + a_q * mu_q)``,
    ``gamma_q = gp[g_at + q*g_c + i*gsi + j*gsj]``, ``mu_q = mp[m_at + q*m_c + i*msi +
    j*msj]``, both of one dtype; without gamma the mu terms only."""

    def add_window_quad(dst, pitch, gp, g_at, g_c, gsi, gsj, mp, m_at, m_c, msi, msj,
                        a0, a1, a2, a3, i_lo, i_hi, j_lo, j_hi, with_gamma):
        nj = j_hi - j_lo
        for i in range(i_lo, i_hi):
            d = _offset(dst, i * pitch + j_lo)
            g0 = g_at + i * gsi + j_lo * gsj
            g1, g2, g3 = g0 + g_c, g0 + 2 * g_c, g0 + 3 * g_c
            m0 = m_at + i * msi + j_lo * msj
            m1, m2, m3 = m0 + m_c, m0 + 2 * m_c, m0 + 3 * m_c
            if gsj == 1 and msj == 1 and with_gamma:  # unit steps: vectorised
                for j in range(nj):
                    d[j] += (((_like(dec(gp[g0 + j]), dst) + _like(dec(gp[g1 + j]), dst))
                              + (_like(dec(gp[g2 + j]), dst) + _like(dec(gp[g3 + j]), dst)))
                             + ((a0 * dec(mp[m0 + j]) + a1 * dec(mp[m1 + j]))
                                + (a2 * dec(mp[m2 + j]) + a3 * dec(mp[m3 + j]))))
            elif with_gamma:
                for j in range(nj):
                    gj, mj = j * gsj, j * msj
                    d[j] += (((_like(dec(gp[g0 + gj]), dst) + _like(dec(gp[g1 + gj]), dst))
                              + (_like(dec(gp[g2 + gj]), dst) + _like(dec(gp[g3 + gj]), dst)))
                             + ((a0 * dec(mp[m0 + mj]) + a1 * dec(mp[m1 + mj]))
                                + (a2 * dec(mp[m2 + mj]) + a3 * dec(mp[m3 + mj]))))
            elif msj == 1:
                for j in range(nj):
                    d[j] += ((a0 * dec(mp[m0 + j]) + a1 * dec(mp[m1 + j]))
                             + (a2 * dec(mp[m2 + j]) + a3 * dec(mp[m3 + j])))
            else:
                for j in range(nj):
                    mj = j * msj
                    d[j] += ((a0 * dec(mp[m0 + mj]) + a1 * dec(mp[m1 + mj]))
                             + (a2 * dec(mp[m2 + mj]) + a3 * dec(mp[m3 + mj])))

    return njit(**_inner)(add_window_quad)


_add_window_quad_keep = _window_quad_adder(_keep)
_add_window_quad_f16 = _window_quad_adder(_f16_decode)
_add_window_quad_bf16 = _window_quad_adder(_bf16_decode)


@njit(**_inner)
def _add_window_quad_any(dst, pitch, code, g_addr, g_at, g_c, gsi, gsj, m_addr, m_at, m_c,
                         msi, msj, a0, a1, a2, a3, i_lo, i_hi, j_lo, j_hi, with_gamma):
    if code == F32:
        _add_window_quad_keep(dst, pitch, _f32_at(g_addr), g_at, g_c, gsi, gsj, _f32_at(m_addr),
                              m_at, m_c, msi, msj, a0, a1, a2, a3, i_lo, i_hi, j_lo, j_hi,
                              with_gamma)
    elif code == F64:
        _add_window_quad_keep(dst, pitch, _f64_at(g_addr), g_at, g_c, gsi, gsj, _f64_at(m_addr),
                              m_at, m_c, msi, msj, a0, a1, a2, a3, i_lo, i_hi, j_lo, j_hi,
                              with_gamma)
    elif code == F16:
        _add_window_quad_f16(dst, pitch, _u16_at(g_addr), g_at, g_c, gsi, gsj, _u16_at(m_addr),
                             m_at, m_c, msi, msj, a0, a1, a2, a3, i_lo, i_hi, j_lo, j_hi,
                             with_gamma)
    else:
        _add_window_quad_bf16(dst, pitch, _u16_at(g_addr), g_at, g_c, gsi, gsj,
                              _u16_at(m_addr), m_at, m_c, msi, msj, a0, a1, a2, a3, i_lo,
                              i_hi, j_lo, j_hi, with_gamma)


@njit(**_inner)
def _sum_runs(dst, src, at, n, run):
    """``dst[e] = sum over w < n of src[at[w] + e]`` for ``e < run``: the M plan's box
    filter, four windows a pass, so that ``dst`` is loaded and stored once per four."""
    r = n % 4 if n % 4 else min(n, 4)  # the first pass: the remainder, or four
    s0, s1, s2, s3 = (_offset(src, at[0]), _offset(src, at[1]), _offset(src, at[2]),
                      _offset(src, at[3]))
    if r == 0:
        for e in range(run):
            dst[e] = 0
    elif r == 1:
        for e in range(run):
            dst[e] = s0[e]
    elif r == 2:
        for e in range(run):
            dst[e] = s0[e] + s1[e]
    elif r == 3:
        for e in range(run):
            dst[e] = s0[e] + s1[e] + s2[e]
    else:
        for e in range(run):
            dst[e] = s0[e] + s1[e] + s2[e] + s3[e]
    for w in range(r, n, 4):
        s0, s1, s2, s3 = (_offset(src, at[w]), _offset(src, at[w + 1]),
                          _offset(src, at[w + 2]), _offset(src, at[w + 3]))
        for e in range(run):
            dst[e] += s0[e] + s1[e] + s2[e] + s3[e]


@njit(**_inner)
def _itemsize(code):
    return 2 if code == F16 or code == BF16 else (4 if code == F32 else 8)


@njit(**_inner)
def _prefetch_plane(addr, code, off, sx, sy, H, W, write):
    """Prefetch the cache lines of one H x W plane (rows with unit inner stride only)."""
    if sy != 1:
        return  # strided rows: left to the hardware
    if sx == W:  # one contiguous run
        H, W = 1, H * W
    isz = _itemsize(code)
    for x in range(H):
        start = addr + (off + x * sx) * isz
        end = start + W * isz
        line = start & ~63
        while line < end:
            if write:
                _prefetch_write(line)
            else:
                _prefetch_read(line)
            line += 64


@njit(**_inner)
def _prefetch_window(addr, code, off, si, sj, i_lo, i_hi, j_lo, j_hi):
    """Prefetch (for reading) the cache lines of the window ``off + i*si + j*sj``,
    ``i_lo <= i < i_hi``, ``j_lo <= j < j_hi``: the lines each row spans, or, where the
    elements of a row are a line or more apart, the line of each element."""
    isz = _itemsize(code)
    step = abs(sj) * isz
    for i in range(i_lo, i_hi):
        a = addr + (off + i * si + j_lo * sj) * isz
        if step >= 64:
            for j in range(j_hi - j_lo):
                _prefetch_read(a + j * sj * isz)
        else:
            z = a + (j_hi - j_lo - 1) * sj * isz
            line, end = min(a, z) & ~63, max(a, z)
            while line <= end:
                _prefetch_read(line)
                line += 64


@njit(**_inner)
def _inside(offset, s, n, n_out):
    """[lo, hi): the outputs i < n_out whose input position i*s + offset lies in [0, n)."""
    lo = max(0, (s - 1 - offset) // s)
    hi = min(n_out, (n - 1 - offset) // s + 1)
    return lo, max(lo, hi)


# ---------------------------------------------------------------------------------------
# The kernel.

# The kernel's integer arguments, in the order of its ``prm`` vector (one int64 array:
# Numba types one array argument faster than forty integers). Addresses are in bytes,
# strides in elements; out's and gamma's strides are those of their channel diagonals.
_PRM = ("B Ci Co G H W Ho Wo kh kw sh sw ph pw dh dw pairs "
        "o_addr o_code o_b o_c o_i0 o_j0 o_i1 o_j1 "
        "g_addr g_code g_b g_c g_x0 g_y0 g_x1 g_y1 "
        "m_addr m_code m_b m_c m_x m_y c_addr c_code c_s pf_gamma pf_out direct w_addr").split()


def _kernel(prm, c_value, M):
    """Add ``c[c0] * S[b, g(c0)]`` into out; ``M`` is the phase-1 buffer (acc dtype; empty
    in the direct plan)."""
    B, Ci, Co, G, H, W, Ho, Wo = prm[0], prm[1], prm[2], prm[3], prm[4], prm[5], prm[6], prm[7]
    kh, kw, sh, sw, ph, pw, dh, dw = (prm[8], prm[9], prm[10], prm[11], prm[12], prm[13],
                                      prm[14], prm[15])
    pairs = prm[16]  # (b, g) pairs per chunk: M holds pairs x H*W*H*W values (M plan)
    o_addr, o_code, o_b, o_c, o_i0, o_j0, o_i1, o_j1 = (prm[17], prm[18], prm[19], prm[20],
                                                          prm[21], prm[22], prm[23], prm[24])
    g_addr, g_code, g_b, g_c, g_x0, g_y0, g_x1, g_y1 = (prm[25], prm[26], prm[27], prm[28],
                                                          prm[29], prm[30], prm[31], prm[32])
    m_addr, m_code, m_b, m_c, m_x, m_y = prm[33], prm[34], prm[35], prm[36], prm[37], prm[38]
    c_addr, c_code, c_s = prm[39], prm[40], prm[41]
    PF_GAMMA, PF_OUT = prm[42], prm[43]
    direct = prm[44] != 0  # S rows straight from gamma and mu: no phase 1, no M
    w_addr = prm[45]  # where the sums go: o_addr (in place) or a result apart from out
    with_gamma = g_code != ABSENT
    same_code = not with_gamma or g_code == m_code
    Cg, Cog, HW, HoWo = Ci // G, Co // G, H * W, Ho * Wo
    # M's (x1, y1) planes carry the padding as zeros, Hp x Wp: every window of phase 2 then
    # lies inside its plane and is one run, and adding a zero is skipping the term exactly
    Hp, Wp = (H + 2 * ph, W + 2 * pw) if sw == 1 else (H, W)
    PL = Hp * Wp
    for first in range(0, B * G, pairs):
        n = min(pairs, B * G - first)

        # Phase 1 (M plan): M[t, x0, y0] = sum over the group's ci of gamma + mu outer
        # product. (Its count is a variable: a conditional expression in prange's
        # argument makes Numba run the loop serially.)
        tasks = 0 if direct else n * H
        for task in prange(tasks):
            t, x0 = task // H, task % H
            b, g = (first + t) // G, (first + t) % G
            # Four channels per pass when gamma (if any) and mu share a dtype and their
            # planes are contiguous: the common case.
            quads = ((not with_gamma or (g_code == m_code and g_y1 == 1 and g_x1 == W))
                     and m_y == 1 and m_x == W)
            # the row M[t, x0, y0] is summed dense, in place where there is no padding
            dense_buf = np.empty(HW if PL != HW else 1, M.dtype)
            for y0 in range(W):
                plane = _offset(_data(M), (task * W + y0) * PL)
                dst = plane if PL == HW else _data(dense_buf)
                for e in range(HW):
                    dst[e] = 0
                g_at = b * g_b + x0 * g_x0 + y0 * g_y0  # + ci * g_c: gamma[b, ci, x0, y0, (ci)]
                m_at = b * m_b  # + ci * m_c: mu[b, ci]
                m_xy = x0 * m_x + y0 * m_y
                ci = g * Cg
                while ci < (g + 1) * Cg:
                    step = 4 if quads and ci + 4 <= (g + 1) * Cg else 1
                    p0 = p1 = p2 = p3 = 0
                    if with_gamma and PF_GAMMA > 0:
                        # The planes PF_GAMMA planes ahead, in (y0, ci) order.
                        isz = _itemsize(g_code)
                        at = b * g_b + x0 * g_x0
                        ahead = y0 * Cg + ci - g * Cg + PF_GAMMA
                        p0 = _plane_ahead(g_addr, isz, at, g, Cg, g_c, g_y0, W, ahead)
                        if step == 4:  # asked for line by line while these four are summed
                            p1 = _plane_ahead(g_addr, isz, at, g, Cg, g_c, g_y0, W, ahead + 1)
                            p2 = _plane_ahead(g_addr, isz, at, g, Cg, g_c, g_y0, W, ahead + 2)
                            p3 = _plane_ahead(g_addr, isz, at, g, Cg, g_c, g_y0, W, ahead + 3)
                        elif p0 != 0:  # one plane: asked for in one burst, now
                            _prefetch_plane(p0, g_code, 0, g_x1, g_y1, H, W, False)
                    if step == 4:
                        m0, m1, m2, m3 = (m_at + ci * m_c, m_at + (ci + 1) * m_c,
                                          m_at + (ci + 2) * m_c, m_at + (ci + 3) * m_c)
                        _add_quad_any(dst, m_code, g_addr, g_at + ci * g_c,
                                      g_at + (ci + 1) * g_c, g_at + (ci + 2) * g_c,
                                      g_at + (ci + 3) * g_c, m_addr, m0, m1, m2, m3,
                                      _like(_load(m_addr, m_code, m0 + m_xy), M),
                                      _like(_load(m_addr, m_code, m1 + m_xy), M),
                                      _like(_load(m_addr, m_code, m2 + m_xy), M),
                                      _like(_load(m_addr, m_code, m3 + m_xy), M),
                                      HW, with_gamma, p0, p1, p2, p3)
                    else:
                        m_off = m_at + ci * m_c
                        mu0 = _like(_load(m_addr, m_code, m_off + m_xy), M)
                        if with_gamma and g_code == m_code:
                            _add_pair_any(dst, g_addr, g_code, g_at + ci * g_c, g_x1, g_y1,
                                          m_addr, m_off, m_x, m_y, H, W, mu0)
                        else:  # no gamma, or mixed dtypes: one plane at a time
                            if with_gamma:
                                _add_plane_any(dst, g_addr, g_code, g_at + ci * g_c, g_x1,
                                               g_y1, H, W, _like(1.0, M))
                            _add_plane_any(dst, m_addr, m_code, m_off, m_x, m_y, H, W, mu0)
                    ci += step
                if PL != HW:  # into the padded plane, zeros around, each element once
                    for e in range(ph * Wp):
                        plane[e] = plane[PL - 1 - e] = 0
                    for x1 in range(H):
                        row = _offset(plane, (x1 + ph) * Wp)
                        for y1 in range(pw):
                            row[y1] = row[Wp - 1 - y1] = 0
                        for y1 in range(W):
                            row[pw + y1] = dst[x1 * W + y1]
            dense_buf[0] = 0

        # Phase 2: S rows by the box filter over (ii, ji), added into every c0 of g.
        for task in prange(n * Ho):
            t, i0 = task // Ho, task % Ho
            b, g = (first + t) // G, (first + t) % G
            # Thread-local buffers. With sw == 1 the M plan's box filter works on rows of
            # pitch P = sh * Wp, the distance in M's padded plane between rows x1 and
            # x1 + sh: then an S position (i1, j1) and the M position it reads differ by a
            # constant for each (ii, ji), and a whole window is one contiguous run (the
            # columns past Wo collect harmless garbage).
            flat = not direct and sw == 1
            P = sh * Wp if flat else Wo
            box_buf = np.empty(Ho * P, M.dtype)
            srow_buf = np.empty(HoWo, M.dtype)
            at_buf = np.empty(kh * kw + 3, np.int64)  # the M plan's windows of one S row
            Mp = _data(M)
            box = _data(box_buf)
            at = _data(at_buf)
            srow = box if P == Wo else _data(srow_buf)
            for j0 in range(Wo):
                if not flat:
                    for e in range(HoWo):
                        box[e] = 0
                n_at = 0
                for ii in range(kh):
                    x0 = i0 * sh + ii * dh - ph
                    if x0 < 0 or x0 >= H:
                        continue  # the whole term lies in the padding: skipped, not 0*x
                    i1_lo, i1_hi = _inside(ii * dh - ph, sh, H, Ho)
                    if i1_lo == i1_hi:
                        continue
                    for ji in range(kw):
                        y0 = j0 * sw + ji * dw - pw
                        if y0 < 0 or y0 >= W:
                            continue
                        j1_lo, j1_hi = _inside(ji * dw - pw, sw, W, Wo)
                        if j1_lo == j1_hi:
                            continue
                        # x1 = i1*sh + ii*dh - ph, y1 = j1*sw + ji*dw - pw over i1, j1 inside
                        if direct:
                            # gamma[b, ci, x0, y0, (ci,) x1, y1]
                            # + mu[b, ci, x0, y0] * mu[b, ci, x1, y1]: four channels per
                            # pass where gamma and mu share a dtype, else one at a time
                            g_at = (b * g_b + x0 * g_x0 + y0 * g_y0 + (ii * dh - ph) * g_x1
                                    + (ji * dw - pw) * g_y1)
                            m_at = b * m_b + (ii * dh - ph) * m_x + (ji * dw - pw) * m_y
                            m_xy = b * m_b + x0 * m_x + y0 * m_y
                            # the same windows PF_GAMMA S rows ahead (at y0 + PF_GAMMA * sw)
                            pf_at = g_at + PF_GAMMA * sw * g_y0
                            pf = with_gamma and PF_GAMMA > 0 and y0 + PF_GAMMA * sw < W
                            ci = g * Cg
                            while ci < (g + 1) * Cg:
                                step = 4 if same_code and ci + 4 <= (g + 1) * Cg else 1
                                if pf:
                                    for q in range(step):
                                        _prefetch_window(g_addr, g_code, pf_at + (ci + q) * g_c,
                                                         sh * g_x1, sw * g_y1, i1_lo, i1_hi,
                                                         j1_lo, j1_hi)
                                if step == 4:
                                    m_ci = m_xy + ci * m_c
                                    _add_window_quad_any(
                                        box, Wo, m_code, g_addr, g_at + ci * g_c, g_c,
                                        sh * g_x1, sw * g_y1, m_addr, m_at + ci * m_c, m_c,
                                        sh * m_x, sw * m_y,
                                        _like(_load(m_addr, m_code, m_ci), M),
                                        _like(_load(m_addr, m_code, m_ci + m_c), M),
                                        _like(_load(m_addr, m_code, m_ci + 2 * m_c), M),
                                        _like(_load(m_addr, m_code, m_ci + 3 * m_c), M),
                                        i1_lo, i1_hi, j1_lo, j1_hi, with_gamma)
                                else:
                                    if with_gamma:
                                        _add_window_any(box, g_addr, g_code, g_at + ci * g_c,
                                                        sh * g_x1, sw * g_y1, i1_lo, i1_hi,
                                                        j1_lo, j1_hi, Wo, 1, _like(1.0, M))
                                    mu0 = _like(_load(m_addr, m_code, m_xy + ci * m_c), M)
                                    _add_window_any(box, m_addr, m_code, m_at + ci * m_c,
                                                    sh * m_x, sw * m_y, i1_lo, i1_hi, j1_lo,
                                                    j1_hi, Wo, 1, mu0)
                                ci += step
                            continue
                        t_at = ((t * H + x0) * W + y0) * PL
                        if flat:  # M[t, x0, y0, x1 + ph, y1 + pw] at i1 = j1 = 0, summed below
                            at[n_at] = t_at + ii * dh * Wp + ji * dw
                            n_at += 1
                        else:  # M[t, x0, y0, x1, y1], strided: row by row
                            _add_window_keep(box, Mp, t_at + (ii * dh - ph) * W + ji * dw - pw,
                                             sh * W, sw, i1_lo, i1_hi, j1_lo, j1_hi, Wo, 1,
                                             _like(1.0, M))
                if flat:
                    _sum_runs(box, Mp, at, n_at, (Ho - 1) * P + Wo)
                if P != Wo:
                    for i1 in range(Ho):
                        for j1 in range(Wo):
                            srow[i1 * Wo + j1] = box[i1 * P + j1]
                for c0 in range(g * Cog, (g + 1) * Cog):
                    if PF_OUT > 0:  # ask for the out row PF_OUT rows ahead, in (j0, c0) order
                        ahead = j0 * Cog + c0 - g * Cog + PF_OUT
                        if ahead < Wo * Cog:
                            _prefetch_plane(o_addr, o_code,
                                            b * o_b + (g * Cog + ahead % Cog) * o_c
                                            + i0 * o_i0 + (ahead // Cog) * o_j0,
                                            o_i1, o_j1, Ho, Wo, True)
                        elif task + 1 < n * Ho and ahead - Wo * Cog < Wo * Cog:
                            ahead -= Wo * Cog  # the next task's first rows
                            t2, i2 = (task + 1) // Ho, (task + 1) % Ho
                            b2, g2 = (first + t2) // G, (first + t2) % G
                            _prefetch_plane(o_addr, o_code,
                                            b2 * o_b + (g2 * Cog + ahead % Cog) * o_c
                                            + i2 * o_i0 + (ahead // Cog) * o_j0,
                                            o_i1, o_j1, Ho, Wo, True)
                    cc = _like(c_value if c_code == ABSENT else
                               _load(c_addr, c_code, c0 * c_s), M)
                    off = b * o_b + c0 * o_c + i0 * o_i0 + j0 * o_j0
                    _add_row_any(o_addr, o_code, off, o_i1, o_j1, Ho, Wo, srow, cc, w_addr)
            if w_addr != o_addr:
                _store_fence()  # the non-temporal stores of the result apart from out
            # Raw pointers do not hold a reference: use the buffers last, here, so that
            # Numba cannot free them while the pointers are in use.
            box_buf[0] = srow_buf[0] = 0
            at_buf[0] = 0


def _renamed(f, name):
    """A copy of function ``f`` called ``name``. Numba's disk cache is keyed by the
    function's name and bytecode, not by compile flags: the serial and the parallel
    compile of one function would overwrite each other's cache entries."""
    g = FunctionType(f.__code__, f.__globals__, name, f.__defaults__, f.__closure__)
    g.__qualname__ = name
    return g


_parallel = njit(parallel=True, **_jit)(_kernel)
# In a forked child of a process that used GNU OpenMP a parallel region kills the
# process; there the same kernel runs compiled without threads.
_serial = njit(**_jit)(_renamed(_kernel, "_kernel_serial"))


# ---------------------------------------------------------------------------------------
# The backward (docs/autograd.md, "The backend contract"): the adjoint of S.


def _plane_storer(enc):
    """A compiled ``store_plane`` with the encoder of the destination's dtype built in."""

    def store_plane(ptr, off, sx, sy, H, W, src, nt):
        """``ptr[off + x*sx + y*sy] = enc(src[x*W + y])``: overwrite, rounded once;
        ``nt``: with non-temporal stores where the plane is contiguous."""
        if sy == 1 and sx == W:
            if nt:
                for e in range(H * W):
                    _store_nt(ptr, off + e, enc(src[e]))
            else:
                for e in range(H * W):
                    ptr[off + e] = enc(src[e])
            return
        for x in range(H):
            s = _offset(src, x * W)
            base = off + x * sx
            if sy == 1:
                for y in range(W):
                    ptr[base + y] = enc(s[y])
            else:
                for y in range(W):
                    ptr[base + y * sy] = enc(s[y])

    return njit(**_inner)(store_plane)


_store_plane_f32 = _plane_storer(_f32_encode)
_store_plane_f64 = _plane_storer(_f64_encode)
_store_plane_f16 = _plane_storer(_f16_encode)
_store_plane_bf16 = _plane_storer(_bf16_encode)


@njit(**_inner)
def _store_plane_any(addr, code, off, sx, sy, H, W, src, nt=False):
    if code == F32:
        _store_plane_f32(_f32_at(addr), off, sx, sy, H, W, src, nt)
    elif code == F64:
        _store_plane_f64(_f64_at(addr), off, sx, sy, H, W, src, nt)
    elif code == F16:
        _store_plane_f16(_u16_at(addr), off, sx, sy, H, W, src, nt)
    else:
        _store_plane_bf16(_u16_at(addr), off, sx, sy, H, W, src, nt)


def _window_dotter(dec):
    """A compiled ``dot_window`` with mu's element decoder built in."""

    def dot_window(a, pitch, ptr, off, si, sj, i_lo, i_hi, j_lo, j_hi):
        """The sum of ``a[i*pitch + j] * dec(ptr[off + i*si + j*sj])`` over the window
        ``i_lo <= i < i_hi``, ``j_lo <= j < j_hi``, in float64: reassociation allowed
        (vectorised; no finite-math assumption, so NaN and Inf propagate)."""
        v = 0.0
        if sj == 1 and si == pitch and j_lo == 0 and j_hi == pitch:  # one run
            r = _offset(a, i_lo * pitch)
            src = off + i_lo * pitch
            for e in range((i_hi - i_lo) * pitch):
                v += r[e] * np.float64(dec(ptr[src + e]))
            return v
        for i in range(i_lo, i_hi):
            r = _offset(a, i * pitch)
            src = off + i * si
            if sj == 1:
                for j in range(j_lo, j_hi):
                    v += r[j] * np.float64(dec(ptr[src + j]))
            else:
                for j in range(j_lo, j_hi):
                    v += r[j] * np.float64(dec(ptr[src + j * sj]))
        return v

    return njit(fastmath={"reassoc", "contract"}, **_inner)(dot_window)


_dot_window_keep = _window_dotter(_keep)
_dot_window_f16 = _window_dotter(_f16_decode)
_dot_window_bf16 = _window_dotter(_bf16_decode)


@njit(**_inner)
def _dot_window_any(a, pitch, addr, code, off, si, sj, i_lo, i_hi, j_lo, j_hi):
    if code == F32:
        return _dot_window_keep(a, pitch, _f32_at(addr), off, si, sj, i_lo, i_hi, j_lo, j_hi)
    if code == F64:
        return _dot_window_keep(a, pitch, _f64_at(addr), off, si, sj, i_lo, i_hi, j_lo, j_hi)
    if code == F16:
        return _dot_window_f16(a, pitch, _u16_at(addr), off, si, sj, i_lo, i_hi, j_lo, j_hi)
    return _dot_window_bf16(a, pitch, _u16_at(addr), off, si, sj, i_lo, i_hi, j_lo, j_hi)


@njit(**_inner)
def _gather_row(row, x0, y0, s_addr, s_code, s_at, t_i0, t_j0, t_i1, t_j1, prm):
    """``row[x1*W + y1] +=`` the sum over kernel offsets o and S positions p, q with
    X_o(p) = (x0, y0) and X_o(q) = (x1, y1) inside the input of ``grad_S[p, q]``, read at
    ``s_at + p . (t_i0, t_j0) + q . (t_i1, t_j1)``: the row ``D[x0, y0]`` of the adjoint of
    the forward's window reads (of the symmetrised D, from grad_S + grad_S^T). A term with
    a padded position is absent, whatever its grad_S."""
    H, W, Ho, Wo = prm[3], prm[4], prm[5], prm[6]
    kh, kw, sh, sw, ph, pw, dh, dw = (prm[7], prm[8], prm[9], prm[10], prm[11], prm[12],
                                      prm[13], prm[14])
    for ii in range(kh):
        r = x0 + ph - ii * dh
        if r < 0 or r % sh != 0 or r // sh >= Ho:
            continue
        i0 = r // sh
        i1_lo, i1_hi = _inside(ii * dh - ph, sh, H, Ho)
        for ji in range(kw):
            q = y0 + pw - ji * dw
            if q < 0 or q % sw != 0 or q // sw >= Wo:
                continue
            j0 = q // sw
            j1_lo, j1_hi = _inside(ji * dw - pw, sw, W, Wo)
            # row[x1 = i1*sh + ii*dh - ph, y1 = j1*sw + ji*dw - pw] += grad_S[i0, j0, i1, j1]
            _add_window_any(_offset(row, (ii * dh - ph) * W + ji * dw - pw), s_addr, s_code,
                            s_at + i0 * t_i0 + j0 * t_j0, t_i1, t_j1, i1_lo, i1_hi, j1_lo,
                            j1_hi, sh * W, sw, 1.0)


@njit(**_inner)
def _mu_grad_windows(acc, nc, x0, y0, m_addr, m_code, m_off, sym, prm):
    """``acc[dc] =`` grad_mu at (x0, y0) of the mu planes at ``m_off + dc*m_c``, dc < nc:
    the sum over kernel offsets o and positions p with X_o(p) = (x0, y0), q with X_o(q) inside,
    of ``mu[X_o(q)] * (grad_S + grad_S^T)[p, q]`` (``sym``: the pair's block of it,
    float64), window by window. These are the numpy reference's products, each formed
    once: exact for any values, Inf * 0 and Inf - Inf giving NaN exactly where they do
    there."""
    H, W, Ho, Wo = prm[3], prm[4], prm[5], prm[6]
    kh, kw, sh, sw, ph, pw, dh, dw = (prm[7], prm[8], prm[9], prm[10], prm[11], prm[12],
                                      prm[13], prm[14])
    m_c, m_x, m_y = prm[26], prm[27], prm[28]
    for dc in range(nc):
        acc[dc] = 0
    for ii in range(kh):
        r = x0 + ph - ii * dh
        if r < 0 or r % sh != 0 or r // sh >= Ho:
            continue
        i0 = r // sh
        i1_lo, i1_hi = _inside(ii * dh - ph, sh, H, Ho)
        for ji in range(kw):
            q = y0 + pw - ji * dw
            if q < 0 or q % sw != 0 or q // sw >= Wo:
                continue
            j0 = q // sw
            j1_lo, j1_hi = _inside(ji * dw - pw, sw, W, Wo)
            # mu[x1 = i1*sh + ii*dh - ph, y1 = j1*sw + ji*dw - pw] * sym[i0, j0, i1, j1]
            row = _offset(sym, (i0 * Wo + j0) * Ho * Wo)
            at = m_off + (ii * dh - ph) * m_x + (ji * dw - pw) * m_y
            for dc in range(nc):
                acc[dc] += _dot_window_any(row, Wo, m_addr, m_code, at + dc * m_c, sh * m_x,
                                           sw * m_y, i1_lo, i1_hi, j1_lo, j1_hi)


# The backward kernel's ``prm`` vector. Addresses in bytes, strides in elements;
# grad_gamma's strides are those of its channel diagonal; code ABSENT: not wanted.
_VJP_PRM = ("B Ci G H W Ho Wo kh kw sh sw ph pw dh dw "
            "s_addr s_code s_b s_g s_i0 s_j0 s_i1 s_j1 "
            "m_addr m_code m_b m_c m_x m_y "
            "gg_addr gg_code gg_b gg_c gg_x0 gg_y0 gg_x1 gg_y1 "
            "gm_addr gm_code gm_b gm_c gm_x gm_y nt pairs sym_addr windows").split()


def _vjp_kernel(prm):
    """Overwrite grad_gamma's channel diagonal and grad_mu from grad_S, one row
    ``D[x0, y0, :, :]`` of the group's dGamma (the gradient of the channel sum of gamma's
    diagonal, and of the mu outer product: the same windows) at a time, per thread. For
    grad_mu, a chunk of ``pairs`` (b, g) pairs of ``grad_S + grad_S^T`` (float64) at
    ``sym_addr``; ``windows``: grad_mu window by window, not by rows."""
    B, Ci, G, H, W, Ho, Wo = prm[0], prm[1], prm[2], prm[3], prm[4], prm[5], prm[6]
    s_addr, s_code, s_b, s_g, s_i0, s_j0, s_i1, s_j1 = (prm[15], prm[16], prm[17], prm[18],
                                                          prm[19], prm[20], prm[21], prm[22])
    m_addr, m_code, m_b, m_c, m_x, m_y = prm[23], prm[24], prm[25], prm[26], prm[27], prm[28]
    gg_addr, gg_code, gg_b, gg_c, gg_x0, gg_y0, gg_x1, gg_y1 = (
        prm[29], prm[30], prm[31], prm[32], prm[33], prm[34], prm[35], prm[36])
    gm_addr, gm_code, gm_b, gm_c, gm_x, gm_y = (prm[37], prm[38], prm[39], prm[40], prm[41],
                                                prm[42])
    nt = prm[43] != 0  # grad_gamma is large: stream it past the caches
    pairs, sym_addr, windows = prm[44], prm[45], prm[46] != 0
    Cg, HW, HoWo = Ci // G, H * W, Ho * Wo
    want_mu = gm_code != ABSENT
    for first in range(0, B * G, pairs):
        n = min(pairs, B * G - first)

        # grad_S + grad_S^T: grad_mu's adjoint reads the symmetrised gradient (below).
        for task in prange(n * Ho if want_mu else 0):
            t, i0 = task // Ho, task % Ho
            b, g = (first + t) // G, (first + t) % G
            for j0 in range(Wo):
                dst = _offset(_f64_at(sym_addr), (t * HoWo + i0 * Wo + j0) * HoWo)
                for e in range(HoWo):
                    dst[e] = 0
                at = b * s_b + g * s_g
                _add_plane_any(dst, s_addr, s_code, at + i0 * s_i0 + j0 * s_j0, s_i1, s_j1,
                               Ho, Wo, 1.0)
                _add_plane_any(dst, s_addr, s_code, at + i0 * s_i1 + j0 * s_j1, s_i0, s_j0,
                               Ho, Wo, 1.0)

        for task in prange(n * H):
            t, x0 = task // H, task % H
            b, g = (first + t) // G, (first + t) % G
            s_at = b * s_b + g * s_g
            sym = _offset(_f64_at(sym_addr), t * HoWo * HoWo)  # the pair's block
            # Thread-local: the row (none for grad_mu alone by windows), the group's
            # grad_mu values at (x0, y0).
            row_buf = np.empty(HW if gg_code != ABSENT or not windows else 1, np.float64)
            val_buf = np.empty(Cg, np.float64)
            row, val = _data(row_buf), _data(val_buf)
            for y0 in range(W):
                # D[x0, y0, :, :] by gathering the grad_S rows S[i0, j0] whose window
                # (offset ii, ji) lands on (x0, y0): the adjoint of the forward's box
                # filter. It is stored into every channel of the group (rounded once each).
                if gg_code != ABSENT:
                    for e in range(HW):
                        row[e] = 0
                    _gather_row(row, x0, y0, s_addr, s_code, s_at, s_i0, s_j0, s_i1, s_j1,
                                prm)
                    for ci in range(g * Cg, (g + 1) * Cg):
                        _store_plane_any(gg_addr, gg_code,
                                         b * gg_b + ci * gg_c + x0 * gg_x0 + y0 * gg_y0,
                                         gg_x1, gg_y1, H, W, row, nt)
                if not want_mu:
                    continue
                # grad_mu[b, ci, x0, y0] = sum over (x1, y1) of
                # (D[x0, y0, x1, y1] + D[x1, y1, x0, y0]) * mu[b, ci, x1, y1]: the mu part
                # of S reads the same windows of the outer product mu x mu as the gamma
                # part reads of gamma, so its adjoint is this product with the
                # symmetrised D. Either window by window (_mu_grad_windows), or by
                # rows: the row of the symmetrised D, gathered from grad_S + grad_S^T,
                # dotted with the whole mu plane; D is exactly 0 on the position pairs no
                # offset forms, so for finite values this is the same sum. With an Inf or
                # NaN, those zeros would become NaN (Inf * 0) and summing over offsets
                # before multiplying could miss Inf - Inf; such a dot product is never
                # finite, and a non-finite one is formed again window by window.
                m_at = b * m_b + g * Cg * m_c  # mu[b, g * Cg]
                if windows:
                    _mu_grad_windows(val, Cg, x0, y0, m_addr, m_code, m_at, sym, prm)
                else:
                    for e in range(HW):
                        row[e] = 0
                    _gather_row(row, x0, y0, sym_addr, F64, t * HoWo * HoWo, Wo * HoWo,
                                HoWo, Wo, 1, prm)
                    for dc in range(Cg):  # channel g * Cg + dc
                        val[dc] = _dot_window_any(row, W, m_addr, m_code, m_at + dc * m_c,
                                                  m_x, m_y, 0, H, 0, W)
                        if not np.isfinite(val[dc]):
                            _mu_grad_windows(_offset(val, dc), 1, x0, y0, m_addr, m_code,
                                             m_at + dc * m_c, sym, prm)
                _store_plane_any(gm_addr, gm_code, b * gm_b + g * Cg * gm_c + x0 * gm_x
                                 + y0 * gm_y, gm_c, 0, Cg, 1, val)
            if nt:
                _store_fence()
            # keep the buffers alive while their raw pointers are in use
            row_buf[0] = val_buf[0] = 0


_vjp_parallel = njit(parallel=True, **_jit)(_vjp_kernel)
_vjp_serial = njit(**_jit)(_renamed(_vjp_kernel, "_vjp_kernel_serial"))


# ---------------------------------------------------------------------------------------
# Running it: threading-layer safety.

_lock = threading.Lock()
_layer: str | None = None  # Numba's threading layer, once a parallel region has run
_forked_after_omp = False


def _current_layer() -> str | None:
    try:
        return numba.threading_layer()
    except ValueError:  # no parallel region has run in this process yet
        return None


def _after_fork_in_child() -> None:
    global _forked_after_omp
    if _current_layer() == "omp":
        _forked_after_omp = True


os.register_at_fork(after_in_child=_after_fork_in_child)


def _run(prm, c_value, M) -> None:
    _call(_parallel, _serial, prm, c_value, M)


def _call(parallel, serial, *args) -> None:
    global _layer
    if _forked_after_omp:
        serial(*args)
    elif _layer is not None and _layer != "workqueue":
        parallel(*args)  # GIL released: concurrent calls really run at once
    else:
        # Until the layer is known (the first call chooses it) and for ever on workqueue,
        # one call at a time.
        with _lock:
            parallel(*args)
            _layer = _current_layer()


#: Phase-1 buffer (M plan) per chunk of (b, g) pairs, in bytes: big enough to give every
#: core work, small enough to stay in the last-level cache between phase 1 and phase 2.
#: The backward's chunk of grad_S + grad_S^T is sized by it too.
CHUNK_BYTES = 4 << 20
#: Software prefetch distance, in bytes ahead of the plane / row being read (converted to
#: whole gamma planes and out rows); measured on the ``cpu`` workload, docs/numba.md.
PREFETCH_BYTES = 8 << 10
#: Below this many bytes of channel diagonals the data sit in cache: no prefetching.
PREFETCH_FROM_BYTES = 8 << 20

#: From this many bytes of grad_gamma's channel diagonal on, the backward writes it with
#: non-temporal stores (measured on the ``cpu`` shapes, docs/numba.md).
STREAM_FROM_BYTES = 8 << 20

_O_ADDR, _G_ADDR, _M_ADDR, _C_ADDR, _PAIRS, _W_ADDR = (
    _PRM.index(n) for n in ("o_addr", "g_addr", "m_addr", "c_addr", "pairs", "w_addr"))


#: How many times a term of the direct plan's windows (strided gathers, several pointers)
#: costs a term of phase 1's contiguous four-channel passes: r20-short (1x1, stride 2, 16
#: times fewer terms) 8.7 -> 1.6 ms direct; r20-down (1.7 times fewer) 8.7 ms with M,
#: 9.4 direct (host, one call of the layers suite's shapes).
DIRECT_COST = 4


def _direct_plan(kh, kw, HW, HoWo, Cg):
    """Whether the forward takes the direct plan (no M)."""
    # Per pair it reads Cg*kh*kw*(Ho*Wo)**2 terms where the M plan reads Cg*(H*W)**2 into
    # M, writes M's (H*W)**2 and reads kh*kw*(Ho*Wo)**2 of it back: with few channels M's
    # own traffic counts (mb-dw-s2, one channel a group: direct about 1.1x as fast).
    return DIRECT_COST * Cg * kh * kw * HoWo**2 < Cg * HW**2 + HW**2 + kh * kw * HoWo**2


#: How many times a term of the backward's grad_mu windows (strided, short runs) costs a
#: term of its rows (contiguous dot products), measured on strided ``cpu``-like shapes.
VJP_WINDOWS_COST = 8


def _vjp_windows(kh, kw, HW, HoWo):
    """Whether the backward forms grad_mu window by window, not by rows."""
    # Rows take no (H*W)**2 buffer, so speed decides: (H*W)**2 terms against kh*kw*(Ho*Wo)**2.
    return VJP_WINDOWS_COST * kh * kw * HoWo**2 < HW**2


def _params(p):
    """(the kernel's parameters for p's signature, addresses 0; the accumulation type;
    the size of one (b, g) plane of its buffer: 0 in the direct plan)."""
    acc = np.float64 if p.acc == "float64" else np.float32
    if p.c is None:
        c_part = (0, ABSENT, 0)
    else:
        ci = p.c_info
        c_part = (0, _CODE[ci.dtype], ci.strides[0] if ci.strides else 0)
    o, gi, m = p.out_info, p.gamma_info, p.mu_info
    o_part = (0, _CODE[o.dtype]) + diag_strides(o.strides, p.full_out)
    if gi is None:
        g_part = (0, ABSENT, 0, 0, 0, 0, 0, 0)
    else:
        g_part = (0, _CODE[gi.dtype]) + diag_strides(gi.strides, p.full_gamma)
    Cg = p.Ci // p.G
    direct = _direct_plan(p.kh, p.kw, p.H * p.W, p.Ho * p.Wo, Cg)
    pf = (0, 0)
    if sum(p.diagonal_bytes()) >= PREFETCH_FROM_BYTES:
        isz = 2 if gi is None else _ITEMSIZE[gi.dtype]
        # ahead by whole gamma planes (M plan) or whole S rows' windows (direct plan)
        g_ahead = (p.kh * p.kw * Cg * p.Ho * p.Wo if direct else p.H * p.W) * isz
        pf = (max(1, PREFETCH_BYTES // g_ahead),
              max(1, PREFETCH_BYTES // (p.Ho * p.Wo * _ITEMSIZE[o.dtype])))
    pad = (p.ph, p.pw) if p.sw == 1 else (0, 0)  # M's planes padded, as in _kernel
    plane = 0 if direct else p.H * p.W * (p.H + 2 * pad[0]) * (p.W + 2 * pad[1])
    acc_size = 4 if acc is np.float32 else 8
    pairs = max(1, min(p.B * p.G, CHUNK_BYTES // max(plane * acc_size, 1)))
    prm = np.array((p.B, p.Ci, p.Co, p.G, p.H, p.W, p.Ho, p.Wo, p.kh, p.kw, p.sh, p.sw,
                    p.ph, p.pw, p.dh, p.dw, pairs, *o_part, *g_part, 0,
                    _CODE[m.dtype], *m.strides, *c_part, *pf, int(direct), 0), np.int64)
    assert len(prm) == len(_PRM)
    return prm, acc, plane


def _accumulate_at(prms, optr, gptr, mptr, cptr, c_value, wptr=None):
    """One call: a copy of the signature's parameters (_params) with the call's addresses
    (0 for an absent gamma or a number c) and c_value, the number c; ``wptr``: where the
    result goes when not into out itself (accumulate_apart)."""
    prm, acc, plane = prms
    prm = prm.copy()
    prm[_O_ADDR], prm[_G_ADDR], prm[_M_ADDR], prm[_C_ADDR] = optr, gptr, mptr, cptr
    prm[_W_ADDR] = optr if wptr is None else wptr
    _run(prm, acc(c_value), np.empty(prm[_PAIRS] * plane, acc))


class NumbaBackend(Backend):
    name = "numba"
    device = "cpu"
    dtypes = frozenset({"float16", "bfloat16", "float32", "float64"})

    def accumulate(self, p) -> None:
        self._launch(p, p.out_info.ptr)

    def accumulate_apart(self, p, source) -> None:
        # out's rows are contiguous (the contract): each is read from source, written to out
        self._launch(p, source.__array_interface__["data"][0], p.out_info.ptr)

    @staticmethod
    def _launch(p, optr, wptr=None):
        _accumulate_at(_params(p), optr, 0 if p.gamma_info is None else p.gamma_info.ptr,
                       p.mu_info.ptr, 0 if p.c_info is None else p.c_info.ptr, p.c_value, wptr)

    def bind(self, p):
        """The launcher of p's signature for the front end's fast path (Backend.bind):
        the kernel's parameters are derived once; a call puts its addresses in. (It must
        not keep p, which holds the first call's arrays.)"""
        prms = _params(p)

        def run(out, gamma, mu, c, optr, gptr, mptr, cptr, c_value):
            _accumulate_at(prms, optr, gptr, mptr, cptr, c_value)

        return run

    def patch_moment_vjp(self, a) -> None:
        # Sums in float64 whatever the dtypes ("acc or wider"): one compiled kernel, and
        # the backward's arithmetic is far from its memory traffic (docs/numba.md).
        s, m = a.grad_S_info, a.mu_info
        gg, gm = a.grad_gamma_info, a.grad_mu_info
        if a.grad_gamma is None:
            gg_part = (0, ABSENT, 0, 0, 0, 0, 0, 0)
        else:
            gg_part = ((gg.ptr, _CODE[gg.dtype])
                       + diag_strides(gg.strides, a.full_gamma))
        gm_part = ((0, ABSENT, 0, 0, 0, 0) if a.grad_mu is None
                   else (gm.ptr, _CODE[gm.dtype], *gm.strides))
        nt = int(gg_part[1] != ABSENT
                 and a.B * a.Ci * (a.H * a.W) ** 2 * _ITEMSIZE[gg.dtype] >= STREAM_FROM_BYTES)
        # grad_mu's grad_S + grad_S^T, in chunks of (b, g) pairs: as large as grad_S's
        # (b, g) blocks (in float64), a chunk at a time
        block = (a.Ho * a.Wo) ** 2 if a.grad_mu is not None else 0
        pairs = max(1, min(a.B * a.G, CHUNK_BYTES // max(block * 8, 1)))
        sym = np.empty(pairs * block, np.float64)
        windows = _vjp_windows(a.kh, a.kw, a.H * a.W, a.Ho * a.Wo)
        prm = np.array((a.B, a.Ci, a.G, a.H, a.W, a.Ho, a.Wo, a.kh, a.kw, a.sh, a.sw,
                        a.ph, a.pw, a.dh, a.dw, s.ptr, _CODE[s.dtype], *s.strides,
                        m.ptr, _CODE[m.dtype], *m.strides, *gg_part, *gm_part, nt, pairs,
                        sym.__array_interface__["data"][0], int(windows)), np.int64)
        assert len(prm) == len(_VJP_PRM)
        _call(_vjp_parallel, _vjp_serial, prm)
        del sym  # (held until the kernel is done with its address)

backend = NumbaBackend()
