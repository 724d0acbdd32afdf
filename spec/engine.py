"""The DDTree engine: prefill, then per step for the whole batch: draft, tree build, verify, accept, compact, emit.

Each sequence of a batch owns one row of the target's latent cache and of the drafter's context cache, its
own tree and its own length. A step reads the device once (tokens emitted and how many, and whether the
target's logits were finite); everything else stays on the device. A sequence that finishes (stop token, max
tokens, context end) stays in the batch as padding until all have finished: its rows are still drafted and
verified but its lengths no longer advance and nothing more is emitted for it.

Sampling goes through `ops.accept` everywhere (also for the first token after prefill and for target-only
decoding, as a tree of one node), so a run is a deterministic function of (seed, step, node).
"""

import math
import numbers
import sys
import time
from dataclasses import dataclass, field

import torch

import ops
from model.generate import count, token_prompts
from model.tokenizer import token_id
from ops.tree import Tree
from spec.budget import AUTO_BUDGETS, BudgetPolicy, LatencyTable, MassScorer, TreeDraft, measure_steps
from spec.graphs import DEFAULT_BUCKETS, DraftGraphs, StepGraphs, bucket_for, draft_eligibility, eligibility

MAX_BUDGET = 512
KEPT_GRANULE = 1024  # cache lengths the engine keeps are multiples of this (DraftGraphs' context span)
TREES = ("ddtree", "chain")


class SamplingError(ValueError):
    """A sampling value out of range: `field problem`; `field` names the SamplingParams field."""

    def __init__(self, field, problem):
        self.field, self.problem = field, problem
        super().__init__(f"{field} {problem}")


class NonFiniteLogits(RuntimeError):
    """The target produced NaN or inf logits (its weights or activations are not finite)."""


SEED_LIMIT = 2**63  # seeds are int64 on the device: each sequence's seed + b must stay below this
# The smallest temperature that samples: below it logits / T overflows fp32 or T rounds to 0 there (1e-320
# sampled noise); 0 is greedy.
MIN_TEMPERATURE = 1e-5


@dataclass
class SamplingParams:
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0

    def __post_init__(self):
        self.check()

    def check(self):
        """SamplingError (a ValueError) for a value out of range, of the wrong type, or not finite."""
        for name in ("temperature", "top_p"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
                raise SamplingError(name, f"must be a finite number, got {value!r}")
        for name in ("top_k", "seed"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Integral):
                raise SamplingError(name, f"must be an integer, got {value!r}")
        if self.temperature < 0 or 0 < self.temperature < MIN_TEMPERATURE:
            raise SamplingError("temperature", f"must be 0 (greedy) or at least {MIN_TEMPERATURE:g}, got "
                                f"{self.temperature}")
        if not 0 < self.top_p <= 1:
            raise SamplingError("top_p", f"must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise SamplingError("top_k", f"must be >= 0, got {self.top_k}")
        if not 0 <= self.seed < SEED_LIMIT:
            raise SamplingError("seed", f"must be in 0..{SEED_LIMIT - 1}, got {self.seed}")


@dataclass
class GenerationResult:
    output_ids: list  # per sequence: the generated tokens (a stop token that ended it included)
    accept_lengths: list  # per sequence: tokens committed per verify step (root counted; 1 per step without spec)
    finish_reasons: list  # per sequence: "stop", "length" (max new tokens) or "context"
    steps: int  # decode steps run for the batch
    prefill_s: float
    decode_s: float
    budgets: list = field(default_factory=list)  # per step: the tree budget verified (0: target only)

    @property
    def tokens(self):
        return sum(len(ids) for ids in self.output_ids)

    @property
    def mean_accept_length(self):
        flat = [n for lengths in self.accept_lengths for n in lengths]
        return sum(flat) / len(flat) if flat else 0.0

    @property
    def tokens_per_s(self):
        total = self.prefill_s + self.decode_s
        return self.tokens / total if total > 0 else 0.0


def root_tree(tokens):
    """A tree of one node per sequence (the root): sampling the next token with `ops.accept`."""
    B, dev = tokens.shape[0], tokens.device
    none = torch.full((B, 1), -1, dtype=torch.int32, device=dev)
    return Tree(tokens=tokens[:, None].long(), parents=none, depths=torch.zeros(B, 1, dtype=torch.int32, device=dev),
                mask=torch.ones(B, 1, 1, dtype=torch.int32, device=dev), first_child=none, next_sibling=none.clone(),
                num_nodes=torch.ones(B, dtype=torch.int32, device=dev), max_depth=0)


class Engine:
    """Speculative (DDTree) or target-only decoding of batches of token prompts with a KimiModel target.

    budget: "auto" (each step's tree budget chosen among `auto_budgets`, those of `latency` if given, each with
    its graph bucket; spec/budget.py) or a fixed 1..MAX_BUDGET. tree: "ddtree" (best-first) or "chain" (DFlash's
    per-depth argmax, L nodes; any budget ignored). latency: auto's step-time table (a LatencyTable or its file);
    None times whole steps once per batch size, before the first run's prefill.
    """

    def __init__(self, target, drafter=None, budget="auto", cuda_graphs=True, buckets=DEFAULT_BUCKETS, tree="ddtree",
                 latency=None, auto_budgets=AUTO_BUDGETS):
        if tree not in TREES:
            raise ValueError(f"tree must be one of {', '.join(TREES)}, got {tree!r}")
        self.latency = LatencyTable.load(latency) if isinstance(latency, str) else latency
        self.auto = budget == "auto" and tree == "ddtree"
        self.candidates = tuple(b for b in sorted(set(auto_budgets)) if 0 < b <= MAX_BUDGET and
                                (self.latency is None or b in self.latency.budgets)) if self.auto else ()
        if self.auto and not self.candidates:
            raise ValueError(f"tree budget auto needs a budget in 1..{MAX_BUDGET} to choose, got "
                             f"{tuple(auto_budgets)}" + (f" and latency table {self.latency.source}"
                                                         if self.latency else ""))
        buckets = tuple(sorted({*buckets, *self.candidates}))
        if budget != "auto" and (isinstance(budget, bool) or not isinstance(budget, int) or
                                 not 1 <= budget <= MAX_BUDGET):
            raise ValueError(f"tree budget must be 'auto' or in 1..{MAX_BUDGET}, got {budget!r}")
        if tree == "chain":
            budget = drafter.cfg.draft_len if drafter is not None else 1
            buckets = tuple(sorted({*buckets, budget}))  # the chain's verify has its own bucket
        self.target, self.drafter, self.tree = target, drafter, tree
        self.budget = max(self.candidates) if self.auto else budget  # the most nodes a step verifies
        self.device = target.device
        self.cuda_graphs, self.buckets = cuda_graphs, tuple(buckets)
        self.latencies = {}  # batch size -> the LatencyTable measured for it
        self.graphs = None  # the last StepGraphs (its cache and captured verify), reused by the next run that fits
        self.drafts = None  # the last Drafts (drafter cache, scorer, captured draft graphs), likewise
        self.graph_notice = False

    def graph_bucket(self, spec):
        """The bucket this engine's verify replays in, or None: graphs off, no CUDA, an op that syncs, or a
        budget past the buckets (then eager, with a one-line notice on a CUDA device). Auto replays every
        candidate; this is the largest."""
        if not self.cuda_graphs or self.device.type != "cuda":
            return None
        ok, why = eligibility(self.target)
        bucket = bucket_for(self.budget if spec else 0, self.buckets) if ok else None
        if bucket is None and not self.graph_notice:
            why = why or f"tree budget {self.budget} is past the largest bucket {max(self.buckets)}"
            print(f"cuda graphs off: {why}; running eagerly", file=sys.stderr)
            self.graph_notice = True
        return bucket

    def step_graphs(self, batch, cache_len, hidden_layers, buckets):
        """A StepGraphs with its own cache of batch x >= cache_len entries (emptied), captured for `buckets`."""
        graphs = self.kept("graphs", (batch, tuple(hidden_layers), tuple(buckets)), cache_len, lambda: StepGraphs(
            self.target, self.target.new_cache(batch, cache_len), batch, buckets, hidden_layers,
            log=self.graph_log).capture())
        graphs.cache.reset()
        return graphs

    def step_drafts(self, batch, cache_len, graphed):
        """The Drafts of a run (emptied, auto's factors back to 1)."""
        drafts = self.kept("drafts", (batch, graphed), cache_len, lambda: Drafts(self, batch, cache_len, graphed))
        drafts.reset()
        return drafts

    def kept(self, name, key, cache_len, build):
        """What the engine keeps in attribute `name` (its graphs, its drafts) while it was built for `key` and its
        cache holds cache_len entries, so that a later run replays its graphs instead of capturing them again;
        else the one `build()` makes (the old one dropped first, freeing its memory)."""
        held = getattr(self, name)
        if held is None or held.key != key or held.cache.max_len < cache_len:
            setattr(self, name, None)
            held = build()
            held.key = key
            setattr(self, name, held)
        return held

    def kept_len(self, tokens, room):
        """The length of a cache the engine keeps for later runs, for sequences of up to `tokens` and a step's
        `room` past them: rounded up to KEPT_GRANULE entries, at most what the whole context needs, so that runs
        of similar lengths share one cache and its graphs."""
        return min(-(-(tokens + room) // KEPT_GRANULE) * KEPT_GRANULE, self.context_len + room)

    def latency_for(self, batch, step):
        """Auto's LatencyTable: the one given, else `step(budget)` (a whole step, nothing committed) timed once
        per batch size, averaged over tensor-parallel ranks so that they all choose alike."""
        if self.latency is not None:
            return self.latency
        if batch not in self.latencies:
            table = measure_steps(step, self.candidates, self.device)
            self.latencies[batch] = table.mean_over(self.target.par, self.device)
        return self.latencies[batch]

    @staticmethod
    def graph_log(line):
        print(line, file=sys.stderr)

    @property
    def context_len(self):
        return self.target.cfg.max_position_embeddings

    def check_prompts(self, prompts):
        """The prompts as lists of ints (see `token_prompts`), each leaving room for one new token in the context;
        TypeError or ValueError naming the prompt otherwise."""
        prompts = token_prompts(prompts, self.target.cfg.vocab_size)
        for i, p in enumerate(prompts):
            if len(p) >= self.context_len:
                raise ValueError(f"prompt {i} has {len(p)} tokens; the context holds {self.context_len} "
                                 "(a prompt must leave room for at least one new token)")
        return prompts

    @torch.no_grad()
    def generate(self, prompts, max_new_tokens, sampling=None, stop_ids=(), spec=True, on_tokens=None):
        """Generate for a batch of token-id prompts. on_tokens(b, new_ids) is called as tokens are emitted.

        Bad arguments raise TypeError or ValueError before anything runs; NaN or inf logits from the target raise
        NonFiniteLogits at the step that produced them."""
        sampling = SamplingParams() if sampling is None else sampling
        if not isinstance(sampling, SamplingParams):
            raise TypeError(f"sampling must be a SamplingParams, got {type(sampling).__name__}")
        sampling.check()  # again: its fields may have been set after it was made
        if not isinstance(spec, bool):
            raise TypeError(f"spec must be True or False, got {spec!r}")
        if spec and self.drafter is None:
            raise ValueError("speculative decoding needs a drafter")
        if on_tokens is not None and not callable(on_tokens):
            raise TypeError(f"on_tokens must be callable, got {type(on_tokens).__name__}")
        max_new_tokens = count(max_new_tokens, "max_new_tokens", 1)
        stop_ids = {token_id(t) for t in stop_ids}
        prompts = self.check_prompts(prompts)
        if sampling.seed + len(prompts) > SEED_LIMIT:
            raise SamplingError("seed", f"{sampling.seed} + {len(prompts) - 1} (one seed per sequence) passes "
                                f"{SEED_LIMIT - 1}")
        run = _Run(self, prompts, max_new_tokens, sampling, stop_ids, spec, on_tokens)
        return run.execute()


class Drafts:
    """A run's drafting state, kept by the engine for the next run that fits: the drafter's context cache,
    auto's MassScorer (or None) and per budget a step may verify, bonus -> its tree (the drafter's pass and
    `TreeDraft`): one replay of a DraftGraphs when `graphed` and the drafter capturable, eager otherwise."""

    def __init__(self, engine, batch, cache_len, graphed):
        e = engine
        self.key = None  # what the engine built it for (Engine.kept)
        self.cache = e.drafter.new_cache(batch, cache_len)
        self.scorer = MassScorer(e.candidates, e.drafter.cfg.draft_len, e.device) if e.auto else None
        if e.auto:
            drafts = {b: TreeDraft("ddtree", b, scorer=self.scorer) for b in e.candidates}
        else:
            drafts = {e.budget: TreeDraft(e.tree, e.budget)}
        if graphed and draft_eligibility(e.drafter)[0]:
            self.trees = {b: DraftGraphs(e.drafter, self.cache, batch, b, log=e.graph_log, make_tree=draft).tree
                          for b, draft in drafts.items()}
        else:
            self.trees = {b: lambda bonus, draft=draft: draft(e.drafter.draft(self.cache, bonus), bonus)
                          for b, draft in drafts.items()}

    def reset(self):
        """Empty the cache and set auto's per-depth factors back to 1 (what a new policy assumes)."""
        self.cache.lens.zero_()
        self.cache.set_host_lens([0] * len(self.cache.host_lens))
        if self.scorer is not None:
            self.scorer.set_bias([1.0] * self.scorer.depth)


def nonfinite_rows(logits):
    """[B] int64 on the device: 1 where logits [B, ..., V] hold NaN or +inf (or a row all -inf), else 0.
    Read with the step's tokens, so detecting costs a reduction, not a host sync."""
    return (~logits.amax(-1).isfinite()).flatten(1).any(1).long()


class _Run:
    """The state of one generate call: caches, per-sequence outputs, liveness."""

    def __init__(self, engine, prompts, max_new, sampling, stop_ids, spec, on_tokens):
        self.e, self.prompts, self.max_new, self.sampling = engine, prompts, max_new, sampling
        self.stop_ids, self.spec, self.on_tokens = stop_ids, spec, on_tokens
        B, dev, target = len(prompts), engine.device, engine.target
        self.limits = [min(engine.context_len, len(p) + max_new) for p in prompts]  # tokens a sequence may reach
        # Room: a live row holds at most limit - 2 entries (its last token is not in the cache yet); its last
        # step may commit up to L + 1 more than it emits, and a finished row still takes each step's tree
        # (N + 1 entries) and the drafter's context rows and block after its frozen length.
        top = max(self.limits)
        self.hidden_layers = tuple(engine.drafter.target_layer_ids) if spec else ()
        bucket = engine.graph_bucket(spec)  # with graphs, a verify writes bucket + 1 entries (padding included)
        if spec:
            L, block = engine.drafter.cfg.draft_len, engine.drafter.cfg.block_size
            room = L + (engine.budget if bucket is None else bucket)
            cache_len = top + room if bucket is None else engine.kept_len(top, room)
            draft_len = engine.kept_len(top, L + max(L + 1, block))
        else:
            cache_len = top if bucket is None else engine.kept_len(top, 0)
        graphs = None
        if bucket is None:
            self.cache = target.new_cache(B, cache_len)
            self.verify = lambda tokens, positions, mask: target(tokens, positions, self.cache, tree_mask=mask,
                                                                 hidden_layers=self.hidden_layers)
        else:
            buckets = engine.candidates if spec and engine.auto else (bucket,)  # auto verifies any candidate
            graphs = engine.step_graphs(B, cache_len, self.hidden_layers, buckets)
            self.cache, self.verify = graphs.cache, graphs.verify
        self.seeds = torch.tensor([sampling.seed + b for b in range(B)], dtype=torch.int64, device=dev)
        self.policy, self.budget, self.budgets = None, engine.budget if spec else 0, []
        if spec:
            drafts = engine.step_drafts(B, draft_len, graphs is not None)
            self.dcache, self.scorer, self.drafts = drafts.cache, drafts.scorer, drafts.trees
        if spec and engine.auto:
            self.policy = BudgetPolicy(engine.candidates, engine.drafter.cfg.draft_len,
                                       engine.latency_for(B, self.dry_step), scorer=self.scorer)
            self.budget = self.policy.budget
        self.outputs = [[] for _ in range(B)]
        self.accept = [[] for _ in range(B)]
        self.reasons = [None] * B
        self.live = [True] * B
        self.live_dev = torch.ones(B, dtype=torch.int32, device=dev)

    def dry_step(self, budget):
        """One speculative step at `budget` with nothing committed (before prefill: auto's latency table)."""
        cache, B = self.cache, len(self.prompts)
        bonus = torch.zeros(B, dtype=torch.int64, device=self.e.device)
        lens = self.dcache.lens.clone()
        tree = self.drafts[budget](bonus)
        out = self.verify(tree.tokens, cache.lens[:B, None].long() + tree.depths.long(), tree.mask)
        path, path_len, _ = self.sample(tree, out.logits, 0)
        self.e.drafter.append_context(self.dcache, ops.compact(cache.kv, cache.lens[:B], path, path_len, out.hidden),
                                      path_len)
        self.dcache.lens.copy_(lens)

    def sample(self, tree, logits, step):
        s = self.sampling
        return ops.accept(tree, logits, s.temperature, s.top_p, s.top_k, self.seeds, step)

    def execute(self):
        t0 = time.perf_counter()
        bonus = self.prefill()
        t1 = time.perf_counter()
        steps = 0
        while any(self.live):
            steps += 1
            bonus = self.spec_step(bonus, steps) if self.spec else self.plain_step(bonus, steps)
        if self.e.device.type == "cuda":
            torch.cuda.synchronize(self.e.device)
        t2 = time.perf_counter()
        return GenerationResult(self.outputs, self.accept, self.reasons, steps, t1 - t0, t2 - t1, self.budgets)

    def prefill(self):
        """One sequence at a time into its cache row (and the drafter's context); sample the first tokens."""
        target, last = self.e.target, []
        for b, prompt in enumerate(self.prompts):
            P = len(prompt)
            tokens = torch.tensor([prompt], dtype=torch.int64, device=self.e.device)
            positions = torch.arange(P, device=self.e.device)[None]
            row = self.cache.row(b)
            out = target(tokens, positions, row, logit_rows=torch.full((1, 1), P - 1, device=self.e.device),
                         hidden_layers=self.hidden_layers)
            row.advance([P])
            self.cache.host_lens[b] = P
            if self.spec:
                drow = self.dcache.row(b)
                self.e.drafter.append_context(drow, out.hidden, torch.tensor([P], dtype=torch.int32,
                                                                             device=self.e.device), [P])
                self.dcache.host_lens[b] = P
            last.append(out.logits)
        bonus_holder = torch.zeros(len(self.prompts), dtype=torch.int64, device=self.e.device)
        logits = torch.cat(last)
        _, _, first = self.sample(root_tree(bonus_holder), logits, 0)
        host = torch.stack([first, nonfinite_rows(logits)], 1).tolist()
        self.check_finite([row.pop() for row in host], 0)
        for b, (token,) in enumerate(host):
            self.emit(b, [token])
        return first

    def spec_step(self, bonus, step):
        e, cache = self.e, self.cache
        B = len(self.prompts)
        budget = self.budget
        tree = self.drafts[budget](bonus)
        positions = cache.lens[:B, None].long() + tree.depths.long()
        out = self.verify(tree.tokens, positions, tree.mask)
        path, path_len, nxt = self.sample(tree, out.logits, step)
        hidden_path = ops.compact(cache.kv, cache.lens[:B], path, path_len, out.hidden)
        commit = path_len.to(torch.int32) * self.live_dev
        cache.lens[:B] += commit
        e.drafter.append_context(self.dcache, hidden_path, commit)
        path_tokens = tree.tokens.gather(1, path.long().clamp(min=0))  # [B, L+1], root first
        stats = [tree.stats] if self.policy is not None else []  # auto: its scorer's gains and masses
        host = torch.cat([commit[:, None].long(), path_tokens, nxt[:, None], *stats,
                          nonfinite_rows(out.logits)[:, None]], 1).tolist()  # the step's one read
        self.check_finite([row.pop() for row in host], step)
        counts = [row[0] for row in host]
        cache.set_host_lens([n + c for n, c in zip(cache.host_lens, counts)])
        self.dcache.set_host_lens([n + c for n, c in zip(self.dcache.host_lens, counts)])
        live, last = list(self.live), tree.max_depth + 2  # row: commit, the path's L + 1 tokens, next, stats
        for b, row in enumerate(host):
            if self.live[b]:
                self.accept[b].append(row[0])
                self.emit(b, row[2 : 1 + row[0]] + [row[last]])
        self.budgets.append(budget)
        if self.policy is not None:
            self.budget = self.policy.update_from_read(host, live, last + 1, max(self.cache.host_lens))
        return nxt

    def plain_step(self, bonus, step):
        cache, B = self.cache, len(self.prompts)
        out = self.verify(bonus[:, None], cache.lens[:B, None].long(), None)
        _, _, nxt = self.sample(root_tree(bonus), out.logits, step)
        cache.lens[:B] += self.live_dev
        host = torch.stack([nxt, nonfinite_rows(out.logits)], 1).tolist()  # the step's one read
        self.check_finite([row.pop() for row in host], step)
        host = [token for (token,) in host]
        self.budgets.append(0)
        cache.set_host_lens([n + int(alive) for n, alive in zip(cache.host_lens, self.live)])
        for b, token in enumerate(host):
            if self.live[b]:
                self.accept[b].append(1)
                self.emit(b, [token])
        return nxt

    def check_finite(self, flags, step):
        """NonFiniteLogits if a live sequence's flag (from `nonfinite_rows`) is set."""
        bad = [b for b, flag in enumerate(flags) if flag and self.live[b]]
        if bad:
            raise NonFiniteLogits(f"the target's logits are NaN or inf (sequence {bad[0]}, step {step}): its weights "
                                  "or activations are not finite")

    def emit(self, b, tokens):
        """Append tokens to sequence b up to its stop token, max tokens or context end; retire it when done."""
        out, room = self.outputs[b], self.limits[b] - len(self.prompts[b]) - len(self.outputs[b])
        new = []
        for token in tokens[:room]:
            new.append(token)
            if token in self.stop_ids:
                self.reasons[b] = "stop"
                break
        out.extend(new)
        if self.reasons[b] is None and len(self.prompts[b]) + len(out) >= self.limits[b]:
            self.reasons[b] = "length" if len(out) >= self.max_new else "context"
        if new and self.on_tokens is not None:
            self.on_tokens(b, new)
        if self.reasons[b] is not None:
            self.live[b] = False
            self.live_dev[b] = 0
