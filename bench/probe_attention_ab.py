"""mla_attention's defaults against call options (e.g. tail_split=False) or module settings (a dotted name, e.g.
mla_gluon.TMA_STORE_RINGS=((32,4),), set on triton_kernels' module while the variant runs), cache cold in L2, one
CUDA graph over rotated caches (bench_attention's timing), bf16, B = 1; each variant's output checked against the fp32
reference.

Usage (device): python bench/probe_attention_ab.py --out DIR --option tail_split=False [--option ...] L,H,T[,pad] ...
"""

import argparse
import ast
import contextlib
import importlib
import json
from pathlib import Path

import bench_attention as ba
from triton_kernels import mla_attention as mk


@contextlib.contextmanager
def module_settings(settings):
    """While open: each "module.NAME" of `settings` set on triton_kernels.module, put back afterwards."""
    saved = []
    for dotted, value in settings.items():
        module_name, name = dotted.rsplit(".", 1)
        module = importlib.import_module(f"triton_kernels.{module_name}")
        saved.append((module, name, getattr(module, name)))
        setattr(module, name, value)
    try:
        yield
    finally:
        for module, name, value in reversed(saved):
            setattr(module, name, value)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--option", action="append", default=[], help="NAME=VALUE keyword(s) of one variant")
    parser.add_argument("cases", nargs="+", help="L,H,T[,pad]")
    args = parser.parse_args()
    variants = {"default": {}} | {o: dict(_option(kv) for kv in _split_option(o)) for o in args.option}
    ceil = ba.ceilings()
    rows = []
    for case in args.cases:
        L, H, T, pad = ba.parse_case(case)
        q, caches, lens, mask = ba.make_inputs(L, H, T, pad=pad)
        ref = ba.mla_attention_torch(q.float(), caches[0].float(), lens, mask, ba.SCALE).double()
        roof = ba.case_costs(L, H, T, 1, ceil)[3]
        row = dict(L=L, H=H, T=T, pad=pad, roofline_us=round(roof, 2), runs={})
        for name, variant in list(variants.items()) + [("default again", {})]:
            kwargs = {k: v for k, v in variant.items() if "." not in k}
            def call(kv):
                return mk.mla_attention(q, kv, lens, mask, ba.SCALE, **kwargs)
            with module_settings({k: v for k, v in variant.items() if "." in k}):
                us, err = ba.checked_time_us(call, caches, ref)
            row["runs"][name] = dict(us=round(us, 2), x_roofline=round(us / roof, 3), rel_err=err)
        rows.append(row)
        print(json.dumps(row), flush=True)
    ba.write_probe_json(args.out, "attention_ab.json", rows, ceilings=ceil, variants=variants)


def _split_option(option):
    """An --option's NAME=VALUE parts, split at the commas outside brackets (a value may be a tuple)."""
    parts, depth, start = [], 0, 0
    for i, c in enumerate(option):
        if c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
        elif c == "," and depth == 0:
            parts.append(option[start:i])
            start = i + 1
    return parts + [option[start:]]


def _option(part):
    name, value = part.split("=", 1)
    return name, ast.literal_eval(value)


if __name__ == "__main__":
    main()
