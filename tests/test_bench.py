"""The bench's timing schedule (convcov.bench._rows): the rows' calls interleaved in
rounds, the order reversed every other round, ``repeat`` calls in all, failures as rows.
A stand-in device records the schedule; no time is measured or asserted."""

from __future__ import annotations

import math

import pytest

from convcov import bench

TOY = next(w for w in bench.WORKLOADS if w.name == "toy")


class Recorder:
    """A device whose time_calls runs each call ``repeat`` times and records who asked."""

    def __init__(self):
        self.log = []

    def time_calls(self, fn, repeat, budget_s, least=5):
        self.log.append((fn.__name__, repeat, budget_s, least))
        for _ in range(repeat):
            fn()
        return [1e-3] * repeat


def named(name, counter):
    def call():
        counter[name] = counter.get(name, 0) + 1

    call.__name__ = name
    return call


def test_rounds_interleave_and_share_out_repeat():
    dev, count = Recorder(), {}
    calls = {"a": (named("a", count), lambda: 0.5), "b": (named("b", count), None)}
    rows = bench._rows(dev, TOY, calls, 1e-4, repeat=7, budget_s=3.0, rounds=3)
    assert [e[0] for e in dev.log] == ["a", "b", "b", "a", "a", "b"]
    assert [e[1] for e in dev.log] == [3, 3, 2, 2, 2, 2]  # 7 = 3 + 2 + 2 for each
    assert all(e[2] == 1.0 and e[3] == 2 for e in dev.log)  # budget and least per round
    assert count == {"a": 3 + 7, "b": 3 + 7}  # three warm-up calls, then the timed ones
    assert [(r.impl, r.calls, r.rel_error) for r in rows] == [("a", 7, 0.5), ("b", 7, None)]
    assert rows[0].median_us == 1e3 and rows[0].fraction == 0.1


def test_one_round_is_one_row_after_another():
    dev = Recorder()
    calls = {n: (named(n, {}), None) for n in "abc"}
    bench._rows(dev, TOY, calls, 1e-4, repeat=4, budget_s=1.0, rounds=1)
    assert dev.log == [("a", 4, 1.0, 5), ("b", 4, 1.0, 5), ("c", 4, 1.0, 5)]


def test_more_rounds_than_calls():
    dev = Recorder()
    rows = bench._rows(dev, TOY, {"a": (named("a", {}), None)}, 1e-4, repeat=2,
                       budget_s=1.0, rounds=5)
    assert [e[1] for e in dev.log] == [1, 1] and rows[0].calls == 2


def test_a_row_that_fails_is_never_timed_again():
    dev = Recorder()

    def fails_in_round_two():
        if sum(e[0] == "t" for e in dev.log) == 2:
            raise RuntimeError("broke")

    fails_in_round_two.__name__ = "t"
    rows = bench._rows(dev, TOY, {"t": (fails_in_round_two, None), "ok": (named("ok", {}), None)},
                       1e-4, repeat=6, budget_s=1.0, rounds=3)
    assert [e[0] for e in dev.log] == ["t", "ok", "ok", "t", "ok"]  # no "t" in round 3
    assert "broke" in rows[0].impl and rows[1].calls == 6


def test_a_failed_row_does_not_keep_the_arrays_alive():
    """The workload's arrays must go when the caller drops them, without waiting for the
    garbage collector: a kept exception's traceback would hold the frames that hold them."""
    import gc
    import weakref

    import numpy as np

    arr = np.ones(10)
    gone = weakref.ref(arr)

    def call(x=arr):
        raise RuntimeError(x.shape)

    gc.disable()
    try:
        rows = bench._rows(Recorder(), TOY, {"x": (call, None)}, 1e-4, repeat=2, budget_s=1.0,
                           rounds=1)
        del arr, call
        assert gone() is None and "RuntimeError: (10,)" in rows[0].impl
    finally:
        gc.enable()


def test_progress_advances_once_a_row():
    class Progress:
        advanced = 0

        def update(self, task, description=""):
            pass

        def advance(self, task):
            self.advanced += 1

    p = Progress()
    calls = {n: (named(n, {}), None) for n in "abc"}
    bench._rows(Recorder(), TOY, calls, 1e-4, repeat=2, budget_s=1.0, rounds=2, progress=p,
                task=0)
    assert p.advanced == 3


def test_failures_are_rows_and_the_others_still_run():
    def broken_check():
        raise RuntimeError("check broke")

    def breaks_when_timed():
        if len(dev.log) > 1:
            raise RuntimeError("timing broke")

    breaks_when_timed.__name__ = "t"
    dev = Recorder()
    calls = {"c": (named("c", {}), broken_check), "t": (breaks_when_timed, None),
             "ok": (named("ok", {}), None)}
    rows = bench._rows(dev, TOY, calls, 1e-4, repeat=4, budget_s=1.0, rounds=2)
    by = {r.impl.split(" ")[0]: r for r in rows}
    assert [r.impl.split(" ")[0] for r in rows] == ["c", "t", "ok"]  # the given order
    assert "RuntimeError: check broke" in by["c"].impl and math.isnan(by["c"].median_us)
    assert "RuntimeError: timing broke" in by["t"].impl and by["t"].calls == 0
    assert by["ok"].calls == 4 and by["ok"].impl == "ok"
    assert "c" not in [e[0] for e in dev.log]  # a failed check is never timed


def test_backends_and_torch_baselines_are_interleaved_apart(monkeypatch):
    """The torch baselines' calls never sit between two backends' blocks (their heavy
    calls leave a GPU power-capped for what follows): two groups, in the table's order."""
    groups, real = [], bench._rows

    def spy(dev, w, calls, *args, **kwargs):
        groups.append(list(calls))
        return real(dev, w, calls, *args, **kwargs)

    def nothing(out, gamma, mu, c, w):
        pass

    monkeypatch.setattr(bench, "_rows", spy)
    monkeypatch.setattr(bench, "_impls", lambda dev, backends, with_torch: dict.fromkeys(
        ("numpy", "torch", "numba", "torch.compile"), nothing))
    result = bench.run("cpu", ["toy"], repeat=2, budget_s=0.01, rounds=2)
    assert groups == [["numpy", "numba"], ["torch", "torch.compile"]]
    assert [r["impl"] for r in result["rows"]] == ["numpy", "numba", "torch", "torch.compile"]
    assert result["rounds"] == 2 and all(r["calls"] == 2 for r in result["rows"])
    # The host's default is one row after another (bench._Host.rounds); the GPU's is 5.
    assert bench.run("cpu", ["toy"], repeat=2, budget_s=0.01)["rounds"] == 1
    assert bench._Cuda.rounds == 5


def test_gradient_rows_are_grouped_too(monkeypatch):
    pytest.importorskip("torch")
    groups, real = [], bench._rows

    def spy(dev, w, calls, *args, **kwargs):
        groups.append(list(calls))
        return real(dev, w, calls, *args, **kwargs)

    def nothing(*args):
        pass

    monkeypatch.setattr(bench, "_rows", spy)
    monkeypatch.setattr(bench, "_impls", lambda dev, backends, with_torch: {"numpy": nothing})
    monkeypatch.setattr(bench, "_grad_impls", lambda dev, backends, with_torch: dict.fromkeys(
        ("numpy fwd+bwd", "torch.compile fwd+bwd", "numba fwd+bwd"), nothing))
    bench.run("cpu", ["toy"], repeat=2, budget_s=0.01, rounds=2, grad=True)
    assert groups == [["numpy"], [], ["numpy fwd+bwd", "numba fwd+bwd"],
                      ["torch.compile fwd+bwd"]]


def test_the_recorded_rounds_are_the_rounds_used():
    assert bench.run("cpu", ["toy"], ["numpy"], False, repeat=2, budget_s=0.01,
                     rounds=5)["rounds"] == 2


def test_the_host_cpu_is_named(monkeypatch, tmp_path):
    """The host's processor model comes from /proc/cpuinfo where there is one (this
    project's machines changed model between two days: docs/performance.md, "Host"), and
    from platform where not; the table names it beside a GPU."""
    import builtins

    fake = tmp_path / "cpuinfo"
    fake.write_text("processor\t: 0\nvendor_id\t: GenuineIntel\n"
                    "model name\t: Intel(R) Xeon(R) Processor\nflags\t: fpu\n")
    real_open = builtins.open
    monkeypatch.setattr(builtins, "open", lambda f, *a, **k: real_open(
        fake if f == "/proc/cpuinfo" else f, *a, **k))
    monkeypatch.setattr(bench.os, "cpu_count", lambda: 2)
    assert bench.host_cpu() == "Intel(R) Xeon(R) Processor, 2 cores"
    assert bench._Host().describe() == bench.host_cpu()

    def missing(f, *a, **k):
        if f == "/proc/cpuinfo":
            raise FileNotFoundError(f)
        return real_open(f, *a, **k)

    monkeypatch.setattr(builtins, "open", missing)
    monkeypatch.setattr(bench.platform, "processor", lambda: "arm")
    assert bench.host_cpu() == "arm, 2 cores"

    from rich.console import Console
    result = dict(machine="NVIDIA H200, 132 SMs, 139 GiB", host="Xeon, 2 cores",
                  date="2026-12-01", copy_bandwidth_GBps=4000.0, rows=[])
    console = Console(record=True, width=200)
    console.print(bench.table(result))
    assert "NVIDIA H200, 132 SMs, 139 GiB (host: Xeon, 2 cores)" in console.export_text()
