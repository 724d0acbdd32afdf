"""Losslessness of tree acceptance (`ops.accept`): with a fixed draft that differs from the target, the first
and second emitted tokens follow the target's distribution (chi-square over 10^5 samples); and so does a step
whose tree budget `auto` chose from earlier steps' random outcomes (spec/budget.py)."""

import pytest
import torch

import ops
from ops.tree import Tree, inv_temperature, sampling_floor
from spec.budget import MASS_SCALE, BudgetPolicy, LatencyTable, MassScorer, path_masses
from tests.conftest import gpu, requires_triton

V, L, BUDGET, SAMPLES = 8, 3, 6, 100_000
FIELDS = ("tokens", "parents", "depths", "mask", "first_child", "next_sibling", "num_nodes")
DEVICE = "cuda" if gpu() else "cpu"


def draft_and_target():
    gen = torch.Generator().manual_seed(0)
    target = torch.log_softmax(torch.randn(V, V, generator=gen) * 1.5, -1)  # bigram: row a = p(. | a)
    marginals = [target[0].exp()]
    for _ in range(L - 1):
        marginals.append(marginals[-1] @ target.exp())
    # the drafter: the target's per-depth marginals from root 0, perturbed
    draft_logits = (torch.stack(marginals).log() + torch.randn(L, V, generator=gen) * 0.5)[None].to(DEVICE)
    return draft_logits, target.to(DEVICE)


def setup(budget=BUDGET):
    draft_logits, target = draft_and_target()
    lp, tokens = ops.draft_topk(draft_logits, min(budget, V))
    trees = ops.build_tree(lp.expand(V, L, -1).contiguous(), tokens.expand(V, L, -1).contiguous(),
                           torch.arange(V, device=DEVICE), budget)  # one per root
    return trees, target


def pick(trees, roots):
    return Tree(*(getattr(trees, f)[roots] for f in FIELDS), max_depth=trees.max_depth)


def step(trees, target, roots, temperature, top_p, seeds, index):
    """One acceptance step from each root; returns (first emitted token, second emitted or -1, path_len)."""
    tree = pick(trees, roots)
    path, path_len, next_token = ops.accept(tree, target[tree.tokens], temperature, top_p=top_p, seeds=seeds,
                                            step=index)
    node_tok = tree.tokens.gather(1, path.clamp(min=0).long())  # [S, L+1]
    first = torch.where(path_len >= 2, node_tok[:, 1], next_token)
    second = torch.where(path_len >= 3, node_tok[:, 2], torch.where(path_len == 2, next_token, -1))
    return first, second


def target_probs(target, temperature, top_p):
    logits = target[None]  # [1, V, V]
    x = logits * inv_temperature(temperature)
    if top_p < 1:
        x = x.masked_fill(x < sampling_floor(logits, temperature, top_p, 0)[..., None], float("-inf"))
    return x.softmax(-1)[0].double()  # [V, V]


def chi_square_p(observed, probs):
    keep = probs > 0
    assert observed[~keep].sum() == 0
    expected = probs[keep] * observed.sum()
    stat = ((observed[keep].double() - expected) ** 2 / expected).sum()
    return torch.special.gammaincc(torch.tensor((keep.sum().item() - 1) / 2.0), stat / 2).item()


@pytest.mark.parametrize("temperature,top_p", [(0.7, 1.0), (1.0, 1.0), (1.0, 0.8)])
def test_emitted_tokens_follow_the_target(temperature, top_p):
    trees, target = setup()
    seeds = torch.arange(SAMPLES, dtype=torch.int64, device=DEVICE) * 7 + 1
    roots = torch.zeros(SAMPLES, dtype=torch.long, device=DEVICE)
    first, second = step(trees, target, roots, temperature, top_p, seeds, 0)
    # where only the bonus token came out, the second token is the next step's first, from the new root
    first2, _ = step(trees, target, first, temperature, top_p, seeds, 1)
    second = torch.where(second >= 0, second, first2)
    p = target_probs(target, temperature, top_p).cpu()
    p_first = p[0]
    p_second = p_first @ p
    assert chi_square_p(torch.bincount(first, minlength=V).cpu(), p_first) > 0.01
    assert chi_square_p(torch.bincount(second, minlength=V).cpu(), p_second) > 0.01


def test_draft_accepts_more_than_one_token():
    """The draft is good enough that the walk goes past the root often: the test above exercises the tree."""
    trees, target = setup()
    tree = pick(trees, torch.zeros(1000, dtype=torch.long, device=DEVICE))
    _, path_len, _ = ops.accept(tree, target[tree.tokens], 1.0, seeds=torch.arange(1000, device=DEVICE), step=0)
    assert (path_len >= 2).float().mean() > 0.3 and (path_len >= 3).any()


@requires_triton
def test_triton_agrees_on_the_chi_square_setup():
    trees, target = setup()
    tree = pick(trees, torch.zeros(48, dtype=torch.long, device=DEVICE))
    args = (tree, target[tree.tokens], 0.7)
    kwargs = dict(seeds=torch.arange(48, device=DEVICE) * 7 + 1, step=0)
    ref = ops.accept(*args, **kwargs)
    with ops.using(accept="triton"):
        out = ops.accept(*args, **kwargs)
    assert all(torch.equal(x, y) for x, y in zip(out, ref))


AUTO_CANDIDATES = (1, 3, BUDGET)


def auto_budgets():
    """`auto`'s budgets for steps 2 and 3 (spec/engine.py's order: a step's read gives the next budget from
    that step's gains, scored with the factors learnt before it; refresh 1: each step is learnt from at once):
    step 2's, the same for every sample, and step 3's for each number of nodes step 1 accepted."""
    table = LatencyTable({0: {1: 1.0, 3: 1.3, BUDGET: 1.6}})
    lp, _ = ops.draft_topk(draft_and_target()[0].cpu(), BUDGET)
    masses = path_masses(lp, AUTO_CANDIDATES)[0]  # the same draft at every root: [nb, L]

    def budgets_after(step1_accepted):
        scorer = MassScorer(AUTO_CANDIDATES, L, "cpu")
        policy = BudgetPolicy(AUTO_CANDIDATES, L, table, scorer=scorer, refresh=1, prior=0.1, start=BUDGET,
                              smooth=0.0)  # no averaging: each choice follows the step before it
        picked = []
        for accepted in (step1_accepted, 0):  # step 2's outcome would matter from step 4 on
            gains = (scorer.gains(masses) * MASS_SCALE).round().long().tolist()
            own = (masses[AUTO_CANDIDATES.index(policy.budget)] * MASS_SCALE).round().long().tolist()
            picked.append(policy.update(gains, own, [accepted]))
        return picked

    runs = {accepted: budgets_after(accepted) for accepted in range(L + 1)}
    second = {run[0] for run in runs.values()}
    assert len(second) == 1
    return second.pop(), {accepted: run[1] for accepted, run in runs.items()}


@pytest.mark.parametrize("temperature,top_p", [(0.7, 1.0), (1.0, 0.8)])
def test_budgets_auto_picked_from_earlier_steps_keep_the_target_distribution(temperature, top_p):
    """Three steps a sample at `auto`'s budgets, step 3's depending on the sample's own step-1 acceptance:
    given its root, step 3's first emitted token follows the target."""
    trees = {b: setup(b)[0] for b in AUTO_CANDIDATES}
    target = setup()[1]
    second, third = auto_budgets()
    assert len(set(third.values())) > 1, third  # the choice does depend on the past
    seeds = torch.arange(SAMPLES, dtype=torch.int64, device=DEVICE) * 7 + 1
    roots = torch.zeros(SAMPLES, dtype=torch.long, device=DEVICE)
    _, path_len, roots = accept_step(trees[BUDGET], target, roots, temperature, top_p, seeds, 0)
    budgets = torch.tensor([third[n] for n in (path_len - 1).tolist()], device=DEVICE)
    _, _, roots = accept_step(trees[second], target, roots, temperature, top_p, seeds, 1)
    first = torch.empty_like(roots)
    for b in set(budgets.tolist()):
        rows = (budgets == b).nonzero()[:, 0]
        first[rows] = accept_step(trees[b], target, roots[rows], temperature, top_p, seeds[rows], 2)[0]
    p = target_probs(target, temperature, top_p).cpu()
    first, roots = first.cpu(), roots.cpu()
    stat, dof = 0.0, 0
    for r in range(V):
        here = roots == r
        if here.sum() < 2000:
            continue
        observed, keep = torch.bincount(first[here], minlength=V), p[r] > 0
        assert observed[~keep].sum() == 0
        expected = p[r][keep] * here.sum()
        stat += ((observed[keep].double() - expected) ** 2 / expected).sum().item()
        dof += int(keep.sum()) - 1
    assert dof >= 2 * (V - 1)  # at least two roots seen often enough
    assert torch.special.gammaincc(torch.tensor(dof / 2.0), torch.tensor(stat / 2)).item() > 0.01


def accept_step(trees, target, roots, temperature, top_p, seeds, index):
    """One step from each root: (first emitted token, path_len, the next root: the step's last token)."""
    tree = pick(trees, roots)
    path, path_len, next_token = ops.accept(tree, target[tree.tokens], temperature, top_p=top_p, seeds=seeds,
                                            step=index)
    node_tok = tree.tokens.gather(1, path.clamp(min=0).long())
    return torch.where(path_len >= 2, node_tok[:, 1], next_token), path_len, next_token
