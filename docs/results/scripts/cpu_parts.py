"""Where the numba kernel's time goes on the ``cpu`` workload, in parts, in one process.

Every variant is the kernel's own source (``convcov.backends.numba._kernel``) with one
thing taken out or changed, compiled like the kernel and called with the parameters of a
real ``convcov.accumulate`` call on the bench's inputs (3 rotating input sets, so that the
73 MB of each call do not sit in the 32 MB L3). Rounds interleave the variants; a cell is
the median of the rounds' medians of 40 calls.

* ``kernel``: the shipped kernel, both phases.
* ``p1``: phase 1 alone (gamma's channel diagonal -> M).
  * ``p1 arithmetic``: gamma's plane strides 0 and no prefetch: every plane read is one
    cached 1 KB plane, so what is left is the arithmetic and M's writes.
  * ``p1 one M row a task``: each task sums into one M row (M traffic cut 16 times).
  * ``p1 no prefetch``: the gamma prefetch off.
  * ``p1 spread prefetch``: one cache line of each of the four planes ahead per 64 bytes
    summed, instead of a burst of 4 x 16 lines before each four-channel step (float32).
* ``p2``: phase 2 alone (M -> S rows -> out).
  * ``p2 box filter``: the out update replaced by a scalar add, out prefetch off: the S
    rows' arithmetic and M's reads.
  * ``p2 out rows``: the box filter skipped: out's rows read, added to and written, with
    the prefetch.
  * ``p2 S rows first``: a task computes its Wo S rows first, then updates its out rows
    (instead of one S row, then its Cog out rows).
* ``read gamma rows``: a probe that only reads gamma's channel-diagonal planes, in phase 1's
  order, with the same prefetch (8 planes ahead), both cores.

Usage: ``python docs/results/scripts/cpu_parts.py [rounds]`` from the repository root.
Its variants edit the kernel's source as it was up to commit 46e50e6; since the
twenty-fifth session the four-channel passes spread their prefetch (what ``p1 spread
prefetch`` measured), and those edits no longer apply: check out 46e50e6 to rerun it.
"""
import statistics
import sys
import time

import numpy as np
from _cpu_kernel import DEV as dev
from _cpu_kernel import W as w
from _cpu_kernel import SRC, compiled, inputs_and_calls, phases, run_with, with_prm
from numba import njit, prange

from convcov.backends import numba as nb

ROUNDS = int(sys.argv[1]) if len(sys.argv) > 1 else 5
# The inputs, and the kernel's arguments for each input set as the backend makes them.
sets, calls = inputs_and_calls()

PHASE1, PHASE2 = phases(SRC)


def edit(code, old, new):
    assert old in code, old
    return code.replace(old, new)


# --- phase 1 variants
_pf = nb._prefetch_read


@njit(**nb._inner)
def _add_quad_spread(dst, gp, g0, g1, g2, g3, mp, m0, m1, m2, m3, a0, a1, a2, a3, n,
                     p0, p1, p2, p3):
    full = n // 16 * 16
    for blk in range(0, full, 16):
        if p0 != 0:
            _pf(p0 + blk * 4)
            _pf(p1 + blk * 4)
            _pf(p2 + blk * 4)
            _pf(p3 + blk * 4)
        d = nb._offset(dst, blk)
        G0, G1 = nb._offset(gp, g0 + blk), nb._offset(gp, g1 + blk)
        G2, G3 = nb._offset(gp, g2 + blk), nb._offset(gp, g3 + blk)
        M0, M1 = nb._offset(mp, m0 + blk), nb._offset(mp, m1 + blk)
        M2, M3 = nb._offset(mp, m2 + blk), nb._offset(mp, m3 + blk)
        for e in range(16):
            d[e] += (((G0[e] + G1[e]) + (G2[e] + G3[e]))
                     + ((a0 * M0[e] + a1 * M1[e]) + (a2 * M2[e] + a3 * M3[e])))
    for e in range(full, n):
        dst[e] += (((gp[g0 + e] + gp[g1 + e]) + (gp[g2 + e] + gp[g3 + e]))
                   + ((a0 * mp[m0 + e] + a1 * mp[m1 + e]) + (a2 * mp[m2 + e] + a3 * mp[m3 + e])))


SPREAD = """                    if step == 4 and with_gamma and g_code == F32:
                        m0, m1, m2, m3 = (m_at + ci * m_c, m_at + (ci + 1) * m_c,
                                          m_at + (ci + 2) * m_c, m_at + (ci + 3) * m_c)
                        q0 = q1 = q2 = q3 = 0
                        ah = y0 * Cg + ci - g * Cg + PF_GAMMA
                        if PF_GAMMA > 0 and ah + 3 < W * Cg:
                            q0 = g_addr + 4 * (b * g_b + (g * Cg + ah % Cg) * g_c + x0 * g_x0 + (ah // Cg) * g_y0)
                            q1 = g_addr + 4 * (b * g_b + (g * Cg + (ah + 1) % Cg) * g_c + x0 * g_x0 + ((ah + 1) // Cg) * g_y0)
                            q2 = g_addr + 4 * (b * g_b + (g * Cg + (ah + 2) % Cg) * g_c + x0 * g_x0 + ((ah + 2) // Cg) * g_y0)
                            q3 = g_addr + 4 * (b * g_b + (g * Cg + (ah + 3) % Cg) * g_c + x0 * g_x0 + ((ah + 3) // Cg) * g_y0)
                        _add_quad_spread(dst, _f32_at(g_addr), g_at + ci * g_c, g_at + (ci + 1) * g_c,
                                         g_at + (ci + 2) * g_c, g_at + (ci + 3) * g_c, _f32_at(m_addr),
                                         m0, m1, m2, m3,
                                         _like(_load(m_addr, m_code, m0 + m_xy), M),
                                         _like(_load(m_addr, m_code, m1 + m_xy), M),
                                         _like(_load(m_addr, m_code, m2 + m_xy), M),
                                         _like(_load(m_addr, m_code, m3 + m_xy), M),
                                         HW, q0, q1, q2, q3)
                    elif step == 4:
                        m0, m1, m2, m3 ="""
SRC_SPREAD = edit(edit(SRC, "if with_gamma and PF_GAMMA > 0:",
                      "if with_gamma and PF_GAMMA > 0 and not (step == 4 and g_code == F32):"),
                 """                    if step == 4:
                        m0, m1, m2, m3 =""", SPREAD)

# --- phase 2 variants
ROW = "_add_row_any(o_addr, o_code, off, o_i1, o_j1, Ho, Wo, srow, cc)"
SRC_FIRST = edit(edit(SRC, """            box_buf = np.empty(Ho * P, M.dtype)
            srow_buf = np.empty(HoWo, M.dtype)
            Mp = _data(M)
            box = _data(box_buf)
            srow = box if P == Wo else _data(srow_buf)
            for j0 in range(Wo):
                for e in range(Ho * P):""", """            box_buf = np.empty(Ho * P, M.dtype)
            srow_buf = np.empty(Wo * HoWo, M.dtype)
            Mp = _data(M)
            rows = _data(srow_buf)
            for j0 in range(Wo):
                srow = _offset(rows, j0 * HoWo)
                box = srow if P == Wo else _data(box_buf)
                for e in range(Ho * P):"""), """                            srow[i1 * Wo + j1] = box[i1 * P + j1]
                for c0 in range(g * Cog, (g + 1) * Cog):""", """                            srow[i1 * Wo + j1] = box[i1 * P + j1]
            for j0 in range(Wo):
                srow = _offset(rows, j0 * HoWo)
                for c0 in range(g * Cog, (g + 1) * Cog):""")

K1 = compiled(PHASE1, "_p1")
K2 = compiled(PHASE2, "_p2")
variants = {
    "kernel": nb._parallel,
    "p1": K1,
    "p1 arithmetic": with_prm(K1, g_b=0, g_c=0, g_x0=0, g_y0=0, pf_gamma=0),
    "p1 one M row a task": compiled(edit(PHASE1, "dst = _offset(_data(M), (task * W + y0) * HW)",
                                         "dst = _offset(_data(M), (task * W) * HW)"), "_p1m"),
    "p1 no prefetch": with_prm(K1, pf_gamma=0),
    "p1 spread prefetch": compiled(phases(SRC_SPREAD)[0], "_p1s",
                                   {"_add_quad_spread": _add_quad_spread}),
    "p2": K2,
    "p2 box filter": with_prm(compiled(edit(PHASE2, ROW, "srow[0] += cc"), "_p2b"), pf_out=0),
    "p2 out rows": compiled(edit(PHASE2, "for ii in range(kh):", "for ii in range(0):"), "_p2r"),
    "p2 S rows first": compiled(phases(SRC_FIRST)[1], "_p2f"),
}

# The changed kernels must still compute the same thing where they claim to.
for name, code in (("p1 spread prefetch", SRC_SPREAD), ("p2 S rows first", SRC_FIRST)):
    whole = compiled(code, "_chk", {"_add_quad_spread": _add_quad_spread})
    a, b = sets[0]["out"].copy(), sets[0]["out"].copy()
    run_with(nb._parallel, a, sets[0])
    run_with(whole, b, sets[0])
    assert np.array_equal(a, b), name

# --- the read-only probe: gamma's channel-diagonal planes in phase 1's order
g0 = sets[0]["gamma"]
isz = g0.itemsize
sb, sc, sx0, sy0, sc2 = (s // isz for s in g0.strides[:5])
B, C, H = w.B, w.Ci, w.H
order = np.array([b * sb + ci * (sc + sc2) + x0 * sx0 + y0 * sy0
                  for b in range(B) for x0 in range(H) for y0 in range(H) for ci in range(C)],
                 np.int64)
PLANE = H * H


@njit(parallel=True, nogil=True, fastmath=True)
def _read_rows(flat, offs, out):
    base = flat.ctypes.data
    n = offs.size
    for t in prange(2):
        lo, hi = t * n // 2, (t + 1) * n // 2
        s = np.float32(0)
        for i in range(lo, hi):
            if i + 8 < hi:
                a = base + offs[i + 8] * 4
                for line in range(0, PLANE * 4, 64):
                    nb._prefetch_read(a + line)
            c = flat[offs[i]:offs[i] + PLANE]
            for e in range(PLANE):
                s += c[e]
        out[t] = s


flats = [s["gamma"].reshape(-1) for s in sets]
sink = np.zeros(2, np.float32)
probes = {"read gamma rows": lambda i: _read_rows(flats[i % 3], order, sink)}

for f in variants.values():
    f(*calls[0])
for f in probes.values():
    f(0)
res = {n: [] for n in (*variants, *probes)}
for rnd in range(ROUNDS):
    for n in res:
        ts = []
        for i in range(40):
            if n in variants:
                prm, cv, M = calls[i % 3]
                t0 = time.perf_counter()
                variants[n](prm, cv, M)
            else:
                t0 = time.perf_counter()
                probes[n](i)
            ts.append(time.perf_counter() - t0)
        res[n].append(statistics.median(ts) * 1e6)
    print(rnd, {n: round(v[-1]) for n, v in res.items()}, flush=True)
print(f"\n{'variant':24s} {'median µs':>10s} {'range of round medians':>24s}")
for n, v in res.items():
    print(f"{n:24s} {statistics.median(v):10.0f} {min(v):11.0f} - {max(v):.0f}")
print("copy bandwidth (GB/s, as the bench measures it):", round(dev.copy_bandwidth() / 1e9, 1))
