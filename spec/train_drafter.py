"""`python -m spec.train_drafter`: train a DFlash drafter for a K2.6-format target.

    python -m spec.train_drafter --model-path TARGET --data PATH... --out DIR [--steps N] [--minutes M]

The objective (DFlash): the target, frozen, runs each training sequence once and returns the hidden states of
the drafter's `target_layer_ids` (computed on the fly by the target's own forward, as in decoding). At random
anchor positions s of a sequence the drafter sees those features of tokens 0..s-1 as its context and the block
[token s, MASK x (block_size-1)] at positions s..s+block_size-1, and learns to fill the block with tokens
s+1..s+block_size-1 in one pass: cross-entropy at each depth k = 1..block_size-1 weighted exp(-(k-1)/gamma).
All anchors of a sequence share its context in one attention over [context ; blocks], masked so that a block
sees the context before its anchor and itself: exactly what the decoding drafter sees after a verify step.

Data: text files (one document each) or JSONL files whose lines hold {"text": ...} or {"messages": [{"role",
"content"}, ...]} (the Kimi chat template; only assistant turns are drafted). DFlash trains on text the target
itself generated for the prompts; text written by others works, with lower acceptance. Documents are cut into
sequences of --seq-len tokens; a fixed set of sequences is held out to measure acceptance (the mean accept
length of DDTree at --eval-budget, greedy, through `spec.engine.Engine`) every --eval-every steps.

Writes DIR/config.json and DIR/model.safetensors (z-lab's format, for --draft-model-path) and DIR/train_state.pt
(the drafter in fp32, the optimizer, the step); --resume continues from it exactly as if never interrupted.
bf16 autocast on a GPU, fp32 on a CPU. Under `torchrun --nproc-per-node N` the target runs tensor-parallel as
in decoding (every rank runs each rank's share of the batch through its shard) and the drafter is data-parallel
with its parameters, gradients and optimizer state sharded by FSDP over the same ranks (each rank drafts its
share). `--memory-plan N` prints the bytes per rank of a run over N GPUs from config.json alone. Bad input ends
with one `error: ...` line and exit code 2.
"""

import gc
import json
import math
import os
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from tqdm import tqdm

from model.tokenizer import ROLE_TOKENS
from spec.decode import Parser, UsageError, add_collective_timeout
from ops.mlp import mlp_torch
from ops.norm import rms_norm_torch
from ops.rope import head_norm_rope_torch, yarn_inv_freq
from spec.drafter import DrafterConfig, check_drafter_fits, default_target_layer_ids
from spec.train_target import Weight, lr_at

STATE_FILE = "train_state.pt"
# Options a resumed run must share with the run that wrote the state (the others may change between runs).
TRAINING_KEYS = ("seq_len", "batch_size", "anchors", "lr", "warmup", "weight_decay", "decay_gamma", "clip", "seed")
# The depth decay gamma of z-lab's published drafters per block size; others get block_size / 2.
DECAY_GAMMA = {8: 4.0, 10: 5.0, 16: 7.0}


@dataclass
class TrainOptions:
    seq_len: int = 512
    batch_size: int = 16  # sequences per step, over all ranks
    anchors: int = 64  # blocks drafted per sequence
    steps: int = 1000
    minutes: float | None = None
    lr: float = 6e-4
    warmup: float = 0.04  # fraction of training
    weight_decay: float = 0.0
    decay_gamma: float | None = None  # None: DECAY_GAMMA[block_size] or block_size / 2
    clip: float = 1.0
    seed: int = 0
    eval_every: int = 200
    eval_prompts: int = 16
    eval_prompt_tokens: int = 64
    eval_tokens: int = 128
    eval_budget: int = 32
    save_every: int = 500

    def gamma(self, block_size):
        return self.decay_gamma or DECAY_GAMMA.get(block_size, block_size / 2)

    def check(self):
        for name in ("seq_len", "batch_size", "anchors", "steps", "eval_every", "eval_prompts", "eval_prompt_tokens",
                     "eval_tokens", "eval_budget", "save_every"):
            if getattr(self, name) < 1:
                raise UsageError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.minutes is not None and self.minutes <= 0:
            raise UsageError(f"--minutes must be > 0, got {self.minutes}")
        from spec.engine import MAX_BUDGET

        if self.eval_budget > MAX_BUDGET:
            raise UsageError(f"--eval-budget must be in 1..{MAX_BUDGET}, got {self.eval_budget}")
        if not self.lr > 0 or not 0 <= self.warmup < 1:
            raise UsageError(f"--lr must be > 0 and --warmup in [0, 1), got {self.lr} and {self.warmup}")


# --- data -----------------------------------------------------------------------------------------------------

@dataclass
class Sequence:
    ids: list  # token ids
    drafted: list  # bool per position: may this token be a drafted target (chat: assistant turns only)

    def __len__(self):
        return len(self.ids)

    def prompt(self, default_len):
        """The prompt for an acceptance measurement: up to the first drafted token (a chat's first assistant
        turn), else the first default_len tokens; at least one token, always leaving one to generate."""
        first = next((t for t, d in enumerate(self.drafted) if d), len(self.ids))
        end = first if 0 < first < len(self.ids) else default_len
        return self.ids[: max(1, min(end, len(self.ids) - 1))]


def chat_document(messages, tok, where):
    """Token ids of a conversation in the Kimi chat template and which of them are assistant text."""
    if not isinstance(messages, list) or not messages:
        raise UsageError(f"{where}: 'messages' must be a non-empty list")
    ids, drafted = [], []
    for m in messages:
        if not isinstance(m, dict) or m.get("role") not in ROLE_TOKENS or not isinstance(m.get("content", ""), str):
            raise UsageError(f"{where}: each message needs a role ({', '.join(ROLE_TOKENS)}) and string content")
        header = tok.apply_chat_template([{"role": m["role"], "content": ""}], add_generation_prompt=False)[:-1]
        body = tok.encode_ordinary(m.get("content") or "") + [tok.im_end_id]
        ids += header + body
        drafted += [False] * len(header) + [m["role"] == "assistant"] * len(body)
    return Sequence(ids, drafted)


def read_documents(paths, tok):
    """Documents of text files (one each) and JSONL files ({"text"} or {"messages"} per line)."""
    docs = []
    for path in map(Path, paths):
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as err:
            raise UsageError(f"--data: cannot read {path}: {err}") from None
        if path.suffix != ".jsonl":
            ids = tok.encode(text, allow_special=False)
            docs.append(Sequence(ids, [True] * len(ids)))
            continue
        for n, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            where = f"--data {path} line {n}"
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise UsageError(f"{where}: not JSON: {err}") from None
            if isinstance(record, dict) and isinstance(record.get("text"), str):
                ids = tok.encode(record["text"], allow_special=False)
                docs.append(Sequence(ids, [True] * len(ids)))
            elif isinstance(record, dict) and "messages" in record:
                docs.append(chat_document(record["messages"], tok, where))
            else:
                raise UsageError(f"{where}: want an object with a 'text' string or a 'messages' list")
    return docs


def make_sequences(docs, seq_len, block_size):
    """Cut documents into sequences of at most seq_len tokens; keep those with a block to draft (a context
    token, an anchor and a drafted token after it)."""
    out = []
    for doc in docs:
        for start in range(0, len(doc), seq_len):
            piece = Sequence(doc.ids[start : start + seq_len], doc.drafted[start : start + seq_len])
            if len(piece) >= 3 and any(piece.drafted[2:]):
                out.append(piece)
    if not out:
        raise UsageError(f"--data: no document has a drafted token after its first two tokens (block size "
                         f"{block_size}); the data is empty or too short")
    return out


def hold_out(sequences, count):
    """(training, held-out) sequences: `count` evenly spaced ones held out when there are at least twice as
    many; otherwise the first `count` serve both (the acceptance then is on training text)."""
    if len(sequences) < 2 * count:
        return sequences, sequences[:count]
    picked = {i * len(sequences) // count for i in range(count)}
    return ([s for i, s in enumerate(sequences) if i not in picked], [sequences[i] for i in sorted(picked)])


@dataclass
class Batch:
    tokens: torch.Tensor  # [G, T] int64 (padded)
    anchors: torch.Tensor  # [G, A] int64: block a of sequence g starts at anchors[g, a]
    targets: torch.Tensor  # [G, A, L] int64: the tokens to draft, -100 where none (past the end, not drafted)


def sample_batch(sequences, opts, step, block_size, pad_id):
    """The global batch of a step, a function of (seed, step) alone: sequences drawn with replacement, anchors
    without replacement among positions s >= 1 whose next token is drafted (fewer than opts.anchors: the
    rest repeat the first with no targets)."""
    gen = torch.Generator().manual_seed(opts.seed * 1_000_003 + step)
    G, T, A, L = opts.batch_size, opts.seq_len, opts.anchors, block_size - 1
    tokens = torch.full((G, T + L), pad_id, dtype=torch.int64)
    drafted = torch.zeros(G, T + L, dtype=torch.bool)
    anchors = torch.zeros(G, A, dtype=torch.int64)
    live = torch.zeros(G, A, dtype=torch.bool)
    for g, i in enumerate(torch.randint(len(sequences), (G,), generator=gen).tolist()):
        seq = sequences[i]
        tokens[g, : len(seq)] = torch.tensor(seq.ids)
        drafted[g, : len(seq)] = torch.tensor(seq.drafted)
        candidates = (drafted[g, 2 : len(seq)].nonzero()[:, 0] + 1)  # s >= 1 with token s+1 drafted
        chosen = candidates[torch.randperm(len(candidates), generator=gen)[:A]].sort().values
        anchors[g, : len(chosen)], anchors[g, len(chosen) :] = chosen, chosen[0]
        live[g, : len(chosen)] = True
    where = anchors[..., None] + 1 + torch.arange(L)  # [G, A, L]
    targets = torch.where(drafted.gather(1, where.flatten(1)).view(G, A, L) & live[..., None],
                          tokens.gather(1, where.flatten(1)).view(G, A, L), -100)
    return Batch(tokens[:, :T], anchors, targets)


# --- the drafter being trained --------------------------------------------------------------------------------

class TrainDrafterLayer(nn.Module):
    """A DrafterLayer's weights as parameters (the same names) and its forward over many blocks at once."""

    def __init__(self, cfg):
        super().__init__()
        D, H, KVH, hd = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.cfg = cfg
        self.input_layernorm = Weight(D)
        self.post_attention_layernorm = Weight(D)
        self.self_attn = nn.Module()
        for name, shape in (("q_proj", (H * hd, D)), ("k_proj", (KVH * hd, D)), ("v_proj", (KVH * hd, D)),
                            ("o_proj", (D, H * hd)), ("q_norm", (hd,)), ("k_norm", (hd,))):
            setattr(self.self_attn, name, Weight(*shape))
        self.mlp = nn.Module()
        self.mlp.gate_up = Weight(2 * cfg.intermediate_size, D)
        self.mlp.down_proj = Weight(D, cfg.intermediate_size)

    def keys_values(self, x, positions, rope):
        """x: [G, N, D] -> roped, normed keys and values [G, N, KVH, hd]."""
        cfg, attn, (G, N, _) = self.cfg, self.self_attn, x.shape
        k = F.linear(x, attn.k_proj.weight).view(G * N, cfg.num_key_value_heads, cfg.head_dim)
        k = head_norm_rope_torch(k, attn.k_norm.weight, cfg.rms_norm_eps, positions, *rope)
        v = F.linear(x, attn.v_proj.weight)
        return k.view(G, N, -1, cfg.head_dim), v.view(G, N, -1, cfg.head_dim)

    def forward(self, h, context, positions, context_positions, mask, rope):
        """h: [G, R, D] block rows; context: [G, T, D] (fc + hidden_norm of the features); positions [G*R],
        context_positions [G*T]; mask: [G, R, T + R] bool (True: may attend). Returns h after the layer."""
        cfg, attn, (G, R, _) = self.cfg, self.self_attn, h.shape
        H, hd, eps = cfg.num_attention_heads, cfg.head_dim, cfg.rms_norm_eps
        x = rms_norm_torch(h, self.input_layernorm.weight, eps)
        q = head_norm_rope_torch(F.linear(x, attn.q_proj.weight).view(G * R, H, hd), attn.q_norm.weight, eps,
                                 positions, *rope).view(G, R, H, hd)
        k_ctx, v_ctx = self.keys_values(context, context_positions, rope)
        k_blk, v_blk = self.keys_values(x, positions, rope)
        group = H // cfg.num_key_value_heads
        k = torch.cat([k_ctx, k_blk], 1).repeat_interleave(group, 2)
        v = torch.cat([v_ctx, v_blk], 1).repeat_interleave(group, 2)
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                           attn_mask=mask[:, None], scale=hd ** -0.5)
        h = h + F.linear(o.transpose(1, 2).reshape(G, R, H * hd), attn.o_proj.weight)
        x = rms_norm_torch(h, self.post_attention_layernorm.weight, eps)
        return h + mlp_torch(x, self.mlp.gate_up.weight, self.mlp.down_proj.weight)


class TrainDrafter(nn.Module):
    """The trainable twin of `spec.drafter.DFlashDrafter`: the same weights as parameters (state_dict names
    equal the drafter's), a forward that drafts every anchor's block of a batch in one pass and returns the
    DFlash loss. Built from the ops' torch references; a test checks its logits against the drafter's."""

    def __init__(self, cfg):
        super().__init__()
        D = cfg.hidden_size
        self.cfg = cfg
        self.fc = Weight(D, len(cfg.target_layer_ids) * D)
        self.hidden_norm = Weight(D)
        self.layers = nn.ModuleList(TrainDrafterLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = Weight(D)
        inv_freq, self.rope_factor = yarn_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    @torch.no_grad()
    def init_weights_(self, seed, std=0.02):
        """Normal(0, std) matrices, the projections into the residual stream scaled by 1/sqrt(2 * layers); norms 1."""
        gen = torch.Generator().manual_seed(seed)
        residual_std = std / math.sqrt(2 * self.cfg.num_hidden_layers)
        for name, p in self.named_parameters():
            if p.dim() == 1:
                p.fill_(1.0)
            else:
                scale = residual_std if name.endswith(("o_proj.weight", "down_proj.weight")) else std
                p.copy_(torch.randn(p.shape, generator=gen) * scale)
        return self

    def block_logits(self, features, tokens, anchors, embed_weight, lm_head_weight):
        """features: [G, T, n*D] (as `hf_features` gives them); tokens [G, T]; anchors [G, A]. Returns the logits
        of depths 1..L of every block, [G, A, L, V] (fp32 on a CPU, the autocast dtype on a GPU)."""
        cfg, (G, T), A, S = self.cfg, tokens.shape, anchors.shape[1], self.cfg.block_size
        dev = tokens.device
        context = rms_norm_torch(F.linear(features, self.fc.weight), self.hidden_norm.weight, cfg.rms_norm_eps)
        offsets = torch.arange(S, device=dev)
        block_pos = (anchors[..., None] + offsets).view(G, A * S)  # [G, R]
        block = torch.full((G, A, S), cfg.mask_token_id, dtype=torch.int64, device=dev)
        block[..., 0] = tokens.gather(1, anchors)
        h = F.embedding(block.view(G, A * S), embed_weight).float()
        sees_context = torch.arange(T, device=dev) < anchors.repeat_interleave(S, 1)[..., None]  # [G, R, T]
        block_id = torch.arange(A, device=dev).repeat_interleave(S)
        same_block = (block_id[:, None] == block_id[None, :]).expand(G, -1, -1)  # [G, R, R]
        mask = torch.cat([sees_context, same_block], -1)
        rope = (self.inv_freq, self.rope_factor)
        context_pos = torch.arange(T, device=dev).repeat(G)
        for layer in self.layers:
            h = layer(h, context, block_pos.reshape(-1), context_pos, mask, rope)
        h = rms_norm_torch(h, self.norm.weight, cfg.rms_norm_eps).view(G, A, S, -1)[:, :, 1:]
        return F.linear(h, lm_head_weight)

    def forward(self, features, tokens, anchors, targets, weights, embed_weight, lm_head_weight, total_weight):
        """The DFlash loss of this rank's share: sum of weights[k] * CE over drafted targets, divided by the
        global batch's total weight (times the rank count: FSDP averages gradients over ranks). Also returns
        (correct, counted) per depth [L] for the accuracy readout."""
        logits = self.block_logits(features, tokens, anchors, embed_weight, lm_head_weight).float()
        ce = F.cross_entropy(logits.flatten(0, 2), targets.flatten(), ignore_index=-100, reduction="none")
        valid = targets >= 0
        loss = (ce.view(targets.shape) * weights * valid).sum() / total_weight
        correct = ((logits.argmax(-1) == targets) & valid).sum((0, 1))
        return loss, correct, valid.sum((0, 1))

    def checkpoint_state(self):
        """Full fp32 CPU tensors under the drafter's state_dict names (gathered from FSDP shards when sharded)."""
        out = {}
        for name, p in self.named_parameters():
            full = p.full_tensor() if hasattr(p, "full_tensor") else p
            out[name] = full.detach().float().cpu()
        return out


def zlab_tensors(state):
    """z-lab names: the stacked `mlp.gate_up` split back into gate_proj and up_proj."""
    out = {}
    for name, t in state.items():
        if name.endswith("mlp.gate_up.weight"):
            stem = name[: -len("gate_up.weight")]
            out[stem + "gate_proj.weight"], out[stem + "up_proj.weight"] = t.chunk(2, dim=0)
        else:
            out[name] = t
    return out


# --- the target side ------------------------------------------------------------------------------------------

class FrozenTarget:
    """What training takes from the (tensor-parallel) target: features of a batch, the embedding, the full
    lm_head (gathered once from the vocabulary shards), and the HF form of the last layer's features."""

    def __init__(self, target, layer_ids):
        self.model, self.layer_ids = target, tuple(layer_ids)
        self.embed_weight = target.embed_tokens.weight
        self.lm_head_weight = target.lm_head.weight
        if target.par.joined:
            parts = [torch.empty_like(self.lm_head_weight) for _ in range(target.par.tp_size)]
            dist.all_gather(parts, self.lm_head_weight.contiguous(), group=target.par.group)
            self.lm_head_weight = torch.cat(parts)
        self.cache = None

    def features(self, tokens, ranks):
        """This rank's share of the features of a global batch tokens [G, T]: rows rank*G/world.. of
        `batch_features`. Every rank runs every share through its shard of the target (tensor parallelism
        needs all ranks on the same tokens) and keeps its own, so it holds one share's cache and features."""
        share = tokens.shape[0] // ranks.world
        kept = None
        for r in range(ranks.world):
            out = self.batch_features(tokens[r * share : (r + 1) * share])
            kept = out if r == ranks.rank else kept
        return kept

    @torch.no_grad()
    def batch_features(self, tokens):
        """[G, T, n*D] outputs of layer_ids for tokens [G, T] (one prefill through the inference forward); the
        last layer's part through the final norm, as HF's hidden_states list holds it (`hf_features`)."""
        model, (G, T) = self.model, tokens.shape
        if self.cache is None or self.cache.batch != G or self.cache.max_len != T:
            self.cache = model.new_cache(G, T)
        self.cache.reset()
        positions = torch.arange(T, device=tokens.device).expand(G, T)
        rows = torch.zeros(G, 1, dtype=torch.int64, device=tokens.device)
        hidden = model(tokens, positions, self.cache, logit_rows=rows, hidden_layers=self.layer_ids).hidden
        last, D = model.cfg.num_hidden_layers - 1, model.cfg.hidden_size
        if last in self.layer_ids:
            j = self.layer_ids.index(last)
            part = hidden[..., j * D : (j + 1) * D]
            hidden[..., j * D : (j + 1) * D] = rms_norm_torch(part, model.norm.weight, model.cfg.rms_norm_eps)
        return hidden


# --- acceptance -----------------------------------------------------------------------------------------------

def write_drafter(state, cfg, out, ranks):
    """Rank 0 writes the drafter (z-lab format, bf16) from full fp32 weights; every rank waits for it."""
    from spec.drafter_checkpoint import write_drafter_checkpoint

    if ranks.rank == 0:
        write_drafter_checkpoint(out, cfg, zlab_tensors(state))
    ranks.barrier()


def mean_accept_length(target, drafter_dir, prompts, new_tokens, budget, stop_ids=()):
    """Mean accept length of greedy DDTree at `budget` over prompts, with the drafter loaded from its checkpoint
    (the normal loader, sharded like the target): tokens committed per verify step, root counted."""
    from spec.drafter_checkpoint import load_drafter
    from spec.engine import Engine

    drafter = load_drafter(drafter_dir, target, dtype=target.dtype, device=target.device)
    result = Engine(target, drafter, budget, cuda_graphs=False).generate(prompts, new_tokens, stop_ids=stop_ids)
    return result.mean_accept_length


# --- training -------------------------------------------------------------------------------------------------

@dataclass
class Ranks:
    """This process's place: world (ranks), rank, the device mesh for FSDP (None alone)."""

    world: int = 1
    rank: int = 0
    mesh: object = None

    @classmethod
    def of(cls, par, device):
        if not par.joined:
            return cls()
        from torch.distributed.device_mesh import init_device_mesh

        return cls(par.tp_size, par.rank, init_device_mesh(device.type, (par.tp_size,)))

    def barrier(self):
        if self.world > 1:
            dist.barrier()


def build_trainer(cfg, seed, device, ranks):
    """The drafter in fp32, on one device or FSDP-sharded over the ranks (per layer, then the rest); on a GPU
    FSDP gathers parameters in bf16 and reduces gradients in fp32."""
    trainer = TrainDrafter(cfg).init_weights_(seed).to(device)
    if ranks.world > 1:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16 if device.type == "cuda" else None,
                                      reduce_dtype=torch.float32, cast_forward_inputs=False)
        for layer in trainer.layers:
            fully_shard(layer, mesh=ranks.mesh, mp_policy=policy)
        fully_shard(trainer, mesh=ranks.mesh, mp_policy=policy)
    return trainer


def make_optimizer(trainer, opts):
    return torch.optim.AdamW(trainer.parameters(), lr=opts.lr, betas=(0.9, 0.95), weight_decay=opts.weight_decay)


def save_state(path, trainer, optimizer, meta, ranks):
    """Full (unsharded) fp32 weights and optimizer state plus `meta`, written by rank 0."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    model_sd, optim_sd = get_state_dict(trainer, optimizer,
                                        options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if ranks.rank == 0:
        tmp = path.with_suffix(".tmp")
        torch.save({"model": model_sd, "optim": optim_sd, **meta}, tmp)
        os.replace(tmp, path)
    ranks.barrier()


def load_state(path, trainer, optimizer, meta):
    """Restore a `save_state` file; its drafter config and options must equal this run's (`meta`)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

    state = torch.load(path, map_location="cpu", weights_only=True)
    for key in ("drafter_config", "options", "data"):
        if state.get(key) != meta[key]:
            raise UsageError(f"--resume: {path} was written with another {key.replace('_', ' ')} "
                             f"({state.get(key)} != {meta[key]}); use a new --out or the same flags")
    set_state_dict(trainer, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"],
                   options=StateDictOptions(full_state_dict=True))
    return state["step"], state["elapsed"]


def train(target, sequences, prompts, cfg, opts, out, resume=False, stop_ids=(), log=print, progress=True):
    """Train a drafter of config `cfg` on `sequences` for `target` (a loaded KimiModel, this rank's shard) and
    write it to `out`, measuring acceptance on the held-out `prompts` (token lists). Returns {"step", "loss",
    "accept_length" (the last measured), "history" (loss per step)}."""
    device = target.device
    ranks = Ranks.of(target.par, device)
    if opts.batch_size % ranks.world:
        raise UsageError(f"--batch-size {opts.batch_size} does not split over {ranks.world} ranks")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    frozen = FrozenTarget(target, cfg.target_layer_ids)
    trainer = build_trainer(cfg, opts.seed, device, ranks)
    optimizer = make_optimizer(trainer, opts)
    meta = {"drafter_config": cfg.to_hf(), "options": {k: v for k, v in asdict(opts).items() if k in TRAINING_KEYS},
            "data": [len(sequences), sum(len(s) for s in sequences)]}
    step, elapsed = 0, 0.0
    if resume and (out / STATE_FILE).exists():
        step, elapsed = load_state(out / STATE_FILE, trainer, optimizer, meta)
        log(f"resumed from {out / STATE_FILE} at step {step}")
    share = opts.batch_size // ranks.world
    mine = slice(ranks.rank * share, (ranks.rank + 1) * share)
    L = cfg.block_size - 1
    depth_weights = torch.exp(-torch.arange(L, dtype=torch.float32) / opts.gamma(cfg.block_size)).to(device)
    clock = Clock(opts, elapsed, ranks)
    history, accept, loss_value = [], None, float("nan")
    bar = tqdm(total=opts.steps, initial=step, unit="step", desc="drafter", mininterval=2.0,
               disable=not progress or ranks.rank != 0)
    tokens_done, rate_start = 0, time.perf_counter()
    while (done := clock.progress(step)) < 1:
        for group in optimizer.param_groups:
            group["lr"] = lr_at(done, opts.lr, opts.warmup)
        batch = sample_batch(sequences, opts, step, cfg.block_size, pad_id=cfg.mask_token_id)
        tokens, targets = batch.tokens.to(device), batch.targets.to(device)
        weights = depth_weights.expand(targets.shape) * (targets >= 0)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            loss, correct, counted = trainer(frozen.features(tokens, ranks), tokens[mine],
                                             batch.anchors[mine].to(device), targets[mine], weights[mine],
                                             frozen.embed_weight, frozen.lm_head_weight,
                                             weights.sum() / ranks.world)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trainer.parameters(), opts.clip)
        optimizer.step()
        step += 1
        stats = torch.cat([loss.detach()[None] / ranks.world, correct.float(), counted.float()])
        if ranks.world > 1:
            dist.all_reduce(stats)
        loss_value = stats[0].item()
        history.append(loss_value)
        tokens_done += tokens.numel()
        rate = tokens_done / (time.perf_counter() - rate_start)
        bar.update()
        bar.set_postfix_str(f"loss {loss_value:.3f}, {rate:.0f} tok/s"
                            + (f", accept {accept:.2f}" if accept is not None else ""))
        last = clock.progress(step) >= 1
        if step % opts.save_every == 0 or step % opts.eval_every == 0 or last:
            write_drafter(trainer.checkpoint_state(), cfg, out, ranks)
        if step % opts.save_every == 0 or last:
            save_state(out / STATE_FILE, trainer, optimizer, {**meta, "step": step, "elapsed": clock.elapsed()},
                       ranks)
        if step % opts.eval_every == 0 or last:
            accept = mean_accept_length(target, out, prompts, opts.eval_tokens, opts.eval_budget, stop_ids)
            accuracy = (stats[1 : 1 + L] / stats[1 + L :].clamp(min=1)).tolist()
            log(f"drafter step {step}: loss {loss_value:.4f}, accuracy per depth {[round(a, 2) for a in accuracy]}, "
                f"held-out mean accept length {accept:.2f} (budget {opts.eval_budget}), {rate:.0f} tok/s")
            tokens_done, rate_start = 0, time.perf_counter()
    bar.close()
    return {"step": step, "loss": loss_value, "accept_length": accept, "history": history}


class Clock:
    """Training progress in [0, 1]: the further along of steps and wall time (--minutes). Ranks agree on it:
    rank 0's clock is broadcast when a time budget is set."""

    def __init__(self, opts, elapsed, ranks):
        self.steps, self.budget, self.ranks = opts.steps, (opts.minutes * 60 if opts.minutes else None), ranks
        self.start = time.perf_counter() - elapsed

    def elapsed(self):
        return time.perf_counter() - self.start

    def progress(self, step):
        done = step / self.steps
        if self.budget is None:
            return done
        by_time = torch.tensor([self.elapsed() / self.budget], dtype=torch.float64)
        if self.ranks.world > 1:
            dist.broadcast(by_time, 0)
        return max(done, by_time.item())


# --- memory ---------------------------------------------------------------------------------------------------

def memory_plan(tcfg, dcfg, ranks, seq_len, batch_size, anchors):
    """Bytes per rank of training drafter `dcfg` for target `tcfg` over `ranks` GPUs (bf16 target and compute,
    fp32 drafter weights and AdamW state). The target shard is exact (the loader's buffers); the rest follows
    the recipe's tensors:
    lm_head_gather: the rest of the bf16 lm_head, gathered once; drafter_shard, gradients, optimizer: fp32
    parameters, gradients and AdamW's two moments, 1/ranks of each; unsharded_layers: two drafter layers' bf16
    parameters gathered by FSDP at a time (one computing, one prefetched); target_forward: the latent cache and
    the features of one rank's share of the batch (`FrozenTarget.features`); activations: an estimate of what
    autograd keeps for this rank's share, counted tensor by tensor in TrainDrafterLayer's forward (bf16, fp32
    residual stream and norm inputs), the attention mask, and the logits with their fp32 copy and gradient."""
    from model.model import KimiModel
    from model.parallel import Parallel
    from spec.drafter import DFlashDrafter

    shard = KimiModel(tcfg, Parallel(ranks, 0), device="meta").state_dict().values()
    P = sum(t.numel() for t in DFlashDrafter(dcfg, device="meta").state_dict().values())
    layer = sum(t.numel() for t in DFlashDrafter(dcfg, device="meta").layers[0].state_dict().values())
    D, V, S, I = dcfg.hidden_size, dcfg.vocab_size, dcfg.block_size, dcfg.intermediate_size
    q, kv = dcfg.num_attention_heads * dcfg.head_dim, dcfg.num_key_value_heads * dcfg.head_dim
    seqs = batch_size // ranks
    R, C = seqs * anchors * S, seqs * seq_len  # block rows, context rows of this rank
    per_layer = (R * (12 * D + 10 * q + 10 * kv + 8 * I + 4 * q // dcfg.head_dim)
                 + C * (10 * kv + 2 * D) + (C + R) * 4 * q)
    return {
        "target_shard": sum(t.numel() * t.element_size() for t in shard if t is not None),
        "lm_head_gather": V * D * 2 * (ranks - 1) // ranks,
        "drafter_shard": 4 * P // ranks, "gradients": 4 * P // ranks, "optimizer": 8 * P // ranks,
        "unsharded_layers": 2 * 2 * layer if ranks > 1 else 0,
        "target_forward": seqs * seq_len * (tcfg.num_hidden_layers * tcfg.cache_entry_dim
                                            + len(dcfg.target_layer_ids) * D) * 2,
        "activations": dcfg.num_hidden_layers * per_layer + seqs * anchors * S * (seq_len + anchors * S)
                       + R * (S - 1) // S * V * 10,
    }


# --- the command line -----------------------------------------------------------------------------------------

def parse_args(argv):
    p = Parser(prog="python -m spec.train_drafter", description=__doc__.splitlines()[0])
    p.add_argument("--model-path", required=True, help="the target: a K2.6-format checkpoint directory")
    p.add_argument("--data", nargs="+", help="text files, or .jsonl with 'text' or 'messages'")
    p.add_argument("--out", help="output directory (drafter checkpoint and train_state.pt)")
    p.add_argument("--memory-plan", type=int, metavar="RANKS",
                   help="print the bytes per rank of this run over RANKS GPUs (reads only config.json) and exit")
    p.add_argument("--resume", action="store_true", help=f"continue from OUT/{STATE_FILE} if it exists")
    p.add_argument("--drafter-config", help="a z-lab config.json to take the drafter's shape from")
    p.add_argument("--layers", type=int, default=6, help="drafter layers (default 6, as Kimi-K2.5-DFlash)")
    p.add_argument("--block-size", type=int, default=8, help="block: the anchor token + block_size-1 drafted")
    p.add_argument("--target-layer-ids", help="comma-separated feature layers (default: z-lab's spread)")
    p.add_argument("--heads", type=int, help="attention heads (default: the target's)")
    p.add_argument("--kv-heads", type=int, help="key/value heads (default: heads / 8, at least 1)")
    p.add_argument("--head-dim", type=int, help="default: the target's v_head_dim (K2.6: 128)")
    p.add_argument("--intermediate-size", type=int, help="MLP width (default: the target's dense intermediate)")
    p.add_argument("--mask-token-id", type=int, help="default: the tokenizer's [UNK]")
    defaults = TrainOptions()
    for name, value in asdict(defaults).items():
        kind = float if name in ("minutes", "lr", "warmup", "weight_decay", "decay_gamma", "clip") else int
        p.add_argument("--" + name.replace("_", "-"), type=kind, default=value)
    p.add_argument("--device", help="cpu, cuda, cuda:1 (default: cuda when present)")
    add_collective_timeout(p)
    args = p.parse_args(argv)
    if args.memory_plan is None and not (args.data and args.out):
        raise UsageError("--data and --out are required (unless --memory-plan)")
    return args


def drafter_config_from_args(args, tcfg, tok):
    """The drafter's config: --drafter-config's, or one built from the flags and the target's shape."""
    if args.drafter_config:
        try:
            cfg = DrafterConfig.from_file(args.drafter_config)
        except (OSError, ValueError) as err:
            raise UsageError(f"--drafter-config: {err}") from None
    else:
        heads = args.heads or tcfg.num_attention_heads
        try:
            ids = (tuple(int(i) for i in args.target_layer_ids.split(",")) if args.target_layer_ids
                   else default_target_layer_ids(tcfg.num_hidden_layers, args.layers))
        except ValueError:
            raise UsageError(f"--target-layer-ids: expected comma-separated integers, got "
                             f"{args.target_layer_ids!r}") from None
        try:
            cfg = DrafterConfig(
                hidden_size=tcfg.hidden_size, num_hidden_layers=args.layers, num_attention_heads=heads,
                num_key_value_heads=args.kv_heads or max(1, heads // 8), head_dim=args.head_dim or tcfg.v_head_dim,
                intermediate_size=args.intermediate_size or tcfg.intermediate_size, vocab_size=tcfg.vocab_size,
                block_size=args.block_size, target_layer_ids=ids,
                mask_token_id=tok.special_id("[UNK]") if args.mask_token_id is None else args.mask_token_id,
                rope_theta=tcfg.rope_theta, max_position_embeddings=tcfg.max_position_embeddings,
                num_target_layers=tcfg.num_hidden_layers)
        except ValueError as err:
            raise UsageError(str(err)) from None
    check_fits(cfg, tcfg, args.seq_len)
    return cfg


def check_fits(cfg, tcfg, seq_len):
    """A drafter config the target can run and verify, and the training sequences can hold."""
    try:
        check_drafter_fits(cfg, tcfg)
    except ValueError as err:
        raise UsageError(f"drafter config does not fit the target: {err}") from None
    if cfg.block_size >= tcfg.max_position_embeddings:
        raise UsageError(f"block size {cfg.block_size}: the target's context of {tcfg.max_position_embeddings} "
                         "positions cannot verify a block that long")
    if cfg.block_size + 1 > seq_len:
        raise UsageError(f"block size {cfg.block_size} does not fit --seq-len {seq_len} (a context token and the "
                         "block)")


def options_from_args(args):
    opts = TrainOptions(**{name: getattr(args, name) for name in asdict(TrainOptions())})
    opts.check()
    return opts


def run(args):
    from model.checkpoint import load_model
    from model.tokenizer import load_tokenizer
    from spec.decode import join_ranks

    opts = options_from_args(args)
    if not os.path.isdir(args.model_path):
        raise UsageError(f"--model-path: {args.model_path} is not a directory")
    if args.memory_plan is not None:
        print_memory_plan(args, opts)
        return
    device, par = join_ranks(args.device, args.collective_timeout)
    try:
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        try:
            target = load_model(args.model_path, par, dtype=dtype, device=device, progress=par.rank == 0)
            tok = load_tokenizer(args.model_path, target.cfg.vocab_size)
        except (OSError, ValueError) as err:
            raise UsageError(f"--model-path: {err}") from None
        cfg = drafter_config_from_args(args, target.cfg, tok)
        sequences = make_sequences(read_documents(args.data, tok), opts.seq_len, cfg.block_size)
        training, held_out = hold_out(sequences, opts.eval_prompts)
        if par.rank == 0:
            print(f"{len(training)} training sequences ({sum(len(s) for s in training)} tokens), {len(held_out)} "
                  f"held out; drafter {cfg.num_hidden_layers} layers, block {cfg.block_size}, features from layers "
                  f"{list(cfg.target_layer_ids)}", file=sys.stderr)
        log = (lambda line: tqdm.write(line, file=sys.stderr)) if par.rank == 0 else (lambda line: None)
        prompts = [s.prompt(opts.eval_prompt_tokens) for s in held_out]
        result = train(target, training, prompts, cfg, opts, args.out, args.resume, tok.stop_ids, log)
        if par.rank == 0:
            print(json.dumps({k: v for k, v in result.items() if k != "history"}))
    finally:
        if par.joined:
            gc.collect()
            dist.barrier()
            dist.destroy_process_group()


def print_memory_plan(args, opts):
    from model.config import ModelConfig
    from model.tokenizer import load_tokenizer

    try:
        tcfg = ModelConfig.from_file(args.model_path)
    except (OSError, ValueError) as err:
        raise UsageError(f"--model-path: {err}") from None
    if args.memory_plan < 1 or opts.batch_size % args.memory_plan:
        raise UsageError(f"--memory-plan {args.memory_plan}: --batch-size {opts.batch_size} must split over it")
    cfg = drafter_config_from_args(args, tcfg, load_tokenizer(args.model_path, tcfg.vocab_size))
    plan = memory_plan(tcfg, cfg, args.memory_plan, opts.seq_len, opts.batch_size, opts.anchors)
    for name, value in plan.items():
        print(f"{name:17s} {value / 2**30:7.2f} GiB")
    print(f"{'total':17s} {sum(plan.values()) / 2**30:7.2f} GiB per rank")


def main(argv=None):
    from spec.decode import command_main

    return command_main(run, parse_args, argv)


if __name__ == "__main__":
    sys.exit(main())
