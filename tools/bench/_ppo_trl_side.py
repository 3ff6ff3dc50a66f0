"""The TRL side of ``tools/bench/ppo.py``: TRL's ``PPOTrainer`` on the same work, in its own environment.

TRL 1.16 (the workspace's) has no PPO trainer any more, so ``ppo.py`` runs this file with
``uv run --isolated --no-project --with trl==<TRL_VERSION> --with torch==<ours> ...``: it must
not import anything of the workspace (only the standard library, ``grpo_clock``/``_child`` next to
it, torch, transformers and TRL). :func:`trl_config_kwargs` and :func:`trl_work` are plain
arithmetic on the spec (no TRL import), so ``tests/sanity/test_bench_ppo.py`` checks that both
sides are given the same work without installing the old TRL.

Usage (through ``ppo.py``)::

    python tools/bench/_ppo_trl_side.py --child trl --child-spec SPEC.json
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

import _child  # tools/bench/_child.py: the script's folder is on sys.path
from grpo_clock import memory_status, now, periods

#: The newest TRL that still ships ``PPOTrainer`` (``trl.experimental.ppo``; gone from 1.13 on,
#: huggingface/trl#7020).
TRL_VERSION = "1.12.0"


def trl_config_kwargs(spec: dict[str, Any]) -> dict[str, Any]:
    """The ``trl.experimental.ppo.PPOConfig`` arguments that give TRL the spec's work."""
    batch = spec["global_batch"]  # one response per prompt (PPO: rollout.n = 1)
    return {
        "output_dir": str(Path(spec["workdir"]) / "trl_out"),
        "total_episodes": spec["steps"] * batch,
        "per_device_train_batch_size": spec["micro_batch"],
        # one optimizer step per mini-batch: TRL steps every `gradient_accumulation_steps` micro
        # batches, so with one mini-batch per epoch the accumulation spans the whole batch.
        "gradient_accumulation_steps": batch // spec["micro_batch"],
        "num_mini_batches": 1,
        "num_ppo_epochs": spec["ppo_epochs"],
        "local_rollout_forward_batch_size": batch,  # generate the whole batch at once, as our engine
        "response_length": spec["max_new_tokens"],
        "stop_token": None,  # never stop at EOS: every response is response_length tokens
        "temperature": 1.0,
        "learning_rate": spec["lr"],
        "lr_scheduler_type": "constant",
        "warmup_steps": 0,
        "weight_decay": 0.0,
        "kl_coef": spec["kl_coef"],
        "kl_estimator": "k1",
        "cliprange": 0.2,
        "cliprange_value": spec["cliprange_value"],
        "gamma": 1.0,
        "lam": 1.0,
        "whiten_rewards": False,
        "missing_eos_penalty": None,
        "num_sample_generations": 0,
        "gradient_checkpointing": False,
        "use_cpu": True,
        "bf16": False,
        "report_to": [],
        "save_strategy": "no",
        "logging_strategy": "no",
        "disable_tqdm": True,
        "seed": spec["seed"],
        "dataloader_num_workers": 0,
        "dataloader_pin_memory": False,
    }


def trl_work(kwargs: dict[str, Any]) -> dict[str, int]:
    """The work one TRL step does under ``kwargs`` (PPOTrainer's own batch arithmetic, one process)."""
    local_batch = kwargs["per_device_train_batch_size"] * kwargs["gradient_accumulation_steps"]
    mini_batch = local_batch // kwargs["num_mini_batches"]
    micro_per_mini = mini_batch // kwargs["per_device_train_batch_size"]
    return {
        "steps": kwargs["total_episodes"] // local_batch,
        "prompts_per_step": local_batch,
        "responses_per_step": local_batch,
        "response_tokens": kwargs["response_length"],
        "micro_batch": kwargs["per_device_train_batch_size"],
        "ppo_epochs": kwargs["num_ppo_epochs"],
        # an optimizer step every gradient_accumulation_steps micro batches
        "policy_updates_per_step": kwargs["num_ppo_epochs"]
        * kwargs["num_mini_batches"]
        * max(micro_per_mini // kwargs["gradient_accumulation_steps"], 1),
        "value_updates_per_step": kwargs["num_ppo_epochs"]
        * kwargs["num_mini_batches"]
        * max(micro_per_mini // kwargs["gradient_accumulation_steps"], 1),
    }


def child_trl(spec: dict[str, Any]) -> dict[str, Any]:
    """TRL's ``PPOTrainer`` on the spec's prompts, with per-phase clocks around its module functions."""
    import torch

    torch.set_num_threads(spec["threads"])
    import transformers
    import trl
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer, TrainerCallback
    from trl.experimental.ppo import PPOConfig, PPOTrainer
    from trl.experimental.ppo import ppo_trainer as module

    base, load = memory_status(), os.getloadavg()[0]
    torch.manual_seed(spec["seed"])
    tokenizer = AutoTokenizer.from_pretrained(spec["model_dir"], padding_side="left")
    policy = AutoModelForCausalLM.from_pretrained(spec["model_dir"], dtype=torch.float32)
    ref = AutoModelForCausalLM.from_pretrained(spec["model_dir"], dtype=torch.float32)
    value = AutoModelForSequenceClassification.from_pretrained(spec["model_dir"], num_labels=1, dtype=torch.float32)
    for model in (policy, ref, value):
        model.config.pad_token_id = tokenizer.pad_token_id

    class RuleReward(torch.nn.Module):
        """Stands for our rule-based verifier: no model forward (its score is 0)."""

    reward = RuleReward()
    phases: dict[str, list[float]] = {"generation": [], "ref_logp": [], "values": []}
    cpu: dict[str, list[float]] = {k: [] for k in phases}
    gen_tokens: list[int] = []

    def clocked(name: str, fn: Any) -> Any:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            wall, proc = time.perf_counter(), time.process_time()
            out = fn(*args, **kwargs)
            phases[name].append(time.perf_counter() - wall)
            cpu[name].append(time.process_time() - proc)
            return out

        return wrapper

    generation = module.batch_generation

    def batch_generation(*args: Any, **kwargs: Any) -> Any:
        query_responses, logits = generation(*args, **kwargs)
        gen_tokens.append(int(logits.shape[0] * logits.shape[1]))
        return query_responses, logits

    module.batch_generation = clocked("generation", batch_generation)
    forward, get_reward = module.forward, module.get_reward
    clocked_forward, clocked_values = clocked("ref_logp", forward), clocked("values", get_reward)

    def timed_forward(*args: Any, **kwargs: Any) -> Any:  # the update's forward runs with gradients: not timed here
        return forward(*args, **kwargs) if torch.is_grad_enabled() else clocked_forward(*args, **kwargs)

    def timed_get_reward(model: Any, query_responses: Any, pad_token_id: int, context_length: int) -> Any:
        if model is reward:
            return None, torch.zeros(query_responses.shape[0]), None
        return clocked_values(model, query_responses, pad_token_id, context_length)

    module.forward, module.get_reward = timed_forward, timed_get_reward
    marks: list[tuple[float, float, float]] = []

    class Clock(TrainerCallback):
        def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            marks.append(now())

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            marks.append(now())

    # our rollout's prompt token ids (the plain template, BOS added: ppo.py's prepare)
    dataset = Dataset.from_dict({"input_ids": [r["ids"] for step in spec["records"] for r in step]})
    kwargs = trl_config_kwargs(spec)
    trainer = PPOTrainer(
        args=PPOConfig(**kwargs),
        processing_class=tokenizer,
        model=policy,
        ref_model=ref,
        reward_model=reward,
        value_model=value,
        train_dataset=dataset,
        callbacks=[Clock()],
    )
    trainer.train()
    return {
        **periods(marks),
        "phases": phases,
        "phases_cpu": cpu,
        "gen_tokens": gen_tokens,
        "prompt_tokens": sum(len(x) for x in dataset["input_ids"]) / len(dataset),
        "work": trl_work(kwargs),
        "versions": {"trl": trl.__version__, "torch": torch.__version__, "transformers": transformers.__version__},
        "threads": torch.get_num_threads(),
        "load": [load, os.getloadavg()[0]],
        **memory_status(),
        "import_rss_mb": base["rss_mb"],
    }


def main(argv: list[str] | None = None) -> int:
    """``--child trl --child-spec FILE``: run :func:`child_trl` and print its result line."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--child", choices=["trl"], required=True)
    parser.add_argument("--child-spec", required=True)
    args = parser.parse_args(argv)
    return _child.child_main({"trl": child_trl}, args.child, args.child_spec)


if __name__ == "__main__":
    sys.exit(main())
