"""The tree-budget policy (spec/budget.py) on the CPU: path masses against the built tree, the best-first prefix
property, the chain, the scorer's fixed-point stats, latency tables, and the policy's choices and learning."""

import json
from itertools import takewhile
from pathlib import Path

import pytest
import torch

import ops
from spec.budget import (AUTO_BUDGETS, MASS_SCALE, BudgetPolicy, LatencyTable, MassScorer, ScoredTree, TreeDraft,
                         chain_tree, path_masses, sum_rows)
from tests.conftest import requires_gpu

STEP_JSON = Path(__file__).parents[1] / "bench" / "results" / "step_h100_s27.json"
FIELDS = ("tokens", "parents", "depths")


def random_draft(B, L, V, k, seed=0, ties=False):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(B, L, V, generator=gen) * 2
    if ties:
        logits = logits.round()
    return ops.draft_topk(logits, min(k, V))


def tree_masses(lp, tokens, budget):
    """Per row and depth, the sum of exp(cumulative log-prob) of the built tree's nodes (the torch build, itself
    checked against heapq in test_tree_ops; fp32 sums parent + log-prob, as the build forms them)."""
    B, L, _ = lp.shape
    tree = ops.build_tree(lp, tokens, torch.zeros(B, dtype=torch.long), budget)
    out = torch.zeros(B, L, dtype=torch.float64)
    for b in range(B):
        score = [torch.tensor(0.0)]
        for i in range(1, int(tree.num_nodes[b])):
            d = int(tree.depths[b, i])
            rank = tokens[b, d - 1].tolist().index(int(tree.tokens[b, i]))
            score.append(score[int(tree.parents[b, i])] + lp[b, d - 1, rank])
            out[b, d - 1] += score[-1].double().exp()
    return out


@pytest.mark.parametrize("B,L,V,budgets,ties", [(3, 5, 40, (1, 2, 3, 5, 8, 16, 33), False),
                                                (2, 7, 512, (4, 8, 16, 32, 64, 128), False),
                                                (2, 3, 4, (1, 5, 20, 100), False),  # fewer nodes than the budget
                                                (4, 6, 16, (3, 9, 27), True),
                                                (1, 1, 9, (1, 2, 9), False)])
def test_path_masses_match_the_built_tree(B, L, V, budgets, ties):
    lp, tokens = random_draft(B, L, V, max(budgets), seed=B * 100 + L, ties=ties)
    masses = path_masses(lp, budgets)
    assert masses.shape == (B, len(budgets), L) and masses.dtype == torch.float32
    for j, budget in enumerate(budgets):
        want = tree_masses(lp, tokens, budget)
        assert torch.allclose(masses[:, j].double(), want, atol=1e-6, rtol=1e-5), budget


def test_best_first_prefix_is_the_smaller_tree():
    """A best-first tree cut after its first b pops is the best-b tree: the fact that lets one draft price
    every budget."""
    lp, tokens = random_draft(3, 7, 300, 128, seed=4)
    roots = torch.tensor([1, 2, 3])
    big = ops.build_tree(lp, tokens, roots, 128)
    for b in (1, 4, 8, 16, 32, 64):
        small = ops.build_tree(lp[..., :b].contiguous(), tokens[..., :b].contiguous(), roots, b)
        for f in FIELDS:
            assert torch.equal(getattr(small, f), getattr(big, f)[:, : b + 1]), (b, f)


def test_chain_is_the_per_depth_argmax():
    lp, tokens = random_draft(4, 7, 64, 16, seed=5)
    roots = torch.arange(4)
    chain = chain_tree(lp, tokens, roots)
    assert chain.tokens.shape == (4, 8) and chain.num_nodes.tolist() == [8] * 4
    assert torch.equal(chain.tokens[:, 1:], tokens[..., 0]) and torch.equal(chain.tokens[:, 0], roots)
    assert chain.parents[0].tolist() == list(range(-1, 7)) and chain.depths[0].tolist() == list(range(8))
    logits = torch.randn(4, 7, 64, generator=torch.Generator().manual_seed(6))
    drafted = TreeDraft("chain")(logits, roots)
    want = chain_tree(*ops.draft_topk(logits, 16), roots)
    for name, t in vars(want).items():
        assert t == getattr(drafted, name) if name == "max_depth" else torch.equal(t, getattr(drafted, name))


def test_tree_draft_with_a_larger_top_k_builds_the_same_tree():
    logits = torch.randn(2, 7, 200, generator=torch.Generator().manual_seed(7))
    roots = torch.tensor([5, 6])
    scorer = MassScorer((8, 16, 64), 7, "cpu")
    for budget in (8, 16, 64):
        plain = TreeDraft("ddtree", budget)(logits, roots)
        scored = TreeDraft("ddtree", budget, scorer=scorer)(logits, roots)
        assert isinstance(scored, ScoredTree) and not isinstance(plain, ScoredTree)
        for name in ("tokens", "parents", "depths", "mask", "first_child", "next_sibling", "num_nodes"):
            assert torch.equal(getattr(plain, name), getattr(scored, name)), (budget, name)
        assert scored.stats.shape == (2, 3 + 7) and scored.stats.dtype == torch.int64
    with pytest.raises(ValueError, match="tree"):
        TreeDraft("bush", 8)
    with pytest.raises(ValueError, match="tree budget"):
        TreeDraft("ddtree", 0)


def test_scorer_stats_are_fixed_point_gains_and_own_masses():
    lp, _ = random_draft(2, 5, 50, 32, seed=8)
    scorer = MassScorer((4, 8, 32), 5, "cpu")
    masses = path_masses(lp, (4, 8, 32))
    stats = scorer.stats(lp, 8).double() / MASS_SCALE
    assert torch.allclose(stats[:, :3], masses.sum(-1).double(), atol=1e-6)  # factors 1: the plain expectation
    assert torch.allclose(stats[:, 3:], masses[:, 1].double(), atol=1e-6)  # the tree built: budget 8
    scorer.set_bias([3.0, 1.0, 0.5, 1.0, 1.0])
    stats = scorer.stats(lp, 4).double() / MASS_SCALE
    want = (masses.double() * torch.tensor([3.0, 1.0, 0.5, 1.0, 1.0], dtype=torch.float64)).clamp(max=1).sum(-1)
    assert torch.allclose(stats[:, :3], want, atol=1e-6)
    assert torch.allclose(stats[:, 3:], masses[:, 0].double(), atol=1e-6)


def test_latency_table_interpolates_and_loads(tmp_path):
    table = LatencyTable({1000: {8: 2.0, 16: 4.0}, 3000: {8: 4.0, 16: 8.0}})
    assert table.budgets == (8, 16)
    assert table.ms(8, 0) == 2.0 and table.ms(8, 2000) == pytest.approx(3.0) and table.ms(16, 9000) == 8.0
    with pytest.raises(ValueError, match="no entry for budget 32"):
        table.ms(32)
    path = tmp_path / "latency.json"
    table.save(path)
    assert LatencyTable.load(path).by_context == table.by_context
    step = LatencyTable.load(STEP_JSON)  # a bench_step file: step_ms per budget, the AR step at 0
    rows = json.loads(STEP_JSON.read_text())["rows"]
    assert step.budgets == tuple(r["budget"] for r in rows if r["context"] == rows[0]["context"])
    assert step.ms(0, 4096) == rows[0]["ar_step_ms"] and step.ms(8, 4096) == rows[1]["step_ms"]
    for bad, message in ((tmp_path / "none.json", "none.json"), (path.with_name("x.json"), "x.json")):
        if bad.name == "x.json":
            bad.write_text(json.dumps({"rows": [{"budget": 8}]}))
        with pytest.raises(ValueError, match=message):
            LatencyTable.load(bad)
    with pytest.raises(ValueError, match="same budgets"):
        LatencyTable({1: {8: 1.0}, 2: {16: 1.0}})
    with pytest.raises(ValueError, match="positive"):
        LatencyTable({1: {8: 0.0}})


def fixed(values):
    return [round(v * MASS_SCALE) for v in values]


def test_policy_picks_the_best_rate():
    table = LatencyTable({0: {8: 10.0, 16: 12.0, 32: 20.0}})
    policy = BudgetPolicy((8, 16, 32), 3, table, smooth=0.0)  # the last step's gains alone
    assert policy.budget == 8  # the first candidate past L
    masses = fixed([0.9, 0.8, 0.7])
    # rates: (1 + 2.0) / 10 = 0.30, (1 + 2.7) / 12 = 0.308, (1 + 3.0) / 20 = 0.2
    assert policy.update(fixed([2.0, 2.7, 3.0]), masses, [3]) == 16
    # a shallower draft: (1 + 1.0) / 10 = 0.2 beats (1 + 1.1) / 12
    assert policy.update(fixed([1.0, 1.1, 1.2]), masses, [3]) == 8
    # a batch of two live sequences, gains summed: (1 + 1.25) / 10 = 0.225 against (1 + 1.8) / 12 = 0.233
    assert policy.update(fixed([2.5, 3.6, 4.0]), masses, [3, 1]) == 16
    assert policy.update(fixed([9.0, 9.0, 9.0]), masses, []) == 16  # nothing live: no change


def test_policy_chooses_from_the_average_gain():
    """Drafts alternating between deep and shallow: the last step alone flips the choice every step; the average
    (smooth 0.9) settles on the budget whose average rate is best, (1 + 2.1) / 12 = 0.258 against (1 + 1.5) / 10."""
    table = LatencyTable({0: {8: 10.0, 16: 12.0}})
    masses = fixed([0.9, 0.8, 0.7])
    deep, shallow = fixed([2.0, 3.2]), fixed([1.0, 1.0])
    flips, settles = BudgetPolicy((8, 16), 3, table, smooth=0.0), BudgetPolicy((8, 16), 3, table, smooth=0.9)
    chosen = {id(p): [p.update(deep if i % 2 == 0 else shallow, masses, [3]) for i in range(60)]
              for p in (flips, settles)}
    assert chosen[id(flips)][-4:] == [16, 8, 16, 8] and set(chosen[id(settles)][-30:]) == {16}


def test_policy_learns_per_depth_factors():
    table = LatencyTable({0: {4: 5.0, 8: 6.0}})
    scorer = MassScorer((4, 8), 3, "cpu")
    policy = BudgetPolicy((4, 8), 3, table, scorer=scorer, refresh=4, start=8)
    # the drafter predicts 0.5 at every depth; the target's paths reach depth 1 always, depth 2 half the time,
    # depth 3 never: factors 2, 1, 0 (the prior decays away over 50 windows of 4 steps)
    for step in range(200):
        policy.update(fixed([1.0, 1.5]), fixed([0.5, 0.5, 0.5]), [1 + step % 2], context=100)
        policy.budget = 8
    assert policy.bias() == pytest.approx([2.0, 1.0, 0.0], abs=1e-3)
    assert torch.allclose(scorer.bias, torch.tensor(policy.bias()), atol=1e-3)  # refreshed on the device
    capped = BudgetPolicy((4, 8), 2, table, max_bias=3.0, prior=1e-9, refresh=1)
    capped.update(fixed([0, 0]), fixed([0.01, 0.01]), [2])
    assert capped.bias() == [3.0, 3.0]
    batch = BudgetPolicy((4, 8), 2, table, prior=1e-9, refresh=2, decay=1.0)
    assert batch.bias() == [1.0, 1.0]  # nothing seen yet
    batch.update(fixed([0, 0]), fixed([1.0, 0.5]), [2, 0])  # two live sequences: one reached both depths
    assert batch.bias() == pytest.approx([1 / 1, 1 / 0.5])  # the first step is folded in at once
    for _ in range(2):  # then a window of 2 (refresh): both sequences reach depth 1 only
        batch.update(fixed([0, 0]), fixed([1.0, 0.5]), [1, 1])
    assert batch.bias() == pytest.approx([5 / 3, 1 / 1.5])
    with pytest.raises(ValueError, match="no entry for budgets \\[16\\]"):
        BudgetPolicy((4, 16), 3, table)
    with pytest.raises(ValueError, match=">= 1"):
        BudgetPolicy((0, 4), 3, table)


def test_sum_rows():
    rows = [[9, 1, 2, 3], [9, 10, 20, 30], [9, 100, 200, 300]]
    assert sum_rows(rows, [True, False, True], 1, 3) == [101, 202]
    assert sum_rows(rows, [False, True, False], 1, 4) == [10, 20, 30]


# ---- bench/policy.py and bench/project.py ----------------------------------------------------------------------

def test_replay_walks_recorded_acceptance():
    from bench.policy import accepted_by_budget, chain_accepted, simulate

    lp, tokens = random_draft(2, 3, 6, 4, seed=9)
    tree = ops.build_tree(lp, tokens, torch.tensor([0, 0]), 4)
    # row 0: the truth follows the rank-0 chain for 2 depths then leaves the tree; row 1: the truth is a
    # rank-1 token at depth 1 (not in the chain)
    truth = torch.stack([torch.cat([tokens[0, :2, 0], torch.tensor([-1])]),
                         torch.cat([tokens[1, :1, 1], torch.tensor([-1, -1])])])
    got = accepted_by_budget(tree, truth, (1, 2, 4))
    nodes = [{(int(tree.parents[b, i]), int(tree.tokens[b, i])): i for i in range(1, 5)} for b in range(2)]
    for b in range(2):
        path, cur = [], 0
        for t in truth[b].tolist():
            if (cur, t) not in nodes[b]:
                break
            cur = nodes[b][(cur, t)]
            path.append(cur)
        want = [sum(1 for _ in takewhile(lambda i: i <= limit, path)) for limit in (1, 2, 4)]
        assert got[b].tolist() == want
    assert chain_accepted(tokens, truth).tolist() == [2, 0]
    rec = {"meta": {"budgets": [4, 8], "depth": 3},
           "prompts": [{"chain": [1] * 10, "accepted": [[2, 3]] * 10, "masses": [[[0.9] * 3, [0.95] * 3]] * 10}]}
    table = LatencyTable({0: {0: 1.0, 4: 2.0, 8: 2.5}})
    assert simulate(rec, "ar", table, 0)[:3] == (10, pytest.approx(0.010), 10)  # 10 positions, one token a 1 ms step
    tokens_, seconds, steps, _ = simulate(rec, "8", table, 0)  # 4 tokens a step: positions 0, 4, 8
    assert (tokens_, steps) == (12, 3) and seconds == pytest.approx(0.0075)
    assert simulate(rec, "chain", table, 0)[:3] == (10, pytest.approx(0.010), 5)  # charged at bucket 4
    tokens_, seconds, steps, chosen = simulate(rec, "auto", table, 0)
    # rates: (1 + 2.7) / 2 = 1.85 for 4 against (1 + 2.85) / 2.5 = 1.54 for 8: auto starts at 4 (> L) and stays
    assert chosen == {4: 4} and (tokens_, steps) == (12, 4)


def test_projection_arithmetic(tmp_path, capsys):
    from bench.project import gain_at, main

    assert gain_at({16: 1.0, 64: 1.2}, 32) == pytest.approx(1.1) and gain_at({16: 1.0, 64: 1.2}, 8) == 1.0
    rows = [dict(context=4096, budget=0, ar_step_ms=4.0), dict(context=4096, budget=8, step_ms=8.0),
            dict(context=4096, budget=32, step_ms=12.0)]
    path = tmp_path / "step.json"
    path.write_text(json.dumps(dict(meta=dict(read_GBps=2000.0), rows=rows)))
    out = tmp_path / "p.md"
    assert main([str(path), "--pro-bw", "1000", "--bw-efficiency", "1", "--collective-us", "10", "--pcie-bw", "1000",
                 "--logits", "local", "--acceptance-by-depth", "0.5,0.5,0.5", "--tree-gain", "4:1,32:1.2",
                 "--out", str(out)]) == 0
    table = out.read_text()
    assert table == capsys.readouterr().out.rstrip("\n") + "\n"
    # ms: compute at 2000 / 1000 GB/s, then 122 all-reduces of one row and a shard-local sample at 1 GB/ms
    ar = 4.0 * 2 + 122 * (10e-3 + 2 * 7 / 8 * 7168 * 2 / 1e9) + 10e-3 + 7 * 8 / 1e9
    assert f"| AR | 4.00 | 8.00 | {ar - 8:.2f} | {ar:.2f} | 1.00 | {1e3 / ar:.0f} |" in table
    lines = {line.split(" | ")[0][2:]: line.split(" | ") for line in table.splitlines() if line.startswith("| ")}
    assert lines["chain"][5] == "2.50"  # 1 + 0.5 x 3, charged at budget 8's 8 ms
    assert lines["budget 8"][5] == "2.67" and lines["budget 32"][5] == "3.00"  # gains 1 + 0.2 / 3, 1.2
    assert lines["budget 32"][2] == "24.00" and lines["chain"][1] == "8.00"
    assert "auto (= budget 8)" in table and "92.4 tok/s" in table
    assert main([str(tmp_path / "none.json")]) == 2 and "not a bench_step json" in capsys.readouterr().err
    assert main([str(path), "--tree-gain", "x"]) == 2 and "--tree-gain" in capsys.readouterr().err


# ---- the engine with auto and the chain ------------------------------------------------------------------------

PROMPTS = [[257, 84, 104, 101, 32, 116, 114, 101, 101], [7], list(range(40, 63))]
NEW = 48


@pytest.fixture(scope="module")
def default_pair():
    from model.generate import greedy_generate
    from spec.default_model import load_default

    target, drafter, _ = load_default()
    return target, drafter, greedy_generate(target, PROMPTS, NEW)


# step ms that make the choice follow the drafter's confidence from step to step
FLAT = LatencyTable({0: {8: 10.0, 16: 10.6, 32: 11.5}})


@pytest.mark.parametrize("kind", ["auto", "chain"])
def test_greedy_is_lossless_under_auto_and_the_chain(default_pair, kind):
    from spec.engine import Engine

    target, drafter, reference = default_pair
    engine = Engine(target, drafter, "auto", tree="ddtree" if kind == "auto" else "chain", latency=FLAT)
    result = engine.generate(PROMPTS, NEW)
    assert result.output_ids == reference
    assert len(result.budgets) == result.steps
    if kind == "chain":
        assert set(result.budgets) == {drafter.cfg.draft_len} and engine.budget == drafter.cfg.draft_len
        assert max(max(a) for a in result.accept_lengths) <= drafter.cfg.draft_len + 1
    else:
        assert len(set(result.budgets)) > 1 and set(result.budgets) <= set(FLAT.budgets)
    assert result.mean_accept_length > 1.5
    single = engine.generate(PROMPTS[:1], NEW)  # a new run: a new policy, the same text
    assert single.output_ids == reference[:1]


def test_auto_reads_the_device_once_a_step(default_pair, monkeypatch):
    """auto's stats travel in the step's one read; the eager latency measurement happens before the run."""
    import sys

    from spec.engine import Engine

    target, drafter, _ = default_pair
    engine = Engine(target, drafter, "auto")
    engine.generate(PROMPTS[:2], 4)  # measures the latency table for batch 2
    assert engine.latencies[2].budgets == engine.candidates == AUTO_BUDGETS
    reads = []
    for name in ("tolist", "item", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__"):
        def counting(self, *args, _original=getattr(torch.Tensor, name), _name=name, **kwargs):
            if sys._getframe(1).f_code.co_filename.endswith(("spec/engine.py", "spec/drafter.py", "spec/budget.py")):
                reads.append(_name)
            return _original(self, *args, **kwargs)
        monkeypatch.setattr(torch.Tensor, name, counting)
    result = engine.generate(PROMPTS[:2], 40)
    assert reads == ["tolist"] * (result.steps + 1)


def test_auto_sampling_is_reproducible(default_pair):
    from spec.engine import Engine, SamplingParams

    target, drafter, reference = default_pair
    engine = Engine(target, drafter, "auto", latency=FLAT)

    def run(seed):
        return engine.generate(PROMPTS[:2], 40, SamplingParams(temperature=0.9, seed=seed))

    first = run(3)
    again = run(3)
    assert again.output_ids == first.output_ids and again.budgets == first.budgets
    assert run(4).output_ids != first.output_ids and first.output_ids != [r[:40] for r in reference[:2]]


def test_engine_tree_arguments(default_pair):
    from spec.engine import Engine

    target, drafter, _ = default_pair
    assert Engine(target, drafter).auto and Engine(target, drafter).budget == max(AUTO_BUDGETS)  # the default
    assert Engine(target, drafter, 16).budget == 16 and not Engine(target, drafter, 16).auto
    chain = Engine(target, drafter, 64, tree="chain")
    assert chain.budget == 7 and not chain.auto and 7 in chain.buckets
    with pytest.raises(ValueError, match="tree must be one of ddtree, chain"):
        Engine(target, drafter, tree="bush")
    with pytest.raises(ValueError, match="tree budget must be 'auto' or in 1..512"):
        Engine(target, drafter, "many")
    with pytest.raises(ValueError, match="auto needs a budget in 1..512"):
        Engine(target, drafter, "auto", auto_budgets=(0,))
    engine = Engine(target, drafter, "auto", auto_budgets=(0, 4, 12))
    assert engine.candidates == (4, 12) and engine.buckets == (0, 4, 8, 12, 16, 32, 64, 128)
    assert Engine(target, drafter, latency=FLAT).candidates == (8, 16, 32)  # those the table has


def test_decode_cli_tree_flags(capsys, tmp_path):
    from spec.decode import main

    def run(*argv):
        assert main(["--prompt", "Hello", "--max-new-tokens", "12", "--json", *argv]) == 0
        return json.loads(capsys.readouterr().out)

    chain = run("--tree", "chain")
    assert chain["budgets"] == [7] * chain["steps"]
    table = tmp_path / "latency.json"
    FLAT.save(table)
    auto = run("--latency-table", str(table))  # auto is the default
    assert auto["output_ids"] == chain["output_ids"] and set(auto["budgets"]) <= {8, 16, 32}
    assert main(["--prompt", "Hello", "--latency-table", str(tmp_path / "none.json")]) == 2
    assert "error: --latency-table: latency table" in capsys.readouterr().err
    assert main(["--prompt", "Hello", "--tree-budget", "many"]) == 2
    assert "--tree-budget must be in 1..512 or auto, got many" in capsys.readouterr().err


@requires_gpu
@pytest.mark.parametrize("kind", ["auto", "chain"])
def test_graphs_equal_eager_under_auto_and_the_chain_gpu(kind):
    """With CUDA graphs (auto: a verify graph per candidate, a draft graph per candidate carrying the scorer)
    the tokens and the budgets chosen are those of the eager run; auto's own table is measured on graphs."""
    from spec.default_model import load_default
    from spec.engine import Engine

    target, drafter, _ = load_default(dtype=torch.float16, device="cuda")
    tree = "ddtree" if kind == "auto" else "chain"
    runs = [Engine(target, drafter, "auto", tree=tree, cuda_graphs=g, latency=FLAT).generate(PROMPTS, NEW)
            for g in (True, False)]
    assert runs[0].output_ids == runs[1].output_ids and runs[0].budgets == runs[1].budgets
    if kind == "auto":
        assert len(set(runs[0].budgets)) > 1
        engine = Engine(target, drafter)
        result = engine.generate(PROMPTS, NEW)
        table = engine.latencies[len(PROMPTS)]
        assert table.budgets == engine.candidates and all(table.ms(b) > 0 for b in table.budgets)
        assert set(result.budgets) <= set(engine.candidates) and len(result.output_ids[0]) == NEW
        plain = [Engine(target, drafter, cuda_graphs=g).generate(PROMPTS, NEW, spec=False) for g in (True, False)]
        assert plain[0].output_ids == plain[1].output_ids and set(plain[0].budgets) == {0}
