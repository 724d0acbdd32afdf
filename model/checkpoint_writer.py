"""Write small checkpoints in the exact K2.6 on-disk format (tests, the embedded default model).

Input tensors are named as in a checkpoint without its prefix (`model.layers.1.mlp.experts.3.gate_proj.weight`,
`lm_head.weight`), or as in an HF `DeepseekV3ForCausalLM` state dict, whose stacked routed experts
(`model.layers.N.mlp.experts.gate_up_proj` [E, 2I, D], `...experts.down_proj` [E, D, I]) are split per expert.
Float routed-expert weights are quantised to INT4 (`quantize_int4`); everything else is stored in `dtype`
(bf16 by default), `e_score_correction_bias` in fp32.
"""

import json
import os
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file

from model.checkpoint import INDEX_FILE, SINGLE_FILE, checkpoint_entries, quantize_int4

HF_STACKED = {"gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}


def write_checkpoint(path, cfg, tensors, shard_size_bytes=2**30, prefix="language_model.", dtype=torch.bfloat16,
                     single_file=False):
    """Write `tensors` for `cfg` to the directory `path` (which must not exist or be empty), atomically.

    prefix "language_model." gives K2.5/K2.6 names and a config.json with `text_config`; prefix "" gives
    K2-Thinking names (`model.`, `lm_head.`) and a flat config.json. Shards of at most shard_size_bytes (a
    larger tensor gets a shard of its own) plus `model.safetensors.index.json`, or one `model.safetensors`.
    Returns {input name: fp32 tensor as stored}: dequantised experts (HF-stacked inputs restacked), other
    tensors rounded through `dtype`, so a reference model can load exactly what the checkpoint holds.
    """
    stored, effective = to_checkpoint_tensors(tensors, dtype)
    entries = {("model." + n if n != "lm_head.weight" else n): e for n, e in checkpoint_entries(cfg).items()}
    missing = sorted(set(entries) - set(stored))
    if missing:
        raise ValueError(f"write_checkpoint: {len(missing)} tensors missing for this config, e.g. {missing[:5]}")
    for name, t in stored.items():
        if name in entries and tuple(t.shape) != entries[name].shape:
            raise ValueError(f"write_checkpoint: {name} has shape {tuple(t.shape)}, expected {entries[name].shape}")
    stored = {prefix + name: t.contiguous() for name, t in stored.items()}
    path = Path(path)
    if path.exists() and (not path.is_dir() or any(path.iterdir())):
        raise FileExistsError(f"write_checkpoint: {path} exists and is not an empty directory")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.tmp-", dir=path.parent))
    try:
        _write_files(tmp, stored, shard_size_bytes, single_file)
        (tmp / "config.json").write_text(json.dumps(hf_config(cfg, nested=bool(prefix)), indent=2) + "\n")
        if path.exists():
            path.rmdir()
        os.rename(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return effective


def hf_config(cfg, nested=True):
    """config.json for `cfg`: K2.5/K2.6 style (text_config nested) or flat K2-Thinking style."""
    hf = cfg.to_hf()
    if nested:
        return hf
    flat = dict(hf["text_config"])
    if "quantization_config" in hf:
        flat["quantization_config"] = hf["quantization_config"]
    return flat


def _write_files(tmp, stored, shard_size_bytes, single_file):
    if single_file:
        save_file(stored, str(tmp / SINGLE_FILE), metadata={"format": "pt"})
        return
    shards = plan_shards(stored, shard_size_bytes)
    weight_map = {}
    for i, names in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file({n: stored[n] for n in names}, str(tmp / file), metadata={"format": "pt"})
        weight_map.update({n: file for n in names})
    total = sum(t.numel() * t.element_size() for t in stored.values())
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (tmp / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")


def plan_shards(stored, shard_size_bytes):
    """Group tensor names, in order, into shards of at most shard_size_bytes each."""
    shards, size = [[]], 0
    for name, t in stored.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > shard_size_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    return shards


def to_checkpoint_tensors(tensors, dtype=torch.bfloat16):
    """Map input tensors to checkpoint names and stored dtypes: returns (stored, effective), see write_checkpoint."""
    stored, effective = {}, {}
    for name, t in tensors.items():
        stacked = name.rsplit(".", 1)
        if stacked[0].endswith("mlp.experts") and stacked[1] in HF_STACKED:
            effective[name] = _write_stacked(stored, stacked[0], stacked[1], t)
        elif ".mlp.experts." in name and name.endswith(".weight"):
            packed, scale, deq = quantize_int4(t)
            _put_expert(stored, name + "_", packed, scale)
            effective[name] = deq
        elif ".mlp.experts." in name:
            stored[name] = t
            effective[name] = t
        else:
            keep = torch.float32 if name.endswith("e_score_correction_bias") else dtype
            stored[name] = t.detach().to(keep)
            effective[name] = stored[name].float()
    return stored, effective


def _write_stacked(stored, module, kind, w):
    """Split an HF stacked expert tensor [E, rows, cols] into per-expert INT4 entries; returns it dequantised."""
    projs = HF_STACKED[kind]
    rows = w.shape[1] // len(projs)
    deq = torch.empty(w.shape, dtype=torch.float32)
    for e in range(w.shape[0]):
        for j, proj in enumerate(projs):
            packed, scale, back = quantize_int4(w[e, j * rows : (j + 1) * rows])
            _put_expert(stored, f"{module}.{e}.{proj}.weight_", packed, scale)
            deq[e, j * rows : (j + 1) * rows] = back
    return deq


def _put_expert(stored, stem, packed, scale):
    stored[stem + "packed"] = packed
    stored[stem + "scale"] = scale
    stored[stem + "shape"] = torch.tensor([packed.shape[0], packed.shape[1] * 8], dtype=torch.int32)


def random_tensors(cfg, seed=0, std=0.02):
    """Seeded random float tensors under checkpoint names (experts as float `.weight` [out, in]) for `cfg`."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name, entry in checkpoint_entries(cfg).items():
        full = name if name == "lm_head.weight" else "model." + name
        if name.endswith("weight_shape") or name.endswith("weight_scale"):
            continue
        if name.endswith("weight_packed"):
            full, shape = full[: -len("_packed")], (entry.shape[0], entry.shape[1] * 8)
        else:
            shape = entry.shape
        if "norm" in name:
            out[full] = 1.0 + 0.1 * torch.randn(shape, generator=gen)
        elif name.endswith("e_score_correction_bias"):
            out[full] = 0.1 * torch.randn(shape, generator=gen)
        else:
            out[full] = std * torch.randn(shape, generator=gen)
    return out
