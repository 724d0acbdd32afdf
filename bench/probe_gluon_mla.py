"""The MLA split kernel in Gluon (`triton_kernels/mla_gluon.py`) against the Triton one, through the op (issue #6).

`mla_attention(..., gluon=True)` runs the hand-scheduled Gluon split kernel, False the Triton kernel; the merge
is the same. First, outputs on ragged batches, trees, causal rows, the tail split and one split (the cache past
each length NaN), Gluon against Triton; then times at issue #6's 32k cases over 2x, a compute-bound one, 128k
and the 4k verify shapes, each kernel at the op's default split count and tail rule, a random tree mask, the
cache cold in L2 (one CUDA graph over rotated copies).

--sweep times the Gluon op instead at SWEEP's split counts (fp32 and bf16 partials), and its split kernel alone
(no merge) at the default count. --rings checks and times it with each of RINGS's cache rings (entries a tile,
tiles in the ring) at the default split count, and at RING_SPLITS's counts where given. --splits times it at split
counts from half to twice the default.

    python bench/probe_gluon_mla.py --out DIR [--sweep | --rings | --splits]      # GPU (Hopper)
"""

import argparse
import itertools
import json
import math
import time
from pathlib import Path

import torch
import triton

from bench_tree import graph_of  # bench/ is on sys.path when this file runs as a script
from ops.attention import pack_tree_mask
from triton_kernels import mla_gluon
from triton_kernels.mla_attention import mla_attention, tail_split_default

ENTRY = 576
SCALE = 1.0 / math.sqrt(192)


def _time_us(fn, calls):
    """us per call of `calls` back-to-back calls (each its own cache copy) replayed in one CUDA graph."""
    graph = graph_of(lambda: [fn(c) for c in range(calls)])
    ms = triton.testing.do_bench(graph.replay, warmup=5, rep=60, return_mode="median")
    return ms * 1e3 / calls


def random_tree_mask(B, T, gen):
    """[B, T, ceil(T/32)] int32: node t sees itself and a random subset of the nodes before it (any bit pattern
    serves: both kernels read the same bits)."""
    seen = torch.rand(B, T, T, generator=gen, device="cuda") < 0.3
    return pack_tree_mask(seen.tril(-1) | torch.eye(T, dtype=torch.bool, device="cuda"))


def case(lens, L_max, H, T, tree, seed, copies=1):
    gen = torch.Generator("cuda").manual_seed(seed)
    q = torch.randn(len(lens), T, H, ENTRY, generator=gen, device="cuda").to(torch.bfloat16)
    kvs = []
    for _ in range(copies):
        kv = torch.randn(len(lens), L_max, ENTRY, generator=gen, device="cuda").to(torch.bfloat16)
        for b, n in enumerate(lens):
            kv[b, n:] = float("nan")  # past the length: must never be read
        kvs.append(kv)
    mask = random_tree_mask(len(lens), T, gen) if tree else None
    return q, kvs, torch.tensor(lens, dtype=torch.int32, device="cuda"), mask


def check(lens, L_max, H, T, splits, tree, tail, seed):
    """Gluon against Triton at the same split count and tail rule (the 64x64 config for both)."""
    q, (kv,), cache_lens, mask = case(lens, L_max, H, T, tree, seed)
    kw = dict(num_splits=splits, tail_split=tail, config=(64, 64, 8, 2, 512, True))
    ref = mla_attention(q, kv, cache_lens, mask, SCALE, gluon=False, **kw).float()
    out = mla_attention(q, kv, cache_lens, mask, SCALE, gluon=True, **kw).float()
    return dict(lens=lens, L_max=L_max, H=H, T=T, splits=splits, tree=tree, tail=tail,
                rel_err=float((out - ref).norm() / ref.norm()), nan=bool(out.isnan().any()))


def timing(L, H, T, copies=6, seed=0):
    """us of the op with the Gluon and the Triton split kernel, each at the op's defaults, tree mask."""
    q, kvs, cache_lens, mask = case([L], L, H, T, True, seed, copies)
    row = dict(L=L, H=H, T=T)
    for name, gluon in (("gluon", True), ("triton", False)):
        run = lambda c, g=gluon: mla_attention(q, kvs[c], cache_lens, mask, SCALE, gluon=g)  # noqa: E731
        row[f"{name}_us"] = round(_time_us(run, copies), 2)
    return row


def sweep(L, H, T, counts, copies=6, seed=0):
    """us of the Gluon op at each split count (fp32 and the op's bf16 partials) and of its split kernel alone (the
    op's count)."""
    q, kvs, cache_lens, mask = case([L], L, H, T, True, seed, copies)
    row = dict(L=L, H=H, T=T)
    for splits, (name, dtype) in itertools.product(counts, (("fp32", torch.float32), ("bf16", torch.bfloat16))):
        run = lambda c, s=splits, d=dtype: mla_attention(q, kvs[c], cache_lens, mask, SCALE, num_splits=s,  # noqa
                                                         partials=d, gluon=True)
        row[f"{splits}_{name}_us"] = round(_time_us(run, copies), 2)
    rows, splits = T * H, row_splits(q, kvs[0], cache_lens, mask)
    o_part = torch.empty(1, splits, rows, 512, dtype=torch.bfloat16, device="cuda")
    lse_part = torch.empty(1, splits, rows, dtype=torch.float32, device="cuda")
    alone = lambda c: mla_gluon.split(q, kvs[c], cache_lens, mask, o_part, lse_part, splits, SCALE * 1.4427,  # noqa
                                      False, tail_split_default(T, 64, 90))
    row.update(default_splits=splits, split_kernel_alone_us=round(_time_us(alone, copies), 2))
    return row


def with_ring(ring, fn):
    """fn() with the op's Gluon launches on cache ring `ring` (entries a tile, tiles in the ring)."""
    launch = mla_gluon.split
    mla_gluon.split = lambda *args: launch(*args, ring=ring)
    try:
        return fn()
    finally:
        mla_gluon.split = launch


def rings(L, H, T, counts, copies=6, seed=0):
    """us of the Gluon op with each of RINGS at the default split count (and at `counts`)."""
    q, kvs, cache_lens, mask = case([L], L, H, T, True, seed, copies)
    row = dict(L=L, H=H, T=T, default_splits=row_splits(q, kvs[0], cache_lens, mask))
    for ring, splits in itertools.product(RINGS, (None, *counts)):
        run = lambda c, s=splits: mla_attention(q, kvs[c], cache_lens, mask, SCALE, num_splits=s, gluon=True)  # noqa
        row[f"{ring[0]}x{ring[1]}_{splits or 'default'}_us"] = round(with_ring(ring, lambda: _time_us(run, copies)), 2)
    return row


def split_counts(L, H, T, copies=6, seed=0):
    """us of the Gluon op at split counts from half to twice the default (SPLIT_FACTORS), for refitting the split
    model (mla_attention.CONFIGS)."""
    q, kvs, cache_lens, mask = case([L], L, H, T, True, seed, copies)
    default = row_splits(q, kvs[0], cache_lens, mask)
    row = dict(L=L, H=H, T=T, default_splits=default, us={})
    for splits in sorted({max(1, round(default * f)) for f in SPLIT_FACTORS}):
        run = lambda c, s=splits: mla_attention(q, kvs[c], cache_lens, mask, SCALE, num_splits=s, gluon=True)  # noqa
        row["us"][splits] = round(_time_us(run, copies), 2)
    return row


def row_splits(q, kv, cache_lens, mask):
    """The op's default split count for this call, read off its launch of the Gluon kernel."""
    counts, launch = [], mla_gluon.split

    def traced(*args):
        counts.append(args[6])  # num_splits
        return launch(*args)

    mla_gluon.split = traced
    try:
        mla_attention(q, kv, cache_lens, mask, SCALE, gluon=True)
    finally:
        mla_gluon.split = launch
    return counts[0]


SWEEP = [(32768, 64, 1, (129,)), (32768, 8, 8, (129,)), (32768, 8, 32, (33,)), (32768, 64, 8, (17,)),
         (32768, 64, 128, (17,)), (131072, 64, 1, (132,)), (4105, 8, 9, (33,)), (4129, 8, 33, (17, 27)),
         (4225, 8, 129, (7,))]
CHECKS = [  # (lens, L_max, H, T, splits, tree, tail): ragged lengths, batches, trees, causal, tail split, 1 split
    ([4129], 4200, 8, 33, 27, True, True), ([1000, 777], 1100, 16, 7, 8, True, False),
    ([300], 333, 8, 5, 4, False, False), ([4105, 901], 4400, 8, 9, 20, True, True), ([130], 130, 64, 1, 2, True, False),
    ([2000], 2048, 8, 65, 6, True, True), ([519], 600, 8, 16, 1, True, False),
    # odd and even tile counts a split (the kernel's pairs), a ragged last tile, several query tiles, batches
    ([4100], 4200, 64, 1, 33, True, True), ([4100], 4200, 64, 1, 7, True, False),
    ([3000, 190], 3100, 8, 16, 5, True, False), ([200], 256, 8, 30, 1, False, False)]
RINGS = [(64, 2), (32, 4), (16, 8)]
SPLIT_FACTORS = (0.5, 0.67, 0.75, 0.85, 1, 1.15, 1.33, 1.5, 2)
RING_SPLITS = {(32768, 64, 1): (88, 132, 176), (32768, 8, 8): (88, 132, 176)}
SPLIT_TIMES = [(131072, 8, 8), (131072, 8, 32), (131072, 64, 8), (32768, 8, 64), (32768, 64, 32), (8192, 8, 33),
               (32768, 8, 33)]  # beside TIMES: more of issue #6's sweep and the 8k / 32k verify shapes
TIMES = [  # (L, H, T): issue #6's 32k cases over 2x, compute-bound and 128k ones, the 4k verify shapes
    (32768, 64, 1), (32768, 8, 8), (32768, 8, 32), (32768, 64, 8), (32768, 64, 128), (131072, 64, 1), (4129, 8, 33),
    (4105, 8, 9), (4161, 8, 65), (4225, 8, 129)]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--sweep", action="store_true", help="split counts and the split kernel alone")
    parser.add_argument("--rings", action="store_true", help="RINGS's cache rings: checks and times")
    parser.add_argument("--splits", action="store_true", help="times at split counts around the default")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report = dict(meta=dict(gpu=torch.cuda.get_device_name(0), triton=triton.__version__,
                            date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())), checks=[], times=[])
    if args.sweep:
        for args_ in SWEEP:
            report["times"].append(sweep(*args_))
            print(json.dumps(report["times"][-1]), flush=True)
            (out / "gluon_mla_sweep.json").write_text(json.dumps(report, indent=1))
        return
    if args.rings:
        for ring, args_ in itertools.product(RINGS, CHECKS):
            report["checks"].append(dict(ring=ring, **with_ring(ring, lambda: check(*args_, seed=7))))
            print(json.dumps(report["checks"][-1]), flush=True)
        for args_ in TIMES:
            report["times"].append(rings(*args_, RING_SPLITS.get(args_, ())))
            print(json.dumps(report["times"][-1]), flush=True)
            (out / "gluon_mla_rings.json").write_text(json.dumps(report, indent=1))
        return
    if args.splits:
        for args_ in TIMES + SPLIT_TIMES:
            report["times"].append(split_counts(*args_))
            print(json.dumps(report["times"][-1]), flush=True)
            (out / "gluon_mla_splits.json").write_text(json.dumps(report, indent=1))
        return
    for args_ in CHECKS:
        report["checks"].append(check(*args_, seed=len(report["checks"])))
        print(json.dumps(report["checks"][-1]), flush=True)
    for args_ in TIMES:
        report["times"].append(timing(*args_))
        print(json.dumps(report["times"][-1]), flush=True)
        (out / "gluon_mla.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
