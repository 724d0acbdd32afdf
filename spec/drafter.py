"""The DFlash drafter (z-lab/dflash): Qwen3-style layers that draft a whole block of tokens in one pass.

The block is [bonus token, MASK x (block_size-1)], embedded with the target's embedding. Every drafter layer
attends non-causally from the block to [context ; block]: the context entries are k/v projections of the
target's features (outputs of decoder layers `target_layer_ids`, concatenated, then `fc` and `hidden_norm`),
one entry per committed token at that token's position; block token j sits at position len + j. Queries come
from the block only. The target's lm_head scores block rows 1..block_size-1: the per-depth marginals q_1..q_L.

The context K/V live in a `DraftCache` (one row per sequence, like the target's latent cache): after each
verify only the accepted tokens' features are appended. The block's K/V are written after the committed
context for the pass and overwritten by the next append.

RoPE is Qwen3's rotate-half form; it runs through `ops.apply_rope` (interleaved pairs) by viewing the two
halves as pairs, which rotates the same (x[i], x[i + hd/2]) pairs by the same angles.
"""

from dataclasses import asdict, dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F

import ops
from model.config import (ConfigError, check_positive, check_rope_scaling, check_types, config_file, describe,
                          is_int, read_json)
from model.memory import check_fits, tensor_bytes
from model.model import Tensors, fill_random_
from model.parallel import Parallel


def default_target_layer_ids(num_target_layers, num_draft_layers):
    """z-lab's spread of feature layers when a config names none: evenly from layer 1 to num_target_layers-3."""
    if num_draft_layers == 1:
        return (num_target_layers // 2,)
    start, end = 1, num_target_layers - 3
    return tuple(int(round(start + i * (end - start) / (num_draft_layers - 1))) for i in range(num_draft_layers))


@dataclass(frozen=True)
class DrafterConfig:
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    block_size: int
    mask_token_id: int
    target_layer_ids: tuple
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    max_position_embeddings: int = 262144
    num_target_layers: int | None = None
    extra: dict = field(default_factory=dict, compare=False)  # other config.json keys, written back as they were

    def __post_init__(self):
        try:
            self._check()
        except ConfigError as err:
            raise err.located("drafter config") from None

    def _check(self):
        check_types(self)
        check_positive(self, ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                              "head_dim", "intermediate_size", "vocab_size", "rms_norm_eps", "max_position_embeddings",
                              "num_target_layers"))
        if not 2 <= self.block_size <= self.max_position_embeddings:
            raise ConfigError("block_size", f"must be in 2..max_position_embeddings ({self.max_position_embeddings}), "
                              f"got {self.block_size}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError("num_key_value_heads", f"{self.num_key_value_heads} does not divide the "
                              f"{self.num_attention_heads} attention heads")
        if self.head_dim % 2:
            raise ConfigError("head_dim", f"must be even, got {self.head_dim}")
        if not self.target_layer_ids or not all(is_int(i) and i >= 0 for i in self.target_layer_ids):
            raise ConfigError("target_layer_ids", f"must be a non-empty list of layer indices >= 0, got "
                              f"{list(self.target_layer_ids)}")
        if not is_int(self.mask_token_id) or not 0 <= self.mask_token_id < self.vocab_size:
            raise ConfigError("mask_token_id", f"{self.mask_token_id} outside the vocabulary of {self.vocab_size}")
        if not self.rope_theta > 1:
            raise ConfigError("rope_theta", f"must be greater than 1, got {self.rope_theta}")
        check_rope_scaling(self.rope_scaling)

    @property
    def draft_len(self):
        """L: tokens drafted per block (the block minus its bonus token)."""
        return self.block_size - 1

    @classmethod
    def from_hf(cls, hf, where="drafter config"):
        """From z-lab's config.json: block_size top-level or in dflash_config; mask_token_id and
        target_layer_ids in dflash_config; head_dim and num_key_value_heads optional. `where` names the file
        in errors."""
        if not isinstance(hf, dict):
            raise ValueError(f"{where}: must hold a JSON object, got {describe(hf)}")
        dflash = {} if hf.get("dflash_config") is None else hf["dflash_config"]
        if not isinstance(dflash, dict):
            raise ConfigError("dflash_config", f"must be an object, got {describe(dflash)}", where)
        keys = {}  # field -> where its value was found, for errors

        def need(key, *sources):
            for source in sources:
                if source.get(key) is not None:
                    keys[key] = ("dflash_config." if source is dflash and source is not hf else "") + key
                    return source[key]
            raise ConfigError(key, None, where)

        if hf.get("attention_bias") or hf.get("mlp_bias"):
            raise ConfigError("attention_bias", "/ mlp_bias are not supported (DFlash has none)", where)
        layer_types = hf.get("layer_types") or ()
        if hf.get("use_sliding_window") or isinstance(layer_types, (list, str)) and "sliding_attention" in layer_types:
            raise ConfigError("layer_types", "name sliding-window attention layers, which are not supported", where)
        heads, layers, hidden = need("num_attention_heads", hf), need("num_hidden_layers", hf), need("hidden_size", hf)
        ids = dflash.get("target_layer_ids", hf.get("target_layer_ids"))
        keys["target_layer_ids"] = ("dflash_config." if "target_layer_ids" in dflash else "") + "target_layer_ids"
        if ids is None:  # z-lab's default spread over the target's layers
            target_layers = need("num_target_layers", hf)
            for key, value in (("num_target_layers", target_layers), ("num_hidden_layers", layers)):
                if not (is_int(value) and value > 0):
                    raise ConfigError(key, f"must be a positive integer, got {describe(value)}", where)
            ids = default_target_layer_ids(target_layers, layers)
        if not isinstance(ids, (list, tuple)):
            raise ConfigError(keys["target_layer_ids"], f"must be a list of layer indices, got {describe(ids)}", where)
        rope_key = "rope_scaling" if hf.get("rope_scaling") is not None else "rope_parameters"
        rope, keys["rope_scaling"] = hf.get(rope_key), rope_key
        try:
            check_rope_scaling(rope)
        except ConfigError as err:
            raise err.located(where, keys) from None
        theta = hf.get("rope_theta") or (rope or {}).get("rope_theta") or 10000.0
        if rope and rope.get("rope_type", rope.get("type")) in (None, "default"):
            rope = None
        evenly = is_int(hidden) and is_int(heads) and heads > 0
        known = {"hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
                 "intermediate_size", "vocab_size", "block_size", "dflash_config", "rms_norm_eps", "rope_theta",
                 "rope_scaling", "rope_parameters", "max_position_embeddings", "num_target_layers"}
        try:
            return cls(
                hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                num_key_value_heads=hf.get("num_key_value_heads") or heads,
                head_dim=hf.get("head_dim") or (hidden // heads if evenly else None),
                intermediate_size=need("intermediate_size", hf), vocab_size=need("vocab_size", hf),
                block_size=need("block_size", hf, dflash), mask_token_id=need("mask_token_id", dflash, hf),
                target_layer_ids=tuple(ids), rms_norm_eps=hf.get("rms_norm_eps", 1e-6), rope_theta=theta,
                rope_scaling=dict(rope) if rope else None,
                max_position_embeddings=hf.get("max_position_embeddings", 262144),
                num_target_layers=hf.get("num_target_layers"),
                extra={k: v for k, v in hf.items() if k not in known},
            )
        except ConfigError as err:
            raise err.located(where, keys) from None

    @classmethod
    def from_file(cls, path):
        file = config_file(path)
        return cls.from_hf(read_json(file, "drafter config"), str(file))

    def to_hf(self, block_size_in_dflash_config=False):
        """z-lab's config.json layout (Qwen3 keys plus block_size and dflash_config)."""
        hf = {"architectures": ["DFlashDraftModel"], "model_type": "qwen3", "attention_bias": False,
              "hidden_act": "silu", "tie_word_embeddings": False, **self.extra}
        hf.update({k: v for k, v in asdict(self).items() if k not in ("extra", "mask_token_id", "target_layer_ids")})
        hf["dflash_config"] = {"mask_token_id": self.mask_token_id, "target_layer_ids": list(self.target_layer_ids)}
        if block_size_in_dflash_config:
            hf["dflash_config"]["block_size"] = hf.pop("block_size")
        if self.num_target_layers is None:
            del hf["num_target_layers"]
        return hf


def check_drafter_fits(dcfg, tcfg):
    """Raise ValueError if a drafter cannot run on a target (hidden size, vocabulary, feature layers)."""
    if dcfg.hidden_size != tcfg.hidden_size:
        raise ValueError(f"drafter hidden_size {dcfg.hidden_size} does not match the target's {tcfg.hidden_size}")
    if dcfg.vocab_size != tcfg.vocab_size:
        raise ValueError(f"drafter vocab_size {dcfg.vocab_size} does not match the target's {tcfg.vocab_size}")
    bad = [i for i in dcfg.target_layer_ids if not 0 <= i < tcfg.num_hidden_layers]
    if bad:
        raise ValueError(f"drafter target_layer_ids {bad} out of range for a target of "
                         f"{tcfg.num_hidden_layers} layers")


# --- the context cache ----------------------------------------------------------------------------------------

class DraftCache:
    """Per drafter layer K/V of the context: k, v [layers, B, L_max, KVH, hd]; lens [B] int32 (device) counts
    committed context entries, host_lens mirrors it (updated by the caller after its one read per step)."""

    def __init__(self, k, v, lens, host_lens):
        self.k, self.v, self.lens, self.host_lens = k, v, lens, host_lens

    @classmethod
    def empty(cls, cfg, batch, max_len, dtype, device, kv_heads=None):
        """kv_heads: this rank's key/value heads (all of them by default)."""
        shape = (cfg.num_hidden_layers, batch, max_len, kv_heads or cfg.num_key_value_heads, cfg.head_dim)
        check_fits(f"the drafter's cache ({batch} x {max_len} entries)", 2 * tensor_bytes(shape, dtype), device)
        return cls(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device),
                   torch.zeros(batch, dtype=torch.int32, device=device), [0] * batch)

    @property
    def max_len(self):
        return self.k.shape[2]

    def row(self, b):
        """A one-sequence view of row b sharing storage (its host_lens is a copy: write it back)."""
        return DraftCache(self.k[:, b : b + 1], self.v[:, b : b + 1], self.lens[b : b + 1], [self.host_lens[b]])

    def check_room(self, new):
        for b, n in enumerate(self.host_lens):
            if n + new > self.max_len:
                raise ValueError(f"draft cache: sequence {b} holds {n} entries; {new} more exceed {self.max_len}")

    def set_host_lens(self, host_lens):
        self.host_lens = list(host_lens)


def write_rows(k_cache, v_cache, k, v, B, starts):
    """k_cache[b, starts[b] + t] = k[b*T + t] and likewise v. Caches: [B, L_max, KVH, hd]; k, v: [B*T, KVH, hd]."""
    for cache, new in ((k_cache, k), (v_cache, v)):
        ops.write_kv(cache.flatten(2), new.reshape(B, -1, cache.shape[2] * cache.shape[3]), starts)


# --- the model ------------------------------------------------------------------------------------------------

class DrafterAttention(nn.Module):
    """GQA attention; under tensor parallelism this rank holds heads / tp query and key/value heads."""

    def __init__(self, cfg, par, dtype, device):
        super().__init__()
        D, hd = cfg.hidden_size, cfg.head_dim
        _, H = par.shard(cfg.num_attention_heads, "drafter attention heads")
        _, KVH = par.shard(cfg.num_key_value_heads, "drafter key/value heads")
        self.cfg, self.par, self.heads, self.kv_heads = cfg, par, H, KVH
        self.q_proj = Tensors.empty((H * hd, D), dtype, device)
        self.k_proj = Tensors.empty((KVH * hd, D), dtype, device)
        self.v_proj = Tensors.empty((KVH * hd, D), dtype, device)
        self.o_proj = Tensors.empty((D, H * hd), dtype, device)
        self.q_norm = Tensors.empty((hd,), dtype, device)
        self.k_norm = Tensors.empty((hd,), dtype, device)

    def keys_values(self, x, positions, rope):
        """x: [N, D] -> roped, k-normed keys [N, KVH, hd] and values [N, KVH, hd]."""
        cfg = self.cfg
        k = ops.linear(x, self.k_proj.weight).view(x.shape[0], self.kv_heads, cfg.head_dim)
        k = ops.head_norm_rope(k, self.k_norm.weight, cfg.rms_norm_eps, positions, *rope)
        v = ops.linear(x, self.v_proj.weight).view(x.shape[0], self.kv_heads, cfg.head_dim)
        return k, v

    def forward(self, x, positions, rope, k_cache, v_cache, starts, lens_after, max_len):
        """x: [B, S, D] normed block; writes the block's K/V at starts.. and attends over lens_after entries."""
        cfg = self.cfg
        B, S, _ = x.shape
        flat = x.reshape(B * S, -1)
        q = ops.linear(flat, self.q_proj.weight).view(B * S, self.heads, cfg.head_dim)
        q = ops.head_norm_rope(q, self.q_norm.weight, cfg.rms_norm_eps, positions, *rope)
        write_rows(k_cache, v_cache, *self.keys_values(flat, positions, rope), B, starts)
        o = ops.drafter_attention(q.view(B, S, *q.shape[1:]), k_cache, v_cache, lens_after, max_len,
                              cfg.head_dim ** -0.5)
        return self.par.all_reduce(ops.linear(o.reshape(B, S, -1), self.o_proj.weight))


class DrafterLayer(nn.Module):
    def __init__(self, cfg, par, dtype, device):
        super().__init__()
        D = cfg.hidden_size
        _, inter = par.shard(cfg.intermediate_size, "drafter intermediate_size")
        self.cfg, self.par = cfg, par
        self.input_layernorm = Tensors.empty((D,), dtype, device)
        self.post_attention_layernorm = Tensors.empty((D,), dtype, device)
        self.self_attn = DrafterAttention(cfg, par, dtype, device)
        self.mlp = nn.Module()
        self.mlp.gate_up = Tensors.empty((2 * inter, D), dtype, device)
        self.mlp.down_proj = Tensors.empty((D, inter), dtype, device)

    def forward(self, h, delta, positions, rope, k_cache, v_cache, starts, lens_after, max_len):
        """The residual stream arrives as h + delta (delta: the previous layer's MLP output, or None) and leaves
        the same way, so each residual add runs inside the norm after it. h, delta: [B, S, D]."""
        eps = self.cfg.rms_norm_eps
        if delta is None:
            x = ops.rms_norm(h, self.input_layernorm.weight, eps)
        else:
            h, x = ops.add_rms_norm(delta, h, self.input_layernorm.weight, eps)
        attn = self.self_attn(x, positions, rope, k_cache, v_cache, starts, lens_after, max_len)
        h, x = ops.add_rms_norm(attn, h, self.post_attention_layernorm.weight, eps)
        mlp = ops.mlp(x.reshape(-1, x.shape[-1]), self.mlp.gate_up.weight, self.mlp.down_proj.weight)
        return h, self.par.all_reduce(mlp).view_as(h)


class DFlashDrafter(nn.Module):
    """The drafter's own weights (names as in the z-lab checkpoint, gate/up stacked as `mlp.gate_up`); the
    embedding and lm_head come from the target through `bind`."""

    def __init__(self, cfg, dtype=torch.bfloat16, device="cpu", parallel=None):
        super().__init__()
        self.cfg, self.dtype, self.device = cfg, dtype, torch.device(device)
        self.par = parallel or Parallel()
        D, n = cfg.hidden_size, len(cfg.target_layer_ids)
        self.fc = Tensors.empty((D, n * D), dtype, device)
        self.hidden_norm = Tensors.empty((D,), dtype, device)
        self.layers = nn.ModuleList(DrafterLayer(cfg, self.par, dtype, device) for _ in range(cfg.num_hidden_layers))
        self.norm = Tensors.empty((D,), dtype, device)
        inv_freq, factor = ops.yarn_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
        self.register_buffer("inv_freq", inv_freq.to(self.device), persistent=False)
        self.rope_factor = factor
        self.target = None

    @property
    def block_size(self):
        return self.cfg.block_size

    @property
    def target_layer_ids(self):
        return self.cfg.target_layer_ids

    def bind(self, target):
        """Use `target`'s embedding, lm_head and tensor-parallel group (checks that the drafter fits it)."""
        check_drafter_fits(self.cfg, target.cfg)
        if (self.par.tp_size, self.par.rank) != (target.par.tp_size, target.par.rank):
            raise ValueError(f"drafter is tensor-parallel rank {self.par.rank} of {self.par.tp_size}, the target rank "
                             f"{target.par.rank} of {target.par.tp_size}: build it with the target's Parallel")
        object.__setattr__(self, "target", target)  # a reference, not a submodule: its weights are not ours
        return self

    def new_cache(self, batch, max_len):
        return DraftCache.empty(self.cfg, batch, max_len, self.dtype, self.device, self.layers[0].self_attn.kv_heads)

    def hf_features(self, features):
        """The features z-lab trains on, HF's hidden_states[i + 1]: the output of decoder layer i, except for
        the last layer, whose entry HF takes after the final norm. features: [B, C, n*D] raw layer outputs."""
        if self.target is None:
            raise RuntimeError("drafter: call bind(target) first")
        last = self.target.cfg.num_hidden_layers - 1
        if last not in self.cfg.target_layer_ids:
            return features
        parts = list(features.split(self.cfg.hidden_size, dim=-1))
        for j, layer in enumerate(self.cfg.target_layer_ids):
            if layer == last:
                parts[j] = ops.rms_norm(parts[j], self.target.norm.weight, self.target.cfg.rms_norm_eps)
        return torch.cat(parts, dim=-1)

    def append_context(self, cache, features, counts, host_counts=None):
        """Append target features to each sequence's context: rows t < counts[b] of features[b].

        features: [B, C, n*D] (raw outputs of target_layer_ids, concatenated, as the target's forward returns
        them; see hf_features); counts: [B] int32 on the device.
        All C rows are written (rows past counts[b] land beyond the committed length and are overwritten
        later); lens += counts. host_counts (list) updates host_lens now; without it the caller sets them.
        """
        B, C, _ = features.shape
        cache.check_room(C)
        ctx = ops.rms_norm(ops.linear(self.hf_features(features).to(self.dtype), self.fc.weight),
                           self.hidden_norm.weight, self.cfg.rms_norm_eps).reshape(B * C, -1)
        positions = (cache.lens[:B, None] + torch.arange(C, device=self.device)).reshape(-1)
        rope = (self.inv_freq, self.rope_factor)
        for i, layer in enumerate(self.layers):
            k, v = layer.self_attn.keys_values(ctx, positions, rope)
            write_rows(cache.k[i], cache.v[i], k, v, B, cache.lens[:B])
        cache.lens[:B] += counts.to(torch.int32)
        if host_counts is not None:
            cache.set_host_lens([n + c for n, c in zip(cache.host_lens, host_counts)] + cache.host_lens[B:])

    def draft(self, cache, bonus):
        """Draft one block per sequence after its committed context; returns logits [B, L, V] for depths 1..L.

        bonus: [B] int64, the token at position cache.lens[b] (the root of the next tree). Commits nothing.
        """
        if self.target is None:
            raise RuntimeError("drafter: call bind(target) first")
        B, S = bonus.shape[0], self.cfg.block_size
        cache.check_room(S)
        block = torch.full((B, S), self.cfg.mask_token_id, dtype=torch.int64, device=self.device)
        block[:, 0] = bonus
        h = F.embedding(block, self.target.embed_tokens.weight).to(self.dtype)  # [B, S, D]
        starts = cache.lens[:B]
        positions = (starts[:, None] + torch.arange(S, device=self.device)).reshape(-1)
        lens_after, max_len = starts + S, max(cache.host_lens[:B]) + S
        rope = (self.inv_freq, self.rope_factor)
        delta = None
        for i, layer in enumerate(self.layers):
            h, delta = layer(h, delta, positions, rope, cache.k[i], cache.v[i], starts, lens_after, max_len)
        h = ops.add_rms_norm(delta, h, self.norm.weight, self.cfg.rms_norm_eps)[1][:, 1:]
        return self.target.par.all_gather_last(ops.linear(h, self.target.lm_head.weight))

    def init_random_(self, seed=0, std=0.02):
        """Seeded random weights (tests and the embedded default)."""
        return fill_random_(self, seed, std)
