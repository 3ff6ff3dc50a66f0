"""Data parallelism (and FSDP2) of vision-language GRPO: two data-parallel ranks = one rank.

One spawned gloo group of 2 ranks; on each rank three runs of the same recipe (tiny Qwen2.5-VL built in
code, 2 questions x 4 samples a step, two mini-batches a step so the second update is off the policy,
a KL penalty so the frozen reference runs too, a reward that varies on the untrained model):

- ``one``: the 1-rank run (no process group used);
- ``dp2``: ``actor.dp=2``: each rank generates and scores half of the step's requests (gathered), trains on
  half of every mini-batch, the gradients and metric sums are summed over the ranks;
- ``fsdp2``: the same with ``actor.fsdp=true``: the policy sharded by the multimodal trainer's FSDP2 plan,
  the engine loaded with the gathered weights.

Over 2 steps (rollout, rewards, advantages, old / reference log-probs, 2 updates, weight sync) the
replies, rewards and lengths are the 1-rank run's exactly, every other metric within rel 1e-5, and the
policy's weights after the 2 steps equal. One update of a mini-batch whose halves differ in having images
(rank 0's share has, rank 1's has not), packed 3 rows a forward (more than a rank's share), gives the
1-rank update's loss, gradient norm and gradients too. The engine's replies do not depend on the batch they are
decoded in (each request its own random stream): 8 prompts in one batch = one at a time.
"""

from __future__ import annotations

from pathlib import Path

import torch

RECIPE = Path(__file__).resolve().parents[3] / "examples" / "rl" / "grpo_vlm_tiny_cpu.yaml"


def _overrides(model: str, data: str) -> list[str]:
    return [
        f"actor.model={model}",
        f"data.path={data}",
        f"data.eval_path={data}",
        "train.global_batch=2",
        "actor.mini_batch_size=1",  # two updates a step: the second one off the policy (ratios != 1)
        "actor.micro_batch_size=2",
        "rollout.n=4",
        "rollout.max_new_tokens=4",
        "rollout.max_num_seqs=3",  # batches of 3: the rows' neighbours differ between the layouts
        "algorithm.kl_coef=0.05",  # a frozen reference: its log-probs are shared over the ranks too
        "reward.verifiers=[format]",
        "reward.options.format.pattern=a|e|i|o|u|[0-9]",
    ]


def _ranks(rank: int, world_size: int, model: str, data: str, save: str) -> dict:
    import time

    from mindspeed_llm.engine import SamplingParams
    from mindspeed_rl.config.grpo import load_grpo_config
    from mindspeed_rl.driver.vlm_checkpoint import resume_vlm, save_vlm_checkpoint
    from mindspeed_rl.driver.vlm_cli import vlm_groups
    from mindspeed_rl.driver.vlm_trainer import build_vlm_context, vlm_step

    out: dict = {"seconds": {}}
    runs = {"one": [], "dp2": ["actor.dp=2"], "fsdp2": ["actor.dp=2", "actor.fsdp=true", f"checkpoint.save={save}"]}
    for name, extra in runs.items():
        mark = time.perf_counter()
        config = load_grpo_config(RECIPE, [*_overrides(model, data), *extra])
        ctx = build_vlm_context(config, *vlm_groups(config.actor.dp, 1))  # the launcher's (dp, sp) mesh
        cache: dict = {}
        start = {k: v.detach().clone() for k, v in ctx.actor.hf_state().items()}
        records = [vlm_step(ctx, cache)]
        if config.checkpoint.save:  # the sharded model and AdamW state after step 1 (DCP), then step 2
            save_vlm_checkpoint(ctx)
        records.append(vlm_step(ctx, cache))
        state = {k: v.detach().clone() for k, v in ctx.actor.hf_state().items()}
        engine = {k: v.detach().clone() for k, v in ctx.engine.loaded.model.state_dict().items()}
        grads = {
            n: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).detach().clone()
            for n, p in ctx.actor.model.named_parameters()
            if p.grad is not None
        }
        moved = max(float((state[k] - start[k]).abs().max()) for k in state)
        out[name] = {
            "records": records,
            "state": state,
            "engine": engine,
            "fsdp": ctx.actor.fsdp,
            "moved": moved,
            "grads": grads,
        }
        if name == "one":  # batch independence of the engine's sampling, on this run's prompts
            prompts = [cache[k] for k in sorted(cache)][:2] * 4
            params = [SamplingParams(max_new_tokens=6, temperature=1.0, seed=100 + i) for i in range(8)]
            ctx.engine.max_batch_size = 8
            together = [o.token_ids for o in ctx.engine.generate(prompts, params)]
            alone = [ctx.engine.generate([p], [q])[0].token_ids for p, q in zip(prompts, params)]
            out["batch_independent"] = together == alone
            out["distinct_replies"] = len({tuple(t) for t in together})
        ctx.actor.close()
        if config.checkpoint.save:  # a new FSDP2 run resumes after step 1: step 2 as the uninterrupted run's
            again = build_vlm_context(config, *vlm_groups(2, 1))
            resumed = resume_vlm(again) is not None and again.step == 1
            second = vlm_step(again, {})
            final = again.actor.hf_state()
            out["resume"] = {
                "resumed": resumed,
                "record": {k: v for k, v in second.items() if not k.startswith("time/") and not k.endswith("_tps")}
                == {k: v for k, v in records[1].items() if not k.startswith("time/") and not k.endswith("_tps")},
                "weights": all(torch.equal(final[k], state[k]) for k in state),
            }
            again.actor.close()
        out["seconds"][name] = time.perf_counter() - mark
    out["mixed"] = _mixed_update(model, data)
    for name in ("dp2", "fsdp2"):  # compare here: only numbers go back
        one, other = out["one"], out[name]
        worst = {"metric": 0.0, "weight": 0.0, "engine": 0.0, "exact": True, "keys": True}
        for x, y in zip(one["records"], other["records"]):
            worst["keys"] &= x.keys() == y.keys()
            for key in x:
                if key.startswith("time/") or key.endswith("_tps"):
                    continue
                if key.startswith("reward") or key.startswith("response_length") or key == "policy_version":
                    worst["exact"] &= x[key] == y[key]
                else:
                    # rel 1e-5, or 1e-6 absolute for the float-noise metrics (rollout_logp_diff ~4e-7, on-policy loss)
                    err = abs(x[key] - y[key]) / max(abs(x[key]), 0.1)
                    if err > worst["metric"]:
                        worst.update(metric=err, worst_key=(key, x[key], y[key]))
        for key, value in one["state"].items():
            scale = float(value.abs().max()) or 1.0
            err = float((value - other["state"][key]).abs().max()) / scale
            if err > worst["weight"]:
                worst.update(weight=err, worst_weight=key)
            worst["engine"] = max(worst["engine"], float((other["state"][key] - other["engine"][key]).abs().max()))
        worst["grad"] = 0.0
        for key, value in one["grads"].items():
            err = float((value - other["grads"][key]).abs().max()) / (float(value.abs().max()) or 1.0)
            if err > worst["grad"]:
                worst.update(grad=err, worst_grad=(key, float(value.abs().max())))
        worst["same_grads"] = one["grads"].keys() == other["grads"].keys()  # AdamW skips the same parameters
        worst["fsdp"] = other["fsdp"]
        out[name] = worst
    records = out["one"]["records"]
    out["one"] = {
        "reward": [r["reward_mean"] for r in records],
        "clip": [r["pg_clipfrac"] for r in records],
        "moved": out["one"]["moved"],
    }
    return out


def _mixed_update(model: str, data: str) -> dict:
    """One off-policy update of a mini-batch whose first half (rank 0's share) has images and whose second half
    (rank 1's) is text only: the ranks' gradients differ in which parameters they reach (the vision tower)."""
    import torch.distributed as dist

    from mindspeed_mm.inference.prompts import read_prompt_file
    from mindspeed_rl.algorithms.losses import policy_loss_config
    from mindspeed_rl.models.vlm_actor import VisionActor, VisionActorSettings
    from mindspeed_rl.rollout.vlm import VisionRolloutEngine

    engine = VisionRolloutEngine(model, 784, 3136)
    image, text = (engine.encode(p) for p in (read_prompt_file(data)[0], read_prompt_file(data)[3]))
    assert image.encoded.vision and not text.encoded.vision
    pairs = [(image, [72, 105, 33]), (image, [98, 121, 101, 10]), (text, [111, 107]), (text, [110, 111, 112])]
    advantages = torch.tensor([0.5, -1.0, 1.2, -0.3])
    # Packs of 3: one rank packs 3 + 1 rows, a DP rank its 2 (a pack larger than its share)
    settings = VisionActorSettings(lr=1e-3, micro_batch_size=3, loss_config=policy_loss_config("ppo_clip", kl_coef=0.0))
    actors = {
        "one": VisionActor(model, settings),
        "dp2": VisionActor(model, settings, dp_group=dist.group.WORLD),
        "fsdp2": VisionActor(model, settings, dp_group=dist.group.WORLD, fsdp=True),
    }
    old = torch.stack([torch.nn.functional.pad(lp, (0, 4 - len(lp))) for lp in actors["one"].compute_logprobs(pairs)])
    old = old + torch.tensor([[-0.3], [0.3], [0.0], [-0.1]])
    metrics = {name: actor.update(pairs, old, advantages, None, None) for name, actor in actors.items()}
    grads = {
        name: {
            n: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad)
            for n, p in actor.model.named_parameters()
            if p.grad is not None
        }
        for name, actor in actors.items()
    }
    out = {}
    for name in ("dp2", "fsdp2"):  # the gradients (other packing: float32 sums in another order), not the weights
        out[name] = {
            "loss": abs(metrics[name]["loss"] - metrics["one"]["loss"]),  # absolute: a sum of terms that cancel
            "grad_norm": abs(metrics[name]["grad_norm"] - metrics["one"]["grad_norm"]) / metrics["one"]["grad_norm"],
            "grad": max(
                float((grads[name][k] - v).abs().max()) / (float(v.abs().max()) or 1.0) for k, v in grads["one"].items()
            ),
            "same_grads": float(grads[name].keys() != grads["one"].keys()),
        }
    out["loss_one"] = metrics["one"]["loss"]
    visual = [p for n, p in actors["one"].model.named_parameters() if n.startswith("model.visual.")]
    out["vision_trained"] = all(p.grad is not None for p in visual) and metrics["one"]["pg_clipfrac"] > 0
    for actor in actors.values():
        actor.close()
    return out


def test_two_data_parallel_ranks_equal_one_and_fsdp2_resumes_exactly(tmp_path: Path) -> None:
    from mindspeed.testing.distributed import run_distributed
    from mindspeed_mm.testing import write_tiny_dataset, write_tiny_model

    model = write_tiny_model(tmp_path / "model")
    data = write_tiny_dataset(tmp_path / "data", num_samples=4)
    for result in run_distributed(_ranks, 2, str(model), str(data), str(tmp_path / "ck"), timeout=300.0):
        mixed = result["mixed"]
        assert mixed["vision_trained"], mixed
        for name in ("dp2", "fsdp2"):  # loss absolute, grad norm relative, gradients of each tensor's largest entry
            assert max(mixed[name].values()) < 1e-5, (name, mixed)
        assert result["resume"] == {"resumed": True, "record": True, "weights": True}, result["resume"]
        assert result["batch_independent"] and result["distinct_replies"] > 1, result
        for name in ("dp2", "fsdp2"):
            worst = result[name]
            assert worst["keys"] and worst["exact"] and worst["same_grads"], (name, worst)
            assert worst["metric"] < 1e-5, (name, worst.get("worst_key"), worst)  # rel 1e-5 (abs 1e-6 near 0)
            assert worst["grad"] < 1e-5, (name, worst.get("worst_grad"), worst)  # the last update's, of its largest
            assert worst["weight"] < 1e-5, (name, worst.get("worst_weight"), worst)
            assert worst["engine"] == 0.0, (name, worst)  # the engine holds the (gathered) policy after the step
        assert result["fsdp2"]["fsdp"] and not result["dp2"]["fsdp"]
        assert max(result["one"]["clip"]) > 0.0, result  # the off-policy update clips: ratios != 1 exercised
        assert 0.0 < result["one"]["reward"][0] < 1.0, result  # rewards vary: advantages, a gradient
        assert result["one"]["moved"] > 1e-3, result  # the two steps changed the weights
