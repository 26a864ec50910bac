"""convcov as PyTorch operators: exact gradients, torch.compile without graph breaks.

Owns three operators in the ``convcov`` namespace of ``torch.library`` and their autograd
(docs/autograd.md has the math and the contract):

* ``convcov::patch_moment(gamma?, mu, ...) -> S``: functional. Its backward is
  ``convcov::patch_moment_vjp``.
* ``convcov::patch_moment_vjp(grad_S, mu, ...) -> (grad_gamma, grad_mu)``: functional, the
  backend's own backward (``Backend.patch_moment_vjp``). First-order: it has no backward.
* ``convcov::accumulate_(out!, gamma?, mu, c?, c_value, ...) -> ()``: in place, with the
  fused forward kernel. ``torch.library`` gives mutable operators no autograd formula, so
  this one is registered by hand, the way torch's own in-place ops are: an
  ``ADInplaceOrView`` kernel bumps ``out``'s version counter, and an ``Autograd`` kernel
  checks ``out`` as torch checks the target of an in-place op (a leaf that requires grad
  is refused before anything is written), then runs the kernel inside an
  ``autograd.Function`` that marks ``out`` dirty, so ``out`` gets the new history (through
  ``CopySlices`` when it is a view) and its old value gets the incoming gradient
  unchanged. Its backward reduces the gradient of ``out``'s channel-diagonal over each
  group's output channels (torch matmuls: read once) into ``grad_S`` and hands that to
  ``convcov::patch_moment_vjp``. When ``c`` requires grad, the forward keeps ``S`` for
  ``dL/dc`` instead of fusing: ``patch_moment``, then ``out += c * S`` as the backend's 1x1
  problem whose "gamma" is ``S`` (docs/autograd.md, "What it costs").

Every operator has a fake kernel (shapes and dtypes only), so ``torch.compile`` puts each
call in the graph as one node, and the autograd formulas are plain torch code that
AOTAutograd traces into the backward graph. The kernels allocate through torch and never
synchronise: the calls can be captured in CUDA graphs.

The front end (``convcov._frontend``) imports this module on the first torch call that
needs it (grad recording or compiling); importing it imports torch. The wrappers here are
what Dynamo traces: no data pointers, no numpy, no backend selection (the kernels do that
at run time, through the ordinary front end).
"""

import numbers

import torch
from torch import _C

from . import _frontend, _registry
from ._errors import ShapeError

_PARAMS = ("int[2] kernel_size, int[2] stride, int[2] padding, int[2] dilation, int groups, "
           "str? backend")


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


@torch.library.custom_op("convcov::patch_moment", mutates_args=(),
                         schema="(Tensor? gamma, Tensor mu, " + _PARAMS + ") -> Tensor")
def _patch_moment(gamma, mu, kernel_size, stride, padding, dilation, groups, backend):
    return _frontend.patch_moment_unrouted(gamma, mu, tuple(kernel_size), tuple(stride),
                                           tuple(padding), tuple(dilation), groups, backend)


@_patch_moment.register_fake
def _patch_moment_fake(gamma, mu, kernel_size, stride, padding, dilation, groups, backend):
    if mu.dim() != 4:
        raise ShapeError(f"mu: expected 4 dims (B, Ci, H, W); got shape {tuple(mu.shape)}")
    B, _, H, W = mu.shape
    Ho = _out_size(H, kernel_size[0], stride[0], padding[0], dilation[0])
    Wo = _out_size(W, kernel_size[1], stride[1], padding[1], dilation[1])
    return mu.new_empty((B, groups, Ho, Wo, Ho, Wo), dtype=_acc(gamma, mu))


def _patch_moment_setup(ctx, inputs, output):
    gamma, mu, *conv = inputs
    ctx.conv = conv
    ctx.gamma_ndim = 0 if gamma is None else gamma.dim()
    ctx.gamma_dtype = mu.dtype if gamma is None else gamma.dtype
    ctx.save_for_backward(mu)


def _patch_moment_backward(ctx, grad_S):
    (mu,) = ctx.saved_tensors
    need_gamma, need_mu = ctx.needs_input_grad[:2]
    grad_gamma, grad_mu = _vjp(grad_S, mu, ctx.gamma_ndim if need_gamma else 0,
                               ctx.gamma_dtype, need_mu, ctx.conv)
    return grad_gamma, grad_mu, None, None, None, None, None, None


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
# convcov::accumulate_: a mutable operator with a hand-registered autograd kernel.

_lib = torch.library.Library("convcov", "FRAGMENT")
_lib.define("accumulate_(Tensor(a!) out, Tensor? gamma, Tensor mu, Tensor? c, float c_value, "
            + _PARAMS + ") -> ()", tags=(torch.Tag.pt2_compliant_tag,))
_accumulate_op = torch.ops.convcov.accumulate_.default


def _accumulate_kernel(out, gamma, mu, c, c_value, kernel_size, stride, padding, dilation,
                       groups, backend):
    _frontend.accumulate_unrouted(out, gamma, mu, c_value if c is None else c,
                                  tuple(kernel_size), tuple(stride), tuple(padding),
                                  tuple(dilation), groups, backend)


def _accumulate_fake(out, gamma, mu, c, c_value, kernel_size, stride, padding, dilation,
                     groups, backend):
    return None


def _accumulate_inplace_or_view(keyset, out, *args):
    torch.autograd.graph.increment_version(out)  # no-op for inference tensors
    return _accumulate_op.redispatch(keyset & _C._after_ADInplaceOrView_keyset, out, *args)


class _Conv:
    """The non-tensor arguments of one accumulate_ call, passed through autograd."""

    __slots__ = ("c_value", "conv", "keyset")

    def __init__(self, keyset, c_value, conv):
        self.keyset, self.c_value, self.conv = keyset, c_value, conv


class _Accumulate(torch.autograd.Function):
    """``out += c ⊙ S(gamma, mu)`` on the channel-diagonal, in place (see the module doc)."""

    @staticmethod
    def forward(ctx, out, gamma, mu, c, a: _Conv):
        need_gamma, need_mu, need_c = ctx.needs_input_grad[1:4]
        S = None
        with _C._AutoDispatchBelowAutograd():
            if need_c:
                # dL/dc needs S. Rather than recompute it in the backward (one more read
                # of gamma's diagonal, the largest array), the forward keeps it: S by the
                # backend, then out += c * S by the backend's own kernel, as the 1x1
                # problem whose "gamma" is S (one channel per group, mu = 0: S' = S
                # exactly). S is Co / G times smaller than out's diagonal.
                S = torch.ops.convcov.patch_moment(gamma, mu, *a.conv)
                B, G, Ho, Wo = S.shape[:4]
                _accumulate_op.redispatch(a.keyset, out, S, S.new_zeros((B, G, Ho, Wo)), c,
                                          a.c_value, [1, 1], [1, 1], [0, 0], [1, 1], G,
                                          a.conv[5])
            else:
                _accumulate_op.redispatch(a.keyset, out, gamma, mu, c, a.c_value, *a.conv)
        ctx.mark_dirty(out)
        ctx.a = a
        ctx.full_out = out.dim() == 7
        ctx.acc = _acc(out, gamma, mu, c)
        ctx.gamma_ndim = 0 if gamma is None else gamma.dim()
        ctx.gamma_dtype = mu.dtype if gamma is None else gamma.dtype
        # mu for its gradient, and for its shape and device.
        ctx.save_for_backward(S, mu, c if (need_gamma or need_mu or need_c) else None)
        return out

    @staticmethod
    def backward(ctx, grad):
        S, mu, c = ctx.saved_tensors
        _, need_gamma, need_mu, need_c, _ = ctx.needs_input_grad
        a, acc = ctx.a, ctx.acc
        grad_gamma = grad_mu = grad_c = None
        if need_gamma or need_mu or need_c:
            G = a.conv[4]
            # The gradient of out's channel-diagonal, grouped: (B, G, Co // G, Ho*Wo*Ho*Wo).
            d = grad.diagonal(dim1=1, dim2=4).movedim(-1, 1) if ctx.full_out else grad
            B, Co, Ho, Wo = d.shape[:4]
            grads = d.unflatten(1, (G, Co // G)).flatten(3).to(acc)
        if need_gamma or need_mu:
            # grad_S[b, g] = sum over c0 in g of c[c0] * grad[b, c0]: one read of grad.
            if c is None:
                grad_S = grads.sum(2) * a.c_value
            else:
                cg = c.to(acc).expand(Co).reshape(G, 1, Co // G)
                grad_S = torch.matmul(cg, grads).squeeze(2)
            grad_gamma, grad_mu = _vjp(grad_S.view(B, G, Ho, Wo, Ho, Wo), mu,
                                       ctx.gamma_ndim if need_gamma else 0, ctx.gamma_dtype,
                                       need_mu, a.conv)
        if need_c:
            # dL/dc[c0] = sum of grad[:, c0] * S[:, g(c0)], S kept by the forward.
            S = S.view(B, G, grads.shape[3], 1)
            per_c0 = torch.matmul(grads, S).sum(0).reshape(Co)
            grad_c = (per_c0 if c.dim() else per_c0.sum()).to(c.dtype)
        return grad, grad_gamma, grad_mu, grad_c, None


# Private, long-standing (torch's fake tensors use it); without it, torch itself still
# refuses such views, only after the kernel has written.
_creation_meta = getattr(_C._autograd, "_get_creation_meta", None)
_VIEW_KINDS = {"MULTI_OUTPUT_NODE": "by a function that returns several views (unbind, "
                                    "split, chunk, ...)",
               "NO_GRAD_MODE": "in no_grad mode", "INFERENCE_MODE": "in inference mode",
               "IN_CUSTOM_FUNCTION": "inside a custom autograd.Function"}


def _check_inplace(out):
    # torch's own checks for the target of an in-place op, made before the kernel writes.
    if out.requires_grad and out.is_leaf:
        raise RuntimeError("a leaf Variable that requires grad is being used in an in-place "
                           "operation.")
    if out._is_view():
        if out._base.requires_grad and out._base.is_leaf:
            raise RuntimeError("a view of a leaf Variable that requires grad is being used "
                               "in an in-place operation.")
        kind = _VIEW_KINDS.get(_creation_meta(out).name) if _creation_meta else None
        if kind:
            raise RuntimeError(f"out: a view created {kind} cannot be modified in place by "
                               f"an operation autograd records (torch's rule for in-place "
                               f"ops); pass a clone, or the base tensor")


def _accumulate_autograd(keyset, out, gamma, mu, c, c_value, *conv):
    below = keyset & _C._after_autograd_keyset
    if _C.is_grad_enabled() and _C._any_requires_grad(out, gamma, mu, c):
        _check_inplace(out)
        _Accumulate.apply(out, gamma, mu, c, _Conv(below, c_value, conv))
    else:
        with _C._AutoDispatchBelowAutograd():
            _accumulate_op.redispatch(below, out, gamma, mu, c, c_value, *conv)


_lib.impl("accumulate_", _accumulate_kernel, "CompositeExplicitAutograd")
torch.library.register_fake("convcov::accumulate_", _accumulate_fake, lib=_lib)
_lib.impl("accumulate_", _accumulate_inplace_or_view, "ADInplaceOrView", with_keyset=True)
_lib.impl("accumulate_", _accumulate_autograd, "Autograd", with_keyset=True)


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


def accumulate(out, gamma, mu, c, kernel_size, stride, padding, dilation, groups, backend):
    """``convcov.accumulate`` as ``convcov::accumulate_``; returns ``out``."""
    if _eager(mu):  # the direct path's checks and errors, before anything else
        problem = _frontend.normalise(out, gamma, mu, c, kernel_size, stride, padding,
                                      dilation, groups)
        _registry.select(backend, problem.device[0], _frontend._dtypes(problem))
    else:
        _check_routed(out, gamma, mu, c)
    k, s, p, d, G = _params(kernel_size, stride, padding, dilation, groups,
                            out.shape[1], mu.shape[1])
    c, c_value = (c, 0.0) if isinstance(c, torch.Tensor) else (None, _frontend.c_float(c))
    torch.ops.convcov.accumulate_(out, gamma, mu, c, c_value, k, s, p, d, G,
                                  _backend_arg(backend))
    return out


def patch_moment(gamma, mu, kernel_size, stride, padding, dilation, groups, backend):
    """``convcov.patch_moment`` as ``convcov::patch_moment``."""
    if _eager(mu):
        _frontend.check_patch_moment(gamma, mu, kernel_size, stride, padding, dilation, groups,
                                     backend)
    k, s, p, d, G = _params(kernel_size, stride, padding, dilation, groups, None, None)
    return torch.ops.convcov.patch_moment(gamma, mu, k, s, p, d, G, _backend_arg(backend))
