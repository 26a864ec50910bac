"""Where a slow process's `mid` time comes from (numba_cuda's two `mid` misses of the
twelfth session came in processes where its `mid` took 140-143 us against cupy's 118-127):
1. the host: the CPUs this process may run on, the GPU's local CPUs, and the bench's
   `mid` median for numba_cuda and cupy with this process pinned to each CPU set, ABAB;
2. the bench's order: `mid` right after `toy`'s torch.compile (as in the bench) and again
   after 5 s of idle;
3. four fresh processes (``ab51.py child``), each timing `mid` unpinned, then pinned to
   the GPU's local CPUs, and saying which CPU it ran on."""
import os
import statistics as st
import subprocess
import sys
import time

import torch

import _timing as T
from convcov import bench

dev = bench._Cuda()
W = {w.name: w for w in bench.WORKLOADS}


def cpu_now():
    with open("/proc/self/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[36])


def local_cpus():
    bus = subprocess.run(["nvidia-smi", "--query-gpu=pci.bus_id", "--format=csv,noheader", "-i", "0"],
                         capture_output=True, text=True).stdout.strip().lower()
    path = f"/sys/bus/pci/devices/{bus[4:]}"
    try:
        text = open(f"{path}/local_cpulist").read().strip()
        node = open(f"{path}/numa_node").read().strip()
    except OSError as exc:
        return None, f"{path}: {exc}"
    cpus = set()
    for part in text.split(","):
        a, _, b = part.partition("-")
        cpus |= set(range(int(a), int(b or a) + 1))
    return cpus, f"{path}: numa_node {node}, local_cpulist {text}"


def mids():
    sets = [bench._inputs(dev, W["mid"]) for _ in range(3)]
    fs = {be: T.rotating(sets, W["mid"], be) for be in ("numba_cuda", "cupy")}
    for f in fs.values():
        for _ in range(5):
            f()
    torch.cuda.synchronize()
    return lambda: "  ".join(f"{be} {st.median(dev.time_calls(f, 60, 1.0)) * 1e6:6.1f}"
                             for be, f in fs.items())


ALL = sorted(os.sched_getaffinity(0))
LOCAL, where = local_cpus()
if sys.argv[1:] == ["child"]:
    m = mids()
    print(f"child: cpu {cpu_now()}  unpinned: {m()}", end="", flush=True)
    if LOCAL and set(ALL) & LOCAL:
        os.sched_setaffinity(0, set(ALL) & LOCAL)
        time.sleep(0.05)
        print(f"  | local-pinned (cpu {cpu_now()}): {m()}", flush=True)
    print(flush=True)
    sys.exit()

print(subprocess.run("lscpu | grep -i -E 'numa|model name|^cpu\\(s\\)|mhz|thread'; "
                     "nvidia-smi topo -m", shell=True, capture_output=True, text=True).stdout)
print("affinity", ALL, "| gpu 0:", where, flush=True)
m = mids()
half = len(ALL) // 2
cpusets = {"all": ALL, "lo-half": ALL[:half], "hi-half": ALL[half:], "cpu-lo": ALL[1:2],
           "cpu-hi": ALL[-1:]}
if LOCAL and set(ALL) & LOCAL and set(ALL) & LOCAL != set(ALL):
    cpusets["gpu-local"] = sorted(set(ALL) & LOCAL)
    cpusets["gpu-remote"] = sorted(set(ALL) - LOCAL)
for rnd in range(3):
    for name, cpus in cpusets.items():
        if not cpus:
            continue
        os.sched_setaffinity(0, cpus)
        time.sleep(0.05)
        print(f"r{rnd} {name:10s} (cpu {cpu_now():3d}): {m()}", flush=True)
os.sched_setaffinity(0, ALL)

toy = W["toy"]
compiled = bench._impls(dev, ["cupy"], True)["torch.compile"]
x = bench._inputs(dev, toy)
call = lambda: compiled(x["out"], x["gamma"], x["mu"], x["c"], toy)  # noqa: E731
for _ in range(3):
    call()
dev.time_calls(call, 60, 0.6)
print(f"right after toy's torch.compile: {m()}", flush=True)
print(f"... then                       : {m()}", flush=True)
time.sleep(5)
print(f"after 5 s idle                 : {m()}", flush=True)
for i in range(4):
    subprocess.run([sys.executable, __file__, "child"], timeout=60)
