"""A projection, not a measurement: single-user tokens/s of K2.6 on 8x RTX PRO 6000 (TP8 over PCIe) per tree
budget and policy, from one TP8 rank's step measured on another GPU (bench/bench_step.py's json).

`python -m bench.project STEP_JSON [--pro-bw ... --bw-efficiency ... --collective-us ... --pcie-bw ...
--collectives-per-step ... --acceptance-by-depth ... --tree-gain ... --logits gather|local --out FILE.md]`

The model, every number in it an argument, all printed:
- compute: each rank's step (draft + verify + accept at budget b, graphed; the AR step at budget 0) scales
  from the measured GPU to the PRO 6000 by the read-bandwidth ratio: measured read GB/s of the step file over
  (the PRO 6000's 1.79 TB/s x an achievable fraction). The step is memory-bound on the measured GPU (1.8-2.4x
  its byte floor in bench/results/step_h100_s27.json); the same multiple of the floor is assumed on sm_120.
- collectives: each all-reduce costs a latency plus its ring traffic, 2 (tp - 1) / tp x rows x hidden x 2 B,
  over the PCIe all-reduce bandwidth; the target has 2 a layer (attention and MLP outputs) over its B + 1 rows,
  the drafter 2 a layer over its block; the logits either all-gathered in full (what spec/engine.py does:
  (tp - 1) / tp x rows x vocab x 2 B) or sampled shard-locally (one small all-gather of (value, index) a row).
- acceptance: the chain's tokens a step are 1 + the sum of the per-depth acceptance rates; a tree of budget b
  multiplies that by its gain over the chain (at most the block), interpolated in log2(b) between given points.
- policies: AR; the chain (its L nodes charged at the smallest measured budget >= L, its verify bucket); every
  measured budget; auto, here the best fixed budget, since the acceptance model is the same at every step
  (`python -m bench.policy replay` walks recorded texts step by step instead).
"""

import argparse
import json
import math
import sys
from pathlib import Path

from model.config import preset

PUBLISHED = [("vLLM, 8x RTX PRO 6000, TP8, no speculation", 92.4), ("vLLM, same, EAGLE3 (3 tokens)", 122.0),
             ("vLLM, same, DFlash chain (7 draft tokens)", 220.0)]
K26_DFLASH_ACCEPTANCE = "0.89,0.75,0.57,0.49,0.41,0.34,0.28"  # vLLM's per-position acceptance, K2.6 + its drafter
DDTREE_GAIN = "8:1.0,16:1.04,128:1.32"  # DDTree paper's tree over chain gains at 16 and 128; none assumed at 8
DFLASH_LAYERS = 6  # the Kimi-K2.5-DFlash drafter


class UsageError(Exception):
    pass


def parse_floats(text, flag):
    try:
        values = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise UsageError(f"{flag}: expected comma-separated numbers, got {text!r}") from None
    if not values:
        raise UsageError(f"{flag}: no values in {text!r}")
    return values


def parse_gains(text):
    points = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        try:
            budget, gain = part.split(":")
            points[int(budget)] = float(gain)
        except ValueError:
            raise UsageError(f"--tree-gain: expected BUDGET:GAIN,..., got {part!r}") from None
    if not points or min(points) < 1 or min(points.values()) <= 0:
        raise UsageError(f"--tree-gain: need budgets >= 1 and positive gains, got {text!r}")
    return dict(sorted(points.items()))


def gain_at(points, budget):
    """The tree's gain over the chain at `budget`: linear in log2(budget) between points, flat outside."""
    keys = list(points)
    if budget <= keys[0]:
        return points[keys[0]]
    if budget >= keys[-1]:
        return points[keys[-1]]
    hi = next(k for k in keys if k >= budget)
    lo = keys[keys.index(hi) - 1]
    w = (math.log2(budget) - math.log2(lo)) / (math.log2(hi) - math.log2(lo))
    return points[lo] + w * (points[hi] - points[lo])


def load_steps(path, context):
    """(meta, {budget: measured step ms}, context) of a bench_step json at one context."""
    try:
        data = json.loads(Path(path).read_text())
        meta, rows = data["meta"], data["rows"]
        bandwidth = float(meta["read_GBps"])
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise UsageError(f"{path}: not a bench_step json ({err})") from None
    contexts = sorted({r["context"] for r in rows})
    context = contexts[0] if context is None else context
    if context not in contexts:
        raise UsageError(f"--context {context}: {path} has contexts {contexts}")
    steps = {}
    for r in rows:
        if r["context"] == context:
            steps[r["budget"]] = r["ar_step_ms"] if r["budget"] == 0 else r["step_ms"]
    if 0 not in steps or len(steps) < 2:
        raise UsageError(f"{path}: needs the AR step (budget 0) and at least one tree budget at context {context}")
    return meta, bandwidth, steps, context


class Model:
    def __init__(self, args, bandwidth):
        cfg = preset("kimi-k2.6")
        self.hidden, self.vocab, self.layers, self.tp = cfg.hidden_size, cfg.vocab_size, cfg.num_hidden_layers, args.tp
        self.scale = bandwidth / (args.pro_bw * args.bw_efficiency)
        self.latency_s, self.bus = args.collective_us * 1e-6, args.pcie_bw * 1e9
        self.target_collectives = args.collectives_per_step or 2 * self.layers
        self.draft_collectives = args.draft_collectives
        self.logits = args.logits
        self.acceptance = parse_floats(args.acceptance_by_depth, "--acceptance-by-depth")
        self.depth = len(self.acceptance)
        self.gains = parse_gains(args.tree_gain)

    def all_reduce_s(self, rows):
        return self.latency_s + 2 * (self.tp - 1) / self.tp * rows * self.hidden * 2 / self.bus

    def logits_s(self, rows):
        if self.logits == "local":
            return self.latency_s + (self.tp - 1) * rows * 8 / self.bus
        return self.latency_s + (self.tp - 1) / self.tp * rows * self.vocab * 2 / self.bus

    def collectives_ms(self, nodes, drafted):
        """Collectives of one step verifying `nodes` rows (drafted: the drafter ran, over its block)."""
        s = self.target_collectives * self.all_reduce_s(nodes) + self.logits_s(nodes)
        if drafted:
            block = self.depth + 1
            s += self.draft_collectives * self.all_reduce_s(block) + self.logits_s(self.depth)
        return s * 1e3

    def tokens_per_step(self, budget):
        chain = 1 + sum(self.acceptance)
        return chain if budget is None else min(self.depth + 1, chain * gain_at(self.gains, budget))

    def row(self, policy, measured_ms, nodes, budget, drafted):
        compute = measured_ms * self.scale
        comm = self.collectives_ms(nodes, drafted)
        tokens = self.tokens_per_step(budget) if drafted else 1.0
        return dict(policy=policy, measured_ms=measured_ms, compute_ms=compute, collectives_ms=comm,
                    step_ms=compute + comm, tokens_per_step=tokens, tokens_per_s=tokens / (compute + comm) * 1e3)


def project(args):
    meta, bandwidth, steps, context = load_steps(args.step_json, args.context)
    m = Model(args, bandwidth)
    budgets = sorted(b for b in steps if b)
    fits = [b for b in budgets if b >= m.depth]
    if not fits:
        raise UsageError(f"{args.step_json}: no measured budget >= the chain's {m.depth} nodes")
    chain_bucket = fits[0]
    rows = [m.row("AR", steps[0], 1, None, False), m.row("chain", steps[chain_bucket], m.depth + 1, None, True)]
    rows += [m.row(f"budget {b}", steps[b], b + 1, b, True) for b in budgets]
    best = max(rows[2:], key=lambda r: r["tokens_per_s"])
    rows.append(dict(best, policy=f"auto (= {best['policy']})"))
    assumptions = [
        f"step file: {args.step_json} ({meta.get('gpu', '?')}, {meta.get('date', '?')}), context {context}, "
        f"read bandwidth measured there {bandwidth:.0f} GB/s",
        f"PRO 6000 read bandwidth: {args.pro_bw:.0f} GB/s x {args.bw_efficiency:.2f} achievable = "
        f"{args.pro_bw * args.bw_efficiency:.0f} GB/s; compute scale {m.scale:.3f} (measured ms x scale)",
        f"collectives: {m.target_collectives} target all-reduces a step (2 x {m.layers} layers) over B + 1 rows, "
        f"{m.draft_collectives} drafter all-reduces over its {m.depth + 1}-row block; each {args.collective_us:.1f} us "
        f"+ ring traffic at {args.pcie_bw:.1f} GB/s (TP{m.tp}, hidden {m.hidden})",
        f"logits: {'all-gathered in full, as spec/engine.py does' if m.logits == 'gather' else 'sampled shard-locally'}"
        f" (vocab {m.vocab}), target and drafter",
        f"acceptance by depth (chain): {args.acceptance_by_depth} -> {m.tokens_per_step(None):.2f} tokens a step",
        f"tree gain over the chain: {args.tree_gain} (linear in log2 budget between points, capped at "
        f"{m.depth + 1} tokens a step); the chain charged at budget {chain_bucket}'s step",
    ]
    table = markdown(rows, assumptions)
    print(table)
    if args.out:
        Path(args.out).write_text(table)
    return rows


def markdown(rows, assumptions):
    lines = ["# Projection: K2.6 on 8x RTX PRO 6000, single user (a model, not a measurement)", "",
             *[f"- {a}" for a in assumptions], "",
             "| policy | measured ms | compute ms | collectives ms | step ms | tokens / step | tokens/s |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['policy']} | {r['measured_ms']:.2f} | {r['compute_ms']:.2f} | {r['collectives_ms']:.2f} | "
                     f"{r['step_ms']:.2f} | {r['tokens_per_step']:.2f} | {r['tokens_per_s']:.0f} |")
    lines += ["", "Published, for comparison (measured, not projected):", ""]
    lines += [f"- {name}: {value:g} tok/s" for name, value in PUBLISHED]
    return "\n".join(lines) + "\n"


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m bench.project", description=__doc__.splitlines()[0])
    p.add_argument("step_json", help="a bench/bench_step.py json (e.g. bench/results/step_h100_s27.json)")
    p.add_argument("--context", type=int, default=None, help="which of the file's contexts (default: its first)")
    p.add_argument("--pro-bw", type=float, default=1790.0, help="PRO 6000 memory bandwidth, GB/s (spec)")
    p.add_argument("--bw-efficiency", type=float, default=0.92,
                   help="achievable fraction of --pro-bw (default: the H100's, 3.08 of 3.35 TB/s read in "
                        "bench/results/step_h100_s27.json)")
    p.add_argument("--tp", type=int, default=8)
    p.add_argument("--collective-us", type=float, default=15.0, help="latency of one PCIe all-reduce (NCCL: 10-20 us)")
    p.add_argument("--pcie-bw", type=float, default=25.0, help="all-reduce bus bandwidth over PCIe, GB/s")
    p.add_argument("--collectives-per-step", type=int, default=None,
                   help="target all-reduces a step (default: 2 a layer)")
    p.add_argument("--draft-collectives", type=int, default=2 * DFLASH_LAYERS,
                   help="drafter all-reduces a step (default: 2 a layer of K2.5-DFlash's 6)")
    p.add_argument("--logits", choices=("gather", "local"), default="gather",
                   help="full-vocabulary all-gather (the engine today) or shard-local sampling")
    p.add_argument("--acceptance-by-depth", default=K26_DFLASH_ACCEPTANCE,
                   help="the chain's acceptance rate at each depth (default: K2.6 + DFlash on vLLM)")
    p.add_argument("--tree-gain", default=DDTREE_GAIN, help="BUDGET:GAIN,... a tree's tokens a step over the chain's")
    p.add_argument("--out", default=None, help="also write the table to this markdown file")
    try:
        args = p.parse_args(argv)
        for name in ("pro_bw", "bw_efficiency", "pcie_bw"):
            if not getattr(args, name) > 0:
                raise UsageError(f"--{name.replace('_', '-')} must be positive")
        if args.collective_us < 0 or args.tp < 1:
            raise UsageError("--collective-us must be >= 0 and --tp >= 1")
        project(args)
    except UsageError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
