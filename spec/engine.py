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
from dataclasses import dataclass

import torch

import ops
from model.generate import count, token_prompts
from model.tokenizer import token_id
from ops.tree import Tree
from spec.graphs import DEFAULT_BUCKETS, DraftGraphs, StepGraphs, bucket_for, draft_eligibility, eligibility

MAX_BUDGET = 512


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
    """Speculative (DDTree) or target-only decoding of batches of token prompts with a KimiModel target."""

    def __init__(self, target, drafter=None, budget=32, cuda_graphs=True, buckets=DEFAULT_BUCKETS):
        if not 1 <= budget <= MAX_BUDGET:
            raise ValueError(f"tree budget must be in 1..{MAX_BUDGET}, got {budget}")
        self.target, self.drafter, self.budget = target, drafter, budget
        self.device = target.device
        self.cuda_graphs, self.buckets = cuda_graphs, tuple(buckets)
        self.graphs = None  # the last StepGraphs (its cache and captured verify), reused by the next run that fits
        self.graph_notice = False

    def graph_bucket(self, spec):
        """The bucket this engine's verify replays in, or None: graphs off, no CUDA, an op that syncs, or a
        budget past the buckets (then eager, with a one-line notice on a CUDA device)."""
        if not self.cuda_graphs or self.device.type != "cuda":
            return None
        ok, why = eligibility(self.target)
        bucket = bucket_for(self.budget if spec else 0, self.buckets) if ok else None
        if bucket is None and not self.graph_notice:
            why = why or f"tree budget {self.budget} is past the largest bucket {max(self.buckets)}"
            print(f"cuda graphs off: {why}; running eagerly", file=sys.stderr)
            self.graph_notice = True
        return bucket

    def step_graphs(self, batch, cache_len, hidden_layers, bucket):
        """A StepGraphs with its own cache of batch x cache_len (emptied), captured for `bucket`."""
        key = (batch, cache_len, tuple(hidden_layers), bucket)
        if self.graphs is None or self.graphs.key != key:
            self.graphs = None
            cache = self.target.new_cache(batch, cache_len)
            graphs = StepGraphs(self.target, cache, batch, (bucket,), hidden_layers, log=self.graph_log)
            graphs.key = key
            self.graphs = graphs.capture()
        self.graphs.cache.reset()
        return self.graphs

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
            cache_len = top + L + (engine.budget if bucket is None else bucket)
            self.dcache = engine.drafter.new_cache(B, top + L + max(L + 1, block))
        else:
            cache_len = top
        if bucket is None:
            self.cache = target.new_cache(B, cache_len)
            self.verify = lambda tokens, positions, mask: target(tokens, positions, self.cache, tree_mask=mask,
                                                                 hidden_layers=self.hidden_layers)
        else:
            graphs = engine.step_graphs(B, cache_len, self.hidden_layers, bucket)
            self.cache, self.verify = graphs.cache, graphs.verify
        if spec and bucket is not None and draft_eligibility(engine.drafter)[0]:
            self.draft_tree = DraftGraphs(engine.drafter, self.dcache, B, engine.budget, log=engine.graph_log).tree
        self.seeds = torch.tensor([sampling.seed + b for b in range(B)], dtype=torch.int64, device=dev)
        self.outputs = [[] for _ in range(B)]
        self.accept = [[] for _ in range(B)]
        self.reasons = [None] * B
        self.live = [True] * B
        self.live_dev = torch.ones(B, dtype=torch.int32, device=dev)

    def draft_tree(self, bonus):
        """The next tree: the drafter's pass, its per-depth top-k and the best-first build (eager)."""
        e = self.e
        logits = e.drafter.draft(self.dcache, bonus)  # [B, L, V]
        logprobs, tokens = ops.draft_topk(logits, min(e.budget, logits.shape[-1]))
        return ops.build_tree(logprobs, tokens, bonus, e.budget)

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
        return GenerationResult(self.outputs, self.accept, self.reasons, steps, t1 - t0, t2 - t1)

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
        tree = self.draft_tree(bonus)
        positions = cache.lens[:B, None].long() + tree.depths.long()
        out = self.verify(tree.tokens, positions, tree.mask)
        path, path_len, nxt = self.sample(tree, out.logits, step)
        hidden_path = ops.compact(cache.kv, cache.lens[:B], path, path_len, out.hidden)
        commit = path_len.to(torch.int32) * self.live_dev
        cache.lens[:B] += commit
        e.drafter.append_context(self.dcache, hidden_path, commit)
        path_tokens = tree.tokens.gather(1, path.long().clamp(min=0))  # [B, L+1], root first
        host = torch.cat([commit[:, None].long(), path_tokens, nxt[:, None], nonfinite_rows(out.logits)[:, None]],
                         1).tolist()  # the step's one read
        self.check_finite([row.pop() for row in host], step)
        counts = [row[0] for row in host]
        cache.set_host_lens([n + c for n, c in zip(cache.host_lens, counts)])
        self.dcache.set_host_lens([n + c for n, c in zip(self.dcache.host_lens, counts)])
        for b, row in enumerate(host):
            if self.live[b]:
                self.accept[b].append(row[0])
                self.emit(b, row[2 : 1 + row[0]] + [row[-1]])
        return nxt

    def plain_step(self, bonus, step):
        cache, B = self.cache, len(self.prompts)
        out = self.verify(bonus[:, None], cache.lens[:B, None].long(), None)
        _, _, nxt = self.sample(root_tree(bonus), out.logits, step)
        cache.lens[:B] += self.live_dev
        host = torch.stack([nxt, nonfinite_rows(out.logits)], 1).tolist()  # the step's one read
        self.check_finite([row.pop() for row in host], step)
        host = [token for (token,) in host]
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
