"""convcov as PyTorch operators: exact gradients, torch.compile without graph breaks.

Owns three operators in the ``convcov`` namespace, all made with ``torch.library``'s
public API (``custom_op``, ``register_fake``, ``register_autograd``), and the torch side
of ``convcov.accumulate`` / ``convcov.patch_moment`` for the calls the front end routes
here (autograd records them, or a tracer looks at them). docs/autograd.md has the math
and the contract.

* ``convcov::patch_moment(gamma?, mu, ..., wide) -> S``: functional; its autograd
  formula's backward is ``convcov::patch_moment_vjp``.
* ``convcov::patch_moment_vjp(grad_S, mu, ...) -> (grad_gamma, grad_mu)``: functional,
  the backend's own backward (``Backend.patch_moment_vjp``); first-order, no formula.
* ``convcov::accumulate_(out!, gamma?, mu, c?, c_value, ...) -> ()``: mutates ``out`` with
  the backend's fused kernel. No autograd formula (torch.library gives none to operators
  that mutate), so it serves the calls autograd does not record.

A call that autograd records runs as ``S = convcov::patch_moment(gamma, mu)`` and then
torch's own in-place op on ``out``'s channel-diagonal, grouped as ``(B, G, Co // G, ...)``:
``addcmul_(S[:, :, None], c)`` with ``S`` and ``c`` broadcast, so nothing of out's size
is allocated (except by torch's host kernels for a 16-bit ``out``, which compute through
a float32 copy of it). torch then does all the in-place bookkeeping, before anything is
written: the version counter, the new history of ``out`` (through ``CopySlices`` for a
view), the refusal of leaves and of views torch does not let in-place ops modify; and its
formula gives the gradients of ``out``'s old value, of ``c`` and of ``S`` (through which
``convcov::patch_moment``'s formula gives those of ``gamma`` and ``mu``). ``S`` and ``c``
are in the dtype the fused kernel sums in, so torch's type promotion runs the add in that
dtype and rounds once into ``out``'s.

Every operator has a fake kernel (shapes and dtypes only), so ``torch.compile`` puts each
in the graph as one node, and the rest is torch code the compiler traces. The kernels
allocate through torch and never synchronise: the calls can be captured in CUDA graphs.

The front end (``convcov._frontend``) imports this module on the first torch call that
needs it; importing it imports torch. The wrappers here are what Dynamo traces: no data
pointers, no numpy, no backend selection (the kernels do that, through the front end).
"""

import numbers

import torch

from . import _frontend, _registry
from ._errors import ShapeError

_PARAMS = ("int[2] kernel_size, int[2] stride, int[2] padding, int[2] dilation, int groups, "
           "str? backend")
_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _out_size(n, k, s, p, d):
    return (n + 2 * p - d * (k - 1) - 1) // s + 1


def _acc(*tensors) -> torch.dtype:
    """The dtype sums accumulate in: float64 when any input is float64, else float32."""
    f64 = any(t is not None and t.dtype == torch.float64 for t in tensors)
    return torch.float64 if f64 else torch.float32


def _backend_arg(backend):
    """The ``backend=`` argument as the operators' ``str?``: a comma-separated list."""
    if backend is None or isinstance(backend, str):
        return backend
    if isinstance(backend, (list, tuple)) and all(isinstance(b, str) for b in backend):
        return ",".join(backend)
    raise TypeError(f"backend=: expected a backend name or a list of names; got {backend!r}")


def _params(kernel_size, stride, padding, dilation, groups, Co, Ci):
    """Conv parameters as the operators take them; checks a 4-item weight shape."""
    G, k, weight, s, p, d = _frontend.conv_params(kernel_size, stride, padding, dilation,
                                                  groups)
    if weight is not None and Co is not None and tuple(weight) != (Co, Ci // G):
        raise ShapeError(f"kernel_size: weight shape expected (Co, Ci // groups, kh, kw) = "
                         f"{(Co, Ci // G, *k)}; got {(*weight, *k)}")
    return list(k), list(s), list(p), list(d), G


# ---------------------------------------------------------------------------------------
# convcov::patch_moment and its backward.


@torch.library.custom_op(
    "convcov::patch_moment", mutates_args=(),
    schema="(Tensor? gamma, Tensor mu, " + _PARAMS + ", bool wide=False) -> Tensor")
def _patch_moment(gamma, mu, kernel_size, stride, padding, dilation, groups, backend,
                  wide=False):
    """S; in float64 also when ``wide`` (an accumulate that sums in float64 for out's or
    c's sake, though gamma and mu are not float64)."""
    args = (gamma, mu, tuple(kernel_size), tuple(stride), tuple(padding), tuple(dilation),
            groups, backend)
    if not wide:
        return _frontend.patch_moment_unrouted(*args)
    shape, _, conv = _frontend.check_patch_moment(*args)
    # As patch_moment_unrouted, into float64 zeros: accumulate with one output channel per
    # group and c = 1, which sums in float64 because S is float64.
    S = torch.zeros(shape, dtype=torch.float64, device=mu.device)
    return _frontend.accumulate_unrouted(S, gamma, mu, 1.0, *conv, backend)


@_patch_moment.register_fake
def _patch_moment_fake(gamma, mu, kernel_size, stride, padding, dilation, groups, backend,
                       wide=False):
    if mu.dim() != 4:
        raise ShapeError(f"mu: expected 4 dims (B, Ci, H, W); got shape {tuple(mu.shape)}")
    B, _, H, W = mu.shape
    Ho = _out_size(H, kernel_size[0], stride[0], padding[0], dilation[0])
    Wo = _out_size(W, kernel_size[1], stride[1], padding[1], dilation[1])
    dtype = torch.float64 if wide else _acc(gamma, mu)
    return mu.new_empty((B, groups, Ho, Wo, Ho, Wo), dtype=dtype)


def _patch_moment_setup(ctx, inputs, output):
    gamma, mu, *conv = inputs
    ctx.conv = conv[:6]
    ctx.gamma_ndim = 0 if gamma is None else gamma.dim()
    ctx.gamma_dtype = mu.dtype if gamma is None else gamma.dtype
    ctx.save_for_backward(mu)


def _patch_moment_backward(ctx, grad_S):
    (mu,) = ctx.saved_tensors
    need_gamma, need_mu = ctx.needs_input_grad[:2]
    grad_gamma, grad_mu = _vjp(grad_S, mu, ctx.gamma_ndim if need_gamma else 0,
                               ctx.gamma_dtype, need_mu, ctx.conv)
    return grad_gamma, grad_mu, None, None, None, None, None, None, None


_patch_moment.register_autograd(_patch_moment_backward, setup_context=_patch_moment_setup)


@torch.library.custom_op(
    "convcov::patch_moment_vjp", mutates_args=(),
    schema="(Tensor grad_S, Tensor mu, int gamma_ndim, ScalarType gamma_dtype, bool need_mu, "
           + _PARAMS + ") -> (Tensor, Tensor)")
def _patch_moment_vjp(grad_S, mu, gamma_ndim, gamma_dtype, need_mu, kernel_size, stride,
                      padding, dilation, groups, backend):
    """(grad_gamma, grad_mu); an unwanted one (gamma_ndim 0, need_mu False) is empty."""
    grad_gamma, grad_mu = _vjp_buffers(mu, gamma_ndim, gamma_dtype, need_mu)
    _frontend.patch_moment_vjp(
        grad_S, mu, tuple(kernel_size), grad_gamma=grad_gamma if gamma_ndim else None,
        grad_mu=grad_mu if need_mu else None, stride=tuple(stride), padding=tuple(padding),
        dilation=tuple(dilation), groups=groups, backend=backend)
    return grad_gamma, grad_mu


def _vjp_buffers(mu, gamma_ndim, gamma_dtype, need_mu):
    """The gradients' buffers: the backend overwrites every element of a diagonal-layout
    grad_gamma and of grad_mu (so: empty), only the channel-diagonal of a full one (zeros)."""
    B, Ci, H, W = mu.shape
    if gamma_ndim == 7:
        grad_gamma = mu.new_zeros((B, Ci, H, W, Ci, H, W), dtype=gamma_dtype)
    elif gamma_ndim == 6:
        grad_gamma = mu.new_empty((B, Ci, H, W, H, W), dtype=gamma_dtype)
    else:
        grad_gamma = mu.new_empty((0,), dtype=gamma_dtype)
    grad_mu = mu.new_empty((B, Ci, H, W) if need_mu else (0,))
    return grad_gamma, grad_mu


@_patch_moment_vjp.register_fake
def _patch_moment_vjp_fake(grad_S, mu, gamma_ndim, gamma_dtype, need_mu, *conv):
    return _vjp_buffers(mu, gamma_ndim, gamma_dtype, need_mu)


def _vjp(grad_S, mu, gamma_ndim, gamma_dtype, need_mu, conv):
    """The gradients of gamma and mu from grad_S; None where not wanted."""
    if not gamma_ndim and not need_mu:
        return None, None
    grad_gamma, grad_mu = torch.ops.convcov.patch_moment_vjp(grad_S, mu, gamma_ndim,
                                                             gamma_dtype, need_mu, *conv)
    return grad_gamma if gamma_ndim else None, grad_mu if need_mu else None


# ---------------------------------------------------------------------------------------
# convcov::accumulate_: the fused kernel, for calls autograd does not record.


@torch.library.custom_op(
    "convcov::accumulate_", mutates_args=("out",),
    schema="(Tensor(a!) out, Tensor? gamma, Tensor mu, Tensor? c, float c_value, "
           + _PARAMS + ") -> ()")
def _accumulate(out, gamma, mu, c, c_value, kernel_size, stride, padding, dilation, groups,
                backend):
    _frontend.accumulate_unrouted(out, gamma, mu, c_value if c is None else c,
                                  tuple(kernel_size), tuple(stride), tuple(padding),
                                  tuple(dilation), groups, backend)


@_accumulate.register_fake
def _accumulate_fake(out, gamma, mu, c, c_value, *conv):
    return None


# ---------------------------------------------------------------------------------------
# The autograd path: S, then torch's in-place op on out's channel-diagonal.


def _add_term(out, S, c, c_value, G):
    """``out[b, c0, p, (c0,) q] += c[c0] * S[b, g(c0), p, q]`` as one in-place torch op on
    a view of ``out``, with ``S`` and ``c`` broadcast (no temporary of out's size)."""
    d = out.diagonal(0, 1, 4).movedim(-1, 1) if out.dim() == 7 else out  # (B, Co, Ho, ..)
    Co = d.shape[1]
    if G == 1 or G == Co:  # S's group axis broadcasts as it is: out itself, when diagonal
        S_b, c_shape = S, (1, Co, 1, 1, 1, 1)
    else:
        d, S_b, c_shape = d.unflatten(1, (G, Co // G)), S.unsqueeze(2), (1, G, Co // G,
                                                                          1, 1, 1, 1)
    # c in S's dtype, with dimensions: torch's type promotion then runs the add, and its
    # backward's products with the gradient of a 16-bit out, in S's dtype (a number, or
    # a 0-d tensor, would leave them in out's dtype).
    if c is None:
        c = S.new_full((1,) * d.dim(), c_value)
    else:
        c = c.to(S.dtype).reshape(c_shape if c.dim() else (1,) * d.dim())
    d.addcmul_(S_b, c)


def _wide(out, gamma, mu, c, c_value) -> bool:
    """Whether the fused kernel would sum in float64 (as ``normalise`` decides): a float64
    array, or a number c that float32 would turn into Inf or lose digits of."""
    if _acc(out, gamma, mu, c) == torch.float64:
        return True
    a = abs(c_value)
    return _frontend._F32_MAX < a < float("inf") or 0 < a < _frontend._F32_TINY


def _fits(out, gamma, mu, c, k, s, p, d, G) -> bool:
    """Whether a traced call's shapes, dtypes and devices are those the autograd path's
    torch code expects (the checks of ``normalise`` that read no data, on out and c)."""
    B, Ci, H, W = mu.shape
    Ho, Wo = _out_size(H, k[0], s[0], p[0], d[0]), _out_size(W, k[1], s[1], p[1], d[1])
    Co = out.shape[1]
    want = (B, Co, Ho, Wo, Co, Ho, Wo) if out.dim() == 7 else (B, Co, Ho, Wo, Ho, Wo)
    tensors = [t for t in (out, gamma, mu, c) if isinstance(t, torch.Tensor)]
    return (Ho >= 1 and Wo >= 1 and tuple(out.shape) == want and Co % G == 0
            and Ci % G == 0 and (c is None or tuple(c.shape) in ((), (Co,)))
            and all(t.dtype in _FLOATS and t.device == mu.device for t in tensors))


# ---------------------------------------------------------------------------------------
# What convcov.accumulate / convcov.patch_moment call for routed torch tensors.


def _eager(mu) -> bool:
    """Plain tensors outside a tracer: their data can be looked at (tracers' fake tensors
    cannot; the kernels check those calls when they run)."""
    return (not torch.compiler.is_compiling()
            and (type(mu) is torch.Tensor or type(mu) is torch.nn.Parameter))


def _check_routed(out, gamma, mu, c):
    """The checks that read no data, for calls whose tensors cannot be looked at (tensor
    subclasses, and any tensor while torch.compile traces): the arguments' kinds, c's
    type and the ranks the operator's arguments are taken from. The kernel checks the
    rest when it runs (the direct path's checks, on the real tensors)."""
    T = torch.Tensor
    arrays = [("out", out)] + ([] if gamma is None else [("gamma", gamma)])
    number = isinstance(c, numbers.Real) and not isinstance(c, bool)
    if not (number or isinstance(c, T)):
        if isinstance(c, bool) or not any(hasattr(c, a) for a in (
                "__array__", "__array_interface__", "__cuda_array_interface__")):
            raise TypeError(f"c: expected a real number or a float tensor; got {c!r}")
        arrays.append(("c", c))  # an array of another kind
    bad = [(n, x) for n, x in arrays if not isinstance(x, T)]
    if bad:
        got = ", ".join(f"{n}: {type(x).__module__}.{type(x).__qualname__}" for n, x in bad)
        raise TypeError(f"all arrays must be of one kind on one device; mu is a torch "
                        f"tensor, got {got}")
    if out.dim() not in (6, 7):
        raise ShapeError(f"out: expected 7 dims (B, Co, Ho, Wo, Co, Ho, Wo) or 6 dims "
                         f"(B, Co, Ho, Wo, Ho, Wo); got shape {tuple(out.shape)}")
    if mu.dim() != 4:
        raise ShapeError(f"mu: expected 4 dims (B, Ci, H, W); got shape {tuple(mu.shape)}")


def accumulate(out, gamma, mu, c, kernel_size, stride, padding, dilation, groups, backend,
               problem=None):
    """``convcov.accumulate`` on routed torch tensors; returns ``out``. ``problem``: the
    call as the front end validated it (its backend selected), when it did."""
    eager = _eager(mu)
    if eager and problem is None:  # the direct path's checks and errors, before anything
        problem = _frontend.normalise(out, gamma, mu, c, kernel_size, stride, padding,
                                      dilation, groups)
        _registry.select(backend, problem.device[0], _frontend._dtypes(problem))
    else:
        _check_routed(out, gamma, mu, c)
    k, s, p, d, G = _params(kernel_size, stride, padding, dilation, groups,
                            out.shape[1], mu.shape[1])
    if eager:  # the checked parameters: a stride or dilation that cannot matter made small
        s, d = [problem.sh, problem.sw], [problem.dh, problem.dw]
    c, c_value = (c, 0.0) if isinstance(c, torch.Tensor) else (None, _frontend.c_float(c))
    backend = _backend_arg(backend)
    records = torch.is_grad_enabled() and (
        out.requires_grad or mu.requires_grad or (gamma is not None and gamma.requires_grad)
        or (c is not None and c.requires_grad))
    # A traced call that does not fit goes to the kernel, whose checks raise convcov's
    # error when the graph runs, before anything is written (the torch code below would
    # fail while tracing, with torch's error).
    if records and (eager or _fits(out, gamma, mu, c, k, s, p, d, G)):
        if out.requires_grad and out.is_leaf:
            # torch refuses it too, but names the view the op below works on, and only
            # after S is computed. (A view made in no_grad mode of a tensor that requires
            # grad looks like such a leaf, and torch refuses it as well.)
            raise RuntimeError("a leaf Variable that requires grad is being used in an "
                               "in-place operation (out, or a view of a tensor that "
                               "requires grad made in no_grad mode, which autograd takes "
                               "for one).")
        wide = problem.acc == "float64" if eager else _wide(out, gamma, mu, c, c_value)
        S = torch.ops.convcov.patch_moment(gamma, mu, k, s, p, d, G, backend, wide)
        _add_term(out, S, c, c_value, G)
    else:
        torch.ops.convcov.accumulate_(out, gamma, mu, c, c_value, k, s, p, d, G, backend)
    return out


def patch_moment(gamma, mu, kernel_size, stride, padding, dilation, groups, backend):
    """``convcov.patch_moment`` as ``convcov::patch_moment``."""
    k, s, p, d, G = _params(kernel_size, stride, padding, dilation, groups, None, None)
    if _eager(mu):  # checked; a stride or dilation that cannot matter made small
        _, _, (_, s, _, d, _) = _frontend.check_patch_moment(
            gamma, mu, kernel_size, stride, padding, dilation, groups, backend)
        s, d = list(s), list(d)
    return torch.ops.convcov.patch_moment(gamma, mu, k, s, p, d, G, _backend_arg(backend))
