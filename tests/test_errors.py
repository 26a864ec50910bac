"""Bad input (SPEC section 3): the right exception, a message that names the argument and
what was expected, and ``out`` bit-identical afterwards."""

from __future__ import annotations

import numpy as np
import pytest

import convcov
from convcov import BackendError, ShapeError

from kinds import HAS_TORCH

B, Ci, Co, G, H, W, K = 2, 4, 6, 2, 5, 5, 3
Ho = Wo = 3


def good(dtype=np.float32):
    rng = np.random.default_rng(0)
    return dict(
        out=rng.standard_normal((B, Co, Ho, Wo, Co, Ho, Wo)).astype(dtype),
        gamma=rng.random((B, Ci, H, W, H, W)).astype(dtype),
        mu=rng.standard_normal((B, Ci, H, W)).astype(dtype),
        c=rng.random(Co).astype(dtype),
        kernel_size=K, groups=G,
    )


def call(args):
    a = dict(args)
    return convcov.accumulate(a.pop("out"), a.pop("gamma"), a.pop("mu"), a.pop("c"),
                              a.pop("kernel_size"), backend=a.pop("backend", "numpy"), **a)


def changed(**kw):
    a = good()
    a.update(kw)
    return a


CASES = [
    # (id, arguments, exception, words the message must contain)
    ("out ndim", changed(out=np.zeros((B, Co, Ho, Wo, Ho), np.float32)), ShapeError, ["out", "7 dims", "got shape"]),
    ("out Ho", changed(out=np.zeros((B, Co, Ho + 1, Wo, Co, Ho + 1, Wo), np.float32)), ShapeError, ["out", "expected shape", "(2, 6, 3, 3, 6, 3, 3)", "(2, 6, 4, 3, 6, 4, 3)"]),
    ("out batch", changed(out=np.zeros((B + 1, Co, Ho, Wo, Co, Ho, Wo), np.float32)), ShapeError, ["out", "expected shape"]),
    ("out Co mismatch", changed(out=np.zeros((B, Co, Ho, Wo, Co - 2, Ho, Wo), np.float32)), ShapeError, ["out", "expected shape"]),
    ("diag out Wo", changed(out=np.zeros((B, Co, Ho, Wo, Ho, Wo + 1), np.float32)), ShapeError, ["out", "(B, Co, Ho, Wo, Ho, Wo)"]),
    ("mu ndim", changed(mu=np.zeros((B, Ci, H), np.float32)), ShapeError, ["mu", "4 dims"]),
    ("gamma shape", changed(gamma=np.zeros((B, Ci, H, W, H, W + 1), np.float32)), ShapeError, ["gamma", "expected shape"]),
    ("gamma ndim", changed(gamma=np.zeros((B, Ci, H, W, H), np.float32)), ShapeError, ["gamma", "7 dims"]),
    ("gamma channels", changed(gamma=np.zeros((B, Ci, H, W, Ci + 1, H, W), np.float32)), ShapeError, ["gamma", "expected shape"]),
    ("Ci not divisible", changed(groups=4, mu=np.zeros((B, 6, H, W), np.float32), gamma=None, out=np.zeros((B, 8, Ho, Wo, 8, Ho, Wo), np.float32), c=1.0), ShapeError, ["groups", "Ci = 6"]),
    ("Co not divisible", changed(groups=4, mu=np.zeros((B, 4, H, W), np.float32), gamma=None), ShapeError, ["groups", "Co = 6"]),
    ("groups < 1", changed(groups=0), ShapeError, ["groups", ">= 1"]),
    ("c length", changed(c=np.ones(Co + 1, np.float32)), ShapeError, ["c", "(Co,) = (6,)", "(7,)"]),
    ("c 2-d", changed(c=np.ones((Co, 1), np.float32)), ShapeError, ["c", "(6, 1)"]),
    ("kernel 0", changed(kernel_size=0), ShapeError, ["kernel_size", ">= 1"]),
    ("kernel triple", changed(kernel_size=(3, 3, 3)), ShapeError, ["kernel_size", "pair"]),
    ("kernel too big", changed(kernel_size=7), ShapeError, ["mu", "smaller than the dilated kernel"]),
    ("weight shape Co", changed(kernel_size=(Co + 1, Ci // G, K, K)), ShapeError, ["kernel_size", "weight shape", "(6, 2, 3, 3)", "(7, 2, 3, 3)"]),
    ("weight shape Ci", changed(kernel_size=(Co, Ci, K, K)), ShapeError, ["kernel_size", "weight shape"]),
    ("stride 0", changed(stride=0), ShapeError, ["stride", ">= 1"]),
    ("dilation 0", changed(dilation=(1, 0)), ShapeError, ["dilation", ">= 1"]),
    ("padding < 0", changed(padding=-1), ShapeError, ["padding", ">= 0"]),
    ("stride float", changed(stride=1.5), TypeError, ["stride", "int"]),
    ("stride bool", changed(stride=True), TypeError, ["stride", "int"]),
    ("int mu", changed(mu=np.zeros((B, Ci, H, W), np.int32)), TypeError, ["mu", "dtype int32"]),
    ("bool gamma", changed(gamma=np.zeros((B, Ci, H, W, H, W), bool)), TypeError, ["gamma", "dtype bool"]),
    ("complex c", changed(c=np.ones(Co, np.complex64)), TypeError, ["c", "complex64"]),
    ("complex number c", changed(c=1j), TypeError, ["c", "real"]),
    ("bool c", changed(c=True), TypeError, ["c"]),
    ("list mu", changed(mu=[[1.0]]), TypeError, ["mu", "list"]),
    ("string c", changed(c="1"), TypeError, ["c", "str"]),
    ("unknown backend", changed(backend="fortran"), BackendError, ["fortran", "valid backends", "numpy", "numba"]),
    ("empty backend list", changed(backend=" , "), BackendError, ["empty"]),
]


def _assert_rejected(args, exc, words):
    out = args["out"]
    before = out.copy()
    with pytest.raises(exc) as info:
        call(args)
    for w in words:
        assert w in str(info.value), f"{w!r} not in message: {info.value}"
    np.testing.assert_array_equal(out, before)  # nothing written (NaN-free data)
    assert out.tobytes() == before.tobytes()


@pytest.mark.parametrize("args, exc, words", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input_rejected_and_out_unchanged(args, exc, words):
    _assert_rejected(args, exc, words)


def test_read_only_out():
    a = good()
    a["out"].flags.writeable = False
    with pytest.raises(ValueError, match="out: is read-only"):
        call(a)


@pytest.mark.parametrize("other", ["gamma", "mu", "c"])
def test_out_sharing_memory(other):
    """out may not alias an input: a view of one buffer as both is refused."""
    a = good()
    size = a["out"].size
    buf = np.zeros(size + a[other].size, np.float32)
    a["out"] = buf[:size].reshape(a["out"].shape)
    a[other] = buf[size - 1: size - 1 + a[other].size].reshape(a[other].shape)
    before = a["out"].copy()
    with pytest.raises(ValueError, match=f"out: shares memory with {other}"):
        call(a)
    np.testing.assert_array_equal(a["out"], before)


@pytest.mark.parametrize("other", ["gamma", "mu", "c"])
def test_checks_after_the_same_signature_passed(other):
    """The front end validates a call signature once (_frontend._checked); what depends
    on the arrays themselves is still checked on every call: aliasing (addresses) and
    writability. Each bad call below has the signature of a good call made just before."""
    from convcov import _frontend

    a = good()
    call(a)  # this signature is now known good
    assert any(k[6] == (("numpy", ("cpu", None), "float32", a["out"].shape,
                         tuple(s // 4 for s in a["out"].strides)))
               for k in _frontend._checked)
    b = good()
    size = b["out"].size
    buf = np.zeros(size + b[other].size, np.float32)
    b["out"] = buf[:size].reshape(b["out"].shape)
    b[other] = buf[size - 1: size - 1 + b[other].size].reshape(b[other].shape)
    assert b["out"].strides == a["out"].strides and b[other].strides == a[other].strides
    _assert_rejected(b, ValueError, [f"out: shares memory with {other}"])
    c = good()
    c["out"].flags.writeable = False
    _assert_rejected(c, ValueError, ["out: is read-only"])
    call(good())  # and the good signature still passes


def test_signature_cache_tells_strides_apart():
    """A view with other strides than a signature that passed is validated on its own:
    a transposed out (same shape, other strides) is valid and must give the reference."""
    a = good()
    call(a)
    ref = good()
    ref["out"] = np.ascontiguousarray(ref["out"])
    t = good()
    t["out"] = np.asfortranarray(t["out"])  # same shape and values, reversed strides
    np.testing.assert_allclose(call(t), call(ref), rtol=1e-6)


def test_mixed_kinds():
    torch = pytest.importorskip("torch")
    a = good()
    a["mu"] = torch.from_numpy(a["mu"])
    before = a["out"].copy()
    with pytest.raises(TypeError, match="one kind on one device") as info:
        call(a)
    assert "mu: torch on cpu" in str(info.value) and "out: numpy on cpu" in str(info.value)
    np.testing.assert_array_equal(a["out"], before)


def test_host_arrays_on_gpu_backend_refused():
    a = good()
    before = a["out"].copy()
    a["backend"] = "cupy"
    with pytest.raises(BackendError, match="cupy") as info:
        call(a)
    np.testing.assert_array_equal(a["out"], before)
    assert "cpu" in str(info.value)


@pytest.mark.skipif(not HAS_TORCH, reason="torch not installed")
def test_bfloat16_on_numpy_backend_refused():
    import torch

    a = good()
    out = torch.from_numpy(a["out"]).to(torch.bfloat16)
    before = out.clone()
    with pytest.raises(BackendError, match="numpy: does not compute on bfloat16"):
        convcov.accumulate(out, torch.from_numpy(a["gamma"]), torch.from_numpy(a["mu"]),
                           torch.from_numpy(a["c"]), K, groups=G, backend="numpy")
    assert torch.equal(out, before)


def test_patch_moment_errors():
    a = good()
    with pytest.raises(ShapeError, match="mu: expected 4 dims"):
        convcov.patch_moment(None, a["out"], 3, backend="numpy")
    with pytest.raises(ShapeError, match="kernel_size: weight shape"):
        convcov.patch_moment(None, a["mu"], (Co, Ci, K, K), groups=G, backend="numpy")
    with pytest.raises(BackendError, match="unknown backend"):
        convcov.patch_moment(None, a["mu"], 3, backend="nope")
    with pytest.raises(TypeError, match="gamma: expected a float16"):
        convcov.patch_moment(a["gamma"].astype(np.int64), a["mu"], 3, backend="numpy")
