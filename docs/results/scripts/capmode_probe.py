"""(Twenty-sixth session; log: docs/results/h200-2026-12-01-26-capture-mode.log.) Which
capture-mode calls CuPy exposes, and which of _Replays.build's CUDA calls fail
while another thread captures in global mode (each probed alone, on a fresh capture)."""
import threading

import cupy
import torch

rt, drv = cupy.cuda.runtime, cupy.cuda.driver
print("runtime:", [n for n in dir(rt) if "apture" in n or "Exchange" in n])
print("driver:", [n for n in dir(drv) if "apture" in n or "Exchange" in n])


def under_global_capture(name, fn):
    x = torch.arange(16.0, device="cuda")
    y = torch.zeros_like(x)
    graph = torch.cuda.CUDAGraph()
    capturing, done, errs = threading.Event(), threading.Event(), []

    def capture():
        try:
            with torch.cuda.graph(graph, capture_error_mode="global"):
                y.copy_(x * 2)
                capturing.set()
                done.wait(30)
        except Exception as exc:
            errs.append(repr(exc)[:160])
        finally:
            capturing.set()

    t = threading.Thread(target=capture)
    t.start()
    capturing.wait(30)
    try:
        fn()
        mine = "ok"
    except Exception as exc:
        mine = repr(exc)[:160]
    done.set()
    t.join(30)
    try:
        torch.cuda.synchronize()
    except Exception as exc:
        errs.append("then synchronize: " + repr(exc)[:100])
    print(f"{name}, thread alive {t.is_alive()}: this thread: {mine}; capturing thread: {errs or 'ok'}")


def stream_create():
    s = rt.streamCreateWithFlags(rt.streamNonBlocking)
    rt.streamDestroy(s)


def event_create():
    e = rt.eventCreateWithFlags(rt.eventDisableTiming)
    rt.eventDestroy(e)


def _captured(s):
    rt.streamBeginCapture(s, rt.streamCaptureModeThreadLocal)
    with cupy.cuda.ExternalStream(s):
        a[...] += 1
    return rt.streamEndCapture(s)


def capture_only():
    s = rt.streamCreateWithFlags(rt.streamNonBlocking)
    rt.graphDestroy(_captured(s))
    rt.streamDestroy(s)


def capture_and_instantiate():
    s = rt.streamCreateWithFlags(rt.streamNonBlocking)
    g = _captured(s)
    e = rt.graphInstantiate(g)
    rt.graphDestroy(g)
    rt.streamDestroy(s)
    return e


def launch_built():
    s = rt.streamCreateWithFlags(rt.streamNonBlocking)
    rt.graphLaunch(BUILT, s)
    rt.streamDestroy(s)


def relaxed(fn):
    from convcov._arrays import exchange_capture_mode

    def run():
        mode = exchange_capture_mode(1)
        try:
            fn()
        finally:
            print("  mode was", mode, "and back:", exchange_capture_mode(mode))
    return run


a = cupy.zeros(8)  # CuPy's context and pool ready before any capture
a += 1
BUILT = capture_and_instantiate()
for name, fn in [("nothing", lambda: None), ("streamCreate", stream_create),
                 ("eventCreate", event_create), ("capture only", capture_only),
                 ("capture+instantiate", capture_and_instantiate),
                 ("graphLaunch of a built graph", launch_built),
                 ("capture+instantiate, thread-local mode", relaxed(capture_and_instantiate))]:
    under_global_capture(name, fn)
