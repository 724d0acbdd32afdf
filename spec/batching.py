"""Continuous batching over an `Engine`: a fixed set of cache slots; sequences join and leave between steps.

Each slot owns one row of the target's latent cache and of the drafter's context cache. `admit` prefills a
prompt into the lowest free slot and samples its first token; `step` runs one DDTree step (or one target-only
token) for rows 0..B-1, where B is the highest busy slot + 1 (on a CUDA device rounded up to 1, 2, 4, ... or
max_batch); `release` frees a slot. Free rows inside B ride along as padding: length 0, drafted and
verified, nothing committed or emitted. A sequence that finishes (stop token or max tokens; admission keeps
prompt + max tokens within the slot) is released inside the step that finished it.

Sampling is keyed per sequence: its own seed and its own step counter (0 for the token after prefill, then
1, 2, ... for each step it takes part in), which is what `Engine.generate` gives a sequence run alone with
that seed, so a sequence's tokens do not depend on what else shares the batch (given kernels whose rows do
not depend on the batch's size: true of the CPU references, checked by tests/test_serve.py). Rows whose
sampling parameters differ are accepted in one `ops.accept` call per distinct (temperature, top_p, top_k).

On a CUDA device the verify pass replays a graph per (batch, tree) bucket: batch sizes 1, 2, 4, ... up to
max_batch, and the tree bucket of the engine's budget (`Engine.graph_bucket`), all over the one cache; the
drafter's pass + tree build likewise per batch size (`DraftGraphs`). Prefill runs eagerly.
"""

from dataclasses import dataclass

import torch

import ops
from ops.tree import Tree
from spec.engine import NonFiniteLogits, SamplingParams, nonfinite_rows, root_tree
from spec.graphs import DraftGraphs, StepGraphs, draft_eligibility


@dataclass
class Sequence:
    """The state of one admitted sequence (host side)."""

    prompt_len: int
    max_new: int
    sampling: SamplingParams
    stop_ids: frozenset
    generated: int = 0
    finish_reason: str | None = None

    @property
    def sampling_key(self):
        s = self.sampling
        return (s.temperature, s.top_p, s.top_k)


@dataclass
class Emitted:
    """What one slot produced at an admit or a step: new tokens, and why it finished (None: still running)."""

    slot: int
    tokens: list
    finish_reason: str | None
    accept_length: int | None  # tokens committed by this step's verify (None for the token after prefill)


def batch_sizes(max_batch):
    """Powers of two below max_batch, then max_batch: the batch buckets graphs are captured for."""
    sizes, b = [], 1
    while b < max_batch:
        sizes.append(b)
        b *= 2
    return tuple(sizes + [max_batch])


class SlotBatch:
    """max_batch slots of max_len tokens each (prompt + output) over `engine`'s target (and drafter if spec)."""

    def __init__(self, engine, max_batch, max_len, spec=True):
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        if not 2 <= max_len <= engine.context_len:
            raise ValueError(f"a slot's context must be in 2..{engine.context_len} tokens, got {max_len}")
        if spec and engine.drafter is None:
            raise ValueError("speculative decoding needs a drafter")
        self.e, self.max_batch, self.max_len, self.spec = engine, max_batch, max_len, spec
        self.device = dev = engine.device
        target = engine.target
        self.hidden_layers = tuple(engine.drafter.target_layer_ids) if spec else ()
        bucket = engine.graph_bucket(spec)
        nodes = (engine.budget if bucket is None else bucket) if spec else 0
        if spec:
            L, block = engine.drafter.cfg.draft_len, engine.drafter.cfg.block_size
            # room as in Engine.generate: a live row holds at most max_len - 2 entries before a step
            self.cache = target.new_cache(max_batch, max_len + L + nodes)
            self.dcache = engine.drafter.new_cache(max_batch, max_len + L + max(L + 1, block))
        else:
            self.cache = target.new_cache(max_batch, max_len)
        # on a GPU a step runs a batch size of the ladder, graphs or not (padding rows cost little there, and
        # eager and graphs run the same shapes); on the CPU exactly the rows up to the highest busy slot
        self.sizes = batch_sizes(max_batch) if dev.type == "cuda" else None
        self.verify_graphs, self.draft_graphs = {}, {}
        if bucket is not None:
            self.capture(bucket)
        self.seeds = torch.zeros(max_batch, dtype=torch.int64, device=dev)
        self.steps = torch.zeros(max_batch, dtype=torch.int64, device=dev)
        self.live_dev = torch.zeros(max_batch, dtype=torch.int32, device=dev)
        self.bonus = torch.zeros(max_batch, dtype=torch.int64, device=dev)
        self.seqs = [None] * max_batch

    def capture(self, bucket):
        """Verify graphs per batch size (largest first, one memory pool); drafter graphs per batch size, each
        captured for the first context span now (longer contexts capture their span on first use)."""
        pool = None
        for b in reversed(self.sizes):
            graphs = StepGraphs(self.e.target, self.cache, b, (bucket,), self.hidden_layers, log=self.e.graph_log)
            graphs.pool = pool
            self.verify_graphs[b] = graphs.capture()
            pool = graphs.pool
        self.cache.reset()
        if self.spec and draft_eligibility(self.e.drafter)[0]:
            for b in self.sizes:
                graphs = DraftGraphs(self.e.drafter, self.dcache, b, self.e.budget, log=self.e.graph_log)
                graphs.capture(graphs.span())
                self.draft_graphs[b] = graphs

    # ---- slots ----

    @property
    def busy(self):
        return [b for b, s in enumerate(self.seqs) if s is not None]

    @property
    def free(self):
        return self.max_batch - len(self.busy)

    def fits(self, prompt_len, max_new):
        return prompt_len >= 1 and max_new >= 1 and prompt_len + max_new <= self.max_len

    def release(self, slot):
        """Free `slot` (its rows become padding of length 0)."""
        self.seqs[slot] = None
        self.live_dev[slot] = 0
        self.cache.reset([slot])
        if self.spec:
            self.dcache.lens[slot] = 0
            self.dcache.host_lens[slot] = 0

    @torch.no_grad()
    def admit(self, prompt, max_new, sampling, stop_ids=()):
        """Prefill `prompt` into the lowest free slot and sample its first token. Returns an `Emitted`."""
        if not self.fits(len(prompt), max_new):
            raise ValueError(f"a prompt of {len(prompt)} tokens + {max_new} new ones does not fit a slot of "
                             f"{self.max_len} tokens (both must be >= 1)")
        vocab = self.e.target.cfg.vocab_size
        bad = [t for t in prompt if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt has token ids outside the vocabulary of {vocab}: {bad[:5]}")
        if not self.free:
            raise RuntimeError("no free slot")
        slot = self.seqs.index(None)
        dev, P = self.device, len(prompt)
        self.seqs[slot] = Sequence(P, max_new, sampling, frozenset(stop_ids))
        tokens = torch.tensor([prompt], dtype=torch.int64, device=dev)
        row = self.cache.row(slot)
        out = self.e.target(tokens, torch.arange(P, device=dev)[None], row,
                            logit_rows=torch.full((1, 1), P - 1, device=dev), hidden_layers=self.hidden_layers)
        row.advance([P])
        self.cache.host_lens[slot] = P
        if self.spec:
            self.e.drafter.append_context(self.dcache.row(slot), out.hidden,
                                          torch.tensor([P], dtype=torch.int32, device=dev), [P])
            self.dcache.host_lens[slot] = P
        self.seeds[slot] = sampling.seed
        self.steps[slot] = 0
        self.live_dev[slot] = 1
        s = sampling
        _, _, first = ops.accept(root_tree(self.bonus[slot : slot + 1]), out.logits, s.temperature, s.top_p,
                                 s.top_k, self.seeds[slot : slot + 1], self.steps[slot : slot + 1])
        self.bonus[slot : slot + 1] = first
        return self.emit(slot, first.tolist(), None)

    # ---- one step ----

    def run_size(self):
        """Rows the next step runs: the highest busy slot + 1, rounded up to the ladder on a GPU."""
        hi = max(self.busy) + 1
        return min(b for b in self.sizes if b >= hi) if self.sizes else hi

    @torch.no_grad()
    def step(self):
        """One step for every busy slot. Returns an `Emitted` per busy slot (finished ones released)."""
        if not self.busy:
            return []
        B = self.run_size()
        self.steps[:B] += self.live_dev[:B].long()
        host = self.spec_step(B) if self.spec else self.plain_step(B)
        return [self.emit(b, host[b][1], host[b][0]) for b in self.busy]

    def spec_step(self, B):
        """Draft, verify, accept, compact; returns per row (tokens committed, tokens emitted)."""
        e, cache, dcache = self.e, self.cache, self.dcache
        bonus = self.bonus[:B]
        tree = self.draft_graphs[B].tree(bonus) if B in self.draft_graphs else self.draft_tree(bonus)
        positions = cache.lens[:B, None].long() + tree.depths.long()
        out = self.verify(B)(tree.tokens, positions, tree.mask)
        path, path_len, nxt = self.sample(tree, out.logits, B)
        hidden_path = ops.compact(cache.kv, cache.lens[:B], path, path_len, out.hidden)
        commit = path_len.to(torch.int32) * self.live_dev[:B]
        cache.lens[:B] += commit
        e.drafter.append_context(dcache, hidden_path, commit)
        self.bonus[:B] = nxt
        path_tokens = tree.tokens.gather(1, path.long().clamp(min=0))  # [B, L+1], root first
        rows = torch.cat([commit[:, None].long(), path_tokens, nxt[:, None], nonfinite_rows(out.logits)[:, None]],
                         1).tolist()  # the step's one read
        self.check_finite([row.pop() for row in rows])
        counts = [row[0] for row in rows]
        cache.set_host_lens([n + c for n, c in zip(cache.host_lens, counts)] + cache.host_lens[B:])
        dcache.set_host_lens([n + c for n, c in zip(dcache.host_lens, counts)] + dcache.host_lens[B:])
        return [(row[0], row[2 : 1 + row[0]] + [row[-1]]) for row in rows]

    def plain_step(self, B):
        cache = self.cache
        bonus = self.bonus[:B]
        out = self.verify(B)(bonus[:, None], cache.lens[:B, None].long(), None)
        _, _, nxt = self.sample(root_tree(bonus), out.logits, B)
        cache.lens[:B] += self.live_dev[:B]
        self.bonus[:B] = nxt
        tokens, flags = torch.stack([nxt, nonfinite_rows(out.logits)]).tolist()  # the step's one read
        self.check_finite(flags)
        live = [int(s is not None) for s in self.seqs[:B]]
        cache.set_host_lens([n + c for n, c in zip(cache.host_lens, live)] + cache.host_lens[B:])
        return [(1, [t]) for t in tokens]

    def check_finite(self, flags):
        """NonFiniteLogits if a busy slot's flag (from `nonfinite_rows`) is set: its requests fail, the server stays."""
        bad = [b for b in self.busy if b < len(flags) and flags[b]]
        if bad:
            raise NonFiniteLogits(f"the target's logits are NaN or inf (slot {bad[0]}): its weights or activations "
                                  "are not finite")

    def verify(self, B):
        if B in self.verify_graphs:
            return self.verify_graphs[B].verify
        return lambda tokens, positions, mask: self.e.target(tokens, positions, self.cache, tree_mask=mask,
                                                             hidden_layers=self.hidden_layers)

    def draft_tree(self, bonus):
        """The drafter's pass, its per-depth top-k and the best-first build (eager)."""
        logits = self.e.drafter.draft(self.dcache, bonus)  # [B, L, V]
        logprobs, tokens = ops.draft_topk(logits, min(self.e.budget, logits.shape[-1]))
        return ops.build_tree(logprobs, tokens, bonus, self.e.budget)

    def sample(self, tree, logits, B):
        """ops.accept per group of rows with the same sampling parameters (free rows join the first group)."""
        keys = [s.sampling_key if s is not None else None for s in self.seqs[:B]]
        groups = {}
        for b, key in enumerate(keys):
            groups.setdefault(key, []).append(b)
        free = groups.pop(None, [])
        if not groups:
            groups[(0.0, 1.0, 0)] = []
        first = next(iter(groups))
        groups[first] += free
        seeds, steps = self.seeds[:B], self.steps[:B]
        if len(groups) == 1:
            return ops.accept(tree, logits, *first, seeds, steps)
        path = torch.empty(B, tree.max_depth + 1, dtype=torch.int32, device=logits.device)
        path_len = torch.empty(B, dtype=torch.int32, device=logits.device)
        nxt = torch.empty(B, dtype=torch.int64, device=logits.device)
        for key, rows in groups.items():
            idx = torch.tensor(sorted(rows), device=logits.device)
            sub = Tree(**{name: t.index_select(0, idx) for name, t in vars(tree).items() if torch.is_tensor(t)},
                       max_depth=tree.max_depth)
            p, n, t = ops.accept(sub, logits.index_select(0, idx), *key, seeds[idx], steps[idx])
            path[idx], path_len[idx], nxt[idx] = p, n, t
        return path, path_len, nxt

    def emit(self, slot, tokens, accept_length):
        """Cut `tokens` at the slot's stop token or max_new; release the slot when it finishes."""
        seq = self.seqs[slot]
        new = []
        for token in tokens[: seq.max_new - seq.generated]:
            new.append(token)
            if token in seq.stop_ids:
                seq.finish_reason = "stop"
                break
        seq.generated += len(new)
        if seq.finish_reason is None and seq.generated >= seq.max_new:
            seq.finish_reason = "length"
        reason = seq.finish_reason
        if reason is not None:
            self.release(slot)
        return Emitted(slot, new, reason, accept_length)

