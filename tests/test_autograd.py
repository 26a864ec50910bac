"""Gradients and the torch integration (docs/autograd.md).

* ``torch.autograd.gradcheck`` in float64 through every backend that has a backward
  (``Backend.patch_moment_vjp``), on that backend's device: parametrised over the
  registry, so a backend that gains a backward, CPU or CUDA, is covered with no new code;
* gradients agree with autograd through the plain PyTorch expression
  (``convcov.torch_expr``) on random problems (hypothesis): layouts of ``out`` and
  ``gamma``, ``gamma=None``, ``c`` as number, 0-d and 1-d, every conv parameter;
* a call autograd records is ``patch_moment`` then torch's own in-place op on ``out``'s
  channel-diagonal: it writes what the fused kernel writes, rounds once into a 16-bit,
  float32 or float64 ``out``, sums in float64 when the fused kernel does, and allocates
  ``S``, nothing of out's size;
* ``accumulate`` is an in-place op as torch's own are: version counter, torch's refusals
  (leaves, views it does not let in-place ops modify) before anything is written, the old
  value's history, views of larger tensors;
* ``torch.compile(fullgraph=True)`` of a small model, ``torch.library.opcheck`` of the
  operators, CUDA graph capture (on a GPU);
* the backward's front end (``convcov._frontend.patch_moment_vjp``): checks and choice of
  a backend that has a backward;
* ``convcov.nn``.
"""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import convcov
from convcov import Backend, BackendError, ShapeError, _frontend, _registry

from kinds import SIM, check_absent_terms_in_the_backward

torch = pytest.importorskip("torch")
torch_expr = pytest.importorskip("convcov.torch_expr")
import convcov.nn  # noqa: E402  (imports torch)
import convcov.torch_ops  # noqa: E402  (registers the operators, for opcheck)

F64 = torch.float64


# ---------------------------------------------------------------------------------------
# Problems


def out_size(n, k, s, p, d):
    return (n + 2 * p - d * (k - 1) - 1) // s + 1


class Case:
    """One problem: geometry, layouts, and float64 leaf tensors that require grad."""

    def __init__(self, B, Ci, Co, G, H, W, k, stride=(1, 1), padding=(0, 0),
                 dilation=(1, 1), full_out=False, gamma_form="diag", c_form="1d", seed=0,
                 device="cpu"):
        self.B, self.Ci, self.Co, self.G, self.H, self.W = B, Ci, Co, G, H, W
        self.k, self.stride, self.padding, self.dilation = k, stride, padding, dilation
        self.Ho = out_size(H, k[0], stride[0], padding[0], dilation[0])
        self.Wo = out_size(W, k[1], stride[1], padding[1], dilation[1])
        g = torch.Generator().manual_seed(seed)

        def leaf(*shape, positive=False):
            x = torch.rand(shape, generator=g, dtype=F64) if positive else \
                torch.randn(shape, generator=g, dtype=F64)
            return x.to(device).requires_grad_(True)

        Ho, Wo = self.Ho, self.Wo
        self.out_shape = (B, Co, Ho, Wo, Co, Ho, Wo) if full_out else (B, Co, Ho, Wo, Ho, Wo)
        self.out0 = leaf(*self.out_shape)
        self.mu = leaf(B, Ci, H, W)
        self.gamma = {"full": lambda: leaf(B, Ci, H, W, Ci, H, W, positive=True),
                      "diag": lambda: leaf(B, Ci, H, W, H, W, positive=True),
                      None: lambda: None}[gamma_form]()
        self.c = {"number": lambda: 0.7, "0d": lambda: leaf(positive=True),
                  "1d": lambda: leaf(Co, positive=True)}[c_form]()
        self.weights = torch.randn(self.out_shape, generator=g, dtype=F64).to(device)

    @property
    def conv(self):
        return dict(stride=self.stride, padding=self.padding, dilation=self.dilation,
                    groups=self.G)

    def leaves(self):
        return [x for x in (self.out0, self.gamma, self.mu, self.c)
                if isinstance(x, torch.Tensor)]

    def convcov(self, out0, gamma, mu, c, backend=None):
        out = out0.clone()  # out0 is a leaf: accumulate into a non-leaf with its history
        return convcov.accumulate(out, gamma, mu, c, self.k, backend=backend, **self.conv)

    def expr(self, out0, gamma, mu, c):
        return torch_expr.accumulate(out0.clone(), gamma, mu, c, *self.k, self.stride,
                                     self.padding, self.dilation, self.G)

    def grads(self, how, backend=None):
        """Gradients of sum(weights * out) for every leaf, through ``how``."""
        if how == "convcov":
            out = self.convcov(self.out0, self.gamma, self.mu, self.c, backend)
        else:
            out = self.expr(self.out0, self.gamma, self.mu, self.c)
        return torch.autograd.grad((out * self.weights).sum(), self.leaves())


@st.composite
def cases(draw):
    G = draw(st.integers(1, 2))
    kh, kw = draw(st.integers(1, 3)), draw(st.integers(1, 3))
    sh, sw = draw(st.integers(1, 2)), draw(st.integers(1, 2))
    ph, pw = draw(st.integers(0, 2)), draw(st.integers(0, 2))
    dh, dw = draw(st.integers(1, 2)), draw(st.integers(1, 2))
    span_h, span_w = dh * (kh - 1) + 1, dw * (kw - 1) + 1
    H = draw(st.integers(max(1, span_h - 2 * ph), span_h + 3))
    W = draw(st.integers(max(1, span_w - 2 * pw), span_w + 3))
    B = 0 if draw(st.integers(0, 20)) == 0 else draw(st.integers(1, 2))  # now and then empty
    return Case(B=B, Ci=G * draw(st.integers(1, 2)),
                Co=G * draw(st.integers(1, 3)), G=G, H=H, W=W, k=(kh, kw), stride=(sh, sw),
                padding=(ph, pw), dilation=(dh, dw), full_out=draw(st.booleans()),
                gamma_form=draw(st.sampled_from(["full", "diag", None])),
                c_form=draw(st.sampled_from(["number", "0d", "1d"])),
                seed=draw(st.integers(0, 2**31 - 1)))


# ---------------------------------------------------------------------------------------
# Backends that have a backward, each on its device


def _vjp_params():
    params = []
    for name in _registry.names():
        b = _registry.get(name)
        params.append(pytest.param(name, id=name, marks=[pytest.mark.gpu]
                                   if b.device == "cuda" else []))
    return params


@pytest.fixture(params=_vjp_params())
def vjp_backend(request):
    """(name, torch device) of a backend that has a backward and can run here."""
    name = request.param
    b = _registry.get(name)
    reason = b.unavailable_reason()
    if reason:
        pytest.skip(f"{name}: {reason}")
    if not _frontend.has_vjp(b):
        pytest.skip(f"{name}: has no backward (patch_moment_vjp) yet")
    if b.device == "cuda" and not torch.cuda.is_available():
        pytest.skip(f"{name}: torch has no CUDA device here")
    if "float64" not in b.dtypes:
        pytest.skip(f"{name}: does not compute on float64, which gradcheck needs")
    return name, ("cpu" if b.device == "cpu" else "cuda")


# ---------------------------------------------------------------------------------------
# gradcheck


TINY = dict(B=1, Ci=2, Co=2, G=1, H=3, W=3, k=(2, 2))
GEOMETRIES = [  # stride, padding, dilation, groups, rectangular kernels and inputs
    dict(B=2, Ci=2, Co=4, G=2, H=5, W=4, k=(3, 2), stride=(2, 1), padding=(1, 0)),
    dict(B=1, Ci=3, Co=3, G=3, H=5, W=5, k=(2, 2), padding=(1, 1), dilation=(2, 1)),
]


@pytest.mark.parametrize("full_out", [False, True], ids=["diag_out", "full_out"])
@pytest.mark.parametrize("gamma_form", ["full", "diag", None])
@pytest.mark.parametrize("c_form", ["number", "0d", "1d"])
def test_gradcheck_accumulate_tiny(vjp_backend, full_out, gamma_form, c_form):
    name, device = vjp_backend
    case = Case(**TINY, full_out=full_out, gamma_form=gamma_form, c_form=c_form,
                device=device)
    args = [case.out0, case.gamma, case.mu, case.c]
    # Under the CUDA simulator each forward costs ~0.1 s of Python threads: check the
    # Jacobian along random directions (fast mode) rather than column by column there.
    simulated = SIM and name == "numba_cuda"
    assert torch.autograd.gradcheck(lambda *a: case.convcov(*a, backend=name), args,
                                    fast_mode=simulated)


@pytest.mark.parametrize("geometry", GEOMETRIES, ids=["strided_grouped", "depthwise_dilated"])
@pytest.mark.parametrize("gamma_form", ["full", "diag"])
def test_gradcheck_accumulate_geometries(vjp_backend, geometry, gamma_form):
    name, device = vjp_backend
    case = Case(**geometry, full_out=gamma_form == "full", gamma_form=gamma_form,
                device=device)
    args = [case.out0, case.gamma, case.mu, case.c]
    assert torch.autograd.gradcheck(lambda *a: case.convcov(*a, backend=name), args,
                                    fast_mode=True)


@pytest.mark.parametrize("gamma_form", ["full", "diag", None])
def test_gradcheck_patch_moment(vjp_backend, gamma_form):
    name, device = vjp_backend
    case = Case(**GEOMETRIES[0], gamma_form=gamma_form, device=device)
    # a non-contiguous mu: the backward reads it through its strides
    mu = case.mu.detach().transpose(2, 3).contiguous().transpose(2, 3).requires_grad_(True)

    def f(gamma, mu):
        return convcov.patch_moment(gamma, mu, case.k, backend=name, **case.conv)

    assert torch.autograd.gradcheck(f, (case.gamma, mu), fast_mode=True)


# ---------------------------------------------------------------------------------------
# Against autograd through the plain PyTorch expression


@settings(max_examples=30)
@given(case=cases())
def test_gradients_match_plain_pytorch(case):
    got = case.grads("convcov", backend="numpy")
    want = case.grads("expr")
    names = [n for n, x in zip(("out", "gamma", "mu", "c"),
                               (case.out0, case.gamma, case.mu, case.c))
             if isinstance(x, torch.Tensor)]
    for n, a, b in zip(names, got, want):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10,
                                   msg=lambda m, n=n: f"{n}: {m}")


def test_gradients_match_plain_pytorch_on_every_vjp_backend(vjp_backend):
    name, device = vjp_backend
    for seed, geometry in enumerate(GEOMETRIES):
        case = Case(**geometry, gamma_form="diag", seed=seed, device=device)
        for a, b in zip(case.grads("convcov", backend=name), case.grads("expr")):
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


def test_patch_moment_gradients_match_plain_pytorch():
    case = Case(**GEOMETRIES[0], gamma_form="full")
    kw = dict(stride=case.stride, padding=case.padding, dilation=case.dilation,
              groups=case.G)
    S = convcov.patch_moment(case.gamma, case.mu, case.k, backend="numpy", **kw)
    want_S = torch_expr.patch_moment(case.gamma, case.mu, *case.k, case.stride, case.padding,
                                     case.dilation, case.G)
    torch.testing.assert_close(S, want_S, rtol=1e-12, atol=1e-12)
    v = torch.randn_like(S)
    got = torch.autograd.grad((S * v).sum(), (case.gamma, case.mu))
    want = torch.autograd.grad((want_S * v).sum(), (case.gamma, case.mu))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


def _problem(device, full_out, dtype=torch.float32, Co=6, G=2, seed=3):
    """(out, gamma, mu, c, kernel, keywords): random inputs of one grouped problem, padding
    1 with a full-layout out (terms in the padding are absent on every path)."""
    g = torch.Generator().manual_seed(seed)
    B, Ci, H, k = 2, 4, 6, 3
    pad = 1 if full_out else 0
    Ho = H + 2 * pad - k + 1
    shape = (B, Co, Ho, Ho, Co, Ho, Ho) if full_out else (B, Co, Ho, Ho, Ho, Ho)
    out = torch.rand(shape, generator=g).to(device, dtype)
    gamma = (torch.rand(B, Ci, H, H, H, H, generator=g) * 0.1).to(device)
    mu = torch.randn(B, Ci, H, H, generator=g).to(device)
    c = torch.rand(Co, generator=g).to(device)
    return out, gamma, mu, c, k, dict(padding=pad, groups=G)


def _off_diagonal(out):
    """The entries of a full-layout out that accumulate never touches."""
    keep = torch.ones(out.shape, dtype=torch.bool, device=out.device)
    keep.diagonal(0, 1, 4).fill_(False)
    return out[keep]


@pytest.mark.parametrize("full_out", [False, True], ids=["diag_out", "full_out"])
@pytest.mark.parametrize("G, Co", [(1, 6), (2, 6), (4, 4)], ids=["G1", "G2", "depthwise"])
def test_recorded_forward_equals_the_fused_forward(vjp_backend, full_out, G, Co):
    """A call autograd records is S, then torch's in-place op adds c * S into out's
    diagonal (docs/autograd.md): out is what the fused kernel writes, up to the rounding of
    that one add (an FMA or not), and bit-identical off the channel-diagonal."""
    name, device = vjp_backend
    out, gamma, mu, c, k, kw = _problem(device, full_out, Co=Co, G=G)
    fused = convcov.accumulate(out.clone(), gamma, mu, c, k, backend=name, **kw)
    for args in ((gamma, mu, c.clone().requires_grad_()),
                 (gamma.clone().requires_grad_(), mu, c),
                 (gamma, mu.clone().requires_grad_(), 0.7)):
        recorded = convcov.accumulate(out.clone(), *args, k, backend=name, **kw)
        assert recorded.grad_fn is not None  # the autograd path ran
        want = fused if isinstance(args[2], torch.Tensor) else convcov.accumulate(
            out.clone(), gamma, mu, 0.7, k, backend=name, **kw)
        torch.testing.assert_close(recorded.detach(), want, rtol=2e-6, atol=1e-6)
        if full_out:
            assert torch.equal(_off_diagonal(recorded.detach()), _off_diagonal(out))


def _numba_or_skip():
    reason = _registry.get("numba").unavailable_reason()
    if reason:
        pytest.skip(f"numba: {reason}")
    return "numba"


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, F64])
@pytest.mark.parametrize("c_form", ["number", "1d"])
def test_recorded_add_rounds_once_into_out(dtype, c_form):
    """torch's in-place op on a float16/bfloat16/float32/float64 out with S in the dtype the
    sums run in (float32 here; float64 for a float64 out) computes out + c * S in S's dtype
    and rounds once into out's dtype: each entry is that value rounded (an FMA: from the
    exact sum) or the same with c * S rounded first (no FMA); out keeps its dtype."""
    backend = _numba_or_skip()  # (bfloat16 runs on numba, not on the numpy reference)
    out, gamma, mu, c, k, kw = _problem("cpu", full_out=False, dtype=dtype)
    mu = mu.to(F64) if dtype == F64 else mu
    c = 0.7 if c_form == "number" else c
    S = convcov.patch_moment(gamma, mu, k, backend=backend, **kw)
    assert S.dtype == (F64 if dtype == F64 else torch.float32)
    mu_leaf = mu.clone().requires_grad_()
    got = convcov.accumulate(out.clone(), gamma, mu_leaf, c, k, backend=backend, **kw)
    assert got.dtype == dtype and got.grad_fn is not None
    # The backward: the gradient of a sum over a 16-bit out is exact (ones), the rest is
    # summed in float32 at least.
    grad_mu, = torch.autograd.grad(got.sum(), mu_leaf)
    mu64 = mu.double().requires_grad_()
    c64 = c if c_form == "number" else c.double()
    want, = torch.autograd.grad(convcov.accumulate(
        out.to(F64, copy=True), gamma.double(), mu64, c64, k, backend="numpy",
        **kw).sum(), mu64)
    assert grad_mu.dtype == mu.dtype
    torch.testing.assert_close(grad_mu.double(), want, rtol=1e-5, atol=1e-5)
    Co, G = out.shape[1], kw["groups"]
    c_all = torch.full((Co,), 0.7) if c_form == "number" else c  # (a number: in S's dtype)
    cg = c_all.to(S.dtype).reshape(1, G, Co // G, 1, 1, 1, 1)
    got = got.detach().unflatten(1, (G, Co // G))
    if dtype == F64:  # no wider sum to compare with here: close to the fused kernel's
        fused = convcov.accumulate(out.clone(), gamma, mu, c, k, backend=backend, **kw)
        torch.testing.assert_close(got, fused.unflatten(1, (G, Co // G)), rtol=1e-13,
                                   atol=1e-13)
        return
    o = out.unflatten(1, (G, Co // G)).to(S.dtype)
    unfused = (o + S.unsqueeze(2) * cg).to(dtype)
    # an FMA: out + c * S rounded once to float32 (float64 holds the product exactly)
    fma = (o.double() + S.unsqueeze(2).double() * cg.double()).float().to(dtype)
    assert ((got == fma) | (got == unfused)).all()


def test_recorded_sums_in_float64_when_the_fused_kernel_does():
    """A float64 out or c makes the fused kernel sum in float64 though gamma and mu are
    float32; the recorded call then computes S in float64 too, not in float32."""
    out, gamma, mu, c, k, kw = _problem("cpu", full_out=False, dtype=F64)
    for o, c_arg in ((out, c), (out.float(), c.double())):
        fused = convcov.accumulate(o.clone(), gamma, mu, c_arg, k, backend="numpy", **kw)
        got = convcov.accumulate(o.clone(), gamma, mu.clone().requires_grad_(), c_arg, k,
                                 backend="numpy", **kw)
        assert got.dtype == o.dtype
        if o.dtype == F64:
            torch.testing.assert_close(got.detach(), fused, rtol=1e-13, atol=1e-13)
        else:  # both: float64 sums, rounded once into float32
            assert torch.equal(got.detach(), fused)


@pytest.mark.parametrize("full_out", [False, True], ids=["diag_out", "full_out"])
def test_recorded_forward_allocates_S_and_nothing_of_outs_size(full_out):
    """The recorded forward holds S (Co / G times smaller than out's diagonal) and torch
    allocates nothing larger: S and c broadcast into the in-place op (float32 out on the
    host; docs/autograd.md says what torch's host kernels do for a 16-bit out)."""
    from torch.profiler import ProfilerActivity, profile

    out, gamma, mu, c, k, kw = _problem("cpu", full_out, Co=16, G=2)
    mu.requires_grad_(True)
    S_bytes = convcov.patch_moment(gamma, mu.detach(), k, backend="numpy", **kw).nbytes
    convcov.accumulate(out.clone(), gamma, mu, c, k, backend="numpy", **kw)  # warm
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        convcov.accumulate(out, gamma, mu, c, k, backend="numpy", **kw)
    largest = max(e.cpu_memory_usage for e in prof.events())
    diagonal_bytes = out.diagonal(0, 1, 4).nbytes if full_out else out.nbytes
    assert largest <= S_bytes <= diagonal_bytes // 8


@pytest.mark.gpu
def test_recorded_forward_on_the_gpu_allocates_no_out_sized_temporary(vjp_backend):
    """On CUDA torch's in-place op converts as it loads and stores: a float16 out with
    float32 S needs no float32 copy of out (unlike torch's host kernels). The budget holds
    S (out.nbytes / 32 here) and the backend's scratch for it, not a copy of out (twice
    out.nbytes)."""
    name, device = vjp_backend
    if device != "cuda":
        pytest.skip("a CUDA backend's test")
    g = torch.Generator().manual_seed(5)
    B, Ci, Co, H = 2, 4, 64, 8
    out = torch.zeros(B, Co, H, H, H, H, dtype=torch.float16, device=device)
    gamma = torch.rand(B, Ci, H, H, H, H, generator=g).to(device)
    mu = torch.randn(B, Ci, H, H, generator=g).to(device).requires_grad_(True)
    c = torch.rand(Co, generator=g).to(device)
    convcov.accumulate(out.clone(), gamma, mu, c, 3, padding=1, backend=name)  # warm
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    got = convcov.accumulate(out, gamma, mu, c, 3, padding=1, backend=name)
    torch.cuda.synchronize()
    assert got.grad_fn is not None
    assert torch.cuda.max_memory_allocated() - before < out.nbytes // 4


def test_float32_gradients_close_to_float64():
    """Mixed dtypes: gradients come back in each input's own dtype, sums in float32."""
    case = Case(**GEOMETRIES[0], gamma_form="diag")
    want = case.grads("convcov", backend="numpy")
    args = [x.detach().float().requires_grad_(True) for x in case.leaves()]
    out = case.convcov(*args, backend="numpy")
    got = torch.autograd.grad((out * case.weights.float()).sum(), args)
    for a, b, x in zip(got, want, args):
        assert a.dtype == torch.float32 and a.shape == x.shape
        torch.testing.assert_close(a.double(), b, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------------------
# accumulate is an in-place op, as torch's own


def test_out_history_and_version_counter():
    case = Case(**TINY)
    y = case.out0.detach().clone().requires_grad_(True)
    out = y * 3  # out has a history: its old value's gradient must reach y
    version = out._version
    convcov.accumulate(out, case.gamma, case.mu, case.c, case.k, backend="numpy")
    assert out._version == version + 1  # one in-place write
    assert type(out.grad_fn).__name__ != "MulBackward0"  # the history was rebased
    gy, gmu = torch.autograd.grad((out * case.weights).sum(), (y, case.mu))
    torch.testing.assert_close(gy, 3 * case.weights)
    want = case.grads("expr")[2]
    torch.testing.assert_close(gmu, want)


def test_version_counter_without_grad():
    """Also the direct path (nothing requires grad) counts its write, so autograd refuses
    a backward through a value that was overwritten."""
    case = Case(**TINY)
    for grad_mode in (True, False):
        out = torch.zeros(case.out_shape, dtype=F64)
        with torch.set_grad_enabled(grad_mode):
            convcov.accumulate(out, None, case.mu.detach(), 1.0, case.k, backend="numpy")
        assert out._version == 1
    y = torch.rand(case.out_shape, dtype=F64, requires_grad=True)
    z = y.exp()  # saves its result for the backward
    convcov.accumulate(z, None, case.mu.detach(), 1.0, case.k, backend="numpy")
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        z.sum().backward()


def test_refused_in_place_targets_are_left_unchanged():
    """torch's rules for the target of an in-place op, applied before anything is written
    (version counters included): a leaf that requires grad, a view of one, and the views
    torch does not let an in-place op modify, made by unbind or split (from a tensor
    autograd records, or from a plain one) or under no_grad. torch's messages."""
    case = Case(**TINY)
    args = (case.gamma, case.mu, case.c, case.k)
    leaf = torch.zeros(case.out_shape, dtype=F64, requires_grad=True)
    with pytest.raises(RuntimeError, match="^a leaf Variable that requires grad is being "
                                           "used in an in-place operation"):
        convcov.accumulate(leaf, *args, backend="numpy")
    with pytest.raises(RuntimeError, match="a view of a leaf Variable that requires grad"):
        convcov.accumulate(leaf[:], *args, backend="numpy")
    assert not leaf.detach().any() and leaf._version == 0
    recorded = torch.zeros((2, *case.out_shape), dtype=F64, requires_grad=True) * 1
    base = torch.zeros((2, *case.out_shape), dtype=F64)
    with torch.no_grad():
        no_grad_views = (base[0], recorded[0])
    views = (recorded.unbind(0)[0], recorded.split(1)[0].squeeze(0), base.unbind(0)[0],
             base.split(1)[0][0], *no_grad_views)
    for view in views:
        with pytest.raises(RuntimeError, match="modified inplace|in an in-place operation"):
            convcov.accumulate(view, *args, backend="numpy")
    for t in (recorded, base):
        assert not t.detach().any() and t._version == 0
    with torch.no_grad():  # allowed there, as for torch's own in-place ops
        convcov.accumulate(leaf, *args, backend="numpy")
    assert leaf.detach().abs().sum() > 0 and leaf.grad_fn is None


def test_view_of_a_larger_tensor():
    case = Case(**TINY, gamma_form="diag")
    B, Co, Ho, Wo = case.B, case.Co, case.Ho, case.Wo
    base0 = torch.randn(B, 2 * Co, Ho, Wo, Ho, Wo, dtype=F64, requires_grad=True)
    base = base0.clone()
    view = base[:, 1::2]
    convcov.accumulate(view, case.gamma, case.mu, case.c, case.k, backend="numpy")
    weights = torch.randn_like(base)
    got = torch.autograd.grad((base * weights).sum(), [base0] + case.leaves()[1:])
    torch.testing.assert_close(got[0], weights)  # every element's old value: gradient 1
    out = case.expr(torch.zeros(case.out_shape, dtype=F64), case.gamma, case.mu, case.c)
    want = torch.autograd.grad((out * weights[:, 1::2]).sum(), case.leaves()[1:])
    for a, b in zip(got[1:], want):
        torch.testing.assert_close(a, b)


def test_errors_before_writing_on_the_autograd_path():
    case = Case(**TINY)
    out = case.out0.detach().clone()
    before = out.clone()
    with pytest.raises(ShapeError, match="c: expected"):
        convcov.accumulate(out, case.gamma, case.mu, torch.ones(5, requires_grad=True),
                           case.k)
    with pytest.raises(TypeError, match="one kind"):
        convcov.accumulate(out, case.gamma.detach().numpy(), case.mu, case.c, case.k)
    with pytest.raises(BackendError, match="unknown backend"):
        convcov.accumulate(out, case.gamma, case.mu, case.c, case.k, backend="nope")
    assert torch.equal(out, before) and out._version == 0 and not out.requires_grad


def test_no_grad_and_inference_mode_record_nothing():
    case = Case(**TINY)
    with torch.no_grad():
        out = convcov.accumulate(torch.zeros(case.out_shape, dtype=F64), case.gamma, case.mu,
                                 case.c, case.k, backend="numpy")
    with torch.inference_mode():
        out2 = convcov.accumulate(torch.zeros(case.out_shape, dtype=F64), case.gamma,
                                  case.mu, case.c, case.k, backend="numpy")
    assert not out.requires_grad and not out2.requires_grad
    torch.testing.assert_close(out, out2)


def test_direct_path_does_not_load_the_operators():
    """Torch calls that autograd does not record take the direct path: convcov.torch_ops
    (and its operator registration) is loaded only when needed."""
    code = textwrap.dedent("""
        import sys, torch, convcov
        mu = torch.ones(1, 1, 3, 3)
        convcov.accumulate(torch.zeros(1, 1, 2, 2, 2, 2), None, mu, 1.0, 2, backend="numpy")
        before = "convcov.torch_ops" in sys.modules
        convcov.accumulate(torch.zeros(1, 1, 2, 2, 2, 2), None, mu.requires_grad_(), 1.0, 2,
                           backend="numpy")
        loaded = "convcov.torch_ops" in sys.modules
        print(before, loaded, hasattr(torch.ops.convcov, "accumulate_"))
    """)
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    assert res.stdout.split() == ["False", "True", "True"]


# ---------------------------------------------------------------------------------------
# torch.compile, opcheck, CUDA graphs


class NoisyConv(torch.nn.Module):
    """A conv layer that propagates a mean and a covariance, with learnable weight noise."""

    def __init__(self, Ci, Co, groups):
        super().__init__()
        self.conv = torch.nn.Conv2d(Ci, Co, 3, padding=1, groups=groups, dtype=F64)
        self.log_c = torch.nn.Parameter(torch.full((Co,), -2.0, dtype=F64))

    def forward(self, x, gamma):
        mu = torch.tanh(x)
        cov = convcov.nn.weight_noise_covariance(self.conv, mu, gamma, c=self.log_c.exp())
        S = convcov.patch_moment(gamma, mu, 3, padding=1, groups=self.conv.groups)
        return self.conv(mu).square().mean() + cov.mean() + S.square().mean()


def test_torch_compile_fullgraph_forward_and_backward():
    """One compiled graph (fullgraph: a graph break is an error) with both operators,
    forward and backward, equal to eager. Automatic backend choice: the backward runs on a
    backend that has one even when the forward's backend has none."""
    torch.manual_seed(0)
    model = NoisyConv(4, 4, 2)
    x = torch.randn(2, 4, 5, 5, dtype=F64, requires_grad=True)
    gamma = torch.rand(2, 4, 5, 5, 5, 5, dtype=F64, requires_grad=True)
    leaves = [x, gamma, model.log_c, model.conv.weight]

    want_loss = model(x, gamma)
    want = torch.autograd.grad(want_loss, leaves)
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True)
    loss = compiled(x, gamma)
    got = torch.autograd.grad(loss, leaves)
    torch.testing.assert_close(loss, want_loss, rtol=1e-12, atol=1e-12)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("full_out", [False, True], ids=["diag_out", "full_out"])
@pytest.mark.parametrize("c_form", ["number", "1d"])
def test_torch_compile_mutates_a_graph_input(full_out, c_form):
    """``out`` passed into the compiled function, with a history: the mutation (torch's
    in-place op on out's diagonal view) and the gradient of its old value survive
    compilation (AOTAutograd, no code generation)."""
    case = Case(**GEOMETRIES[0], full_out=full_out, gamma_form="diag", c_form=c_form)

    def f(out, gamma, mu, c):
        convcov.accumulate(out, gamma, mu, c, case.k, backend="numpy", **case.conv)
        return (out * case.weights).sum()

    def run(fn):
        out = case.out0 * 2
        loss = fn(out, case.gamma, case.mu, case.c)
        return [out.detach()] + list(torch.autograd.grad(loss, case.leaves()))

    torch._dynamo.reset()
    got = run(torch.compile(f, fullgraph=True, backend="aot_eager"))
    for a, b in zip(got, run(f)):
        torch.testing.assert_close(a, b)


def test_errors_under_the_compiler():
    """docs/autograd.md, "Errors under the compiler": a bad tensor raises our ShapeError
    when compiled, whether autograd records the call or not; a bad non-tensor c raises
    our TypeError without fullgraph, and with it Dynamo's own error, which carries our
    message. out is unchanged each time."""
    case = Case(**GEOMETRIES[0], gamma_form="diag")
    gamma, mu = case.gamma.detach(), case.mu.detach()
    out = torch.zeros(case.out_shape, dtype=F64)

    def f(out, c):
        return convcov.accumulate(out, gamma, mu, c, case.k, backend="numpy", **case.conv)

    # (Which check names the str first depends on whether the operators are loaded yet.)
    message = r"c: expected .*got (builtins\.str|'bad')"
    for bad_c, backend in ((torch.ones(1, 1, dtype=F64), "eager"),
                           (torch.ones(1, 1, dtype=F64, requires_grad=True), "aot_eager")):
        torch._dynamo.reset()
        with pytest.raises(ShapeError, match=r"c: expected .* got shape \(1, 1\)"):
            torch.compile(f, fullgraph=True, backend=backend)(out, bad_c)
    torch._dynamo.reset()
    with pytest.raises(TypeError, match=message):
        torch.compile(f, backend="eager")(out, "bad")
    torch._dynamo.reset()
    with pytest.raises(Exception) as caught:
        torch.compile(f, fullgraph=True, backend="eager")(out, "bad")
    assert re.search(message, str(caught.value)), caught.value
    assert not out.any()


def test_traced_without_grad():
    """Inference code is traced too: under Dynamo (no grad anywhere) and by make_fx with
    fake tensors, the calls become the operators, never a graph break or a data pointer."""
    case = Case(**GEOMETRIES[0], gamma_form="diag")
    gamma, mu, c = (x.detach() for x in (case.gamma, case.mu, case.c))

    def f(gamma, mu, c):
        out = torch.zeros(case.out_shape, dtype=F64)
        convcov.accumulate(out, gamma, mu, c, case.k, backend="numpy", **case.conv)
        return out + convcov.patch_moment(gamma, mu, case.k, backend="numpy",
                                          **case.conv).sum()

    want = f(gamma, mu, c)
    torch._dynamo.reset()
    with torch.no_grad():
        got = torch.compile(f, fullgraph=True, backend="eager")(gamma, mu, c)
    torch.testing.assert_close(got, want)
    from torch.fx.experimental.proxy_tensor import make_fx

    graph = make_fx(f, tracing_mode="fake")(gamma, mu, c)
    targets = {str(n.target) for n in graph.graph.nodes}
    assert {"convcov.accumulate_.default", "convcov.patch_moment.default"} <= targets
    torch.testing.assert_close(graph(gamma, mu, c), want)


def test_operator_counts_its_write():
    """Called directly (as compiled graphs call it), accumulate_ bumps out's version."""
    case = Case(**TINY)
    out = torch.zeros(case.out_shape, dtype=F64)
    with torch.no_grad():
        torch.ops.convcov.accumulate_(out, None, case.mu, None, 1.0, [*case.k], [1, 1],
                                      [0, 0], [1, 1], 1, "numpy")
    assert out._version == 1 and out.abs().sum() > 0


def test_opcheck(vjp_backend):
    name, device = vjp_backend
    case = Case(**GEOMETRIES[0], full_out=True, gamma_form="full", device=device)
    conv = ([*case.k], [*case.stride], [*case.padding], [*case.dilation], case.G, name)
    ops = torch.ops.convcov
    out = torch.zeros(case.out_shape, dtype=F64, device=device)
    grad_S = torch.randn(case.B, case.G, case.Ho, case.Wo, case.Ho, case.Wo, dtype=F64,
                         device=device)
    gamma_diag = case.gamma.detach()[:, :, :, :, 0].clone().requires_grad_(True)
    for op, args in [
        (ops.patch_moment.default, (case.gamma, case.mu, *conv)),
        (ops.patch_moment.default, (None, case.mu, *conv)),
        (ops.patch_moment.default, (case.gamma.float(), case.mu.float(), *conv, True)),
        (ops.accumulate_.default, (out.clone(), case.gamma, case.mu, case.c, 0.0, *conv)),
        (ops.accumulate_.default, (out[:, :, :, :, 0].clone(), gamma_diag, case.mu, None,
                                   0.5, *conv)),
        (ops.patch_moment_vjp.default, (grad_S, case.mu.detach(), 7, F64, True, *conv)),
        (ops.patch_moment_vjp.default, (grad_S, case.mu.detach(), 6, F64, False, *conv)),
    ]:
        torch.library.opcheck(op, args)


@pytest.mark.gpu
@pytest.mark.parametrize("gamma_form", ["diag", "full"])
def test_cuda_graph_capture(vjp_backend, gamma_form):
    """Forward and backward captured in a CUDA graph (no synchronisation, scratch only from
    torch's allocator) and replayed on new data: the same as eager. Every GPU backend with
    a backward is covered here; the backend test files do not repeat it."""
    name, device = vjp_backend
    if device != "cuda":
        pytest.skip("CUDA graphs need a CUDA backend")
    case = Case(**GEOMETRIES[0], gamma_form=gamma_form, device=device)
    gamma, mu, c = (x.detach().clone().requires_grad_(True)
                    for x in (case.gamma, case.mu, case.c))
    out = torch.zeros(case.out_shape, dtype=F64, device=device)

    def step():
        o = out.clone()
        convcov.accumulate(o, gamma, mu, c, case.k, backend=name, **case.conv)
        return (o.detach(),) + torch.autograd.grad((o * case.weights).sum(), (gamma, mu, c))

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static = step()
    with torch.no_grad():
        for x in (gamma, mu, c):
            x.copy_(torch.rand_like(x))
    graph.replay()
    torch.cuda.synchronize()
    for a, b in zip(static, step()):
        torch.testing.assert_close(a, b)


# ---------------------------------------------------------------------------------------
# The backward's front end


def test_patch_moment_vjp_numpy_arrays():
    """The backward entry works on any array kind (here numpy, float32): full-layout
    grad_gamma gets its channel-diagonal written and nothing else."""
    case = Case(**GEOMETRIES[0], gamma_form="full")
    S = torch_expr.patch_moment(case.gamma, case.mu, *case.k, case.stride, case.padding,
                                case.dilation, case.G)
    grad_S = torch.randn_like(S)
    want_gamma, want_mu = torch.autograd.grad((S * grad_S).sum(), (case.gamma, case.mu))
    grad_gamma = np.full(case.gamma.shape, 7.0, np.float32)
    grad_mu = np.empty(case.mu.shape, np.float32)
    T = grad_S.numpy().astype(np.float32).transpose(0, 1, 4, 5, 2, 3).copy()
    _frontend.patch_moment_vjp(T.transpose(0, 1, 4, 5, 2, 3), case.mu.detach().numpy(),
                               case.k, grad_gamma=grad_gamma, grad_mu=grad_mu,
                               backend="numpy", **case.conv)
    diag = np.zeros(grad_gamma.shape, bool)
    for ci in range(case.Ci):
        diag[:, ci, :, :, ci] = True
    np.testing.assert_array_equal(grad_gamma[~diag], 7.0)
    np.testing.assert_allclose(grad_gamma[diag], want_gamma.numpy()[diag], rtol=1e-5,
                               atol=1e-5)
    np.testing.assert_allclose(grad_mu, want_mu.numpy(), rtol=1e-5, atol=1e-5)


def test_patch_moment_vjp_checks():
    mu = np.ones((1, 2, 4, 4))
    grad_S = np.ones((1, 1, 3, 3, 3, 3))
    vjp = _frontend.patch_moment_vjp
    with pytest.raises(ShapeError, match=r"grad_S: expected shape \(B, G, Ho, Wo, Ho, Wo\)"):
        vjp(grad_S[:, :, :2], mu, 2, grad_mu=np.empty_like(mu))
    with pytest.raises(ShapeError, match="grad_mu: expected shape"):
        vjp(grad_S, mu, 2, grad_mu=np.empty((1, 2, 4, 5)))
    with pytest.raises(ShapeError, match="grad_gamma: expected 7 dims"):
        vjp(grad_S, mu, 2, grad_gamma=np.empty((1, 2, 4, 4)))
    ro = np.empty_like(mu)
    ro.flags.writeable = False
    with pytest.raises(ValueError, match="grad_mu: is read-only"):
        vjp(grad_S, mu, 2, grad_mu=ro)
    with pytest.raises(ValueError, match="grad_mu: shares memory with mu"):
        vjp(grad_S, mu, 2, grad_mu=mu)
    with pytest.raises(TypeError, match="one kind"):
        vjp(torch.from_numpy(grad_S), mu, 2, grad_mu=np.empty_like(mu))


class ForwardOnly(Backend):
    """The numpy forward, no backward: what a backend looks like before it has one."""

    name, device = "forward_only", "cpu"

    def accumulate(self, problem):
        _registry.get("numpy").accumulate(problem)


@pytest.fixture
def forward_only():
    convcov.register_backend(ForwardOnly())
    yield "forward_only"
    _registry.unregister("forward_only")


def test_backend_without_backward(forward_only, monkeypatch):
    monkeypatch.delenv("CONVCOV_BACKEND", raising=False)
    case = Case(**TINY)
    out = case.convcov(case.out0, case.gamma, case.mu, case.c, backend=forward_only)
    with pytest.raises(BackendError, match="forward_only: has no backward"):
        out.sum().backward()
    with pytest.raises(BackendError, match="'forward_only' has no backward"):
        ForwardOnly().patch_moment_vjp(None)
    # In a preference list the backward goes to the next backend that has one.
    monkeypatch.setenv("CONVCOV_BACKEND", f"{forward_only},numpy")
    got = case.grads("convcov")
    for a, b in zip(got, case.grads("expr")):
        torch.testing.assert_close(a, b)


# ---------------------------------------------------------------------------------------
# convcov.nn


CONVS = [
    dict(in_channels=4, out_channels=6, kernel_size=(3, 2), stride=(2, 1), padding=(1, 0),
         dilation=(1, 2), groups=2),
    dict(in_channels=2, out_channels=3, kernel_size=3, padding="same", dilation=2),
    dict(in_channels=2, out_channels=2, kernel_size=2, padding="valid"),
]


@pytest.mark.parametrize("kw", CONVS, ids=["tuples", "same", "valid"])
@pytest.mark.parametrize("layout", ["diag", "full"])
def test_nn_helper_reads_the_layer(kw, layout):
    conv = torch.nn.Conv2d(**kw, dtype=F64)
    mu = torch.randn(2, kw["in_channels"], 6, 7, dtype=F64, requires_grad=True)
    gamma = torch.rand(2, kw["in_channels"], 6, 7, 6, 7, dtype=F64)
    got = convcov.nn.weight_noise_covariance(conv, mu, gamma, c=0.3, layout=layout,
                                             backend="numpy")
    y = conv(mu)  # the layer's own output size and channels
    Co, Ho, Wo = y.shape[1:]
    want_shape = (2, Co, Ho, Wo, Ho, Wo) if layout == "diag" else (2, Co, Ho, Wo, Co, Ho, Wo)
    assert got.shape == want_shape and got.dtype == F64
    p = convcov.nn.conv_params(conv)
    want = torch_expr.accumulate(torch.zeros(want_shape, dtype=F64), gamma, mu, 0.3,
                                 *p["kernel_size"][2:], p["stride"], p["padding"],
                                 p["dilation"], p["groups"])
    torch.testing.assert_close(got, want)
    g_got, = torch.autograd.grad(got.sum(), mu)
    g_want, = torch.autograd.grad(want.sum(), mu)
    torch.testing.assert_close(g_got, g_want)


def test_nn_helper_into_given_out_and_checks_channels():
    conv = torch.nn.Conv2d(2, 4, 3, padding=1)
    mu = torch.rand(1, 2, 4, 4)
    out = torch.ones(1, 4, 4, 4, 4, 4)
    assert convcov.nn.weight_noise_covariance(conv, mu, c=0.0, out=out) is out
    assert torch.equal(out, torch.ones_like(out))
    with pytest.raises(ShapeError, match="kernel_size: weight shape"):
        convcov.nn.weight_noise_covariance(conv, mu, c=1.0, out=torch.zeros(1, 3, 4, 4, 4, 4))
    with pytest.raises(ShapeError, match="kernel_size: weight shape"):
        convcov.nn.weight_noise_covariance(conv, torch.rand(1, 3, 4, 4), c=1.0)


def test_nn_helper_refuses_what_convcov_does_not_model():
    with pytest.raises(ValueError, match="padding_mode: convcov models zero padding only"):
        convcov.nn.conv_params(torch.nn.Conv2d(2, 2, 3, padding=1, padding_mode="reflect"))
    with pytest.raises(ValueError, match="pads one side more than the other"):
        convcov.nn.conv_params(torch.nn.Conv2d(2, 2, 2, padding="same"))
    with pytest.raises(TypeError, match="expected a 2-D convolution"):
        convcov.nn.conv_params(torch.nn.Conv1d(2, 2, 3))
    with pytest.raises(TypeError, match="expected a torch.nn.Conv2d"):
        convcov.nn.conv_params(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="layout: expected"):
        convcov.nn.weight_noise_covariance(torch.nn.Conv2d(1, 1, 1), torch.rand(1, 1, 2, 2),
                                           c=1.0, layout="packed")


def test_absent_terms_stay_absent_in_the_backward():
    check_absent_terms_in_the_backward("numpy")
