"""Eight tensor-parallel ranks (gloo, on the CPU) decode the tokens of one process: `torchrun --nproc-per-node 8
-m spec.decode` on a small K2.6-shaped target whose heads, intermediates and vocabulary split eight ways, with a
DFlash drafter split the same way, greedy, with DDTree and target-only."""

from dataclasses import replace

import pytest

from model.config import preset
from spec.default_model import drafter_config, write_default
from tests.test_decode_cli import run_json, torchrun_json

RANKS = 8
# The tiny preset's shapes, resized so every sharded dim splits over RANKS (experts' intermediate in multiples of
# the INT4 group, 32): a dense first layer, one MoE layer of INT4 experts with a shared expert, MLA with a q LoRA.
TP8_TARGET = replace(preset("tiny"), num_hidden_layers=2, num_attention_heads=RANKS, moe_intermediate_size=RANKS * 32)
TP8_DRAFTER = replace(drafter_config(TP8_TARGET), num_hidden_layers=1, num_attention_heads=RANKS,
                      num_key_value_heads=RANKS, head_dim=16)


@pytest.fixture(scope="module")
def tp8_pair(tmp_path_factory):
    return write_default(tmp_path_factory.mktemp("tp8"), target_cfg=TP8_TARGET, dcfg=TP8_DRAFTER)


@pytest.mark.parametrize("mode", [["--tree-budget", "8"], ["--no-spec"]], ids=["ddtree", "target-only"])
def test_eight_ranks_decode_like_one_process(tp8_pair, mode):
    target, drafter = tp8_pair
    args = ["--model-path", str(target), "--draft-model-path", str(drafter), "--device", "cpu",
            "--prompt-ids", "5,17,99,300,42", "--max-new-tokens", "10", *mode]
    alone = run_json(*args)
    assert len(alone["output_ids"]) == 10
    assert torchrun_json(*args, ranks=RANKS)["output_ids"] == alone["output_ids"]
