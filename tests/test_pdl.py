"""Programmatic dependent launch (convcov/backends/_pdl.py): when a plan uses it, how a
launch is configured, and, on a GPU of compute capability 9.0 or later, that numba_cuda's
dependent launches give the same bits as plain ones and the right result: calls queued
back to back on a non-default stream into the same ``out``, after a copy into ``out`` on
that stream (each call's first kernel must wait for what came before it, and the kernels
behind it must see it)."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest

import convcov
from convcov import _frontend, _registry
from convcov.backends import _pdl

from kinds import SIM, to_f64, tolerance, torch_cuda

HAS_BINDINGS = importlib.util.find_spec("cuda") is not None and (
    importlib.util.find_spec("cuda.bindings") is not None)


def test_usable_from_compute_capability_9_with_the_binding(monkeypatch):
    monkeypatch.setattr(_pdl, "ENABLED", True)
    assert not _pdl.usable(8)
    assert _pdl.usable(9) == HAS_BINDINGS
    assert _pdl.usable(10) == HAS_BINDINGS
    monkeypatch.setattr(_pdl, "ENABLED", False)
    assert not _pdl.usable(9)


@pytest.mark.skipif(not HAS_BINDINGS, reason="cuda.bindings is not installed")
def test_launch_configuration():
    _pdl.usable(9)  # imports the binding
    d = _pdl._drv
    cfg = _pdl.Launcher(0x1234, 77, 256)._config()
    assert (cfg.gridDimX, cfg.gridDimY, cfg.gridDimZ) == (77, 1, 1)
    assert (cfg.blockDimX, cfg.blockDimY, cfg.blockDimZ) == (256, 1, 1)
    assert cfg.sharedMemBytes == 0 and cfg.numAttrs == 1
    attr = cfg.attrs[0]
    assert attr.id == d.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
    assert attr.value.programmaticStreamSerializationAllowed == 1


def _hopper():
    if SIM or not torch_cuda():
        return False
    import torch

    return torch.cuda.get_device_capability()[0] >= 9


GPU_BACKENDS = [n for n in ("numba_cuda",)
                if _registry.get(n).unavailable_reason() is None
                and _registry.get(n).device == "cuda"]
hopper = pytest.mark.skipif(not (_hopper() and HAS_BINDINGS and GPU_BACKENDS),
                            reason="needs a GPU of compute capability >= 9.0, torch with CUDA, "
                            "cuda.bindings and a GPU backend")


def _three_launches(monkeypatch):
    """Force the three-launch path (the only one with dependent launches) and forget the
    plans and bound launchers, which remember whether their launches are dependent."""
    from convcov.backends import numba_cuda as mod

    monkeypatch.setattr(mod, "DIRECT_TERMS", -1)
    monkeypatch.setattr(mod, "DIRECT_RATIO", 0)
    monkeypatch.setattr(mod, "_plans", {})
    monkeypatch.setattr(_frontend, "_bound", {})
    return mod


def _problem(dtype):
    """A three-launch problem on the GPU in ``dtype``: (gamma, mu, c, out0 as float64
    numpy, kernel size); gamma full, with its channel-diagonal random."""
    import torch

    rng = np.random.default_rng(7)
    B, Ci, Co, H, k = 3, 5, 6, 11, 3
    HW = H * H
    g = rng.standard_normal((B, Ci, HW, HW)) * 0.1
    gamma64 = np.zeros((B, Ci, H, H, Ci, H, H))
    for ci in range(Ci):
        gamma64[:, ci, :, :, ci] = g[:, ci].reshape(B, H, H, H, H)
    mu64 = rng.standard_normal((B, Ci, H, H))
    c64 = rng.random(Co)
    Ho = H - k + 1
    out64 = rng.standard_normal((B, Co, Ho, Ho, Co, Ho, Ho))
    gamma, mu, c = (torch.from_numpy(a).to("cuda", getattr(torch, dtype))
                    for a in (gamma64, mu64, c64))
    return gamma, mu, c, out64, k


@hopper
@pytest.mark.parametrize("name", GPU_BACKENDS)
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_dependent_launches_give_the_same_bits(monkeypatch, name, dtype):
    import torch

    mod = _three_launches(monkeypatch)
    gamma, mu, c, out64, k = _problem(dtype)
    Ci, calls, dev = mu.shape[1], 4, torch.device("cuda")
    results = {}
    for pdl in (False, True, False, True):
        monkeypatch.setattr(_pdl, "ENABLED", pdl)
        mod._plans.clear()
        _frontend._bound.clear()
        src = torch.from_numpy(out64).to(dev, getattr(torch, dtype))
        out = torch.zeros_like(src)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # queued back to back, no wait between the calls
            torch.cuda._sleep(2_000_000)  # the launches are queued before the copy is done
            out.copy_(src)
            for _ in range(calls):
                convcov.accumulate(out, gamma, mu, c, k, backend=name)
        torch.cuda.current_stream().wait_stream(side)
        plans = list(mod._plans.values())
        assert len(plans) == 1 and len(plans[0].launches) == 3
        assert [ln.ex is not None for ln in plans[0].launches] == [False, pdl, pdl]
        got = to_f64(out)
        if pdl in results:
            assert np.array_equal(got, results[pdl], equal_nan=True), "not deterministic"
        results[pdl] = got
    assert np.array_equal(results[True], results[False], equal_nan=True)
    # ... and right: each call added c * S once more (the numpy reference, float64).
    g64, m64, cc64 = to_f64(gamma), to_f64(mu), to_f64(c)
    out0 = to_f64(torch.from_numpy(out64).to(getattr(torch, dtype)))
    step, bound = np.zeros_like(out0), np.zeros_like(out0)
    convcov.accumulate(step, g64, m64, cc64, k, backend="numpy")
    convcov.accumulate(bound, np.abs(g64), np.abs(m64), np.abs(cc64), k, backend="numpy")
    tol = calls * tolerance(np.abs(out0) + calls * bound, Ci * k * k, "float32", dtype)
    assert np.all(np.abs(results[True] - (out0 + calls * step)) <= tol)


@hopper
@pytest.mark.parametrize("name", GPU_BACKENDS)
def test_dependent_launches_in_a_cuda_graph(monkeypatch, name):
    """Captured in a CUDA graph (the dependent launches become programmatic edges) and
    replayed on new data: the same bits as plain launches, eagerly."""
    import torch

    mod = _three_launches(monkeypatch)
    monkeypatch.setattr(_pdl, "ENABLED", True)
    gamma, mu, c, out64, k = _problem("float32")
    out0 = torch.from_numpy(out64).to("cuda", torch.float32)
    out = out0.clone()

    def calls():
        for _ in range(2):
            convcov.accumulate(out, gamma, mu, c, k, backend=name)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compile, plan and bind before the capture
        calls()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        calls()
    (plan,) = mod._plans.values()
    assert [ln.ex is not None for ln in plan.launches] == [False, True, True]
    with torch.no_grad():
        out.copy_(out0)
        mu.mul_(0.5).add_(0.25)
    graph.replay()
    torch.cuda.synchronize()
    got = to_f64(out)

    monkeypatch.setattr(_pdl, "ENABLED", False)
    mod._plans.clear()
    _frontend._bound.clear()
    want = out0.clone()
    for _ in range(2):
        convcov.accumulate(want, gamma, mu, c, k, backend=name)
    assert np.array_equal(got, to_f64(want), equal_nan=True)
    assert not np.array_equal(got, to_f64(out0))  # the replay did add
