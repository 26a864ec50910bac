"""A/B of the bound launcher's graph replays (cupy.REPLAY) on toy and mid, same process,
bench timing (convcov.bench.run), alternating; plus a bitwise check against plain launches.
Run (2026-12-01 10:09 UTC) on the one-chain replays, before REPLAY_SPLIT_BYTES existed;
with the final code, REPLAY = True also splits mid's batch (split_ab.py compares both)."""
import json
import statistics
import sys
import time

import torch

import convcov
from convcov import _frontend, bench
from convcov.backends import cupy as cb


def bits_check():
    dev = bench._Cuda()
    for name in ("toy", "mid"):
        w = next(x for x in bench.WORKLOADS if x.name == name)
        a = bench._inputs(dev, w)
        res = {}
        for flag in (False, True):
            cb.REPLAY = flag
            _frontend._bound.clear()
            for c in (a["c"], 0.75, -0.0, 0.0):
                out = a["out"].clone()
                for _ in range(5):
                    convcov.accumulate(out, a["gamma"], a["mu"], c, 3, backend="cupy")
                torch.cuda.synchronize()
                res[(flag, str(c) if not torch.is_tensor(c) else "t")] = out
            ngraphs = [len(b.run.replays[0].graphs) if getattr(b.run, "replays", [None])[0]
                       else 0 for b in _frontend._bound.values() if b is not None]
            print(name, "REPLAY", flag, "graphs per launcher", ngraphs, flush=True)
        for k in ("t", "0.75", "-0.0", "0.0"):
            eq = torch.equal(res[(False, k)], res[(True, k)])
            print(name, "c", k, "bitwise equal plain vs replay:", eq, flush=True)
            assert eq
        print(name, "-0.0 vs 0.0 differ in sign bits (expected if out has -0):",
              torch.equal(res[(True, "-0.0")].view(torch.int32), res[(True, "0.0")].view(torch.int32)))


def ab(n):
    table = []
    for i in range(n):
        for flag in ((False, True) if i % 2 == 0 else (True, False)):
            cb.REPLAY = flag
            _frontend._bound.clear()
            r = bench.run(device="cuda", workloads=["toy", "mid", "big-f32"], backends=["cupy"],
                          with_torch=False, repeat=60, budget_s=0.6)
            us = {row["workload"]: (round(row["median_us"], 1), round(row["fraction"], 3))
                  for row in r["rows"]}
            table.append((i, flag, r["copy_bandwidth_GBps"], us))
            print(i, "REPLAY" if flag else "plain ", round(r["copy_bandwidth_GBps"]), json.dumps(us), flush=True)
    for flag in (False, True):
        for wl in ("toy", "mid", "big-f32"):
            v = [t[3][wl][0] for t in table if t[1] == flag]
            print("REPLAY" if flag else "plain ", wl, "median of runs", statistics.median(v),
                  "runs", v, flush=True)
    return table


if __name__ == "__main__":
    print(torch.__version__, torch.cuda.get_device_name(0), flush=True)
    bits_check()
    ab(int(sys.argv[1]) if len(sys.argv) > 1 else 4)
