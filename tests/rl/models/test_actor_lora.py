"""LoRA RL (``actor.lora``) against its references, in one spawned single-rank group on a tiny Llama.

The group builds the GRPO context of a recipe with ``actor.lora`` on every megatron linear and a KL
penalty (so the reference is :class:`~mindspeed_rl.models.actor_lora.AdapterOffReference`), then:

- three plain actor updates on fixed advantages (B leaves zero), then two GRPO steps (rollout,
  rewards, the adapters-off reference's log-probs, the KL-penalised update, the weight sync):
  every base weight is bit for bit the checkpoint's, every LoRA factor moved, and the optimizer
  holds exactly the factors;
- the reference: the adapters-off log-probs equal a separately built frozen actor of the same
  checkpoint (1e-6), while the actor's own (adapters on) differ from them;
- the rollout weights: ``hf_state()`` of the unfused targets (``o_proj``, ``down_proj``) equals
  ``W + (alpha / r) B A`` computed here from the checkpoint's W and the factors (float64, 1e-6), the
  built-in engine loaded with it gives the actor's logits (1e-5), and the live base weights are
  the checkpoint's again afterwards;
- resume: an adapters-only checkpoint at update k (the factors, their Adam moments, the schedule,
  the RNG; no base weight), loaded into a freshly built LoRA actor whose base comes from the model
  path, and two more updates give bit-identical log-probs and parameters to the same two updates of
  the uninterrupted actor; it is smaller than the whole-model checkpoint, and loading it into an
  actor without LoRA, or into one built on other base weights, is one line;
- export: the PEFT adapter it writes, loaded by peft over the transformers base, gives the actor's
  log-probs (1e-5) (the fused ``linear_qkv`` / ``linear_fc1`` factors split into q/k/v, gate/up).

A two-rank group does the same at TP2 (each rank merges its own pieces: A cut with a row-parallel
weight's columns, B with a column-parallel weight's rows, gate/up kept apart): after two updates the
gathered ``hf_state()`` equals the checkpoint's weights plus ``(alpha / r) B A`` of the factors of
the PEFT adapter it exports, for every adapted projection (q, k, v, o, gate, up, down of every layer; 1e-6), and the
adapters-off log-probs equal a frozen TP2 reference's.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from mindspeed.testing.distributed import run_distributed

PAIRS = [([1, 5, 9, 14], [20, 21, 7]), ([3, 4], [30, 31, 32, 33, 2]), ([8, 9, 10, 11, 12], [40])]
ADV = torch.tensor([1.0, -1.0, 0.5])
R, ALPHA = 4, 8.0
TARGETS = "[linear_qkv,linear_proj,linear_fc1,linear_fc2]"


def _pad(rows: list[torch.Tensor]) -> torch.Tensor:
    return torch.stack([torch.nn.functional.pad(t, (0, 5 - len(t))) for t in rows])


def _update(actor: Any) -> None:
    """One update on the fixed advantages, with the KL to the actor's adapters-off log-probs."""
    from mindspeed_rl.models.actor_lora import AdapterOffReference

    actor.update(PAIRS, None, ADV, _pad(AdapterOffReference(actor).compute_logprobs(PAIRS)))


def _params(actor: Any) -> dict[str, torch.Tensor]:
    from mindspeed_llm.engine import unwrap

    return {n: p.detach().clone() for n, p in unwrap(actor.chunks[0]).named_parameters()}


def _changed(before: dict[str, torch.Tensor], after: dict[str, torch.Tensor]) -> dict[str, list[str]]:
    moved = [n for n in before if not torch.equal(before[n], after[n])]
    lora = [n for n in before if "lora_" in n]
    return {"moved": sorted(moved), "lora": sorted(lora)}


def _merged_check(actor: Any, base: dict[str, torch.Tensor], root: str) -> dict[str, Any]:
    """``hf_state()`` of the unfused targets against W + (alpha / r) B A (``base``: the checkpoint's
    W), and the engine loaded with it against the actor."""
    from mindspeed_llm.engine import InferenceEngine, lora_layers, unwrap

    layers = lora_layers(unwrap(actor.chunks[0]))
    state = {k: v.clone() for k, v in actor.hf_state().items()}
    errors = {}
    for i in range(2):
        for mg, hf in (("self_attention.linear_proj", "self_attn.o_proj"), ("mlp.linear_fc2", "mlp.down_proj")):
            layer = layers[f"decoder.layers.{i}.{mg}"]
            a, b = layer.lora_A["default"].weight.double(), layer.lora_B["default"].weight.double()
            want = base[f"model.layers.{i}.{hf}.weight"].double() + (ALPHA / R) * b @ a
            errors[hf + str(i)] = float((state[f"model.layers.{i}.{hf}.weight"].double() - want).abs().max())
            errors["delta" + hf + str(i)] = float(((ALPHA / R) * b @ a).abs().max())
    engine = InferenceEngine.from_pretrained(f"{root}/hf")
    engine.load_weights(state)
    probe = [*PAIRS[1][0], *PAIRS[1][1]]
    return {
        "errors": errors,
        "engine": engine.forward_logits(probe).cpu().numpy(),
        "actor": actor.forward_logits(probe).numpy(),
    }


def _bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def _resume(actor: Any, root: str) -> dict[str, Any]:
    """An adapters-only checkpoint at update k (and a whole-model one to compare sizes), resumed into a
    fresh actor built on the base: two more updates equal the uninterrupted ones."""
    from dataclasses import replace

    from megatron.core.dist_checkpointing import load_tensors_metadata

    from mindspeed.config import ConfigError
    from mindspeed_llm.engine import load_model_checkpoint, save_model_checkpoint
    from mindspeed_llm.testing.tiny_models import save_tiny_checkpoint
    from mindspeed_rl.models.actor import Actor

    full = save_model_checkpoint(f"{root}/ckpt_full", 5, actor)
    path = actor.save_checkpoint(f"{root}/ckpt", 5)
    out: dict[str, Any] = {"bytes": {"full": _bytes(full), "adapters": _bytes(path)}}
    out["keys"] = sorted(load_tensors_metadata(str(path)))
    resumed = Actor(f"{root}/hf", actor.settings)  # the base from the model path, then the checkpoint
    load_model_checkpoint(Path(path), resumed)
    save_tiny_checkpoint("llama2", Path(root) / "hf_other", seed=1)
    for key, model_dir, settings in (
        ("no_lora_error", "hf", replace(actor.settings, lora=None)),
        ("other_base_error", "hf_other", actor.settings),
    ):
        wrong = Actor(f"{root}/{model_dir}", settings)
        try:
            load_model_checkpoint(Path(path), wrong)
        except ConfigError as err:
            out[key] = str(err)
        wrong.close()
    for name, model in (("straight", actor), ("resumed", resumed)):
        for _ in range(2):
            _update(model)
        out[name] = _pad(model.compute_logprobs(PAIRS))
    out["straight_params"], out["resumed_params"] = _params(actor), _params(resumed)
    return out


def _group(rank: int, world_size: int, root: str) -> dict[str, Any]:
    from mindspeed_rl.config.grpo import load_grpo_config
    from mindspeed_rl.driver.trainer import build_context, grpo_step
    from mindspeed_rl.models.actor import Actor
    from mindspeed_rl.models.actor_lora import AdapterOffReference

    config = load_grpo_config(
        None,
        [
            f"actor.model={root}/hf",
            "actor.lr=1e-2",
            "actor.micro_batch_size=4",
            f"actor.lora.target_modules={TARGETS}",
            f"actor.lora.r={R}",
            f"actor.lora.alpha={ALPHA}",
            "data.path=demo",
            "data.prompt_format=plain",
            "rollout.n=4",
            "rollout.max_new_tokens=4",
            "rollout.max_prompt_length=64",
            "train.global_batch=2",
            "train.steps=2",
            "algorithm.kl_coef=0.5",
            "logging.progress=false",
        ],
    )
    ctx = build_context(config)
    actor = ctx.actor
    out: dict[str, Any] = {"reference_is_view": isinstance(ctx.reference, AdapterOffReference)}
    out["optimizer_params"] = sum(p.numel() for g in actor.optimizer.param_groups for p in g["params"])
    out["trainable"] = actor.trainable_parameters()
    start = _params(actor)
    for _ in range(3):
        _update(actor)
    mid = _params(actor)
    for _ in range(2):
        grpo_step(ctx)
    out["updates"], out["grpo"] = _changed(start, mid), _changed(mid, _params(actor))
    frozen = Actor(f"{root}/hf", actor.settings, trainable=False)
    out["ref_separate"] = frozen.compute_logprobs(PAIRS)
    out["ref_view"] = ctx.reference.compute_logprobs(PAIRS)
    out["policy"] = actor.compute_logprobs(PAIRS)
    out["merged"] = _merged_check(actor, {k: v.clone() for k, v in frozen.hf_state().items()}, root)
    out["after_merge"] = _changed(start, _params(actor))
    actor.export_peft(f"{root}/peft")
    out["resume"] = _resume(actor, root)
    actor.close()
    return _plain(out)


def _plain(value: Any) -> Any:
    """Plain arrays: tensors would travel through shared memory that dies with the rank."""
    if torch.is_tensor(value):
        return value.numpy()
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value


def _group_tp2(rank: int, world_size: int, root: str) -> dict[str, Any]:
    from mindspeed_llm.engine import LoraSettings
    from mindspeed_rl.models.actor import Actor, ActorSettings
    from mindspeed_rl.models.actor_lora import AdapterOffReference

    lora = LoraSettings(r=R, alpha=ALPHA, target_modules=("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"))
    actor = Actor(f"{root}/hf", ActorSettings.adamw(lr=1e-2, micro_batch_size=2, lora=lora), tp=2)
    for _ in range(2):
        _update(actor)
    out = {"merged": {k: v.clone() for k, v in actor.hf_state().items()}}
    out["ref_view"] = AdapterOffReference(actor).compute_logprobs(PAIRS)
    out["ref_separate"] = Actor(f"{root}/hf", actor.settings, trainable=False, tp=2).compute_logprobs(PAIRS)
    actor.export_peft(f"{root}/peft_tp2")
    actor.close()
    return _plain(out)


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    from mindspeed_llm.testing.tiny_models import save_tiny_checkpoint

    root: Path = tmp_path_factory.mktemp("lora")
    save_tiny_checkpoint("llama2", root / "hf", seed=0)
    out = run_distributed(_group, 1, str(root), timeout=300)[0]
    out["root"] = root
    return out


def test_only_adapters_train(run: dict[str, Any]) -> None:
    assert run["reference_is_view"]  # no second model: the reference is the actor with adapters off
    assert run["optimizer_params"] == run["trainable"] > 0
    for phase in ("updates", "grpo"):
        assert run[phase]["moved"] == run[phase]["lora"], phase  # every factor moved, nothing else
    assert run["after_merge"]["moved"] == run["after_merge"]["lora"]  # the weight export put W back


def test_adapters_off_equals_separate_reference(run: dict[str, Any]) -> None:
    for view, separate, policy in zip(run["ref_view"], run["ref_separate"], run["policy"]):
        torch.testing.assert_close(torch.from_numpy(view), torch.from_numpy(separate), atol=1e-6, rtol=0)
        assert (torch.from_numpy(policy) - torch.from_numpy(separate)).abs().max() > 1e-3


def test_rollout_weights_are_merged(run: dict[str, Any]) -> None:
    errors = run["merged"]["errors"]
    for name, err in errors.items():
        if name.startswith("delta"):
            assert err > 1e-4, name  # the adapters trained: the merge is visible
        else:
            assert err < 1e-6, (name, err)
    torch.testing.assert_close(
        torch.from_numpy(run["merged"]["engine"]), torch.from_numpy(run["merged"]["actor"]), atol=1e-5, rtol=1e-5
    )


def test_resume_from_adapters_only_checkpoint_is_bit_exact(run: dict[str, Any]) -> None:
    r = run["resume"]
    # The checkpoint holds the factors and their Adam moments, not one base weight.
    model_keys = [k for k in r["keys"] if not k.startswith("optimizer.")]
    assert model_keys and all(".lora_A." in k or ".lora_B." in k for k in model_keys), model_keys
    assert any(k.startswith("optimizer.") and "exp_avg_sq" in k for k in r["keys"]), r["keys"]
    assert r["bytes"]["adapters"] < r["bytes"]["full"] / 2, r["bytes"]
    assert "holds LoRA adapters only" in r["no_lora_error"] and "\n" not in r["no_lora_error"]
    assert "trained on other base weights" in r["other_base_error"] and "\n" not in r["other_base_error"]
    assert torch.equal(torch.from_numpy(r["straight"]), torch.from_numpy(r["resumed"]))
    for name, value in r["straight_params"].items():
        assert (value == r["resumed_params"][name]).all(), name


def test_peft_adapter_gives_the_actor_logprobs(run: dict[str, Any]) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(run["root"] / "hf", dtype=torch.float32)
    model = PeftModel.from_pretrained(base, run["root"] / "peft").eval()
    for (prompt, response), got in zip(PAIRS, run["policy"]):
        with torch.no_grad():
            logits = model(torch.tensor([[*prompt, *response]])).logits[0].float()
        want = torch.log_softmax(logits, -1)[len(prompt) - 1 : -1].gather(1, torch.tensor(response)[:, None])[:, 0]
        torch.testing.assert_close(torch.from_numpy(got), want, atol=1e-5, rtol=0)


def test_tp2_merged_weights_and_reference(tmp_path: Path) -> None:
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from mindspeed_llm.testing.tiny_models import save_tiny_checkpoint

    save_tiny_checkpoint("llama2", tmp_path / "hf", seed=0)
    out = run_distributed(_group_tp2, 2, str(tmp_path), timeout=300)[0]
    base = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).state_dict()
    factors = load_file(tmp_path / "peft_tp2" / "adapter_model.safetensors")
    checked = 0
    for key in factors:
        if ".lora_A." not in key:
            continue
        module = key.split("base_model.model.", 1)[1].rsplit(".lora_A.", 1)[0]
        a, b = factors[key].double(), factors[key.replace(".lora_A.", ".lora_B.")].double()
        want = base[f"{module}.weight"].double() + (ALPHA / R) * b @ a
        got = torch.from_numpy(out["merged"][f"{module}.weight"]).double()
        assert (b.abs().max() > 0) and (got - want).abs().max() < 1e-6, module
        checked += 1
    layers = sum(key.endswith("self_attn.q_proj.weight") for key in base)
    assert layers > 0 and checked == 7 * layers  # q, k, v, o, gate, up, down in each layer
    for view, separate in zip(out["ref_view"], out["ref_separate"]):
        torch.testing.assert_close(torch.from_numpy(view), torch.from_numpy(separate), atol=1e-6, rtol=0)
