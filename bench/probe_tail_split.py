"""The attention's tail split (TAIL_SPLIT: the last split takes the tree's tiles) against the whole-range splits, at
each one's own default split count and at the other's, cache cold in L2, one CUDA graph over rotated caches
(bench_attention's timing), bf16, B = 1.

Usage (device): python bench/probe_tail_split.py --out DIR L,H,T[,pad] ...
"""

import argparse
import json
from pathlib import Path

import torch

import bench_attention as ba
from triton_kernels import mla_attention as mk
from triton_kernels.moe_configs import sm_count


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("cases", nargs="+", help="L,H,T[,pad]")
    args = parser.parse_args()
    sms = sm_count(torch.device("cuda"))
    ceil = ba.ceilings()
    rows = []
    for case in args.cases:
        L, H, T, pad = ba.parse_case(case)
        entry = mk.entry_for(T * H, 90)
        value_bytes = (entry.partials or torch.bfloat16).itemsize
        counts = {tail: mk.default_splits(entry, T * H, 1, L + pad, sms, 90, value_bytes, tree=T, tail=tail)
                  for tail in (True, False)}
        q, caches, lens, mask = ba.make_inputs(L, H, T, pad=pad)
        ref = ba.mla_attention_torch(q.float(), caches[0].float(), lens, mask, ba.SCALE).double()
        roof = ba.case_costs(L, H, T, 1, ceil)[3]
        row = dict(L=L, H=H, T=T, pad=pad, roofline_us=round(roof, 2), runs=[])
        for tail in (True, False):
            for splits in dict.fromkeys([counts[tail], counts[not tail]]):
                def call(kv):
                    return mk.mla_attention(q, kv, lens, mask, ba.SCALE, num_splits=splits, tail_split=tail)
                us, err = ba.checked_time_us(call, caches, ref)
                row["runs"].append(dict(tail=tail, splits=splits, default=splits == counts[tail], us=round(us, 2),
                                        x_roofline=round(us / roof, 3), rel_err=err))
        rows.append(row)
        print(json.dumps(row), flush=True)
    ba.write_probe_json(args.out, "tail_split.json", rows, ceilings=ceil)


if __name__ == "__main__":
    main()
