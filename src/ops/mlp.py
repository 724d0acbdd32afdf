import torch.nn.functional as F

from ops._backend import dispatch, register


def mlp(x, gate_up_weight, down_weight):
    """SwiGLU MLP: `(silu(x @ Wg^T) * (x @ Wu^T)) @ Wd^T` (dense layer and shared expert).

    x: [M, D]; gate_up_weight: [2I, D] (gate rows then up rows); down_weight: [D, I]. Returns [M, D].
    The reference runs the matmuls in x's dtype (cuBLAS accumulates in fp32; fp32 inputs stay fp32).
    """
    if x.shape[-1] != gate_up_weight.shape[1] or gate_up_weight.shape[0] != 2 * down_weight.shape[1]:
        raise ValueError(
            f"mlp: x {tuple(x.shape)}, gate_up {tuple(gate_up_weight.shape)}, down {tuple(down_weight.shape)} "
            "do not fit [M, D], [2I, D], [D, I]"
        )
    return dispatch("mlp", x.device)(x, gate_up_weight, down_weight)


def mlp_torch(x, gate_up_weight, down_weight):
    gate, up = F.linear(x, gate_up_weight).chunk(2, dim=-1)
    return F.linear(F.silu(gate) * up, down_weight)


register("mlp", mlp_torch, "triton_kernels.glue:mlp")
