"""The attention's split merge alone, its blocks (BLOCK_S splits x BLOCK_D values a step) and warps against the
merge_blocks rule (the committed one when run), at the split counts the defaults run (partials L2-warm, as the split
kernel leaves them: bench_attention.merge_time_us's timing).

--variants: instead, at the rule's blocks, the committed merge against a copy whose partials' load does not wait
for the lse load (o loaded where the split exists, empty splits' o zeroed after), beside the L2 read ceiling
measured in the same run: a plain kernel summing the same partials (16 KB a program).

Usage (device): python bench/probe_merge.py --out DIR [--variants]
"""

import argparse
import inspect
import json
from pathlib import Path

import torch
import triton
import triton.language as tl

import bench_attention as ba
import probe_attention_timeline as pt
from triton_kernels import mla_attention as mk

# (rows, splits, partials) the defaults run: 32k / 128k H 8 T 1 (tail split; Triton's 16-row kernel), T*H = 64 at
# 32k / 128k, 32k H 8 T 32 and H 64 T 8, the 4k step's T 9, 33, 65, 129 (the Gluon kernel's bf16 partials)
CASES = [(8, 257, torch.bfloat16), (8, 264, torch.bfloat16), (64, 129, torch.bfloat16), (64, 132, torch.bfloat16),
         (256, 33, torch.bfloat16), (512, 17, torch.bfloat16), (72, 66, torch.bfloat16), (264, 27, torch.bfloat16),
         (520, 15, torch.bfloat16), (1032, 7, torch.bfloat16)]
BLOCKS_S = (8, 16, 32, 64, 128, 256, 512)
BLOCKS_D = (16, 32, 64, 128, 256, 512)
WARPS = (2, 4, 8)


def time_merge(o_part, lse_part, out, rows, splits, block_s, block_d, warps, kernel=mk._merge_kernel):
    grid = (rows, 512 // block_d, 1)
    return ba.graph_time_us(lambda _: kernel[grid](o_part, lse_part, out, rows, splits, BLOCK_S=block_s,
                                                   BLOCK_D=block_d, num_warps=warps), [None] * 8)


@triton.jit
def _read_kernel(x_ptr, sums_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    tl.store(sums_ptr + tl.program_id(0), tl.sum(tl.load(x_ptr + offs, mask=offs < n, other=0.0).to(tl.float32), 0))


def unmasked_merge():
    """_merge_kernel with the partials' load independent of the lse load (a module's copy)."""
    src = inspect.getsource(mk._merge_kernel.fn)
    for old, new in (("mask=o_ok[:, None], other=0.0)", "mask=s_ok[:, None], other=0.0)"),
                     ("o = o.to(tl.float32)", "o = tl.where(o_ok[:, None], o.to(tl.float32), 0.0)")):
        assert src.count(old) == 1, f"_merge_kernel changed: update the probe ({old})"
        src = src.replace(old, new)
    header = "import triton\nimport triton.language as tl\nfrom triton_kernels import pdl\n"
    return pt.load_source("merge_unmasked", header + src)._merge_kernel


def variants(args):
    """The committed merge, the unmasked-load copy and the L2 read ceiling at the rule's blocks, per case."""
    unmasked = unmasked_merge()
    rows_out = []
    for rows, splits, dtype in CASES:
        o_part = torch.randn(1, splits, rows, 512, device="cuda").to(dtype)
        lse_part = torch.randn(1, splits, rows, device="cuda")
        lse_part[0, splits // 3] = float("-inf")  # an empty split: its o never written (here NaN)
        o_part[0, splits // 3] = float("nan")
        blocks = mk.merge_blocks(splits)
        outs = [torch.empty(1, rows, 512, dtype=torch.bfloat16, device="cuda") for _ in range(2)]
        row = dict(rows=rows, splits=splits, blocks=list(blocks),
                   committed_us=round(time_merge(o_part, lse_part, outs[0], rows, splits, *blocks), 2),
                   unmasked_us=round(time_merge(o_part, lse_part, outs[1], rows, splits, *blocks, unmasked), 2))
        row["equal"] = bool(torch.equal(outs[0], outs[1])) and not outs[0].isnan().any().item()
        flat, block = o_part.view(-1), 8192
        sums = torch.empty(triton.cdiv(flat.numel(), block), device="cuda")
        row["read_ceiling_us"] = round(ba.graph_time_us(
            lambda _: _read_kernel[(sums.numel(),)](flat, sums, flat.numel(), BLOCK=block, num_warps=4),
            [None] * 8), 2)
        row["partial_mb"] = round(flat.numel() * flat.element_size() / 1e6, 2)
        print(json.dumps(row), flush=True)
        rows_out.append(row)
    ba.write_probe_json(args.out, "merge_variants.json", rows_out)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--variants", action="store_true", help="the unmasked-load merge and the read ceiling")
    args = parser.parse_args()
    if args.variants:
        return variants(args)
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
