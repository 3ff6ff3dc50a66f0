"""megatron-core's GatedDeltaNet runs on the CPU on the registry's gated_delta_rule and equals
transformers' Qwen3NextGatedDeltaNet with the same weights (forward and backward): through the
patches of megatron's module names, and as our RegistryGatedDeltaNet (no name rebound at run time)."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from mindspeed.testing.distributed import run_distributed

HIDDEN, KEY_HEADS, VALUE_HEADS, KEY_DIM, VALUE_DIM, CONV = 32, 2, 4, 8, 6, 4


def _hf_layer():
    from transformers import Qwen3NextConfig
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextGatedDeltaNet

    config = Qwen3NextConfig(
        hidden_size=HIDDEN,
        num_hidden_layers=1,
        layer_types=["linear_attention"],
        linear_num_key_heads=KEY_HEADS,
        linear_num_value_heads=VALUE_HEADS,
        linear_key_head_dim=KEY_DIM,
        linear_value_head_dim=VALUE_DIM,
        linear_conv_kernel_dim=CONV,
        rms_norm_eps=1e-6,
        hidden_act="silu",
    )
    layer = Qwen3NextGatedDeltaNet(config, layer_idx=0)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in layer.parameters():  # every weight random, the norm's and the decay's too
            param.copy_(0.3 * torch.randn(param.shape, generator=gen))
    return layer


def _megatron_state(hf) -> dict[str, torch.Tensor]:
    """HF's per-key-head interleaved projections as megatron's [q | k | v | z | b | a] in_proj."""
    ratio = VALUE_HEADS // KEY_HEADS
    qkvz = hf.in_proj_qkvz.weight.detach().view(KEY_HEADS, -1, HIDDEN)
    ba = hf.in_proj_ba.weight.detach().view(KEY_HEADS, -1, HIDDEN)
    cuts = [KEY_DIM, KEY_DIM, ratio * VALUE_DIM, ratio * VALUE_DIM]
    q, k, v, z = (part.reshape(-1, HIDDEN) for part in qkvz.split(cuts, dim=1))
    b, a = (part.reshape(-1, HIDDEN) for part in ba.split([ratio, ratio], dim=1))
    return {
        "in_proj.weight": torch.cat([q, k, v, z, b, a]),
        "conv1d.weight": hf.conv1d.weight.detach(),
        "dt_bias": hf.dt_bias.detach(),
        "A_log": hf.A_log.detach(),
        "out_norm.weight": hf.norm.weight.detach(),
        "out_proj.weight": hf.out_proj.weight.detach(),
    }


def _megatron_layer(impl: str, registry: bool = False):
    import torch.nn.functional as F
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.spec_utils import build_module

    from mindspeed.megatron.gated_delta_net import get_gated_delta_net_spec, get_registry_gated_delta_net_spec

    config = TransformerConfig(
        num_layers=1,
        hidden_size=HIDDEN,
        num_attention_heads=4,
        experimental_attention_variant="gated_delta_net",
        linear_attention_freq=[1],
        linear_conv_kernel_dim=CONV,
        linear_key_head_dim=KEY_DIM,
        linear_value_head_dim=VALUE_DIM,
        linear_num_key_heads=KEY_HEADS,
        linear_num_value_heads=VALUE_HEADS,
        normalization="RMSNorm",
        layernorm_epsilon=1e-6,
        activation_func=F.silu,
        add_bias_linear=False,
        use_cpu_initialization=True,
        hidden_dropout=0.0,
        attention_dropout=0.0,
    )
    spec = get_gated_delta_net_spec({"rms_norm": "reference"})
    if registry:  # our subclass: the kernel by the spec's impl, nothing of megatron's rebound
        spec = get_registry_gated_delta_net_spec({"rms_norm": "reference"}, impl)
    return build_module(
        spec, config=config, layer_number=1, pg_collection=ProcessGroupCollection.use_mpu_process_groups()
    )


def _compare(rank: int, world_size: int) -> dict:
    import megatron.core.ssm.gated_delta_net as gdn_module
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from mindspeed.device import get_accelerator
    from mindspeed.megatron import adapt, unadapt
    from mindspeed.megatron.gated_delta_net import gated_delta_net_patches
    from mindspeed.patching import PatchSet

    names_before = {name: getattr(gdn_module, name, None) for name in ("chunk_gated_delta_rule", "HAVE_FLA")}
    adapt("cpu")
    parallel_state.initialize_model_parallel(1, 1)
    model_parallel_cuda_manual_seed(1234)
    hf = _hf_layer()
    x = torch.randn(2, 19, HIDDEN, generator=torch.Generator().manual_seed(1))
    cotangent = torch.randn(2, 19, HIDDEN, generator=torch.Generator().manual_seed(2))
    hf_x = x.clone().requires_grad_(True)
    hf_out = hf(hf_x)
    hf_out.backward(cotangent)
    hf_grads = {"A_log": hf.A_log.grad, "dt_bias": hf.dt_bias.grad, "conv1d.weight": hf.conv1d.weight.grad}
    results = {}
    for impl in ("reference", "recurrent", "registry"):
        registry = impl == "registry"
        patches = PatchSet([] if registry else gated_delta_net_patches(impl))
        patches.apply(get_accelerator())
        try:
            layer = _megatron_layer("reference" if registry else impl, registry)
            missing = layer.load_state_dict(_megatron_state(hf), strict=False)
            kernel = "registry" if registry and layer.kernel.name == "reference" else None
            kernel = kernel or gdn_module.chunk_gated_delta_rule.kernel.name
            ours_x = x.transpose(0, 1).clone().requires_grad_(True)  # megatron's [s, b, h]
            out, bias = layer(ours_x, attention_mask=None)
            out.backward(cotangent.transpose(0, 1))
        finally:
            patches.revert()
        params = dict(layer.named_parameters())
        results[impl] = {
            "kernel": kernel,
            "missing": sorted(missing.missing_keys + missing.unexpected_keys),
            "bias": bias,
            "out_diff": (out.transpose(0, 1) - hf_out).abs().max().item(),
            "out_scale": hf_out.abs().max().item(),
            "x_grad_diff": (ours_x.grad.transpose(0, 1) - hf_x.grad).abs().max().item(),
            # Relative to the gradient's size: A_log's and dt_bias' sum over every token and channel.
            "param_grad_diff": {
                n: (params[n].grad - g).abs().max().item() / g.abs().max().item() for n, g in hf_grads.items()
            },
        }
    unadapt()
    parallel_state.destroy_model_parallel()
    names_after = {name: getattr(gdn_module, name, None) for name in ("chunk_gated_delta_rule", "HAVE_FLA")}
    return {"results": results, "restored": names_before == names_after}


@pytest.mark.distributed
def test_megatron_gated_delta_net_equals_transformers_qwen3_next_on_cpu() -> None:
    pytest.importorskip("transformers.models.qwen3_next")
    if importlib.util.find_spec("fla") is not None or importlib.util.find_spec("causal_conv1d") is not None:
        pytest.skip("transformers' Qwen3-Next layer would call FLA / causal-conv1d (CUDA kernels) on CPU tensors")
    (out,) = run_distributed(_compare, 1, timeout=240)
    assert out["restored"], "the patches left megatron's gated_delta_net names changed"
    for impl, row in out["results"].items():
        assert row["kernel"] == impl, row
        assert row["missing"] == [], row  # every megatron parameter came from the HF layer
        assert row["bias"] is None
        assert row["out_scale"] > 1e-2, row
        assert row["out_diff"] < 1e-5, (impl, row)
        assert row["x_grad_diff"] < 1e-5, (impl, row)
        assert max(row["param_grad_diff"].values()) < 1e-5, (impl, row)
