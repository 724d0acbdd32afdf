"""Attention split counts on short caches (1k-16k entries): the committed rule's count against others given on the
command line, cache cold in L2, one CUDA graph over rotated caches (bench_attention's timing), bf16, B = 1.

Usage (device): python bench/probe_short_splits.py --out DIR L,H,T:S1/S2 ...   (S: extra split counts to time)
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
    parser.add_argument("cases", nargs="+", help="L,H,T:S1/S2 (extra split counts to time beside the rule's)")
    args = parser.parse_args()
    sms = sm_count(torch.device("cuda"))
    rows = []
    for case in args.cases:
        shape, _, extra = case.partition(":")
        L, H, T = (int(v) for v in shape.split(","))
        rule = ba.default_choice(T * H, 1, L, sms, tree=T)[1]
        q, caches, lens, mask = ba.make_inputs(L, H, T)
        ref = ba.mla_attention_torch(q.float(), caches[0].float(), lens, mask, ba.SCALE).double()
        row = dict(L=L, H=H, T=T, rule=rule, us={})
        for splits in [rule] + [int(s) for s in extra.split("/") if s]:
            us, err = ba.checked_time_us(lambda kv: mk.mla_attention(q, kv, lens, mask, ba.SCALE, num_splits=splits),
                                         caches, ref)
            row["us"][splits] = dict(us=us, rel_err=err)
        rows.append(row)
        print(json.dumps(row), flush=True)
    ba.write_probe_json(args.out, "short_splits.json", rows)


if __name__ == "__main__":
    main()
