"""Streaming loader for K2.6-format checkpoints (safetensors shards + index json, compressed-tensors INT4 experts).

Names in the checkpoint are `<body>layers.N...` and `<head>` where (body, head) is ("model.", "lm_head.weight")
for K2-Thinking or ("language_model.model.", "language_model.lm_head.weight") for K2.5/K2.6. Every tensor's
shape and dtype are checked against the config before it is read; each rank reads only its slice (`get_slice`),
and routed experts stay packed INT4 all the way into the model's stacked buffers.
"""

import json
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from tqdm import tqdm

import ops
from model.config import ModelConfig
from model.model import KimiModel
from model.parallel import Parallel

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
PREFIXES = (("language_model.model.", "language_model.lm_head.weight"), ("model.", "lm_head.weight"))
GROUP = 32
PACK = 8
EXPERT = re.compile(r"layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight_(packed|scale|shape)$")


@dataclass(frozen=True)
class Entry:
    """One checkpoint tensor: its full (unsharded) shape and which dtypes it may have."""

    shape: tuple
    dtypes: tuple  # safetensors dtype names, e.g. ("BF16", "F16", "F32")


FLOAT = ("BF16", "F16", "F32")


def checkpoint_entries(cfg):
    """Every tensor a text checkpoint for `cfg` holds: {name: Entry}, names relative to the body prefix
    (`layers.0.self_attn.q_a_proj.weight`), plus the head as `lm_head.weight`."""
    V, D, H = cfg.vocab_size, cfg.hidden_size, cfg.num_attention_heads
    out = {"embed_tokens.weight": Entry((V, D), FLOAT), "norm.weight": Entry((D,), FLOAT),
           "lm_head.weight": Entry((V, D), FLOAT)}
    for i in range(cfg.num_hidden_layers):
        p = f"layers.{i}."
        out[p + "input_layernorm.weight"] = Entry((D,), FLOAT)
        out[p + "post_attention_layernorm.weight"] = Entry((D,), FLOAT)
        out.update(_attention_entries(cfg, p + "self_attn."))
        if cfg.is_moe_layer(i):
            out.update(_moe_entries(cfg, p + "mlp."))
        else:
            out.update(_mlp_entries(D, cfg.intermediate_size, p + "mlp."))
    return out


def _attention_entries(cfg, p):
    D, H, R = cfg.hidden_size, cfg.num_attention_heads, cfg.kv_lora_rank
    out = {}
    if cfg.q_lora_rank:
        out[p + "q_a_proj.weight"] = Entry((cfg.q_lora_rank, D), FLOAT)
        out[p + "q_a_layernorm.weight"] = Entry((cfg.q_lora_rank,), FLOAT)
        out[p + "q_b_proj.weight"] = Entry((H * cfg.qk_head_dim, cfg.q_lora_rank), FLOAT)
    else:
        out[p + "q_proj.weight"] = Entry((H * cfg.qk_head_dim, D), FLOAT)
    out[p + "kv_a_proj_with_mqa.weight"] = Entry((cfg.cache_entry_dim, D), FLOAT)
    out[p + "kv_a_layernorm.weight"] = Entry((R,), FLOAT)
    out[p + "kv_b_proj.weight"] = Entry((H * (cfg.qk_nope_head_dim + cfg.v_head_dim), R), FLOAT)
    out[p + "o_proj.weight"] = Entry((D, H * cfg.v_head_dim), FLOAT)
    return out


def _mlp_entries(D, intermediate, p):
    return {p + "gate_proj.weight": Entry((intermediate, D), FLOAT),
            p + "up_proj.weight": Entry((intermediate, D), FLOAT),
            p + "down_proj.weight": Entry((D, intermediate), FLOAT)}


def _moe_entries(cfg, p):
    D, E, I = cfg.hidden_size, cfg.n_routed_experts, cfg.moe_intermediate_size
    out = {p + "gate.weight": Entry((E, D), FLOAT), p + "gate.e_score_correction_bias": Entry((E,), FLOAT)}
    out.update(_mlp_entries(D, I * cfg.n_shared_experts, p + "shared_experts."))
    for e in range(E):
        for proj, (rows, cols) in (("gate", (I, D)), ("up", (I, D)), ("down", (D, I))):
            q = f"{p}experts.{e}.{proj}_proj.weight_"
            out[q + "packed"] = Entry((rows, cols // PACK), ("I32",))
            out[q + "scale"] = Entry((rows, cols // GROUP), ("BF16",))
            out[q + "shape"] = Entry((2,), ("I32", "I64"))
    return out


def quantize_int4(w):
    """Symmetric INT4, group 32 along the last dim: w [N, K] float -> (packed [N, K/8] int32, scale [N, K/32]
    bf16, dequantised [N, K] fp32).

    scale = absmax(group) / 7 rounded to bf16 (an all-zero group gets scale 1), q = round(w / scale) clamped to
    [-8, 7] (so -8 is never produced), packed with `ops.pack_int4`; dequantised = `ops.unpack_int4(packed,
    scale)`, exactly what a loader reconstructs.
    """
    N, K = w.shape
    if K % GROUP:
        raise ValueError(f"quantize_int4: input dim {K} is not a multiple of {GROUP}")
    groups = w.float().view(N, K // GROUP, GROUP)
    absmax = groups.abs().amax(-1)
    scale = torch.where(absmax > 0, absmax / 7, torch.ones_like(absmax)).to(torch.bfloat16)
    q = torch.round(groups / scale.float()[..., None]).clamp(-8, 7).view(N, K)
    packed = ops.pack_int4(q)
    return packed, scale, ops.unpack_int4(packed, scale)


# ---------------------------------------------------------------------------------------------- reading files


def checkpoint_files(path):
    """{tensor name: file path} for a checkpoint directory (index json or one model.safetensors)."""
    path = Path(path)
    index = path / INDEX_FILE
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as err:
            raise ValueError(f"checkpoint: {index} is not a valid safetensors index ({err!r})") from None
        files = {name: path / file for name, file in weight_map.items()}
        for file in sorted(set(files.values())):
            if not file.exists():
                raise FileNotFoundError(f"checkpoint: {index} lists {file.name}, which does not exist")
        return files
    single = path / SINGLE_FILE
    if not single.exists():
        raise FileNotFoundError(f"checkpoint: {path} has neither {INDEX_FILE} nor {SINGLE_FILE}")
    with _open(single) as f:
        return {name: single for name in f.keys()}


def _open(file):
    try:
        return safe_open(str(file), framework="pt")
    except SafetensorError as err:
        raise ValueError(f"checkpoint: {file} is not a readable safetensors file (truncated or corrupt?): {err}") \
            from None


def detect_prefix(names):
    """(body prefix, head name) used by a checkpoint, from its tensor names."""
    for body, head in PREFIXES:
        if any(n.startswith(body + "layers.") or n == body + "embed_tokens.weight" for n in names):
            return body, head
    raise ValueError(f"checkpoint: no text-model tensors found (want names under {PREFIXES[0][0]!r} or "
                     f"{PREFIXES[1][0]!r}; saw e.g. {sorted(names)[:3]})")


# ---------------------------------------------------------------------------------------------- placement


class Placer:
    """Where each checkpoint tensor's local slice goes in a `KimiModel` built for one TP rank."""

    def __init__(self, model):
        self.cfg, self.par = model.cfg, model.par
        self.buffers = dict(model.named_buffers())

    def __call__(self, name):
        """(target tensor view, index into the checkpoint tensor) for `name`, or (None, None) for weight_shape."""
        cfg, par = self.cfg, self.par
        m = EXPERT.search(name)
        if m:
            return self._expert(int(m[1]), int(m[2]), m[3], m[4])
        leaf = name.rsplit(".", 2)[-2]
        if name == "lm_head.weight":
            v0, vl = par.shard(cfg.vocab_size, "vocab_size")
            return self.buffers[name], (slice(v0, v0 + vl),)
        if leaf in ("q_b_proj", "q_proj", "kv_b_proj", "o_proj"):
            h0, hl = par.shard(cfg.num_attention_heads, "attention heads")
            units = {"o_proj": cfg.v_head_dim, "kv_b_proj": cfg.qk_nope_head_dim + cfg.v_head_dim}
            unit = units.get(leaf, cfg.qk_head_dim)
            part = slice(h0 * unit, (h0 + hl) * unit)
            return self.buffers[name], ((slice(None), part) if leaf == "o_proj" else (part,))
        if leaf in ("gate_proj", "up_proj", "down_proj"):
            return self._dense(name, leaf)
        return self.buffers[name], ()

    def _dense(self, name, leaf):
        cfg, par = self.cfg, self.par
        module = name.rsplit(".", 2)[0]
        shared = module.endswith("shared_experts")
        size = cfg.moe_intermediate_size * cfg.n_shared_experts if shared else cfg.intermediate_size
        i0, il = par.shard(size, "shared expert intermediate" if shared else "intermediate_size")
        if leaf == "down_proj":
            return self.buffers[name], (slice(None), slice(i0, i0 + il))
        gate_up = self.buffers[module + ".gate_up.weight"]
        rows = slice(0, il) if leaf == "gate_proj" else slice(il, 2 * il)
        return gate_up[rows], (slice(i0, i0 + il),)

    def _expert(self, layer, e, proj, part):
        if part == "shape":
            return None, None
        i0, il = self.par.shard(self.cfg.moe_intermediate_size, "moe_intermediate_size", multiple=GROUP)
        p = f"layers.{layer}.mlp.experts."
        if proj == "down":
            unit = PACK if part == "packed" else GROUP
            return self.buffers[p + f"down_{part}"][e], (slice(None), slice(i0 // unit, (i0 + il) // unit))
        rows = slice(0, il) if proj == "gate" else slice(il, 2 * il)
        return self.buffers[p + f"gate_up_{part}"][e, rows], (slice(i0, i0 + il),)


# ---------------------------------------------------------------------------------------------- the loader


def load_model(path, parallel=None, dtype=torch.bfloat16, device="cpu", progress=True):
    """Build a `KimiModel` for this rank from a K2.6-format checkpoint directory, stream its shards in, and
    prepare the experts for the current moe backend.

    Reads config.json (flat or with `text_config`), `model.safetensors.index.json` or one `model.safetensors`,
    either name prefix; ignores vision tower / projector / rotary_emb.inv_freq and anything else outside the
    text model. Raises ValueError naming the tensor (or file) on a wrong shape, dtype, weight_shape, a missing
    tensor, or an unreadable file.
    """
    path = Path(path)
    cfg = ModelConfig.from_file(path)
    if cfg.has_moe and cfg.quantization is None:
        raise ValueError(f"checkpoint: {path / 'config.json'} has no quantization_config; only compressed-tensors "
                         "pack-quantized (INT4) routed experts are supported")
    if cfg.tie_word_embeddings:
        raise ValueError("checkpoint: tie_word_embeddings is not supported (K2.6 keeps a separate lm_head)")
    files = checkpoint_files(path)
    body, head = detect_prefix(files)
    entries = checkpoint_entries(cfg)
    local = {(head if name == "lm_head.weight" else body + name): name for name in entries}
    model = KimiModel(cfg, parallel or Parallel(), dtype, device)
    place = Placer(model)
    by_file = {}
    for full, file in files.items():
        if full in local:
            by_file.setdefault(file, []).append(full)
    missing = [n for n in local if n not in files]
    if missing:
        raise ValueError(f"checkpoint: {len(missing)} tensors missing from {path}, e.g. {missing[:5]}")
    for file in sorted(by_file):  # headers only: a bad shape or dtype fails before any data is read
        _validate(file, by_file[file], local, entries)
    with tqdm(total=len(local), unit="tensor", desc="loading", disable=not progress) as bar:
        for file in sorted(by_file):
            bar.set_postfix_str(file.name)
            _load_file(file, by_file[file], local, entries, place, bar)
    return model.prepare()


def _validate(file, names, local, entries):
    with _open(file) as f:
        present = set(f.keys())
        for full in names:
            if full not in present:
                raise ValueError(f"checkpoint: {full} is listed for {file.name} but not stored there")
            view = f.get_slice(full)
            _check(full, entries[local[full]], view.get_shape(), view.get_dtype())


def _load_file(file, names, local, entries, place, bar):
    with _open(file) as f:
        for full in names:
            name = local[full]
            target, index = place(name)
            if target is None:
                _check_weight_shape(full, f.get_tensor(full), entries, name)
            else:
                target.copy_(_read(full, f.get_slice(full), index))
            bar.update()


def _read(full, view, index):
    try:
        return view[index] if index else view[:]
    except SafetensorError as err:
        raise ValueError(f"checkpoint: cannot read {full}: {err}") from None


def _check(full, entry, shape, dtype):
    if tuple(shape) != entry.shape:
        raise ValueError(f"checkpoint: {full} has shape {tuple(shape)}, expected {entry.shape}")
    if dtype not in entry.dtypes:
        raise ValueError(f"checkpoint: {full} has dtype {dtype}, expected {' or '.join(entry.dtypes)}")


def _check_weight_shape(full, value, entries, name):
    stem = name[: -len("shape")]
    rows, words = entries[stem + "packed"].shape
    want = [rows, words * PACK]
    if value.tolist() != want:
        raise ValueError(f"checkpoint: {full} is {value.tolist()}, expected {want} ([out, in])")
