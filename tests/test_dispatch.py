"""Backend selection (SPEC section 4), with recording fake backends; plug-ins through entry
points; array kinds (torch CPU tensors in and out, zero-copy); and that importing convcov
imports no framework."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import convcov
from convcov import Backend, BackendError, _arrays, _frontend, _registry

from kinds import HAS_TORCH, FakeCudaArray


class Recorder(Backend):
    """Records the problems it is given; computes nothing."""

    def __init__(self, name, device="cpu", reason=None, dtypes=None):
        self.name, self.device, self.calls = name, device, []
        self._reason, self._probed = reason, True
        if dtypes is not None:
            self.dtypes = frozenset(dtypes)

    def accumulate(self, problem):
        self.calls.append(problem)


@pytest.fixture
def fakes(monkeypatch):
    monkeypatch.delenv("CONVCOV_BACKEND", raising=False)
    made = {
        "fake_a": Recorder("fake_a"),
        "fake_b": Recorder("fake_b"),
        "fake_missing": Recorder("fake_missing", reason="fake: not installed"),
        "fake_cuda": Recorder("fake_cuda", device="cuda"),
    }
    for b in made.values():
        convcov.register_backend(b)
    yield made
    for n in made:
        _registry.unregister(n)


def small():
    return (np.zeros((1, 2, 2, 2, 2, 2, 2), np.float32), None,
            np.ones((1, 2, 4, 4), np.float32), 1.0, 3)


def test_argument_beats_environment(fakes, monkeypatch):
    monkeypatch.setenv("CONVCOV_BACKEND", "fake_b")
    convcov.accumulate(*small(), backend="fake_a")
    assert len(fakes["fake_a"].calls) == 1 and not fakes["fake_b"].calls


def test_environment_read_per_call(fakes, monkeypatch):
    monkeypatch.setenv("CONVCOV_BACKEND", "fake_b")
    convcov.accumulate(*small())
    monkeypatch.setenv("CONVCOV_BACKEND", "fake_a")
    convcov.accumulate(*small())
    assert len(fakes["fake_a"].calls) == 1 and len(fakes["fake_b"].calls) == 1


def test_preference_list_skips_unavailable_and_wrong_device(fakes, monkeypatch):
    monkeypatch.setenv("CONVCOV_BACKEND", "fake_missing, fake_cuda, fake_b, fake_a")
    convcov.accumulate(*small())
    assert len(fakes["fake_b"].calls) == 1 and not fakes["fake_a"].calls
    assert not fakes["fake_cuda"].calls and not fakes["fake_missing"].calls


def test_preference_list_as_argument(fakes):
    convcov.accumulate(*small(), backend=["fake_missing", "fake_a"])
    assert len(fakes["fake_a"].calls) == 1


def test_no_usable_backend_explains_each(fakes, monkeypatch):
    monkeypatch.setenv("CONVCOV_BACKEND", "fake_missing,fake_cuda")
    out = small()[0]
    with pytest.raises(BackendError) as info:
        convcov.accumulate(out, *small()[1:])
    msg = str(info.value)
    assert "CONVCOV_BACKEND" in msg and "fake: not installed" in msg
    assert "fake_cuda: runs on cuda arrays, these are cpu arrays" in msg


def test_unknown_name_in_environment(fakes, monkeypatch):
    monkeypatch.setenv("CONVCOV_BACKEND", "fake_a,fakr_b")
    # typos are errors even when an earlier name would do: they would hide later
    with pytest.raises(BackendError, match="unknown backend 'fakr_b'"):
        convcov.accumulate(*small())


def test_dtype_not_handled(fakes):
    convcov.register_backend(Recorder("fake_f64", dtypes={"float64"}))
    try:
        with pytest.raises(BackendError, match="fake_f64: does not compute on float32"):
            convcov.accumulate(*small(), backend="fake_f64")
    finally:
        _registry.unregister("fake_f64")


def test_automatic_order_host(fakes, monkeypatch):
    monkeypatch.setitem(_registry.AUTO, "cpu", ("fake_missing", "fake_b", "fake_a"))
    convcov.accumulate(*small())
    assert len(fakes["fake_b"].calls) == 1


def test_automatic_host_choice_is_numba_then_numpy(monkeypatch):
    monkeypatch.delenv("CONVCOV_BACKEND", raising=False)
    numba_ok = _registry.get("numba").unavailable_reason() is None
    want = "numba" if numba_ok else "numpy"
    assert _registry.select(None, "cpu", frozenset({"float32"})).name == want


def test_cuda_arrays_routed_to_cuda_backend(fakes):
    out = FakeCudaArray((1, 2, 2, 2, 2, 2, 2), ptr=0x10000000)
    mu = FakeCudaArray((1, 2, 4, 4), ptr=0x20000000)
    convcov.accumulate(out, None, mu, 2.0, 3, backend="fake_cuda")
    (p,) = fakes["fake_cuda"].calls
    assert p.kind == "cai" and p.device[0] == "cuda" and p.out is out and p.c_value == 2.0
    with pytest.raises(BackendError, match="fake_a: runs on cpu arrays, these are cuda"):
        convcov.accumulate(out, None, mu, 2.0, 3, backend="fake_a")


def test_generic_cuda_arrays_name_their_streams(fakes):
    """A generic CUDA array's __cuda_array_interface__ "stream" reaches the backend, and
    launch_streams picks the launch stream (out's, else the legacy default stream) and
    the other streams to wait for (each once; the legacy stream's two handles as one)."""
    from convcov._arrays import launch_streams

    out = FakeCudaArray((1, 2, 2, 2, 2, 2, 2), ptr=0x10000000, stream=0x5000)
    mu = FakeCudaArray((1, 2, 4, 4), ptr=0x20000000, stream=0x6000)
    c = FakeCudaArray((2,), ptr=0x30000000, stream=0x6000)
    convcov.accumulate(out, None, mu, c, 3, backend="fake_cuda")
    (p,) = fakes["fake_cuda"].calls
    assert [None if a is None else a.stream for a in p.infos] == [0x5000, None, 0x6000, 0x6000]
    assert launch_streams(p.kind, p.device[1], p.infos, p.written) == (0x5000, (0x6000,), ())

    def infos(*streams):
        return [None if s == "absent" else _arrays.info(FakeCudaArray((1,), stream=s), "x")
                for s in streams]

    assert launch_streams("cai", None, infos(None, None, None)) == (0, (), ())
    assert launch_streams("cai", None, infos(None, "absent", 7, None)) == (0, (7,), ())
    assert launch_streams("cai", None, infos(7, 7, 9, 1)) == (7, (9, 1), ())
    assert launch_streams("cai", None, infos(1, 0, None, 2)) == (1, (2,), ())
    assert launch_streams("cai", None, infos(None, 1)) == (0, (), ())
    # The backward writes two (grad_gamma, grad_mu): the second's stream is waited for
    # first and then waits for the launches; one that names none is the legacy stream's.
    assert launch_streams("cai", None, infos("absent", 3, 4), 2) == (3, (4,), ())
    assert launch_streams("cai", None, infos(7, 9, 9, 4), 2) == (7, (9, 4), (9,))
    assert launch_streams("cai", None, infos(7, None, 4), 2) == (7, (4,), (0,))
    assert launch_streams("cai", None, infos(None, 1, 4), 2) == (0, (4,), ())
    assert launch_streams("cai", None, infos(1, 7, 7, 7), 2) == (1, (7,), (7,))
    assert launch_streams("cai", None, infos(7, 7, 7), 2) == (7, (), ())


def test_cuda_array_stream_handles_of_integer_types():
    """CAI v3 says "an integer": NumPy integers and IntEnum members are handles too."""
    import enum

    class Handle(enum.IntEnum):
        side = 0x5000

    for stream in (np.int64(0x5000), np.uintp(0x5000), Handle.side):
        a = _arrays.info(FakeCudaArray((1,), stream=stream), "x")
        assert a.stream == 0x5000 and type(a.stream) is int


@pytest.mark.parametrize("stream", ["1", 1.0, True, np.bool_(True), -1])
def test_cuda_array_stream_that_is_no_handle_refused(stream):
    out = FakeCudaArray((1, 2, 2, 2, 2, 2, 2), ptr=0x10000000)
    mu = FakeCudaArray((1, 2, 4, 4), ptr=0x20000000, stream=stream)
    with pytest.raises(TypeError, match=r"mu: __cuda_array_interface__\['stream'\] must be"):
        convcov.accumulate(out, None, mu, 1.0, 3)


def test_cuda_arrays_of_unknown_ordinal_go_with_any(fakes, monkeypatch):
    """A generic CUDA array the driver does not place (ordinal None: an empty one has no
    address) goes with arrays on a known device, and the call runs there; two known
    ordinals that differ are refused."""
    places = {0x10000000: 1, 0x20000000: None, 0x30000000: 0}
    monkeypatch.setattr(_arrays, "pointer_device", places.get)
    out = FakeCudaArray((1, 2, 2, 2, 2, 2, 2), ptr=0x10000000)  # on device 1
    mu = FakeCudaArray((1, 2, 4, 4), ptr=0x20000000)  # unknown
    convcov.accumulate(out, None, mu, 2.0, 3, backend="fake_cuda")
    (p,) = fakes["fake_cuda"].calls
    assert p.mu_info.device == ("cuda", None) and p.device == ("cuda", 1)
    c = FakeCudaArray((2,), ptr=0x30000000)  # on device 0
    with pytest.raises(TypeError, match="one device; got out: cai on cuda:1, mu: cai on "
                                        "cuda, c: cai on cuda:0"):
        convcov.accumulate(out, None, mu, c, 3, backend="fake_cuda")


def test_the_driver_is_never_initialised_by_convcov():
    """``import convcov`` imports no cuda-python. A generic CUDA array's device and stream
    come from the CUDA driver through cuda.bindings, imported only then, and convcov never
    initialises CUDA: where no library has, the answers are "unknown" and CUDA is still
    uninitialised afterwards; where cuda-python or the driver is missing, the same, and no
    error."""
    code = textwrap.dedent("""
        import sys
        import convcov
        from convcov import _arrays
        assert "cuda.bindings" not in sys.modules, "import convcov imported cuda-python"

        class A:
            __cuda_array_interface__ = {"shape": (1,), "typestr": "<f4", "version": 3,
                                        "data": (0x10000000, False)}

        assert _arrays.info(A(), "x").device == ("cuda", None)
        assert _arrays.pointer_device(0x10000000) is None
        assert _arrays.stream_device(0x5000) is None
        try:
            from cuda.bindings import driver
        except ImportError:
            print("no cuda-python")
            raise SystemExit
        try:
            err, _ = driver.cuDeviceGetCount()
        except Exception:
            print("no driver")
            raise SystemExit
        print(err.name)
    """)
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() in ("no cuda-python", "no driver", "CUDA_ERROR_NOT_INITIALIZED")


class _Driver:
    """A stand-in for cuda.bindings.driver: calls return (CUresult, value) tuples, as
    cuda-python's do; ``answers`` maps a call's name to its results, in turn (an exception
    is raised), and ``asked`` records the calls."""

    import enum as _enum

    class CUresult(_enum.IntEnum):
        CUDA_SUCCESS = 0
        CUDA_ERROR_INVALID_VALUE = 1
        CUDA_ERROR_NOT_INITIALIZED = 3

    class CUpointer_attribute(_enum.IntEnum):
        CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL = 9

    class CUstreamCaptureStatus(_enum.IntEnum):
        CU_STREAM_CAPTURE_STATUS_NONE = 0
        CU_STREAM_CAPTURE_STATUS_ACTIVE = 1

    class CUstream:
        def __init__(self, handle):
            self.handle = handle

    class CUdevice:  # cuStreamGetDevice's value: an object that int() turns into the ordinal
        def __init__(self, ordinal):
            self.ordinal = ordinal

        def __int__(self):
            return self.ordinal

    def __init__(self, answers):
        self.answers, self.asked = answers, []
        for name in answers:
            setattr(self, name, self._call(name))

    def _call(self, name):
        def call(*args):
            self.asked.append((name,) + tuple(a.handle if isinstance(a, _Driver.CUstream)
                                              else a for a in args))
            answer = self.answers[name].pop(0)
            if isinstance(answer, Exception):
                raise answer
            return answer
        return call


def test_driver_answers_and_errors(monkeypatch):
    """pointer_device and stream_device read cuda-python's (CUresult, value) tuples: the
    value on success, None on an error result, and nothing remembered (a driver initialised
    later answers); a call that raises (no driver library, or a driver older than the call)
    is None and not made again; no cuda-python at all is None. No stream is asked about
    before CUDA is initialised (the driver reads the handle, and none can be real yet), a
    stream being captured is not asked for its device (that would end the capture), and
    default-stream handles are not asked about."""
    R, S = _Driver.CUresult, _Driver.CUstreamCaptureStatus
    drv = _Driver({
        "cuPointerGetAttribute": [(R.CUDA_ERROR_NOT_INITIALIZED, 0), (R.CUDA_SUCCESS, 1),
                                  (R.CUDA_ERROR_INVALID_VALUE, 0),
                                  RuntimeError("no driver library")],
        "cuDeviceGetCount": [(R.CUDA_ERROR_NOT_INITIALIZED, 0), (R.CUDA_SUCCESS, 1)],
        "cuStreamIsCapturing": [(R.CUDA_SUCCESS, S.CU_STREAM_CAPTURE_STATUS_ACTIVE),
                                (R.CUDA_SUCCESS, S.CU_STREAM_CAPTURE_STATUS_NONE),
                                (R.CUDA_SUCCESS, S.CU_STREAM_CAPTURE_STATUS_NONE),
                                (R.CUDA_SUCCESS, S.CU_STREAM_CAPTURE_STATUS_NONE)],
        "cuStreamGetDevice": [(R.CUDA_SUCCESS, _Driver.CUdevice(2)),
                              AttributeError("a driver without cuStreamGetDevice")],
    })
    monkeypatch.setattr(_arrays, "_driver_module", drv)
    monkeypatch.setattr(_arrays, "_unanswered", set())
    monkeypatch.setattr(_arrays, "_initialised", False)
    ordinal = _Driver.CUpointer_attribute.CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL
    assert _arrays.pointer_device(0x1000) is None  # not initialised yet ...
    assert _arrays.pointer_device(0x1000) == 1  # ... and then it is
    assert _arrays.pointer_device(0x2000) is None  # an address it does not know
    assert _arrays.pointer_device(0) is None  # no address: not asked
    assert drv.asked == [("cuPointerGetAttribute", ordinal, 0x1000)] * 2 + [
        ("cuPointerGetAttribute", ordinal, 0x2000)]
    assert _arrays.pointer_device(0x3000) is None  # raised: not asked again
    assert _arrays.pointer_device(0x3000) is None and len(drv.asked) == 4

    drv.asked.clear()
    assert _arrays.stream_device(0x5000) is None  # CUDA not initialised: no stream exists
    assert _arrays.stream_device(0x5000) is None  # being captured
    assert _arrays.stream_device(0x5000) == 2
    assert [a[0] for a in drv.asked] == ["cuDeviceGetCount"] * 2 + [
        "cuStreamIsCapturing"] * 2 + ["cuStreamGetDevice"]
    del drv.asked[:2]
    assert drv.asked[-1] == ("cuStreamGetDevice", 0x5000)
    assert all(_arrays.stream_device(h) is None for h in _arrays.DEFAULT_STREAMS)
    assert len(drv.asked) == 3
    assert _arrays.stream_device(0x5000) is None  # an older driver ...
    assert _arrays.stream_device(0x5000) is None  # ... is not asked again
    assert [a[0] for a in drv.asked[3:]] == ["cuStreamIsCapturing", "cuStreamGetDevice",
                                             "cuStreamIsCapturing"]

    monkeypatch.setattr(_arrays, "_driver_module", False)  # no cuda-python
    assert _arrays.pointer_device(0x1000) is None and _arrays.stream_device(0x5000) is None


def test_a_stream_of_another_device_is_refused(fakes, monkeypatch):
    """A generic CUDA array that names a stream of another device than the arrays' is a
    TypeError before the backend is called (the driver says where a stream belongs:
    _arrays.stream_device, stood in for here); default-stream handles and streams the
    driver does not place pass."""
    monkeypatch.setattr(_arrays, "pointer_device", lambda ptr: 0 if ptr else None)
    monkeypatch.setattr(_arrays, "stream_device",
                        lambda s: {0x5000: 0, 0x6000: 1}.get(s))
    out_h = np.zeros((1, 2, 2, 2, 2, 2, 2), np.float32)

    def call(out_stream, mu_stream):
        out = FakeCudaArray(out_h.shape, ptr=0x10000000, stream=out_stream)
        mu = FakeCudaArray((1, 2, 4, 4), ptr=0x20000000, stream=mu_stream)
        convcov.accumulate(out, None, mu, 2.0, 3, backend="fake_cuda")

    for out_stream, mu_stream, bad in ((0x6000, None, "out"), (0x5000, 0x6000, "mu")):
        with pytest.raises(TypeError, match=rf"{bad}: its __cuda_array_interface__ names "
                           r"stream 0x6000, which belongs to cuda:1; the arrays are on cuda:0"):
            call(out_stream, mu_stream)
    assert fakes["fake_cuda"].calls == []
    for streams in ((0x5000, 0x5000), (1, 2), (None, 0x7000)):
        call(*streams)
    assert len(fakes["fake_cuda"].calls) == 3
    # Per call, not per signature: the signature passed just now.
    with pytest.raises(TypeError, match="mu: .* names stream 0x6000, which belongs to cuda:1"):
        call(0x5000, 0x6000)
    assert len(fakes["fake_cuda"].calls) == 3
    # patch_moment and the backward check the same.
    mu = FakeCudaArray((1, 2, 4, 4), ptr=0x20000000, stream=0x6000)
    with pytest.raises(TypeError, match="mu: .* names stream 0x6000, which belongs to cuda:1"):
        convcov.patch_moment(None, mu, 3, backend="fake_cuda")
    grad_S = FakeCudaArray((1, 1, 2, 2, 2, 2), ptr=0x30000000, stream=0x6000)
    with pytest.raises(TypeError, match="grad_S: .* stream 0x6000, which belongs to cuda:1"):
        _frontend.patch_moment_vjp(grad_S, FakeCudaArray((1, 2, 4, 4), ptr=0x20000000), 3,
                                   grad_mu=FakeCudaArray((1, 2, 4, 4), ptr=0x40000000),
                                   backend="fake_cuda")


def test_cuda_arrays_without_gpu_backend_give_clear_error(monkeypatch):
    monkeypatch.delenv("CONVCOV_BACKEND", raising=False)
    if any(_registry.get(n).unavailable_reason() is None and _registry.get(n).device == "cuda"
           for n in _registry.AUTO["cuda"]):
        pytest.skip("a GPU backend is usable here")
    out = FakeCudaArray((1, 2, 2, 2, 2, 2, 2), ptr=0x10000000)
    mu = FakeCudaArray((1, 2, 4, 4), ptr=0x20000000)
    with pytest.raises(BackendError, match="automatic choice \\(cupy, numba_cuda\\)"):
        convcov.accumulate(out, None, mu, 1.0, 3)


def test_backends_listing():
    rows = convcov.backends()
    names = [r.name for r in rows]
    assert names[:4] == ["numpy", "numba", "numba_cuda", "cupy"]
    by = {r.name: r for r in rows}
    assert by["numpy"].available and by["numpy"].device == "cpu" and by["numpy"].reason == ""
    for r in rows:
        assert r.available == (r.reason == ""), r


def test_entry_point_plugin(tmp_path):
    """A third-party backend registers through the ``convcov.backends`` entry-point group."""
    (tmp_path / "myplug.py").write_text(textwrap.dedent("""
        import convcov
        class Plug(convcov.Backend):
            name, device = "myplug", "cpu"
            def accumulate(self, p):
                p.out[...] += 1
        backend = Plug()
    """))
    dist = tmp_path / "myplug-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: myplug\nVersion: 1.0\n")
    # a second entry point with a built-in's name: ignored, with a warning
    (dist / "entry_points.txt").write_text(
        "[convcov.backends]\nmyplug = myplug:backend\nnumpy = myplug:backend\n")
    code = textwrap.dedent("""
        import warnings
        import numpy as np, convcov
        ref = np.zeros((1, 1, 1, 1, 1, 1))  # mu = 3: the reference gives 9, the plug-in 1
        convcov.accumulate(ref, None, np.full((1, 1, 1, 1), 3.0), 1.0, 1, backend="numpy")
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            assert "myplug" in [b.name for b in convcov.backends()]
        assert any("'numpy'" in str(w.message) and "ignored" in str(w.message)
                   for w in seen), [str(w.message) for w in seen]
        out = np.zeros((1, 1, 1, 1, 1, 1))
        convcov.accumulate(out, None, np.ones((1, 1, 1, 1)), 1.0, 1, backend="myplug")
        assert out.sum() == 1, out
        again = np.zeros((1, 1, 1, 1, 1, 1))  # "numpy" is still the reference
        convcov.accumulate(again, None, np.full((1, 1, 1, 1), 3.0), 1.0, 1, backend="numpy")
        assert (again == ref).all() and ref.sum() == 9, (again, ref)
        print("ok")
    """)
    env = dict(os.environ, PYTHONPATH=f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert res.returncode == 0 and res.stdout.strip() == "ok", res.stderr


def test_import_pulls_in_no_framework():
    """``import convcov`` and a host call import neither torch, cupy nor numba.cuda."""
    code = textwrap.dedent("""
        import sys, numpy as np, convcov
        convcov.accumulate(np.zeros((1, 1, 1, 1, 1, 1)), None, np.ones((1, 1, 1, 1)), 1.0, 1,
                           backend="numpy")
        heavy = [m for m in ("torch", "cupy", "numba", "numba.cuda", "jax") if m in sys.modules]
        print(",".join(heavy))
    """)
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == ""


def test_automatic_host_call_does_not_import_gpu_libraries():
    code = textwrap.dedent("""
        import sys, numpy as np, convcov
        convcov.accumulate(np.zeros((1, 1, 1, 1, 1, 1)), None, np.ones((1, 1, 1, 1)), 1.0, 1)
        print(",".join(m for m in ("torch", "cupy", "numba.cuda") if m in sys.modules))
    """)
    env = {k: v for k, v in os.environ.items() if k != "CONVCOV_BACKEND"}
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == ""


@pytest.mark.skipif(not HAS_TORCH, reason="torch not installed")
def test_torch_cpu_tensors_zero_copy_and_requires_grad():
    import torch

    rng = np.random.default_rng(3)
    out_np = rng.standard_normal((2, 4, 3, 3, 4, 3, 3))
    out = torch.from_numpy(out_np.copy())
    gamma = torch.from_numpy(rng.random((2, 2, 5, 5, 2, 5, 5)))
    mu = torch.from_numpy(rng.standard_normal((2, 2, 5, 5))).requires_grad_(True)
    c = torch.from_numpy(rng.random(4))
    ptr = out.data_ptr()
    res = convcov.accumulate(out, gamma, mu, c, 3, backend="numpy")
    assert res is out and out.data_ptr() == ptr
    want = convcov.accumulate(out_np.copy(), gamma.numpy(), mu.detach().numpy(), c.numpy(), 3,
                              backend="numpy")
    # an in-place op with an input that requires grad: out now carries that history
    assert out.requires_grad and out.grad_fn is not None
    # (recorded: S, then torch's fused multiply-add into out: within an ulp of the reference)
    np.testing.assert_allclose(out.detach().numpy(), want, rtol=1e-14, atol=1e-14)
    # a non-contiguous view of a larger tensor is written in place
    big = torch.zeros(2, 8, 3, 3, 8, 3, 3, dtype=torch.float64)
    view = big[:, ::2, :, :, ::2]
    convcov.accumulate(view, gamma, mu, c, 3, backend="numpy")
    delta = convcov.accumulate(np.zeros_like(out_np), gamma.numpy(), mu.detach().numpy(),
                               c.numpy(), 3, backend="numpy")
    np.testing.assert_array_equal(view.detach().numpy(), delta)
    assert big[:, 1::2].abs().sum() == 0
