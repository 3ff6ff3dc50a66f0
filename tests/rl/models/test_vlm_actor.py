"""The vision-language GRPO actor and rollout engine against transformers and the loss formula.

A tiny Qwen2.5-VL built in code (``mindspeed_mm.testing``), image questions of three sizes (so the
rows of a batch have different image-token counts and need padding) and a text-only one:

- the engine samples responses; the actor's log-probs of them (right-padded microbatches, images
  concatenated) equal a plain transformers ``Qwen2_5_VLForConditionalGeneration`` (eager attention)
  forward of each sequence alone, image tokens included, within rel 1e-5; the engine's own
  log-probs (its KV-cache decode) equal them too;
- one GRPO update on a hand-built batch (2 questions x 2 responses, given advantages, two
  microbatches): its loss equals ``-sum_i A_i |r_i| / N`` (on-policy: ratio 1, token-mean over the
  N response tokens of the mini-batch) and its gradient equals the autograd gradient of
  ``-(1/N) sum_i A_i sum_t log p(r_it)`` through the transformers model (every parameter tensor
  within 1e-5 relative, or 1e-5 of its largest entry: float32 sums in another order).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from mindspeed_llm.engine import SamplingParams


@pytest.fixture(scope="module")
def vlm_setup(tiny_vlm_rl: tuple[Path, Path]) -> dict:
    from mindspeed_mm.inference.prompts import read_prompt_file
    from mindspeed_rl.algorithms.losses import policy_loss_config
    from mindspeed_rl.models.vlm_actor import VisionActor, VisionActorSettings
    from mindspeed_rl.rollout.vlm import VisionRolloutEngine

    model_dir, data = tiny_vlm_rl
    engine = VisionRolloutEngine(model_dir, 784, 3136, max_batch_size=8)
    settings = VisionActorSettings(
        lr=1e-3, clip_grad=0.0, micro_batch_size=3, loss_config=policy_loss_config("ppo_clip", kl_coef=0.0)
    )
    actor = VisionActor(model_dir, settings)
    engine.load_weights(actor.hf_state())
    prompts = read_prompt_file(data)
    chosen = [prompts[0], prompts[1], prompts[2], prompts[3]]  # 3 image sizes, and a text-only question
    return {"engine": engine, "actor": actor, "encoded": [engine.encode(p) for p in chosen], "dir": model_dir}


@pytest.fixture(scope="module")
def tiny_vlm_rl(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    from mindspeed_mm.testing import write_tiny_dataset, write_tiny_model

    root = tmp_path_factory.mktemp("rl-vlm")
    return write_tiny_model(root / "qwen2_5_vl"), write_tiny_dataset(root / "data", num_samples=8)


def _hf_model(model_dir: Path):
    """The plain transformers class named by the directory's ``config.json`` (eager attention)."""
    import json

    import transformers

    architecture = json.loads((Path(model_dir) / "config.json").read_text())["architectures"][0]
    return (
        getattr(transformers, architecture)
        .from_pretrained(str(model_dir), dtype=torch.float32, attn_implementation="eager", local_files_only=True)
        .eval()
    )


def _hf_logprobs(model, prompt, response: list[int]) -> torch.Tensor:
    """Log-probs of ``response`` after ``prompt`` by one transformers forward of the sequence alone."""
    e = prompt.encoded
    ids = torch.cat([e.input_ids, torch.tensor(response)])[None]
    types = torch.cat([e.mm_token_type_ids, torch.zeros(len(response), dtype=e.mm_token_type_ids.dtype)])[None]
    logits = model(input_ids=ids, mm_token_type_ids=types, **e.vision).logits[0]
    n = e.input_ids.numel()
    logp = torch.log_softmax(logits[n - 1 : n + len(response) - 1].double(), dim=-1)
    return logp.gather(-1, torch.tensor(response)[:, None])[:, 0]


@pytest.fixture(scope="module")
def qwen3_vl_setup(tiny_vlm_rl: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The same questions with a tiny Qwen3-VL (``mindspeed_mm``'s registered family)."""
    from mindspeed_mm.inference.prompts import read_prompt_file
    from mindspeed_mm.testing import write_tiny_model
    from mindspeed_rl.algorithms.losses import policy_loss_config
    from mindspeed_rl.models.vlm_actor import VisionActor, VisionActorSettings
    from mindspeed_rl.rollout.vlm import VisionRolloutEngine

    model_dir = write_tiny_model(tmp_path_factory.mktemp("rl-vlm3") / "qwen3_vl", "Qwen3VLForConditionalGeneration")
    engine = VisionRolloutEngine(model_dir, 784, 3136, max_batch_size=8)
    settings = VisionActorSettings(micro_batch_size=3, loss_config=policy_loss_config("ppo_clip", kl_coef=0.0))
    actor = VisionActor(model_dir, settings, trainable=False)
    engine.load_weights(actor.hf_state())
    chosen = read_prompt_file(tiny_vlm_rl[1])[:4]
    return {"engine": engine, "actor": actor, "encoded": [engine.encode(p) for p in chosen], "dir": model_dir}


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])
def test_logprobs_of_sampled_responses_equal_transformers(family: str, request: pytest.FixtureRequest) -> None:
    setup = request.getfixturevalue("vlm_setup" if family == "qwen2_5_vl" else "qwen3_vl_setup")
    engine, actor, encoded = setup["engine"], setup["actor"], setup["encoded"]
    params = [SamplingParams(max_new_tokens=6, temperature=1.0, seed=11) for _ in encoded]
    outputs = engine.generate(encoded, params)
    assert {len(o.token_ids) for o in outputs} != {0}
    assert len({p.encoded.input_ids.numel() for p in encoded}) > 1, "rows of different lengths: padding exercised"
    pairs = [(p, o.token_ids) for p, o in zip(encoded, outputs)]
    ours = actor.compute_logprobs(pairs)
    hf = _hf_model(setup["dir"])
    assert type(hf).__name__ == {"qwen2_5_vl": "Qwen2_5_VL", "qwen3_vl": "Qwen3VL"}[family] + "ForConditionalGeneration"
    image_rows = 0
    with torch.no_grad():
        for (prompt, response), mine, out in zip(pairs, ours, outputs):
            image_rows += int(prompt.encoded.mm_token_type_ids.sum() > 0)
            ref = _hf_logprobs(hf, prompt, response)
            torch.testing.assert_close(mine.double(), ref, rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(torch.tensor(out.logprobs).double(), ref, rtol=1e-5, atol=1e-5)
    assert image_rows == 3


def test_video_questions_logprobs_equal_transformers(vlm_setup: dict, tmp_path: Path) -> None:
    """Questions with videos (an .mp4, an image beside an .mp4, a folder of frames) in mllm_format: the
    engine samples, the actor's packed log-probs and the engine's equal transformers' forward of each
    sequence alone, video tokens included."""
    from mindspeed_mm.inference.prompts import read_prompt_file
    from mindspeed_mm.testing import write_tiny_video_dataset

    engine, actor = vlm_setup["engine"], vlm_setup["actor"]
    engine.load_weights(actor.hf_state())  # whatever ran before in the module
    prompts = read_prompt_file(write_tiny_video_dataset(tmp_path / "video"))
    encoded = [engine.encode(prompts[i]) for i in (0, 1, 3)]
    assert all("pixel_values_videos" in e.encoded.vision for e in encoded)
    params = [SamplingParams(max_new_tokens=5, temperature=1.0, seed=7 + i) for i in range(len(encoded))]
    outputs = engine.generate(encoded, params)
    assert {len(o.token_ids) for o in outputs} != {0}
    pairs = [(p, o.token_ids) for p, o in zip(encoded, outputs)]
    ours = actor.compute_logprobs(pairs)
    hf = _hf_model(vlm_setup["dir"])
    hf.load_state_dict(actor.hf_state())
    with torch.no_grad():
        for (prompt, response), mine, out in zip(pairs, ours, outputs):
            ref = _hf_logprobs(hf, prompt, response)
            torch.testing.assert_close(mine.double(), ref, rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(torch.tensor(out.logprobs).double(), ref, rtol=1e-5, atol=1e-5)


def test_one_update_equals_the_grpo_formula(vlm_setup: dict) -> None:
    actor, encoded = vlm_setup["actor"], vlm_setup["encoded"]
    hf = _hf_model(vlm_setup["dir"])
    hf.load_state_dict(actor.hf_state())
    responses = [[72, 105, 33], [98, 121, 101, 10], [111, 107], [110, 111, 112, 113, 114]]
    pairs = [
        (encoded[0], responses[0]),
        (encoded[0], responses[1]),
        (encoded[1], responses[2]),
        (encoded[1], responses[3]),
    ]
    advantages = torch.tensor([0.7071, -0.7071, 1.2, -0.3])
    tokens = sum(len(r) for r in responses)
    metrics = actor.update(pairs, None, advantages, None, None)
    objective = sum(-a * _hf_logprobs(hf, p, r).sum() for a, (p, r) in zip(advantages.double(), pairs)) / tokens
    objective.backward()
    expected_loss = float(-(advantages * torch.tensor([float(len(r)) for r in responses])).sum() / tokens)
    assert metrics["loss"] == pytest.approx(expected_loss, abs=1e-6)
    # update() leaves its gradient in .grad (zeroed at the start of the next update), before the AdamW step moved
    # the weights: compare with the transformers model's, whose weights are the actor's before the step.
    ours = dict(actor.model.named_parameters())
    checked = 0
    for name, param in hf.named_parameters():
        if param.grad is None:
            continue
        # float32 sums in another order (padded batch vs one sequence): within 1e-5 of the tensor's largest entry
        ref = param.grad.double()
        torch.testing.assert_close(ours[name].grad.double(), ref, rtol=1e-5, atol=1e-5 * float(ref.abs().max()))
        checked += 1
    assert checked > 10 and any(n.startswith("model.visual") for n, p in hf.named_parameters() if p.grad is not None)
    assert metrics["skipped"] == 0.0 and actor.version == 1


def _sp_ranks(rank: int, world_size: int, model_dir: str, data: str) -> dict[str, float]:
    import torch.distributed as dist

    from mindspeed_mm.inference.prompts import read_prompt_file
    from mindspeed_rl.algorithms.losses import policy_loss_config
    from mindspeed_rl.models.vlm_actor import VisionActor, VisionActorSettings
    from mindspeed_rl.rollout.vlm import VisionRolloutEngine

    engine = VisionRolloutEngine(model_dir, 784, 3136)
    prompts = [engine.encode(p) for p in read_prompt_file(data)[:4]]
    pairs = [(prompts[0], [72, 105, 33]), (prompts[1], [98, 121, 101, 10]), (prompts[3], [111, 107])]
    pairs.append((prompts[2], [110, 111, 112, 113, 114]))
    advantages = torch.tensor([0.5, -1.0, 1.2, -0.3])
    settings = VisionActorSettings(
        lr=1e-3, clip_grad=0.0, micro_batch_size=3, loss_config=policy_loss_config("ppo_clip", kl_coef=0.0)
    )
    one, two = VisionActor(model_dir, settings), VisionActor(model_dir, settings, group=dist.group.WORLD)
    worst = {"logp": 0.0, "grad": 0.0, "loss": 0.0}
    _, here = two.forward(pairs, 5)  # this rank's share of the response tokens: a part, not all
    worst["share"] = float(here.sum()) / sum(len(r) for _, r in pairs)
    for a, b in zip(one.compute_logprobs(pairs), two.compute_logprobs(pairs)):
        worst["logp"] = max(worst["logp"], float(((a - b).abs() / a.abs().clamp(min=1e-6)).max()))
    old = torch.stack([torch.nn.functional.pad(lp, (0, 5 - len(lp))) for lp in one.compute_logprobs(pairs)])
    old = old + torch.tensor([[-0.3], [0.3], [0.0], [-0.1]])
    m1 = one.update(pairs, old, advantages, None, None)  # old log-probs off the policy: ratios != 1, clipping on
    m2 = two.update(pairs, old, advantages, None, None)
    worst["loss"] = abs(m1["loss"] - m2["loss"]) / abs(m1["loss"])
    worst["clipfrac"] = abs(m1["pg_clipfrac"] - m2["pg_clipfrac"])
    worst["clipped"] = m1["pg_clipfrac"]
    for p1, p2 in zip(one.model.parameters(), two.model.parameters()):
        if p1.grad is not None:
            scale = float(p1.grad.abs().max()) or 1.0
            worst["grad"] = max(worst["grad"], float((p1.grad - p2.grad).abs().max()) / scale)
    return worst


def test_sequence_parallel_two_ranks_equal_one(tiny_vlm_rl: tuple[Path, Path]) -> None:
    """SP2 = SP1: a Ulysses group of 2 (each rank half of every packed row) gives the log-probs, the loss and the
    gradient of the unsplit actor (one spawned gloo group; the second actor of each rank is the reference)."""
    from mindspeed.testing.distributed import run_distributed

    model_dir, data = tiny_vlm_rl
    for worst in run_distributed(_sp_ranks, 2, str(model_dir), str(data)):
        assert worst["logp"] < 1e-5 and worst["loss"] < 1e-5 and worst["clipfrac"] < 1e-6, worst
        assert worst["grad"] < 1e-5, worst
        assert 0.0 < worst["share"] < 1.0, worst
        assert worst["clipped"] > 0.0, worst  # the clip is exercised
