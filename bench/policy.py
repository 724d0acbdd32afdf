"""The tree-budget policies compared: target-only (AR), the DFlash chain, fixed DDTree budgets and `auto`.

`python -m bench.policy live [--out FILE.md]`: decodes a set of prompts with a drafter + target pair (default: the
embedded tiny pair; --model-path/--draft-model-path for real checkpoints) once per policy, repeated and
interleaved, and reports decode tokens/s (median over repeats), mean accept length and the budgets chosen.
CPU or GPU; on a GPU CUDA graphs are on for every policy (the chain and fixed budgets replay their own bucket,
auto every candidate bucket) unless --no-cuda-graphs.

`python -m bench.policy record --out REC.json`: per position of each prompt's greedy continuation, the draft's
path masses for every candidate budget and the accepted length of the best-b tree (for each b) and of the
chain against the target's greedy text (at temperature 0 the engine's output is that text whatever the tree,
and the tree drafted at a position depends only on the text before it, so one recording serves every policy).

`python -m bench.policy replay REC.json STEP.json`: walks each recorded text with each policy, charging every
step the latency of its budget from a step table (bench/bench_step.py's json, or a spec.budget.LatencyTable
file): tokens/s of that pair's acceptance at the table's costs (e.g. K2.6's TP8 rank on an H100).

`python -m bench.policy host-cost`: the host time of auto's per-step work (BudgetPolicy.update, the engine's
`choose`); `scorer-cost`: its device work (the draft pass's extra, one graph replay on a GPU).
"""

import argparse
import itertools
import json
import os
import platform
import statistics
import sys
import time
import timeit
from collections import Counter
from pathlib import Path

import torch

import ops
from spec.budget import AUTO_BUDGETS, MASS_SCALE, BudgetPolicy, LatencyTable, MassScorer, path_masses

DEFAULT_PROMPTS = ["The tree of thought", "Speculative decoding verifies a whole tree", "def main():\n    return",
                   "Kimi K2.6 runs on eight GPUs", "1, 2, 3, 5, 8, 13,", "Once upon a time"]
FIXED = (4, 8, 16, 32, 64)


# ---- the pair -------------------------------------------------------------------------------------------------

def load_pair(args, device):
    """(target, drafter, tokenizer): the embedded default or the checkpoints given."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if args.model_path is None:
        from spec.default_model import load_default

        if device.type == "cpu":
            torch.set_num_threads(1)
        return load_default(dtype, device)
    from model.checkpoint import load_model
    from model.tokenizer import load_tokenizer
    from spec.drafter_checkpoint import load_drafter

    target = load_model(args.model_path, dtype=dtype, device=device)
    return target, load_drafter(args.draft_model_path, target, dtype=dtype, device=device), \
        load_tokenizer(args.model_path, target.cfg.vocab_size)


def read_prompts(args, tok):
    texts = Path(args.prompts).read_text().splitlines() if args.prompts else DEFAULT_PROMPTS
    texts = [t for t in texts if t.strip()]
    if args.chat:
        return [tok.apply_chat_template([{"role": "user", "content": t}]) for t in texts]
    return [tok.encode(t, allow_special=False) for t in texts]


def parse_budgets(text):
    """'4,8' -> (4, 8): spec.graphs.parse_buckets' rule, with budgets of at least 1 (a tree, not the root alone)."""
    from spec.graphs import parse_buckets

    try:
        values = parse_buckets(text)
    except ValueError as err:
        raise SystemExit(f"error: {err}") from None
    if values[0] < 1:
        raise SystemExit(f"error: budgets must be >= 1, got {text!r}")
    return values


def machine(device):
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return (f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores), "
            f"{torch.get_num_threads()} torch thread(s)")


# ---- live -----------------------------------------------------------------------------------------------------

def policies(fixed):
    return ["ar", "chain"] + [str(b) for b in fixed] + ["auto"]


def run_policy(engine_for, name, prompts, max_new):
    """One decode of every prompt (one at a time: single-user decoding) under a policy: decode seconds (wall),
    this process's CPU seconds of the decode (prorated from each call's CPU time by its decode share of the
    wall time), tokens, accept lengths and the budget of every step."""
    engine = engine_for(name)
    seconds = cpu = 0.0
    tokens, accepts, budgets = 0, [], Counter()
    for prompt in prompts:
        c0 = time.process_time()
        result = engine.generate([prompt], max_new, spec=name != "ar")
        cpu += (time.process_time() - c0) * result.decode_s / (result.prefill_s + result.decode_s)
        seconds += result.decode_s
        tokens += len(result.output_ids[0]) - 1  # the first token comes from the prefill
        accepts += result.accept_lengths[0]
        budgets.update(result.budgets)
    return seconds, cpu, tokens, accepts, budgets


def live(args):
    from spec.engine import Engine
    from spec.graphs import DEFAULT_BUCKETS

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    target, drafter, tok = load_pair(args, device)
    prompts = read_prompts(args, tok)
    fixed = parse_budgets(args.budgets)
    auto = parse_budgets(args.auto_budgets) if args.auto_budgets else AUTO_BUDGETS
    buckets = tuple(sorted({*DEFAULT_BUCKETS, *fixed}))
    latency = LatencyTable.load(args.latency) if args.latency else None
    engines = {}

    def engine_for(name):
        if name not in engines:
            budget = "auto" if name == "auto" else int(name) if name.isdigit() else 8
            tree = "chain" if name == "chain" else "ddtree"
            engines[name] = Engine(target, drafter, budget, cuda_graphs=args.cuda_graphs, tree=tree, buckets=buckets,
                                   latency=latency, auto_budgets=auto)
        return engines[name]

    names = policies(fixed)
    for name in names:  # warm-up: graph capture, latency measurement, Triton compiles
        run_policy(engine_for, name, prompts[:1], min(8, args.max_new_tokens))
    runs = {name: [] for name in names}
    for _ in range(args.repeats):
        for name in names:
            runs[name].append(run_policy(engine_for, name, prompts, args.max_new_tokens))
    rows = []
    for name in names:
        rates = [tokens / seconds for seconds, _, tokens, _, _ in runs[name]]
        cpu_rates = [tokens / cpu for _, cpu, tokens, _, _ in runs[name]]
        accepts = [a for run in runs[name] for a in run[3]]
        budgets = sum((run[4] for run in runs[name]), Counter())
        rows.append(dict(policy=name, tokens_per_s=statistics.median(rates), spread=(min(rates), max(rates)),
                         tokens_per_cpu_s=statistics.median(cpu_rates), cpu_spread=(min(cpu_rates), max(cpu_rates)),
                         mean_accept=sum(accepts) / len(accepts), steps=len(accepts) // args.repeats,
                         budgets=dict(sorted(budgets.items()))))
        print(json.dumps(rows[-1]), flush=True)
    meta = dict(machine=machine(device), torch=torch.__version__,
                date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                pair=args.model_path or "embedded default (spec/default_model.py)", prompts=len(prompts),
                max_new_tokens=args.max_new_tokens, repeats=args.repeats,
                cuda_graphs=args.cuda_graphs and device.type == "cuda",
                auto_budgets=auto, latency=args.latency or "measured by the engine", kernels=ops.table(),
                load_average=os.getloadavg()[0])
    auto_engine = engines["auto"]
    table = auto_engine.latency or auto_engine.latencies.get(1)
    meta["auto_latency_ms"] = {b: round(table.ms(b), 3) for b in table.budgets}
    write(args.out, meta, rows, live_markdown(meta, rows))


def live_markdown(meta, rows):
    """Tokens per wall second (decode), and on a CPU per CPU second of this process (steadier on a shared
    machine: other processes' work does not count), medians over repeats, relative to the chain's."""
    cpu = meta["machine"].startswith("CPU")
    key = "tokens_per_cpu_s" if cpu else "tokens_per_s"
    chain = next(r[key] for r in rows if r["policy"] == "chain")
    best = max(r[key] for r in rows if r["policy"].isdigit())
    lines = [f"# Tree-budget policies, live ({meta['machine']}, {meta['date']})", "",
             f"Pair: {meta['pair']}; {meta['prompts']} prompts x {meta['max_new_tokens']} new tokens, one at a time, "
             f"greedy; median of {meta['repeats']} interleaved repeats (decode only); CUDA graphs "
             f"{'on' if meta['cuda_graphs'] else 'off'}; auto's candidates {list(meta['auto_budgets'])}, latency "
             f"{meta['latency']}: {meta['auto_latency_ms']} ms; torch {meta['torch']}; load average "
             f"{meta['load_average']:.1f} at the end.", ""]
    cpu_cols = "tokens / CPU s | min-max | " if cpu else ""
    lines += [f"| policy | {cpu_cols}tokens / s (wall) | min-max | vs chain | vs best fixed | mean accept length | "
              "steps / repeat | budgets chosen |", "|---|" + "---|" * (9 if cpu else 7)]
    for r in rows:
        chosen = ", ".join(f"{b}: {n}" for b, n in r["budgets"].items()) if r["policy"] == "auto" else "-"
        cpu_vals = f"{r['tokens_per_cpu_s']:.1f} | {r['cpu_spread'][0]:.1f}-{r['cpu_spread'][1]:.1f} | " if cpu else ""
        lines.append(f"| {r['policy']} | {cpu_vals}{r['tokens_per_s']:.1f} | "
                     f"{r['spread'][0]:.1f}-{r['spread'][1]:.1f} | "
                     f"{r[key] / chain:.2f} | {r[key] / best:.2f} | {r['mean_accept']:.2f} | {r['steps']} | {chosen} |")
    return "\n".join(lines) + "\n"


def write(out, meta, rows, table):
    print(table)
    if out:
        out = Path(out)
        out.write_text(table)
        out.with_suffix(".json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=1) + "\n")


# ---- record ---------------------------------------------------------------------------------------------------

def accepted_by_budget(tree, truth, budgets):
    """Per row, the accepted draft nodes of the best-b tree for each b (the tree built at the largest b; the
    best-b tree is its first b + 1 nodes, and a path's node indices grow with depth), against truth [B, L]
    (-1 past the text's end): the walk from the root follows the child holding the next true token."""
    B, N1 = tree.tokens.shape
    cur = torch.zeros(B, dtype=torch.long)
    deepest = torch.zeros(B, len(budgets), dtype=torch.long)
    walking = torch.ones(B, dtype=torch.bool)
    limits = torch.tensor(budgets)
    for d in range(truth.shape[1]):
        match = (tree.parents.long() == cur[:, None]) & (tree.tokens == truth[:, d : d + 1])
        child = torch.where(match, torch.arange(N1), N1).min(1).values
        walking &= child < N1
        deepest += (walking[:, None] & (child[:, None] <= limits)).long()  # a prefix: later depths only when earlier
        cur = torch.where(walking, child, cur)
    return deepest


def chain_accepted(tokens, truth):
    """Per row, how many leading depths the drafter's argmax equals the true token."""
    same = (tokens[..., 0] == truth).long()
    return same.cumprod(1).sum(1)


@torch.no_grad()
def record_prompt(target, drafter, prompt, max_new, budgets, chunk=64):
    from model.generate import greedy_generate

    seq = prompt + greedy_generate(target, [prompt], max_new)[0]
    T, L, P = len(seq), drafter.cfg.draft_len, len(prompt)
    tokens = torch.tensor([seq], device=target.device)
    feats = target(tokens, torch.arange(T, device=target.device)[None], target.new_cache(1, T),
                   hidden_layers=drafter.target_layer_ids).hidden[0]
    masses, accepted, chain = [], [], []
    for start in range(P, T, chunk):
        pos = list(range(start, min(start + chunk, T)))
        B = len(pos)
        cache = drafter.new_cache(B, pos[-1] + drafter.cfg.block_size)
        context = torch.zeros(B, pos[-1], feats.shape[-1], dtype=feats.dtype, device=feats.device)
        for i, p in enumerate(pos):
            context[i, :p] = feats[:p]
        counts = torch.tensor(pos, dtype=torch.int32, device=target.device)
        drafter.append_context(cache, context, counts, pos)
        bonus = tokens[0, pos]
        lp, tok = ops.draft_topk(drafter.draft(cache, bonus), min(max(budgets), target.cfg.vocab_size))
        truth = torch.tensor([(seq[p + 1 : p + 1 + L] + [-1] * L)[:L] for p in pos])
        tree = ops.build_tree(lp, tok, bonus, max(budgets))
        masses += path_masses(lp, budgets).cpu().tolist()
        host_tree = type(tree)(**{k: v.cpu() if torch.is_tensor(v) else v for k, v in vars(tree).items()})
        accepted += accepted_by_budget(host_tree, truth, budgets).tolist()
        chain += chain_accepted(tok.cpu(), truth).tolist()
    return dict(prompt_tokens=P, masses=[[[round(m, 6) for m in row] for row in pos] for pos in masses],
                accepted=accepted, chain=chain)


def record(args):
    device = torch.device(args.device or "cpu")
    target, drafter, tok = load_pair(args, device)
    budgets = parse_budgets(args.budgets)
    prompts = read_prompts(args, tok)
    out = dict(meta=dict(pair=args.model_path or "embedded default (spec/default_model.py)", budgets=budgets,
                         depth=drafter.cfg.draft_len, max_new_tokens=args.max_new_tokens,
                         date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())),
               prompts=[record_prompt(target, drafter, p, args.max_new_tokens, budgets) for p in prompts])
    Path(args.out).write_text(json.dumps(out) + "\n")
    n = sum(len(p["chain"]) for p in out["prompts"])
    print(f"recorded {n} positions of {len(prompts)} prompts to {args.out}")


# ---- replay ---------------------------------------------------------------------------------------------------

def simulate(rec, name, latency, context, extra_ms=0.0, smooth=None):
    """Walk every recorded text under one policy; (tokens, seconds, steps, budgets chosen)."""
    budgets, L = tuple(rec["meta"]["budgets"]), rec["meta"]["depth"]
    candidates = tuple(b for b in budgets if b in latency.budgets)
    chain_cost = latency.ms(min(b for b in latency.budgets if b >= L), context)  # a chain pads to its bucket
    tokens = steps = 0
    seconds, chosen = 0.0, Counter()
    for text in rec["prompts"]:
        n, pos = len(text["chain"]), 0
        if name == "auto":
            scorer = MassScorer(candidates, L, "cpu")
            policy = BudgetPolicy(candidates, L, latency, scorer=scorer,
                                  **({} if smooth is None else dict(smooth=smooth)))
            columns = [budgets.index(b) for b in candidates]
        while pos < n:
            if name == "ar":
                accepted, ms = 0, latency.ms(0, context)
            elif name == "chain":
                accepted, ms = text["chain"][pos], chain_cost
            elif name == "auto":
                b = policy.budget
                accepted, ms = text["accepted"][pos][budgets.index(b)], latency.ms(b, context) + extra_ms
                masses = torch.tensor(text["masses"][pos])[columns]  # [nb, L]
                gains = (scorer.gains(masses) * MASS_SCALE).round().long().tolist()
                own = (masses[candidates.index(b)] * MASS_SCALE).round().long().tolist()
                policy.update(gains, own, [accepted], context)
                chosen[b] += 1
            else:
                b = int(name)
                accepted, ms = text["accepted"][pos][budgets.index(b)], latency.ms(b, context)
            tokens += accepted + 1
            pos += accepted + 1
            seconds += ms / 1e3
            steps += 1
    return tokens, seconds, steps, chosen


def scaled_trees(latency, scale):
    """The table with each tree budget's extra over the smallest tree budget scaled (0: trees cost alike;
    the autoregressive step unchanged): a target whose bigger trees cost less, to exercise the choice."""
    trees = [b for b in latency.budgets if b]
    return LatencyTable({c: {b: ms if b == 0 else row[trees[0]] + scale * (ms - row[trees[0]])
                             for b, ms in row.items()} for c, row in latency.by_context.items()},
                        source=f"{latency.source}, tree extras x {scale}")


def replay(args):
    rec = json.loads(Path(args.record).read_text())
    latency = LatencyTable.load(args.steps)
    if args.tree_cost_scale != 1:
        latency = scaled_trees(latency, args.tree_cost_scale)
    context = args.context if args.context is not None else latency.contexts[0]
    L = rec["meta"]["depth"]
    fixed = [b for b in rec["meta"]["budgets"] if b in latency.budgets]
    rows = []
    for name in ["ar", "chain"] + [str(b) for b in fixed] + ["auto"]:
        if name == "ar" and 0 not in latency.budgets:
            continue
        tokens, seconds, steps, chosen = simulate(rec, name, latency, context, args.auto_extra_ms, args.auto_smooth)
        rows.append(dict(policy=name, tokens_per_s=tokens / seconds, mean_accept=tokens / steps, steps=steps,
                         budgets=dict(sorted(chosen.items()))))
        print(json.dumps(rows[-1]), flush=True)
    meta = dict(record=args.record, pair=rec["meta"]["pair"], steps_file=latency.source, context=context, depth=L,
                positions=sum(len(p["chain"]) for p in rec["prompts"]), prompts=len(rec["prompts"]),
                auto_extra_ms=args.auto_extra_ms, auto_smooth=args.auto_smooth,
                chain_bucket=min(b for b in latency.budgets if b >= L))
    write(args.out, meta, rows, replay_markdown(meta, rows))


def replay_markdown(meta, rows):
    chain = next(r["tokens_per_s"] for r in rows if r["policy"] == "chain")
    best = max(r["tokens_per_s"] for r in rows if r["policy"].isdigit())
    lines = ["# Tree-budget policies, replayed at a step table's costs", "",
             f"Acceptance: {meta['pair']}, recorded over {meta['positions']} positions of {meta['prompts']} greedy "
             f"texts ({meta['record']}). Costs: {meta['steps_file']} at context {meta['context']} (the chain's "
             f"{meta['depth']} nodes charged at bucket {meta['chain_bucket']}; auto charged "
             f"{meta['auto_extra_ms']} ms a step more than its bucket).", "",
             "| policy | tokens/s | vs chain | vs best fixed | tokens / step | steps | budgets chosen |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        chosen = ", ".join(f"{b}: {n}" for b, n in r["budgets"].items()) if r["budgets"] else "-"
        lines.append(f"| {r['policy']} | {r['tokens_per_s']:.1f} | {r['tokens_per_s'] / chain:.3f} | "
                     f"{r['tokens_per_s'] / best:.3f} | {r['mean_accept']:.2f} | {r['steps']} | {chosen} |")
    return "\n".join(lines) + "\n"


# ---- host cost ------------------------------------------------------------------------------------------------

def host_cost(args):
    """Microseconds a step of auto's host work: BudgetPolicy.update alone, and `update_from_read`, the engine's (parsing
    the step's read, then update) at B = 1, the default candidates, L = 7 (the folds and the factors' copy
    included); min over repeats, with a fixed pure-Python loop timed in the same run to show the machine's
    load."""
    budgets, L = AUTO_BUDGETS, 7
    table = LatencyTable({4096: {b: 9.0 + b / 10 for b in budgets}})

    def policy():
        return BudgetPolicy(budgets, L, table, scorer=MassScorer(budgets, L, "cpu"))

    gains = [round(x * MASS_SCALE) for x in (1.8, 2.1, 2.5, 2.8, 3.0, 3.1)]
    masses = [round(0.3 * MASS_SCALE)] * L
    accepted = itertools.cycle(range(L + 1))
    alone = policy()
    reader = policy()
    rows = [[[a + 1] + list(range(L + 2)) + gains + masses] for a in range(L + 1)]
    start, live = L + 3, [True]

    def reference():
        total = 0
        for i in range(100):
            total += i

    def best(fn, n=20000):
        return min(timeit.repeat(fn, number=n, repeat=args.repeats)) / n * 1e6

    update = best(lambda: alone.update(gains, masses, [next(accepted)], 4096))
    choose = best(lambda: reader.update_from_read(rows[next(accepted)], live, start, 4096))
    print(f"auto's host work a step: BudgetPolicy.update {update:.2f} us, update_from_read (read parsing + "
          f"update) {choose:.2f} us (min of {args.repeats} x 20000 calls); a loop of 100 integer additions: "
          f"{best(reference):.2f} us in the same run (Python {platform.python_version()}, "
          f"{platform.processor() or platform.machine()}, load average {os.getloadavg()[0]:.1f})")


def scorer_cost(args):
    """Microseconds of auto's device work a step, `MassScorer.stats` (path masses of every candidate, corrected
    gains, fixed point) on a draft's top-k log-probs [B, L, K = the largest candidate]: replayed as a CUDA graph
    on a GPU (events, the median of rounds), eager on a CPU (host clock)."""
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    budgets, L = AUTO_BUDGETS, args.depth
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(args.batch, L, 4096, generator=gen).to(device)
    lp, _ = ops.draft_topk(logits, max(budgets))
    scorer = MassScorer(budgets, L, device)
    run = lambda: scorer.stats(lp, budgets[1])  # noqa: E731
    if device.type == "cuda":
        from spec.graphs import capture_graph

        graph = capture_graph(run, device, None)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        rounds = []
        for _ in range(args.repeats):
            start.record()
            for _ in range(100):
                graph.replay()
            end.record()
            end.synchronize()
            rounds.append(start.elapsed_time(end) * 10)  # us a replay
        where = f"{torch.cuda.get_device_name(device)}, one CUDA graph replay"
    else:
        run()
        rounds = [timeit.timeit(run, number=100) * 1e4 for _ in range(args.repeats)]
        where = "CPU, eager"
    print(f"auto's scorer: {statistics.median(rounds):.1f} us a step (median of {args.repeats} x 100; "
          f"B = {args.batch}, "
          f"L = {L}, candidates {list(budgets)}; {where})")


# ---- command line ---------------------------------------------------------------------------------------------

def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m bench.policy", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="mode", required=True)
    for name in ("live", "record"):
        s = sub.add_parser(name)
        s.add_argument("--model-path", help="K2.6-format target (default: the embedded tiny pair)")
        s.add_argument("--draft-model-path")
        s.add_argument("--prompts", help="a text file, one prompt a line (default: six short built-in prompts)")
        s.add_argument("--chat", action="store_true", help="wrap each prompt in the chat template")
        s.add_argument("--max-new-tokens", type=int, default=96)
        s.add_argument("--device", default=None)
        s.add_argument("--budgets", default=",".join(map(str, FIXED)) if name == "live" else "4,8,16,32,64,128",
                       help="fixed budgets to run (live) / to record")
        s.add_argument("--out", default=None, required=name == "record")
    s = sub.choices["live"]
    s.add_argument("--auto-budgets", default=None, help="auto's candidates (default: spec.budget.AUTO_BUDGETS)")
    s.add_argument("--latency", default=None, help="a latency table for auto (default: measured by the engine)")
    s.add_argument("--repeats", type=int, default=3)
    s.add_argument("--cuda-graphs", action=argparse.BooleanOptionalAction, default=True)
    s = sub.add_parser("replay")
    s.add_argument("record")
    s.add_argument("steps", help="bench_step json or LatencyTable json")
    s.add_argument("--context", type=int, default=None, help="context of the table to charge (default: its first)")
    s.add_argument("--auto-extra-ms", type=float, default=0.0, help="auto's own cost a step (its scorer)")
    s.add_argument("--auto-smooth", type=float, default=None,
                   help="auto's weight of the past in its average gains (default: spec.budget.BudgetPolicy's)")
    s.add_argument("--tree-cost-scale", type=float, default=1.0,
                   help="scale each budget's step ms above the smallest budget's (a what-if: cheaper trees)")
    s.add_argument("--out", default=None)
    s = sub.add_parser("host-cost")
    s.add_argument("--repeats", type=int, default=7)
    s = sub.add_parser("scorer-cost")
    s.add_argument("--device", default=None)
    s.add_argument("--batch", type=int, default=1)
    s.add_argument("--depth", type=int, default=7)
    s.add_argument("--repeats", type=int, default=7)
    args = p.parse_args(argv)
    if getattr(args, "draft_model_path", None) and not args.model_path:
        raise SystemExit("error: --draft-model-path needs --model-path")
    if getattr(args, "model_path", None) and not args.draft_model_path:
        raise SystemExit("error: --model-path needs --draft-model-path")
    modes = {"live": live, "record": record, "replay": replay, "host-cost": host_cost, "scorer-cost": scorer_cost}
    modes[args.mode](args)


if __name__ == "__main__":
    sys.exit(main())
