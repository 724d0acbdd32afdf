"""DDTree step on the GPU (draft top-K + tree build + accept + compaction) against the host path.

Standalone: `python bench/bench_tree.py --out DIR [--quick | --budgets 8,64 | --cases 8:8,64:16] [--blocks 8,16]
[--sweep]` measures the HBM read ceiling, and for budgets 8..512 at blocks 8 and 16 (--quick: 8, 64, 512; --cases:
budget:block pairs) checks the Triton ops against the torch references at K2.6 shapes (bf16 logits, V = 163840),
times each op alone and the whole step (eager and as one CUDA graph replay) and the host path (GPU top-k, copy,
heapq, Python walk, per-layer index_select compaction over 61 layers), and writes tree.json + tree.md. Each kernel
compiles once per shape; block 16 reuses block 8's compiles. With --sweep also: at budget 64, block 8, each config
variant of VARIANTS (the op it changes alone and the whole greedy step, outputs checked against the defaults'), and
the top-k alone on four logit distributions at block 8 (checked against the reference).
As a pytest-benchmark sweep: `pytest bench/bench_tree.py` (GPU only; host timer around a synchronised graph
replay).
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
from ops.tree import accept_torch, build_tree_torch, compact_torch, draft_topk_torch
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
    x = torch.randn(1 << 30, dtype=torch.bfloat16, device=DEVICE)  # 2 GiB
    ms = triton.testing.do_bench(lambda: x.sum(), warmup=20, rep=100, return_mode="median")
    del x
    return (2 << 30) / ms / 1e6


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


def bench_ms(fn):
    return triton.testing.do_bench(fn, warmup=5, rep=25, return_mode="median")


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


TOPK_KS = (8, 64, 512)
DISTS = ("normal", "realistic", "clustered", "ties")


def draft_logits(dist, L, g):
    """[1, L, V] bf16 drafter-like logits. normal: N(0, 3^2). realistic (synthetic, no drafter here): a N(0, 2^2)
    bulk and a head of 256 tokens at random ids lifted by 14 exp(-r / 12) + U(0, 2) nats, a few clear favourites
    then a long tail. clustered: the head 10 nats higher, on 256 consecutive ids (the rows that sent the removed
    segment-bound top-k to its millisecond path: a few chunks hold the whole top K).
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


def _topk_rows(k64_row):
    return ((8, 2048, 4, 2048, None), (64, *k64_row), (dd.MAX_BUDGET, 4096, 8, dd.SEL_TILE, None))


# {name: (the op it changes, overrides of the sm_90 config; "pdl": False launches without PDL)}
VARIANTS = {
    "default": ("step", {}),
    "topk_s4_rows": ("topk", dict(topk=((16, 2048, 4, dd.SEL_TILE, None),
                                        (dd.MAX_BUDGET, 4096, 8, dd.SEL_TILE, None)))),
    "topk_tile4096_cap80": ("topk", dict(topk=_topk_rows((4096, 8, 4096, 80)))),
    "topk_tile2048_nocap": ("topk", dict(topk=_topk_rows((4096, 8, 2048, None)))),
    "levels_warps4": ("build", dict(levels_warps=4)),
    "levels_warps2": ("build", dict(levels_warps=2)),
    "sample_nocap": ("accept", dict(maxnreg_v=None)),
    "unroll2": ("accept", dict(unroll_v=2)),
    "unroll8": ("accept", dict(unroll_v=8)),
    "programs528": ("accept", dict(programs=528)),
    "programs2112": ("accept", dict(programs=2112)),
    "block1024_w4": ("accept", dict(block_v=1024, warps_v=4)),
    "no_pdl": ("step", dict(pdl=False)),
}


def sweep(fn, ref, overrides):
    """{name: (GPU us of fn alone in a CUDA graph, fn's outputs equal to ref)} under each override of the sm_90
    config; the config is restored after each."""
    return {name: under(over, lambda: (round(graph_us(fn), 2), equal(fn(), ref))) for name, over in overrides.items()}


def equal(got, ref):
    return all(torch.equal(a, b) for a, b in zip(got, ref))


def under(over, fn):
    """fn() with the sm_90 config (and pdl.ENABLED for the key "pdl") overridden, restored after."""
    from triton_kernels import pdl

    cfg = dd.CONFIGS[90]
    saved, saved_pdl = dict(cfg), pdl.ENABLED
    cfg.update({k: v for k, v in over.items() if k != "pdl"})
    pdl.ENABLED = over.get("pdl", saved_pdl)
    try:
        return fn()
    finally:
        cfg.clear()
        cfg.update(saved)
        pdl.ENABLED = saved_pdl


def variant_sweep(case, out, save):
    """out[name] = {op: us alone, step: us, equal} at this case (greedy step, one CUDA graph each); save() after
    each."""
    with ops.using(**BACKEND):
        lp, tok = ops.draft_topk(case.draft_logits, case.K)
        tree = ops.build_tree(lp, tok, case.root, case.budget)
        path, path_len, _ = ops.accept(tree, case.target_logits, 0.0, seeds=case.seeds, step=case.step0)
        alone = dict(topk=lambda: ops.draft_topk(case.draft_logits, case.K)[1:],
                     build=lambda: tuple(vars(ops.build_tree(lp, tok, case.root, case.budget)).values())[:-1],
                     accept=lambda: ops.accept(tree, case.target_logits, 0.0, seeds=case.seeds, step=case.step0),
                     step=lambda: case.step()[1:])
        refs = {op: fn() for op, fn in alone.items()}
        for name, (op, over) in VARIANTS.items():
            def run():
                r = {"equal": equal(alone[op](), refs[op]) and equal(alone["step"](), refs["step"])}
                if op != "step":
                    r[op] = round(graph_us(alone[op]), 2)
                r["step"] = round(graph_us(case.step), 2)
                return r
            out[name] = under(over, run)
            print(name, out[name], flush=True)
            save()


def topk_sweep(g):
    """{dist: {K: (us of the default top-k alone in a CUDA graph, equal to the torch reference)}} at block 8."""
    out = {}
    for dist in DISTS:
        x = draft_logits(dist, 7, g)
        out[dist] = {}
        for k in TOPK_KS:
            ref = draft_topk_torch(x, k)[1:]
            out[dist][k] = sweep(lambda: ops.draft_topk(x, k)[1:], ref, {"default": {}})["default"]
        print(dist, out[dist], flush=True)
    return out


def measure(case, read_GBps):
    r = {"budget": case.budget, "block": case.L + 1}
    with ops.using(**BACKEND):
        lp, tok = ops.draft_topk(case.draft_logits, case.K)
        tree = ops.build_tree(lp, tok, case.root, case.budget)
        path, path_len, _ = ops.accept(tree, case.target_logits, 0.0, seeds=case.seeds, step=case.step0)
        r["topk_graph_us"] = graph_us(lambda: ops.draft_topk(case.draft_logits, case.K))
        r["build_graph_us"] = graph_us(lambda: ops.build_tree(lp, tok, case.root, case.budget))
        for name, temp in (("greedy", 0.0), ("T1", 1.0)):
            r[f"accept_{name}_graph_us"] = graph_us(
                lambda: ops.accept(tree, case.target_logits, temp, seeds=case.seeds, step=case.step0))
        r["compact_graph_us"] = graph_us(lambda: ops.compact(case.kv, case.starts, path, path_len, case.hidden))
        r["step_eager_us"] = 1e3 * bench_ms(case.step)
        for name, temp in (("greedy", 0.0), ("T1", 1.0)):
            r[f"step_graph_{name}_us"] = graph_us(lambda: case.step(temp))
    logit_bytes = case.target_logits.numel() * 2
    r["accept_greedy_GBps"] = logit_bytes / r["accept_greedy_graph_us"] / 1e3
    r["accept_greedy_frac_hbm"] = r["accept_greedy_GBps"] / read_GBps
    case.host_step()
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        case.host_step()
        times.append(time.perf_counter() - t0)
    r["host_us"] = 1e6 * sorted(times)[1]
    r["speedup_vs_host"] = r["host_us"] / r["step_graph_greedy_us"]
    return r


def table(rows):
    cols = ["budget", "block", "topk_graph_us", "build_graph_us", "accept_greedy_graph_us", "accept_T1_graph_us",
            "compact_graph_us", "step_eager_us", "step_graph_greedy_us", "step_graph_T1_us", "host_us",
            "speedup_vs_host"]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        lines.append("| " + " | ".join(f"{r[c]:.3g}" if isinstance(r[c], float) else str(r[c]) for c in cols) + " |")
    return "\n".join(lines)


def cell(us_equal):
    return f"{us_equal[0]:.3g}" + ("" if us_equal[1] else "!")


def sweep_tables(result):
    """The sweeps: each config variant at budget 64 (block 8); the default top-k alone per distribution and K.
    GPU us in a CUDA graph, '!' where the outputs differ."""
    md = []
    if "variants" in result:
        md += ["Config variants (budget 64, block 8; each changes one op against the defaults: that op alone and the "
               "whole greedy step, one CUDA graph each):", "", "| variant | op | op alone | step | equal |",
               "|---|---|---|---|---|"]
        for name, r in result["variants"].items():
            op = VARIANTS[name][0]
            md.append(f"| {name} | {op} | {r.get(op, '')} | {r['step']} | {r['equal']} |")
        md.append("")
    if "topk_sweep" in result:
        md += ["Top-k alone (block 8: 7 rows, default config) per logit distribution:", "",
               "| dist | " + " | ".join(f"K = {k}" for k in TOPK_KS) + " |", "|" + "---|" * (1 + len(TOPK_KS))]
        md += [f"| {dist} | " + " | ".join(cell(by_k[k]) for k in TOPK_KS) + " |"
               for dist, by_k in result["topk_sweep"].items()]
        md.append("")
    return md


def cases(args):
    """[(budget, block)] from --cases, else --budgets (or --quick) x --blocks."""
    if args.cases:
        return [tuple(int(v) for v in c.split(":")) for c in args.cases.split(",")]
    budgets = [int(b) for b in args.budgets.split(",")] if args.budgets else BUDGETS if not args.quick else (8, 64, 512)
    return [(budget, int(block)) for block in args.blocks.split(",") for budget in budgets]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument("--budgets", help="comma-separated budgets (default: all, or 8,64,512 with --quick)")
    parser.add_argument("--blocks", default="8,16", help="comma-separated block sizes")
    parser.add_argument("--cases", help="comma-separated budget:block pairs (in place of --budgets and --blocks)")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    env = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
           "python": platform.python_version(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
           "hbm_read_GBps": hbm_read_GBps()}
    print(env, flush=True)
    rows, checks, result = [], [], {"env": env}
    for budget, block in cases(args):
        t0 = time.perf_counter()
        case = Case(budget, block)
        checks.append({"budget": budget, "block": block, **check(case)})
        rows.append(measure(case, env["hbm_read_GBps"]))
        if len(rows) == 1:
            with ops.using(**BACKEND):
                result["step_kernels"] = launches(case.step)
        result.update(checks=checks, results=rows)
        if args.sweep and (budget, block) == (64, 8):
            result["variants"] = {}
            variant_sweep(case, result["variants"], lambda: report(out, result))
        rows[-1]["wall_s"] = round(time.perf_counter() - t0, 1)  # this case's checks and timings, compiles included
        print(checks[-1], "\n", rows[-1], flush=True)
        result.update(checks=checks, results=rows)
        report(out, result)
        del case
        torch.cuda.empty_cache()
    if args.sweep:
        with ops.using(draft_topk="triton"):
            result["topk_sweep"] = topk_sweep(torch.Generator(device=DEVICE).manual_seed(0))
    report(out, result)
    print((out / "tree.md").read_text())


def report(out, result):
    """tree.json and tree.md from what has been measured so far."""
    (out / "tree.json").write_text(json.dumps(result, indent=1))
    rows, checks, env = result["results"], result["checks"], result["env"]
    md = [f"# DDTree step, batch 1, V = {V}, {LAYERS} layers", "",
          ", ".join(f"{k}: {v:.0f}" if isinstance(v, float) else f"{k}: {v}" for k, v in env.items()), "",
          "Times in microseconds (median, CUDA events, L2 flushed); `*_graph_us` = that op alone captured in a CUDA "
          "graph; step = draft top-K + build + accept + compact with the default configs, "
          f"{len(result['step_kernels'])} launches; host = GPU top-k, copy, heapq, Python walk, 61 index_select "
          "moves (median of 3).", "", table(sorted(rows, key=lambda r: (r["block"], r["budget"]))), ""]
    md += sweep_tables(result)
    sweeps = [e for by_k in result.get("topk_sweep", {}).values() for _, e in by_k.values()]
    sweeps += [r["equal"] for r in result.get("variants", {}).values()]
    md += ["Checks (Triton == torch reference, same run: top-k tokens, build, greedy and T = 1 accept, compaction, "
           "the top-k per distribution; every variant equal to the defaults): all equal: "
           f"{all(v for c in checks for k, v in c.items() if k.endswith('_equal')) and all(sweeps)}", ""]
    (out / "tree.md").write_text("\n".join(md))


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
