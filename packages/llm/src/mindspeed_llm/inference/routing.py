"""MoE routing of the inference decoder: which experts each token uses, and with what weights.

Two routers, chosen by the model's shape (megatron's router options, which the bridges fill):

- softmax (Mixtral, Qwen3-MoE, GPT-OSS with its router bias): softmax over all experts in fp32, top-k, the k weights
  renormalised to sum to one unless ``moe_router_pre_softmax`` (Qwen3-MoE's
  ``norm_topk_prob=False``);
- sigmoid (DeepSeek-V3): sigmoid scores in fp32; the experts are *chosen* on the scores plus a
  per-expert bias (``expert_bias``, transformers' ``e_score_correction_bias``), optionally only
  inside the best ``moe_router_group_topk`` of ``moe_router_num_groups`` groups (a group's score
  is the sum of its two best biased scores); the weights are the unbiased scores of the chosen
  experts, renormalised (``+ 1e-20``) and multiplied by ``moe_router_topk_scaling_factor``.

Both follow transformers' arithmetic, so greedy decoding picks the same experts.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mindspeed_llm.bridges import ModelShape


def route(
    tokens: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    shape: ModelShape,
    logit_bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(weights [tokens, k] fp32, chosen [tokens, k])`` of the experts of ``tokens`` ``[tokens, hidden]``.

    Args:
        tokens: the normed hidden states.
        weight: the router ``[experts, hidden]``.
        bias: the per-expert selection bias (``None``: none).
        shape: the model (router options).
        logit_bias: the router's own bias, added to its logits (GPT-OSS; ``None``: none).
    """
    logits = F.linear(tokens.float(), weight.float(), None if logit_bias is None else logit_bias.float())
    k = shape.moe_router_topk
    if shape.moe_router_score_function == "softmax":
        weights, chosen = torch.topk(torch.softmax(logits, dim=-1), k, dim=-1)
        if not shape.moe_router_pre_softmax:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights, chosen
    scores = logits.sigmoid()
    choice = scores if bias is None else scores + bias.float()
    groups = shape.moe_router_num_groups
    if groups and groups > 1:
        per_group = choice.view(-1, groups, choice.shape[-1] // groups)
        group_scores = per_group.topk(2, dim=-1)[0].sum(dim=-1)
        best = torch.topk(group_scores, k=int(shape.moe_router_group_topk), dim=-1, sorted=False)[1]
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
        choice = choice.masked_fill(~keep[..., None].expand_as(per_group).reshape_as(choice), float("-inf"))
    chosen = torch.topk(choice, k=k, dim=-1, sorted=False)[1]
    weights = scores.gather(1, chosen)
    weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)  # the bridge requires norm_topk_prob
    return weights * float(shape.moe_router_topk_scaling_factor or 1.0), chosen
