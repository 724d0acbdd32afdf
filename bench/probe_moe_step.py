"""The verify step's own MoE calls, layer by layer, replayed with other MoE configs (issue #7).

bench_moe.py draws its routings from a model of the step's expert counts; here they are the step's: one TP8 rank
of K2.6 with random weights (bench_step.build_target), the cache at a context, the drafter's tree per budget,
and a hook that records every MoE layer's input and routing during an eager verify. Each config then replays all
the layers' calls in one CUDA graph (each layer its own experts, so the weights are cold in L2 as in the step);
its time per layer is compared with the default entry's, its outputs with the default's. The tokens an expert
gets are reported too: the tree's nodes share tokens, so they share experts, and an expert with more tokens than
a block's BM rows is read once per block.

    python bench/probe_moe_step.py --out DIR --budgets 8,32,64,128 --configs default,bm16,bm32

A config is a moe_configs.VARIANTS name (or one of EXTRA's) applied to the default entry of the call's M, or
`entry:N`, the entry of the bucket holding N tokens.
"""

import argparse
import json
import math
import time
from pathlib import Path

import torch
import triton

import bench_step as bs
from bench_tree import graph_of
from model.model import MoE
import ops
from triton_kernels import moe_configs, moe_w4a16

EXTRA = {  # probe-only variants (merged into the entry like VARIANTS')
    "bm32": dict(BM=32, gate_up=dict(maxnreg=None)),
    "bm64": dict(BM=64, gate_up=dict(maxnreg=None)),
    "bm32_w8": dict(BM=32, gate_up=dict(maxnreg=None, num_warps=8), down=dict(num_warps=8)),
    # the group scales applied to the weights before the MMA: per weight, not per accumulator element, so a
    # larger BM adds MMA work but no FMAs
    **{f"bm{bm}_pre": dict(BM=bm, gate_up=dict(maxnreg=None, prescale=True), down=dict(prescale=True))
       for bm in (8, 16, 32, 64)},
    # the tuned entries' dots as Triton 3.6 compiles them (wgmma, not prescaled), undoing moe_configs.NEWER_TRITON
    "wgmma_plain": dict(gate_up=dict(mma_v2=False, prescale=False), down=dict(mma_v2=False, prescale=False)),
}


def record_calls(model, tokens, positions, cache, tree_mask):
    """[(x, topk_ids, topk_weights, prepared experts)] of every MoE layer in an eager verify of these tokens."""
    calls = []

    def hook(moe, args):
        cfg, x = moe.cfg, args[0]
        weights, ids = ops.route(x, moe.gate.weight, moe.gate.e_score_correction_bias, cfg.num_experts_per_tok,
                                 cfg.n_group, cfg.topk_group, cfg.routed_scaling_factor, cfg.norm_topk_prob)
        calls.append((x.detach().clone(), ids, weights, moe.experts.prepared))

    handles = [m.register_forward_pre_hook(hook) for m in model.modules() if isinstance(m, MoE)]
    try:
        with torch.no_grad():
            model(tokens, positions, cache, tree_mask=tree_mask)
    finally:
        for h in handles:
            h.remove()
    return calls


def spread(calls, experts, blocks=(8, 16, 32, 64)):
    """Per layer averages: distinct experts, the most tokens one expert gets, and the blocks of each BM."""
    rows = []
    for _, ids, _, _ in calls:
        n = torch.bincount(ids.long().flatten(), minlength=experts)
        n = n[n > 0].tolist()
        rows.append([len(n), max(n)] + [sum(math.ceil(c / bm) for c in n) for bm in blocks])
    mean = [sum(col) / len(rows) for col in zip(*rows)]
    return dict(distinct=mean[0], max_tokens=mean[1], **{f"blocks_bm{bm}": v for bm, v in zip(blocks, mean[2:])})


def config_of(name, M, device):
    base = moe_configs.config_for(device, M)
    if name == "default":
        return base
    if name.startswith("entry:"):
        return moe_configs.config_for(device, int(name.split(":")[1]))
    return moe_configs.with_variant(base, name)


def replay_us(calls, cfg, iters):
    """us per layer of all calls replayed in one graph under config cfg, and the outputs of one replay."""
    outs = []

    def run():  # the captured call's outputs are the graph's
        outs[:] = [moe_w4a16.moe(x, ids, w, ex, keep_sums=True, config=cfg) for x, ids, w, ex in calls]

    graph = graph_of(run)
    ms = bs.wall_ms(graph.replay, iters)
    return ms * 1e3 / len(calls), [o.clone() for o in outs]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--budgets", default="8,32,64,128")
    parser.add_argument("--configs", default="default,bm16,bm32")
    parser.add_argument("--iters", type=int, default=10)
    args = parser.parse_args()
    moe_configs.VARIANTS.update(EXTRA)
    budgets = [int(b) for b in args.budgets.split(",")]
    names = args.configs.split(",")
    t0 = time.perf_counter()
    target = bs.build_target()
    drafter = bs.build_drafter(target)
    bench = bs.Bench(target, drafter, budgets, args.context)
    bench.set_context(args.context)
    print(f"built in {time.perf_counter() - t0:.0f} s", flush=True)
    rows = []
    for budget in budgets:
        tokens, positions, mask = bench.verify_inputs(budget)
        calls = record_calls(target, tokens, positions, bench.cache, mask)
        M = calls[0][0].shape[0]
        row = dict(budget=budget, M=M, **spread(calls, target.cfg.n_routed_experts), us={}, max_err={})
        ref = None
        for name in names:
            try:
                us, outs = replay_us(calls, config_of(name, M, target.device), args.iters)
            except Exception as e:  # a config that does not build or launch: reported, the others still run
                row["us"][name] = f"failed: {type(e).__name__}: {str(e)[:120]}"
                continue
            ref = ref or outs
            row["us"][name] = round(us, 2)
            row["max_err"][name] = max(float((o - r).abs().max() / r.abs().max()) for o, r in zip(outs, ref))
        rows.append(row)
        print(json.dumps(row), flush=True)
        torch.cuda.empty_cache()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = dict(gpu=torch.cuda.get_device_name(0), date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                triton=triton.__version__, context=args.context, iters=args.iters)
    (out / "moe_step.json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))


if __name__ == "__main__":
    main()
