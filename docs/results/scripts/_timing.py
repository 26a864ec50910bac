"""Shared by the A/B scripts here: a call's whole time and its GPU part, alternately."""
import statistics as st

import torch


def measure(f, n=40):
    """(median whole-call time, median GPU part) in µs over n calls each: the whole call
    after draining the queue (host dispatch included, as the bench times it), and the
    GPU part with the host hidden behind a sleep kernel queued first."""
    whole, gpu = [], []
    for i in range(2 * n):
        torch.cuda.synchronize()
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        hide = i % 2 == 1
        if hide:
            torch.cuda._sleep(3_000_000)
        e0.record(); f(); e1.record()
        torch.cuda.synchronize()
        (gpu if hide else whole).append(e0.elapsed_time(e1) * 1e3)
    return st.median(whole), st.median(gpu)
