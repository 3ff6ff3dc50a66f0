"""Multi-turn tool rollouts through the real engine and the megatron actor: log-probs, the loss mask, GRPO.

A tiny Llama (random weights) with a character-level tokenizer that has Qwen2.5's tool template
and special tokens. A random policy never writes a well-formed call, so the engine is wrapped:
each sample's *first* turn is a scripted call (a good calculator call, or malformed JSON) whose
log-probs the engine scores on the context; every later turn is the engine's own sampling
(KV-cache decoding after a prefill of the context, which holds the appended tool response).
One spawned single-rank group:

- runs the agent loop for 4 samples (max 3 turns) and the actor's ``compute_logprobs`` on
  ``(prompt, whole response)``: on every generated token the rollout's log-prob equals the
  actor's single forward of the concatenated sequence (1e-6 relative to the log-prob's size; measured
  9.5e-7 absolute at most), on the scripted turn and the sampled ones after the tool response;
- updates the actor on those samples with their loss mask (ppo_clip, old log-probs shifted by
  noise so clipping is active); the parent recomputes the masked loss with transformers' autograd
  on the same weights: the gradient w.r.t. each tool-response position's log-prob is exactly zero,
  the generated positions' is not, the loss equals the actor's and the model's gradient norm equals
  the actor's (rel 1e-4), and differs from the unmasked loss's gradient norm (the mask mattered);
- PPO's critic on those samples: with the loss mask its value loss is the token mean over the
  generated tokens (the formula) and values and returns at the tool tokens change neither the loss
  nor the gradient norm (zero weight, zero gradient), without it they count;
- runs ``train_grpo`` for two steps with ``rollout.tools=[calculator]``, ``max_turns=2``: the tool
  metrics are logged, every sample made one call, and the engine's log-probs equal the actor's
  on the generated tokens after the weight sync (``rollout_logp_diff`` over the masked tokens).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch

from mindspeed.testing.distributed import run_distributed

CALLS = [
    '<tool_call>\n{"name": "calculator", "arguments": {"expression": "37 * 59"}}\n</tool_call>',
    "<tool_call>\n{not json}\n</tool_call>",
]
SPECIALS = ["<unk>", "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>"]


def char_tokenizer() -> Any:
    """Characters and Qwen2.5's special tokens in under 128 ids; ``<|im_end|>`` is id 2 (the tiny model's EOS)."""
    from tokenizers import Tokenizer, decoders
    from tokenizers.models import BPE
    from transformers import PreTrainedTokenizerFast

    from mindspeed_rl.tools import QWEN25_TOOLS_TEMPLATE

    chars = [chr(c) for c in range(32, 127)] + ["\n"]
    vocab = {token: i for i, token in enumerate([*SPECIALS, *chars])}
    core = Tokenizer(BPE(vocab, [], unk_token="<unk>"))
    core.add_special_tokens(SPECIALS)
    core.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=core, unk_token="<unk>", eos_token="<|im_end|>", pad_token="<unk>")
    fast.chat_template = QWEN25_TOOLS_TEMPLATE
    return fast


class FirstTurnScripted:
    """The engine, except that each sample's first turn is ``CALLS[k % 2]``, scored by the engine."""

    def __init__(self, engine: Any, tokenizer: Any) -> None:
        self.engine, self.tokenizer = engine, tokenizer
        self.forced: list[list[int]] = []

    def generate(self, prompts: list[list[int]], params: list[Any]) -> list[Any]:
        from mindspeed_llm.engine import GenerationOutput

        out: list[Any] = [None] * len(prompts)
        free = [i for i, p in enumerate(prompts) if any(p[: len(f)] == f for f in self.forced)]
        for i, prompt in enumerate(prompts):
            if i in free:
                continue
            ids = self.tokenizer(CALLS[len(self.forced) % 2], add_special_tokens=False)["input_ids"]
            logprobs = self.engine.score([[*prompt, *ids]])[0][-len(ids) :].tolist()
            self.forced.append([*prompt, *ids])
            out[i] = GenerationOutput(list(prompt), ids, logprobs, "stop")
        if free:
            for i, result in zip(free, self.engine.generate([prompts[i] for i in free], [params[i] for i in free])):
                out[i] = result
        return out

    def __getattr__(self, name: str) -> Any:
        return getattr(self.engine, name)


def _rollout_and_update(root: str) -> dict[str, Any]:
    from mindspeed_llm.engine import InferenceEngine, SamplingParams
    from mindspeed_rl.algorithms import policy_loss_config
    from mindspeed_rl.models.actor import Actor, ActorSettings
    from mindspeed_rl.rollout.agent import AgentLoop, AgentSettings
    from mindspeed_rl.tools import build_tools

    tokenizer = char_tokenizer()
    loop = AgentLoop(tokenizer, AgentSettings(build_tools(["calculator"]), max_turns=3, max_response_length=400))
    engine = FirstTurnScripted(InferenceEngine.from_pretrained(f"{root}/hf", max_batch_size=4), tokenizer)
    conversations = [
        [{"role": "user", "content": f"What is {a} * {b}?"}] for a, b in ((37, 59), (12, 34), (5, 6), (7, 8))
    ]
    texts = [tokenizer.apply_chat_template(c, tokenize=False, add_generation_prompt=True) for c in conversations]
    prompts = [tokenizer(text, add_special_tokens=False)["input_ids"] for text in texts]
    params = [SamplingParams(max_new_tokens=12, temperature=1.0, seed=10 + i) for i in range(4)]
    outputs = loop.generate(engine.generate, prompts, params, conversations)
    pairs = [(o.prompt_token_ids, o.token_ids) for o in outputs]

    actor = Actor(f"{root}/hf", ActorSettings.adamw(lr=1e-3, micro_batch_size=2, clip_grad=0.0))
    actor_logp = actor.compute_logprobs(pairs)
    width = max(len(r) for _, r in pairs)

    def pad(rows: list[Any]) -> torch.Tensor:
        out = torch.zeros(len(rows), width)
        for i, row in enumerate(rows):
            out[i, : len(row)] = torch.as_tensor(row, dtype=torch.float32)
        return out

    mask = pad([o.loss_mask for o in outputs])
    now = pad(actor_logp)
    old = (now + 0.3 * torch.randn(now.shape, generator=torch.Generator().manual_seed(0))) * (mask > 0)
    advantages = torch.tensor([1.0, -0.5, 0.8, -1.2])
    actor.settings.loss_config = policy_loss_config("ppo_clip", loss_agg_mode="token-mean", kl_coef=0.0)
    weights = {k: v.clone().numpy() for k, v in actor.hf_state().items()}
    metrics = actor.update(pairs, old, advantages[:, None] * mask, loss_mask=mask)
    return {
        "pairs": pairs,
        "mask": mask.numpy(),
        "rollout_logp": pad([o.logprobs for o in outputs]).numpy(),
        "actor_logp": now.numpy(),
        "old": old.numpy(),
        "advantages": advantages.numpy(),
        "weights": weights,
        "metrics": metrics,
        "summary": [(o.finish_reason, o.turns, o.tool_calls, dict(o.tool_errors)) for o in outputs],
    }


def _critic_masked(root: str, pairs: list[Any], mask: torch.Tensor) -> dict[str, Any]:
    """PPO's critic on the multi-turn samples: value-loss updates with and without the loss mask, and
    with the values and returns at the tool tokens changed. A learning rate of 1e-30 leaves the weights
    bit-equal (Adam's step is ~lr), so every update starts from the same critic."""
    from mindspeed_rl.models.critic import Critic, CriticSettings

    critic = Critic(f"{root}/hf", CriticSettings.adamw(lr=1e-30, micro_batch_size=2, clip_grad=0.0, head_std=0.5))
    width = mask.shape[1]
    lengths = torch.tensor([len(r) for _, r in pairs])
    inside = (torch.arange(width)[None] < lengths[:, None]).float()
    tools = inside * (1 - mask)
    values = torch.zeros(len(pairs), width)
    for i, row in enumerate(critic.compute_values(pairs)):
        values[i, : len(row)] = row
    returns = torch.randn(values.shape, generator=torch.Generator().manual_seed(5)) * inside
    return {
        "values": values.numpy(),
        "returns": returns.numpy(),
        "masked": critic.update(pairs, values, returns, mask),
        "tools_changed": critic.update(pairs, values + 3.0 * tools, returns - 50.0 * tools, mask),
        "unmasked": critic.update(pairs, values, returns),
        "after": [v.numpy() for v in critic.compute_values(pairs)],
    }


def _group(rank: int, world_size: int, root: str) -> dict[str, Any]:
    from mindspeed_rl.config.grpo import load_grpo_config
    from mindspeed_rl.driver import trainer

    out = {"rollout": _rollout_and_update(root)}
    out["critic"] = _critic_masked(root, out["rollout"]["pairs"], torch.from_numpy(out["rollout"]["mask"]))
    data = Path(root) / "prompts.jsonl"
    data.write_text("".join(f'{{"question": "What is {a} * 7?", "answer": "#### {a * 7}"}}\n' for a in range(10, 20)))
    config = load_grpo_config(
        None,
        [
            f"actor.model={root}/hf",
            "actor.lr=1e-3",
            "actor.micro_batch_size=4",
            f"data.path={data}",
            "data.prompt_format=chat",
            "rollout.n=2",
            "rollout.max_new_tokens=8",
            "rollout.max_prompt_length=1024",
            "rollout.tools=[calculator]",
            "rollout.max_turns=2",
            "rollout.max_response_length=300",
            "train.global_batch=2",
            "train.steps=2",
            "algorithm.kl_coef=0",
            "logging.progress=false",
        ],
    )
    build = trainer.build_context

    def scripted_context(cfg: Any) -> Any:
        ctx = build(cfg)
        ctx.engine = FirstTurnScripted(ctx.engine, ctx.tokenizer)
        return ctx

    trainer.build_context = scripted_context
    try:
        out["e2e"] = trainer.train_grpo(config)
    finally:
        trainer.build_context = build
    return out


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    from mindspeed_llm.testing.tiny_models import save_tiny_checkpoint

    root: Path = tmp_path_factory.mktemp("tools")
    save_tiny_checkpoint("llama2", root / "hf", seed=0)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (root / "hf" / name).unlink(missing_ok=True)
    char_tokenizer().save_pretrained(root / "hf")
    out = run_distributed(_group, 1, str(root), timeout=400)[0]
    out["root"] = root
    return out


def test_multi_turn_logprobs_equal_one_forward(run: dict[str, Any]) -> None:
    got = run["rollout"]
    summary = got["summary"]
    assert all(s[2] >= 1 for s in summary), summary
    assert summary[1][3].get("malformed_call", 0) >= 1, summary
    assert all(s[1] >= 2 for s in summary), "every sample generated after its tool response"
    mask = torch.from_numpy(got["mask"])
    rollout, actor = torch.from_numpy(got["rollout_logp"]), torch.from_numpy(got["actor_logp"])
    assert int((mask == 0).sum()) > 100 and int((mask == 1).sum()) > 100
    sampled_after_tools = torch.zeros_like(mask, dtype=torch.bool)
    for i, (_, response) in enumerate(got["pairs"]):
        first_gap = int((mask[i, : len(response)] == 0).nonzero()[0])
        sampled_after_tools[i, first_gap:] = mask[i, first_gap:] > 0
    assert int(sampled_after_tools.sum()) > 10
    # 1e-6 relative to the log-prob's size (at least 1): the two sides are fp32 forwards with different
    # kernels, and at |logp| ~ 5 one fp32 ulp is 4.8e-7 (measured: 9.5e-7 at most, 2e-7 on average).
    diff = (rollout - actor).abs() * mask
    assert bool((diff <= 1e-6 * actor.abs().clamp(min=1.0)).all()), float(diff.max())
    assert float(diff.max()) < 2e-6


def test_masked_update_gradient_against_autograd(run: dict[str, Any]) -> None:
    from transformers import AutoModelForCausalLM

    from mindspeed_rl.algorithms import PolicyLossInputs, compute_policy_loss, policy_loss_config

    got = run["rollout"]
    model = AutoModelForCausalLM.from_pretrained(run["root"] / "hf", dtype=torch.float32)
    model.load_state_dict({k: torch.from_numpy(v) for k, v in got["weights"].items()})
    mask = torch.from_numpy(got["mask"])
    width = mask.shape[1]
    rows = []
    for prompt, response in got["pairs"]:
        logits = model(torch.tensor([[*prompt, *response]])).logits[0]
        logp = torch.log_softmax(logits, -1)[len(prompt) - 1 : -1].gather(1, torch.tensor(response)[:, None])[:, 0]
        rows.append(torch.nn.functional.pad(logp, (0, width - len(response))))
    logp = torch.stack(rows)
    logp.retain_grad()
    config = policy_loss_config("ppo_clip", loss_agg_mode="token-mean", kl_coef=0.0)
    advantages = torch.from_numpy(got["advantages"])[:, None] * mask
    old = torch.from_numpy(got["old"])

    def loss_of(m: torch.Tensor) -> torch.Tensor:
        inputs = PolicyLossInputs(logp=logp, old_logp=old, advantages=advantages, mask=m)
        return compute_policy_loss("ppo_clip", inputs, config).loss

    loss = loss_of(mask)
    loss.backward(retain_graph=True)
    assert math.isclose(got["metrics"]["loss"], float(loss), rel_tol=1e-5, abs_tol=1e-6)
    assert got["metrics"]["pg_clipfrac"] > 0, "the clip is exercised"
    tools = (mask == 0) & (torch.arange(width)[None] < torch.tensor([len(r) for _, r in got["pairs"]])[:, None])
    assert int(tools.sum()) > 100
    assert torch.equal(logp.grad[tools], torch.zeros(int(tools.sum()))), "no gradient through tool tokens"
    assert int((logp.grad[mask > 0] != 0).sum()) > 0
    norm = torch.sqrt(sum(p.grad.double().square().sum() for p in model.parameters() if p.grad is not None))
    assert math.isclose(got["metrics"]["grad_norm"], float(norm), rel_tol=1e-4)
    model.zero_grad()
    full = (torch.arange(width)[None] < torch.tensor([len(r) for _, r in got["pairs"]])[:, None]).float()
    loss_of(full).backward()
    unmasked = torch.sqrt(sum(p.grad.double().square().sum() for p in model.parameters() if p.grad is not None))
    assert abs(float(unmasked) - float(norm)) > 1e-3 * float(norm), "the mask changes the gradient"


def test_critic_value_loss_skips_tool_tokens(run: dict[str, Any]) -> None:
    """PPO's critic: with the loss mask, the value loss is the token mean over the generated tokens only
    (the formula, rel 1e-5), and values and returns at the tool tokens change neither the loss nor the
    gradient norm (bit-equal): zero weight, zero gradient there; without the mask they would count."""
    got, mask = run["critic"], torch.from_numpy(run["rollout"]["mask"])
    values, returns = torch.from_numpy(got["values"]), torch.from_numpy(got["returns"])
    for row, after in zip(values, got["after"]):  # the 1e-30 steps left the critic as it was
        assert torch.equal(row[: len(after)], torch.from_numpy(after))
    masked, changed, unmasked = got["masked"], got["tools_changed"], got["unmasked"]
    inside = (values != 0).float()  # the values of a random critic are never exactly 0
    # The new predictions equal the scored values (same weights), so the clipped loss is 0.5 (v - G)^2.
    want = float(0.5 * ((values - returns).square() * mask).sum() / mask.sum())
    assert math.isclose(masked["vf_loss"], want, rel_tol=1e-5), (masked["vf_loss"], want)
    full = float(0.5 * ((values - returns).square() * inside).sum() / inside.sum())
    assert math.isclose(unmasked["vf_loss"], full, rel_tol=1e-5), (unmasked["vf_loss"], full)
    assert abs(full - want) > 1e-3 * want, "the tool tokens would count without the mask"
    assert changed["vf_loss"] == masked["vf_loss"] and changed["grad_norm"] == masked["grad_norm"]
    assert masked["grad_norm"] > 0 and unmasked["grad_norm"] != masked["grad_norm"]


def test_grpo_with_tools_end_to_end(run: dict[str, Any]) -> None:
    records = run["e2e"]
    assert len(records) == 2
    for record in records:
        assert record["tools/calls"] >= 1.0 and record["tools/call_rate"] == 1.0, record
        assert record["tools/turns"] >= 2.0
        assert record["tools/errors/malformed_call"] > 0 and math.isfinite(record["tools/time_s"])
        assert math.isfinite(record["loss"]) and math.isfinite(record["grad_norm"])
        assert record["rollout_logp_diff"] < 1e-5, record
