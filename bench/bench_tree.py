"""DDTree step on the GPU (draft top-K + tree build + accept + compaction) against the host path.

Standalone: `python bench/bench_tree.py --out DIR [--quick | --budgets 8,64] [--sweep] [--no-tie-checks]`
measures the HBM read ceiling (a sum over 4 GiB), checks the Triton ops against the torch references at K2.6 shapes (bf16 logits, V = 163840) and both
Triton tree builds against the torch build on tie-heavy random trees, times each op alone and the whole step
(eager and as one CUDA graph replay) for budgets 8..512 at blocks 8 and 16 (--quick: 8, 64, 512), times the host
path (GPU top-k, copy, heapq, Python walk, per-layer index_select compaction over 61 layers), with --sweep also
times config variants of top-k, build and greedy accept at block 8, budgets SWEEP_BUDGETS (each checked against
the reference), and writes tree.json + tree.md. `--topk-methods [--budgets 8,64] [--bound-sweep]` instead compares
the two top-k methods (alone at K = 8, 64, 512 on four logit distributions, and in the whole step) and writes
topk.json + topk.md. As a pytest-benchmark sweep: `pytest bench/bench_tree.py` (GPU
only; host timer around a synchronised graph replay).
"""

import argparse
import json
import platform
import time
from pathlib import Path

import pytest
import torch
import triton

import ops
from ops.tree import accept_torch, build_tree_torch, compact_torch, draft_topk_torch, ordered
from spec.tree_ref import build_tree_heapq, walk
from triton_kernels import ddtree as dd

V = 163840  # K2.6 vocabulary
LAYERS = 61
ENTRY = 576
FEATURES = 6 * 7168  # the drafter's context: target hidden states of 6 layers
L_MAX = 4096
START = 1000  # where the verify pass wrote node 0
BUDGETS = (8, 16, 32, 64, 128, 256, 512)
BLOCKS = (8, 16)
DEVICE = "cuda"
BACKEND = dict(draft_topk="triton", tree_build="triton", accept="triton", compact="triton")


def hbm_read_GBps():
    x = torch.randn(2 << 30, dtype=torch.bfloat16, device=DEVICE)  # 4 GiB
    ms = triton.testing.do_bench(lambda: x.sum(), warmup=50, rep=300, return_mode="median")
    del x
    return (4 << 30) / ms / 1e6


class Case:
    """Inputs of one step at batch 1; the target logits favour each node's first child so paths are long."""

    def __init__(self, budget, block, seed=0):
        self.budget, self.L, self.K = budget, block - 1, min(budget, V)
        g = torch.Generator(device=DEVICE).manual_seed(seed)
        self.draft_logits = (torch.randn(1, self.L, V, generator=g, device=DEVICE) * 3).bfloat16()
        self.root = torch.tensor([7], device=DEVICE)
        self.kv = torch.randn(LAYERS, 1, L_MAX, ENTRY, generator=g, device=DEVICE).bfloat16()
        self.hidden = torch.randn(1, budget + 1, FEATURES, generator=g, device=DEVICE).bfloat16()
        self.starts = torch.tensor([START], dtype=torch.int32, device=DEVICE)
        self.seeds = torch.tensor([1234], device=DEVICE)
        self.step0 = torch.zeros(1, dtype=torch.int64, device=DEVICE)  # a tensor, as in the engine's graphs: no fill
        with ops.using(**BACKEND):
            lp, tok = ops.draft_topk(self.draft_logits, self.K)
            tree = ops.build_tree(lp, tok, self.root, budget)
        logits = torch.randn(1, budget + 1, V, generator=g, device=DEVICE) * 3
        fc = tree.first_child[0].long()
        rows = torch.nonzero(fc >= 0).flatten()
        logits[0, rows, tree.tokens[0, fc[rows]]] = 30.0
        self.target_logits = logits.bfloat16()

    def step(self, temperature=0.0):
        lp, tok = ops.draft_topk(self.draft_logits, self.K)
        tree = ops.build_tree(lp, tok, self.root, self.budget)
        path, path_len, next_token = ops.accept(tree, self.target_logits, temperature, seeds=self.seeds,
                                                step=self.step0)
        return ops.compact(self.kv, self.starts, path, path_len, self.hidden), path_len, next_token

    def host_step(self):
        """The reference path: GPU top-k, copy, heapq build, upload of the tree tokens, target argmax copy,
        Python walk, per-layer index_select compaction."""
        lp, tok = torch.log_softmax(self.draft_logits.float(), -1).topk(self.K, dim=-1)
        lp, tok = lp[0].cpu().numpy(), tok[0].cpu().tolist()
        tokens, parents, _ = build_tree_heapq(lp, tok, int(self.root[0]), self.budget)
        torch.tensor(tokens, device=DEVICE)  # the verify pass's input
        sampled = self.target_logits[0, : len(tokens)].argmax(-1).tolist()
        path, next_token = walk(tokens, parents, sampled, self.L)
        src = torch.tensor(path, device=DEVICE) + START
        for layer in range(LAYERS):
            self.kv[layer, 0, START:START + len(path)] = self.kv[layer, 0].index_select(0, src)
        hidden_path = self.hidden[0].index_select(0, src - START)
        torch.cuda.synchronize()
        return hidden_path, next_token


def check(case):
    """Triton vs torch reference at these shapes: exact integer outputs, log-prob error, equal compaction."""
    out = {}
    with ops.using(**BACKEND):
        lp, tok = ops.draft_topk(case.draft_logits, case.K)
        tree = ops.build_tree(lp, tok, case.root, case.budget)
        greedy = ops.accept(tree, case.target_logits, 0.0, seeds=case.seeds, step=0)
        sampled = ops.accept(tree, case.target_logits, 1.0, seeds=case.seeds, step=3)
        kv_t = case.kv.clone()
        hid_t = ops.compact(kv_t, case.starts, greedy[0], greedy[1], case.hidden)
    ref_lp, ref_tok = draft_topk_torch(case.draft_logits, case.K)
    out["topk_tokens_equal"] = torch.equal(tok, ref_tok)
    out["topk_lp_max_abs_err"] = (lp - ref_lp).abs().max().item()
    ref_tree = build_tree_torch(lp, tok, case.root, case.budget)
    fields = ("tokens", "parents", "depths", "mask", "first_child", "next_sibling", "num_nodes")
    out["build_equal"] = all(torch.equal(getattr(tree, f), r) for f, r in zip(fields, ref_tree))
    ref_greedy = accept_torch(tree, case.target_logits, 0.0, None, case.seeds, torch.zeros_like(case.seeds))
    ref_sampled = accept_torch(tree, case.target_logits, 1.0, None, case.seeds, torch.full_like(case.seeds, 3))
    out["accept_greedy_equal"] = all(torch.equal(a, b) for a, b in zip(greedy, ref_greedy))
    out["accept_T1_equal"] = all(torch.equal(a, b) for a, b in zip(sampled, ref_sampled))
    out["greedy_path_len"] = int(greedy[1][0])
    kv_r = case.kv.clone()
    hid_r = compact_torch(kv_r, case.starts, greedy[0], greedy[1], case.hidden)
    out["compact_equal"] = torch.equal(kv_t, kv_r) and torch.equal(hid_t, hid_r)
    return out


def tie_checks():
    """Both Triton builds against the torch build on random tie-heavy drafts (log-probs on a 0.25 grid, zeros
    included), 32 trees per case: budget, L, K."""
    cfg = dd.CONFIGS[90]
    saved = dict(cfg)
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    fields = ("tokens", "parents", "depths", "mask", "first_child", "next_sibling", "num_nodes")
    out = []
    for budget, L, K in [(1, 7, 1), (8, 7, 8), (33, 3, 33), (64, 15, 8), (64, 7, 64), (512, 15, 512), (512, 7, 5)]:
        lp = (-torch.randint(0, 5, (32, L, K), generator=gen, device=DEVICE).float() * 0.25).sort(-1, True).values
        tok = torch.randint(0, V, (32, L, K), generator=gen, device=DEVICE)
        root = torch.randint(0, V, (32,), generator=gen, device=DEVICE)
        ref = build_tree_torch(lp, tok, root, budget)
        row = {"budget": budget, "L": L, "K": K}
        for method, start in (("heap", dd.MAX_BUDGET + 1), ("levels", 1)):
            cfg["levels_from"] = start
            with ops.using(tree_build="triton"):
                tree = ops.build_tree(lp, tok, root, budget)
            row[f"{method}_equal"] = all(torch.equal(getattr(tree, f), x) for f, x in zip(fields, ref))
        out.append(row)
    cfg.update(saved)
    return out


def bench_ms(fn):
    return triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median")


def graph_of(fn):
    fn()
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


def graph_us(fn):
    """GPU time of fn captured alone in a CUDA graph (no launch overhead)."""
    graph = graph_of(fn)
    return 1e3 * bench_ms(graph.replay)


def launches(fn):
    """GPU activities (kernels, memsets, copies) one eager call of fn launches: [name, ...] in order."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    cuda = torch.autograd.DeviceType.CUDA
    return [e.name[:60] for e in sorted(prof.events(), key=lambda e: e.time_range.start) if e.device_type == cuda]


TOPK_METHODS = ("bisect", "bound")
TOPK_KS = (8, 64, 512)


def draft_logits(dist, L, g):
    """[1, L, V] bf16 drafter-like logits. normal: N(0, 3^2). realistic (synthetic, no drafter here): a N(0, 2^2)
    bulk and a head of 256 tokens at random ids lifted by 14 exp(-r / 12) + U(0, 2) nats, a few clear favourites
    then a long tail. clustered (adversarial for the bound): the head 10 nats higher, on 256 consecutive ids, so
    a few segments hold the whole top K and every head token passes the bound (past capacity: the slow path).
    ties (exactness): rows of 0/1 values, of one value, of 700 equal maxima at the end, of N(0, 3^2) on a 1/4 grid."""
    x = torch.randn(1, L, V, generator=g, device=DEVICE) * (3 if dist in ("normal", "ties") else 2)
    if dist == "ties":
        x = (x * 4).round() / 4
        x[0, 0::4] = torch.randint(0, 2, (len(range(0, L, 4)), V), generator=g, device=DEVICE).float()
        x[0, 1::4] = -1.5
        x[0, 2::4, V - 700:] = 20.0
    if dist != "normal":
        lift = 14 * torch.exp(-torch.arange(256, device=DEVICE) / 12) + 2 * torch.rand(
            L, 256, generator=g, device=DEVICE) + (10 if dist == "clustered" else 0)
        for d in range(L):
            ids = (torch.randperm(V, generator=g, device=DEVICE)[:256] if dist == "realistic"
                   else (V // 8) * d + torch.randperm(256, generator=g, device=DEVICE))
            x[0, d, ids] += lift[d]
    return x.bfloat16()


def bound_path(x, k):
    """Per row, the "bound" method's candidate count and whether it fits the capacity (sorted) or not (the slow
    exact row scan), computed on the host from the kernel's sizes."""
    chunk, chunks, seg, cap = dd.bound_plan(V, k, dd.CONFIGS[90]["bound"])
    o = ordered(x[0])  # [L, V]
    pad = torch.full((o.shape[0], chunks * chunk - V), -2**31, dtype=o.dtype, device=o.device)
    segs = torch.cat([o, pad], 1).view(o.shape[0], -1, seg).amax(-1)
    t = segs.sort(-1, descending=True).values[:, k - 1:k] if segs.shape[1] >= k else -2**31
    n = (o >= t).sum(-1).tolist()
    return {"cap": cap, "candidates": n, "slow_rows": sum(c > cap for c in n)}


def set_topk_method(method):
    for cfg in dd.CONFIGS.values():
        cfg["topk_method"] = method


BOUND_SWEEP = {"chunk2048_w4": dict(chunk=2048, warps=4), "chunk4096_w4": dict(warps=4),
               "chunk8192_w16": dict(chunk=8192, warps=16), "tl_sort": dict(tl_sort=True), "segs2": dict(segs_per_k=2)}


def bound_sweep(x, ks):
    """{K: {variant: (GPU us of the bound top-k in a CUDA graph, equal to the reference)}} over BOUND_SWEEP (each an
    override of the sm_90 bound config, restored after)."""
    cfg = dd.CONFIGS[90]
    saved = dict(cfg["bound"])
    set_topk_method("bound")
    out = {}
    for k in ks:
        ref = draft_topk_torch(x, k)[1]
        out[k] = {}
        for name, over in BOUND_SWEEP.items():
            cfg["bound"] = {**saved, **over}
            with ops.using(draft_topk="triton"):
                equal = torch.equal(ops.draft_topk(x, k)[1], ref)
                out[k][name] = (round(graph_us(lambda: ops.draft_topk(x, k)), 2), equal)
            print(k, name, out[k][name], flush=True)
    cfg["bound"] = saved
    return out


def topk_methods(out, env, budgets, sweep=False):
    """Each top-k method alone in a CUDA graph at K in TOPK_KS (block 8) on each logit distribution, checked
    against the torch reference; then the whole step (greedy) at `budgets`, block 8, with each method; with
    `sweep`, bound config variants at K = 64, 512 on the realistic logits."""
    g = torch.Generator(device=DEVICE).manual_seed(0)
    result = {"env": env, "topk": [], "step": []}
    default = dd.CONFIGS[90]["topk_method"]
    for dist in ("realistic", "normal", "clustered", "ties"):
        x = draft_logits(dist, 7, g)
        for k in TOPK_KS:
            ref_lp, ref_tok = draft_topk_torch(x, k)
            row = {"dist": dist, "K": k,
                   "torch_topk_us": 1e3 * bench_ms(lambda: torch.log_softmax(x.float(), -1).topk(k))}
            for method in TOPK_METHODS:
                set_topk_method(method)
                t0 = time.perf_counter()
                with ops.using(draft_topk="triton"):
                    lp, tok = ops.draft_topk(x, k)
                    row[f"{method}_equal"] = torch.equal(tok, ref_tok) and (lp - ref_lp).abs().max().item() < 1e-4
                    row[f"{method}_us"] = graph_us(lambda: ops.draft_topk(x, k))
                row[f"{method}_wall_s"] = round(time.perf_counter() - t0, 1)
            row["bound_plan"] = bound_path(x, k)
            result["topk"].append(row)
            print(row, flush=True)
            (out / "topk.json").write_text(json.dumps(result, indent=1))
    for budget in budgets:
        set_topk_method(default)
        case = Case(budget, 8)
        row = {"budget": budget, "block": 8}
        for method in TOPK_METHODS:
            set_topk_method(method)
            with ops.using(**BACKEND):
                row[f"{method}_step_graph_greedy_us"] = graph_us(lambda: case.step(0.0))
        result["step"].append(row)
        print(row, flush=True)
        (out / "topk.json").write_text(json.dumps(result, indent=1))
        del case
    if sweep:
        result["bound_sweep"] = bound_sweep(draft_logits("realistic", 7, g), (64, 512))
        (out / "topk.json").write_text(json.dumps(result, indent=1))
    set_topk_method(default)
    md = [f"# DDTree draft top-k methods, block 8 (7 rows), V = {V}, bf16 logits", "",
          ", ".join(f"{k}: {v:.0f}" if isinstance(v, float) else f"{k}: {v}" for k, v in env.items()), "",
          "GPU us of draft_topk alone in a CUDA graph (median); equal = tokens equal to the torch reference and "
          "log-probs within 1e-4; wall = first call (compiles) + checks + timing.", "",
          "| dist | K | torch log_softmax+topk | "
          + " | ".join(f"{m} us | {m} equal | {m} wall s" for m in TOPK_METHODS)
          + " | bound cap | bound max candidates | bound slow rows |", "|" + "---|" * (6 + 3 * len(TOPK_METHODS))]
    for r in result["topk"]:
        md.append(f"| {r['dist']} | {r['K']} | {r['torch_topk_us']:.3g} | " + " | ".join(
            f"{r[m + '_us']:.3g} | {r[m + '_equal']} | {r[m + '_wall_s']}" for m in TOPK_METHODS)
            + f" | {r['bound_plan']['cap']} | {max(r['bound_plan']['candidates'])} | {r['bound_plan']['slow_rows']} |")
    md += ["", "Whole step (top-k + build + accept greedy + compact) in one CUDA graph, block 8, normal logits (the "
           "bench's Case):", "", "| budget | " + " | ".join(f"{m} step us" for m in TOPK_METHODS) + " |",
           "|" + "---|" * (1 + len(TOPK_METHODS))]
    for r in result["step"]:
        md.append(f"| {r['budget']} | " + " | ".join(f"{r[m + '_step_graph_greedy_us']:.3g}" for m in TOPK_METHODS)
                  + " |")
    if sweep:
        md += ["", "Bound config variants (realistic logits; GPU us in a CUDA graph, '!' = tokens differ from the "
               "reference):", "", "| K | " + " | ".join(BOUND_SWEEP) + " |", "|" + "---|" * (1 + len(BOUND_SWEEP))]
        for k, row in result["bound_sweep"].items():
            md.append(f"| {k} | " + " | ".join(f"{us:.3g}" + ("" if eq else "!") for us, eq in row.values()) + " |")
    (out / "topk.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))


TOPK_SWEEP = {f"chunk{c}_w{w}": dict(topk=((dd.MAX_BUDGET, c, w),)) for c, w in ((2048, 4), (4096, 4), (4096, 8),
                                                                            (8192, 4))}
ACCEPT_SWEEP = {f"block{b}_p{p}": dict(block_v=b, programs=p) for b in (2048, 4096) for p in (528, 1056)}
BUILD_SWEEP = {"heap_w1": dict(levels_from=dd.MAX_BUDGET + 1, build_warps=1),
               **{f"levels_w{w}": dict(levels_from=1, levels_warps=w) for w in (1, 2, 4, 8)}}
SWEEP_BUDGETS = (8, 32, 64, 128, 512)


def tree_fields(tree):
    return [getattr(tree, f) for f in ("tokens", "parents", "depths", "mask", "first_child", "next_sibling",
                                       "num_nodes")]


def sweep(fn, ref, overrides):
    """{name: (GPU us of fn alone in a CUDA graph, fn's outputs equal to ref)} under each override of the sm_90
    config; the config is restored after each."""
    cfg = dd.CONFIGS[90]
    saved = dict(cfg)
    out = {}
    for name, over in overrides.items():
        cfg.update(over)
        got = fn()
        equal = all(torch.equal(a, b) for a, b in zip(got, ref))
        out[name] = (round(graph_us(fn), 2), equal)
        cfg.clear()
        cfg.update(saved)
    return out


def measure(case, read_GBps, sweeps):
    r = {"budget": case.budget, "block": case.L + 1}
    with ops.using(**BACKEND):
        lp, tok = ops.draft_topk(case.draft_logits, case.K)
        tree = ops.build_tree(lp, tok, case.root, case.budget)
        path, path_len, _ = ops.accept(tree, case.target_logits, 0.0, seeds=case.seeds, step=case.step0)
        r["topk_graph_us"] = graph_us(lambda: ops.draft_topk(case.draft_logits, case.K))
        r["torch_topk_us"] = 1e3 * bench_ms(lambda: torch.log_softmax(case.draft_logits.float(), -1).topk(case.K))
        r["build_graph_us"] = graph_us(lambda: ops.build_tree(lp, tok, case.root, case.budget))
        for name, temp in (("greedy", 0.0), ("T1", 1.0)):
            r[f"accept_{name}_graph_us"] = graph_us(
                lambda: ops.accept(tree, case.target_logits, temp, seeds=case.seeds, step=case.step0))
        r["compact_graph_us"] = graph_us(lambda: ops.compact(case.kv, case.starts, path, path_len, case.hidden))
        r["step_eager_us"] = 1e3 * bench_ms(case.step)
        r["step_kernels"] = launches(case.step)
        r["step_launches"] = len(r["step_kernels"])
        if sweeps and case.L + 1 == 8 and case.budget in SWEEP_BUDGETS:
            ref_topk = draft_topk_torch(case.draft_logits, case.K)[1:]
            r["topk_sweep"] = sweep(lambda: ops.draft_topk(case.draft_logits, case.K)[1:], ref_topk, TOPK_SWEEP)
            fields = ("tokens", "parents", "depths", "mask", "first_child", "next_sibling", "num_nodes")
            ref_tree = build_tree_torch(lp, tok, case.root, case.budget)
            r["build_sweep"] = sweep(lambda: tree_fields(ops.build_tree(lp, tok, case.root, case.budget)), ref_tree,
                                     BUILD_SWEEP)
            ref_acc = accept_torch(tree, case.target_logits, 0.0, None, case.seeds, torch.zeros_like(case.seeds))
            r["accept_greedy_sweep"] = sweep(
                lambda: ops.accept(tree, case.target_logits, 0.0, seeds=case.seeds, step=case.step0), ref_acc,
                ACCEPT_SWEEP)
        for name, temp in (("greedy", 0.0), ("T1", 1.0)):
            r[f"step_graph_{name}_us"] = graph_us(lambda: case.step(temp))
    logit_bytes = case.target_logits.numel() * 2
    r["accept_greedy_GBps"] = logit_bytes / r["accept_greedy_graph_us"] / 1e3
    r["accept_greedy_frac_hbm"] = r["accept_greedy_GBps"] / read_GBps
    case.host_step()
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        case.host_step()
        times.append(time.perf_counter() - t0)
    r["host_us"] = 1e6 * sorted(times)[len(times) // 2]
    r["speedup_vs_host"] = r["host_us"] / r["step_graph_greedy_us"]
    return r


def table(rows):
    cols = ["budget", "block", "topk_graph_us", "build_graph_us", "accept_greedy_graph_us", "accept_T1_graph_us",
            "compact_graph_us", "step_launches", "step_eager_us",
            "step_graph_greedy_us", "step_graph_T1_us", "host_us", "speedup_vs_host"]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        lines.append("| " + " | ".join(f"{r[c]:.3g}" if isinstance(r[c], float) else str(r[c]) for c in cols) + " |")
    return "\n".join(lines)


def sweep_table(rows):
    """One line per budget (block 8): each config's GPU us, '!' where its outputs differed from the reference."""
    names = [(k, n) for k, sw in (("topk_sweep", TOPK_SWEEP), ("build_sweep", BUILD_SWEEP),
                                  ("accept_greedy_sweep", ACCEPT_SWEEP)) for n in sw]
    lines = ["| budget | " + " | ".join(f"{k.split('_')[0]} {n}" for k, n in names) + " |",
             "|" + "---|" * (len(names) + 1)]
    for r in rows:
        if "topk_sweep" in r:
            cells = [f"{r[k][n][0]:.3g}" + ("" if r[k][n][1] else "!") for k, n in names]
            lines.append(f"| {r['budget']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument("--budgets", help="comma-separated budgets (default: all, or 8,64,512 with --quick)")
    parser.add_argument("--no-tie-checks", action="store_true", help="skip the tie-heavy build checks (compiles)")
    parser.add_argument("--topk-methods", action="store_true",
                        help="only compare the top-k methods (and the step at --budgets, default 8,64, with each)")
    parser.add_argument("--bound-sweep", action="store_true", help="with --topk-methods: bound config variants")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    env = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
           "python": platform.python_version(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    if args.topk_methods:
        budgets = [int(b) for b in args.budgets.split(",")] if args.budgets else (8, 64)
        return topk_methods(out, env, budgets, args.bound_sweep)
    env["hbm_read_GBps"] = hbm_read_GBps()
    print(env, flush=True)
    rows, checks = [], [] if args.no_tie_checks else tie_checks()
    budgets = [int(b) for b in args.budgets.split(",")] if args.budgets else BUDGETS if not args.quick else (8, 64, 512)
    print(checks, flush=True)
    for block in BLOCKS:  # budget 64 first at block 16: the target's budget, in case the time runs out
        for budget in sorted(budgets, key=lambda b: (block != 8 and b != 64, b)):
            t0 = time.perf_counter()
            case = Case(budget, block)
            checks.append({"budget": budget, "block": block, **check(case)})
            print(checks[-1], flush=True)
            rows.append(measure(case, env["hbm_read_GBps"], args.sweep))
            rows[-1]["wall_s"] = round(time.perf_counter() - t0, 1)  # this case's checks and timings, compiles included
            print(rows[-1], flush=True)
            (out / "tree.json").write_text(json.dumps({"env": env, "checks": checks, "results": rows}, indent=1))
            del case
            torch.cuda.empty_cache()
    md = [f"# DDTree step, batch 1, V = {V}, {LAYERS} layers", "",
          ", ".join(f"{k}: {v:.0f}" if isinstance(v, float) else f"{k}: {v}" for k, v in env.items()), "",
          "Times in microseconds (median, CUDA events); `*_graph_us` = that op alone captured in a CUDA graph; "
          "step = draft top-K + build + accept + compact, with the default configs; host = GPU top-k, copy, heapq, "
          "Python walk, 61 index_select moves (median of 5).", "",
          table(sorted(rows, key=lambda r: (r["block"], r["budget"]))), ""]
    if args.sweep:
        md += ["Config sweeps at block 8 (sm_90 config overrides; GPU us of the op alone in a CUDA graph; '!' = "
               "outputs differ from the torch reference):", "", sweep_table(rows), ""]
    sweeps_equal = all(eq for r in rows for k, sw in r.items() if k.endswith("_sweep") for _us, eq in sw.values())
    md += ["Checks (Triton == torch reference, same run): all equal: "
           f"{all(v for c in checks for k, v in c.items() if k.endswith('_equal')) and sweeps_equal}", ""]
    (out / "tree.md").write_text("\n".join(md))
    print("\n".join(md))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("block", BLOCKS)
@pytest.mark.parametrize("budget", BUDGETS)
def test_step_graph(benchmark, budget, block):
    case = Case(budget, block)
    with ops.using(**BACKEND):
        graph = graph_of(case.step)
    benchmark(lambda: (graph.replay(), torch.cuda.synchronize()))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("budget", (64, 512))
def test_host_path(benchmark, budget):
    benchmark(Case(budget, 8).host_step)


if __name__ == "__main__":
    main()
