"""mla_attention's defaults against call options (e.g. tail_split=False), cache cold in L2, one CUDA graph over rotated
caches (bench_attention's timing), bf16, B = 1; each variant's output checked against the fp32 reference.

Usage (device): python bench/probe_attention_ab.py --out DIR --option tail_split=False [--option ...] L,H,T[,pad] ...
"""

import argparse
import ast
import json
from pathlib import Path

import bench_attention as ba
from triton_kernels import mla_attention as mk


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--option", action="append", default=[], help="NAME=VALUE keyword(s) of one variant")
    parser.add_argument("cases", nargs="+", help="L,H,T[,pad]")
    args = parser.parse_args()
    variants = {"default": {}} | {o: {k: ast.literal_eval(v) for k, v in (kv.split("=") for kv in o.split(","))}
                                  for o in args.option}
    ceil = ba.ceilings()
    rows = []
    for case in args.cases:
        L, H, T, pad = ba.parse_case(case)
        q, caches, lens, mask = ba.make_inputs(L, H, T, pad=pad)
        ref = ba.mla_attention_torch(q.float(), caches[0].float(), lens, mask, ba.SCALE).double()
        roof = ba.case_costs(L, H, T, 1, ceil)[3]
        row = dict(L=L, H=H, T=T, pad=pad, roofline_us=round(roof, 2), runs={})
        for name, kwargs in list(variants.items()) + [("default again", {})]:
            def call(kv):
                return mk.mla_attention(q, kv, lens, mask, ba.SCALE, **kwargs)
            us, err = ba.checked_time_us(call, caches, ref)
            row["runs"][name] = dict(us=round(us, 2), x_roofline=round(us / roof, 3), rel_err=err)
        rows.append(row)
        print(json.dumps(row), flush=True)
    ba.write_probe_json(args.out, "attention_ab.json", rows, ceilings=ceil, variants=variants)


if __name__ == "__main__":
    main()
