"""A batch larger than memory: convcov through dask on a LocalCluster, chunk by chunk.

Propagating moments over a whole data set means one conv layer's inputs (the mean ``mu``
and the channel-diagonal covariance ``gamma`` of every sample) for more samples than
memory holds. As dask arrays cut along the batch, each chunk is made when a worker needs
it (here a synthetic stand-in: random means and a stationary covariance between input
positions; in real use the previous layer's dask result, or chunks read from storage),
the weight-noise term is added to it by ``convcov.accumulate`` on that worker, and the
result is reduced at once to what is kept: each output channel's and position's variance
from weight noise, averaged over the data set. Nothing batch-sized is ever held, so the
inputs can be any number of times the cluster's memory.

    python examples/dask_batch.py            # 2 workers of 512 MiB; inputs 4 times that
    python examples/dask_batch.py --small    # a quick run, for the test suite
    python examples/dask_batch.py --workers 8 --memory-limit 8GiB --times 100
                                             # 6.4 TB of inputs: hours, any machine
    python examples/dask_batch.py --scheduler tcp://HOST:8786   # a running cluster

``--times`` scales the inputs with the cluster's memory; ``--channels`` and ``--size``
set the layer (C -> C channels, size x size inputs, 3x3, padding 1). Needs
``pip install 'convcov[dask]'``. ``CONVCOV_EXAMPLES_SMALL=1`` in the environment means
``--small``.
"""

from __future__ import annotations

import argparse
import os
import time

import dask.array as da
import distributed
import numpy as np

import convcov

KERNEL = dict(kernel_size=3, padding=1)


def _covariance(H):
    """A stationary covariance between the H x H input positions: exp(-d^2 / 2)."""
    y, x = np.divmod(np.arange(H * H), H)
    d2 = (y[:, None] - y[None, :]) ** 2 + (x[:, None] - x[None, :]) ** 2
    return np.exp(-d2 / 2).reshape(H, H, H, H).astype(np.float32)


def make_mu(n, C, H, block_id=None):
    """Chunk ``block_id[0]`` of the means: n samples, made where the task runs."""
    rng = np.random.default_rng(block_id[0])
    return rng.random((n, C, H, H), np.float32)


def make_gamma(n, C, H, block_id=None):
    """Chunk ``block_id[0]`` of gamma's channel diagonal: a per-sample, per-channel
    variance times the stationary covariance."""
    scale = np.random.default_rng((block_id[0], 1)).random((n, C), np.float32) * 0.1
    return scale[:, :, None, None, None, None] * _covariance(H)


def variances(out):
    """The output variances of a diagonal-layout out chunk: out[b, c, i, j, i, j]."""
    return np.einsum("bcijij->bcij", out)


def build(B, n, C, H, c):
    """The graph: per-sample output variance from weight noise, averaged over B samples."""
    Ho = H  # 3x3, padding 1
    nb = B // n

    def lazy(fn, shape):
        return da.map_blocks(fn, n, C, H, dtype=np.float32,
                             chunks=((n,) * nb,) + tuple((s,) for s in shape[1:]),
                             meta=np.empty((0,) * len(shape), np.float32))

    mu = lazy(make_mu, (B, C, H, H))
    gamma = lazy(make_gamma, (B, C, H, H, H, H))
    out = da.zeros((B, C, Ho, Ho, Ho, Ho), dtype=np.float32, chunks=(n, -1, -1, -1, -1, -1))
    noise = convcov.accumulate(out, gamma, mu, c, **KERNEL)  # a new dask array: out + term
    per_sample = noise.map_blocks(variances, drop_axis=(4, 5), dtype=np.float32)
    return mu.nbytes + gamma.nbytes, per_sample


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--small", action="store_true",
                        default=os.environ.get("CONVCOV_EXAMPLES_SMALL") == "1",
                        help="a quick run: 64 MB of inputs")
    parser.add_argument("--scheduler", help="address of a running dask scheduler "
                                            "(default: start a LocalCluster)")
    parser.add_argument("--workers", type=int, default=2, help="LocalCluster workers")
    parser.add_argument("--memory-limit", default="512MiB", help="per LocalCluster worker")
    parser.add_argument("--times", type=float, default=4.0,
                        help="inputs as a multiple of the cluster's total memory limit")
    parser.add_argument("--channels", type=int, default=8)
    parser.add_argument("--size", type=int, default=12)
    parser.add_argument("--chunk-mb", type=float, default=16.0, help="inputs per chunk")
    args = parser.parse_args(argv)
    C, H = args.channels, args.size
    c = np.full(C, 0.02, np.float32)  # the weights' noise variance, per output channel
    per_sample = C * H * H * (H * H + 1) * 4  # bytes of gamma's and mu's entries
    n = max(1, int(args.chunk_mb * 2**20 // per_sample))

    cluster = None
    if args.scheduler is None:
        cluster = distributed.LocalCluster(n_workers=args.workers, threads_per_worker=1,
                                           memory_limit=args.memory_limit,
                                           dashboard_address=None)
    try:
        with distributed.Client(args.scheduler or cluster) as client:
            workers = client.scheduler_info()["workers"].values()
            memory = sum(w["memory_limit"] for w in workers)
            target = 64 * 2**20 if args.small else args.times * memory
            B = max(1, round(target / per_sample / n)) * n
            nbytes, var = build(B, n, C, H, c)
            print(f"{B} samples, layer {C} -> {C} channels, {H}x{H}, 3x3: inputs "
                  f"{nbytes / 1e9:.2f} GB in {B // n} chunks, {nbytes / memory:.2f} times the "
                  f"cluster's memory limit ({memory / 1e9:.2f} GB in {len(workers)} workers)")
            t = time.perf_counter()
            mean = client.compute(var.mean(axis=0)).result()
            print(f"computed in {time.perf_counter() - t:.1f} s; output variance from "
                  f"weight noise, mean over samples and positions, per channel: "
                  f"{np.array2string(mean.mean(axis=(1, 2)), precision=4)}")

            # The first chunk again, with the direct call here.
            first = client.compute(var[:n]).result()
            out = np.zeros((n, C, H, H, H, H), np.float32)
            convcov.accumulate(out, make_gamma(n, C, H, (0,)), make_mu(n, C, H, (0,)), c,
                               **KERNEL)
            diff = np.abs(first - variances(out)).max() / np.abs(variances(out)).max()
            print(f"the first chunk agrees with the direct call: max relative difference "
                  f"{diff:.1e}")
            assert diff == 0, "dask's chunk differs from the direct call's"
    finally:
        if cluster is not None:
            cluster.close()


if __name__ == "__main__":
    main()
