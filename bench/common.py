"""What every benchmark shares: GPU timing, the ceilings measured in the same run, the roofline, metadata.

Times are GPU time, never the host clock: CUDA events around a CUDA-graph replay of many calls (cold inputs
rotated inside the graph), or `triton.testing.do_bench`'s method (a 256 MiB memset flushes the L2 before every
call). Inside a pytest-benchmark test both go through `benchmark.pedantic` with `GpuStamp` as its timer (set for
every bench/ test by bench/conftest.py), so pytest-benchmark's statistics are GPU seconds a round.
"""

import datetime
import functools
import platform

import torch


class GpuStamp:
    """A pytest-benchmark timer reading the GPU clock: a CUDA event recorded on the current stream; the difference
    of two stamps waits for the later one and is the GPU time between them, in seconds."""

    __slots__ = ("event",)

    def __init__(self):
        self.event = torch.cuda.Event(enable_timing=True)
        self.event.record()

    def __sub__(self, start):
        self.event.synchronize()
        return start.event.elapsed_time(self.event) / 1e3


def capture(calls):
    """One CUDA graph of `calls` (thunks) back to back, after one eager pass on a side stream (compiles,
    allocates)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for fn in calls:
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for fn in calls:
            fn()
    return graph


def events_us(fn, reps=10, warmup=2):
    """Median GPU microseconds of fn() over `reps` calls, CUDA events around each (outside pytest-benchmark)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        start = GpuStamp()
        fn()
        times.append(GpuStamp() - start)
    return 1e6 * sorted(times)[len(times) // 2]


def graph_us(calls, reps=10):
    """Median GPU microseconds per call of `calls` captured back to back in one CUDA graph (outside
    pytest-benchmark)."""
    return events_us(capture(calls).replay, reps) / len(calls)


def median_us(benchmark):
    return 1e6 * benchmark.stats.stats.median


def bench_graph(benchmark, calls, rounds=10, warmup=2):
    """Median GPU microseconds per call of `calls` captured back to back in one CUDA graph, the graph replayed
    `rounds` times by pytest-benchmark."""
    graph = capture(calls)
    benchmark.pedantic(graph.replay, rounds=rounds, warmup_rounds=warmup)
    return median_us(benchmark) / len(calls)


@functools.cache
def _l2_flush_buffer():
    return torch.empty((256 << 20) // 4, dtype=torch.int32, device="cuda")  # as triton.testing.do_bench's


def flush_l2():
    _l2_flush_buffer().zero_()


def bench_flushed(benchmark, fn, warmup_ms=25.0, rep_ms=100.0):
    """`triton.testing.do_bench(fn, warmup_ms, rep_ms, return_mode="median")` through pytest-benchmark: the L2
    flushed before every call (outside the timed region), as many calls as fill warmup_ms and rep_ms by an
    estimate over 5 flushed calls. Median GPU microseconds per call."""
    fn()
    torch.cuda.synchronize()
    start = GpuStamp()
    for _ in range(5):
        flush_l2()
        fn()
    estimate_ms = 1e3 * (GpuStamp() - start) / 5
    benchmark.pedantic(fn, setup=flush_l2, rounds=max(1, int(rep_ms / estimate_ms)),
                       warmup_rounds=max(1, int(warmup_ms / estimate_ms)))
    return median_us(benchmark)


def read_gbs():
    """The device's read bandwidth, GB/s: a sum over 4 GiB of bf16 (do_bench median)."""
    import triton

    x = torch.randn(2 << 30, dtype=torch.bfloat16, device="cuda")
    return (4 << 30) / triton.testing.do_bench(lambda: x.sum(), warmup=50, rep=300, return_mode="median") / 1e6


def matmul_tflops():
    """The device's bf16 matmul rate, TFLOP/s: 8192^3 (do_bench median)."""
    import triton

    a, b = (torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda") for _ in range(2))
    return 2 * 8192**3 / triton.testing.do_bench(lambda: a @ b, warmup=50, rep=300, return_mode="median") / 1e9


class Ceilings:
    """The read bandwidth and matmul rate, measured on first use (a pytest session measures them once, a
    compile-only run never)."""

    @functools.cached_property
    def values(self):
        return dict(read_gbs=read_gbs(), matmul_tflops=matmul_tflops())


def record(benchmark, ceilings, us, key, nbytes=None, flops=None, **fields):
    """A case's extra_info: its key (the name bench/compare.py matches cases by) and fields, GPU microseconds per
    call, the bytes it must move and FLOPs it must do, the ceilings of this run, achieved GB/s and TFLOP/s, the
    roofline time max(bytes / read bandwidth, FLOPs / matmul rate) and the fraction of it reached (roofline /
    time, 1.0 at the roofline)."""
    c = ceilings.values
    roofline = max(nbytes / c["read_gbs"] / 1e3 if nbytes else 0.0, flops / c["matmul_tflops"] / 1e6 if flops else 0.0)
    benchmark.extra_info.update(
        key=key, **fields, us=us, bytes=nbytes, flops=flops, **c,
        gbs=nbytes / us / 1e3 if nbytes else None, tflops=flops / us / 1e6 if flops else None,
        roofline_us=roofline or None, roofline_frac=roofline / us if roofline else None)


def rel_err(out, ref):
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def arch_name():
    """The arch whose kernel tables run here ('sm_90', ...): triton_kernels.arch's answer where that module is
    (it honours its override), else the device's compute capability."""
    try:
        from triton_kernels import arch
        return str(arch.current())
    except (ImportError, AttributeError):
        major, minor = torch.cuda.get_device_capability()
        return f"sm_{major}{minor}"


def metadata():
    """GPU, arch, SM count, versions and the UTC date, for a results file's header."""
    import triton

    props = torch.cuda.get_device_properties(0)
    return dict(gpu=props.name, arch=arch_name(), sms=props.multi_processor_count, torch=torch.__version__,
                triton=triton.__version__, cuda=torch.version.cuda, python=platform.python_version(),
                date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"))
