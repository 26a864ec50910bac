"""The tiling arithmetic of the GPU design (docs/backends.md, "The GPU design").

A forward call is at most three launches, each chosen from the problem's quantities:

1. ``T[b, g, x0, y0, x1, y1]``, the channel sum of ``gamma``'s diagonal plus
   ``mu (x) mu`` over the group, streamed once at bandwidth, unless S is formed straight
   from ``gamma`` and ``mu`` (:func:`direct_source`);
2. the fused kernel: per thread, ``V`` consecutive values of a row ``S[b, g, p0, :]``
   formed in registers, then ``c[c0] * S`` added into ``out``'s channel-diagonal for a
   chunk of the group's output channels (:func:`tiling`);
3. where a group has many output channels (:func:`stream_s`), the fused kernel writes S
   instead and a third kernel streams ``out`` in address order (:func:`stream_grid`).

Where a group has one output channel and S would come from T (:func:`by_planes`), one
launch replaces them: the planes of ``gamma + mu (x) mu`` that a diagonal of S's planes
reads are summed into shared memory once each and S is formed from there
(:func:`planes`); it falls back to T where they do not fit.

No list of shapes: every layer takes this code path.
"""

from __future__ import annotations

from dataclasses import dataclass

from .._arrays import ITEMSIZE, vector_width

THREADS = 256  # threads a block
UNROLL = 4  # output channels whose loads of out are in flight together (UNROLL_OUT)
STREAM_U = 4  # cc_stream's vectors in flight a thread (STREAM_U)
MAX_GRID_X, MAX_GRID_YZ = 2**31 - 1, 65535  # CUDA's grid limits (the kernels loop past)
# Below this many direct terms, one launch beats two: the problem is launch-bound (toy:
# 54 -> 39 us on the H200).
DIRECT_TERMS = 1 << 22
# S through shared memory (cc_planes) in place of T for groups of at most PLANES_COG output
# channels (buys mb-dw 2060 -> 1575 us on the H200, against S from T down columns).
PLANES_COG = 1
# S through memory for groups of at least STREAM_COG output channels and S rows of at least
# STREAM_ROW positions: buys big-f32 6878 -> 5913 us and big-f16 4277 -> 3508 us on the
# H200; layers with fewer channels or shorter rows lose by it (stem-k5, dil2, mb-pw).
STREAM_COG, STREAM_ROW = 64, 512
SMEM_MAX = 48 * 1024  # dynamic shared memory a block may take without opting in (CUDA)


@dataclass(frozen=True)
class Tiling:
    """The fused kernel's ``block`` and ``grid`` for one call, and the split of each
    group's ``Cog`` output channels into ``nchunk`` chunks of ``chunk`` (each chunk
    re-forms its S)."""

    block: tuple
    grid: tuple
    nchunk: int
    chunk: int


def _cdiv(a, b):
    return -(-a // b)


def direct_source(B, G, Cg, H, W, Ho, Wo, kh, kw) -> bool:
    """Whether S is formed straight from gamma and mu rather than from T: when the direct
    source's terms (``Cg * kh * kw`` an element of S, each a cached gather) are no more
    than T's elements (``(H*W)**2`` a group, each written and read once at DRAM
    bandwidth, then gathered ``kh * kw`` times), as for large strides and 1x1 kernels
    (r20-short: 737 -> 328 us on the H200), or when the whole problem is so small that a
    second launch costs more than the terms."""
    S = Cg * kh * kw * (Ho * Wo) ** 2
    return B * G * S <= DIRECT_TERMS or S <= (H * W) ** 2


def stream_s(Cog, Ho, Wo) -> bool:
    """Whether S goes through memory (written once, then out streamed in address order)
    rather than straight from registers into out: where many output channels share each
    long row of S, so that S's round trip costs little beside out's."""
    return Cog >= STREAM_COG and Ho * Wo >= STREAM_ROW


def tiling(B, G, Cog, Ho, Wo, V, capacity) -> Tiling:
    """The fused kernel's grid for a device holding ``capacity`` resident threads, each
    thread ``V`` consecutive positions of a row of S (the written array's vector width)."""
    HoWo = Ho * Wo
    work = B * G * HoWo * _cdiv(HoWo, V)  # threads, one chunk a group
    # Split the channels when the threads alone would leave the device under-filled.
    nchunk = max(1, min(_cdiv(Cog, UNROLL), _cdiv(2 * capacity, work)))
    chunk = _cdiv(Cog, nchunk)
    nchunk = _cdiv(Cog, chunk)
    # x: (p0, q vector) pairs of one (b, g, chunk); z: those (each loops past the limits).
    grid = (min(_cdiv(work // (B * G), THREADS), MAX_GRID_X), 1,
            min(B * G * nchunk, MAX_GRID_YZ))
    return Tiling((THREADS,), grid, nchunk, chunk)


def stream_grid(planes, rows, vectors):
    """cc_stream's (grid, block): ``planes`` (b, c0) blocks of out, each ``rows`` rows of
    ``vectors`` vectors; a thread STREAM_U vectors of a row, a block's x threads one row
    (short rows leave room for more rows: y)."""
    bx = min(THREADS, max(32, 1 << (_cdiv(vectors, STREAM_U) - 1).bit_length()))
    by = THREADS // bx
    grid = (min(_cdiv(vectors, bx * STREAM_U), MAX_GRID_X), min(_cdiv(rows, by), MAX_GRID_YZ),
            min(planes, MAX_GRID_YZ))
    return grid, (bx, by)


@dataclass(frozen=True)
class Planes:
    """cc_planes' sizes for one call: ``V`` elements of S along j1 a thread, ``VG``
    elements of gamma along y1 a load, ``runp`` planes of S a block (one run along a
    diagonal ``i1 - i0``), ``wq`` columns a row of P in shared memory, ``smem`` bytes of
    it a block (the run's planes of P), the grid, and the channel chunks."""

    V: int
    VG: int
    runp: int
    wq: int
    smem: int
    grid: tuple
    nchunk: int
    chunk: int


def planes(B, G, Cog, W, Ho, Wo, kh, kw, sh, sw, pw, dh, dw, v_row, vg, acc_size, capacity):
    """cc_planes' sizes, or None where one run's planes of P do not fit in shared memory.

    ``v_row``: the widest vector along a row of out's (i1, j1) plane; ``vg``: along a row
    of gamma's and mu's (x1, y1) plane. A block takes a whole diagonal of S (``Ho``
    planes of ``Wo * Wo / V`` threads each, V narrowed until they fill the block), fewer
    planes where their ``sh*(R-1) + dh*(kh-1) + 1`` planes of P exceed SMEM_MAX or 64."""
    Wp = sw * (Wo - 1) + dw * (kw - 1) + 1  # the columns y + pw a row of S spans
    wq = _cdiv(max(Wp, pw + _cdiv(min(W, Wp - pw), vg) * vg), sw) * sw  # sw classes
    V = v_row
    while V > 1 and Ho * (Wo * Wo // V) < THREADS:
        V //= 2

    def rows(r):  # planes of P a run of r planes of S reads (a 64-bit mask in the kernel)
        return sh * (r - 1) + dh * (kh - 1) + 1

    def smem(r):
        return rows(r) * Wp * wq * acc_size

    # A whole diagonal a block: mb-dw 1861 -> 1575 us on the H200 against a block's worth.
    R = Ho
    while R > 1 and (smem(R) > SMEM_MAX or rows(R) > 64):
        R -= 1
    if smem(R) > SMEM_MAX or rows(R) > 64:
        return None
    nx = (2 * Ho - 1) * _cdiv(Ho, R)
    # Split the channels when the blocks alone would leave the device under-filled.
    nchunk = max(1, min(_cdiv(Cog, UNROLL), _cdiv(2 * capacity, B * G * nx * THREADS)))
    chunk = _cdiv(Cog, nchunk)
    nchunk = _cdiv(Cog, chunk)
    grid = (min(nx, MAX_GRID_X), 1, min(B * G * nchunk, MAX_GRID_YZ))
    return Planes(V, vg, R, wq, smem(R), grid, nchunk, chunk)


def planes_for(p, so, sg, sm, acc_size, capacity):
    """:func:`planes` for the validated call ``p`` (``Problem``) and its arrays' element
    strides ``so``, ``sg``, ``sm`` (channel diagonals folded), or None: V along a row of
    out's (i1, j1) plane; VG along a row of gamma's and mu's (x1, y1) plane, kept only
    where both have out's dtype and a vector is 16 bytes, else 1."""
    oi, gi, mi = p.out_info, p.gamma_info, p.mu_info
    o_size, m_size = ITEMSIZE[oi.dtype], ITEMSIZE[mi.dtype]
    v_row = vector_width(o_size, p.Wo, (so[5],), (p.Wo,), so[:5], oi.ptr)
    mu_row = (m_size, (sm[3],), sm[:3], mi.ptr)
    vg = (vector_width(ITEMSIZE[gi.dtype], p.W, (sg[5],), (p.W,), sg[:5], gi.ptr, (mu_row,))
          if gi else vector_width(m_size, p.W, (sm[3],), (p.W,), sm[:3], mi.ptr))
    same = {mi.dtype} | ({gi.dtype} if gi else set()) == {oi.dtype}
    vg = vg if same and vg * o_size == 16 else 1
    return planes(p.B, p.G, p.Co // p.G, p.W, p.Ho, p.Wo, p.kh, p.kw, p.sh, p.sw, p.pw,
                  p.dh, p.dw, v_row, vg, acc_size, capacity)


def by_planes(Cog) -> bool:
    """Whether S, where it would be formed from T, is formed by cc_planes instead (where
    its planes fit): where a group has one output channel (depthwise), so that forming S
    is the work and T's round trip through memory costs as much as out's."""
    return Cog <= PLANES_COG
