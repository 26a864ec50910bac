"""A/B/C in one process: cupy's bound launcher plain (REPLAY off), replayed as one chain,
and replayed as two batch halves on two graph branches (REPLAY_SPLIT_BYTES = 0: every call of B >= 2; run on 2026-12-01 with
the equivalent first knob, REPLAY_SPLIT_B = 2); bench timing
(convcov.bench.run: CUDA events around whole calls after an empty queue), rotating the
order; plus a bits check of the three ways on every shape."""
import statistics
import sys

import torch

import convcov
from convcov import _frontend, bench
from convcov.backends import cupy as cb

EXTRA = [bench.Workload("mid-B8", 8, 32, 32, 16, 3, "full", "float32", "cuda"),
         bench.Workload("mid-B4", 4, 32, 32, 16, 3, "full", "float32", "cuda"),
         bench.Workload("cpu-gpu", 8, 16, 16, 16, 3, "full", "float32", "cuda"),
         bench.Workload("diag-B16", 16, 32, 32, 16, 3, "diag", "float32", "cuda"),
         bench.Workload("mid-f16", 16, 32, 32, 16, 3, "full", "float16", "cuda")]
bench.WORKLOADS.extend(EXTRA)
NAMES = ["mid"] + [w.name for w in EXTRA]
WAYS = {"plain": (False, 1 << 62), "one": (True, 1 << 62), "two": (True, 0)}


def setway(way):
    cb.REPLAY, cb.REPLAY_SPLIT_BYTES = WAYS[way]
    _frontend._bound.clear()


def bits():
    dev = bench._Cuda()
    for name in NAMES:
        w = next(x for x in bench.WORKLOADS if x.name == name)
        a = bench._inputs(dev, w)
        res = {}
        for way in WAYS:
            setway(way)
            out = a["out"].clone()
            for _ in range(5):
                convcov.accumulate(out, a["gamma"], a["mu"], a["c"], 3, backend="cupy")
            torch.cuda.synchronize()
            res[way] = out
        print(name, "bits equal one/two vs plain:", torch.equal(res["plain"], res["one"]),
              torch.equal(res["plain"], res["two"]), flush=True)
        assert torch.equal(res["plain"], res["one"]) and torch.equal(res["plain"], res["two"])
        del a, res


def ab(n):
    got = {(way, name): [] for way in WAYS for name in NAMES}
    order = list(WAYS)
    for i in range(n):
        for way in order[i % 3:] + order[:i % 3]:
            setway(way)
            r = bench.run(device="cuda", workloads=NAMES, backends=["cupy"], with_torch=False,
                          repeat=60, budget_s=0.6)
            for row in r["rows"]:
                got[way, row["workload"]].append(row["median_us"])
            print(i, way, round(r["copy_bandwidth_GBps"]),
                  {row["workload"]: (round(row["median_us"], 1), round(row["fraction"], 3))
                   for row in r["rows"]}, flush=True)
    for name in NAMES:
        print(name, {way: (round(statistics.median(got[way, name]), 1),
                           [round(x, 1) for x in got[way, name]]) for way in WAYS}, flush=True)


if __name__ == "__main__":
    print(torch.__version__, torch.cuda.get_device_name(0), flush=True)
    bits()
    ab(int(sys.argv[1]) if len(sys.argv) > 1 else 4)
