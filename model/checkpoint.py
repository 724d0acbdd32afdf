"""Streaming loader for K2.6-format checkpoints (safetensors shards + index json, compressed-tensors INT4 experts).

Names in the checkpoint are `<body>layers.N...` and `<head>` where (body, head) is ("model.", "lm_head.weight")
for K2-Thinking or ("language_model.model.", "language_model.lm_head.weight") for K2.5/K2.6. Every file an
index names must lie inside the model folder (`shard_path`). Every tensor's shape and dtype are checked against
the config, and the weights' size against free memory, before anything is allocated or read; each rank reads
only its slice (`get_slice`), and routed experts stay packed INT4 all the way into the model's stacked buffers.
"""

import os
import re
import stat
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

import torch
from safetensors import SafetensorError, safe_open
from tqdm import tqdm

import ops
from model.config import ModelConfig, config_file, describe, read_json
from model.memory import check_fits
from model.model import KimiModel
from model.parallel import Parallel

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
PREFIXES = (("language_model.model.", "language_model.lm_head.weight"), ("model.", "lm_head.weight"))
GROUP = 32
PACK = 8
LAYER = re.compile(r"layers\.(\d+)\.")
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
    V, D = cfg.vocab_size, cfg.hidden_size
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


def shard_path(folder, written, what, listed_in):
    """The file named `written` (a path from an index, relative to the model folder) as a Path in `folder`.

    The name must be a relative path that stays below the folder (not absolute, no '..'), and the file it
    resolves to, through any symlink, must lie in the folder, or in the repository folder of an HF hub cache
    when `folder` is one of its snapshots (snapshots/<rev>/x.safetensors -> ../../blobs/<hash>). Outside is one
    error whether or not such a file exists; inside, the file must exist and be a regular file.
    """
    folder = Path(folder)
    where = f"{what}: {listed_in} lists {written if isinstance(written, str) else describe(written)}"
    if not isinstance(written, str) or written.strip() in ("", ".") or "\0" in written:
        raise ValueError(f"{where}, which is not a file name")
    name = PurePosixPath(written)
    outside = name.is_absolute() or ".." in name.parts
    real = folder if outside else Path(os.path.realpath(folder / written))
    if outside or not any(real.is_relative_to(root) for root in _roots(folder)):
        raise ValueError(f"{where}, which is outside the model folder {folder}")
    try:
        mode = os.stat(real).st_mode
    except OSError:
        raise FileNotFoundError(f"{where}, which does not exist") from None
    if not stat.S_ISREG(mode):
        raise ValueError(f"{where}, which is {'a directory' if stat.S_ISDIR(mode) else 'not a regular file'}")
    return folder / written


def _roots(folder):
    """Where a model folder's files may resolve to: the folder, and for an HF hub cache snapshot its repo."""
    real = Path(os.path.realpath(folder))
    roots = [real]
    if real.parent.name == "snapshots" and (real.parent.parent / "blobs").is_dir():
        roots.append(real.parent.parent)
    return roots


def read_index(folder, what="checkpoint"):
    """{tensor name: shard Path} from `folder`/model.safetensors.index.json (its `weight_map`)."""
    index = Path(folder) / INDEX_FILE
    weight_map = read_json(index, what).get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise ValueError(f"{what}: {index} has no weight_map (an object: tensor name -> shard file), got "
                         f"{describe(weight_map)}")
    files = {}
    for written in weight_map.values():
        if not isinstance(written, str) or written not in files:
            files[written] = shard_path(folder, written, what, index)  # raises for a name that is not a str
    return {name: files[written] for name, written in weight_map.items()}


def checkpoint_files(path, what="checkpoint"):
    """{tensor name: file path} for a checkpoint directory (index json or one model.safetensors)."""
    path = Path(path)
    if os.path.lexists(path / INDEX_FILE):
        return read_index(path, what)
    if not os.path.lexists(path / SINGLE_FILE):
        raise FileNotFoundError(f"{what}: {path} has neither {INDEX_FILE} nor {SINGLE_FILE}")
    single = shard_path(path, SINGLE_FILE, what, path)
    with _open(single, what) as f:
        return {name: single for name in f.keys()}


def _open(file, what="checkpoint"):
    try:
        return safe_open(str(file), framework="pt")
    except (SafetensorError, OSError) as err:
        raise ValueError(f"{what}: {file} is not a readable safetensors file (truncated or corrupt?): {err}") \
            from None


def read_headers(files, what="checkpoint"):
    """{tensor name: (shape, safetensors dtype)} for `files` ({name: file}), from the shards' headers only."""
    by_file = {}
    for name, file in files.items():
        by_file.setdefault(file, []).append(name)
    out = {}
    for file in sorted(by_file):
        with _open(file, what) as f:
            present = set(f.keys())
            for name in by_file[file]:
                if name not in present:
                    raise ValueError(f"{what}: {name} is listed for {file.name} but not stored there")
                view = f.get_slice(name)
                out[name] = (tuple(view.get_shape()), view.get_dtype())
    return out


def check_counts(cfg, names, body, where):
    """The config's layer and expert counts must not pass what the checkpoint holds (checked on names, before
    any per-layer or per-expert table is built from the config)."""
    layers = {int(m[1]) for n in names if n.startswith(body) and (m := LAYER.match(n[len(body):]))}
    held = max(layers) + 1 if layers else 0
    if cfg.num_hidden_layers > held:
        raise ValueError(f"checkpoint: {where} says num_hidden_layers {cfg.num_hidden_layers}, but the shards hold "
                         f"{held} layers")
    if cfg.has_moe:
        experts = {int(m[2]) for n in names if (m := EXPERT.search(n)) and int(m[1]) == cfg.first_k_dense_replace}
        held = max(experts) + 1 if experts else 0
        if cfg.n_routed_experts > held:
            raise ValueError(f"checkpoint: {where} says n_routed_experts {cfg.n_routed_experts}, but the shards hold "
                             f"{held} experts in layer {cfg.first_k_dense_replace}")


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
    text model. Before anything is allocated, the config's counts are checked against the tensor names, every
    header against the config, and the weights' size against the device's free memory. Raises ValueError naming
    the tensor, file or key on a wrong shape, dtype, weight_shape, a missing tensor, an unreadable file, a path
    outside the folder or a NaN/inf weight; OutOfMemory (a MemoryError) with the sizes when the weights do not fit.
    """
    path = Path(path)
    cfg = ModelConfig.from_file(path)
    where = config_file(path)
    if cfg.has_moe and cfg.quantization is None:
        raise ValueError(f"checkpoint: {where} has no quantization_config; only compressed-tensors "
                         "pack-quantized (INT4) routed experts are supported")
    if cfg.tie_word_embeddings:
        raise ValueError(f"checkpoint: {where}: tie_word_embeddings is not supported (K2.6 keeps a separate lm_head)")
    files = checkpoint_files(path)
    body, head = detect_prefix(files)
    check_counts(cfg, files, body, where)
    entries = checkpoint_entries(cfg)
    local = {(head if name == "lm_head.weight" else body + name): name for name in entries}
    missing = [n for n in local if n not in files]
    if missing:
        raise ValueError(f"checkpoint: {len(missing)} tensors missing from {path}, e.g. {missing[:5]}")
    headers = read_headers({full: files[full] for full in local})  # a bad shape or dtype fails before any read
    for full, (shape, dtype_name) in headers.items():
        _check(full, entries[local[full]], shape, dtype_name)
    parallel = parallel or Parallel()
    check_fits("the model's weights", model_bytes(KimiModel(cfg, parallel, dtype, "meta")), device)
    model = KimiModel(cfg, parallel, dtype, device)
    place = Placer(model)
    by_file = {}
    for full in local:
        by_file.setdefault(files[full], []).append(full)
    with tqdm(total=len(local), unit="tensor", desc="loading", disable=not progress) as bar:
        for file in sorted(by_file):
            bar.set_postfix_str(file.name)
            _load_file(file, by_file[file], local, entries, place, bar)
    return model.prepare()


def model_bytes(model):
    """Bytes of a module's own buffers (views of another buffer not counted): its size, built on "meta"."""
    return sum(b.numel() * b.element_size() for b in model.buffers() if b._base is None)


def _load_file(file, names, local, entries, place, bar):
    loaded = []  # (name, its float target): checked for NaN/inf with one device read per file
    with _open(file) as f:
        for full in names:
            name = local[full]
            target, index = place(name)
            if target is None:
                _check_weight_shape(full, f.get_tensor(full), entries, name)
            else:
                target.copy_(_read(full, f.get_slice(full), index))
                if target.is_floating_point():
                    loaded.append((full, target))
            bar.update()
    check_finite(loaded, file)


def check_finite(tensors, file, what="checkpoint"):
    """ValueError naming the first of `tensors` ((name, tensor) pairs read from `file`) holding NaN or inf."""
    if not tensors:
        return
    finite = torch.stack([t.isfinite().all() for _, t in tensors]).tolist()
    bad = [name for (name, _), ok in zip(tensors, finite) if not ok]
    if bad:
        raise ValueError(f"{what}: {bad[0]} in {file} holds NaN or inf" +
                         (f" ({len(bad) - 1} more tensors there too)" if len(bad) > 1 else ""))


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
