"""The front end's fast path for torch tensors and NumPy arrays (convcov/_frontend.py,
``_torch_fast``, ``_numpy_fast``): a call signature seen before runs its backend's bound
launcher (``Backend.bind``) instead of the full validation. Everything the full path does
must still hold on it: each call's own addresses, the aliasing check, a read-only out,
autograd routing and the version counter (torch), CONVCOV_BACKEND and newly registered
backends read per call, and threads. Torch CPU tensors and NumPy arrays with the numba
backend (which binds) here; tests/test_cupy.py and tests/test_numba_cuda.py repeat calls
on the GPU."""

from __future__ import annotations

import numpy as np
import pytest

import convcov
from convcov import Backend, _frontend, _registry

from kinds import HAS_TORCH, at_once

needs_torch = pytest.mark.skipif(not HAS_TORCH, reason="torch is not installed")

B, Ci, Co, H, K = 2, 3, 2, 6, 3
HO = H - K + 1


def tensors(seed=0, c_tensor=True):
    import torch

    g = torch.Generator().manual_seed(seed)
    out = torch.randn(B, Co, HO, HO, Co, HO, HO, generator=g)
    gamma = torch.rand(B, Ci, H, H, H, H, generator=g)
    mu = torch.randn(B, Ci, H, H, generator=g)
    c = torch.rand(Co, generator=g) + 0.5 if c_tensor else 0.75
    return out, gamma, mu, c


def reference(out, gamma, mu, c):
    """What the call must give: the numpy backend on float64 copies."""
    c64 = c if isinstance(c, float) else c.double().numpy()
    return convcov.accumulate(out.double().numpy(), gamma.double().numpy(),
                              mu.double().numpy(), c64, K, backend="numpy")


class Spy:
    """Records what each call of the fast path ``name`` (_torch_fast by default)
    returned (True: the bound launcher ran)."""

    def __init__(self, monkeypatch, name="_torch_fast"):
        self.taken, fast = [], getattr(_frontend, name)

        def spy(*args):
            self.taken.append(fast(*args))
            return self.taken[-1]

        monkeypatch.setattr(_frontend, name, spy)


@pytest.fixture
def spy(monkeypatch):
    monkeypatch.delenv("CONVCOV_BACKEND", raising=False)
    monkeypatch.setattr(_frontend, "_bound", {})
    return Spy(monkeypatch)


@needs_torch
@pytest.mark.parametrize("c_tensor", [True, False])
def test_each_call_uses_its_own_arrays(spy, c_tensor):
    """Fresh tensors of a bound signature: each call reads and writes its own memory."""
    calls = [tensors(seed, c_tensor) for seed in range(4)]
    want = [reference(*a) for a in calls]
    for a, w in zip(calls, want):
        convcov.accumulate(*a, K, backend="numba")
        np.testing.assert_allclose(a[0].double().numpy(), w, rtol=1e-5, atol=1e-5)
    assert type(spy.taken[0]) is tuple  # the key: the full path ran, then bound it
    assert spy.taken[1:] == [True, True, True]


@needs_torch
def test_version_counter_counts_each_call(spy):
    out, gamma, mu, c = tensors()
    v = out._version
    for n in range(1, 4):
        convcov.accumulate(out, gamma, mu, c, K, backend="numba")
        assert out._version == v + n
    assert spy.taken[-1] is True


@needs_torch
@pytest.mark.parametrize("which", ["gamma", "mu", "c"])
def test_aliasing_is_checked_on_every_call(spy, which):
    """A signature bound with separate arrays, then called with out overlapping gamma, mu
    or c (same shapes, strides and alignment): ValueError, out unchanged."""
    import torch

    out0, *inputs = tensors()
    args = dict(zip(("gamma", "mu", "c"), inputs))
    n_out, n_x = out0.numel(), args[which].numel()
    buf = torch.zeros(n_out + n_x + 8)
    out = buf[:n_out].view(out0.shape)
    args[which] = buf[n_out + 8:].view(args[which].shape).copy_(args[which])
    for _ in range(3):
        convcov.accumulate(out, args["gamma"], args["mu"], args["c"], K, backend="numba")
    assert spy.taken[-1] is True
    args[which] = buf[n_out - 8:n_out - 8 + n_x].view(args[which].shape)
    before = out.clone()
    with pytest.raises(ValueError, match=f"out: shares memory with {which}"):
        convcov.accumulate(out, args["gamma"], args["mu"], args["c"], K, backend="numba")
    assert spy.taken[-1] is None  # the fast path saw it, and left it to the full path
    assert torch.equal(out, before)


@needs_torch
def test_autograd_still_routed(spy):
    """A bound signature whose tensors now require grad goes through the operator, which
    gives the gradients."""
    import torch

    out, gamma, mu, c = tensors()
    for _ in range(3):
        convcov.accumulate(out.clone(), gamma, mu, c, K, backend="numba")
    assert spy.taken[-1] is True
    mu = mu.clone().requires_grad_()
    res = convcov.accumulate(out.clone(), gamma, mu, c, K, backend="numba")
    assert res.requires_grad and spy.taken[-1] is None
    res.sum().backward()
    assert mu.grad is not None and torch.isfinite(mu.grad).all() and mu.grad.abs().sum() > 0


class Counting(Backend):
    """Counts its calls, full path (accumulate) and bound (bind's launcher) apart."""

    device = "cpu"
    dtypes = frozenset({"float32", "float64"})

    def __init__(self, name):
        self.name, self.full, self.bound = name, 0, 0

    def accumulate(self, problem):
        self.full += 1

    def bind(self, problem):
        def run(*args):
            self.bound += 1

        return run


@pytest.fixture
def counting():
    made = [Counting("count_a"), Counting("count_b")]
    for b in made:
        convcov.register_backend(b)
    yield made
    for b in made:
        _registry.unregister(b.name)


@needs_torch
def test_environment_and_registry_read_per_call(spy, counting, monkeypatch):
    a, b = counting
    args = tensors()
    monkeypatch.setenv("CONVCOV_BACKEND", "count_a")
    for _ in range(3):
        convcov.accumulate(*args, K)
    assert (a.full, a.bound) == (1, 2)  # the full path (which binds), then the launcher
    monkeypatch.setenv("CONVCOV_BACKEND", "count_b")
    convcov.accumulate(*args, K)
    assert (b.full, b.bound, a.bound) == (1, 0, 2)
    monkeypatch.setenv("CONVCOV_BACKEND", "count_a")
    convcov.accumulate(*args, K)
    assert (a.full, a.bound) == (1, 3)
    # A backend registered under the name in use replaces it at once.
    c = Counting("count_a")
    convcov.register_backend(c)
    convcov.accumulate(*args, K)
    assert (c.full, a.full, a.bound) == (1, 1, 3)


@needs_torch
def test_unusual_arguments_take_the_full_path(spy, counting):
    """Conv parameters given as lists, a backend list, a numpy c: the full path, each time."""
    a = counting[0]
    out, gamma, mu, _ = tensors()
    for _ in range(3):
        convcov.accumulate(out, gamma, mu, 1.0, [K, K], backend="count_a")
        convcov.accumulate(out, gamma, mu, 1.0, K, backend=["count_a"])
        convcov.accumulate(out, gamma, mu, np.float64(1.0), K, backend="count_a")
    assert a.bound == 0 and a.full == 9 and set(spy.taken) == {None}  # never a key


def threads_on_a_bound_signature(make, reference, host, taken):
    """Eight threads, each its own arrays (``make(seed)``) of one signature that a first
    call binds, calling at once; every result against ``reference``; ``taken`` (the
    spy's record) shows the bound launcher ran each time."""
    calls = [make(seed) for seed in range(8)]
    want = [reference(*a) for a in calls]
    del taken[:]  # (the references' calls)
    convcov.accumulate(*make(99), K, backend="numba")  # binds the signature

    def work(i, start):
        start()
        convcov.accumulate(*calls[i], K, backend="numba")

    at_once(8, work)
    for a, w in zip(calls, want):
        np.testing.assert_allclose(host(a[0]), w, rtol=1e-5, atol=1e-5)
    assert taken[1:] == [True] * 8


@needs_torch
def test_threads_on_a_bound_signature(spy):
    threads_on_a_bound_signature(tensors, reference, lambda t: t.double().numpy(), spy.taken)


@needs_torch
def test_number_c_beyond_float32_on_the_fast_path(spy):
    """A bound float32 signature called with a number c that float32 cannot hold leaves
    the fast path: the full path sums it in float64 (normalise), so S = 0 gives zeros,
    not NaN from Inf * 0."""
    import torch

    out = torch.zeros(1, 2, 2, 2, 2, 2, 2)
    mu = torch.zeros(1, 1, 4, 4)
    for c in (1.0, 1.0, 1e39):
        convcov.accumulate(out, None, mu, c, 3, backend="numba")
    assert spy.taken[1:] == [True, None]
    assert (out == 0).all()


# ---------------------------------------------------------------------------------------
# NumPy arrays (_numpy_fast): the same promises, without autograd and version counts.


def arrays(seed=0, c_array=True):
    rng = np.random.default_rng(seed)
    out = rng.standard_normal((B, Co, HO, HO, Co, HO, HO)).astype(np.float32)
    gamma = rng.random((B, Ci, H, H, H, H)).astype(np.float32)
    mu = rng.standard_normal((B, Ci, H, H)).astype(np.float32)
    c = (rng.random(Co) + 0.5).astype(np.float32) if c_array else 0.75
    return out, gamma, mu, c


def reference_np(out, gamma, mu, c):
    """What the call must give: the numpy backend on float64 copies."""
    c64 = c if isinstance(c, float) else c.astype(np.float64)
    return convcov.accumulate(out.astype(np.float64), gamma.astype(np.float64),
                              mu.astype(np.float64), c64, K, backend="numpy")


@pytest.fixture
def np_spy(monkeypatch):
    """What each _numpy_fast call returned (True: the bound launcher ran)."""
    monkeypatch.delenv("CONVCOV_BACKEND", raising=False)
    monkeypatch.setattr(_frontend, "_bound", {})
    return Spy(monkeypatch, "_numpy_fast").taken


@pytest.mark.parametrize("c_array", [True, False])
def test_numpy_each_call_uses_its_own_arrays(np_spy, c_array):
    calls = [arrays(seed, c_array) for seed in range(4)]
    want = [reference_np(*a) for a in calls]
    del np_spy[:]  # (the references' calls)
    for a, w in zip(calls, want):
        assert convcov.accumulate(*a, K, backend="numba") is a[0]
        np.testing.assert_allclose(a[0], w, rtol=1e-5, atol=1e-5)
    assert type(np_spy[0]) is tuple and np_spy[1:] == [True, True, True]


def test_numpy_many_signatures_keep_the_newest_fast(np_spy):
    # A process that has already seen the caches' worth of signatures still binds new ones.
    _frontend._bound.update({("seen", i): None for i in range(4096)})
    a = arrays(0)
    want, start = reference_np(*a), a[0].copy()
    del np_spy[:]
    convcov.accumulate(*a, K, backend="numba")
    a[0][...] = start
    assert convcov.accumulate(*a, K, backend="numba") is a[0]
    np.testing.assert_allclose(a[0], want, rtol=1e-5, atol=1e-5)
    assert type(np_spy[0]) is tuple and np_spy[1] is True


@pytest.mark.parametrize("which", ["gamma", "mu", "c"])
@pytest.mark.parametrize("reverse", [False, True])
def test_numpy_aliasing_is_checked_on_every_call(np_spy, which, reverse):
    """As for torch, and with the input reversed (negative strides: its first element at
    its highest address), so that the bounds are taken from both ends."""
    out0, *inputs = arrays()
    args = dict(zip(("gamma", "mu", "c"), inputs))
    shape = np.shape(args[which])
    n_out, n_x = out0.size, args[which].size
    buf = np.zeros(n_out + n_x + 8, np.float32)
    out = buf[:n_out].reshape(out0.shape)

    def view(lo):
        flat = buf[lo:lo + n_x]
        return (flat[::-1] if reverse else flat).reshape(shape)

    args[which] = view(n_out + 8)
    args[which][...] = inputs[("gamma", "mu", "c").index(which)]
    for _ in range(3):
        convcov.accumulate(out, args["gamma"], args["mu"], args["c"], K, backend="numba")
    assert np_spy[-1] is True
    args[which] = view(n_out - 8)
    assert np.shares_memory(out, args[which])
    before = out.copy()
    with pytest.raises(ValueError, match=f"out: shares memory with {which}"):
        convcov.accumulate(out, args["gamma"], args["mu"], args["c"], K, backend="numba")
    assert np_spy[-1] is None
    np.testing.assert_array_equal(out, before)


def test_numpy_read_only_out_raises_after_binding(np_spy):
    out, gamma, mu, c = arrays()
    for _ in range(2):
        convcov.accumulate(out, gamma, mu, c, K, backend="numba")
    assert np_spy[-1] is True
    frozen = out.copy()
    frozen.flags.writeable = False
    with pytest.raises(ValueError, match="out: is read-only"):
        convcov.accumulate(frozen, gamma, mu, c, K, backend="numba")
    np.testing.assert_array_equal(frozen, out)


def test_numpy_unusual_arguments_take_the_full_path(np_spy, counting, monkeypatch):
    """A subclass of ndarray, a NumPy scalar c, a backend list: the full path each time;
    plain arrays bind and then follow CONVCOV_BACKEND per call."""
    a, b = counting
    out, gamma, mu, c = arrays()

    class Sub(np.ndarray):
        pass

    for _ in range(2):
        convcov.accumulate(out.view(Sub), gamma, mu, c, K, backend="count_a")
        convcov.accumulate(out, gamma, mu, np.float32(1.0), K, backend="count_a")
        convcov.accumulate(out, gamma, mu, c, K, backend=["count_a"])
    assert a.bound == 0 and a.full == 6 and set(np_spy) == {None}
    monkeypatch.setenv("CONVCOV_BACKEND", "count_b")
    for _ in range(3):
        convcov.accumulate(out, gamma, mu, c, K)
    assert (b.full, b.bound) == (1, 2)


def test_numpy_threads_on_a_bound_signature(np_spy):
    threads_on_a_bound_signature(arrays, reference_np, np.asarray, np_spy)


def test_numpy_and_torch_signatures_do_not_meet(np_spy):
    """The same shapes as NumPy arrays and as torch tensors bind two entries; each kind's
    calls run their own."""
    torch = pytest.importorskip("torch")
    for _ in range(2):
        convcov.accumulate(*arrays(), K, backend="numba")
        convcov.accumulate(*(torch.from_numpy(x) if isinstance(x, np.ndarray) else x
                             for x in arrays(1)), K, backend="numba")
    assert np_spy == [np_spy[0], True] and len(_frontend._bound) == 2
