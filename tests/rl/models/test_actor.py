"""The megatron actor against transformers, and weight sync into the built-in inference engine.

One spawned single-rank group builds the actor from a tiny Llama's Hugging Face directory and:

- computes per-token log-probs of (prompt, response) pairs packed in one THD microbatch (so a
  leak across sequence boundaries would show); the parent recomputes them with transformers'
  log-softmax of the HF model's logits, sequence by sequence (1e-5);
- pushes ``hf_state()`` into an ``InferenceEngine`` loaded from a *different* checkpoint and
  compares the engine's logits with the actor's, before and after an update step (the update
  must move the logits, and the engine must follow).

A two-rank group builds the actor at TP2: its gathered ``hf_state()`` equals the
checkpoint's tensors exactly, and after an update the engine's scores of the sequences equal
the actor's log-probs.

Entropy: at TP1 and TP2 (vocab-parallel logits) the actor runs two updates with the learning
rate at 0 (the weights stay the checkpoint's), without and with an entropy bonus. The reported
entropy equals the mean token entropy of transformers' logits; the loss moves by exactly
``-coef * entropy``; both gradient norms equal the norms of transformers' autograd gradients of
the same losses (the bonus's gradient flows through the vocab-parallel statistics).

The same two-rank group then builds the actor at PP2: every rank's ``hf_state()`` is the checkpoint,
every rank gets the TP1 log-probs, and an update reports the TP1 numbers on both ranks.

Then PPO's critic (:class:`~mindspeed_rl.models.critic.Critic`: the tiny Llama's decoder with a fresh,
seeded value head) at TP2 and at TP1 with DP2 (each replica one share of the pairs, two of which
answer one prompt: a shared-prompt segment at TP2, separate at DP2): its packed values equal a
plain forward of each sequence at the positions that predict each response token (1e-5), its values
at TP2 equal TP1's (1e-5), the update's gradient norm at TP2 equals the
DP2 one (rel 1e-5: the per-token loss summed over replicas and divided by the step's token count
is the whole batch's), and ``vf_loss``, ``vf_clipfrac``, ``vpred_mean`` equal the clipped loss
computed from the values (the scored values are the clip centre: nothing clipped) on every rank of
both layouts (a DP replica reports the whole batch's metrics, not its share's).

A full PPO update at TP2 equals TP1/DP2 (same group, before the critic): the actor's ``ppo_clip``
update on token-level advantages gives the same loss and gradient norm (rel 1e-5) and the same
gathered weight change (1e-5 of the largest change), and the critic's values after its update
agree to 1e-5. Both optimizers use Adam's epsilon 1 (learning rate 1): the first step is then
about the gradient itself, smooth in it, where epsilon 1e-8 makes it about its sign and blows
rounding up where gradients are near zero.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch

from mindspeed.testing.distributed import run_distributed

PAIRS = [([1, 5, 9, 14], [20, 21, 7]), ([3, 4], [30, 31, 32, 33, 2]), ([8, 9, 10, 11, 12], [40])]
ADV = [1.0, -1.0, 0.5]
ENTROPY_COEF = 0.1
#: The critic's pairs: PAIRS with a second response to the first prompt (a shared-prompt segment
#: in TP2's first microbatch, not in DP2's), and their regression targets.
CRITIC_PAIRS = [PAIRS[0], (PAIRS[0][0], [22, 23, 24, 2]), PAIRS[1], PAIRS[2]]
CRITIC_RETURNS = [[1.0, 0.5, -0.2], [0.7, -0.4, 0.0, 1.5], [0.3, 0.0, 0.1, 0.9, -1.0], [2.0]]


def _pad(rows: list[torch.Tensor]) -> torch.Tensor:
    out = torch.zeros(len(rows), max(len(r) for _, r in PAIRS))
    for i, row in enumerate(rows):
        out[i, : len(row)] = row
    return out


def _entropy_updates(actor: Any, old: torch.Tensor) -> dict[str, Any]:
    """Two updates at learning rate 0 (weights unchanged): without, then with an entropy bonus."""
    from mindspeed_rl.algorithms import policy_loss_config

    lrs = [group["lr"] for group in actor.optimizer.param_groups]
    for group in actor.optimizer.param_groups:
        group["lr"] = 0.0
    out = {}
    for key, coef in (("ent0", 0.0), ("ent1", ENTROPY_COEF)):
        actor.settings.loss_config = policy_loss_config("dapo", entropy_coef=coef)
        out[key] = actor.update(PAIRS, old, torch.tensor(ADV))
    actor.settings.loss_config = None
    for group, lr in zip(actor.optimizer.param_groups, lrs):
        group["lr"] = lr
    out["old"] = old.numpy()
    return out


def _group(rank: int, world_size: int, root: str) -> dict[str, Any]:
    from mindspeed_llm.inference import InferenceEngine
    from mindspeed_rl.models.actor import Actor, ActorSettings

    actor = Actor(f"{root}/hf", ActorSettings.adamw(lr=1e-2, micro_batch_size=2, clip_grad=0.0, loss="dapo"))
    out: dict[str, Any] = {"logp": actor.compute_logprobs(PAIRS)}
    out["entropy"] = _entropy_updates(actor, _pad(out["logp"]))
    engine = InferenceEngine.from_pretrained(f"{root}/other")
    probe = [*PAIRS[0][0], *PAIRS[0][1]]
    out["engine_before_sync"] = engine.forward_logits(probe).cpu()
    engine.load_weights(actor.hf_state())
    out["engine0"], out["actor0"] = engine.forward_logits(probe).cpu(), actor.forward_logits(probe)
    width = max(len(r) for _, r in PAIRS)
    old = torch.zeros(len(PAIRS), width)
    for i, lp in enumerate(out["logp"]):
        old[i, : len(lp)] = lp
    out["metrics"] = actor.update(PAIRS, old, torch.tensor([1.0, -1.0, 0.5]))
    engine.load_weights(actor.hf_state())
    out["engine1"], out["actor1"] = engine.forward_logits(probe).cpu(), actor.forward_logits(probe)
    # Plain arrays: tensors would travel through shared memory that dies with the rank.
    return {
        k: ([t.numpy() for t in v] if isinstance(v, list) else v.numpy() if torch.is_tensor(v) else v)
        for k, v in out.items()
    }


def _check_entropy(root: Path, got: dict[str, Any]) -> None:
    """The entropy updates of one layout against transformers' model of the checkpoint."""
    from transformers import AutoModelForCausalLM

    from mindspeed_rl.algorithms import PolicyLossInputs, compute_policy_loss, policy_loss_config

    model = AutoModelForCausalLM.from_pretrained(root / "hf", dtype=torch.float32)
    width = max(len(r) for _, r in PAIRS)
    mask = _pad([torch.ones(len(r)) for _, r in PAIRS])
    hf_entropy = torch.zeros(len(PAIRS), width)
    with torch.no_grad():
        for i, (prompt, response) in enumerate(PAIRS):
            rows = model(torch.tensor([[*prompt, *response]])).logits[0, len(prompt) - 1 : -1]
            p = torch.softmax(rows, -1)
            hf_entropy[i, : len(response)] = -(p * torch.log_softmax(rows, -1)).sum(-1)
    want = float((hf_entropy * mask).sum() / mask.sum())
    assert math.isclose(got["ent0"]["entropy"], want, abs_tol=1e-5), (got["ent0"]["entropy"], want)
    assert math.isclose(got["ent1"]["entropy"], want, abs_tol=1e-5)
    # The bonus: loss - coef * (token-mean entropy), exactly.
    assert math.isclose(got["ent1"]["loss"], got["ent0"]["loss"] - ENTROPY_COEF * got["ent0"]["entropy"], abs_tol=1e-6)
    for key, coef in (("ent0", 0.0), ("ent1", ENTROPY_COEF)):
        model.zero_grad()
        rows, logp = [], []
        for prompt, response in PAIRS:
            out = model(torch.tensor([[*prompt, *response]])).logits[0, len(prompt) - 1 : -1]
            lp = torch.log_softmax(out, -1).gather(1, torch.tensor(response)[:, None])[:, 0]
            logp.append(torch.nn.functional.pad(lp, (0, width - len(response))))
            rows.append(torch.nn.functional.pad(out, (0, 0, 0, width - len(response))))
        inputs = PolicyLossInputs(
            logp=torch.stack(logp),
            old_logp=torch.from_numpy(got["old"]),
            advantages=torch.tensor(ADV),
            mask=mask,
            logits=torch.stack(rows),
        )
        loss = compute_policy_loss("dapo", inputs, policy_loss_config("dapo", entropy_coef=coef)).loss
        loss.backward()
        norm = torch.sqrt(sum(p.grad.double().square().sum() for p in model.parameters() if p.grad is not None))
        assert math.isclose(got[key]["grad_norm"], float(norm), rel_tol=1e-4), (key, got[key]["grad_norm"], float(norm))
    assert abs(got["ent1"]["grad_norm"] - got["ent0"]["grad_norm"]) > 1e-4  # the bonus has a gradient


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    from mindspeed_llm.testing.tiny_models import save_tiny_checkpoint

    root: Path = tmp_path_factory.mktemp("actor")
    save_tiny_checkpoint("llama2", root / "hf", seed=0)
    save_tiny_checkpoint("llama2", root / "other", seed=3)
    save_tiny_checkpoint("qwen25", root / "qwen", seed=1)
    out = run_distributed(_group, 1, str(root), timeout=300)[0]
    out = {
        k: (
            [torch.from_numpy(a) for a in v]
            if isinstance(v, list)
            else torch.from_numpy(v)
            if not isinstance(v, dict)
            else v
        )
        for k, v in out.items()
    }
    out["root"] = root
    return out


def test_logprobs_match_transformers(run: dict[str, Any]) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(run["root"] / "hf", dtype=torch.float32).eval()
    for (prompt, response), got in zip(PAIRS, run["logp"]):
        ids = torch.tensor([[*prompt, *response]])
        with torch.no_grad():
            logits = model(ids).logits[0].float()
        ref = torch.log_softmax(logits, -1)[len(prompt) - 1 : -1].gather(1, torch.tensor(response)[:, None])[:, 0]
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=0)


def test_entropy_tp1_matches_transformers(run: dict[str, Any]) -> None:
    _check_entropy(run["root"], run["entropy"])


def test_weight_sync_engine_equals_actor(run: dict[str, Any]) -> None:
    # The engine started from other weights: equality after the sync is the sync's doing.
    assert (run["engine_before_sync"] - run["actor0"]).abs().max() > 1e-2
    torch.testing.assert_close(run["engine0"], run["actor0"], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(run["engine1"], run["actor1"], atol=1e-5, rtol=1e-5)
    # The update moved the weights, and the engine followed.
    assert (run["actor1"] - run["actor0"]).abs().max() > 1e-3
    assert torch.isfinite(torch.tensor(run["metrics"]["loss"]))


def _group_tp2(rank: int, world_size: int, root: str) -> dict[str, Any]:
    from mindspeed_llm.inference import InferenceEngine
    from mindspeed_rl.models.actor import Actor, ActorSettings

    actor = Actor(f"{root}/hf", ActorSettings.adamw(lr=1e-2, micro_batch_size=2, clip_grad=0.0, loss="dapo"), tp=2)
    out: dict[str, Any] = {"state0": {k: v.clone().numpy() for k, v in actor.hf_state().items()}}
    old = _pad(actor.compute_logprobs(PAIRS))
    out["entropy"] = _entropy_updates(actor, old)
    actor.update(PAIRS, old, torch.tensor(ADV))
    engine = InferenceEngine.from_pretrained(f"{root}/other")
    engine.load_weights(actor.hf_state())
    scores = engine.score([[*p, *r] for p, r in PAIRS])
    out["engine"] = [s[len(p) - 1 :].numpy() for s, (p, _) in zip(scores, PAIRS)]
    out["actor"] = [t.numpy() for t in actor.compute_logprobs(PAIRS)]
    out["old"] = [old[i, : len(r)].numpy() for i, (_, r) in enumerate(PAIRS)]
    # Qwen2.5's 131 rows are padded to 132 at TP2: the padding column must not count.
    qwen = Actor(f"{root}/qwen", ActorSettings.adamw(lr=1e-2, micro_batch_size=2, clip_grad=0.0, loss="dapo"), tp=2)
    logp = qwen.compute_logprobs(PAIRS)
    out["qwen_logp"] = [t.numpy() for t in logp]
    out["qwen_entropy"] = qwen.update(PAIRS, _pad(logp), torch.tensor(ADV))["entropy"]
    return out


def _group_two(rank: int, world_size: int, root: str) -> dict[str, Any]:
    # One spawned group for both layouts (the imports cost more than the work): TP2, then
    # megatron's parallel state is torn down and the PP2 actor builds a new one.
    from megatron.core import parallel_state as ps

    out = {"tp2": _group_tp2(rank, world_size, root)}
    ps.destroy_model_parallel()
    out["pp2"] = _group_pp2(rank, world_size, root)
    # PPO's critic (an Actor with a value head) in the same group: TP2, then TP1 with DP2.
    ps.destroy_model_parallel()
    out["critic_tp2"] = _critic_layout(root, 2, 0, 1)
    ps.destroy_model_parallel()
    out["critic_dp2"] = _critic_layout(root, 1, rank, 2)
    return out


def _critic_loaded(root: str) -> list[Any]:
    """``critic.load``: a TP1 critic with another fresh head started from the TP2 critic's checkpoint
    (saved after its update): its values of CRITIC_PAIRS."""
    from mindspeed_rl.config.ppo_checks import critic_checkpoint_dir
    from mindspeed_rl.models.critic import Critic, CriticSettings

    critic = Critic(f"{root}/hf", CriticSettings.adamw(lr=1.0, micro_batch_size=2, head_std=3.0, seed=99))
    critic.load_weights(critic_checkpoint_dir(f"{root}/critic_tp2"))  # the save directory: its newest iter_*
    return [v.numpy() for v in critic.compute_values(CRITIC_PAIRS)]


def _critic_layout(root: str, tp: int, dp_rank: int, dp: int) -> dict[str, Any]:
    """A full PPO update in one layout: the actor's (ppo_clip on token advantages, this replica's
    share of CRITIC_PAIRS) with its gathered weights before and after, then the critic's values of
    CRITIC_PAIRS (packed, and by a plain forward of each sequence), one value-loss update on this
    replica's share, the values after. Adam's epsilon 1 (learning rate 1: a step of about the
    gradient) keeps the first step smooth in the gradient, so the layouts' updates compare to 1e-5."""
    from dataclasses import replace

    from mindspeed_llm.engine import save_model_checkpoint, unwrap
    from mindspeed_rl.algorithms import policy_loss_config
    from mindspeed_rl.models.actor import Actor, ActorSettings
    from mindspeed_rl.models.critic import Critic, CriticSettings

    pick = torch.tensor([i for i in range(len(CRITIC_PAIRS)) if i % dp == dp_rank])
    mine = [CRITIC_PAIRS[i] for i in pick.tolist()]
    loss = policy_loss_config("ppo_clip", kl_coef=0.0)  # PPO's KL is in the reward
    a = ActorSettings.adamw(lr=1.0, micro_batch_size=2, clip_grad=0.0, loss="ppo_clip", loss_config=loss)
    actor = Actor(f"{root}/hf", replace(a, optimizer=replace(a.optimizer, adam_eps=1.0)), tp=tp)
    before = {k: v.clone().numpy() for k, v in actor.hf_state().items()}
    advantages = _pad([torch.tensor(r) for r in CRITIC_RETURNS]) - 0.5  # token-level, of both signs
    actor_metrics = actor.update(mine, None, advantages[pick])
    moved = {k: v.numpy() - before[k] for k, v in actor.hf_state().items()}
    settings = CriticSettings.adamw(lr=1.0, micro_batch_size=2, clip_grad=0.0, head_std=0.5, value_loss="clipped")
    critic = Critic(f"{root}/hf", replace(settings, optimizer=replace(settings.optimizer, adam_eps=1.0)), tp=tp)
    values = critic.compute_values(CRITIC_PAIRS)
    model = unwrap(critic.chunks[0])
    with torch.no_grad():  # position len(prompt) - 1 + j predicts response token j: its value is token j's
        plain = [
            model(torch.tensor([[*p, *r]]), torch.arange(len(p) + len(r))[None], None).reshape(-1)[len(p) - 1 : -1]
            for p, r in CRITIC_PAIRS
        ]
    returns = _pad([torch.tensor(r) for r in CRITIC_RETURNS])
    metrics = critic.update(mine, _pad(values)[pick], returns[pick])
    after = critic.compute_values(CRITIC_PAIRS)
    loaded = None
    if tp == 2:  # critic.load: its checkpoint starts a TP1 critic (below, resharded) with its values
        save_model_checkpoint(f"{root}/critic_tp2", 1, critic)
    else:
        loaded = _critic_loaded(root)
    return {
        "actor_metrics": actor_metrics,
        "actor_moved": moved,
        "values": [v.numpy() for v in values],
        "plain": [v.float().numpy() for v in plain],
        "after": [v.numpy() for v in after],
        "loaded": loaded,
        "metrics": metrics,
        "share_prompt": critic.share_prompt,
    }


@pytest.fixture(scope="module")
def run2(run: dict[str, Any]) -> list[dict[str, Any]]:
    return run_distributed(_group_two, 2, str(run["root"]), timeout=400)


def test_tp2_weight_sync(run: dict[str, Any], run2: list[dict[str, Any]]) -> None:
    """At TP2 the gathered HF state is the checkpoint itself, and after an update the engine follows."""
    from transformers import AutoModelForCausalLM

    root = run["root"]
    out = run2[0]["tp2"]
    want = AutoModelForCausalLM.from_pretrained(root / "hf", dtype=torch.float32).state_dict()
    assert set(out["state0"]) == set(want)
    for name, tensor in want.items():
        torch.testing.assert_close(torch.from_numpy(out["state0"][name]), tensor, atol=0, rtol=0)
    for engine, actor in zip(out["engine"], out["actor"]):
        torch.testing.assert_close(torch.from_numpy(engine), torch.from_numpy(actor), atol=1e-5, rtol=1e-5)
    assert max(float(abs(a - o).max()) for a, o in zip(out["actor"], out["old"])) > 1e-3  # the update moved them
    _check_entropy(root, out["entropy"])


def test_tp2_padded_vocabulary(run: dict[str, Any], run2: list[dict[str, Any]]) -> None:
    """A vocabulary TP2 pads (131 -> 132 rows): log-probs and entropy are the HF model's."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(run["root"] / "qwen", dtype=torch.float32).eval()
    out, entropies = run2[0]["tp2"], []
    for (prompt, response), got in zip(PAIRS, out["qwen_logp"]):
        with torch.no_grad():
            rows = model(torch.tensor([[*prompt, *response]])).logits[0, len(prompt) - 1 : -1]
        lsm = torch.log_softmax(rows, -1)
        torch.testing.assert_close(
            torch.from_numpy(got), lsm.gather(1, torch.tensor(response)[:, None])[:, 0], atol=1e-5, rtol=0
        )
        entropies.append(-(lsm.exp() * lsm).sum(-1))
    assert math.isclose(out["qwen_entropy"], float(torch.cat(entropies).mean()), abs_tol=1e-5)


def _group_pp2(rank: int, world_size: int, root: str) -> dict[str, Any]:
    from mindspeed_rl.models.actor import Actor, ActorSettings

    actor = Actor(f"{root}/hf", ActorSettings.adamw(lr=1e-2, micro_batch_size=2, clip_grad=0.0, loss="dapo"), pp=2)
    out: dict[str, Any] = {"state0": {k: v.clone().numpy() for k, v in actor.hf_state().items()}}
    logp = actor.compute_logprobs(PAIRS)
    out["logp"] = [t.numpy() for t in logp]
    out["metrics"] = actor.update(PAIRS, _pad(logp), torch.tensor(ADV))
    out["state1"] = {k: v.clone().numpy() for k, v in actor.hf_state().items()}
    out["share_prompt"] = actor.share_prompt  # unset: off where it cannot apply
    try:
        Actor(f"{root}/hf", ActorSettings(share_prompt=True), pp=2)
    except ValueError as err:
        out["share_prompt_error"] = str(err)
    return out


def test_pp2_state_and_logprobs_on_every_rank(run: dict[str, Any], run2: list[dict[str, Any]]) -> None:
    """At PP2 every rank holds the full HF state and the log-probs; the update matches TP1's."""
    from transformers import AutoModelForCausalLM

    root = run["root"]
    outs = [out["pp2"] for out in run2]
    want = AutoModelForCausalLM.from_pretrained(root / "hf", dtype=torch.float32).state_dict()
    tp1 = run["entropy"]["ent0"]  # the same loss from the same weights at TP1
    for out in outs:
        assert set(out["state0"]) == set(want)
        for name, tensor in want.items():
            torch.testing.assert_close(torch.from_numpy(out["state0"][name]), tensor, atol=0, rtol=0)
        for got, ref in zip(out["logp"], run["logp"]):
            torch.testing.assert_close(torch.from_numpy(got), ref, atol=1e-5, rtol=0)
        for key in ("loss", "entropy", "grad_norm", "pg_clipfrac"):
            assert math.isclose(out["metrics"][key], tp1[key], rel_tol=1e-4, abs_tol=1e-6), (key, out["metrics"], tp1)
        for name in want:  # after the update both ranks still agree on the whole state
            assert (outs[0]["state1"][name] == out["state1"][name]).all(), name
    assert any((outs[0]["state1"][n] != outs[0]["state0"][n]).any() for n in want)
    for out in outs:  # shared prompts need one pipeline stage: off when unset, refused when asked for
        assert out["share_prompt"] is False
        assert "actor.share_prompt=true cannot apply with pp=2" in out["share_prompt_error"]


def test_ppo_update_tp2_equals_tp1(run2: list[dict[str, Any]]) -> None:
    """A full PPO update at TP2 equals TP1 (DP2): the actor's loss, gradient norm and gathered weight change, the
    critic's values, value-loss gradient norm and values after its update; the loss metrics equal the formula."""
    from mindspeed_rl.algorithms.value_loss import ValueLossInputs, compute_value_loss

    tp1 = run2[0]["critic_dp2"]
    assert tp1["share_prompt"]  # the first microbatch at TP2 packs its two responses to one prompt as one segment
    for out in run2:  # the packed values are a plain forward's, at the positions that predict each token
        for layout in ("critic_tp2", "critic_dp2"):
            for a, b in zip(out[layout]["values"], out[layout]["plain"]):
                assert torch.allclose(torch.from_numpy(a), torch.from_numpy(b), atol=1e-5), (layout, a, b)
    # After one Adam step the values move by the update, which Adam's normalisation makes sensitive
    # to last-bit gradient differences (measured up to 2.2e-5 on an AMD EPYC): a looser bound there.
    for key, tol in (("values", 1e-5), ("after", 1e-4)):
        for out in run2:
            for a, b in zip(out["critic_tp2"][key], tp1[key]):
                assert torch.allclose(torch.from_numpy(a), torch.from_numpy(b), rtol=tol, atol=tol), (key, a, b)
    tp2 = run2[0]["critic_tp2"]
    assert max(abs(a - b).max() for a, b in zip(tp2["after"], tp2["values"])) > 1e-3  # the update moved them
    for out in run2:  # critic.load: the TP2 checkpoint's values in a TP1 critic whose own head was other
        for a, b in zip(out["critic_dp2"]["loaded"], tp2["after"]):
            assert torch.allclose(torch.from_numpy(a), torch.from_numpy(b), rtol=1e-5, atol=1e-5), ("loaded", a, b)
    # The actor's update (every rank of both layouts holds the gathered weights).
    for out in run2:
        for layout in ("critic_tp2", "critic_dp2"):
            got = out[layout]
            for key in ("loss", "grad_norm"):
                assert math.isclose(got["actor_metrics"][key], tp1["actor_metrics"][key], rel_tol=1e-5), (key, layout)
            for key in ("vf_loss", "vpred_mean"):  # each replica reports the whole batch's, not its share's
                assert math.isclose(got["metrics"][key], tp1["metrics"][key], rel_tol=1e-5), (key, layout)
            scale = max(float(abs(d).max()) for d in tp1["actor_moved"].values())
            for name, moved in tp1["actor_moved"].items():
                assert abs(got["actor_moved"][name] - moved).max() <= 1e-5 * scale, (name, layout)
    assert tp1["actor_metrics"]["grad_norm"] > 0 and scale > 1e-3  # a real update
    values = _pad([torch.from_numpy(v) for v in tp2["values"]])
    mask = _pad([torch.ones(len(r)) for _, r in CRITIC_PAIRS])
    want = compute_value_loss(
        "clipped", ValueLossInputs(values, values, _pad([torch.tensor(r) for r in CRITIC_RETURNS]), mask), 0.5
    )
    got = tp2["metrics"]
    assert math.isclose(got["vf_loss"], want.metrics["vf_loss"], rel_tol=1e-5)
    assert got["vf_clipfrac"] == 0.0
    assert math.isclose(got["vpred_mean"], want.metrics["vpred_mean"], rel_tol=1e-5, abs_tol=1e-6)
    assert math.isclose(got["grad_norm"], tp1["metrics"]["grad_norm"], rel_tol=1e-5)
    assert run2[1]["critic_tp2"]["metrics"]["grad_norm"] == got["grad_norm"]
