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


class PhaseClock:
    """Wall and process CPU seconds of named phases, summed per step (``end_step`` closes a step)."""

    def __init__(self) -> None:
        self.wall: dict[str, list[float]] = {}
        self.cpu: dict[str, list[float]] = {}
        self._open: dict[str, list[float]] = {}

    def wrap(self, name: str, fn: Any) -> Any:
        """``fn`` with its calls' time added to phase ``name``."""

        def clocked(*args: Any, **kwargs: Any) -> Any:
            wall, proc = time.perf_counter(), time.process_time()
            try:
                return fn(*args, **kwargs)
            finally:
                total = self._open.setdefault(name, [0.0, 0.0])
                total[0] += time.perf_counter() - wall
                total[1] += time.process_time() - proc

        return clocked

    def end_step(self) -> None:
        """Close the step: every phase seen so far gets its total (0 where it did not run)."""
        for name in {*self._open, *self.wall}:
            wall, cpu = self._open.get(name, [0.0, 0.0])
            self.wall.setdefault(name, []).append(wall)
            self.cpu.setdefault(name, []).append(cpu)
        self._open.clear()


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
    clock = PhaseClock()
    gen_tokens: list[int] = []
    generation = module.batch_generation

    def batch_generation(*args: Any, **kwargs: Any) -> Any:
        query_responses, logits = generation(*args, **kwargs)
        gen_tokens.append(int(logits.shape[0] * logits.shape[1]))
        return query_responses, logits

    module.batch_generation = clock.wrap("generation", batch_generation)
    forward, get_reward = module.forward, module.get_reward
    ref_forward, update_forward = clock.wrap("ref_logp", forward), clock.wrap("update", forward)
    values = clock.wrap("values", get_reward)

    def timed_forward(*args: Any, **kwargs: Any) -> Any:  # with gradients: the update's policy + value forward
        return update_forward(*args, **kwargs) if torch.is_grad_enabled() else ref_forward(*args, **kwargs)

    def timed_get_reward(model: Any, query_responses: Any, pad_token_id: int, context_length: int) -> Any:
        if model is reward:
            return None, torch.zeros(query_responses.shape[0]), None
        return values(model, query_responses, pad_token_id, context_length)

    module.forward, module.get_reward = timed_forward, timed_get_reward
    marks: list[tuple[float, float, float]] = []

    class Clock(TrainerCallback):
        def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            marks.append(now())

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            marks.append(now())
            clock.end_step()

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
    # the rest of the update: backward and optimizer steps (the loss's own arithmetic stays in "other")
    trainer.accelerator.backward = clock.wrap("update", trainer.accelerator.backward)
    if trainer.optimizer is not None:
        trainer.optimizer.step = clock.wrap("update", trainer.optimizer.step)
    trainer.train()
    return {
        **periods(marks),
        "phases": clock.wall,
        "phases_cpu": clock.cpu,
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
