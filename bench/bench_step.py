"""One TP8 rank of K2.6 on one GPU: the verify pass per tree-size bucket, with and without CUDA graphs, the
whole DDTree step and the autoregressive step, each against its memory floor.

    python -m bench.bench_step --out DIR [--quick] [--contexts 4096,32768] [--buckets 0,8,...] [--long-buckets 0,32]

Builds KimiModel(kimi-k2.6, Parallel(8, 0)) in bf16 with random weights made on the GPU (INT4 experts included,
no checkpoint), and a drafter of the Kimi-K2.5-DFlash shape sharded the same way (rank 0 of 8: 8 query heads, 1
key/value head, 1/8 of the MLP), scoring with the target's lm_head shard. Per context and bucket it times
back-to-back calls between two CUDA events (so the GPU's waits on the host show): the verify eagerly and as a
graph replay, the sum of its kernels (profiler, eager run), the whole step (draft, top-k, tree build, verify,
accept, compact, drafter context append) eagerly and graphed (draft + top-k + build one replay, the verify
another) and the autoregressive step (root-only verify replay + accept), and the draft + top-k + build replay
alone with the kernels of its eager run. Each is divided by its floor: the bytes it must read (`floor_bytes`)
over the read bandwidth measured in the same run. Writes step.json and step.md to --out; prints the table last.

The CPU-side pieces (model and drafter building, floor arithmetic, expert counting) run on any preset and
device; tests/test_graphs.py checks them on 'tiny'.
"""

import argparse
import json
import time
from pathlib import Path

import torch

import ops
from bench.common import GpuStamp, metadata, read_gbs
from model.config import preset
from model.model import KimiModel, MoE
from model.parallel import Parallel
from spec.drafter import DFlashDrafter, DrafterConfig
from spec.engine import root_tree
from spec.graphs import DEFAULT_BUCKETS, DraftGraphs, StepGraphs, draft_eligibility, eligibility, parse_buckets

CONTEXTS = (4096, 32768)
DFLASH_K25 = dict(num_hidden_layers=6, num_attention_heads=64, num_key_value_heads=8, head_dim=128,
                  intermediate_size=18432, block_size=8, target_layer_ids=(1, 12, 24, 35, 47, 58))
DFLASH_TINY = dict(num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                   intermediate_size=256, block_size=4, target_layer_ids=(0, 2))
DRAFTER_NOTE = ("Kimi-K2.5-DFlash shape, TP8 rank 0 like the target (8 of 64 query heads, 1 of 8 key/value heads, "
                "1/8 of the MLP), scoring with the target's lm_head shard")


# ---- building ---------------------------------------------------------------------------------------------

@torch.no_grad()
def fill_random_(module, seed=0, std=0.02):
    """Seeded random weights written in place on the module's device (no host or fp32 temporaries): int32
    words uniform (random nibbles), scales in [0.001, 0.005), norms 1, correction biases N(0, 0.1), the rest
    N(0, std)."""
    for i, (name, buf) in enumerate(module.state_dict(keep_vars=True).items()):  # no inv_freq, no joint views
        if buf is None:
            continue
        gen = torch.Generator(device=buf.device).manual_seed(seed * 100003 + i)
        if buf.dtype == torch.int32:
            buf.random_(-2**31, 2**31 - 1, generator=gen)
        elif name.endswith("_scale"):
            buf.uniform_(0.001, 0.005, generator=gen)
        elif "norm" in name:
            buf.fill_(1.0)
        elif name.endswith("e_score_correction_bias"):
            buf.normal_(0.0, 0.1, generator=gen)
        else:
            buf.normal_(0.0, std, generator=gen)
    return module


def build_target(name="kimi-k2.6", tp=8, rank=0, dtype=torch.bfloat16, device="cuda", seed=0):
    """One rank of a TP-sharded target with random weights, experts prepared for the current moe backend."""
    model = KimiModel(preset(name), Parallel(tp, rank), dtype, device)
    fill_random_(model, seed)
    return model.prepare(keep_checkpoint_form=False)


def drafter_config(target_cfg, shape=DFLASH_K25):
    """A DFlash config of the given shape over this target (hidden size, vocabulary, mask token)."""
    return DrafterConfig(hidden_size=target_cfg.hidden_size, vocab_size=target_cfg.vocab_size,
                         mask_token_id=target_cfg.vocab_size - 2, **shape)


def build_drafter(target, shape=DFLASH_K25, seed=1):
    drafter = DFlashDrafter(drafter_config(target.cfg, shape), target.dtype, target.device, target.par)
    return fill_random_(drafter, seed).bind(target)


# ---- floors -----------------------------------------------------------------------------------------------

def _bytes(tensors):
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def expert_bytes(cfg, tp, weight_bits=4, scale_bytes=2, group=32):
    """Bytes of one routed expert's shard: gate, up and down INT4 weights plus their group scales."""
    weights = 3 * cfg.hidden_size * (cfg.moe_intermediate_size // tp)
    return weights * weight_bits // 8 + weights // group * scale_bytes


def expected_distinct(experts, top_k, tokens):
    """Distinct experts that `tokens` tokens pick under uniform routing: E (1 - (1 - k/E)^n)."""
    return experts * (1 - (1 - top_k / experts) ** tokens)


def floor_bytes(model, batch, nodes, context, distinct, logits_rows=None):
    """The bytes one verify of `nodes` tokens per sequence must read (and the cache entries it writes), by part.

    distinct: per MoE layer, the number of distinct experts its tokens route to (or one number for all).
    Parts: attention weights, dense (norms, dense MLP, shared experts, router gates), experts (distinct x one
    expert's shard), kv (batch x (context + nodes) entries of every layer), lm_head (this rank's shard),
    embedding rows, logits (written, then read by accept).
    """
    cfg, moe_layers = model.cfg, model.moe_layers()
    per_layer = list(distinct) if hasattr(distinct, "__iter__") else [distinct] * len(moe_layers)
    if len(per_layer) != len(moe_layers):
        raise ValueError(f"floor_bytes: {len(per_layer)} expert counts for {len(moe_layers)} MoE layers")
    attention = _bytes(b for layer in model.layers for b in layer.self_attn.state_dict(keep_vars=True).values())
    dense = _bytes([model.norm.weight] + [b for layer in model.layers
                                          for n, b in layer.state_dict(keep_vars=True).items()
                                          if not n.startswith(("self_attn.", "mlp.experts."))])
    entry = cfg.cache_entry_dim * model.dtype.itemsize
    rows = batch * nodes if logits_rows is None else logits_rows
    return dict(
        attention=attention, dense=dense,
        experts=int(round(sum(per_layer) * expert_bytes(cfg, model.par.tp_size))),
        kv=cfg.num_hidden_layers * batch * (context + nodes) * entry,
        lm_head=_bytes([model.lm_head.weight]),
        embedding=batch * nodes * cfg.hidden_size * model.dtype.itemsize,
        logits=rows * model.lm_head.weight.shape[0] * model.dtype.itemsize,
    )


def drafter_floor_bytes(drafter, batch, context):
    """Bytes of one draft: the drafter's weights, its context K/V, the lm_head shard, the block's logits."""
    cfg, target = drafter.cfg, drafter.target
    kv_heads = drafter.layers[0].self_attn.kv_heads
    kv = 2 * cfg.num_hidden_layers * batch * (context + cfg.block_size) * kv_heads * cfg.head_dim
    return dict(weights=_bytes(b for n, b in drafter.named_buffers() if n != "inv_freq"),
                kv=kv * drafter.dtype.itemsize, lm_head=_bytes([target.lm_head.weight]),
                logits=batch * cfg.draft_len * target.lm_head.weight.shape[0] * target.dtype.itemsize)


@torch.no_grad()
def count_experts(model, tokens, positions, cache, tree_mask=None):
    """Per MoE layer, the distinct experts a forward of these tokens routes to (an eager pass with hooks)."""
    counts = []

    def hook(moe, args):
        cfg, x = moe.cfg, args[0]
        _, ids = ops.route(x, moe.gate.weight, moe.gate.e_score_correction_bias, cfg.num_experts_per_tok,
                           cfg.n_group, cfg.topk_group, cfg.routed_scaling_factor, cfg.norm_topk_prob)
        counts.append(int(ids.unique().numel()))

    handles = [m.register_forward_pre_hook(hook) for m in model.modules() if isinstance(m, MoE)]
    try:
        model(tokens, positions, cache, tree_mask=tree_mask)
    finally:
        for h in handles:
            h.remove()
    return counts


# ---- timing (GPU) -----------------------------------------------------------------------------------------

def loop_ms(fn, iters, warmup=2):
    """GPU ms per call of `iters` back-to-back calls between two CUDA events (the GPU waits when the host's
    launches are slow, so host overhead shows)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    start = GpuStamp()
    for _ in range(iters):
        fn()
    return 1e3 * (GpuStamp() - start) / iters


def kernel_ms(fn, top=25):
    """Sum of the GPU kernel times of one call (profiler), in ms (None if the profiler saw no kernel), and the
    `top` kernel names by total time as [name, calls, total us]."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    cuda = torch.autograd.DeviceType.CUDA
    by_name = {}
    for evt in prof.events():
        if evt.device_type == cuda:
            calls, us = by_name.get(evt.name, (0, 0.0))
            by_name[evt.name] = (calls + 1, us + evt.device_time_total)
    ranked = sorted(([name[:90], calls, round(us, 1)] for name, (calls, us) in by_name.items()), key=lambda r: -r[2])
    return sum(us for _, us in by_name.values()) / 1e3 or None, ranked[:top]


# ---- the measured pieces ------------------------------------------------------------------------------------

class Bench:
    """The target, drafter, caches and graphs at batch 1, the cache filled to a context length."""

    def __init__(self, target, drafter, buckets, max_context, batch=1):
        self.target, self.drafter, self.buckets, self.batch = target, drafter, buckets, batch
        top = max(buckets)
        self.cache = target.new_cache(batch, max_context + top + 1)
        L, block = drafter.cfg.draft_len, drafter.cfg.block_size
        self.dcache = drafter.new_cache(batch, max_context + L + max(L + 1, block))
        self.graphs = StepGraphs(target, self.cache, batch, buckets, drafter.target_layer_ids)
        dev = target.device
        self.bonus = torch.full((batch,), 7, dtype=torch.int64, device=dev)
        self.seeds = torch.arange(batch, dtype=torch.int64, device=dev)
        self.trees, self.drafts = {}, {}

    def set_context(self, n):
        for c in (self.cache, self.dcache):
            c.lens.fill_(n)
            c.set_host_lens([n] * self.batch)
        self.trees, self.drafts = {}, {}

    def tree(self, budget):
        """A tree built from the drafter's real pass (kept per budget for the verify-only timings)."""
        if budget not in self.trees:
            logits = self.drafter.draft(self.dcache, self.bonus)
            lp, tok = ops.draft_topk(logits, min(budget, logits.shape[-1]))
            self.trees[budget] = ops.build_tree(lp, tok, self.bonus, budget)
        return self.trees[budget]

    def verify_inputs(self, budget):
        if budget == 0:
            return self.bonus[:, None], self.cache.lens[:, None].long(), None
        tree = self.tree(budget)
        return tree.tokens, self.cache.lens[:, None].long() + tree.depths.long(), tree.mask

    def verify_eager_of(self, tokens, positions, mask):
        return self.target(tokens, positions, self.cache, tree_mask=mask, hidden_layers=self.graphs.hidden_layers)

    def verify_eager(self, budget):
        tokens, positions, mask = self.verify_inputs(budget)
        return lambda: self.verify_eager_of(tokens, positions, mask)

    def verify_graph(self, budget):
        tokens, positions, mask = self.verify_inputs(budget)
        return lambda: self.graphs.verify(tokens, positions, mask)

    def draft_tree(self, budget, graphed):
        """draft -> top-k -> build: one replay (captured on first use) when graphed and capturable, else eager."""
        if graphed and draft_eligibility(self.drafter)[0]:
            if budget not in self.drafts:
                self.drafts[budget] = DraftGraphs(self.drafter, self.dcache, self.batch, budget)
            return self.drafts[budget].tree(self.bonus)
        logits = self.drafter.draft(self.dcache, self.bonus)
        lp, tok = ops.draft_topk(logits, min(budget, logits.shape[-1]))
        return ops.build_tree(lp, tok, self.bonus, budget)

    def spec_step(self, budget, graphed=True):
        """draft, top-k, build, verify, accept, compact, drafter append (graphed: the first three as one replay,
        the verify as another); nothing committed: the drafter's lengths are put back after each call."""
        lens = self.dcache.lens.clone()
        verify = self.graphs.verify if graphed else self.verify_eager_of

        def step():
            tree = self.draft_tree(budget, graphed)
            out = verify(tree.tokens, self.cache.lens[:, None].long() + tree.depths.long(), tree.mask)
            path, path_len, nxt = ops.accept(tree, out.logits, 0.0, seeds=self.seeds, step=1)
            hidden = ops.compact(self.cache.kv, self.cache.lens, path, path_len, out.hidden)
            self.drafter.append_context(self.dcache, hidden, path_len)
            self.dcache.lens.copy_(lens)
            return nxt

        return step

    def ar_step(self):
        def step():
            out = self.graphs.verify(self.bonus[:, None], self.cache.lens[:, None].long(), None)
            return ops.accept(root_tree(self.bonus), out.logits, 0.0, seeds=self.seeds, step=1)[2]

        return step


def measure(bench, budget, context, bw, iters):
    """One row: times in ms and time / floor for the verify (eager, graph), the step and the AR step."""
    t = bench.target
    tokens, positions, mask = bench.verify_inputs(budget)
    nodes = tokens.shape[1]
    experts = count_experts(t, tokens, positions, bench.cache, mask)
    floor = floor_bytes(t, bench.batch, nodes, context, experts)
    floor_ms = sum(floor.values()) / bw / 1e6
    eager = loop_ms(bench.verify_eager(budget), max(3, iters // 4))
    graph = loop_ms(bench.verify_graph(budget), iters)
    kernels, top_kernels = kernel_ms(bench.verify_eager(budget))
    row = dict(context=context, budget=budget, nodes=nodes, distinct_experts=sum(experts) / len(experts),
               floor_MB=sum(floor.values()) / 1e6, floor_parts_MB={k: v / 1e6 for k, v in floor.items()},
               floor_ms=floor_ms, verify_eager_ms=eager, verify_graph_ms=graph, verify_kernels_ms=kernels,
               verify_graph_over_floor=graph / floor_ms, host_overhead_eager_ms=None, host_overhead_graph_ms=None,
               graph_over_kernels=None, overhead_removed=None, top_kernels=top_kernels)
    if kernels:
        row.update(host_overhead_eager_ms=eager - kernels, host_overhead_graph_ms=graph - kernels,
                   graph_over_kernels=graph / kernels)
        if eager > kernels:
            row["overhead_removed"] = 1 - (graph - kernels) / (eager - kernels)
    if budget:
        draft = drafter_floor_bytes(bench.drafter, bench.batch, context)
        step_floor_ms = (sum(floor.values()) + sum(draft.values())) / bw / 1e6
        row["step_ms"] = loop_ms(bench.spec_step(budget), iters)
        row["step_eager_ms"] = loop_ms(bench.spec_step(budget, graphed=False), max(3, iters // 4))
        row["step_floor_ms"] = step_floor_ms
        row["step_over_floor"] = row["step_ms"] / step_floor_ms
        row["draft_tree_ms"] = loop_ms(lambda: bench.draft_tree(budget, graphed=True), iters)
        row["draft_floor_ms"] = sum(draft.values()) / bw / 1e6
        row["draft_kernels_ms"], row["draft_top_kernels"] = kernel_ms(lambda: bench.draft_tree(budget, False), 12)
    else:
        row["ar_step_ms"] = loop_ms(bench.ar_step(), iters)
        row["ar_step_over_floor"] = row["ar_step_ms"] / floor_ms
    return row


def markdown(meta, rows):
    lines = [f"# One TP8 rank of K2.6: verify and step vs memory floor ({meta['gpu']}, {meta['date']})", "",
             f"torch {meta['torch']}, triton {meta['triton']}; read bandwidth {meta['read_GBps']:.0f} GB/s "
             f"(sum over 4 GiB); build {meta['build_s']:.0f} s, capture {meta['capture_s']:.1f} s; batch 1.",
             f"Drafter: {meta['drafter_note']}", "",
             "| ctx | budget | experts/layer | floor ms | verify eager ms | verify graph ms | kernels ms | "
             "overhead removed | graph / kernels | verify / floor | step eager ms | step ms | step / floor |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        step = (f"{r['step_eager_ms']:.2f} | {r['step_ms']:.2f} | {r['step_over_floor']:.2f}" if r["budget"]
                else f"- | AR {r['ar_step_ms']:.2f} | {r['ar_step_over_floor']:.2f}")
        removed = f"{r['overhead_removed']:.0%}" if r["overhead_removed"] is not None else "-"
        ratio = f"{r['graph_over_kernels']:.2f}" if r["graph_over_kernels"] else "-"
        lines.append(f"| {r['context']} | {r['budget']} | {r['distinct_experts']:.0f} | {r['floor_ms']:.2f} | "
                     f"{r['verify_eager_ms']:.2f} | {r['verify_graph_ms']:.2f} | {r['verify_kernels_ms'] or 0:.2f} | "
                     f"{removed} | {ratio} | {r['verify_graph_over_floor']:.2f} | {step} |")
    return "\n".join(lines) + "\n"


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--quick", action="store_true", help="buckets 0 and 32 at 4k only, fewer iterations")
    parser.add_argument("--buckets", default=",".join(map(str, DEFAULT_BUCKETS)))
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--contexts", default=",".join(map(str, CONTEXTS)))
    parser.add_argument("--long-buckets", default=None,
                        help="buckets to time at contexts after the first (default: all of --buckets)")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    buckets = (0, 32) if args.quick else parse_buckets(args.buckets)
    contexts = CONTEXTS[:1] if args.quick else tuple(int(c) for c in args.contexts.split(","))
    long_buckets = buckets if args.long_buckets is None else parse_buckets(args.long_buckets)
    iters = 5 if args.quick else args.iters
    meta = dict(metadata(), drafter_note=DRAFTER_NOTE, read_GBps=read_gbs())
    t0 = time.perf_counter()
    target = build_target()
    drafter = build_drafter(target)
    torch.cuda.synchronize()
    meta["build_s"] = time.perf_counter() - t0
    meta["gpu_GB_after_build"] = torch.cuda.memory_allocated() / 1e9
    print(f"built one TP8 rank + drafter in {meta['build_s']:.1f} s, {meta['gpu_GB_after_build']:.1f} GB", flush=True)
    ok, why = eligibility(target)
    if not ok:
        raise SystemExit(f"error: cuda graphs not available: {why}")
    bench = Bench(target, drafter, buckets, max(contexts))
    bench.set_context(contexts[0])
    t0 = time.perf_counter()
    bench.graphs.capture()
    meta["capture_s"] = time.perf_counter() - t0
    rows = []
    for context in contexts:
        bench.set_context(context)
        for budget in buckets if context == contexts[0] else long_buckets:
            rows.append(measure(bench, budget, context, meta["read_GBps"], iters))
            brief = {k: v for k, v in rows[-1].items() if not k.endswith(("parts_MB", "top_kernels"))}
            print(json.dumps(brief), flush=True)
            (out / "step.json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
    table = markdown(meta, rows)
    (out / "step.md").write_text(table)
    print(table)


if __name__ == "__main__":
    main()
