"""The fixed cost of one dependent kernel in a CUDA-graph chain: how much of a decode step the launches alone take.

A chain of N copies of a trivial kernel, each reading what the one before wrote (a dependent chain, as a layer's
kernels are), captured in one CUDA graph and replayed; time per kernel, with and without programmatic dependent
launch (PDL), for grids of 1 to 2 waves of CTAs. The step's budget-0 verify runs 14 such dependent kernels a layer.

Usage (device): python bench/probe_launch_chain.py --out DIR
"""

import argparse
import json
import time
from pathlib import Path

import torch
import triton
import triton.language as tl

from bench_moe import time_graph
from triton_kernels import pdl
from triton_kernels.moe_configs import sm_count

CHAIN = 200  # kernels a graph


@triton.jit
def _step_kernel(src_ptr, dst_ptr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    """dst[program's block] = src[program's block] + 1 (each program reads what the previous kernel wrote)."""
    pdl.enter(PDL)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(dst_ptr + offs, tl.load(src_ptr + offs) + 1.0)


def chain_us(ctas, use_pdl, block=1024):
    a = torch.zeros(ctas * block, device="cuda")
    b = torch.zeros_like(a)
    options = dict(PDL=True, launch_pdl=True) if use_pdl else dict(PDL=False)

    def call(i):
        src, dst = (a, b) if i % 2 == 0 else (b, a)
        _step_kernel[(ctas,)](src, dst, BLOCK=block, num_warps=4, **options)

    us = time_graph([lambda i=i: call(i) for i in range(CHAIN)]) * 1e3
    return us, a.min().item() > 0  # every element was written by the chain (the kernels ran)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    sms = sm_count(torch.device("cuda"))
    rows = []
    for ctas in (1, 8, sms, 2 * sms, 4 * sms):
        for use_pdl in (False, True):
            us, ran = chain_us(ctas, use_pdl)
            rows.append(dict(ctas=ctas, pdl=use_pdl, us_per_kernel=us, ran=ran))
            print(json.dumps(rows[-1]), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    meta = dict(gpu=torch.cuda.get_device_name(0), torch=torch.__version__, triton=triton.__version__,
                date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), chain=CHAIN)
    (args.out / "launch_chain.json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))


if __name__ == "__main__":
    main()
