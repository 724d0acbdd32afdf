"""Does a stream's L2 access-policy window (hit and miss "streaming") keep a hot buffer in L2 across a large
read, eagerly and under CUDA graph capture? Times one read of a 25 MB buffer right after a read of a buffer as
large as the largest window, with and without the window over the large one (session 21's hypothesis: the
verify step's weight streams evict the next kernels' code and inputs; `wip_s21_l2_streaming.patch` put the
window over every weight and cache read).

    python bench/probe_l2_policy.py --out DIR
"""

import argparse
import contextlib
import ctypes
import json
import time
from pathlib import Path

import torch
import triton
import triton.language as tl

ACCESS_POLICY_WINDOW = 1  # CU_STREAM_ATTRIBUTE_ACCESS_POLICY_WINDOW
MAX_WINDOW_ATTR = 109  # CU_DEVICE_ATTRIBUTE_MAX_ACCESS_POLICY_WINDOW_SIZE
STREAMING = 1  # CU_ACCESS_PROPERTY_STREAMING
READ_BLOCK = 8192  # elements a program of the read kernel sums


class Window(ctypes.Structure):
    _fields_ = [("base_ptr", ctypes.c_void_p), ("num_bytes", ctypes.c_size_t), ("hit_ratio", ctypes.c_float),
                ("hit_prop", ctypes.c_int), ("miss_prop", ctypes.c_int)]


class LaunchValue(ctypes.Union):
    _fields_ = [("window", Window), ("pad", ctypes.c_char * 64)]


def check(result, what):
    if result:
        raise RuntimeError(f"{what} failed with CUresult {result}")


def max_window(cuda, index):
    value = ctypes.c_int(0)
    check(cuda.cuDeviceGetAttribute(ctypes.byref(value), MAX_WINDOW_ATTR, index), "cuDeviceGetAttribute")
    return value.value


@contextlib.contextmanager
def streaming(cuda, tensor, marked):
    """Launches inside read `tensor` through a streaming window on the current stream (when `marked`)."""
    stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)

    def set_window(base, num_bytes):
        value = LaunchValue()
        value.window = Window(base, num_bytes, 1.0, STREAMING, STREAMING)
        check(cuda.cuStreamSetAttribute(stream, ACCESS_POLICY_WINDOW, ctypes.byref(value)), "cuStreamSetAttribute")

    if marked:
        set_window(tensor.data_ptr(), tensor.numel() * tensor.element_size())
    try:
        yield
    finally:
        if marked:
            set_window(0, 0)


@triton.jit
def _read_kernel(x_ptr, out_ptr, BLOCK: tl.constexpr):
    """Program p sums x's block p (16-byte loads), so the read runs at the memory's speed, not a reduction's."""
    p = tl.program_id(0)
    x = tl.load(x_ptr + p.to(tl.int64) * BLOCK + tl.arange(0, BLOCK))
    tl.store(out_ptr + p, tl.sum(x.to(tl.float32), 0))


def read(x, out):
    """out[p] = sum of x's block p; x.numel() a multiple of READ_BLOCK, out that many blocks long."""
    _read_kernel[(x.numel() // READ_BLOCK,)](x, out, BLOCK=READ_BLOCK, num_warps=8)


def tail_us(head, tail, iters, graphed):
    """Median time of `tail` right after `head`, us, timed from an event recorded between the two (a sleep first,
    so that both are queued before they run); with graphed, each captured in a CUDA graph of its own and replayed
    (the window set during `tail`'s capture, so the graph's kernel node holds whatever capture recorded of it)."""
    if graphed:
        graphs = []
        for part in (head, tail):
            part()  # warm, outside the capture
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                part()
            graphs.append(graph)
        head, tail = graphs[0].replay, graphs[1].replay
    times = []
    for _ in range(iters):
        mid, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(200_000)
        head()
        mid.record()
        tail()
        end.record()
        torch.cuda.synchronize()
        times.append(mid.elapsed_time(end) * 1e3)
    return median(times)


def median(times):
    return round(sorted(times)[len(times) // 2], 2)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--iters", type=int, default=30)
    args = parser.parse_args()
    cuda = ctypes.CDLL("libcuda.so.1")
    window = max_window(cuda, torch.cuda.current_device())
    hot = torch.randn(12 << 20, device="cuda", dtype=torch.bfloat16)
    big = torch.randn(window // 2, device="cuda", dtype=torch.bfloat16)
    sink = torch.empty(big.numel() // READ_BLOCK, device="cuda")

    def read_hot():
        read(hot, sink)

    def read_big(marked):
        with streaming(cuda, big, marked):
            read(big, sink)

    for _ in range(20):  # compile, and bring the clocks up
        read_hot(), read_big(False)
    rows = {"max_window_bytes": window, "hot_MB": hot.numel() * 2 / 1e6, "big_MB": big.numel() * 2 / 1e6}
    for name, graphed in (("eager", False), ("graph", True)):
        rows[f"{name}_hot_after_hot_us"] = tail_us(read_hot, read_hot, args.iters, graphed)
        rows[f"{name}_big_after_hot_us"] = tail_us(read_hot, lambda: read_big(False), args.iters, graphed)
        for marked in (False, True):  # the window over the big read
            rows[f"{name}_hot_after_big_marked={marked}_us"] = tail_us(lambda: (read_hot(), read_big(marked)),
                                                                        read_hot, args.iters, graphed)
        rows[f"{name}_marked_big_after_hot_us"] = tail_us(read_hot, lambda: read_big(True), args.iters, graphed)
    rows["date"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    rows["gpu"] = torch.cuda.get_device_name(0)
    print(json.dumps(rows))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "l2_policy.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
