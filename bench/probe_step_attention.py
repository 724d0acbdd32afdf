"""The Gluon split kernel's timeline inside the verify step (issue #7): one TP8 rank of K2.6 (bench_step's build),
its cache at a 4k context, one eager verify at a budget with the kernel stamped (probe_attention_timeline's
stamps; each of the 61 calls its own buffer), against the same shape alone (a CUDA graph over rotated caches).
Per phase: the median over a call's programs, then the median over the calls.

    python bench/probe_step_attention.py --out DIR [--context 4096] [--budget 8]      # GPU (Hopper)
"""

import argparse
import json
import statistics
from pathlib import Path

import torch

import bench_step as bs
import probe_attention_timeline as pt
from triton_kernels import mla_gluon


class PerCall(pt.Stamped):
    """Stamped with a fresh stamp buffer for each launch (kept in .buffers with the grid)."""

    def __getitem__(self, grid):
        self.buffers = getattr(self, "buffers", [])
        times = torch.zeros(grid[0] * grid[1] * grid[2], 32, dtype=torch.int64, device="cuda")
        self.buffers.append((grid, times))
        return lambda *args, **kwargs: self.kernel[grid](*args, times_ptr=times, **kwargs)


def in_step(context, budget):
    target = bs.build_target()
    drafter = bs.build_drafter(target)
    bench = bs.Bench(target, drafter, (budget,), context)
    bench.set_context(context)
    verify = bench.verify_eager(budget)
    verify()  # compiles everything
    stamped = PerCall(pt.stamped_gluon_module()._split_kernel, None)
    saved, mla_gluon._split_kernel = mla_gluon._split_kernel, stamped
    try:
        verify()
    finally:
        mla_gluon._split_kernel = saved
    torch.cuda.synchronize()
    calls = [pt.phases(times.cpu(), pt.GLUON_PHASES) for _, times in stamped.buffers]
    row = dict(context=context, budget=budget, calls=len(calls), grid=list(stamped.buffers[0][0]))
    row["split"] = {k: round(statistics.median(c[0][k][0] for c in calls), 2) for k in calls[0][0]}
    row["split_span_us"] = round(statistics.median((c[2] - c[1]) / 1e3 for c in calls), 2)
    return row


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--budget", type=int, default=8)
    args = parser.parse_args()
    rows = [in_step(args.context, args.budget)]
    print(json.dumps(rows[-1]), flush=True)
    T = args.budget + 1
    rows.append(pt.run_case(args.context + T, 8, T, 121, pt.stamped_module(), pt.stamped_gluon_module()))
    print(json.dumps(rows[-1]), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "step_attention_timeline.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
