"""Kernel swap: each op with a Triton kernel switched on alone (and all together) leaves the model's logits and
hidden states (prefill and a tree verify pass) and the drafter's logits at the all-torch values, and the
engine's greedy output and acceptance unchanged: any kernel can be swapped in by itself. Runs under
TRITON_INTERPRET=1 on CPU (fp16/fp32), bf16 too on a GPU."""

import pytest
import torch

import ops
from model.config import preset
from model.model import KimiModel
from spec.drafter import DFlashDrafter
from spec.default_model import drafter_config
from spec.engine import Engine
from tests.conftest import TRITON_DEVICE, kernel_dtypes, rel_err, requires_triton
from tests.test_engine import OracleDrafter
from tests.test_model_vs_hf import one_thread  # noqa: F401 (autouse fixture)

TREE_OPS = ("draft_topk", "tree_build", "accept", "compact")
KERNELS = [n for n in ops.op_names() if ops.has_triton(n)]
MODEL_KERNELS = [n for n in KERNELS if n not in TREE_OPS]
TREE_KERNELS = [n for n in KERNELS if n in TREE_OPS]
SIXTEEN_BIT_ONLY = {"moe"}  # the INT4 MoE kernel takes fp16/bf16 activations only (it refuses fp32)
BOUND = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 2e-2}
CFG = preset("tiny")


def model_swaps():
    """Each model kernel alone, then all of them, per dtype the tests run kernels in (kernels that refuse a
    dtype left out of its cases)."""
    for dtype in kernel_dtypes():
        names = [n for n in MODEL_KERNELS if dtype != torch.float32 or n not in SIXTEEN_BIT_ONLY]
        for case, label in [([n], n) for n in names] + [(names, "all")]:
            yield pytest.param(case, dtype, id=f"{label}-{str(dtype).split('.')[-1]}")


def forward_outputs(model, drafter):
    """Prefill 9 tokens into 2 rows, draft a block from their features, then verify a 12-node tree: logits
    and hidden states of both target passes and the drafter's logits."""
    gen, dev = torch.Generator().manual_seed(0), model.device
    cache = model.new_cache(2, 32)
    tokens = torch.randint(0, CFG.vocab_size, (2, 9), generator=gen).to(dev)
    first = model(tokens, torch.arange(9, device=dev).expand(2, 9), cache, hidden_layers=(0, 2))
    cache.advance([9, 9])
    draft_cache = drafter.new_cache(2, 32)
    drafter.append_context(draft_cache, first.hidden, torch.tensor([9, 7], dtype=torch.int32, device=dev), [9, 7])
    draft = drafter.draft(draft_cache, torch.tensor([5, 6], device=dev))
    logprobs = torch.randn(2, 4, 5, generator=gen).log_softmax(-1).sort(-1, descending=True).values.to(dev)
    with ops.using(tree_build="torch"):
        tree = ops.build_tree(logprobs, torch.randint(0, CFG.vocab_size, (2, 4, 5), generator=gen).to(dev),
                              torch.tensor([3, 4], device=dev), 11)
    second = model(tree.tokens, cache.lens[:, None].long() + tree.depths, cache, tree_mask=tree.mask,
                   hidden_layers=(1,))
    return [first.logits, first.hidden, draft, second.logits, second.hidden]


def switch(model, names):
    """Switch `names` to Triton, re-preparing the experts for the moe backend now chosen."""
    ops.use(**{n: "triton" for n in names})
    model.prepare()


@requires_triton
@pytest.mark.parametrize("names, dtype", model_swaps())
def test_model_outputs_with_kernel_swapped_in(names, dtype):
    model = KimiModel(CFG, dtype=dtype, device=TRITON_DEVICE).init_random_(1).prepare()
    drafter = DFlashDrafter(drafter_config(CFG), dtype=dtype, device=TRITON_DEVICE).init_random_(2).bind(model)
    reference = forward_outputs(model, drafter)
    switch(model, names)
    swapped = forward_outputs(model, drafter)
    for name, out, ref in zip(("prefill logits", "prefill hidden", "draft logits", "verify logits", "verify hidden"), swapped,
                              reference):
        assert not out.isnan().any(), name
        assert rel_err(out, ref) < BOUND[dtype], name


@requires_triton
@pytest.mark.parametrize("names", [[n] for n in TREE_KERNELS] + [TREE_KERNELS], ids="+".join)
def test_engine_output_with_tree_kernel_swapped_in(names):
    target = KimiModel(CFG, dtype=torch.float32, device=TRITON_DEVICE).init_random_(2).prepare()
    drafter = DFlashDrafter(drafter_config(CFG), dtype=torch.float32, device=TRITON_DEVICE).init_random_(3).bind(target)
    prompts = [[10, 11, 12, 13, 14], [200, 201]]
    new = 2 if "draft_topk" in names else 6  # its interpreted kernel is the slow part: one step
    greedy = Engine(target).generate(prompts, new, spec=False).output_ids
    oracle = OracleDrafter(drafter, [p + g for p, g in zip(prompts, greedy)])
    engine = Engine(target, oracle, 12)
    oracle.gen.manual_seed(0)
    reference = engine.generate(prompts, new)
    assert reference.output_ids == greedy and reference.mean_accept_length > 1
    switch(target, names)
    oracle.gen.manual_seed(0)
    swapped = engine.generate(prompts, new)
    assert swapped.output_ids == reference.output_ids
    assert swapped.accept_lengths == reference.accept_lengths
