"""How big a tree each step verifies: the chain, a fixed budget, or `auto`, the cost-aware choice.

A step that verifies the best-b tree emits 1 + (accepted nodes) tokens a sequence and costs draft + verify(b).
`auto` picks, before each step, the bucket b that maximises expected tokens per second:

    (live sequences + E[accepted | b]) / (step ms of b)

E[accepted | b]: a node is accepted when the target agrees with its whole path, which under the drafter's
per-depth marginals has probability exp(cumulative log-prob); the best-first tree of b nodes holds the b most
likely paths (children are never likelier than their parents, so those b paths are prefix-closed), hence
E[accepted | b] is the sum of the b largest path probabilities, for every b at once from one top-k
(`path_masses`). That is also the prefix sum of the probabilities of a budget-max build's popped nodes: a
best-first tree cut after its first b pops is the best-b tree. The masses are kept per depth, and a per-depth
factor learnt online (reached depth d / predicted mass at d, over recent steps) corrects the drafter's
calibration. Step ms per bucket come from a `LatencyTable`: whole steps timed once per batch size before a
run's prefill (graphed where the run is), or a file.

The work is split so that the step needs no extra host synchronisation and little host time. On the device,
inside the draft pass (`MassScorer`, captured with it): the masses and, per candidate, the corrected gain
sum_d min(1, factor[d] * mass(b, d)). They travel as fixed-point integers in the step's one device read, and
the tree just verified predicts the next (one-step lag). On the host (`BudgetPolicy.update`): an argmax over
the candidates each step; every few steps the per-depth sums are folded in and the factors copied to the device.
"""

import functools
import json
import time
from dataclasses import dataclass
from pathlib import Path

import torch

import ops
from ops.tree import Tree

MASS_SCALE = 1 << 24  # masses travel to the host as int64 in units of 1/MASS_SCALE (error < 6e-8 a value)
# auto's candidates: spec.graphs' buckets and 4 (a tree below the chain's size, for drafts whose mass sits in
# their first nodes); each is a captured verify and draft graph on a GPU
AUTO_BUDGETS = (4, 8, 16, 32, 64, 128)


# ---- trees ---------------------------------------------------------------------------------------------------

def chain_tree(logprobs, tokens, root_tokens):
    """DFlash's chain: per depth the drafter's argmax, L nodes. A best-first build of budget L over the top-1
    (K = 1: each pop pushes only its first child) is exactly that chain."""
    return ops.build_tree(logprobs[..., :1].contiguous(), tokens[..., :1].contiguous(), root_tokens,
                          logprobs.shape[1])


@functools.lru_cache(maxsize=64)
def _layout(budgets, L, K, device):
    """Index tensors of `path_masses` for these shapes (made once, so that a captured pass creates none).

    Per depth d >= 1, the (prefix rank r, token rank s) pairs with (r+1)(s+1) <= n, n = the largest budget:
    the only extensions that can be among the n likeliest paths one depth deeper (each (r', s') with r' <= r,
    s' <= s is at least as likely). Then the depth of every candidate of the final top-n, the depths 0..L-1,
    and per budget the index of its last node in pop order.
    """
    n = max(budgets)
    sizes, pairs = [min(n, K)], []
    for _ in range(1, L):
        rs = [(r, s) for r in range(sizes[-1]) for s in range(min(K, n // (r + 1)))]
        pairs.append(tuple(torch.tensor(v, device=device) for v in zip(*rs)))
        sizes.append(min(n, len(rs)))
    depth_of = torch.tensor([d for d, m in enumerate(sizes) for _ in range(m)], device=device)
    kept = min(n, sum(sizes))
    last = torch.tensor([min(b, kept) - 1 for b in budgets], device=device)
    return pairs, depth_of, torch.arange(L, device=device), last


def path_masses(logprobs, budgets):
    """Per budget b and depth d, the drafter's probability that the accepted path passes a depth-d node of the
    best-b tree: the sum of exp(cumulative log-prob) over those nodes.

    logprobs: [B, L, K] fp32 per-depth top-K log-probs, descending (`ops.draft_topk`, K = min(max budget, V)).
    Returns [B, len(budgets), L] fp32; summed over depths, E[accepted nodes | b] under the drafter's marginals.
    Cumulative log-probs are fp32 sums parent + log-prob, as the tree build forms them; no host read.
    """
    B, L, K = logprobs.shape
    budgets = tuple(budgets)
    if min(budgets) < 1:
        raise ValueError(f"path_masses: budgets must be >= 1, got {budgets}")
    pairs, depth_of, depths, last = _layout(budgets, L, K, logprobs.device)
    n = max(budgets)
    level = logprobs[:, 0, : min(n, K)]  # [B, m]: the likeliest depth-1 paths, descending
    levels = [level]
    for d, (r, s) in enumerate(pairs, start=1):
        candidates = level[:, r] + logprobs[:, d, s]
        level = candidates.topk(min(n, candidates.shape[1]), dim=1).values
        levels.append(level)
    scores, idx = torch.cat(levels, 1).topk(min(n, depth_of.numel()), dim=1)  # the best-n tree, pop order
    per_depth = (depth_of[idx][..., None] == depths) * scores.exp()[..., None]  # [B, m, L]
    return per_depth.cumsum(1)[:, last]


class MassScorer:
    """The device half of `auto`: from a draft's top-k log-probs, per sequence the corrected expected accepted
    nodes of every candidate budget, and the raw masses of the tree actually built, as fixed-point int64
    [B, nb + L] (`stats`), so they join the step's one integer read.

    gain(b) = sum over depths d of min(1, bias[d] * mass(b, d)): the drafter's probability of reaching depth d
    within the best-b tree, times the per-depth factor the host learnt (`BudgetPolicy`), at most 1.
    `bias` is a device tensor read by captured graphs at replay: `set_bias` updates it in place.
    """

    def __init__(self, budgets, depth, device):
        self.budgets, self.depth = tuple(sorted(budgets)), depth
        self.bias = torch.ones(depth, dtype=torch.float32, device=device)

    def gains(self, masses):
        """[..., nb, L] masses -> [..., nb] corrected expected accepted nodes."""
        return (masses * self.bias).clamp(max=1.0).sum(-1)

    def stats(self, logprobs, budget):
        masses = path_masses(logprobs, self.budgets)  # [B, nb, L]
        own = masses[:, self.budgets.index(budget)]
        return (torch.cat([self.gains(masses), own], 1) * MASS_SCALE).round().long()

    def set_bias(self, values):
        self.bias.copy_(torch.tensor(values, dtype=torch.float32))


@dataclass
class ScoredTree(Tree):
    """A Tree with its draft's `MassScorer.stats`: [B, nb + L] int64 fixed point."""

    stats: torch.Tensor = None


class TreeDraft:
    """How a step turns the drafter's logits into its tree (a callable: (logits [B, L, V], bonus [B]) -> Tree).

    kind "ddtree": the best-first tree of `budget` nodes from the per-depth top-`top_k` (top_k >= budget; a
    larger top_k changes nothing in the tree, since a rank >= budget never pops); with a `scorer`, a ScoredTree
    carrying its stats (auto: top_k = the scorer's largest budget).
    kind "chain": the per-depth argmax (budget L).
    """

    def __init__(self, kind="ddtree", budget=None, top_k=None, scorer=None):
        if kind not in ("ddtree", "chain"):
            raise ValueError(f"tree: expected 'ddtree' or 'chain', got {kind!r}")
        if kind == "ddtree" and (budget is None or budget < 1):
            raise ValueError(f"tree budget must be >= 1, got {budget}")
        self.kind, self.budget, self.scorer = kind, budget, scorer
        self.top_k = max(top_k or 0, budget or 0, *(scorer.budgets if scorer else ()))

    def __call__(self, logits, bonus):
        if self.kind == "chain":
            lp, tok = ops.draft_topk(logits, 1)
            return ops.build_tree(lp, tok, bonus, logits.shape[1])
        lp, tok = ops.draft_topk(logits, min(self.top_k, logits.shape[-1]))
        tree = ops.build_tree(lp, tok, bonus, self.budget)
        if self.scorer is None:
            return tree
        return ScoredTree(**vars(tree), stats=self.scorer.stats(lp, self.budget))


# ---- step latency ---------------------------------------------------------------------------------------------

class LatencyTable:
    """Milliseconds of one decode step per tree budget, at one or more context lengths: linear between two
    measured contexts, the nearest one's outside them. Budget 0 is the autoregressive step."""

    def __init__(self, by_context, source=""):
        if not by_context:
            raise ValueError(f"latency table{f' {source}' if source else ''}: no entries")
        self.by_context = {int(c): {int(b): float(ms) for b, ms in row.items()} for c, row in by_context.items()}
        self.contexts = sorted(self.by_context)
        budgets = [set(row) for row in self.by_context.values()]
        if any(b != budgets[0] for b in budgets):
            raise ValueError(f"latency table{f' {source}' if source else ''}: every context needs the same budgets, "
                             f"got {[sorted(b) for b in budgets]}")
        self.budgets = tuple(sorted(budgets[0]))
        bad = [(c, b, ms) for c, row in self.by_context.items() for b, ms in row.items() if not ms > 0]
        if bad:
            raise ValueError(f"latency table{f' {source}' if source else ''}: step times must be positive: {bad[:3]}")
        self.source = source

    def ms(self, budget, context=0):
        if budget not in self.budgets:
            raise ValueError(f"latency table {self.source}: no entry for budget {budget} (has {list(self.budgets)})")
        cs = self.contexts
        if context <= cs[0] or len(cs) == 1:
            return self.by_context[cs[0]][budget]
        if context >= cs[-1]:
            return self.by_context[cs[-1]][budget]
        hi = next(i for i, c in enumerate(cs) if c >= context)
        c0, c1 = cs[hi - 1], cs[hi]
        w = (context - c0) / (c1 - c0)
        return (1 - w) * self.by_context[c0][budget] + w * self.by_context[c1][budget]

    def mean_over(self, par, device):
        """The table averaged over the tensor-parallel ranks of `par` (one all-reduce), so that every rank
        picks the same budgets; itself alone."""
        if not par.joined:
            return self
        keys = [(c, b) for c in self.contexts for b in self.budgets]
        values = torch.tensor([self.by_context[c][b] for c, b in keys], dtype=torch.float64, device=device)
        values = (par.all_reduce(values) / par.tp_size).tolist()
        table = {}
        for (c, b), ms in zip(keys, values):
            table.setdefault(c, {})[b] = ms
        return LatencyTable(table, source=f"{self.source}, mean over {par.tp_size} ranks")

    def to_json(self):
        return {"latency_ms": {str(c): {str(b): ms for b, ms in row.items()} for c, row in self.by_context.items()},
                "source": self.source}

    def save(self, path):
        Path(path).write_text(json.dumps(self.to_json(), indent=1) + "\n")

    @classmethod
    def load(cls, path):
        """From this class's json ({"latency_ms": {context: {budget: ms}}}) or a bench/bench_step.py json
        (rows of context, budget, step_ms; budget 0's ar_step_ms)."""
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, ValueError) as err:
            raise ValueError(f"latency table {path}: {err}") from None
        if isinstance(data, dict) and "latency_ms" in data:
            return cls(data["latency_ms"], source=str(path))
        if isinstance(data, dict) and isinstance(data.get("rows"), list):
            return cls(step_rows(data["rows"], path), source=str(path))
        raise ValueError(f"latency table {path}: expected a 'latency_ms' object or bench_step 'rows'")


def step_rows(rows, source):
    """{context: {budget: ms}} from bench_step rows: the graphed step (step_ms), budget 0's ar_step_ms."""
    table = {}
    for i, row in enumerate(rows):
        key = "ar_step_ms" if row.get("budget") == 0 else "step_ms"
        if key not in row or "context" not in row:
            raise ValueError(f"latency table {source}: rows[{i}] has no 'context' or {key!r}")
        table.setdefault(row["context"], {})[row["budget"]] = row[key]
    return table


def measure_steps(step, budgets, device, reps=3):
    """A LatencyTable (context 0) of `step(budget)`, a whole decode step: host clock around a synchronised
    step, the budgets interleaved, the least of `reps` rounds after one warm-up round (compiles, captures;
    the least, since whatever else runs on the machine only adds time)."""
    def timed(budget):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        step(budget)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return (time.perf_counter() - t0) * 1e3

    times = {b: [] for b in budgets}
    for round_ in range(reps + 1):
        for b in budgets:
            ms = timed(b)
            if round_:
                times[b].append(ms)
    return LatencyTable({0: {b: min(t) for b, t in times.items()}}, source="measured: whole steps")


# ---- the policy -----------------------------------------------------------------------------------------------

class BudgetPolicy:
    """The host half of `auto`: learns the per-depth factors and picks each step's budget.

    budgets: the buckets it may pick (each in `latency`); depth: L; scorer: the MassScorer whose factors it sets.
    After a step verified with `self.budget`, `update` takes what that step read back and returns the next
    step's budget: argmax over b of (1 + gain(b)) / (step ms of b), gain(b) a sequence's corrected gain averaged
    over the past steps (weight `smooth` per step). Averaged, since the choice lags one step: a step's own masses
    say little of the next step's draft, and choosing from them alone costs 4% against the best fixed budget on
    the default pair, where the average costs none (bench/results/policy_replay_cpu.md). Per step that is an
    append and a handful of float operations; the per-depth sums are folded in (and the factors copied to the
    device) after 1, 2, 4 and 8 steps, then every `refresh` steps. No clock is read: the choices are a function of
    the table and of what the steps read back, so tensor-parallel ranks agree and, given the same table, a seeded
    run repeats itself.
    decay: weight of the past per step in the per-depth sums; prior: steps' worth of "the drafter is calibrated"
    the sums start with (in the first step's masses); max_bias: cap of a factor; smooth: weight of the past per
    step in the average gains (0: the last step's alone).
    """

    def __init__(self, budgets, depth, latency, scorer=None, decay=0.97, prior=2.0, max_bias=16.0, refresh=16,
                 start=None, smooth=0.99):
        self.budgets = tuple(sorted(set(budgets)))
        if not self.budgets or self.budgets[0] < 1:
            raise ValueError(f"auto budget: candidate budgets must be >= 1, got {budgets}")
        missing = [b for b in self.budgets if b not in latency.budgets]
        if missing:
            raise ValueError(f"auto budget: latency table {latency.source} has no entry for budgets {missing}")
        if scorer is not None and scorer.budgets != self.budgets:
            raise ValueError(f"auto budget: scorer budgets {scorer.budgets} differ from {self.budgets}")
        self.depth, self.latency, self.scorer = depth, latency, scorer
        self.decay, self.prior, self.max_bias, self.refresh, self.smooth = decay, prior, max_bias, refresh, smooth
        self.gains = None  # a sequence's average corrected gain per candidate (fixed point)
        self.budget = start if start is not None else next((b for b in self.budgets if b > depth), self.budgets[-1])
        self.reached = self.predicted = None  # per depth d + 1: decayed sequences that reached it, drafter mass
        self.window, self.folded = [], 0  # (accepted, masses) of the steps since the last fold; steps folded
        self._ms, self._ms_key = None, None

    def step_ms(self, context):
        """The table's ms of every candidate at this context (recomputed once per 256 positions)."""
        key = context >> 8
        if key != self._ms_key:
            self._ms = [self.latency.ms(b, context) for b in self.budgets]
            self._ms_key = key
        return self._ms

    def update(self, gains, masses, accepted, context=0):
        """gains: [nb] fixed-point corrected gains of the tree just verified (summed over live sequences);
        masses: [L] its own fixed-point masses per depth (likewise); accepted: accepted draft nodes of each live
        sequence; context: the longest sequence's length. Returns the next budget."""
        if not accepted:
            return self.budget
        window = self.window
        window.append((accepted, masses))
        if len(window) >= self.refresh or len(window) > self.folded:  # folds after 1, 2, 4, 8, then every refresh
            self.fold()
        now = [g / len(accepted) for g in gains]
        keep = self.smooth if self.gains is not None else 0.0
        self.gains = [keep * a + (1 - keep) * g for a, g in zip(self.gains or now, now)]
        rates = [(MASS_SCALE + g) / t for g, t in zip(self.gains, self.step_ms(context))]
        self.budget = self.budgets[rates.index(max(rates))]
        return self.budget

    def update_from_read(self, rows, live, start, context=0):
        """`update` from one step's read: each row [commit, ..., gains (nb), masses (L)] from `start`, summed over
        the sequences live at the step; accepted = commit - 1 of each. Returns the next budget."""
        nb, L = len(self.budgets), self.depth
        accepted = [row[0] - 1 for row, alive in zip(rows, live) if alive]
        gains, masses = sum_rows(rows, live, start, start + nb), sum_rows(rows, live, start + nb, start + nb + L)
        return self.update(gains, masses, accepted, context)

    def fold(self):
        """Fold the window's observations into the per-depth sums (the past decayed by decay^steps) and copy
        the new factors to the device. The sums start as `prior` steps of the first step's masses, reached
        as predicted."""
        L, keep = self.depth, self.decay ** len(self.window)
        if self.reached is None:
            first = [m / MASS_SCALE * self.prior for m in self.window[0][1]]
            self.reached, self.predicted = first, list(first)
        ended = [0] * (L + 1)  # sequences by accepted nodes
        for accepted, _ in self.window:
            for a in accepted:
                ended[min(a, L)] += 1
        reached, past = [], 0
        for d in range(L, 0, -1):  # depth d was reached by the sequences that accepted >= d nodes
            past += ended[d]
            reached.append(past)
        reached = [keep * r + n for r, n in zip(self.reached, reversed(reached))]
        masses = map(sum, zip(*(m for _, m in self.window)))
        predicted = [keep * p + m / MASS_SCALE for p, m in zip(self.predicted, masses)]
        self.folded += len(self.window)
        self.reached, self.predicted, self.window = reached, predicted, []
        if self.scorer is not None:
            self.scorer.set_bias(self.bias())

    def bias(self):
        """Per depth: sequences that reached it over the drafter's mass there, capped at max_bias (1 before any
        step, and where the drafter put no mass)."""
        if self.reached is None:
            return [1.0] * self.depth
        cap = self.max_bias
        return [min(r / p, cap) if p > 0 else 1.0 for r, p in zip(self.reached, self.predicted)]


def sum_rows(rows, live, start, stop):
    """Element-wise sum of row[start:stop] over the live rows (the batch's stats)."""
    picked = [r[start:stop] for r, alive in zip(rows, live) if alive]
    return picked[0] if len(picked) == 1 else [sum(col) for col in zip(*picked)]
