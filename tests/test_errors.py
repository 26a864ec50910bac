"""Bad input (SPEC section 3): the right exception, a message that names the argument and
what was expected, and ``out`` bit-identical afterwards."""

from __future__ import annotations

import numpy as np
import pytest

import convcov
from convcov import BackendError, ShapeError

from kinds import HAS_TORCH, FakeCudaArray

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
    # ... and names the backends that do run on these arrays (SPEC section 3)
    assert "backends for cpu arrays: numpy, numba" in str(info.value)


def test_arrays_on_different_devices_refused():
    """One kind, two devices (two GPUs): the kinds error lists each array's device. (On
    descriptions: a machine without GPUs has no such arrays.)"""
    from convcov import _arrays, _frontend

    def on(device, shape):
        strides = tuple(int(np.prod(shape[i + 1:])) for i in range(len(shape)))
        return _arrays.ArrayInfo("torch", ("cuda", device), "float32", shape, strides,
                                 1 << 20, False)

    with pytest.raises(TypeError, match="one kind on one device") as info:
        _frontend._check(on(0, (B, Co, Ho, Wo, Ho, Wo)), None, on(1, (B, Ci, H, W)), None,
                         K, 1, 0, 1, G)
    assert "out: torch on cuda:0" in str(info.value)
    assert "mu: torch on cuda:1" in str(info.value)


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


# ---------------------------------------------------------------------------------------
# Inputs that a review found accepted with a wrong result, or refused with an internal
# error.


@pytest.mark.parametrize("backend", ["numpy", "numba"])
def test_out_with_elements_sharing_memory_refused(backend):
    """Two elements of out at one address (a zero stride): SPEC section 2 writes every
    element of out's channel diagonal once and leaves the others bit-identical, which such
    an out cannot honour (the backends gave different sums)."""
    a = good()
    base = np.zeros((1, Co, Ho, Wo, Ho, Wo), np.float32)
    a["out"] = np.lib.stride_tricks.as_strided(base, (B, *base.shape[1:]),
                                               (0, *base.strides[1:]))
    a["backend"] = backend
    _assert_rejected(a, ValueError, ["out", "share memory", "stride"])
    full = good()  # full layout whose c' axis has stride 0: the off-diagonal aliases
    fb = np.zeros((B, Co, Ho, Wo, 1, Ho, Wo), np.float32)
    full["out"] = np.lib.stride_tricks.as_strided(
        fb, full["out"].shape, (*fb.strides[:4], 0, *fb.strides[5:]))
    full["backend"] = backend
    _assert_rejected(full, ValueError, ["out", "share memory"])


def test_out_with_interleaved_strides_checked_exactly():
    """Strides that do not nest: a 2 x 2 block with strides (1, 1) overlaps (elements
    (0, 1) and (1, 0)); strides (3, 2) over 2 x 2 do not, and work."""
    from convcov import _arrays

    def info(shape, strides):
        return _arrays.ArrayInfo("numpy", ("cpu", None), "float32", shape, strides, 0, False)

    assert _arrays.self_overlapping(info((2, 2), (1, 1)))
    assert not _arrays.self_overlapping(info((2, 2), (3, 2)))
    assert not _arrays.self_overlapping(info((3, 2), (2, 3)))  # 0 2 4 / 3 5 7
    assert _arrays.self_overlapping(info((3, 2), (1, 2)))  # (2, 0) and (0, 1) at 2
    assert not _arrays.self_overlapping(info((4, 0, 2), (0, 1, 5)))  # no elements
    assert not _arrays.self_overlapping(info((1, 5, 7), (0, 7, 1)))  # size-1 stride 0
    assert not _arrays.self_overlapping(info((5, 7), (-7, -1)))  # negative strides


def test_interleaved_views_that_share_no_memory_work():
    """out and mu interleaved in one buffer (out the even elements, mu the odd ones):
    their bounds meet, but no element is shared, so the call is valid (the bounds alone
    had refused it)."""
    a = good()
    out_size, mu_size = a["out"].size, a["mu"].size
    buf = np.zeros(2 * out_size, np.float32)
    a["out"] = buf[0::2].reshape(a["out"].shape)
    a["mu"] = buf[1::2][:mu_size].reshape(a["mu"].shape)
    a["mu"][...] = good()["mu"]
    expected = good()
    expected["out"] = np.zeros_like(expected["out"])
    assert not np.shares_memory(a["out"], a["mu"])
    np.testing.assert_array_equal(call(a), call(expected))


def test_tiny_number_c_sums_in_float64():
    """A Python-number c below float32's normal range: 1e-50 would be 0 as a float32, and
    1e-45 a subnormal 40% off, so such a c sums in float64 like a c beyond float32's
    range; on the fast path too (the second call of a signature)."""
    mu = np.full((1, 1, 3, 3), 1e18, np.float32)  # S = 9e36, finite in float32
    for c in (1e-50, 1e-45, -1e-40):
        for backend in ("numpy", "numba"):
            for _ in range(2):
                out = np.zeros((1, 1, 1, 1, 1, 1), np.float32)
                convcov.accumulate(out, None, mu, c, 3, backend=backend)
                np.testing.assert_allclose(out[0, 0, 0, 0, 0, 0], np.float32(9e36 * c),
                                           rtol=1e-6)


def test_c_beyond_float64_refused():
    a = changed(c=10 ** 400)
    _assert_rejected(a, ValueError, ["c", "too large"])


@pytest.mark.parametrize("value", [np.array([3, 3]), np.array([1, 1])])
def test_conv_parameters_as_arrays(value):
    """A pair given as a 1-d array (or tensor) is a pair, like a tuple."""
    a = good()
    ref = good()
    if value[0] == 3:
        a["kernel_size"] = value
    else:
        a["stride"] = value
    np.testing.assert_array_equal(call(a), call(ref))
    np.testing.assert_array_equal(
        convcov.patch_moment(None, good()["mu"], np.array([3, 3]), backend="numpy"),
        convcov.patch_moment(None, good()["mu"], (3, 3), backend="numpy"))


@pytest.mark.parametrize("value, exc, words", [
    (np.array(2), None, []),  # a 0-d integer array is a number
    (np.array([1, 1, 1]), ShapeError, ["stride", "pair"]),
    ("1", TypeError, ["stride", "int"]),
])
def test_conv_parameter_kinds(value, exc, words):
    a = changed(stride=value, kernel_size=1)
    a["out"] = np.zeros((B, Co, 3, 3, Co, 3, 3), np.float32)
    if exc is None:
        call(a)
    else:
        _assert_rejected(a, exc, words)


@pytest.mark.parametrize("backend", [{"numpy"}, {"numpy": 0}, 1.5, [["numpy"]]])
def test_backend_argument_type(backend):
    """backend= is a name or a list of names, whatever was called before (the choice is
    cached per request: a set must not pass for the list with its names)."""
    call(changed(backend=["numpy"]))
    _assert_rejected(changed(backend=backend), TypeError, ["backend=", "name"])


def test_big_endian_arrays_refused_with_the_reason():
    a = changed(mu=good()["mu"].astype(">f4"))
    _assert_rejected(a, TypeError, ["mu", ">f4", "byte order"])


def test_masked_array_refused():
    a = changed(mu=np.ma.masked_array(good()["mu"], mask=False))
    _assert_rejected(a, TypeError, ["mu", "masked"])


def test_big_endian_cuda_interface_refused():
    """The typestr's byte order is part of the dtype: '>f4' is not float32 on a GPU."""
    from convcov import _arrays

    assert _arrays.info(FakeCudaArray((2,)), "x").dtype == "float32"
    assert _arrays.info(FakeCudaArray((2,), ">f4"), "x").dtype == ">f4"
    args = [FakeCudaArray((B, Co, Ho, Wo, Ho, Wo)), None,
            FakeCudaArray((B, Ci, H, W), ">f4"), 1.0, K]
    with pytest.raises(TypeError, match="mu: .*>f4.*byte order"):
        convcov.accumulate(*args, groups=G)


def test_misaligned_cuda_array_refused_before_any_launch():
    """A CUDA load from a misaligned address would fault and end the CUDA context: the
    front end refuses it (validation only: these arrays have no memory, and the error
    comes before any backend is chosen)."""
    out = FakeCudaArray((B, Co, Ho, Wo, Ho, Wo), ptr=(1 << 40) + (1 << 20))
    mu = FakeCudaArray((B, Ci, H, W), ptr=(1 << 40) + 2)
    with pytest.raises(ValueError, match="mu: its data address .* multiple of its item size"):
        convcov.accumulate(out, None, mu, 1.0, K, groups=G)


def _torch_args():
    import torch

    return {k: (torch.from_numpy(v) if isinstance(v, np.ndarray) else v)
            for k, v in good().items()}


def _assert_torch_rejected(args, exc, words, backend="numba"):
    import torch

    a = dict(args)
    out = a.pop("out")
    before = out.detach().clone()
    with pytest.raises(exc) as info:
        convcov.accumulate(out, a.pop("gamma"), a.pop("mu"), a.pop("c"), a.pop("kernel_size"),
                           backend=backend, **a)
    for w in words:
        assert w in str(info.value), f"{w!r} not in message: {info.value}"
    assert torch.equal(out.detach(), before)


@pytest.mark.skipif(not HAS_TORCH, reason="torch not installed")
@pytest.mark.parametrize("which", ["out", "gamma", "mu", "c"])
def test_torch_negated_views_refused(which):
    """A lazily negated view (``z.conj().imag``) holds -x in memory: it is refused with
    the way out, also when its call signature is already bound (the fast path reads
    addresses, which are the same as for a plain tensor)."""
    import torch

    convcov.accumulate(*(_torch_args()[k] for k in ("out", "gamma", "mu", "c", "kernel_size")),
                       groups=G, backend="numba")  # binds the plain signature
    a = _torch_args()
    x = a[which]
    z = torch.complex(torch.zeros_like(x), x)
    a[which] = z.conj().imag.neg_()  # the same values, with the neg bit: -(-x)
    assert a[which].is_neg() and torch.equal(a[which], x)
    _assert_torch_rejected(a, TypeError, [which, "resolve_neg"])


@pytest.mark.skipif(not HAS_TORCH, reason="torch not installed")
@pytest.mark.parametrize("make", ["sparse", "vmap"])
def test_torch_tensors_without_memory_refused(make):
    import torch

    a = _torch_args()
    if make == "sparse":
        a["mu"] = a["mu"].to_sparse()
        _assert_torch_rejected(a, TypeError, ["mu", "layout"])
        return
    mus = torch.stack([a["mu"], a["mu"]])
    out = a["out"]
    before = out.clone()

    def one(m):
        return convcov.accumulate(out, a["gamma"], m, a["c"], K, groups=G, backend="numba")

    with pytest.raises(TypeError, match="mu"):
        torch.vmap(one)(mus)
    assert torch.equal(out, before)


@pytest.mark.skipif(not HAS_TORCH, reason="torch not installed")
@pytest.mark.parametrize("case", ["c bool", "c str", "numpy out", "list out", "1-d out",
                                  "numpy c", "huge c", "numpy scalar c"])
def test_torch_subclass_calls_checked(case):
    """Tensor subclasses go through the torch operator without the data-reading checks
    (tracers' tensors have no data); the checks that need no data still give the
    direct path's errors."""
    import torch

    class Sub(torch.Tensor):
        pass

    a = _torch_args()
    a["mu"] = a["mu"].as_subclass(Sub)
    exc, words = TypeError, []
    if case == "c bool":
        a["c"], words = True, ["c"]
    elif case == "c str":
        a["c"], words = "2", ["c", "real number", "'2'"]
    elif case == "numpy out":
        a["out"], words = good()["out"], ["one kind", "out: numpy.ndarray"]
    elif case == "list out":
        a["out"], words = [[0.0]], ["one kind", "out: builtins.list"]
    elif case == "1-d out":
        a["out"], exc, words = torch.zeros(3), ShapeError, ["out", "7 dims"]
    elif case == "numpy c":
        a["c"], words = np.ones(Co, np.float32), ["one kind", "c: numpy.ndarray"]
    elif case == "huge c":
        a["c"], exc, words = 10 ** 400, ValueError, ["c", "too large"]
    elif case == "numpy scalar c":  # valid: a number (the call goes through)
        ref = _torch_args()
        convcov.accumulate(ref["out"], ref["gamma"], ref["mu"], 2.0, K, groups=G,
                           backend="numba")
        convcov.accumulate(a["out"], a["gamma"], a["mu"], np.float32(2), K, groups=G,
                           backend="numba")
        assert torch.equal(a["out"], ref["out"])
        return
    out = a["out"]
    before = out.copy() if isinstance(out, np.ndarray) else (
        out.clone() if isinstance(out, torch.Tensor) else list(out))
    with pytest.raises(exc) as info:
        convcov.accumulate(out, a["gamma"], a["mu"], a["c"], K, groups=G, backend="numba")
    for w in words:
        assert w in str(info.value), f"{w!r} not in message: {info.value}"
    if isinstance(out, torch.Tensor):
        assert torch.equal(out, before)
    elif isinstance(out, np.ndarray):
        np.testing.assert_array_equal(out, before)


@pytest.mark.skipif(not HAS_TORCH, reason="torch not installed")
@pytest.mark.parametrize("grad", [False, True])
def test_patch_moment_mixed_kinds(grad):
    """numpy gamma with a torch mu: the kinds error, naming the arguments patch_moment
    has (not torch's schema error, which printed the whole array)."""
    import torch

    a = good()
    mu = torch.from_numpy(a["mu"]).requires_grad_(grad)
    with pytest.raises(TypeError, match="one kind") as info:
        convcov.patch_moment(a["gamma"], mu, K, groups=G, backend="numba")
    assert "mu: torch on cpu" in str(info.value) and "gamma: numpy on cpu" in str(info.value)
    assert "out" not in str(info.value)


def _cuda_backends():
    from kinds import torch_cuda

    if not torch_cuda():
        return [pytest.param(None, marks=pytest.mark.skip(reason="no CUDA device for torch"))]
    return [pytest.param(b.name, marks=pytest.mark.skipif(not b.available, reason=b.reason))
            for b in convcov.backends() if b.device == "cuda"]


@pytest.mark.parametrize("backend", _cuda_backends())
def test_cuda_tensors_refused_after_binding(backend):
    """On a GPU too, with the signature bound (the fast path): a negated view of each
    input, and an out with a zero stride, are refused before anything is written."""
    import torch

    def args():
        return {k: (v.cuda() if isinstance(v, torch.Tensor) else v)
                for k, v in _torch_args().items()}

    a = args()
    for _ in range(2):  # bind
        convcov.accumulate(a["out"], a["gamma"], a["mu"], a["c"], K, groups=G, backend=backend)
    for which in ("out", "gamma", "mu", "c"):
        a = args()
        x = a[which]
        a[which] = torch.complex(torch.zeros_like(x), x).conj().imag.neg_()
        _assert_torch_rejected(a, TypeError, [which, "resolve_neg"], backend=backend)
    a = args()
    a["out"] = a["out"][:1].expand_as(a["out"])
    _assert_torch_rejected(a, ValueError, ["out", "share memory"], backend=backend)
    torch.cuda.synchronize()
