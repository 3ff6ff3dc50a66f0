"""The TRL side of ``tools/bench/grpo.py``: TRL's ``GRPOTrainer`` on the same work, in its own process.

``tools/bench/grpo.py`` writes the model, the prompt records and the spec, then runs
:func:`run_trl` (this file with ``--child trl``, a fresh interpreter). The child trains with
transformers generation (no vLLM), the same records in the same order, our ``math`` verifier as
its reward function, and the settings that make its work equal to ours (see ``grpo.py``'s
docstring and ``docs/rl/benchmark.md``); it reports its step periods, generation and rollout
times, generated tokens and memory as ``grpo.py``'s ``child_ours`` does.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import _child  # tools/bench/_child.py: the script's folder is on sys.path
from grpo_clock import Profiler, memory_status, now, periods


def child_trl(spec: dict[str, Any]) -> dict[str, Any]:
    """TRL's ``GRPOTrainer`` (transformers generation, no vLLM) on the same records."""
    import torch

    torch.set_num_threads(spec["threads"])
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from mindspeed_rl.rewards import build_reward

    base, load = memory_status(), os.getloadavg()[0]
    reward = build_reward(["math"])

    def math_reward(prompts: list[Any], completions: list[Any], reference: list[str], **_: Any) -> list[float]:
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        total, _parts = reward.score_batch([str(p) for p in prompts], texts, reference)
        return total.tolist()

    rows = [
        {"prompt": [{"role": "user", "content": r["prompt"]}], "reference": r["reference"]}
        for step in spec["records"]
        for r in step
    ]
    rows_per_step = spec["global_batch"] * spec["n"]
    args = GRPOConfig(
        output_dir=str(Path(spec["workdir"]) / "trl_out"),
        max_steps=spec["steps"],
        learning_rate=spec["lr"],
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        adam_beta1=0.9,
        adam_beta2=0.999,
        max_grad_norm=1.0,
        per_device_train_batch_size=spec["micro_batch"],
        gradient_accumulation_steps=rows_per_step // spec["micro_batch"],
        num_generations=spec["n"],
        max_completion_length=spec["max_new_tokens"],
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        beta=spec["beta"],
        num_iterations=1,
        epsilon=0.2,
        loss_type="dapo",
        scale_rewards="group",
        shuffle_dataset=False,
        generation_kwargs=None if spec["allow_eos"] else {"min_new_tokens": spec["max_new_tokens"]},
        # TRL turns gradient checkpointing on by default; ours recomputes nothing: same work.
        gradient_checkpointing=False,
        use_vllm=False,
        use_cpu=True,
        bf16=False,
        report_to=[],
        save_strategy="no",
        logging_strategy="no",
        disable_tqdm=True,
        seed=spec["seed"],
        dataloader_num_workers=0,
        dataloader_pin_memory=False,
    )
    model = AutoModelForCausalLM.from_pretrained(spec["model_dir"], dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(spec["model_dir"])
    starts, gen_times, gen_tokens, rollout_times, rollout_cpu = {}, [], [], [], []
    profiler = Profiler(spec, "trl")

    class Clock(TrainerCallback):
        def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            starts.setdefault(state.global_step, now())
            if state.global_step == spec["warmup"]:
                profiler.start()

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            starts[state.global_step] = now()  # the end of the last step

    class TimedTrainer(GRPOTrainer):
        def _generate_and_score_completions(self, inputs: Any) -> Any:
            start, cpu = time.perf_counter(), time.process_time()
            out = super()._generate_and_score_completions(inputs)
            rollout_times.append(time.perf_counter() - start)
            rollout_cpu.append(time.process_time() - cpu)
            return out

    trainer = TimedTrainer(
        model=model,
        reward_funcs=math_reward,
        args=args,
        train_dataset=Dataset.from_list(rows),
        processing_class=tokenizer,
        callbacks=[Clock()],
    )
    generate, prompt_width, prompt_tokens = trainer.model.generate, [], []

    def timed_generate(*a: Any, **kw: Any) -> Any:
        start = now()
        out = generate(*a, **kw)
        gen_times.append([b - a for a, b in zip(start, now())])
        prompt_width.append(kw["input_ids"].shape[1])
        mask = kw.get("attention_mask")
        prompt_tokens.append(float(mask.sum()) / mask.shape[0] if mask is not None else kw["input_ids"].shape[1])
        completion = out[:, kw["input_ids"].shape[1] :]
        # Tokens up to and including the first EOS (what TRL keeps), padding after it excluded.
        is_eos = torch.isin(completion, torch.tensor(trainer.eos_token_ids))
        first = torch.where(is_eos.any(1), is_eos.int().argmax(1) + 1, completion.shape[1])
        gen_tokens.append(int(first.sum()))
        return out

    trainer.model.generate = timed_generate
    trainer.train()
    profiler.stop()
    ends = [starts[s] for s in sorted(starts)]
    return {
        **periods(ends),
        "gen_times": gen_times,
        "gen_tokens": gen_tokens,
        "prompt_tokens": prompt_tokens,
        "rollout_times": rollout_times,
        "rollout_cpu": rollout_cpu,
        "prompt_width": prompt_width,
        "threads": torch.get_num_threads(),
        "import_rss_mb": base["rss_mb"],
        "load": [load, os.getloadavg()[0]],
        **memory_status(),
    }


CHILDREN = {"trl": child_trl}


def run_trl(spec: dict[str, Any], log: Path) -> dict[str, Any]:
    """Run :func:`child_trl` in a fresh interpreter (its output in ``log``) and return its result."""
    return _child.run_child(__file__, "trl", spec, log, {"TOKENIZERS_PARALLELISM": "false"})


def main(argv: Sequence[str] | None = None) -> int:
    """The child side only: ``grpo_trl.py --child trl --child-spec FILE`` (run it through ``grpo.py``)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--child", choices=sorted(CHILDREN), required=True)
    parser.add_argument("--child-spec", required=True)
    args = parser.parse_args(argv)
    return _child.child_main(CHILDREN, args.child, args.child_spec)


if __name__ == "__main__":
    sys.exit(main())
