"""The tensor-parallel collectives at the DDTree step's message sizes: per-call latency (median, p99) by method.

    torchrun --nproc-per-node 8 -m bench.collectives --out DIR [--rows 1,8,9,17,33,65,129] [--iters 200]

Messages, in the model's dtype (bf16) and the preset's shapes (K2.6 by default):
- all_reduce of [rows, hidden]: each decoder layer sums its attention and its MLP output (2 x 61 a verify of
  K2.6, over the tree's budget + 1 rows; 1 row: the autoregressive step), each drafter layer its own two over
  the block (8 rows);
- all_gather of the lm_head's [rows, vocab / ranks] logits into [rows, vocab] (one a verify, one a draft).
Methods:
- `process_group`: model.parallel.Parallel's all_reduce and all_gather_last, the path the model runs (NCCL on
  GPUs, gloo on the CPU);
- `symm_one_shot`, `symm_two_shot` (all-reduce, CUDA only): torch's symmetric-memory all-reduce
  (`torch.ops.symm_mem.one_shot_all_reduce_out`, `two_shot_all_reduce_`) on a buffer rendezvoused once; the
  message is copied in and its sum written back in place, as a drop-in for Parallel.all_reduce would do.
Modes: `eager` times each call (CUDA events on the GPU, the host clock on the CPU); `graph` (CUDA only) replays a
CUDA graph of GRAPH_CALLS back-to-back calls, as the step's graphs run them, and counts a replay's time over its
calls. A call's time is the slowest rank's. Every method's result is checked exactly before it is timed. NVLink
multicast stays off (NCCL_NVLS_ENABLE=0 and TORCH_SYMM_MEM_DISABLE_MULTICAST=1 unless already set).

Rank 0 writes collectives.json and collectives.md to --out: per collective, method, mode and rows the bytes,
median and p99 us and GB/s; then per tree budget the collectives of one step (2 x layers target all-reduces and
the logits gather over budget + 1 rows, plus the drafter's 2 x its layers all-reduces and gather over its block).
"""

import json
import math
import os
import platform
import time
from datetime import datetime, timezone
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist

from bench.bench_step import DFLASH_K25
from model.config import PRESETS, preset
from spec.decode import Parser, UsageError, command_main, join_ranks, positive_seconds

DEFAULT_ROWS = (1, 8, 9, 17, 33, 65, 129)  # the verify's budget + 1 for budgets 0-128, and the drafter's block
GRAPH_CALLS = 10
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}


def parse_args(argv):
    p = Parser(prog="torchrun --nproc-per-node N -m bench.collectives", description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="directory for collectives.json and collectives.md")
    p.add_argument("--rows", default=",".join(map(str, DEFAULT_ROWS)), help="message rows, comma-separated")
    p.add_argument("--preset", default="kimi-k2.6", choices=sorted(PRESETS), help="hidden size, vocabulary, layers")
    p.add_argument("--iters", type=int, default=200, help="timed calls (eager) or graph replays per case")
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when present)")
    p.add_argument("--collective-timeout", type=positive_seconds, default=300.0, metavar="SECONDS")
    args = p.parse_args(argv)
    try:
        args.rows = sorted({int(r) for r in args.rows.split(",") if r.strip()})
    except ValueError:
        raise UsageError(f"--rows: expected comma-separated integers, got {args.rows!r}") from None
    if not args.rows or args.rows[0] < 1:
        raise UsageError(f"--rows: need row counts >= 1, got {args.rows}")
    if args.iters < 1 or args.warmup < 0:
        raise UsageError(f"--iters must be >= 1 and --warmup >= 0, got {args.iters} and {args.warmup}")
    return args


# ---- the methods ------------------------------------------------------------------------------------------

class SymmAllReduce:
    """torch's symmetric-memory all-reduce of messages up to max_numel elements, in place."""

    def __init__(self, par, max_numel, dtype, device, one_shot):
        from torch.distributed import _symmetric_memory as symm_mem

        self.buffer = symm_mem.empty(max_numel, dtype=dtype, device=device)
        self.group_name, self.one_shot = par.group.group_name, one_shot
        symm_mem.rendezvous(self.buffer, self.group_name)

    def __call__(self, x):
        flat = x.view(-1)
        staged = self.buffer[: flat.numel()]
        staged.copy_(flat)
        if self.one_shot:
            torch.ops.symm_mem.one_shot_all_reduce_out(staged, "sum", self.group_name, flat)
        else:
            torch.ops.symm_mem.two_shot_all_reduce_(staged, "sum", self.group_name)
            flat.copy_(staged)
        return x


def all_reduce_methods(par, max_numel, dtype, device):
    """{method: fn(x) summing x over ranks in place, or the reason it cannot run here}."""
    methods = {"process_group": par.all_reduce}
    for name, one_shot in (("symm_one_shot", True), ("symm_two_shot", False)):
        if device.type != "cuda":
            methods[name] = "needs CUDA"
            continue
        try:
            methods[name] = SymmAllReduce(par, max_numel, dtype, device, one_shot)
        except (RuntimeError, ImportError, AttributeError) as err:
            methods[name] = f"unavailable: {str(err).strip().splitlines()[0][:200]}"
    return methods


def pattern(shape, device, dtype):
    """Small integers (-3..3), exact in bf16 when summed over a few ranks."""
    return (torch.arange(math.prod(shape), device=device) % 7 - 3).view(shape).to(dtype)


def check_all_reduce(fn, par, shape, device, dtype):
    x = pattern(shape, device, dtype) * (par.rank + 1)
    expected = pattern(shape, device, dtype) * (par.tp_size * (par.tp_size + 1) // 2)
    if not torch.equal(fn(x), expected):
        raise RuntimeError(f"all_reduce of {list(shape)} gave a wrong sum")


def check_all_gather(par, shape, device, dtype):
    base = pattern(shape, device, dtype)
    expected = torch.cat([base * (r + 1) for r in range(par.tp_size)], -1)
    if not torch.equal(par.all_gather_last(base * (par.rank + 1)), expected):
        raise RuntimeError(f"all_gather of {list(shape)} gave wrong logits")


# ---- timing -----------------------------------------------------------------------------------------------

def eager_us(fn, iters, warmup, par, device):
    """Microseconds of each of `iters` calls on this rank (CUDA events on the GPU, the host clock on the CPU)."""
    for _ in range(warmup):
        fn()
    par.barrier()
    if device.type != "cuda":
        times = []
        for _ in range(iters):
            start = time.perf_counter()
            fn()
            times.append(1e6 * (time.perf_counter() - start))
        return times
    torch.cuda.synchronize()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
    for start, end in events:
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return [1e3 * start.elapsed_time(end) for start, end in events]


def graph_us(fn, replays, warmup, par):
    """Microseconds a call of each of `replays` replays of a CUDA graph of GRAPH_CALLS calls, on this rank."""
    from bench.common import capture

    graph = capture([fn] * GRAPH_CALLS)
    for _ in range(warmup):
        graph.replay()
    par.barrier()
    torch.cuda.synchronize()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(replays)]
    for start, end in events:
        start.record()
        graph.replay()
        end.record()
    torch.cuda.synchronize()
    return [1e3 * start.elapsed_time(end) / GRAPH_CALLS for start, end in events]


def slowest(times, par, device):
    """Per call, the largest time over ranks."""
    t = torch.tensor(times, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=par.group)
    return t.tolist()


def percentile(values, q):
    """The nearest-rank q-th percentile."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


def row(collective, method, mode, rows, shape, nbytes, times):
    median = percentile(times, 50)
    return dict(collective=collective, method=method, mode=mode, rows=rows, shape=list(shape), bytes=nbytes,
                median_us=median, p99_us=percentile(times, 99), GBps=nbytes / median / 1e3)


# ---- the run ----------------------------------------------------------------------------------------------

def cases(par, cfg, rows_list, dtype, device):
    """(collective, method, rows, shape, bytes, fn or the reason it is skipped), every input zeroed (its sums
    stay zero however often it is reduced)."""
    vocab_local = par.shard(cfg.vocab_size, "vocab_size")[1]
    size = dtype.itemsize
    methods = all_reduce_methods(par, max(rows_list) * cfg.hidden_size, dtype, device)
    out = []
    for rows in rows_list:
        shape = (rows, cfg.hidden_size)
        for method, fn in methods.items():
            if callable(fn):
                check_all_reduce(fn, par, shape, device, dtype)
                x = torch.zeros(shape, dtype=dtype, device=device)
                fn = partial(fn, x)
            out.append(("all_reduce", method, rows, shape, rows * cfg.hidden_size * size, fn))
        local = (rows, vocab_local)
        check_all_gather(par, local, device, dtype)
        logits = torch.zeros(local, dtype=dtype, device=device)
        out.append(("all_gather", "process_group", rows, (rows, cfg.vocab_size), rows * cfg.vocab_size * size,
                    partial(par.all_gather_last, logits)))
    return out


def step_totals(results, layers, draft_layers, block):
    """Per measured row count but the block's (budget = rows - 1), mode and all-reduce method, one step's
    collectives: 2 x layers all-reduces and one logits gather over budget + 1 rows, plus for budgets > 0 the
    drafter's 2 x draft_layers all-reduces and its gather over the block (a gather of block - 1 rows: the
    block's time stands in for it)."""
    median = {(r["collective"], r["method"], r["mode"], r["rows"]): r["median_us"] for r in results}
    out = []
    for (collective, method, mode, rows), all_reduce in sorted(median.items()):
        gather = median.get(("all_gather", "process_group", mode, rows))
        if collective != "all_reduce" or gather is None or rows == block:
            continue
        total = 2 * layers * all_reduce + gather
        if rows > 1:
            draft = (median.get(("all_reduce", method, mode, block)), median.get(("all_gather", "process_group",
                                                                                  mode, block)))
            if None in draft:
                continue
            total += 2 * draft_layers * draft[0] + draft[1]
        out.append(dict(budget=rows - 1, method=method, mode=mode, all_reduce_us=all_reduce, gather_us=gather,
                        step_collectives_us=total))
    return out


def metadata(device, par, cfg_name):
    meta = dict(ranks=par.tp_size, backend=dist.get_backend(par.group), preset=cfg_name, torch=torch.__version__,
                python=platform.python_version(), graph_calls=GRAPH_CALLS,
                env={k: os.environ.get(k) for k in NO_MULTICAST},
                date=datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"))
    if device.type == "cuda":
        from bench.common import metadata as gpu_metadata

        meta.update(gpu_metadata(), nccl=".".join(map(str, torch.cuda.nccl.version())))
    else:
        meta.update(gpu=None, device=platform.processor() or "cpu")
    return meta


def markdown(report):
    meta = report["meta"]
    where = f"{meta['ranks']} x {meta['gpu']}" if meta.get("gpu") else f"{meta['ranks']} CPU ranks"
    lines = [f"# Tensor-parallel collectives at the step's message sizes ({where}, {meta['date']})", "",
             f"torch {meta['torch']}, backend {meta['backend']}"
             + (f", NCCL {meta['nccl']}" if meta.get("nccl") else "") + f"; preset {meta['preset']}; "
             f"the slowest rank's time a call; graph: a replay of {meta['graph_calls']} calls over its calls; "
             + ", ".join(f"{k}={v}" for k, v in meta["env"].items()) + ".", ""]
    if report["skipped"]:
        lines += ["Skipped: " + "; ".join(f"{m}: {why}" for m, why in report["skipped"].items()), ""]
    lines += ["| collective | method | mode | rows | bytes | median us | p99 us | GB/s |", "|---" * 8 + "|"]
    for r in report["rows"]:
        lines.append(f"| {r['collective']} | {r['method']} | {r['mode']} | {r['rows']} | {r['bytes']} | "
                     f"{r['median_us']:.1f} | {r['p99_us']:.1f} | {r['GBps']:.3g} |")
    if report["steps"]:
        lines += ["", f"One step's collectives (medians): {report['layers']} layers x 2 all-reduces + the logits "
                  f"gather over budget + 1 rows; budgets > 0 add the drafter's {report['draft_layers']} layers x 2 "
                  f"all-reduces + its gather over the {report['block']}-row block.", "",
                  "| budget | method | mode | all-reduce us | gather us | step collectives us |", "|---" * 6 + "|"]
        for s in report["steps"]:
            lines.append(f"| {s['budget']} | {s['method']} | {s['mode']} | {s['all_reduce_us']:.1f} | "
                         f"{s['gather_us']:.1f} | {s['step_collectives_us']:.1f} |")
    return "\n".join(lines) + "\n"


def run(args):
    for key, value in NO_MULTICAST.items():
        os.environ.setdefault(key, value)
    device, par = join_ranks(args.device, args.collective_timeout)
    if not par.joined:
        raise UsageError("run under torchrun with 2 or more ranks: torchrun --nproc-per-node 8 -m bench.collectives")
    try:
        measure(args, device, par)
        par.barrier()
    finally:
        dist.destroy_process_group()


def measure(args, device, par):
    cfg = preset(args.preset)
    dtype = torch.bfloat16
    modes = ("eager", "graph") if device.type == "cuda" else ("eager",)
    results, skipped = [], {}
    out = Path(args.out)
    block = DFLASH_K25["block_size"]
    for collective, method, rows, shape, nbytes, fn in cases(par, cfg, args.rows, dtype, device):
        if not callable(fn):
            skipped[method] = fn
            continue
        for mode in modes:
            if mode == "eager":
                times = eager_us(fn, args.iters, args.warmup, par, device)
            else:
                times = graph_us(fn, args.iters, args.warmup, par)
            results.append(row(collective, method, mode, rows, shape, nbytes, slowest(times, par, device)))
        if par.rank == 0:
            print(json.dumps(results[-1]), flush=True)
    if par.rank == 0:
        report = dict(meta=metadata(device, par, args.preset), skipped=skipped, rows=results,
                      layers=cfg.num_hidden_layers, draft_layers=DFLASH_K25["num_hidden_layers"], block=block,
                      steps=step_totals(results, cfg.num_hidden_layers, DFLASH_K25["num_hidden_layers"], block))
        out.mkdir(parents=True, exist_ok=True)
        (out / "collectives.json").write_text(json.dumps(report, indent=1) + "\n")
        table = markdown(report)
        (out / "collectives.md").write_text(table)
        print(table)


def main(argv=None):
    return command_main(run, parse_args, argv)


if __name__ == "__main__":
    raise SystemExit(main())
