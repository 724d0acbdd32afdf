"""The embedded default: a tiny K2.6-shaped target (preset "tiny", INT4 experts) and a matching DFlash drafter,
both made from a fixed seed, written in the real on-disk formats and read back through the real loaders.
Its weights are random, so its text is noise and its drafter rarely agrees with it: it shows the machinery
end to end (and runs in seconds on a CPU), not the speed-up of a trained pair.
"""

import tempfile
from pathlib import Path

import torch

from model.checkpoint import load_model
from model.checkpoint_writer import random_tensors, write_checkpoint
from model.config import preset
from model.tokenizer import ByteTokenizer
from spec.drafter import DFlashDrafter, DrafterConfig
from spec.drafter_checkpoint import checkpoint_tensors, load_drafter, write_drafter_checkpoint

SEED = 20261129
TARGET = preset("tiny")


def drafter_config(target_cfg=TARGET, block_size=8, layers=2):
    """A small DFlash drafter for `target_cfg`: its features from the first and last target layers, the
    byte tokenizer's [UNK] as the mask token (K2.6's drafter uses [UNK] too)."""
    return DrafterConfig(
        hidden_size=target_cfg.hidden_size, num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
        head_dim=32, intermediate_size=2 * target_cfg.hidden_size, vocab_size=target_cfg.vocab_size,
        block_size=block_size, mask_token_id=ByteTokenizer(target_cfg.vocab_size).special_id("[UNK]"),
        target_layer_ids=(0, target_cfg.num_hidden_layers - 1), rope_theta=10000.0,
        max_position_embeddings=target_cfg.max_position_embeddings, num_target_layers=target_cfg.num_hidden_layers,
    )


def write_default(path, seed=SEED, target_cfg=TARGET, dcfg=None):
    """Write the target checkpoint to path/target and the drafter's to path/drafter; returns both paths."""
    path = Path(path)
    dcfg = dcfg or drafter_config(target_cfg)
    target_dir, drafter_dir = path / "target", path / "drafter"
    write_checkpoint(target_dir, target_cfg, random_tensors(target_cfg, seed), single_file=True)
    drafter = DFlashDrafter(dcfg, dtype=torch.float32).init_random_(seed + 1)
    write_drafter_checkpoint(drafter_dir, dcfg, checkpoint_tensors(drafter))
    return target_dir, drafter_dir


def load_default(dtype=torch.float32, device="cpu", seed=SEED):
    """(target, drafter, tokenizer) of the embedded default, built in a temporary directory."""
    with tempfile.TemporaryDirectory(prefix="kimi-ddtree-default-") as tmp:
        target_dir, drafter_dir = write_default(tmp, seed)
        target = load_model(target_dir, dtype=dtype, device=device, progress=False)
        drafter = load_drafter(drafter_dir, target, dtype=dtype, device=device)
    return target, drafter, ByteTokenizer(TARGET.vocab_size)
