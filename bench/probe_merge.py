"""The attention's split merge alone, its blocks (BLOCK_S splits x BLOCK_D values a step) and warps against the
merge_blocks rule (the committed one when run), at the split counts the defaults run (partials L2-warm, as the split
kernel leaves them: bench_attention.merge_time_us's timing).

Usage (device): python bench/probe_merge.py --out DIR
"""

import argparse
import json
from pathlib import Path

import torch
import triton

import bench_attention as ba
from triton_kernels import mla_attention as mk

# (rows, splits, partials) the defaults run: 32k / 128k H 8 T 1 (tail split; Triton's 16-row kernel), T*H = 64 at
# 32k / 128k, 32k H 8 T 32 and H 64 T 8, the 4k step's T 9, 33, 65, 129 (the Gluon kernel's bf16 partials)
CASES = [(8, 257, torch.bfloat16), (8, 264, torch.bfloat16), (64, 129, torch.bfloat16), (64, 132, torch.bfloat16),
         (256, 33, torch.bfloat16), (512, 17, torch.bfloat16), (72, 66, torch.bfloat16), (264, 27, torch.bfloat16),
         (520, 15, torch.bfloat16), (1032, 7, torch.bfloat16)]
BLOCKS_S = (8, 16, 32, 64, 128, 256, 512)
BLOCKS_D = (16, 32, 64, 128, 256, 512)
WARPS = (2, 4, 8)


def time_merge(o_part, lse_part, out, rows, splits, block_s, block_d, warps):
    grid = (rows, 512 // block_d, 1)
    return ba.graph_time_us(lambda _: mk._merge_kernel[grid](o_part, lse_part, out, rows, splits, BLOCK_S=block_s,
                                                             BLOCK_D=block_d, num_warps=warps), [None] * 8)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    rows_out = []
    for rows, splits, dtype in CASES:
        o_part = torch.randn(1, splits, rows, 512, device="cuda").to(dtype)
        lse_part = torch.randn(1, splits, rows, device="cuda")
        ref = torch.empty(1, rows, 512, dtype=torch.bfloat16, device="cuda")
        rule = mk.merge_blocks(splits)
        base = time_merge(o_part, lse_part, ref, rows, splits, *rule)
        row = dict(rows=rows, splits=splits, partials=str(dtype), rule=list(rule), rule_us=round(base, 2),
                   runs=[])
        for bs in BLOCKS_S:
            for bd in BLOCKS_D:
                if not 512 <= bs * bd <= 16384 or bs > 2 * triton.next_power_of_2(splits):
                    continue
                for warps in WARPS:
                    out = torch.empty_like(ref)
                    us = time_merge(o_part, lse_part, out, rows, splits, bs, bd, warps)
                    ok = torch.allclose(out.float(), ref.float(), atol=1e-2, rtol=1e-2)
                    row["runs"].append([bs, bd, warps, round(us, 2), ok])
        best = min(row["runs"], key=lambda r: r[3])
        print(json.dumps(dict(rows=rows, splits=splits, rule=row["rule"], rule_us=row["rule_us"], best=best,
                              top5=sorted(row["runs"], key=lambda r: r[3])[:5])), flush=True)
        rows_out.append(row)
    ba.write_probe_json(args.out, "merge_blocks.json", rows_out)


if __name__ == "__main__":
    main()
