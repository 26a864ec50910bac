"""The sizes of the GPU design, shared by the ``cupy`` and ``numba_cuda`` backends
(docs/cupy.md "The design").

A forward call is one launch of the walk, or two where many output channels share S:

1. the walk: a block takes one diagonal ``i1 - i0`` of S's planes (or a segment of it) and
   one tile of each plane; it sums the planes of the channel sum of ``gamma + mu (x) mu``
   that the diagonal reads into shared memory (cupy: ``nch`` lanes sharing an element's
   channel sum where the planes are small), row-filters them into a ring, forms each
   plane of S from ``kh`` planes of the ring and adds ``c[c0] * S`` into out (or stores S):
   :func:`walk` sizes it;
2. where a group's output channels hold at least :data:`STREAM_BYTES` bytes of out an
   element of S, the walk stores S and a stream kernel adds ``c[c0] * S`` into out in
   address order (:func:`stream_grid`).

Where the input's planes fit a warp (:func:`plane`), the walk is a warp's instead of a
block's: the same sums, with no block-wide barrier (cupy's ``cc_plane``, numba_cuda's
``plane``).

No list of shapes: every layer takes these code paths; the sizes follow from the layer's
quantities.
"""

from __future__ import annotations

from dataclasses import dataclass

THREADS = 256  # threads a block
UNROLL = 4  # numba_cuda's walk: channels whose loads are in flight together
STREAM_U = 4  # the stream kernel's vectors in flight a thread (STREAM_U)
MAX_GRID_X, MAX_GRID_YZ = 2**31 - 1, 65535  # CUDA's grid limits (the kernels loop past)


def _cdiv(a, b):
    return -(-a // b)


def stream_grid(planes, rows, vectors):
    """The stream kernel's (grid, block): ``planes`` (b, c0) blocks of out, each ``rows``
    rows of ``vectors`` vectors; a thread STREAM_U vectors of a row, a block's x threads
    one row (short rows leave room for more rows: y)."""
    bx = min(THREADS, max(32, 1 << (_cdiv(vectors, STREAM_U) - 1).bit_length()))
    by = THREADS // bx
    grid = (min(_cdiv(vectors, bx * STREAM_U), MAX_GRID_X), min(_cdiv(rows, by), MAX_GRID_YZ),
            min(planes, MAX_GRID_YZ))
    return grid, (bx, by)


# ---------------------------------------------------------------------------- the walk
# Shared memory a block of the walk takes at most: below CUDA's 48 KiB (no opt-in), small
# enough for several blocks a multiprocessor.
WALK_SMEM = 32 * 1024
# The loads of Q a block's step aims for, lanes sharing channel sums until then (cupy):
# r20-64full 0.171 -> 0.207 of the floor on an H100 (0: no sharing).
SPLIT_LOADS = THREADS
# Blocks below which the diagonals are split into segments (each re-reads its first
# planes of Q): a device's multiprocessors times this.
WALK_BLOCKS_PER_SM = 4
# The walk's grid: at most a device's multiprocessors times this many blocks (three waves
# of the blocks a multiprocessor holds), each looping over items and setting up what
# depends on the launch once: mb-dw-s2 0.093 -> 0.109 of the floor on an H100.
WALK_GRID_PER_SM = 12
# Whether Q may be staged a step's planes at once (walk's choice, by barriers): numba_cuda
# layers 0.281 -> 0.301 of the floor on an H100 (r20-64full 0.087 -> 0.106); cupy unchanged.
STAGE_WHOLE = True


@dataclass(frozen=True)
class Walk:
    """cc_walk's sizes for one call: ``R`` planes of S a step; a diagonal in ``nseg``
    segments of ``seglen`` planes; a plane in ``ntile`` tiles of ``tj0`` x ``tj1`` (``ntj1``
    along j1); ``nq`` planes of Q staged at once (rows ``hq``, pitch ``wq``); a ring of
    ``nslot`` planes of T (pitch ``tp``); ``nch`` lanes sharing each element's channel sum
    of Q; ``csm``: c's values in shared memory (else read from c where used); ``smem``
    bytes; ``n`` blocks' items."""

    R: int
    seglen: int
    nseg: int
    tj0: int
    tj1: int
    ntj1: int
    ntile: int
    nq: int
    nslot: int
    hq: int
    wq: int
    tp: int
    nch: int
    csm: bool
    smem: int
    n: int
    grid: tuple


def walk(B, G, Cg, W, Ho, Wo, kh, kw, sh, sw, dh, dw, V, VG, acc_size, ncs, sms,
         smem_max=None, blocks_min=None) -> Walk:
    """cc_walk's sizes: whole planes (tiles only where one plane's Q and T exceed the
    shared memory), as many planes of S a step as fit, whole diagonals a block unless
    that leaves fewer than ``blocks_min`` blocks, and each element of Q's channel sum
    split over lanes of a warp until a step's elements (``VG`` a load) fill the block.
    ``V``: the elements along j1 a thread forms (tiles keep it whole); ``ncs``: the values
    of c a block uses (its group's)."""
    smem_max = WALK_SMEM if smem_max is None else smem_max
    blocks_min = WALK_BLOCKS_PER_SM * sms if blocks_min is None else blocks_min
    # c's values in a quarter of the shared memory at most (a group of more output
    # channels reads each where it is used: they would leave no room for Q and T)
    csm = ncs * acc_size <= smem_max // 4
    ncs = ncs if csm else 0

    def sizes(tj0, tj1, R, whole=False):
        tp = _cdiv(tj1, 4) * 4  # T's rows: 16-byte aligned
        hq = (tj0 - 1) * sw + (kw - 1) * dw + 1
        wq = _cdiv(3 + (tj1 - 1) * sw + (kw - 1) * dw + 1, 4) * 4  # (3: alignment offset)
        nslot = sh * (R - 1) + dh * (kh - 1) + 1
        nq = nslot if whole else min(nslot, R * sh)
        return nq, nslot, hq, wq, tp, (nq * hq * wq + nslot * tj0 * tp + ncs) * acc_size

    tj0, tj1 = Wo, Wo
    while sizes(tj0, tj1, 1)[-1] > smem_max and (tj0 > 1 or tj1 > V):
        if tj1 > V and tj1 >= tj0:
            tj1 = _cdiv(_cdiv(tj1, 2), V) * V
        else:
            tj0 = _cdiv(tj0, 2)
    ntj1 = _cdiv(Wo, tj1)
    ntile = _cdiv(Wo, tj0) * ntj1
    blocks = (2 * Ho - 1) * ntile * B * G
    nseg = min(Ho, max(1, _cdiv(blocks_min, blocks)))
    seglen = _cdiv(Ho, nseg)
    nseg = _cdiv(Ho, seglen)

    def most_planes(whole):
        R = 1
        while R < seglen and sizes(tj0, tj1, R + 1, whole)[-1] <= smem_max:
            R += 1
        return R

    def barriers(R, nq):  # the barriers of every segment's walk (as cc_walk takes them)
        n = 0
        for L in range(1, Ho + 1):
            for t_first in range(0, L, seglen):
                t_end, u_next = min(L, t_first + seglen), 0
                for t0 in range(t_first, t_end, R):
                    u_need = (min(t_end, t0 + R) - 1 - t_first) * sh + (kh - 1) * dh
                    while u_next <= u_need:
                        u_next += min(nq, u_need + 1 - u_next)
                        n += 2
                    n += 1
        return n

    # Q staged nq planes at once: as many as a step's T reads (each step's planes in one
    # batch, fewer and longer phases) where that takes fewer barriers than more planes
    # of S a step with fewer planes of Q staged.
    cand = [(most_planes(w), w) for w in (False, True)
            if not w or (STAGE_WHOLE and sizes(tj0, tj1, 1, w)[-1] <= smem_max)]
    R, whole = min(cand, key=lambda c: barriers(c[0], sizes(tj0, tj1, c[0], c[1])[0]))
    nq, nslot, hq, wq, tp, smem = sizes(tj0, tj1, R, whole)
    # Small planes leave most of a block idle while it sums Q over many channels: lanes
    # then share an element's sum (a power of two, a warp at most; no shared memory).
    loads = nq * min(W, hq) * _cdiv(min(W, (tj1 - 1) * sw + (kw - 1) * dw + 1), VG)
    nch = 1
    while nch < 32 and 2 * nch <= Cg and loads * nch < SPLIT_LOADS:
        nch *= 2
    n = (2 * Ho - 1) * nseg * ntile * B * G
    grid = min(n, MAX_GRID_X, WALK_GRID_PER_SM * sms)
    return Walk(R, seglen, nseg, tj0, tj1, ntj1, ntile, nq, nslot, hq, wq, tp, nch, csm, smem, n,
                (grid,))
# S through memory (cc_walk stores it, cc_stream adds it into out) where a group's output
# channels hold at least this many bytes of out an element of S: S's round trip is then a
# small part of out's traffic.
STREAM_BYTES = 64
# The most bytes of a row a thread of cc_walk loads at once (two 16-byte vectors: more in
# flight where a group has few channels).
VECTOR_BYTES = 32


def widen(v, itemsize, n):
    """A 16-byte vector of ``v`` elements along a row of ``n``, doubled while it stays
    within VECTOR_BYTES and divides the row (other widths stay as they are)."""
    while v * itemsize >= 16 and 2 * v * itemsize <= VECTOR_BYTES and n % (2 * v) == 0:
        v *= 2
    return v


# ---------------------------------------------------------------------- the plane walk
PLANE_V = 8  # columns of a plane a lane holds (two lanes a row of at most 16)
PLANE_RING = 48  # registers a thread's ring of T may take (more would spill)
# Bytes of gamma (for the next plane) and of out (for the next step) that a lane copies
# ahead into shared memory, each (cupy): mb-dw 1138 -> 951-956 us on an H200 (0: none).
PLANE_STAGE = 64


@dataclass(frozen=True)
class Plane:
    """The plane walk's sizes: a warp's plane of Q in shared memory, ``qrows`` rows of
    ``qpitch`` accumulation-type elements, Q's columns from ``qcol`` (its rows from row
    ``pw``), then its staging areas for the first ``nst`` channels of a plane's gamma
    and the first ``nso`` output channels of a step's out (``smem`` bytes a warp in
    all); ``n`` items (a warp's: (b, g) and k, the planes i1 = (i0 + k) mod Ho of S for
    i0 = 0 .. Ho - 1)."""

    qrows: int
    qpitch: int
    qcol: int
    nst: int
    nso: int
    smem: int
    n: int


def plane(B, G, Cg, Cog, Ho, W, Wo, kh, kw, sw, dh, dw, pw, acc_size, in_size=0,
          smem_max=None):
    """The plane walk's sizes where a plane of the input and of S fits a warp (``W`` and ``Wo``
    multiples of PLANE_V, at most twice it) and the ring of T its registers, else None.
    The pitch of the warp's plane is the one, of the few past its width, whose rows the
    lanes' reads of T spread over the most shared-memory banks. ``in_size``: the item size
    of gamma and out where a warp copies the next plane's gamma and the next step's out
    ahead (PLANE_STAGE bytes a lane each, as many of the group's Cg input and Cog output
    channels as fit; 0: none)."""
    smem_max = WALK_SMEM if smem_max is None else smem_max
    if W % PLANE_V or Wo % PLANE_V or W > 2 * PLANE_V or Wo > 2 * PLANE_V:
        return None
    if (dh * (kh - 1) + 1) * PLANE_V * max(1, acc_size // 4) > PLANE_RING:
        return None
    align = max(1, 16 // acc_size)  # Q's rows stored as 16-byte vectors
    reach = (Wo - 1) * sw + (kw - 1) * dw  # the furthest row and column T reads
    qcol = _cdiv(pw, align) * align
    qrows = max(pw + W, reach + 1)
    least = max(qcol + W, reach - pw + qcol + 1)
    words = acc_size // 4 or 1
    lanes = [(j0, h) for j0 in range(Wo) for h in range(0, Wo, PLANE_V)]

    def conflicts(p):  # the most lanes that read one bank at once (T's first column)
        banks = {}
        for j0, h in lanes:
            w = (j0 * sw * p + h * sw) * words
            banks[w % 32] = banks.get(w % 32, 0) + 1
        return max(banks.values())

    qpitch = min(range(_cdiv(least, align) * align, _cdiv(least, align) * align + 32, align),
                 key=lambda p: (conflicts(p), p))
    smem = qrows * qpitch * acc_size
    warps = THREADS // 32  # (cupy's blocks hold THREADS // 32 warps)
    if warps * smem > smem_max:
        return None
    most = PLANE_STAGE // (PLANE_V * in_size) if in_size else 0
    nst, nso = min(Cg, most), min(Cog, most)
    while nst + nso and warps * (smem + 32 * PLANE_V * in_size * (nst + nso)) > smem_max:
        nst, nso = (nst - 1, nso) if nst >= nso else (nst, nso - 1)
    return Plane(qrows, qpitch, qcol, nst, nso, smem + 32 * PLANE_V * in_size * (nst + nso),
                 Ho * B * G)
