"""The ``convcov`` command line: ``info`` lists the backends, ``bench`` checks and times
(here only that it runs and reports a correct result: timings are never asserted)."""

from __future__ import annotations

import json

import pytest

from convcov import cli

pytest.importorskip("rich")


def test_info(capsys):
    cli.main(["info"])
    text = capsys.readouterr().out
    for name in ("numpy", "numba", "numba_cuda", "cupy"):
        assert name in text


def test_bench_toy_json(tmp_path, capsys):
    path = tmp_path / "r.json"
    cli.main(["bench", "--device", "cpu", "--workload", "toy", "--backend", "numpy",
              "--no-torch", "--repeat", "3", "--budget", "0.1", "--json", str(path)])
    result = json.loads(path.read_text())
    (row,) = result["rows"]
    assert row["workload"] == "toy" and row["impl"] == "numpy" and row["calls"] == 3
    assert row["rel_error"] < 1e-6
    assert row["median_us"] > 0 and row["fraction"] == pytest.approx(
        row["floor_us"] / row["median_us"])
    assert result["copy_bandwidth_GBps"] > 0
    assert "toy" in capsys.readouterr().out


def test_bench_says_which_backends_it_left_out(tmp_path, capsys, monkeypatch):
    """A backend that cannot run here is named with its reason, in the JSON and on screen,
    rather than silently missing from the table."""
    from convcov import _registry

    numba = _registry.get("numba")
    monkeypatch.setattr(numba, "unavailable_reason", lambda: "numba: broken on purpose")
    path = tmp_path / "r.json"
    cli.main(["bench", "--device", "cpu", "--workload", "toy", "--backend", "numpy",
              "--backend", "numba", "--backend", "cupy", "--no-torch", "--repeat", "3",
              "--budget", "0.1", "--json", str(path)])
    result = json.loads(path.read_text())
    assert [r["impl"] for r in result["rows"]] == ["numpy"]
    left = {s["backend"]: s["reason"] for s in result["not_measured"]}
    assert left["numba"] == "numba: broken on purpose"
    assert left["cupy"]  # another device's backend, asked for by name: said why
    screen = capsys.readouterr().out
    assert "not measured: numba: numba: broken on purpose" in screen


def test_bench_rejects_unknown_device():
    with pytest.raises(SystemExit):
        cli.main(["bench", "--device", "tpu"])


def test_bench_grad_rows(tmp_path):
    pytest.importorskip("torch")
    path = tmp_path / "r.json"
    cli.main(["bench", "--device", "cpu", "--workload", "toy", "--backend", "numpy",
              "--no-torch", "--grad", "--repeat", "3", "--budget", "0.1", "--json", str(path)])
    rows = {r["impl"]: r for r in json.loads(path.read_text())["rows"]}
    assert set(rows) == {"numpy", "numpy fwd+bwd"}  # a failed row would be named "(failed..."
    fwd, both = rows["numpy"], rows["numpy fwd+bwd"]
    assert both["calls"] == 3 and both["median_us"] > 0
    # The backward's least bytes come on top of the forward's (bench.Workload).
    assert both["floor_us"] > fwd["floor_us"]


def test_bench_rounds_option(tmp_path):
    path = tmp_path / "r.json"
    cli.main(["bench", "--device", "cpu", "--workload", "toy", "--backend", "numpy",
              "--no-torch", "--repeat", "4", "--budget", "0.1", "--rounds", "2",
              "--json", str(path)])
    result = json.loads(path.read_text())
    assert result["rounds"] == 2 and result["rows"][0]["calls"] == 4
    for bad in (["--rounds", "0"], ["--repeat", "0"]):  # refused before anything runs
        with pytest.raises(SystemExit):
            cli.main(["bench", "--device", "cpu", *bad])


def test_bench_layers_suite(tmp_path, capsys, monkeypatch):
    """Two layers of the layers suite, with the torch baselines: rows, each backend's
    speed-up, the summary (JSON and on screen) and the picture. torch.compile is stood in
    for by the eager expression (compiling takes a minute on a small host; the bench's
    own tests compile for real)."""
    pytest.importorskip("torch")
    pytest.importorskip("matplotlib", reason="drawing needs matplotlib")
    import torch

    from convcov import bench

    monkeypatch.setattr(torch, "compile", lambda fn, **kwargs: fn)
    monkeypatch.setattr(bench._Host, "copy_bandwidth", lambda self: 2e10)
    path, png = tmp_path / "r.json", tmp_path / "r.png"
    cli.main(["bench", "--device", "cpu", "--suite", "layers", "--workload", "r20-short",
              "--workload", "grp8", "--backend", "numpy", "--repeat", "2",
              "--budget", "0.01", "--json", str(path), "--plot", str(png)])
    result = json.loads(path.read_text())
    assert result["suite"] == "layers"
    assert [(w["name"], w["suite"], w["B"]) for w in result["workloads"]] == [
        ("r20-short", "layers", 2), ("grp8", "layers", 2)]
    rows = {(r["workload"], r["impl"]): r for r in result["rows"]}
    assert set(rows) == {(w, i) for w in ("r20-short", "grp8")
                         for i in ("numpy", "torch", "torch.compile")}
    assert all(r["calls"] == 2 and r["rel_error"] < 1e-5 for r in rows.values())
    s = result["summary"]["layers"]
    assert s["workloads"] == ["r20-short", "grp8"]
    numpy = s["impls"]["numpy"]
    assert numpy["speedup"]["per_workload"] == {
        w: rows[w, "numpy"]["speedup"] for w in ("r20-short", "grp8")}
    assert numpy["fraction"]["worst"] == min(rows[w, "numpy"]["fraction"]
                                             for w in ("r20-short", "grp8"))
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    screen = capsys.readouterr().out
    assert "suite layers: 2 workloads" in screen and "× torch" in screen


def test_bench_rejects_a_workload_not_in_the_suite(monkeypatch):
    monkeypatch.setattr("convcov.bench.run", lambda *a, **k: pytest.fail("bench ran"))
    with pytest.raises(SystemExit, match="unknown workload 'toy' in suite 'layers'"):
        cli.main(["bench", "--device", "cpu", "--suite", "layers", "--workload", "toy"])
    with pytest.raises(SystemExit):
        cli.main(["bench", "--device", "cpu", "--suite", "nope"])
