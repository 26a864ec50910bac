"""The ``numba_cuda`` backend: what the shared property test does not reach.

Without a GPU (CI) the kernels run under Numba's CUDA simulator on numpy and torch CPU
arrays (tests/conftest.py switches it on): each plan (a warp a diagonal, ``plane``, where
the planes fit a warp; c * S added into out by ``walk``, or S stored and streamed into out
by ``stream``; planes in the smallest tiles; diagonals in segments of one plane) is forced
through ``convcov.backends._plan``, as tests/test_cupy.py forces cupy's, on the same small
problems of signed inputs, with every layout, ``c`` form, dtype (bfloat16 through torch)
and conv parameter, the vector widths, padding next to Inf, and a float64 sum that must
reach bfloat16 with one rounding; the kernels compiled for sm_90 without a GPU
(tests/_compile_numba_cuda.py) cover every one the plans ask for, over every dtype mix.
With a GPU the same checks run on torch CUDA tensors, plus what only a device can show:
CuPy arrays and numba device arrays, a launch on a non-default torch stream, an ``out`` of
more than 2**31 elements, several threads at once. Tests that need what is missing skip
and say why."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import convcov
from convcov import _frontend, _registry

from kinds import (HAS_TORCH, SIM, at_once, has_cupy_gpu, make, op_loops, to_f64, tolerance,
                   torch_cuda)

BACKEND = _registry.get("numba_cuda")
REASON = BACKEND.unavailable_reason()
available = pytest.mark.skipif(REASON is not None, reason=f"numba_cuda: {REASON}")
ON_GPU = REASON is None and BACKEND.device == "cuda"
gpu = pytest.mark.skipif(not (ON_GPU and torch_cuda()), reason=(
    "needs a CUDA device and torch with CUDA (this run: "
    + ("the CUDA simulator" if SIM else f"{REASON}" if REASON else "no torch CUDA") + ")"))

#: Array kind the backend computes on here: torch CUDA tensors on a GPU, numpy under the
#: simulator (torch CPU tensors there too, in the dtype tests: bfloat16 comes from torch).
KINDS = (["torch_cuda"] if torch_cuda() else []) if ON_GPU else ["numpy"]


def _no_simulator():
    """The environment of a test's own process without Numba's CUDA simulator (which
    conftest.py switches on in this one), with the project on its path."""
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    root = str(Path(__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(filter(None, (root, env.get("PYTHONPATH"))))
    return env


def _beside(name):
    """Path of a script in this folder."""
    return str(Path(__file__).with_name(name))


def test_probe_reason_is_clear():
    """Available, or unavailable with the cause: never a crash (CI may lack numba-cuda)."""
    rows = {r.name: r for r in convcov.backends()}
    row = rows["numba_cuda"]
    assert row.device == ("cpu" if SIM else "cuda")
    assert row.available == (REASON is None)
    if REASON is not None:
        assert row.reason == REASON and ("numba-cuda" in REASON or "CUDA device" in REASON)


@pytest.mark.skipif(REASON is not None and "numba-cuda" in REASON, reason=f"numba_cuda: {REASON}")
def test_every_kernel_compiles_for_the_gpu():
    """The kernel variants of tests/_compile_numba_cuda.py (every element type at every
    pointer of every kernel with each accumulation dtype, and every vector width;
    test_compiled_variants_cover_every_request holds the list to what the plans ask for)
    compile through Numba, NVVM and ptxas for sm_90. The simulator that runs
    the kernels in CI executes their Python and never compiles them, so without this a
    typing error in a kernel would first show on a GPU machine. Its own process: the
    simulator is switched on in this one (conftest.py). ``python
    tests/_compile_numba_cuda.py --all`` compiles every variant the plans can ask for
    (twenty times as many)."""
    r = subprocess.run([sys.executable, _beside("_compile_numba_cuda.py")], env=_no_simulator(),
                       capture_output=True, text=True, timeout=1800)
    if r.returncode == 77:
        pytest.skip(r.stdout.strip())
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    from _compile_numba_cuda import variants

    assert f"compiled {len(variants())} kernels for sm_90" in r.stdout, r.stdout[-2000:]


def _requested_kernels(monkeypatch):
    """Every kernel (name, pointer element types, accumulation dtype, V) the plans ask
    numba_cuda._kernel for over a sweep of calls, launching nothing (simulator, torch CPU
    tensors: bfloat16 comes from torch). The walk adding into out: every dtype of out,
    gamma, mu and c at each vector width of out (the address V elements past a 32-byte
    boundary; rows of 8, 10, 12 and 16), gamma aligned (16- and 32-byte vectors of gamma
    and mu where they share out's dtype) and one element off, and every one without
    float64 with a number c beyond float32's range (float64 sums). S through memory, with
    float32 and float64 sums (a float64 array beside them): the walk storing S for each
    gamma and mu dtype, aligned and not, at each width of S (rows of those sizes and one
    less), and stream for each out and c dtype
    at each width of out (diagonal and full layouts). The plane walk: each dtype of out
    (gamma and mu alike) and c, and a number c beyond float32's range, at each kernel
    height, stride and dilation whose ring reaches one plane past the most it may hold
    (planes 8 wide; strides one past the ring). Backward: each dtype of grad_S and
    grad_gamma, and of grad_S, mu and grad_mu, with float32 and float64 sums. And the
    other forms: gamma None, full gamma, a number c, a 0-d c."""
    import itertools

    import torch

    from convcov._frontend import patch_moment_vjp
    from convcov.backends import numba_cuda as mod

    from _compile_numba_cuda import TYPES, WIDTHS

    asked = set()

    class _NoLaunch:  # kernel[grid, block](*args), as the simulator's launch calls it
        def __getitem__(self, launch_config):
            return lambda *args: None

    def record(name, elems, acc, V=1):
        asked.add((name, tuple(elems), acc, V))
        return _NoLaunch()

    monkeypatch.setattr(mod, "_kernel", record)
    _forget_plans(monkeypatch)
    dtype = {"float16": torch.float16, "uint16": torch.bfloat16, "float32": torch.float32,
             "float64": torch.float64}

    def arr(shape, t, V=None):
        """Zeros of pointer type t, V elements past a 32-byte boundary (the widest vector
        aligned there is V elements) or, V None, at one."""
        n = int(np.prod(shape))
        buf = torch.zeros(n + 64, dtype=dtype[t])
        at = (-buf.data_ptr() % 32) // buf.element_size() + (V or 0)
        return buf[at:at + n].view(shape)

    mu_shape, s_shape = (1, 2, 4, 4), (1, 1, 4, 4, 4, 4)
    diag = (1, 2, 4, 4, 4, 4)  # grad_gamma's

    def forward(o, g, m, c, stream=False, Vg=None, Vo=None, full=False, n=8, kw=1, pw=0):
        """One call (B 1, Ci = Co = 2, n x n inputs, a 1 x kw kernel, padding pw along
        rows) on one plan: g None or "full:" + type; c a type (shape (Co,)), "0d:" + type,
        or a number."""
        Wo = n - kw + 1 + 2 * pw
        with monkeypatch.context() as mp:
            _force(mp, "stream" if stream else "fused")
            gamma = None if g is None else (arr((1, 2, n, n, 2, n, n), g[5:])
                                            if g.startswith("full:")
                                            else arr((1, 2) + (n,) * 4, g, Vg))
            cc = (c if not isinstance(c, str) else arr((), c[3:]) if c.startswith("0d:")
                  else arr((2,), c))
            out = arr((1, 2, n, Wo, 2, n, Wo) if full else (1, 2, n, Wo, n, Wo), o, Vo)
            convcov.accumulate(out, gamma, arr((1, 2, n, n), m), cc, (1, kw), padding=(0, pw),
                               backend="numba_cuda")

    def plane(o, c, kh, sh, dh):
        """One call on the plane path: inputs of type o (out, gamma and mu) 8 wide and two
        outputs high (one would make the stride meaningless, and the front end make it
        small), c a type or a number, a kh x 1 kernel of stride sh and dilation dh."""
        H = dh * (kh - 1) + 1 + sh
        with monkeypatch.context() as mp:
            _force(mp, "plane")
            convcov.accumulate(arr((1, 2, 2, 8, 2, 8), o), arr((1, 2, H, 8, H, 8), o),
                               arr((1, 2, H, 8), o), c if not isinstance(c, str) else
                               arr((2,), c), (kh, 1), stride=(sh, 1), dilation=(dh, 1),
                               backend="numba_cuda")

    def backward(s, m, gg, gm):
        patch_moment_vjp(arr(s_shape, s), arr(mu_shape, m), 1, backend="numba_cuda",
                         grad_gamma=None if gg is None else arr(diag, gg),
                         grad_mu=None if gm is None else arr(mu_shape, gm))

    no_f64 = ("float16", "uint16", "float32")  # with these alone: float32 sums
    # Rows where out's 16-byte vectors stay 16 bytes and where they are doubled
    # (_plan.widen), by out's dtype; gamma one element off (VG 1).
    sizes = {"float16": (8, 16), "uint16": (8, 16), "float32": (12, 8), "float64": (10, 8)}
    for o, g, m in itertools.product(TYPES, repeat=3):
        # (c below float32's normal range: float64 sums)
        for c in TYPES + (() if "float64" in (o, g, m) else (1e-39,)):
            for n, V in itertools.product(sizes[o], WIDTHS[o]):
                forward(o, g, m, c, Vg=1, Vo=V, n=n)
    # gamma and mu aligned in out's dtype (16- and 32-byte vectors of them): rows of 8,
    # 10, 12 and 16 inputs and 0, 2, 4 or 8 more outputs, so that each width of gamma's
    # meets each width of out's (or of S's).
    rows = list(itertools.product((8, 10, 12, 16), (0, 1, 2, 4)))
    for t, c, (n, pw) in itertools.product(TYPES, TYPES + (1e-39,), rows):
        for V in WIDTHS[t]:
            forward(t, t, t, c, Vo=V, n=n, pw=pw)
    for acc in ("float32", "float64"):  # the dtype of the arrays beside, so of the sums
        types = no_f64 if acc == "float32" else TYPES
        for g, m in itertools.product(types, repeat=2):  # S stored, at each of its widths
            for Vg, (n, pw) in itertools.product((None, 1), rows):
                forward(acc, g, m, acc, stream=True, Vg=Vg, n=n, pw=pw)
                if pw == 0:  # odd rows: one element a store
                    forward(acc, g, m, acc, stream=True, Vg=Vg, n=n, kw=2)
        for o, c in itertools.product(types, repeat=2):
            for V in WIDTHS[o]:  # stream at each width of out
                for full in (False, True):
                    forward(o, acc, acc, c, stream=True, Vo=V, full=full)
        for s, g in itertools.product(types, repeat=2):
            backward(s, acc, g, None)
        for s, m, d in itertools.product(types, repeat=3):
            backward(s, m, acc if acc == "float64" else None, d)
    for t in TYPES:
        for stream in (False, True):
            forward(t, None, t, -0.5, stream)
            forward(t, "full:" + t, t, "0d:" + t, stream, full=True)
    rings = [(kh, sh, dh) for kh in range(1, 8) for dh in range(1, 7 if kh > 1 else 3)
             if dh * (kh - 1) + 1 <= 7 for sh in range(1, dh * (kh - 1) + 3)]
    for o, c in itertools.product(TYPES, TYPES + (1e-39,)):
        for kh, sh, dh in rings:
            plane(o, c, kh, sh, dh)
    return asked


@pytest.mark.skipif(not (SIM and HAS_TORCH and REASON is None), reason=(
    "records what the plans ask for under the CUDA simulator, with torch's bfloat16 "
    "(a GPU compiles each kernel the suite launches anyway)"))
def test_compiled_variants_cover_every_request(monkeypatch):
    """The GPU compile test's list cannot drift from the plans: every kernel the plans
    ask for over a sweep of calls (_requested_kernels: each dtype mix, bfloat16 and
    float64 among them, every branch, each vector width, float64 sums, the backward) is one
    that tests/_compile_numba_cuda.py's requests() derives from the plans' rules, the
    sweep asks for each of those, and the variants test_every_kernel_compiles_for_the_gpu
    compiles cover each: compiled variants of the same kernel have its element type at
    each pointer with its accumulation dtype, and its vector width with out's element
    type and with its accumulation dtype."""
    from _compile_numba_cuda import features, requests, variants

    asked = _requested_kernels(monkeypatch)
    derived = set(requests())
    assert not asked - derived, f"requests() lacks {sorted(asked - derived)[:8]}"
    assert not derived - asked, f"requests() has, never asked for, {sorted(derived - asked)[:8]}"
    have = set().union(*map(features, variants()))
    uncovered = [r for r in sorted(asked) if not features(r) <= have]
    assert not uncovered, f"no variant compiled for the GPU covers {uncovered[:8]}"


def test_never_chosen_automatically_for_host_arrays():
    """Under the simulator the backend takes host arrays, but only when asked by name."""
    out = np.zeros((1, 1, 1, 1, 1, 1, 1))
    b = _registry.select(None, "cpu", frozenset({"float64"}))
    assert b.name != "numba_cuda"
    convcov.accumulate(out, None, np.ones((1, 1, 1, 1)), 1.0, 1)  # automatic choice works


def test_import_of_convcov_does_not_import_numba_cuda():
    code = "import sys, convcov; assert 'numba.cuda' not in sys.modules, 'imported numba.cuda'"
    subprocess.run([sys.executable, "-c", code], check=True)


# ------------------------------------------------------------------ helpers
def _forget_plans(monkeypatch):
    """Empty plan and bound-launcher caches for this test: both remember the branch the
    plan took when a signature was first seen."""
    from convcov.backends import numba_cuda as mod

    monkeypatch.setattr(mod, "_plans", {})
    monkeypatch.setattr(_frontend, "_bound", {})


#: The plans _force can force (cupy's, tests/test_cupy.py, but "split": this walk has no
#: lanes sharing a channel sum).
PATHS = ["plane", "fused", "stream", "tiles", "segments"]
#: The walk's: for problems whose planes no warp holds, which on "plane" repeat "fused".
WALK_PATHS = PATHS[1:]


def _force(monkeypatch, forced):
    """Force a plan (``convcov.backends._plan``, as cupy's plan reads it): a warp a diagonal
    wherever the planes fit a warp ("plane": _plan.plane) or never (the others); S
    through memory wherever out's rows allow it ("stream": walk stores S, stream adds it
    into out) or never (the others: walk, or plane, adds c * S into out); planes in the
    smallest tiles, one plane of S a step, c read where it is used ("tiles":
    _plan.WALK_SMEM); every diagonal in segments of one plane ("segments":
    _plan.WALK_BLOCKS_PER_SM)."""
    from convcov.backends import _plan

    monkeypatch.setattr(_plan, "STREAM_BYTES", 0 if forced == "stream" else 1 << 60)
    if forced != "plane":
        monkeypatch.setattr(_plan, "plane", lambda *args, **kw: None)
    if forced == "tiles":
        monkeypatch.setattr(_plan, "WALK_SMEM", 1)
    if forced == "segments":
        monkeypatch.setattr(_plan, "WALK_BLOCKS_PER_SM", 1 << 30)
    _forget_plans(monkeypatch)


def _walk_sizes(launch):
    """The walk's sizes (_plan.walk's R, seglen, nseg, tj0, tj1, ntj1, ntile, nq, nslot,
    wq, tp) in a launch's arguments."""
    return dict(zip(("R", "seglen", "nseg", "tj0", "tj1", "ntj1", "ntile"), launch.args[-3]))


@pytest.fixture(params=PATHS)
def path(request, monkeypatch):
    """Force one plan (_force); afterwards, every plan made took it: plane alone (or, where
    the planes do not fit a warp, walk alone); walk alone, or (stream, where out's
    (i1, j1) rows are contiguous) walk storing S, then stream; tiles of one row (tj0 1),
    one plane a step; segments of one plane."""
    _force(monkeypatch, request.param)
    yield request.param
    from convcov.backends import numba_cuda as mod

    for plan in mod._plans.values():
        names = [ln.name for ln in plan.launches]
        if request.param == "plane":
            assert len(names) == 1 and names[0].startswith(("plane", "walk")), names
            assert not names[0].startswith("walk_s"), names
        elif request.param == "stream" and len(names) == 2:
            assert names[0].startswith("walk_s") and names[1] == "stream", names
        else:
            assert len(names) == 1 and names[0].startswith("walk"), names
            assert request.param == "stream" or not names[0].startswith("walk_s"), names
        sizes = _walk_sizes(plan.launches[0])
        if request.param == "tiles":
            assert sizes["tj0"] == 1 and sizes["R"] == 1, sizes
        if request.param == "segments":
            assert sizes["seglen"] == 1, sizes


def _names(mod):
    """The kernels of the one plan made since the caches were emptied, with their V."""
    (plan,) = mod._plans.values()
    return [(ln.name, ln.V) for ln in plan.launches]


def _problem(rng, B, Ci, Co, H, W, k, full_out=True, gamma="full", G=1, stride=(1, 1),
             padding=(0, 0), dilation=(1, 1)):
    """(out, gamma, mu, c, k, conv) of one call, float64, every input standard normal: of
    both signs, so that a sign lost on the way (an abs of c or of a term) shows. c[0] (the
    number and the 0-d c of _check) is negative, c[1] positive."""
    kh, kw = k
    Ho = (H + 2 * padding[0] - dilation[0] * (kh - 1) - 1) // stride[0] + 1
    Wo = (W + 2 * padding[1] - dilation[1] * (kw - 1) - 1) // stride[1] + 1
    out = rng.standard_normal((B, Co, Ho, Wo, Co, Ho, Wo) if full_out else (B, Co, Ho, Wo, Ho, Wo))
    g = {"full": lambda: rng.standard_normal((B, Ci, H, W, Ci, H, W)),
         "diag": lambda: rng.standard_normal((B, Ci, H, W, H, W)), None: lambda: None}[gamma]()
    c = rng.standard_normal(Co)
    c[0] = -abs(c[0])
    c[1:2] = abs(c[1:2])
    conv = dict(stride=stride, padding=padding, dilation=dilation, groups=G)
    return out, g, rng.standard_normal((B, Ci, H, W)), c, k, conv


def _shifted(x):
    """A copy of ``x`` one element into a larger buffer: no longer 16-byte aligned."""
    if isinstance(x, np.ndarray):
        buf = np.zeros(x.size + 1, x.dtype)
        y = buf[1:].reshape(x.shape)
    else:  # torch
        y = x.new_zeros(x.numel() + 1)[1:].view(x.shape)
    y[...] = x
    return y


def _check(out0, gamma, mu, c, k, conv, kind, dtypes, layouts=("contiguous",) * 3,
           c_form="1d", seed=0, misalign=False):
    """Run numba_cuda on arrays of ``kind``; compare with the float64 literal loops. The
    tolerance is the forward error bound of the sum (kinds.tolerance) on the absolute
    values of its terms, so cancellation between terms of both signs stays within it."""
    rng = np.random.default_rng(seed)
    dt_out, dt_g, dt_mu, dt_c = dtypes
    out = make(out0, kind, dt_out, layouts[0], rng)
    if misalign:
        out = _shifted(out)
    g = None if gamma is None else make(gamma, kind, dt_g, layouts[1], rng)
    m = make(mu, kind, dt_mu, layouts[2], rng)
    cc = {"number": float(c[0]), "0d": lambda: make(np.array(c[0]), kind, dt_c),
          "1d": lambda: make(c, kind, dt_c)}[c_form]
    cc = cc if c_form == "number" else cc()
    # Copies: to_f64 of a float64 torch CPU tensor is a view of it.
    before, g64, m64 = to_f64(out).copy(), None if g is None else to_f64(g), to_f64(m)
    c64 = (np.full(out0.shape[1], cc) if c_form == "number"
           else np.broadcast_to(to_f64(cc), (out0.shape[1],)).copy())
    assert convcov.accumulate(out, g, m, cc, k, backend="numba_cuda", **conv) is out
    got = to_f64(out)
    loops = dict(stride=conv["stride"], padding=conv["padding"], dilation=conv["dilation"],
                 groups=conv["groups"])
    ref = op_loops(before, g64, m64, c64, *k, **loops)
    bound = op_loops(np.abs(before), None if g64 is None else np.abs(g64), np.abs(m64),
                     np.abs(c64), *k, **loops)
    used = [dt_out, dt_mu] + ([dt_g] if g is not None else []) + (
        [dt_c] if c_form != "number" else [])
    acc = "float64" if "float64" in used else "float32"
    tol = tolerance(bound, 2 * (mu.shape[1] // conv["groups"]) * k[0] * k[1], acc, dt_out)
    err = np.abs(got - ref)
    assert (err <= tol).all(), (f"worst error {err.max():.3g}, "
                                f"tolerance {tol.ravel()[err.argmax()]:.3g}")
    if out0.ndim == 7:  # off the channel-diagonal: bit-identical
        off = np.ones(out0.shape, bool)
        for c0 in range(out0.shape[1]):
            off[:, c0, :, :, c0] = False
        np.testing.assert_array_equal(got[off], before[off])


CONVS = {  # name: (B, Ci, Co, H, W, k, G, stride, padding, dilation)
    "seed": (1, 2, 2, 4, 4, (2, 2), 1, (1, 1), (0, 0), (1, 1)),
    "padded": (1, 2, 3, 4, 5, (3, 3), 1, (1, 1), (2, 1), (1, 1)),
    "strided-dilated-groups": (2, 4, 2, 5, 6, (2, 3), 2, (2, 1), (1, 0), (1, 2)),
    "eight-channels": (1, 9, 9, 3, 3, (2, 1), 1, (1, 1), (0, 0), (1, 1)),  # unrolled loops
    "seventeen-out-channels": (1, 2, 17, 3, 3, (2, 2), 1, (1, 1), (0, 0), (1, 1)),
    "tall-kernel": (1, 2, 2, 9, 3, (8, 1), 1, (1, 1), (1, 0), (1, 1)),
}
#: Problems whose planes fit a warp (W and Wo 8 or 16), for the "plane" path (on the walk's
#: paths the walk takes them as it takes any other): tests/test_cupy.py's host cases.
PLANE_CONVS = {
    "plane-depthwise": (1, 2, 2, 8, 8, (3, 3), 2, (1, 1), (1, 1), (1, 1)),  # 8 wide
    "plane-strided": (1, 3, 6, 5, 16, (3, 3), 3, (2, 2), (1, 1), (1, 1)),  # 2 outputs a group
    "plane-dilated": (1, 4, 4, 4, 16, (3, 3), 2, (1, 1), (2, 2), (2, 2)),  # a ring of five
    "plane-1x1-strided": (1, 2, 2, 4, 16, (1, 1), 1, (2, 2), (0, 0), (1, 1)),  # sh past NS
}


# ------------------------------------------------------------------ every branch, here
@available
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("path, conv", [(p, c) for p in PATHS
                                        for c in (PLANE_CONVS if p == "plane" else CONVS)],
                         indirect=["path"])
@pytest.mark.parametrize("form", [("full", True, "1d"), ("diag", False, "number"),
                                  (None, True, "0d")])
def test_matches_loops(path, kind, conv, form):
    """The literal loops' result on each path: the walk's on CONVS, the plane walk's on
    PLANE_CONVS (each takes it, with the ring its kh, sh and dh ask for)."""
    from convcov.backends import numba_cuda as mod

    B, Ci, Co, H, W, k, G, s, p, d = {**CONVS, **PLANE_CONVS}[conv]
    gamma, full_out, c_form = form
    out, g, mu, c, k, cv = _problem(np.random.default_rng(1), B, Ci, Co, H, W, k, full_out,
                                    gamma, G, s, p, d)
    _check(out, g, mu, c, k, cv, kind, ("float32",) * 4, c_form=c_form)
    if path == "plane":
        assert _names(mod) == [(mod._plane_name(k[0], s[0], d[0]), 8)], _names(mod)


@available
@pytest.mark.parametrize("dtypes", [("float16",) * 4, ("float64",) * 4,
                                    ("float16", "float32", "float64", "float16"),
                                    ("bfloat16",) * 4,
                                    ("bfloat16", "float16", "float32", "float64")])
def test_dtypes(path, dtypes):
    """Each dtype mix against the literal loops. On the "plane" path, planes 8 wide (a
    3 x 3 kernel padded by 1): gamma and mu of out's dtype take the plane walk, the other
    mixes the walk."""
    from convcov.backends import numba_cuda as mod

    kind = "torch_cuda" if ON_GPU else "torch"
    if "bfloat16" in dtypes and not HAS_TORCH:
        pytest.skip("bfloat16 arrays come from torch, which is not installed")
    if ON_GPU and not torch_cuda():
        pytest.skip("torch with CUDA is not installed")
    if not HAS_TORCH:
        kind = "numpy"
    # Two groups of three output channels: a pass of UNROLL (4) channels has one too many,
    # which must not spill into the next group (plane: PLANE_INFLIGHT bytes a pass, two
    # passes of two 16-bit channels or three of one).
    if path == "plane":
        out, g, mu, c, k, cv = _problem(np.random.default_rng(2), 1, 2, 6, 3, 8, (3, 3), G=2,
                                        padding=(1, 1))
    else:
        out, g, mu, c, k, cv = _problem(np.random.default_rng(2), 1, 2, 6, 4, 4, (2, 2), G=2)
    _check(out, g, mu, c, k, cv, kind, dtypes)
    if path == "plane":
        plane = len(set(dtypes[:3])) == 1
        assert _names(mod)[0][0].startswith("plane" if plane else "walk"), _names(mod)


@available
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("path", WALK_PATHS, indirect=True)  # (no plane fits a warp)
def test_sixteen_bit_vectors(path, dtype):
    """16-bit arrays in vectors, two elements a 32-bit word: out 8 elements along j1 a
    load (7 x 7 inputs padded, 8 x 8 planes of out), gamma and mu 8 along y1 (8 x 8
    inputs, 7 x 7 planes of out: no vector of out divides 7)."""
    kind = "torch_cuda" if ON_GPU else "torch"
    if not HAS_TORCH:
        if dtype == "bfloat16":
            pytest.skip("bfloat16 arrays come from torch, which is not installed")
        kind = "numpy"
    if ON_GPU and not torch_cuda():
        pytest.skip("torch with CUDA is not installed")
    for hw, pad in ((7, 1), (8, 0)):
        out, g, mu, c, k, cv = _problem(np.random.default_rng(5), 1, 2, 6, hw, hw, (2, 2),
                                        full_out=False, gamma="diag", G=2, padding=(pad, pad))
        _check(out, g, mu, c, k, cv, kind, (dtype,) * 4)


@available
@pytest.mark.parametrize("layouts", [("permuted", "strided", "permuted"),
                                     ("strided", "permuted", "strided")])
@pytest.mark.parametrize("path", WALK_PATHS, indirect=True)  # (no plane fits a warp)
def test_views(path, layouts):
    out, g, mu, c, k, cv = _problem(np.random.default_rng(3), 2, 2, 3, 4, 5, (2, 2))
    for kind in KINDS:
        _check(out, g, mu, c, k, cv, kind, ("float32",) * 4, layouts)


@available
@pytest.mark.skipif(ON_GPU, reason="negative strides: numpy views, host (simulator) only")
@pytest.mark.parametrize("path", WALK_PATHS, indirect=True)  # (no plane fits a warp)
def test_negative_strides(path):
    out, g, mu, c, k, cv = _problem(np.random.default_rng(4), 1, 2, 2, 4, 4, (2, 2))
    out_v, mu_v, g_v = out[:, ::-1], mu[..., ::-1], g[:, :, ::-1, :, :, ::-1]
    ref = convcov.accumulate(out_v.copy(), g_v, mu_v, c, k, backend="numpy")
    convcov.accumulate(out_v, g_v.astype(np.float32), mu_v.astype(np.float32), c, k,
                       backend="numba_cuda")
    np.testing.assert_allclose(out_v, ref, rtol=1e-5, atol=1e-5)


@available
@pytest.mark.skipif(ON_GPU, reason="numpy views: host (simulator) only")
def test_many_output_channels_a_group(monkeypatch):
    """More output channels a group than a quarter of the walk's shared memory holds
    values of c (12,300 in float32), out's rows (i1, j1) not contiguous (c * S straight
    into out): c is read where it is used, the launch asks for no more than CUDA's 48 KiB
    of shared memory a block (a GPU refuses more), and the result is the reference's."""
    from convcov.backends import numba_cuda as mod

    rng = np.random.default_rng(7)
    Co = 12300
    out = rng.random((1, Co, 2, 2, 2, 4), np.float32)[..., ::2]
    mu = rng.random((1, 1, 2, 2), np.float32)
    c = rng.random(Co, np.float32)
    ref = convcov.accumulate(out.astype(np.float64), None, mu.astype(np.float64),
                             c.astype(np.float64), 1, backend="numpy")
    _forget_plans(monkeypatch)
    convcov.accumulate(out, None, mu, c, 1, backend="numba_cuda")
    np.testing.assert_allclose(out, ref, rtol=1e-6, atol=1e-6)
    (plan,) = mod._plans.values()
    assert [ln.smem <= 48 * 1024 for ln in plan.launches] == [True], plan.launches


def _reversed(x):
    """``x`` with every axis reversed: a view with negative strides only."""
    return x[(slice(None, None, -1),) * x.ndim]


@available
@pytest.mark.skipif(not (ON_GPU and has_cupy_gpu()),
                    reason="negative strides on a GPU come from CuPy views (torch has none)")
@pytest.mark.parametrize("full_out, gamma", [(True, "full"), (False, "diag"), (True, None)])
@pytest.mark.parametrize("path", WALK_PATHS, indirect=True)  # (no plane fits a warp)
def test_negative_strides_on_the_gpu(path, full_out, gamma):
    """Every array a view with every axis reversed (float64 out, float32 gamma and mu, c),
    with groups, padding and a non-square kernel, against the numpy reference on the
    same views: the kernels must step backwards with negative strides."""
    import cupy

    out, g, mu, c, k, cv = _problem(np.random.default_rng(5), 2, 4, 4, 5, 6, (3, 2),
                                    full_out=full_out, gamma=gamma, G=2, padding=(1, 0))
    g = None if g is None else g.astype(np.float32)
    mu = mu.astype(np.float32)
    want = convcov.accumulate(_reversed(out).copy(), None if g is None else _reversed(g),
                              _reversed(mu), _reversed(c), k, backend="numpy", **cv)
    views = [None if x is None else _reversed(cupy.asarray(x)) for x in (out, g, mu, c)]
    assert all(s < 0 for v in views if v is not None for s in v.strides)
    convcov.accumulate(*views, k, backend="numba_cuda", **cv)
    np.testing.assert_allclose(cupy.asnumpy(views[0]), want, rtol=1e-5,
                               atol=1e-5 * np.abs(want).max())


@available
@pytest.mark.parametrize("dtypes, misaligned, forced, hw, widths", [
    (("float32",) * 4, False, "fused", 8, [("walk_vg32", 8)]),  # both 16 bytes, doubled
    (("float16",) * 4, False, "fused", 8, [("walk_vg16", 8)]),  # 16 bytes: 8 x 8 planes
    (("float16",) * 4, False, "fused", 16, [("walk_vg32", 16)]),  # 32 bytes: 16 x 16
    (("float64",) * 4, True, "fused", 8, [("walk_vg32", 1)]),  # out one element off
    (("float32", "float16", "float32", "float32"), False, "fused", 8, [("walk", 8)]),  # mixed
    (("float16", "float32", "float32", "float16"), False, "fused", 8, [("walk", 8)]),  # not out's
    (("float16",) * 4, False, "stream", 8, [("walk_s_vg16", 8), ("stream", 8)]),  # S: float32
    (("float32", "float16", "float16", "float32"), False, "stream", 8,
     [("walk_s_vg16", 8), ("stream", 4)]),  # gamma and mu share a dtype: VG 8
    (("float32",) * 4, True, "stream", 8, [("walk_s_vg32", 8), ("stream", 1)]),
    (("float32",) * 4, False, "plane", 8, [("plane_3_1_1", 8)]),  # planes that fit a warp
    (("float32",) * 4, True, "plane", 8, [("walk_vg32", 1)]),  # out's rows not 16-byte
])
def test_vector_widths(monkeypatch, dtypes, misaligned, forced, hw, widths):
    """The walk forms V elements along j1 a thread (out's vector width along its rows, or
    S's where it stores S: 16 bytes, doubled where the row allows, _plan.widen) and reads
    gamma and mu VG elements along y1 a load (16 bytes, or 32) where they share a dtype
    (out's, where it adds into out) and the layout allows, else one; stream adds into out
    V elements (16 bytes) a load. The plane walk takes planes that fit a warp only where
    gamma, mu and out are all 16-byte vectors. Every width gives the literal loops'
    result."""
    from convcov.backends import numba_cuda as mod

    _force(monkeypatch, forced)
    out, g, mu, c, k, cv = _problem(np.random.default_rng(6), 1, 2, 2, hw, hw, (3, 3), False,
                                    "diag", padding=(1, 1))
    _check(out, g, mu, c, k, cv, KINDS[0], dtypes, misalign=misaligned)
    assert _names(mod) == widths


def _out_view(a, kind, case):
    """``a`` (a diagonal-layout out when case starts with "diag", else full) as an array
    of ``kind``: contiguous; "gapped": a full out whose (i0, j0) rows are not at one
    stride (a slice of a wider buffer along j0); "permuted": (i1, j1) swapped in memory."""
    if case.endswith("gapped"):
        wide = np.zeros(a.shape[:3] + (a.shape[3] + 1,) + a.shape[4:])
        x = make(wide, kind, "float32")[:, :, :, :a.shape[3]]
        x[...] = make(a, kind, "float32")
        return x
    if case.endswith("permuted"):
        x = make(np.ascontiguousarray(np.swapaxes(a, -1, -2)), kind, "float32")
        return x.transpose(-1, -2) if kind.startswith("torch") else np.swapaxes(x, -1, -2)
    return make(a, kind, "float32")


@available
@pytest.mark.parametrize("case, rows", [("diag", 1), ("full", "HoWo"), ("full-gapped", "HoWo"),
                                        ("full-permuted", None)])
@pytest.mark.parametrize("hw", [(3, 3), (4, 4), (2, 5)])
def test_stream_rows(monkeypatch, case, rows, hw):
    """S through memory: stream takes a contiguous out[b, c0] block as one row and any
    other layout with contiguous (i1, j1) planes a row per (i0, j0); out with other
    planes (permuted) takes the walk adding into out instead. Each gives the reference's
    result."""
    from convcov.backends import numba_cuda as mod

    _force(monkeypatch, "stream")
    kind = KINDS[0]
    out0, g, mu, c, k, conv = _problem(np.random.default_rng(13), 2, 2, 3, *hw, (3, 3),
                                       not case.startswith("diag"), "diag", padding=(1, 1))
    o = _out_view(out0, kind, case)
    convcov.accumulate(o, make(g, kind, "float32"), make(mu, kind, "float32"),
                       make(c, kind, "float32"), k, backend="numba_cuda", **conv)
    (plan,) = mod._plans.values()
    last = plan.launches[-1]
    if rows is None:
        assert len(plan.launches) == 1 and not last.name.startswith("walk_s"), last.name
    else:
        HoWo = hw[0] * hw[1]
        assert last.name == "stream" and last.args[-3] == (1 if rows == 1 else HoWo)
    ref = convcov.accumulate(out0.astype(np.float32).astype(np.float64), g.astype(np.float32),
                             mu.astype(np.float32), c.astype(np.float32), k, backend="numpy",
                             **conv)
    np.testing.assert_allclose(to_f64(o), ref, rtol=1e-5, atol=1e-5)


@available
def test_padding_next_to_inf(path):
    """A term with a position in the padding is absent, not 0 * Inf = NaN (plane: rows 8
    wide, next to the zero border of the warp's plane in shared memory)."""
    from convcov.backends import numba_cuda as mod

    W = 8 if path == "plane" else 3
    mu = np.random.default_rng(6).random((1, 1, 3, W))
    mu[0, 0, 0, 0] = np.inf
    out = np.zeros((1, 1, 3, W, 3, W))
    ref = convcov.accumulate(out.copy(), None, mu, 1.0, 3, padding=1, backend="numpy")
    kind = KINDS[0]
    got = make(out, kind, "float64")
    convcov.accumulate(got, None, make(mu, kind, "float64"), 1.0, 3, padding=1,
                       backend="numba_cuda")
    if path == "plane":
        assert _names(mod) == [("plane_3_1_1", 8)], _names(mod)
    # Inf where it belongs, no NaN (assert_allclose compares the non-finite values
    # exactly); the finite ones to float64 rounding (the kernels fuse multiply-adds).
    np.testing.assert_allclose(to_f64(got), ref, rtol=1e-14, atol=0)


@available
@pytest.mark.parametrize("path", WALK_PATHS, indirect=True)  # (no plane fits a warp)
def test_float64_sum_rounds_once_into_bfloat16(path):
    """out (bf16) = 1 + (2**-8 + 2**-30): above the bf16 half-way point, so 1 + 2**-7.
    Rounding through float32 first would lose 2**-30, tie, and give 1 (even)."""
    if not HAS_TORCH:
        pytest.skip("bfloat16 arrays come from torch, which is not installed")
    import torch

    dev = "cuda" if ON_GPU else "cpu"
    out = torch.ones((1, 1, 1, 1, 1, 1), dtype=torch.bfloat16, device=dev)
    gamma = torch.full((1, 1, 1, 1, 1, 1), 2.0**-8 + 2.0**-30, dtype=torch.float64, device=dev)
    mu = torch.zeros((1, 1, 1, 1), dtype=torch.float64, device=dev)
    convcov.accumulate(out, gamma, mu, 1.0, 1, backend="numba_cuda")
    assert out.item() == 1 + 2.0**-7


# ------------------------------------------------------------------ a real GPU only
@gpu
@pytest.mark.parametrize("path", WALK_PATHS, indirect=True)  # (no plane fits a warp)
def test_cupy_and_numba_device_arrays(path):
    out, g, mu, c, k, cv = _problem(np.random.default_rng(7), 1, 2, 2, 4, 4, (2, 2))
    kinds = ["numba"] + (["cupy"] if has_cupy_gpu() else [])
    for kind in kinds:
        _check(out, g, mu, c, k, cv, kind, ("float32",) * 4)


@gpu
def test_requires_grad_tensors():
    import torch

    mu = torch.rand(1, 2, 4, 4, device="cuda", requires_grad=True)
    out = torch.zeros(1, 2, 3, 3, 3, 3, device="cuda")
    convcov.accumulate(out, None, mu, 1.0, 2, backend="numba_cuda")
    ref = convcov.accumulate(np.zeros((1, 2, 3, 3, 3, 3)), None, to_f64(mu), 1.0, 2,
                             backend="numpy")
    np.testing.assert_allclose(to_f64(out), ref, rtol=1e-5)


@gpu
@pytest.mark.parametrize("path", WALK_PATHS, indirect=True)  # (no plane fits a warp)
def test_runs_on_the_current_torch_stream(path):
    """mu is written on a side stream after a long sleep; the call, made on that stream,
    must see the new values. On any other stream it would read the old ones (zeros)."""
    import torch

    rng = np.random.default_rng(8)
    mu_true = torch.tensor(rng.random((1, 2, 5, 5)), dtype=torch.float32, device="cuda")
    mu = torch.zeros_like(mu_true)
    out = torch.zeros((1, 2, 4, 4, 4, 4), device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU time before mu is written
        mu.copy_(mu_true)
        for _ in range(2):  # the second call: the front end's fast path (a bound launcher)
            convcov.accumulate(out, None, mu, 1.0, 2, backend="numba_cuda")
    side.synchronize()
    ref = convcov.accumulate(np.zeros((1, 2, 4, 4, 4, 4)), None, to_f64(mu_true), 2.0, 2,
                             backend="numpy")
    np.testing.assert_allclose(to_f64(out), ref, rtol=1e-5)


@gpu
@pytest.mark.parametrize("path", WALK_PATHS, indirect=True)  # (no plane fits a warp)
def test_bound_launch_after_the_context_was_popped(path):
    """A thread whose calls are bound and whose context some library then popped (none
    current, while cudaGetDevice still names device 0) computes on: the bound launcher
    compares the current context itself and pushes its own around the launches. (A
    cheaper test, torch's current device and a per-thread ready set, launched into no
    context here: CUDA_ERROR_INVALID_CONTEXT on the H200 x2, 2026-11-30.)"""
    import torch
    from cuda.bindings import driver as drv

    torch.cuda.set_device(0)
    out, g, mu, c, k, cv = _problem(np.random.default_rng(14), 1, 2, 2, 5, 5, (2, 2))
    ref = convcov.accumulate(out.copy(), g, mu, c, k, backend="numpy", **cv)
    t = [torch.tensor(x, dtype=torch.float32, device="cuda:0") for x in (out, g, mu, c)]
    for _ in range(2):  # the second call takes the bound launcher: the thread is ready
        convcov.accumulate(*t, k, backend="numba_cuda", **cv)
    torch.cuda.synchronize()
    popped = []
    while int(drv.cuCtxGetCurrent()[1]):
        popped.append(drv.cuCtxPopCurrent()[1])
    assert popped
    try:
        convcov.accumulate(*t, k, backend="numba_cuda", **cv)
        torch.cuda.synchronize()
    finally:
        while int(drv.cuCtxGetCurrent()[1]):
            drv.cuCtxPopCurrent()
        for ctx in reversed(popped):
            drv.cuCtxPushCurrent(ctx)
    np.testing.assert_allclose(to_f64(t[0]), out + 3 * (ref - out), rtol=1e-4, atol=1e-4)


@gpu
def test_scratch_from_torchs_allocator():
    """Scratch for torch tensors (both GPU backends: convcov._arrays.torch_scratch) comes
    from torch's caching allocator on the launch stream, aligned for vector loads, and
    goes back when its owner is dropped."""
    import torch

    from convcov._arrays import torch_scratch

    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    owner, ptr = torch_scratch(3 << 20, torch.cuda.current_device(),
                               torch.cuda.current_stream().cuda_stream)
    assert ptr % 256 == 0
    assert torch.cuda.memory_allocated() >= before + (3 << 20)
    # usable device memory: written and summed through a CuPy view (when CuPy is here)
    if has_cupy_gpu():
        import cupy

        mem = cupy.cuda.UnownedMemory(ptr, 3 << 20, owner)
        view = cupy.ndarray((1024,), cupy.float32, cupy.cuda.MemoryPointer(mem, 0))
        view[:] = cupy.arange(1024, dtype=cupy.float32)
        assert float(view.sum()) == 1023 * 1024 / 2
        del view, mem
    del owner
    assert torch.cuda.memory_allocated() == before


@pytest.mark.parametrize("kind", ["cai", "torch", "cupy"])
def test_generic_array_scratch_is_held_until_its_launches_ran(monkeypatch, kind):
    """Host, with stand-ins for the launches, the scratch and Numba's events: a generic
    array call's scratch (a Numba device array, whose memory manager may be a plugin that
    frees on a stream of its own) outlives the call, beside an event recorded on the
    launch stream after its launches, also when a launch failed; a later call drops it
    once that event has completed, oldest first, and nothing waits for one. torch and
    CuPy scratch (their pools order reuse on the launch stream) goes back as the call
    returns."""
    import weakref

    mod = sys.modules[type(BACKEND).__module__]
    events, owners, log = [], [], []

    class Owner:
        pass

    def workspace(kind_, dev, n, acc, handle, stream):
        owners.append(weakref.ref(o := Owner()))
        return o, 4096

    class Event:
        def __init__(self):
            self.done = False
            events.append(self)

        def record(self, stream):
            log.append(("record", stream))

        def query(self):
            return self.done

        def synchronize(self):
            raise AssertionError("the host waited for an event")

    class Cuda:  # what _hold takes from numba.cuda
        @staticmethod
        def event(timing=True):
            assert not timing
            return Event()

    class Plan:
        scratch = 64
        launches = [lambda stream, values, i=i: log.append(("launch", i, stream))
                    for i in range(3)]

    monkeypatch.setattr(mod, "_workspace", workspace)
    monkeypatch.setattr(mod, "_numba_stream", lambda handle: f"stream {handle}")
    monkeypatch.setattr(mod, "cuda", Cuda)
    monkeypatch.setattr(mod, "_held", {})

    def call():
        mod._launch_plan(Plan, kind, 7, 0, "float32", 1, 2, 3, 0, 1.5)

    call()
    assert log[:3] == [("launch", i, "stream 7") for i in range(3)]
    if kind != "cai":
        assert len(log) == 3 and not events
        assert owners[0]() is None
        return
    assert log[3:] == [("record", "stream 7")]
    assert owners[0]() is not None  # its kernels may not have run yet
    call()
    events[1].done = True  # the second call's kernels ran, the first's not yet
    call()
    assert all(o() is not None for o in owners)
    events[0].done = True
    call()  # the first two go; the third's and fourth's events have not completed
    assert [o() is None for o in owners] == [True, True, False, False]

    def fails(stream, values):
        raise RuntimeError("launch failed")

    Plan.launches = Plan.launches[:1] + [fails]
    with pytest.raises(RuntimeError, match="launch failed"):
        call()
    assert log[-2:] == [("launch", 0, "stream 7"), ("record", "stream 7")]
    assert owners[4]() is not None  # held behind the launch that was queued


@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA device (this run: "
                    + ("the CUDA simulator" if SIM else f"{REASON}") + ")")
@pytest.mark.parametrize("guard", [True, False])
def test_scratch_under_rmm(guard):
    """On a GPU, with RMM's Numba plugin on a pool (tests/_rmm_scratch.py, its own
    process): another block taken right after a call on a non-blocking stream, while the
    call's kernels still wait behind a spin, must not be written by them, and out must be
    right. With the scratch dropped as the call returns instead of held (``--no-guard``)
    the same run must show the race, where RMM gave the scratch block out again: so the
    check can fail."""
    r = subprocess.run([sys.executable, _beside("_rmm_scratch.py")]
                       + ([] if guard else ["--no-guard"]),
                       env=_no_simulator(), capture_output=True, text=True, timeout=300)
    text = r.stdout + r.stderr
    if r.returncode == 77:
        pytest.skip(r.stdout.strip())
    if guard:
        assert r.returncode == 0, text[-4000:]
        assert "other block intact True" in r.stdout, text[-4000:]
        # no host wait: the call returned with its kernels still queued behind the spin
        assert "kernels queued on return True" in r.stdout, text[-4000:]
    elif "scratch block reused True" not in r.stdout:
        pytest.skip(f"RMM did not give the scratch block out again here: {text[-400:]}")
    else:
        assert "kernels queued on return True" in r.stdout, text[-4000:]
        assert r.returncode == 1 and "other block intact False" in r.stdout, text[-4000:]


@gpu
@pytest.mark.parametrize("path", WALK_PATHS, indirect=True)  # (no plane fits a warp)
def test_second_gpu(path):
    """Arrays on cuda:1 are computed there while cuda:0 is current, and calls with the same
    layout on both devices, interleaved, each use their own device's plan and kernels
    (torch tensors, and CuPy arrays where CuPy has the GPUs)."""
    import torch

    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs (nvidia-h200-x2)")
    out, g, mu, c, k, cv = _problem(np.random.default_rng(12), 1, 2, 2, 5, 5, (2, 2))
    ref = convcov.accumulate(out.copy(), g, mu, c, k, backend="numpy", **cv)
    torch.cuda.set_device(0)

    def on_torch(x, dev):
        return torch.tensor(x, dtype=torch.float32, device=f"cuda:{dev}")

    def on_cupy(x, dev):
        import cupy

        with cupy.cuda.Device(dev):
            return cupy.asarray(x, dtype=cupy.float32)

    for move in [on_torch] + ([on_cupy] if has_cupy_gpu() else []):
        arrays = {dev: [move(x, dev) for x in (out, g, mu, c)] for dev in (1, 0)}
        for _ in range(2):  # the second round takes the planned launches
            for dev in (1, 0):
                a = arrays[dev]
                convcov.accumulate(a[0], a[1], a[2], a[3], k, backend="numba_cuda", **cv)
        assert torch.cuda.current_device() == 0
        for dev in (1, 0):
            np.testing.assert_allclose(to_f64(arrays[dev][0]), out + 2 * (ref - out),
                                       rtol=1e-4, atol=1e-4)


@gpu
def test_more_than_2_31_elements():
    """out (float32, diagonal layout) of 2.6e9 elements: 64-bit indexing, checked at
    sampled positions past 2**31 against S computed from mu directly (gamma None)."""
    import torch

    free, _ = torch.cuda.mem_get_info()
    H, Co, k = 162, 4, 3
    Ho = H - k + 1
    need = Co * Ho**4 * 4 + (H * H) ** 2 * 4 + 2**30
    if free < need:
        pytest.skip(f"needs {need / 2**30:.0f} GiB of free GPU memory, {free / 2**30:.0f} here")
    assert Co * Ho**4 > 2**31
    rng = np.random.default_rng(9)
    mu64 = rng.random((1, 1, H, H))
    out = torch.zeros((1, Co, Ho, Ho, Ho, Ho), dtype=torch.float32, device="cuda")
    c = torch.tensor([1.0, 2.0, 3.0, 4.0], device="cuda")
    convcov.accumulate(out, None, torch.tensor(mu64, dtype=torch.float32, device="cuda"), c, k,
                       backend="numba_cuda")
    m32 = mu64.astype(np.float32).astype(np.float64)[0, 0]
    for c0, i0, j0, i1, j1 in [(3, Ho - 1, Ho - 1, Ho - 1, Ho - 1), (3, 5, 7, Ho - 2, 3),
                               (2, Ho - 1, 0, 0, Ho - 1), (0, 0, 0, 0, 0)]:
        s = sum(m32[i0 + ii, j0 + ji] * m32[i1 + ii, j1 + ji]
                for ii in range(k) for ji in range(k))
        got = out[0, c0, i0, j0, i1, j1].item()
        assert abs(got - (c0 + 1) * s) <= 1e-5 * abs(s), (c0, i0, j0, i1, j1, got, s)
    del out


@gpu
@pytest.mark.parametrize("path", WALK_PATHS, indirect=True)  # (no plane fits a warp)
def test_threads_at_once(path):
    import torch

    rng = np.random.default_rng(10)
    cases = [_problem(rng, 1, 2, 2, 5, 5, (2, 2)) for _ in range(4)]
    refs, results = [], [None] * len(cases)
    for out, g, mu, c, k, _ in cases:
        refs.append(convcov.accumulate(out.copy(), g, mu, c, k, backend="numpy"))

    def work(i, start):
        out, g, mu, c, k, cv = cases[i]
        t = [torch.tensor(x, dtype=torch.float32, device="cuda") for x in (out, g, mu, c)]
        start()
        for _ in range(20):  # out accumulates 20 times
            convcov.accumulate(t[0], t[1], t[2], t[3], k, backend="numba_cuda")
        torch.cuda.current_stream().synchronize()
        results[i] = to_f64(t[0])

    at_once(len(cases), work)
    for (out, *_), ref, got in zip(cases, refs, results):
        np.testing.assert_allclose(got, out + 20 * (ref - out), rtol=1e-4, atol=1e-4)


# ------------------------------------------------------------------ the backward
# Backend.patch_moment_vjp (docs/autograd.md): tiny random problems against the numpy
# backend's VJP (float64), through the backward's front end on arrays of every kind here.
# tests/test_autograd.py also runs gradcheck and the torch operators through this backend.
def _vjp_problem(rng, B, Ci, H, W, k, G=1, stride=(1, 1), padding=(0, 0), dilation=(1, 1)):
    kh, kw = k
    Ho = (H + 2 * padding[0] - dilation[0] * (kh - 1) - 1) // stride[0] + 1
    Wo = (W + 2 * padding[1] - dilation[1] * (kw - 1) - 1) // stride[1] + 1
    conv = dict(stride=stride, padding=padding, dilation=dilation, groups=G)
    return rng.standard_normal((B, G, Ho, Wo, Ho, Wo)), rng.standard_normal((B, Ci, H, W)), conv


def _vjp_ref(grad_S, mu, k, conv, full_gamma):
    """The numpy backend's (grad_gamma, grad_mu) in float64, and the same on |inputs|."""
    from convcov._frontend import patch_moment_vjp

    B, Ci, H, W = mu.shape
    res = []
    for gs, m in ((grad_S, mu), (np.abs(grad_S), np.abs(mu))):
        gg = np.zeros((B, Ci, H, W, Ci, H, W) if full_gamma else (B, Ci, H, W, H, W))
        gm = np.zeros(mu.shape)
        patch_moment_vjp(gs, m, k, grad_gamma=gg, grad_mu=gm, backend="numpy", **conv)
        res.append((gg, gm))
    return res


def _check_vjp(grad_S, mu, k, conv, kind, dtypes=("float32",) * 4, layouts=("contiguous",) * 4,
               gamma="diag", want_mu=True, seed=0):
    """numba_cuda's backward on arrays of ``kind`` vs the numpy VJP of the same (rounded)
    inputs. dtypes and layouts: grad_S, mu, grad_gamma, grad_mu. The gradients start as NaN
    (overwrite, never add); off the channel-diagonal of a full grad_gamma they must stay."""
    from convcov._frontend import patch_moment_vjp

    rng = np.random.default_rng(seed)
    dt_s, dt_m, dt_gg, dt_gm = dtypes
    B, Ci, H, W = mu.shape
    gs = make(grad_S, kind, dt_s, layouts[0], rng)
    m = make(mu, kind, dt_m, layouts[1], rng)
    full = gamma == "full"
    shape = (B, Ci, H, W, Ci, H, W) if full else (B, Ci, H, W, H, W)
    start = rng.standard_normal(shape) if full else np.full(shape, np.nan)
    gg = None if gamma is None else make(start, kind, dt_gg, layouts[2], rng)
    gm = make(np.full(mu.shape, np.nan), kind, dt_gm, layouts[3], rng) if want_mu else None
    before = None if gg is None else to_f64(gg)
    patch_moment_vjp(gs, m, k, grad_gamma=gg, grad_mu=gm, backend="numba_cuda", **conv)
    (ref_gg, ref_gm), (bnd_gg, bnd_gm) = _vjp_ref(to_f64(gs), to_f64(m), k, conv, full)
    acc = "float64" if "float64" in [dt_s, dt_m] + ([dt_gg] if gg is not None else []) + (
        [dt_gm] if want_mu else []) else "float32"
    kh, kw = k
    P = grad_S.shape[2] * grad_S.shape[3]
    for got, ref, bnd, dt, n in ((gg, ref_gg, bnd_gg, dt_gg, kh * kw),
                                 (gm, ref_gm, bnd_gm, dt_gm, 2 * kh * kw * P)):
        if got is None:
            continue
        got64 = to_f64(got)
        if full and got is gg:
            diag = np.zeros(shape, bool)
            for c in range(Ci):
                diag[:, c, :, :, c] = True
            np.testing.assert_array_equal(got64[~diag], before[~diag])
            got64, ref, bnd = got64[diag], ref[diag], bnd[diag]
        err = np.abs(got64 - ref)
        tol = tolerance(bnd, n, acc, dt)
        assert (err <= tol).all(), (f"worst error {err.max():.3g}, "
                                    f"tolerance {tol.ravel()[err.argmax()]:.3g}")


VJP_CONVS = {  # name: (B, Ci, H, W, k, G, stride, padding, dilation)
    "seed": (1, 2, 4, 4, (2, 2), 1, (1, 1), (0, 0), (1, 1)),
    "padded": (1, 2, 4, 5, (3, 3), 1, (1, 1), (2, 1), (1, 1)),
    "strided-dilated-groups": (2, 4, 5, 6, (2, 3), 2, (2, 1), (1, 0), (1, 2)),
    "six-channels": (1, 6, 3, 3, (2, 1), 1, (1, 1), (0, 0), (1, 1)),  # 4 + a clamped 2
    "depthwise-strided": (1, 3, 5, 4, (2, 2), 3, (2, 2), (1, 1), (1, 1)),
}


@available
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("conv", list(VJP_CONVS))
@pytest.mark.parametrize("gamma,want_mu", [("diag", True), ("full", True), ("diag", False),
                                           (None, True)])
def test_vjp_matches_numpy(kind, conv, gamma, want_mu):
    B, Ci, H, W, k, G, s, p, d = VJP_CONVS[conv]
    grad_S, mu, cv = _vjp_problem(np.random.default_rng(11), B, Ci, H, W, k, G, s, p, d)
    _check_vjp(grad_S, mu, k, cv, kind, ("float64",) * 4, gamma=gamma, want_mu=want_mu)
    _check_vjp(grad_S, mu, k, cv, kind, ("float32",) * 4, gamma=gamma, want_mu=want_mu)


@available
@pytest.mark.parametrize("dtypes", [("float16",) * 4, ("bfloat16",) * 4,
                                    ("float32", "float16", "bfloat16", "float64"),
                                    ("bfloat16", "float64", "float16", "float32"),
                                    ("float16", "float32", "float32", "bfloat16")])
def test_vjp_dtypes(dtypes):
    kind = "torch_cuda" if ON_GPU else "torch"
    if not HAS_TORCH:
        if "bfloat16" in dtypes:
            pytest.skip("bfloat16 arrays come from torch, which is not installed")
        kind = "numpy"
    if ON_GPU and not torch_cuda():
        pytest.skip("torch with CUDA is not installed")
    grad_S, mu, cv = _vjp_problem(np.random.default_rng(12), 1, 2, 4, 4, (2, 2),
                                  padding=(1, 0))
    for gamma in ("diag", "full"):
        _check_vjp(grad_S, mu, (2, 2), cv, kind, dtypes, gamma=gamma)


@available
@pytest.mark.parametrize("layouts", [("permuted", "strided", "permuted", "strided"),
                                     ("strided", "permuted", "strided", "permuted")])
@pytest.mark.parametrize("gamma", ["diag", "full"])
def test_vjp_views(layouts, gamma):
    grad_S, mu, cv = _vjp_problem(np.random.default_rng(13), 2, 2, 4, 5, (2, 3), G=2,
                                  padding=(1, 1))
    for kind in KINDS:
        _check_vjp(grad_S, mu, (2, 3), cv, kind, layouts=layouts, gamma=gamma)


@available
def test_vjp_expanded_grad_S():
    """autograd hands an expanded gradient (zero strides) for out.sum()-like losses."""
    from convcov._frontend import patch_moment_vjp

    shape = (2, 1, 3, 3, 3, 3)
    mu = np.random.default_rng(14).standard_normal((2, 2, 4, 4))
    if KINDS[0] == "numpy":
        gs = np.broadcast_to(np.float32(0.5), shape)
        m = mu.astype(np.float32)
    else:
        import torch

        gs = torch.full((), 0.5, device="cuda").expand(shape)
        m = torch.tensor(mu, dtype=torch.float32, device="cuda")
    gg, gm = np.zeros((2, 2, 4, 4, 4, 4)), np.zeros(mu.shape)
    patch_moment_vjp(np.full(shape, 0.5), mu, 2, grad_gamma=gg, grad_mu=gm, backend="numpy")
    got_gg = make(np.full(gg.shape, np.nan), KINDS[0], "float32")
    got_gm = make(np.full(mu.shape, np.nan), KINDS[0], "float32")
    patch_moment_vjp(gs, m, 2, grad_gamma=got_gg, grad_mu=got_gm, backend="numba_cuda")
    np.testing.assert_allclose(to_f64(got_gg), gg, rtol=1e-6)
    np.testing.assert_allclose(to_f64(got_gm), gm, rtol=1e-5, atol=1e-5)


@available
def test_vjp_padding_next_to_inf():
    """Terms with a position in the padding are absent, even next to NaN / Inf: the same
    NaN / Inf pattern as the numpy VJP, and equal finite values."""
    from convcov._frontend import patch_moment_vjp

    rng = np.random.default_rng(15)
    mu = rng.random((1, 1, 3, 4))
    mu[0, 0, 0, 0] = np.inf
    grad_S = rng.random((1, 1, 3, 4, 3, 4))
    grad_S[0, 0, 0, 0, 0, 3] = np.nan  # a pair that offsets with padded partners also read
    grad_S[0, 0, 2, 3, 1, 0] = -np.inf
    res = []
    for be, kind in (("numpy", "numpy"), ("numba_cuda", KINDS[0])):
        gg = make(np.zeros((1, 1, 3, 4, 3, 4)), kind, "float64")
        gm = make(np.zeros(mu.shape), kind, "float64")
        patch_moment_vjp(make(grad_S, kind, "float64"), make(mu, kind, "float64"), 3,
                         grad_gamma=gg, grad_mu=gm, padding=1, backend=be)
        res.append((to_f64(gg), to_f64(gm)))
    for want, got in zip(*res):
        np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)
    assert not np.isnan(res[1][1]).all()  # the pattern is not trivially all-NaN


@available
@pytest.mark.skipif(ON_GPU, reason="negative strides: numpy views, host (simulator) only")
def test_vjp_negative_strides():
    from convcov._frontend import patch_moment_vjp

    grad_S, mu, cv = _vjp_problem(np.random.default_rng(16), 1, 2, 4, 4, (2, 2))
    gs_v, mu_v = grad_S[:, :, ::-1, :, :, ::-1], mu[..., ::-1]
    want = _vjp_ref(gs_v, mu_v, (2, 2), cv, False)[0]
    gg = np.zeros((1, 2, 4, 4, 4, 4))[:, ::-1, :, ::-1]
    gm = np.zeros((1, 2, 4, 4))[..., ::-1]
    patch_moment_vjp(gs_v, mu_v, 2, grad_gamma=gg, grad_mu=gm, backend="numba_cuda")
    np.testing.assert_allclose(gg, want[0], rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(gm, want[1], rtol=1e-12, atol=1e-12)


# ------------------------------------------------------------------ the backward, GPU only
@gpu
def test_vjp_on_the_current_torch_stream():
    """grad_S and mu are written on a side stream after a long sleep; the backward, called
    on that stream, must see them (on any other stream it would read zeros)."""
    import torch

    from convcov._frontend import patch_moment_vjp

    grad_S, mu, cv = _vjp_problem(np.random.default_rng(17), 1, 2, 5, 5, (2, 2))
    gs_true = torch.tensor(grad_S, dtype=torch.float32, device="cuda")
    mu_true = torch.tensor(mu, dtype=torch.float32, device="cuda")
    gs, m = torch.zeros_like(gs_true), torch.zeros_like(mu_true)
    gg = torch.empty((1, 2, 5, 5, 5, 5), device="cuda")
    gm = torch.empty_like(m)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.cuda._sleep(200_000_000)
        gs.copy_(gs_true)
        m.copy_(mu_true)
        patch_moment_vjp(gs, m, 2, grad_gamma=gg, grad_mu=gm, backend="numba_cuda", **cv)
    side.synchronize()
    want = _vjp_ref(to_f64(gs_true), to_f64(mu_true), (2, 2), cv, False)[0]
    np.testing.assert_allclose(to_f64(gg), want[0], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(to_f64(gm), want[1], rtol=1e-4, atol=1e-4)


# CUDA-graph capture of forward + backward: tests/test_autograd.py::test_cuda_graph_capture


@gpu
def test_vjp_more_than_2_31_elements():
    """grad_gamma (float16, diagonal layout) of 2.3e9 elements: 64-bit indexing. With a
    1 x 1 kernel dΓ is grad_S itself, stored to every channel: checked past 2**31."""
    import torch

    from convcov._frontend import patch_moment_vjp

    H, Ci = 110, 16
    HW = H * H
    n = Ci * HW * HW
    need = n * 2 + HW * HW * 4 + 2**30
    free, _ = torch.cuda.mem_get_info()
    if free < need:
        pytest.skip(f"needs {need / 2**30:.0f} GiB of free GPU memory, {free / 2**30:.0f} here")
    assert n > 2**31
    gen = torch.Generator(device="cuda").manual_seed(19)
    grad_S = torch.rand((1, 1, H, H, H, H), device="cuda", generator=gen)
    mu = torch.rand((1, Ci, H, H), device="cuda", generator=gen)
    gg = torch.empty((1, Ci, H, H, H, H), dtype=torch.float16, device="cuda")
    patch_moment_vjp(grad_S, mu, 1, grad_gamma=gg, backend="numba_cuda")
    for ci, x0, y0, x1, y1 in [(15, H - 1, H - 1, H - 1, H - 1), (14, 3, 7, H - 2, 5),
                               (11, H - 1, 0, 0, H - 1), (0, 0, 0, 0, 0)]:
        want = grad_S[0, 0, x0, y0, x1, y1].half().item()
        assert gg[0, ci, x0, y0, x1, y1].item() == want, (ci, x0, y0, x1, y1)
    del gg
