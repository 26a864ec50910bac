"""``convcov.plot`` and the command line's pictures: ``convcov bench --plot`` and
``convcov plot FILE.json -o PATH``; also the line progress ``bench`` prints when its output
is not a terminal. Bars are checked against the rows they are drawn from."""

from __future__ import annotations

import json
import math
import sys

import pytest

from convcov import cli, plot


@pytest.fixture
def rich():
    """The command line needs rich (the bench extra); the drawing itself does not."""
    return pytest.importorskip("rich", reason="the convcov command needs rich")


def _run(device, rows):
    return {"date": "2026-01-01T00:00:00+00:00", "device": device, "machine": "test box",
            "copy_bandwidth_GBps": 100.0,
            "rows": [dict(workload=w, impl=i, median_us=10.0, floor_us=10.0 * f, fraction=f,
                          rel_error=None, calls=5) for w, i, f in rows]}


CPU = _run("cpu", [("toy", "numpy", 0.05), ("toy", "numba", 0.4), ("toy", "torch", 0.01),
                   ("cpu", "numpy", 0.1), ("cpu", "numba", 0.8),
                   ("cpu", "torch (failed: RuntimeError: boom)", math.nan)])
CUDA = _run("cuda", [("mid", "cupy", 0.9), ("mid", "torch.compile", 0.2)])


def test_runs_accepts_every_result_shape():
    assert plot.runs(CPU) == [CPU]
    assert plot.runs({"runs": [CPU, CUDA]}) == [CPU, CUDA]
    assert plot.runs([CPU, {"runs": [CUDA]}]) == [CPU, CUDA]
    with pytest.raises(ValueError, match="not a convcov bench result"):
        plot.runs({"date": "x"})


def test_bars_are_the_rows_fractions():
    pytest.importorskip("matplotlib", reason="drawing needs matplotlib")
    fig = plot.figure({"runs": [CPU, CUDA]})
    cpu_ax, cuda_ax = fig.axes
    tops = sorted(round(p.get_y() + p.get_height(), 6) for p in cpu_ax.patches)
    assert tops == [0.01, 0.05, 0.1, 0.4, 0.8]  # the failed row has no bar ...
    assert "failed" in [t.get_text() for t in cpu_ax.texts]  # ... but is marked
    assert [t.get_text() for t in cpu_ax.get_xticklabels()] == ["toy", "cpu"]
    assert sorted(round(p.get_y() + p.get_height(), 6) for p in cuda_ax.patches) == [0.2, 0.9]
    # one colour per implementation across panels; backends before the torch baselines
    legend = [t.get_text() for t in fig.legends[0].get_texts()]
    assert legend == ["numpy", "numba", "cupy", "torch", "torch.compile"]
    numba = [p for p in cpu_ax.patches if abs(p.get_y() + p.get_height() - 0.4) < 1e-9][0]
    assert numba.get_facecolor() == fig.legends[0].get_patches()[1].get_facecolor()


def test_plot_command_from_saved_json(rich, tmp_path, capsys):
    pytest.importorskip("matplotlib", reason="drawing needs matplotlib")
    a, b, png = tmp_path / "cpu.json", tmp_path / "gpu.json", tmp_path / "out.png"
    a.write_text(json.dumps(CPU))
    b.write_text(json.dumps({"runs": [CUDA]}))
    cli.main(["plot", str(a), str(b), "-o", str(png)])
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"wrote {png}" in capsys.readouterr().out.replace("\n", "")


def test_plot_command_rejects_a_file_that_is_no_result(rich, tmp_path):
    pytest.importorskip("matplotlib", reason="drawing needs matplotlib")
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    with pytest.raises(SystemExit, match="not a convcov bench result"):
        cli.main(["plot", str(bad), "-o", str(tmp_path / "x.png")])


def test_bench_plot_and_line_progress(rich, tmp_path, capsys):
    pytest.importorskip("matplotlib", reason="drawing needs matplotlib")
    png = tmp_path / "bench.svg"
    cli.main(["bench", "--device", "cpu", "--workload", "toy", "--backend", "numpy",
              "--no-torch", "--repeat", "3", "--budget", "0.1", "--plot", str(png)])
    assert png.read_text().lstrip().startswith("<?xml")
    out = capsys.readouterr().out
    assert "[1/1] toy / numpy ..." in out  # captured output is no terminal: line progress


def test_bench_plot_without_matplotlib_fails_before_running(rich, monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    monkeypatch.setattr("convcov.bench.run", lambda *a, **k: pytest.fail("bench ran"))
    with pytest.raises(SystemExit, match=r"convcov\[plot\]"):
        cli.main(["bench", "--device", "cpu", "--plot", str(tmp_path / "x.png")])


def test_the_layers_suite_ends_with_its_geometric_mean():
    """A run of both suites is two panels; the layers panel has a group per layer and a
    last group of each implementation's geometric mean over the layers it ran on."""
    pytest.importorskip("matplotlib", reason="drawing needs matplotlib")
    run = _run("cuda", [("toy", "cupy", 0.5), ("r20-16", "cupy", 0.5), ("r20-16", "torch", 0.1),
                        ("mb-dw", "cupy", 0.125), ("mb-dw", "torch (failed: boom)", math.nan)])
    run["workloads"] = [dict(name="toy", suite="reference"),
                        dict(name="r20-16", suite="layers"), dict(name="mb-dw", suite="layers")]
    fig = plot.figure(run)
    ref_ax, layers_ax = fig.axes
    assert [t.get_text() for t in ref_ax.get_xticklabels()] == ["toy"]
    labels = [t.get_text() for t in layers_ax.get_xticklabels()]
    assert labels[:2] == ["r20-16", "mb-dw"] and labels[2].startswith("geomean")
    assert "of those run" in labels[2]  # torch failed on one layer
    tops = sorted(round(p.get_y() + p.get_height(), 6) for p in layers_ax.patches)
    # the layers' bars, then cupy's geomean sqrt(0.5 * 0.125) = 0.25 and torch's 0.1
    assert tops == [0.1, 0.1, 0.125, 0.25, 0.5]
    assert plot.geomeans(run["rows"][1:]) == {"cupy": (pytest.approx(0.25), 2),
                                              "torch": (pytest.approx(0.1), 1)}
