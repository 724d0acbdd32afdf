"""A few launches of the MoE, attention and DDTree kernels at chosen shapes, for `ncu` to profile (no timing here).

Usage (device): ncu --clock-control none --set full -k regex:'_gate_up|_down|_mla_split|_topk|_sample|_walk' \
    python bench/profile_kernels.py [--moe-m 1 64] [--moe-variant NAME] [--attn L,H,T ...] [--attn-config 64,64,8,2,512,1]
    [--tree BUDGET,BLOCK ...]
"""

import argparse

import torch

import bench_attention as ba
import bench_moe as bm
import bench_tree as bt
from triton_kernels.mla_attention import mla_attention
from triton_kernels.moe_w4a16 import moe


def run_moe(M, gen, variant=None):
    """Two TP8 calls at M tokens, under the default config or moe_configs.VARIANTS[variant] (in its layout)."""
    from triton_kernels.moe_configs import config_for, with_variant

    shape = bm.SHAPES["tp8"]
    cfg = with_variant(config_for(torch.device("cuda"), M), variant) if variant else None
    layer = bm.random_triton_layer(shape["E"], shape["D"], shape["I"], gen, cfg and cfg.get("panels"))
    for x, ids, weights in bm.routings(M, shape["E"], 2, gen):
        moe(x, ids, weights, layer, config=cfg)
    torch.cuda.synchronize()


def run_attention(L, H, T, config=None):
    q, caches, lens, mask = ba.make_inputs(L, H, T)
    for kv in caches[:2]:
        mla_attention(q, kv, lens, mask, 576 ** -0.5, config=config)
    torch.cuda.synchronize()


def run_tree(budget, block):
    """Two greedy DDTree steps (draft top-k, build, accept, compaction) of bench_tree's case at batch 1."""
    case = bt.Case(budget, block)
    with bt.ops.using(**bt.BACKEND):
        for _ in range(2):
            case.step()
    torch.cuda.synchronize()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--moe-m", type=int, nargs="*", default=[1, 64])
    parser.add_argument("--attn", nargs="*", default=["32768,8,1", "32768,64,32"])
    parser.add_argument("--moe-variant", help="a moe_configs.VARIANTS name instead of the default config")
    parser.add_argument("--tree", nargs="*", default=[], help="BUDGET,BLOCK cases of the DDTree step")
    parser.add_argument("--attn-config", help="BM,BN,warps,stages,DV,unchain (0/1) instead of the default config")
    args = parser.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    for M in args.moe_m:
        run_moe(M, gen, args.moe_variant)
    config = tuple(map(int, args.attn_config.split(","))) if args.attn_config else None
    config = config[:5] + (bool(config[5]),) if config else None
    for case in args.attn:
        run_attention(*map(int, case.split(",")), config=config)
    for case in args.tree:
        run_tree(*map(int, case.split(",")))


if __name__ == "__main__":
    main()
