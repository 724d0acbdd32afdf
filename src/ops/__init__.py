"""The op boundary: one public function per hot op, a torch reference for each, and the backend table.

The model calls only these functions; `ops.use(...)` / `--kernels` / SPEC_KERNELS choose torch or Triton per op.
"""

from ops.absorb import LatentWrite, absorb_output, absorb_query
from ops._backend import (apply_env, current, dispatch, env_problem, has_triton, op_names, table, use,
                          use_kernel_configs, use_spec, using)
from ops.attention import mla_attention, pack_tree_mask, tree_mask_dense, write_kv
from ops.drafter_attention import drafter_attention
from ops.linear import linear
from ops.mlp import mlp
from ops.moe import PackedExperts, moe, norm_route, pack_int4, prepare_moe, route, unpack_int4
from ops.norm import add_rms_norm, norm_linear, rms_norm
from ops.rope import apply_rope, head_norm_rope, yarn_inv_freq, yarn_mscale
from ops.tree import Tree, accept, build_tree, compact, draft_topk

apply_env()

__all__ = [
    "absorb_output", "absorb_query", "accept", "add_rms_norm", "apply_env", "apply_rope", "build_tree", "compact",
    "current", "dispatch", "draft_topk", "drafter_attention", "env_problem", "has_triton", "head_norm_rope",
    "LatentWrite", "linear", "mla_attention", "mlp", "moe", "norm_linear", "norm_route", "op_names", "pack_int4",
    "pack_tree_mask", "PackedExperts", "prepare_moe", "rms_norm", "route", "table", "Tree", "tree_mask_dense",
    "unpack_int4", "use", "use_kernel_configs", "use_spec", "using", "write_kv", "yarn_inv_freq", "yarn_mscale",
]
