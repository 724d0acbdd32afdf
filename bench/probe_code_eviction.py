"""An attention call's time with its code evicted between calls (issue #7: the Gluon split kernel is slower inside
the verify step than alone).

Between calls a verify step runs its other kernels, which evict the attention kernels' code from the SMs'
instruction caches, and tens of MB of weights, which evict it from L2: each call then fetches its code cold. Here
each call of the op (a CUDA graph over rotated caches, cache cold in L2, as bench_attention times it) follows, per
mode: nothing; two kernels of 4,096 unrolled FMAs each on every SM (about 130 KB of code apiece: the instruction
caches); those and a 128 MB memset (L2 too). The evicting work's own time, measured alone in the same graph
shape, is subtracted.

--gluon-module FILE adds the Gluon split kernel of FILE (a copy of mla_gluon.py, e.g. another commit's).

    python bench/probe_code_eviction.py --out DIR [--gluon-module FILE] [L,H,T[,pad] ...]      # GPU
"""

import argparse
import json
from pathlib import Path

import torch
import triton
import triton.language as tl

import bench_attention as ba
from triton_kernels import mla_attention as mk
from triton_kernels import mla_gluon

CASES = ["4105,8,9,121", "4129,8,33,95", "32768,64,1"]  # the 4k verify's budgets 8 and 32, a 64-row 32k case


@triton.jit
def _unrolled_fmas(x_ptr, N: tl.constexpr, SEED: tl.constexpr):
    x = tl.load(x_ptr + tl.program_id(0))
    for i in tl.static_range(N):
        x = x * 1.0001 + (i + SEED)
    tl.store(x_ptr + tl.program_id(0), x)


def evictors():
    """(name, work before each call): the instruction caches' evictor, then it and an L2 flush."""
    scratch = torch.zeros(1024, device="cuda")
    flush = torch.empty(128 << 20, dtype=torch.uint8, device="cuda")
    code = lambda: [_unrolled_fmas[(264,)](scratch, N=4096, SEED=s, num_warps=4) for s in (0, 1)]  # noqa: E731
    return [("icache", code), ("icache_l2", lambda: (code(), flush.zero_()))]


def run_case(L, H, T, pad, modes, kernels):
    """us of the op with each of `kernels` ((name, gluon, the Gluon launcher or None: the committed one)), plain and
    after each of `modes`."""
    q, caches, lens, mask = ba.make_inputs(L, H, T, pad=pad)
    row = dict(L=L, H=H, T=T, pad=pad)
    committed = mla_gluon.split
    for name, gluon, launcher in kernels:
        mla_gluon.split = launcher or committed
        try:
            attn = lambda kv, g=gluon: mk.mla_attention(q, kv, lens, mask, ba.SCALE, gluon=g)  # noqa: E731
            row[f"{name}_us"] = round(ba.graph_time_us(attn, caches), 2)
            for mode, before in modes:
                both = ba.graph_time_us(lambda kv: (before(), attn(kv)), caches)
                alone = ba.graph_time_us(lambda kv: before(), caches)
                row[f"{name}_after_{mode}_us"] = round(both - alone, 2)
        finally:
            mla_gluon.split = committed
    return row


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--gluon-module", metavar="FILE", help="also the Gluon split kernel of FILE")
    parser.add_argument("cases", nargs="*", default=CASES, help="L,H,T[,pad]")
    args = parser.parse_args()
    kernels = [("gluon", True, None), ("triton", False, None)]
    if args.gluon_module:
        kernels.append(("module", True, ba.module_from_file(args.gluon_module).split))
    modes, rows = evictors(), []
    for case in args.cases:
        rows.append(run_case(*ba.parse_case(case), modes, kernels))
        print(json.dumps(rows[-1]), flush=True)
    ba.write_probe_json(args.out, "code_eviction.json", rows, gluon_module=args.gluon_module)


if __name__ == "__main__":
    main()
