"""``numba``: the fused, parallel CPU kernel; the default backend for host arrays.

Owns the Numba CPU implementation of SPEC section 1 and its run-time rules: how arrays
reach the kernel, which code is compiled, and how calls run on Numba's threading layer
(which ``convcov._host_kernels``, conv2d_moments' kernels on the host, shares).

How it computes (docs/numba.md has the design notes and the measurements): SPEC section 1
as a walk along S's planes, as the GPU backends' ``cc_walk``. For one ``(b, g)`` and one
input row ``x0``, over the rows ``x1 = X*sh + r`` of x0's residue r modulo sh (``x1 - x0 =
(i1 - i0)*sh``: every diagonal of S's planes at once),

    Q[y0][X][y1]      = sum over ci in g of gamma[b, ci, x0, y0, (ci,) x1, y1]
                                            + mu[b, ci, x0, y0] * mu[b, ci, x1, y1]
    T(x0)[j0][X][j1]  = sum over ji of Q[j0*sw + ji*dw - pw][X][j1*sw + ji*dw - pw]
    S[i0, j0, i1, j1] = sum over ii of T(x0 = i0*sh + ii*dh - ph)[j0][X = i1 + e(ii)]

A work item ``(b, g, segment of i0)`` walks its rows i0 of S's planes. The rows x0 that an
i0 reads are formed once each: the channel sum into Q (gamma read once, in its own order,
four channels a pass), then the row filter into a ring of ``(kh - 1)*dh + 1`` rows of T
(for each j0 one run over X and j1: kw runs of Q). The block ``S[i0]`` is, for each j0,
kh runs of the ring; the blocks of a few rows are kept, then ``c[c0] * S[i0]`` goes into
out's blocks ``[b, c0, i0]`` of those rows (one contiguous run a channel in the diagonal
layout) for every output channel of the group in turn. Everything
but gamma and out stays in L1/L2. A term with a position in the padding is absent, never
``0 * x``: Q's rows y0 in the padding are zeros, T's edge columns (y1 in the padding) are
formed again from the terms inside only, T's rows with x1 in the padding are zeros and
rows x0 in the padding are skipped. Q keeps only the rows y0 that some window reads.
Where runs are short and far apart, gamma's rows and out's runs are prefetched in
software.

Arrays reach the kernel as raw addresses plus strides in elements (the front end's
``ArrayInfo``) and a dtype code, so the compiled code depends on no layout, stride, shape
or input dtype: full and diagonal layouts are just strides, negative strides are pointer
arithmetic. The one specialisation is the accumulation dtype: two compiles, cached on
disk. float16 is converted by the CPU (F16C / Arm fcvt; an exact integer version
elsewhere), bfloat16 by integer arithmetic (Numba has no 16-bit float arithmetic on the
CPU). Sums run in float32 (float64 when an input is float64) and are rounded once into
``out``, to nearest even; from float64 through float32 rounded *to odd*.

The backward (``patch_moment_vjp``, docs/autograd.md) is a second kernel, parallel over
``(pair, x0)``: one row ``D[x0, y0, :, :]`` at a time, in a thread-local buffer, is gathered
from the grad_S windows (the forward's box filter transposed; padded terms absent) and
stored into every channel of the group's gamma gradient (non-temporal stores when large).
``grad_mu`` reads ``grad_S + grad_S^T`` (a chunk of pairs): either by rows, the row of the
symmetrised ``D`` dotted with mu's planes (a non-finite result is formed again window by
window, as the reference's products), or, where the input is much larger than the output
(``_vjp_windows``), window by window only. Sums always in float64: one compile.

Threads: the kernels release the GIL. They rely on a thread-safe Numba threading layer
(``tbb`` or ``omp``, Numba's default order); if Numba ends up on ``workqueue``, which
aborts on concurrent use, this module serialises its calls. GNU OpenMP kills a forked
child that starts a parallel region after its parent used one, so such a child runs a
serial compile of the same kernel.

Must not: validate (the front end did), copy ``out`` or ``gamma``, allocate anything that
grows with ``Ci * Ci`` or ``Co`` (or with ``(H*W)**2``), or change Numba's process-wide
configuration.
"""
from __future__ import annotations

import os
import platform
import threading
from dataclasses import replace
from types import FunctionType

import numba
import numpy as np
from llvmlite import binding as llvm_binding
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic, overload

from .._arrays import ITEMSIZE as _ITEMSIZE, diag_strides, host_view
from . import numpy as _numpy
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
_u8_at = _pointer_to(types.uint8)


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
    """Typed pointer to an array's first element. The kernels' own buffers are indexed
    through pointers too: a slice costs a reference count, and an index into an array
    costs a negative-index check that stops LLVM from vectorising."""
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
def _store_fence(typingctx):
    """A sequentially consistent fence (mfence on x86): makes the weakly ordered
    non-temporal stores visible before the parallel region's end."""

    def codegen(context, builder, sig, args):
        builder.fence("seq_cst")
        return context.get_dummy_value()

    return types.none(), codegen


@intrinsic
def _addr(typingctx, ptr):
    """The address ``ptr`` holds, in bytes."""
    if not isinstance(ptr, types.CPointer):
        return None

    def codegen(context, builder, sig, args):
        return builder.ptrtoint(args[0], ir.IntType(64))

    return types.int64(ptr), codegen


#: Bytes a non-temporal vector store writes: one cache line.
_LINE = 64


@intrinsic
def _update_nt(typingctx, w, p, k, s, cc):
    """``w[k + e] = p[k + e] + cc * s[e]`` for one cache line of w's elements (float32 or
    float64; s and cc in the accumulation dtype, rounded once into w's), as vectors: one
    non-temporal store of the line ``w + k`` (64-byte aligned), no read-for-ownership. The
    same arithmetic, element by element, as the scalar update (no contraction)."""
    if not (isinstance(w, types.CPointer) and w.dtype in (types.float32, types.float64)
            and p == w and isinstance(s, types.CPointer) and cc == s.dtype):
        return None
    n = _LINE // (w.dtype.bitwidth // 8)

    def codegen(context, builder, sig, args):
        wp, pp, k, sp, c = args
        ot, at = context.get_value_type(w.dtype), context.get_value_type(s.dtype)
        ov, av = ir.VectorType(ot, n), ir.VectorType(at, n)
        pv = builder.load(builder.bitcast(builder.gep(pp, [k]), ov.as_pointer()), align=1)
        sv = builder.load(builder.bitcast(sp, av.as_pointer()), align=1)
        cv = builder.insert_element(ir.Constant(av, ir.Undefined), c, ir.IntType(32)(0))
        cv = builder.shuffle_vector(cv, ir.Constant(av, ir.Undefined),
                                    ir.Constant(ir.VectorType(ir.IntType(32), n), [0] * n))
        prod = builder.fmul(cv, sv)
        # the sum in the wider of the two dtypes, as the scalar update's promotion
        if w.dtype.bitwidth > s.dtype.bitwidth:
            prod = builder.fpext(prod, ov)
        elif w.dtype.bitwidth < s.dtype.bitwidth:
            pv = builder.fpext(pv, av)
        r = builder.fadd(pv, prod)
        if w.dtype.bitwidth < s.dtype.bitwidth:
            r = builder.fptrunc(r, ov)
        st = builder.store(r, builder.bitcast(builder.gep(wp, [k]), ov.as_pointer()),
                           align=_LINE)
        st.set_metadata("nontemporal", builder.module.add_metadata([ir.IntType(32)(1)]))
        return context.get_dummy_value()

    return types.none(w, p, k, s, cc), codegen


def _prefetcher(write):
    """An intrinsic ``prefetch(ptr, k)``: ask for the cache line of ``ptr[k]``, to be read
    (prefetcht0) or written (prefetchw). For short runs far apart, which the hardware
    prefetchers do not follow."""

    @intrinsic
    def prefetch(typingctx, ptr, k):
        if not isinstance(ptr, types.CPointer):
            return None

        def codegen(context, builder, sig, args):
            i8p, i32 = ir.IntType(8).as_pointer(), ir.IntType(32)
            fn = cgutils.get_or_insert_function(
                builder.module, ir.FunctionType(ir.VoidType(), [i8p, i32, i32, i32]),
                "llvm.prefetch.p0")
            at = builder.bitcast(builder.gep(args[0], [args[1]]), i8p)
            builder.call(fn, [at, i32(write), i32(3), i32(1)])
            return context.get_dummy_value()

        return types.none(ptr, k), codegen

    return prefetch


_prefetch_read, _prefetch_write = _prefetcher(0), _prefetcher(1)



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


@njit(**_inner)
def _inside(offset, s, n, n_out):
    """[lo, hi): the outputs i < n_out whose input position i*s + offset lies in [0, n)."""
    lo = max(0, (s - 1 - offset) // s)
    hi = min(n_out, (n - 1 - offset) // s + 1)
    return lo, max(lo, hi)


# ---------------------------------------------------------------------------------------
# The forward. Inner loops are written once and compiled per element decoder (and
# encoder), dispatched on the dtype code by an ``*_any`` function; unit strides get their
# own loop so that LLVM vectorises it.


def _row_loader(dec):
    """A compiled ``load_rows`` with the element decoder ``dec`` built in."""

    def load_rows(dst, p, off, n, rs, W, ys):
        """``dst[r*W + e] = dec(p[off + r*rs + e*ys])`` in dst's dtype, r < n, e < W."""
        for r in range(n):
            d, o = _offset(dst, r * W), off + r * rs
            for e in range(W):
                d[e] = _like(dec(p[o + e * ys]), d)

    return njit(**_inner)(load_rows)


_load_rows_keep = _row_loader(_keep)
_load_rows_f16 = _row_loader(_f16_decode)
_load_rows_bf16 = _row_loader(_bf16_decode)


@njit(**_inner)
def _load_rows_any(code, addr, dst, off, n, rs, W, ys):
    if code == F32:
        _load_rows_keep(dst, _f32_at(addr), off, n, rs, W, ys)
    elif code == F64:
        _load_rows_keep(dst, _f64_at(addr), off, n, rs, W, ys)
    elif code == F16:
        _load_rows_f16(dst, _u16_at(addr), off, n, rs, W, ys)
    else:
        _load_rows_bf16(dst, _u16_at(addr), off, n, rs, W, ys)


@njit(**_inner)
def _prefetch_block(addr, isz, off, n0, s0, n1, s1, n2, s2, W):
    """Ask for the rows of W contiguous elements of ``isz`` bytes at element offsets
    ``off + a*s0 + b*s1 + c*s2``, a < n0, b < n1, c < n2, from the array at ``addr``."""
    p = _u8_at(addr)
    for a in range(n0):
        for b in range(n1):
            for c in range(n2):
                at = (off + a * s0 + b * s1 + c * s2) * isz
                for e in range(0, W * isz + 63, 64):
                    _prefetch_read(p, at + e)


def _q_adder(dec):
    """A compiled ``add_q`` with gamma's element decoder built in (a decoder passed as an
    argument would make the kernel uncacheable)."""

    def add_q(q, qy, ym, Wy, first, gp, ga, gy0, gc, gs, gy, mr, mx, mc, ms, n, qs, W, four,
              with_gamma, pf, line):
        """Q's rows ``ym[y0] > 0``, y0 < Wy, each n rows of W: ``q[ym[y0]*qy + r*qs + e]
        (first: =, else +=)`` the sum over one channel, or ``four``, k of
        ``dec(gp[ga + k*gc + y0*gy0 + r*gs + e*gy]) + mx[k*mc + y0] * mr[k*mc + r*ms + e]``
        in q's dtype; without gamma the mu terms alone. ``pf``: prefetch gamma's rows that
        many rows y0 ahead (``line``: elements a cache line)."""
        if qs == W and gs == W * gy and ms == W:  # the rows are one run
            W, n = W * n, 1
        for y0 in range(Wy):
            if ym[y0] <= 0:
                continue
            if pf and gy == 1 and y0 + pf < Wy and with_gamma:  # rows pf rows y0 ahead
                for k in range(4 if four else 1):
                    for r in range(n):
                        for e in range(0, W, line):
                            _prefetch_read(gp, ga + k * gc + (y0 + pf) * gy0 + r * gs + e)
            m0 = mx[y0]
            m1, m2, m3 = (mx[mc + y0], mx[2 * mc + y0], mx[3 * mc + y0]) if four else (m0, m0, m0)
            for r in range(n):
                d, g = _offset(q, ym[y0] * qy + r * qs), ga + y0 * gy0 + r * gs
                a0, a1 = _offset(mr, r * ms), _offset(mr, r * ms + mc)
                a2, a3 = _offset(mr, r * ms + 2 * mc), _offset(mr, r * ms + 3 * mc)
                if not four:  # one channel: one loop (it reads few enough arrays)
                    if with_gamma:
                        for e in range(W):
                            v = _like(dec(gp[g + e * gy]), d) + m0 * a0[e]
                            d[e] = v if first else d[e] + v
                    else:
                        for e in range(W):
                            v = m0 * a0[e]
                            d[e] = v if first else d[e] + v
                    continue
                # Four channels: mu's terms, then gamma's. A loop that reads at most four
                # arrays besides d is one LLVM vectorises (its overlap checks stay under
                # LLVM's limit): r20-down 1.46x, r20-short 1.21x on the host.
                if first:
                    for e in range(W):
                        d[e] = (m0 * a0[e] + m1 * a1[e]) + (m2 * a2[e] + m3 * a3[e])
                else:
                    for e in range(W):
                        d[e] += (m0 * a0[e] + m1 * a1[e]) + (m2 * a2[e] + m3 * a3[e])
                if with_gamma and gy == 1:  # contiguous rows: this loop is vectorised
                    g0, g1 = _offset(gp, g), _offset(gp, g + gc)
                    g2, g3 = _offset(gp, g + 2 * gc), _offset(gp, g + 3 * gc)
                    for e in range(W):
                        d[e] += ((_like(dec(g0[e]), d) + _like(dec(g1[e]), d))
                                 + (_like(dec(g2[e]), d) + _like(dec(g3[e]), d)))
                elif with_gamma:
                    for e in range(W):
                        k = g + e * gy
                        d[e] += ((_like(dec(gp[k]), d) + _like(dec(gp[k + gc]), d))
                                 + (_like(dec(gp[k + 2 * gc]), d) + _like(dec(gp[k + 3 * gc]), d)))

    return njit(**_inner)(add_q)


_add_q_keep = _q_adder(_keep)
_add_q_f16 = _q_adder(_f16_decode)
_add_q_bf16 = _q_adder(_bf16_decode)


@njit(**_inner)
def _add_q_any(code, addr, q, qy, ym, Wy, first, ga, gy0, gc, gs, gy, mr, mx, mc, ms, n, qs,
               W, four, pf):
    if code == F32:
        _add_q_keep(q, qy, ym, Wy, first, _f32_at(addr), ga, gy0, gc, gs, gy, mr, mx, mc, ms,
                    n, qs, W, four, True, pf, 16)
    elif code == F64:
        _add_q_keep(q, qy, ym, Wy, first, _f64_at(addr), ga, gy0, gc, gs, gy, mr, mx, mc, ms,
                    n, qs, W, four, True, pf, 8)
    elif code == F16:
        _add_q_f16(q, qy, ym, Wy, first, _u16_at(addr), ga, gy0, gc, gs, gy, mr, mx, mc, ms,
                   n, qs, W, four, True, pf, 32)
    elif code == BF16:
        _add_q_bf16(q, qy, ym, Wy, first, _u16_at(addr), ga, gy0, gc, gs, gy, mr, mx, mc, ms,
                    n, qs, W, four, True, pf, 32)
    else:  # no gamma
        _add_q_keep(q, qy, ym, Wy, first, mr, 0, 0, 0, 0, 0, mr, mx, mc, ms, n, qs, W, four,
                    False, 0, 16)


@njit(**_inner)
def _sum_runs(dst, nr, dp, n, src, sp, at, k, step):
    """``dst[r*dp + e] = sum over w < k of src[r*sp + at[w] + e*step]`` for rows r < nr,
    e < n, four runs a pass (dst loaded and stored once per four): the row filter of T
    and the column sum of S."""
    f = k % 4 if k % 4 else min(k, 4)  # the first pass: the remainder, or four
    if dp == n and sp == n * step:  # the rows are one run
        n, nr = n * nr, 1
    for r in range(nr):
        d = _offset(dst, r * dp)
        s0, s1 = _offset(src, r * sp + at[0]), _offset(src, r * sp + at[1])
        s2, s3 = _offset(src, r * sp + at[2]), _offset(src, r * sp + at[3])
        if f == 0:
            for e in range(n):
                d[e] = 0
        elif f == 1:
            for e in range(n):
                d[e] = s0[e * step]
        elif f == 2:
            for e in range(n):
                d[e] = s0[e * step] + s1[e * step]
        elif f == 3:
            for e in range(n):
                d[e] = s0[e * step] + s1[e * step] + s2[e * step]
        else:
            for e in range(n):
                d[e] = (s0[e * step] + s1[e * step]) + (s2[e * step] + s3[e * step])
        for w in range(f, k, 4):
            s0, s1 = _offset(src, r * sp + at[w]), _offset(src, r * sp + at[w + 1])
            s2, s3 = _offset(src, r * sp + at[w + 2]), _offset(src, r * sp + at[w + 3])
            for e in range(n):
                d[e] += (s0[e * step] + s1[e * step]) + (s2[e * step] + s3[e * step])


def _out_adder(dec, enc, streams):
    """A compiled ``add_out`` with the decoder and encoder of out's dtype built in;
    ``streams``: whether out's dtype has the non-temporal update (float32, float64)."""

    def add_out(p, w, off, n0, s0, n1, s1, n2, s2, src, cc, apart, pf, nxt, line, nt):
        """``w[k] = enc(dec(p[k]) + cc * src[(a*n1 + b)*n2 + e])``, ``k = off + a*s0 + b*s1 +
        e*s2`` over a < n0, b < n1, e < n2: out's block [b, c0, i0], its dims (j0, i1, j1)
        merged where contiguous (S's block is contiguous), rounded once; in place unless
        ``apart``. ``pf``: prefetch (for writing) the run that many runs ahead, on into
        the next block at ``off + nxt`` (``line``: elements a cache line). ``nt`` (apart
        only): contiguous runs written a cache line at a time, non-temporally."""
        R = n0 * n1
        for row in range(R):
            if pf and (row + pf < R or nxt):
                ah = row + pf
                k = off + (0 if ah < R else nxt) + ah % R // n1 * s0 + ah % n1 * s1
                for e in range(0, n2 * s2, line):
                    _prefetch_write(w, k + e)
            o, s = off + row // n1 * s0 + row % n1 * s1, _offset(src, row * n2)
            if apart:
                done = 0
                if streams and nt and s2 == 1:
                    # up to w's first whole line, then whole lines (w's lines are
                    # element-aligned: the caller checked)
                    done = min(n2, (-_addr(_offset(w, o)) & (_LINE - 1)) // (_LINE // line))
                    for e in range(done):
                        w[o + e] = enc(dec(p[o + e]) + cc * s[e])
                    while done + line <= n2:
                        _update_nt(w, p, o + done, _offset(s, done), cc)
                        done += line
                for e in range(done, n2):
                    w[o + e * s2] = enc(dec(p[o + e * s2]) + cc * s[e])
            else:
                for e in range(n2):
                    p[o + e * s2] = enc(dec(p[o + e * s2]) + cc * s[e])

    return njit(**_inner)(add_out)


_add_out_f32 = _out_adder(_keep, _f32_encode, True)
_add_out_f64 = _out_adder(_keep, _f64_encode, True)
_add_out_f16 = _out_adder(_f16_decode, _f16_encode, False)
_add_out_bf16 = _out_adder(_bf16_decode, _bf16_encode, False)


@njit(**_inner)
def _add_out_any(code, addr, waddr, off, n0, s0, n1, s1, n2, s2, src, cc, pf, nxt, nt):
    a = waddr != addr
    if code == F32:
        _add_out_f32(_f32_at(addr), _f32_at(waddr), off, n0, s0, n1, s1, n2, s2, src, cc, a,
                     pf, nxt, 16, nt)
    elif code == F64:
        _add_out_f64(_f64_at(addr), _f64_at(waddr), off, n0, s0, n1, s1, n2, s2, src, cc, a,
                     pf, nxt, 8, nt)
    elif code == F16:
        _add_out_f16(_u16_at(addr), _u16_at(waddr), off, n0, s0, n1, s1, n2, s2, src, cc, a,
                     pf, nxt, 32, nt)
    else:
        _add_out_bf16(_u16_at(addr), _u16_at(waddr), off, n0, s0, n1, s1, n2, s2, src, cc, a,
                      pf, nxt, 32, nt)


# The kernel's integer arguments, in the order of its ``prm`` vector (one int64 array:
# Numba types one array argument faster than forty integers). Addresses are in bytes,
# strides in elements; gamma's strides are those of its channel diagonal; out's block
# [b, c0, i0] is (n0, s0) x (n1, s1) x (n2, s2), its dims (j0, i1, j1) merged where
# contiguous; pf: out's runs prefetched ahead (0: none); nt: a result written apart from
# out is streamed (non-temporal stores; out's item size, 0: not streamed).
_PRM = ("B G Cg Cog H W Ho Wo kh kw sh sw ph pw dh dw nseg seglen "
        "o_addr o_code o_b o_c o_i0 n0 s0 n1 s1 n2 s2 pf w_addr "
        "g_addr g_code g_b g_c g_x0 g_y0 g_x1 g_y1 "
        "m_addr m_code m_b m_c m_x m_y c_addr c_code c_s pf_g pf_x nt srows").split()


def _kernel(prm, c_value, proto):
    """Add ``c[c0] * S[b, g(c0)]`` into out (``proto``: an array of the accumulation dtype)."""
    B, G, Cg, Cog, H, W, Ho, Wo = prm[0], prm[1], prm[2], prm[3], prm[4], prm[5], prm[6], prm[7]
    kh, kw, sh, sw, ph, pw, dh, dw = (prm[8], prm[9], prm[10], prm[11], prm[12], prm[13],
                                      prm[14], prm[15])
    nseg, seglen = prm[16], prm[17]
    o_addr, o_code, o_b, o_c, o_i0 = prm[18], prm[19], prm[20], prm[21], prm[22]
    n0, s0, n1, s1, n2, s2, pf, w_addr = (prm[23], prm[24], prm[25], prm[26], prm[27], prm[28],
                                          prm[29], prm[30])
    g_addr, g_code, g_b, g_c, g_x0, g_y0, g_x1, g_y1 = (prm[31], prm[32], prm[33], prm[34],
                                                          prm[35], prm[36], prm[37], prm[38])
    m_addr, m_code, m_b, m_c, m_x, m_y = prm[39], prm[40], prm[41], prm[42], prm[43], prm[44]
    c_addr, c_code, c_s, pf_g, pf_x, nt = prm[45], prm[46], prm[47], prm[48], prm[49], prm[50]
    srows = prm[51]  # rows i0 of S formed before their update (each output channel's in turn)
    # Q[y][X][y1] (y: a row y0 that windows read, or 0, a zero row for the padding; x1 =
    # X*sh + r, the rows of x0's residue r modulo sh) has rows of pitch Wq = sw*PT, and
    # T[j0][X][j1] rows of pitch PT: then for each j0 the row filter over all X is kw runs
    # of Q with step sw; the terms with y1 in the padding are formed again apart (the
    # edge columns j1 < jl and j1 >= jh).
    X1n = (H + sh - 1) // sh
    PT = max((W + sw - 1) // sw, Wo)
    Wq, QY = sw * PT, X1n * sw * PT  # Q's pitch; one row y of Q
    MQ = pw + (kw - 1) * dw  # Q's margins, read only for edge columns
    nslot = (kh - 1) * dh + 1  # the ring: the rows x0 that one i0 reads span this many
    # T's rows X in [Xmin, Xmin + XR) are kept (zeros where x1 lies in the padding), so
    # that the run X = i1 + e of every offset ii spans all i1 < Ho.
    Xmin = (-ph - sh + 1) // sh
    XR = ((kh - 1) * dh - ph) // sh + Ho - Xmin
    TS = Wo * XR * PT  # one ring slot
    for item in prange(B * G * nseg):
        b, g, seg = item // (G * nseg), item // nseg % G, item % nseg
        i0a = seg * seglen
        i0b = min(Ho, i0a + seglen)
        # Thread-local: Q's row of each y0 + pw (0: the zero row; -1: none); which x0 each
        # ring slot holds; the runs a sum reads; each ji's columns j1 inside the input.
        na = max(kh, kw) + 4
        i_buf = np.zeros(W + 2 * pw + nslot + na + 2 * kw, np.int64)
        ym = _data(i_buf)
        held, at = _offset(ym, W + 2 * pw), _offset(ym, W + 2 * pw + nslot)
        jlo, jhi = _offset(at, na), _offset(at, na + kw)
        jl, jh = 0, Wo  # the columns j1 whose every term lies inside
        for y in range(W):
            ym[pw + y] = -1
        ny = 1
        for ji in range(kw):
            jlo[ji], jhi[ji] = _inside(ji * dw - pw, sw, W, Wo)
            jl, jh = max(jl, jlo[ji]), min(jh, jhi[ji])
            for j0 in range(Wo):
                y = j0 * sw + ji * dw
                if pw <= y < W + pw and ym[y] < 0:
                    ym[y] = ny
                    ny += 1
        jh = max(jl, jh)
        for k in range(nslot):
            held[k] = -1
        # mu's rows x1 then x0 in the accumulation dtype, a channel a block; Q (zeroed
        # once: its row 0 and margins stay 0); the ring of T; the block S[i0].
        mu_buf = np.empty(Cg * (X1n + 1) * W, proto.dtype)
        q_buf = np.zeros(ny * QY + 2 * MQ, proto.dtype)
        t_buf = np.zeros(nslot * TS, proto.dtype)
        s_buf = np.empty(srows * Wo * Ho * Wo, proto.dtype)
        mu, q, t, s = _data(mu_buf), _offset(_data(q_buf), MQ), _data(t_buf), _data(s_buf)
        for i0 in range(i0a, i0b):
            for ii in range(kh):
                x0 = i0 * sh + ii * dh - ph
                if x0 < 0 or x0 >= H or held[x0 % nslot] == x0:
                    continue
                slot, r = x0 % nslot, x0 % sh
                held[slot] = x0
                ts = _offset(t, slot * TS - Xmin * PT)  # T[j0][X] at ts + (j0*XR + X)*PT
                # The rows X that the segment's rows i0 read with this x0 (the union over
                # the offsets ii2 that reach it); T's rows with x1 in the padding are 0.
                Xlo, Xhi = X1n, 0
                for ii2 in range(kh):
                    u = x0 + ph - ii2 * dh
                    if u % sh == 0 and i0a <= u // sh < i0b:
                        lo, hi = _inside(ii2 * dh - ph, sh, H, Ho)
                        if lo < hi:
                            e = (ii2 * dh - ph - r) // sh
                            Xlo, Xhi = min(Xlo, lo + e), max(Xhi, hi + e)
                Xin = (H - r + sh - 1) // sh  # x1 = X*sh + r < H for X < Xin
                for j0 in range(Wo):
                    for e in range((j0 * XR + Xmin) * PT, j0 * XR * PT):
                        ts[e] = 0
                    for e in range((j0 * XR + Xin) * PT, (j0 * XR + Xmin + XR) * PT):
                        ts[e] = 0
                if Xlo >= Xhi:
                    continue
                # mu's rows; Q's rows y0 that windows read, X in [Xlo, Xhi): the channel
                # sum, four channels a pass, gamma in its own order (channel, y0, x1, y1)
                for ci in range(Cg):
                    a = b * m_b + (g * Cg + ci) * m_c
                    mr = _offset(mu, ci * (X1n + 1) * W)
                    _load_rows_any(m_code, m_addr, _offset(mr, Xlo * W), a + (Xlo * sh + r) * m_x,
                                   Xhi - Xlo, sh * m_x, W, m_y)
                    _load_rows_any(m_code, m_addr, _offset(mr, X1n * W), a + x0 * m_x, 1, 0, W,
                                   m_y)
                ci = 0
                while ci < Cg:
                    four = ci + 4 <= Cg
                    mr = _offset(mu, ci * (X1n + 1) * W)
                    _add_q_any(g_code, g_addr, _offset(q, Xlo * Wq), QY, _offset(ym, pw), W,
                               ci == 0, b * g_b + (g * Cg + ci) * g_c + x0 * g_x0
                               + (Xlo * sh + r) * g_x1, g_y0, g_c, sh * g_x1, g_y1,
                               _offset(mr, Xlo * W), _offset(mr, X1n * W), (X1n + 1) * W, W,
                               Xhi - Xlo, Wq, W, four, pf_g)
                    ci += 4 if four else 1
                # the next row x0's gamma rows, asked for while this one's T, S and out
                # are formed
                if pf_x and x0 + 1 < H:
                    r1 = (x0 + 1) % sh
                    _prefetch_block(g_addr, pf_x, b * g_b + g * Cg * g_c + (x0 + 1) * g_x0
                                    + r1 * g_x1, Cg, g_c, W, g_y0, (H - r1 + sh - 1) // sh,
                                    sh * g_x1, W)
                # T, the row filter along y, into the ring: for each j0 one run over X and
                # j1, kw runs of Q; then the edge columns, whose terms in the padding are
                # absent (not the neighbouring row's values)
                for j0 in range(Wo):
                    tr = _offset(ts, (j0 * XR + Xlo) * PT)
                    for ji in range(kw):
                        at[ji] = ym[j0 * sw + ji * dw] * QY + Xlo * Wq + ji * dw - pw
                    _sum_runs(tr, 1, 0, (Xhi - Xlo) * PT, q, 0, at, kw, sw)
                    for X in range(Xhi - Xlo):
                        for k in range(jl + Wo - jh):
                            j1 = k if k < jl else k - jl + jh
                            v = _like(0, proto)
                            for ji in range(kw):
                                if jlo[ji] <= j1 < jhi[ji]:
                                    v += q[at[ji] + X * Wq + j1 * sw]
                            tr[X * PT + j1] = v
            # S[i0, j0, i1, :] = sum over ii of T(x0)[j0][i1 + e]: for each j0, kh runs of
            # the ring over all i1 (zeros where x1 lies in the padding)
            nv = 0
            for ii in range(kh):
                x0 = i0 * sh + ii * dh - ph
                if 0 <= x0 < H:  # else the whole term lies in the padding: skipped
                    at[nv] = (x0 % nslot) * TS + ((ii * dh - ph - x0 % sh) // sh - Xmin) * PT
                    nv += 1
            r0 = i0 - (i0 - i0a) % srows  # the first row of S's buffer
            sr = _offset(s, (i0 - r0) * Wo * Ho * Wo)
            for j0 in range(Wo):
                _sum_runs(_offset(sr, j0 * Ho * Wo), Ho, Wo, Wo, _offset(t, j0 * XR * PT), PT,
                          at, nv, 1)
            if i0 + 1 < min(i0b, r0 + srows):
                continue
            # c[c0] * S[r0..i0] into out[b, c0, r0..i0] for each c0 of the group in turn; out's
            # runs prefetched on into the next block, (b, c0, i + 1), (b, c0 + 1, r0) or
            # (b, g*Cog, i0 + 1)
            for c0 in range(g * Cog, (g + 1) * Cog):
                cc = _like(c_value if c_code == ABSENT else _load(c_addr, c_code, c0 * c_s),
                           proto)
                for i in range(r0, i0 + 1):
                    nxt = (o_i0 if i < i0 else o_c - (i0 - r0) * o_i0 if c0 + 1 < (g + 1) * Cog
                           else o_i0 - (Cog - 1) * o_c if i0 + 1 < i0b else 0)
                    _add_out_any(o_code, o_addr, w_addr, b * o_b + c0 * o_c + i * o_i0, n0, s0,
                                 n1, s1, n2, s2, _offset(s, (i - r0) * Wo * Ho * Wo), cc, pf,
                                 nxt, nt)
        if nt:
            _store_fence()  # the item's streamed lines, visible before the region ends
        # Raw pointers hold no reference: use the buffers last, so that Numba keeps them.
        mu_buf[0] = q_buf[0] = t_buf[0] = s_buf[0] = 0
        i_buf[0] = 0


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
                _add_window_any(dst, s_addr, s_code, at + i0 * s_i0 + j0 * s_j0, s_i1, s_j1,
                                0, Ho, 0, Wo, Wo, 1, 1.0)
                _add_window_any(dst, s_addr, s_code, at + i0 * s_i1 + j0 * s_j1, s_i0, s_j0,
                                0, Ho, 0, Wo, Wo, 1, 1.0)

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


_threads = numba.get_num_threads  # (tests ask for more segments)
#: Software prefetch of gamma's rows one row y0 ahead where a row y0 of one channel spans
#: at most this many bytes (short runs): grp8 and dil2 1.1x, cpu 1.09x, mb-dw-s2 1.05-1.08x
GAMMA_PF_SPAN = 1024
#: Software prefetch of the next row x0's gamma (strided rows x1) up to this many bytes:
#: mb-dw-s2 1.6x (8 KiB); r20-down's 1 MiB lost 10-20%
NEXT_ROW_BYTES = 32 << 10
#: Software prefetch of out's runs (full layout), in bytes ahead: the ``cpu`` workload 1.15x
PREFETCH_BYTES = 8 << 10

#: S's rows kept, in bytes, before each output channel's rows of out are updated in turn
#: (one run a channel): layers suite 1.08x, grp8 1.20x, mb-pw 1.19x on the Intel host.
S_ROWS_BYTES = 256 << 10

#: The backward's chunk of grad_S + grad_S^T, in bytes.
CHUNK_BYTES = 4 << 20
#: From this many bytes of grad_gamma's channel diagonal on, the backward writes it with
#: non-temporal stores (measured on the ``cpu`` shapes, docs/numba.md); so does
#: accumulate_apart its result from this many bytes of out's diagonal on.
STREAM_FROM_BYTES = 8 << 20

_O_ADDR, _G_ADDR, _M_ADDR, _C_ADDR, _W_ADDR, _PF, _NT = (
    _PRM.index(n) for n in ("o_addr", "g_addr", "m_addr", "c_addr", "w_addr", "pf", "nt"))
_PROTO = {"float32": np.zeros(1, np.float32), "float64": np.zeros(1, np.float64)}


#: How many times a term of the backward's grad_mu windows (strided, short runs) costs a
#: term of its rows (contiguous dot products), measured on strided ``cpu``-like shapes.
VJP_WINDOWS_COST = 8


def _vjp_windows(kh, kw, HW, HoWo):
    """Whether the backward forms grad_mu window by window, not by rows."""
    # Rows take no (H*W)**2 buffer, so speed decides: (H*W)**2 terms against kh*kw*(Ho*Wo)**2.
    return VJP_WINDOWS_COST * kh * kw * HoWo**2 < HW**2


def _merged(dims):
    """(n, stride) pairs, outermost first, with each pair merged into the one outside it
    where together they are one run; padded to three."""
    out = []
    for n, s in dims:
        if out and out[-1][1] == n * s:
            out[-1] = (out[-1][0] * n, s)
        else:
            out.append((n, s))
    return [(1, 0)] * (3 - len(out)) + out


def _params(p):
    """(the kernel's parameters for p's signature, addresses 0; the accumulation type and
    its prototype array)."""
    o, gi, m = p.out_info, p.gamma_info, p.mu_info
    _, o_b, o_c, o_i0, o_j0, o_i1, o_j1 = (0,) + diag_strides(o.strides, p.full_out)
    dims = _merged([(p.Wo, o_j0), (p.Ho, o_i1), (p.Wo, o_j1)])
    g_part = ((0, ABSENT, 0, 0, 0, 0, 0, 0) if gi is None
              else (0, _CODE[gi.dtype]) + diag_strides(gi.strides, p.full_gamma))
    c_part = ((0, ABSENT, 0) if p.c is None else
              (0, _CODE[p.c_info.dtype], p.c_info.strides[0] if p.c_info.strides else 0))
    # Items (b, g, segment of i0): at least one a thread.
    nseg = min(p.Ho, -(-_threads() // (p.B * p.G)))
    seglen = -(-p.Ho // nseg)
    nseg = -(-p.Ho // seglen)
    # out's runs prefetched PREFETCH_BYTES ahead where its blocks are runs far apart (the
    # full layout)
    runs = dims[0][0] * dims[1][0]
    pf = 0
    if runs > 1:
        pf = min(runs, -(-PREFETCH_BYTES // (dims[2][0] * _ITEMSIZE[o.dtype])))
    # gamma's rows one row y0 ahead where those of one y0 span at most GAMMA_PF_SPAN bytes
    span = (p.H // p.sh * p.W * _ITEMSIZE[gi.dtype]) if gi is not None else 1 << 60
    pf_g = int(span <= GAMMA_PF_SPAN)
    # The next row x0's gamma rows asked for while this one's are summed, where rows x1
    # are a stride apart (sh > 1: the hardware prefetchers lose them) and they are few
    # (NEXT_ROW_BYTES). (pf_x: gamma's item size; 0: none)
    pf_x = 0
    if gi is not None and gi.strides[-1] == 1 and p.sh > 1 and (
            p.Ci // p.G * -(-p.H // p.sh) * p.W * p.W * _ITEMSIZE[gi.dtype] <= NEXT_ROW_BYTES):
        pf_x = _ITEMSIZE[gi.dtype]
    # A result written apart from out (accumulate_apart) is streamed where it is contiguous
    # runs of float32 or float64 too large for the cache.
    nt = _ITEMSIZE[o.dtype] if (o.dtype in ("float32", "float64") and dims[2][1] == 1 and
                                p.diagonal_bytes()[1] >= STREAM_FROM_BYTES) else 0
    # Rows of S formed before each output channel's rows are updated in turn, up to
    # S_ROWS_BYTES of S: out's rows of one channel are then one run (diagonal layout).
    srows = max(1, min(seglen, S_ROWS_BYTES // (p.Wo * p.Ho * p.Wo * _ITEMSIZE[p.acc])))
    prm = np.array((p.B, p.G, p.Ci // p.G, p.Co // p.G, p.H, p.W, p.Ho, p.Wo, p.kh, p.kw,
                    p.sh, p.sw, p.ph, p.pw, p.dh, p.dw, nseg, seglen,
                    0, _CODE[o.dtype], o_b, o_c, o_i0, *(v for d in dims for v in d), pf, 0,
                    *g_part, 0, _CODE[m.dtype], *m.strides, *c_part, pf_g, pf_x, nt, srows),
                   np.int64)
    assert len(prm) == len(_PRM)
    acc = np.float64 if p.acc == "float64" else np.float32
    return prm, acc, _PROTO[p.acc]


def _accumulate_at(prms, optr, gptr, mptr, cptr, c_value, wptr=None):
    """One call: a copy of the signature's parameters (_params) with the call's addresses
    (0 for an absent gamma or a number c) and c_value, the number c; ``wptr``: where the
    result goes when not into out itself (accumulate_apart)."""
    prm, acc, proto = prms
    prm = prm.copy()
    prm[_O_ADDR], prm[_G_ADDR], prm[_M_ADDR], prm[_C_ADDR] = optr, gptr, mptr, cptr
    prm[_W_ADDR] = optr if wptr is None else wptr
    if wptr is None or wptr % max(prm[_NT], 1):
        prm[_NT] = 0  # in place, or the result's elements not aligned to their size
    elif prm[_NT]:
        prm[_PF] = 0  # streamed lines are not fetched
    _call(_parallel, _serial, prm, acc(c_value), proto)


def _far_padding(p) -> bool:
    """A padding past the input and the kernel's span on either axis: the walk's buffers
    are indexed by padded position, so such a call (a few windows touch the input, if any)
    takes the numpy reference's sums (:func:`_reference`), which read the input in place."""
    return p.ph > p.H + p.dh * (p.kh - 1) or p.pw > p.W + p.dw * (p.kw - 1)


@njit(**_jit)
def _from_bf16(u):
    """bfloat16 bits (a contiguous uint16 array) as float64 (exact)."""
    flat, r = u.ravel(), np.empty(u.size, np.float64)
    for i in range(u.size):
        r[i] = _bf16_decode(flat[i])
    return r.reshape(u.shape)


@njit(**_jit)
def _to_bf16(v):
    """A contiguous float64 array as bfloat16 bits, rounded once (as the kernel's stores)."""
    flat, r = v.ravel(), np.empty(v.size, np.uint16)
    for i in range(v.size):
        r[i] = _bf16_encode(flat[i])
    return r.reshape(v.shape)


def _reference(p, source=None) -> None:
    """``out = source + c * S`` (source: out itself unless given) with S from the numpy
    reference, summed in float64 and rounded once into out; bfloat16 (which numpy lacks)
    is decoded and encoded here. Only gamma's channel diagonal is decoded."""
    def dec(a, info):
        if info is None or info.dtype != "bfloat16":
            return a
        return _from_bf16(np.ascontiguousarray(a))

    gamma = p.gamma
    if gamma is not None and p.full_gamma:
        gamma = _numpy.channel_diagonal(gamma)
    S = _numpy.patch_moment(replace(p, gamma=dec(gamma, p.gamma_info), full_gamma=False,
                                    mu=dec(p.mu, p.mu_info)))
    c = np.full(p.Co, p.c_value) if p.c is None else np.asarray(dec(p.c, p.c_info), np.float64)
    bf16 = p.out_info.dtype == "bfloat16"
    _numpy.add_term(p, S, c, source, (lambda a: dec(a, p.out_info)) if bf16 else None,
                    _to_bf16 if bf16 else None)


class NumbaBackend(Backend):
    name = "numba"
    device = "cpu"
    dtypes = frozenset({"float16", "bfloat16", "float32", "float64"})

    def accumulate(self, p) -> None:
        if _far_padding(p):
            return _reference(p)
        self._launch(p, p.out_info.ptr)

    def accumulate_apart(self, p, source) -> None:
        if _far_padding(p):
            return _reference(p, source)
        # source has out's strides (the contract): each element is read there, written to out
        self._launch(p, source.__array_interface__["data"][0], p.out_info.ptr)

    @staticmethod
    def _launch(p, optr, wptr=None):
        _accumulate_at(_params(p), optr, 0 if p.gamma_info is None else p.gamma_info.ptr,
                       p.mu_info.ptr, 0 if p.c_info is None else p.c_info.ptr, p.c_value, wptr)

    def bind(self, p):
        """The launcher of p's signature for the front end's fast path (Backend.bind):
        the kernel's parameters are derived once; a call puts its addresses in. (It must
        not keep p, which holds the first call's arrays.)"""
        if _far_padding(p):
            shape = replace(p, out=None, gamma=None, mu=None, c=None)

            def far(out, gamma, mu, c, optr, gptr, mptr, cptr, c_value):
                cv = None if shape.c_info is None else host_view(c, shape.c_info.dtype)
                _reference(replace(
                    shape, out=host_view(out, shape.out_info.dtype), mu=host_view(
                        mu, shape.mu_info.dtype), c_value=c_value,
                    gamma=None if gamma is None else host_view(gamma, shape.gamma_info.dtype),
                    c=None if cv is None else np.broadcast_to(cv, (shape.Co,))))

            return far
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
