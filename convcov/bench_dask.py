"""``convcov bench --dask``: what computing through dask costs over the direct call.

One layer of SPEC's ``big`` shape (C 64 -> 64, 32x32, 3x3, padding 1, diagonal ``gamma``
and ``out``, float32), whose ``out`` is 268 MB per batch element: the batch is cut into
four chunks of one element (so every chunk of ``out`` and of ``gamma`` is 268 MB; on CUDA
also of 16 elements, 4.3 GB: :data:`PER_CHUNK`) and computed three ways on the same data,
already in memory where it is computed:

* ``direct``: one ``convcov.accumulate`` call on the whole batch;
* ``dask threads``: the dask graph on the threaded scheduler, one worker thread (the
  backend's own threads use the cores, as in the direct call);
* ``dask distributed``: the same graph on a ``distributed.LocalCluster`` of one worker
  process with one thread, its inputs made and held on the worker (nothing is sent);
  on CUDA a ``dask_cuda.LocalCUDACluster`` of one GPU, where dask-cuda imports.

Each is timed until its result is computed and held (``persist``), the median of
``repeat`` runs after a first one (``direct`` and ``dask threads`` in alternation);
``overhead`` is the difference to ``direct`` per chunk. Host arrays are
NumPy (numpy chunks); CUDA arrays are CuPy (CuPy chunks).
"""

from __future__ import annotations

import statistics
import time

import numpy as np

import convcov


#: Batch elements a chunk (268 MB of out and of gamma each): a GPU computes one in 0.3 ms,
#: less than dask's cost of a task, so CUDA also runs chunks of 16 (4.3 GB), where it
#: amortises.
PER_CHUNK = {"cpu": (1,), "cuda": (1, 16)}


def _xp(device: str):
    if device == "cuda":
        import cupy

        return cupy
    return np


def _sync(device: str) -> None:
    if device == "cuda":
        import cupy

        cupy.cuda.get_current_stream().synchronize()


def _full(value, dtype, device, block_info=None):
    """One chunk of a constant input, made where the task runs."""
    return _xp(device).full(block_info[None]["chunk-shape"], value, dtype)


def _inputs(B, C, H, per_chunk, device):
    """(out, gamma, mu) as lazily made dask arrays of per_chunk batch elements a chunk."""
    import dask.array as da

    xp = _xp(device)

    def make(shape, value):
        chunks = (per_chunk,) + (-1,) * (len(shape) - 1)
        return da.map_blocks(_full, value, np.float32, device, dtype=np.float32,
                             chunks=da.core.normalize_chunks(chunks, shape),
                             meta=xp.empty((0,) * len(shape), np.float32))

    return (make((B, C, H, H, H, H), 0.0), make((B, C, H, H, H, H), 0.01),
            make((B, C, H, H), 0.5))


def _time(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def run(device: str = "cpu", C: int = 64, H: int = 32, per_chunk: int = 1, chunks: int = 4,
        repeat: int = 3, address: str | None = None, progress=print) -> dict:
    """Time the three paths; ``address``: a running scheduler to use instead of starting
    a local cluster (its workers must reach the same devices)."""
    import dask
    import distributed

    B = per_chunk * chunks
    xp = _xp(device)
    call = dict(kernel_size=3, padding=1, groups=1)

    rows = []
    progress(f"direct and dask threads ({device}), interleaved")
    held = [xp.zeros((B, C, H, H, H, H), np.float32),
            xp.full((B, C, H, H, H, H), 0.01, np.float32), xp.full((B, C, H, H), 0.5, np.float32)]

    def direct():
        convcov.accumulate(*held, 0.5, **call)
        _sync(device)

    arrays = dask.persist(*_inputs(B, C, H, per_chunk, device), scheduler="threads")
    runs = iter(range(1, 1 << 30))

    def graph():
        # a new c each run: new keys, so a scheduler never finds the last run's results
        return convcov.accumulate(*arrays, 0.5 + next(runs) * 2**-20, **call)

    def threads():
        held = dask.persist(graph(), scheduler="threads", num_workers=1)
        _sync(device)
        del held

    direct()  # compiles / loads the kernels
    threads()  # a first run's results are new memory; later runs reuse it (docs/dask.md)
    # the two in alternation, so that both see the same state of the machine
    times = {"direct": [], "dask threads": []}
    for _ in range(repeat):
        for path, fn in (("direct", direct), ("dask threads", threads)):
            t = time.perf_counter()
            fn()
            times[path].append(time.perf_counter() - t)
    rows += [{"path": path, "seconds": statistics.median(ts)} for path, ts in times.items()]
    held.clear()  # the memory, for the next path
    del arrays
    if device == "cuda":  # CuPy's pool would keep it from the cluster's worker
        xp.get_default_memory_pool().free_all_blocks()

    progress(f"dask distributed ({device})")
    cluster = None
    if address is None:
        if device == "cuda":
            try:
                from dask_cuda import LocalCUDACluster
            except ImportError as exc:
                rows.append({"path": "dask distributed", "seconds": None,
                             "note": f"dask_cuda: {exc}"})
                return _result(device, B, C, H, per_chunk, chunks, rows)
            cluster = LocalCUDACluster(n_workers=1, threads_per_worker=1,
                                       dashboard_address=None)
        else:
            cluster = distributed.LocalCluster(n_workers=1, threads_per_worker=1,
                                               processes=True, memory_limit=0,
                                               dashboard_address=None)
        address = cluster.scheduler_address
    try:
        with distributed.Client(address) as client:
            arrays = client.persist(list(_inputs(B, C, H, per_chunk, device)))
            distributed.wait(arrays)
            distributed.wait(client.persist(graph()))  # the workers' first call loads kernels

            def cluster_run():
                held = client.persist(graph())
                distributed.wait(held)
                if device == "cuda":  # a task returns once its kernels are queued
                    client.run(_sync, device)
                del held

            rows.append({"path": "dask distributed", "seconds": _time(cluster_run, repeat)})
    finally:
        if cluster is not None:
            cluster.close()
    return _result(device, B, C, H, per_chunk, chunks, rows)


def _result(device, B, C, H, per_chunk, chunks, rows) -> dict:
    base = rows[0]["seconds"]
    for row in rows:
        s = row["seconds"]
        row["overhead_per_chunk_s"] = None if s is None else (s - base) / chunks
    return {"device": device, "batch": B, "channels": C, "size": H, "chunks": chunks,
            "chunk_bytes": per_chunk * C * H**4 * 4, "rows": rows}


def table(result: dict):
    from rich.table import Table

    t = Table(title=f"dask overhead, {result['device']}: B {result['batch']}, C "
                    f"{result['channels']}, {result['size']}x{result['size']}, 3x3, diagonal "
                    f"layout, float32; {result['chunks']} chunks of "
                    f"{result['chunk_bytes'] / 1e6:.0f} MB (out and gamma)")
    for col in ("path", "time", "per chunk", "overhead per chunk", "vs direct"):
        t.add_column(col, justify="left" if col == "path" else "right")
    base = result["rows"][0]["seconds"]
    for row in result["rows"]:
        s = row["seconds"]
        if s is None:
            t.add_row(row["path"], "-", "-", "-", row.get("note", ""))
            continue
        t.add_row(row["path"], f"{s * 1e3:.1f} ms", f"{s / result['chunks'] * 1e3:.1f} ms",
                  f"{row['overhead_per_chunk_s'] * 1e3:+.1f} ms", f"{s / base:.2f}x")
    return t


def main(args, console) -> list:
    """``convcov bench --dask``: the host, and CUDA where CuPy has a device."""
    devices = {"auto": ["cpu", "cuda"], "cpu": ["cpu"], "cuda": ["cuda"]}[args.device]
    results = []
    for device in devices:
        if device == "cuda" and not _cupy_device():
            if args.device == "cuda":
                raise SystemExit("convcov bench --dask --device cuda: needs CuPy with a "
                                 "CUDA device")
            continue
        for per_chunk in PER_CHUNK[device]:
            result = run(device, per_chunk=per_chunk, repeat=min(args.repeat, 5),
                         progress=lambda m: console.print(f"timing {m} ...", highlight=False))
            console.print(table(result))
            results.append(result)
    return results


def _cupy_device() -> bool:
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False
