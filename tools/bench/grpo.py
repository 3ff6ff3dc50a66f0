"""Benchmark one GRPO step of ``mindspeed_rl`` against TRL's ``GRPOTrainer`` (CPU, same work).

Both sides train the same random-weight Llama (a Hugging Face directory built here, with the
demo BPE tokenizer and its ChatML template) on the shipped arithmetic prompts (``data.path=demo``),
rewarded by our ``math`` verifier (wrapped as a TRL reward function on the TRL side), with:

- the same prompts in the same order: our ``PromptSampler`` draws each step's prompts once, here;
  both sides read those records in that order (ours from ``prompts.jsonl`` with
  ``data.shuffle=false``, TRL's dataset with ``shuffle_dataset=False``), each rendered by the same
  chat template (TRL's ``apply_chat_template`` and ours give the same prompt ids; the table shows
  each side's prompt tokens per row); ``--prompt-tokens`` puts a context of digits before each
  prompt (``--long``: 512 tokens);
- the same group size (``rollout.n`` = ``num_generations``), prompts per step (``train.global_batch``
  = ``per_device_train_batch_size x gradient_accumulation_steps / num_generations``), micro batch
  (``actor.micro_batch_size`` = ``per_device_train_batch_size``), one optimizer step per rollout
  batch (fully on-policy: ``steps_per_generation`` = ``gradient_accumulation_steps``,
  ``num_iterations`` = ``ppo_epochs`` = 1), temperature 1, no top-k/top-p, constant learning
  rate, AdamW betas, gradient clipping 1.0, PPO clip 0.2, token-mean loss (TRL's ``dapo``), fp32;
- the same KL setting: ``--beta 0`` (default) builds no reference on either side, ``--beta``
  > 0 gives both a frozen reference and a k3 KL penalty;
- the same number of generated tokens: every response is exactly ``--max-new-tokens`` long,
  ours with ``SamplingParams.ignore_eos`` (set by wrapping the engine's ``generate``), TRL with
  ``generation_kwargs={"min_new_tokens": max_new_tokens}`` (the EOS logit is masked until
  then). A random-weight model stops at EOS at random, which would make the two sides do
  different work; ``--allow-eos`` turns this off (the table then reports tokens/s as well).

Each side runs in a fresh interpreter, one after the other, with the same torch thread count
(``--threads``, default 1) and ``OMP_NUM_THREADS``. The first ``--warmup`` steps are not timed; a
side's step time is the median over the timed steps of the period from the start of one step
to the start of the next (generation, scoring, log-prob passes, update, our weight sync, TRL's
bookkeeping: everything). Generation time is measured around the generate call of each side
(our engine's ``generate``; TRL's ``model.generate``); "rollout" is generation plus scoring
(TRL: its whole ``_generate_and_score_completions``). Peak RSS is the child's ``VmHWM``. The
load average is recorded: on a shared machine absolute numbers are noisy; ratios of runs taken
back to back less so (``--repeats`` alternates the sides and keeps each side's best run).

Usage::

    uv run --frozen python tools/bench/grpo.py              # default: ~8 min on 2 cores (both tables)
    uv run --frozen python tools/bench/grpo.py --quick --no-buffer-modes  # a smoke run (~1 min)
    uv run --frozen python tools/bench/grpo.py --quick      # both tables (~2 to 4 min: Ray start-up)
    uv run --frozen python tools/bench/grpo.py --no-trl     # sync vs async only
    uv run --frozen python tools/bench/grpo.py --long --no-buffer-modes  # 512-token prompts, 8 x 128 tokens
    uv run --frozen python tools/bench/grpo.py --long --no-buffer-modes --no-share-prompt  # A/B of actor.share_prompt
    uv run --frozen python tools/bench/grpo.py --no-buffer-modes --compile  # ours with actor.compile and rollout.compile

Results and their reading: ``docs/rl/benchmark.md``. The TRL side lives in ``grpo_trl.py``, the
step clocks both sides use in ``grpo_clock.py``.

A second table runs the same recipe through the Ray driver (``mindspeed_rl.driver.runner.GRPORunner``:
the actor and a separate rollout worker) with ``buffer.mode=sync`` and ``async``
(``max_staleness`` 1) and reports the asynchronous speed-up per step (``--no-buffer-modes``
skips it).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from importlib.metadata import version
from pathlib import Path
from typing import Any

import _child  # tools/bench/_child.py: the script's folder is on sys.path
from grpo_clock import SIZES, Profiler, memory_status, now, periods
from grpo_trl import run_trl

SIDES = ("ours", "trl")
#: ``--compile`` modes: which of our parts run compiled (the actor's layers, the engine's decode step).
COMPILED = {"none": (), "rollout": ("rollout",), "actor": ("actor",), "both": ("actor", "rollout")}


# ----------------------------------------------------------------------------- preparation


def prepare(spec: dict[str, Any]) -> dict[str, Any]:
    """Write the model directory and each step's prompt records (in our sampler's order)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from mindspeed_llm.tokenizer import load_tokenizer
    from mindspeed_rl.data import PromptSampler, load_prompts

    model_dir = Path(spec["workdir"]) / f"model_{spec['size']}"
    config = LlamaConfig(
        vocab_size=2048,
        max_position_embeddings=max_positions(spec),
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        **SIZES[spec["size"]],
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    model.save_pretrained(model_dir)
    tokenizer = load_tokenizer("demo")
    tokenizer.save_pretrained(model_dir)
    records = load_prompts("demo")
    sampler = PromptSampler(len(records), spec["global_batch"], spec["seed"], shuffle=True)
    steps = [[records[i] for i in sampler.next_batch()] for _ in range(spec["steps"])]

    def length(text: str) -> int:
        return len(
            tokenizer.apply_chat_template(
                [{"role": "user", "content": text}], tokenize=True, add_generation_prompt=True, return_dict=True
            )["input_ids"]
        )

    if spec["prompt_tokens"]:
        steps = [
            [dataclasses.replace(r, prompt=lengthen(r.prompt, spec["prompt_tokens"], length)) for r in step]
            for step in steps
        ]
    prompt_tokens = [length(r.prompt) for step in steps for r in step]
    # Every side reads these records in this order (ours with data.shuffle=false): the same prompts each step.
    prompts_path = Path(spec["workdir"]) / "prompts.jsonl"
    prompts_path.write_text(
        "".join(json.dumps({"question": r.prompt, "answer": r.reference}) + "\n" for step in steps for r in step)
    )
    return {
        "model_dir": str(model_dir),
        "prompts_path": str(prompts_path),
        "parameters": sum(p.numel() for p in model.parameters()),
        "records": [[{"prompt": r.prompt, "reference": r.reference} for r in step] for step in steps],
        "prompt_tokens_mean": statistics.mean(prompt_tokens),
    }


def max_positions(spec: dict[str, Any]) -> int:
    """The model's ``max_position_embeddings``: 512, or what the prompts and responses need (a multiple of 64)."""
    need = spec["prompt_tokens"] + spec["max_new_tokens"] + 16
    return max(512, -(-need // 64) * 64)


def lengthen(prompt: str, tokens: int, length: Any) -> str:
    """``prompt`` behind a context of digits such that its chat-rendered prompt has ``tokens`` tokens
    (or the fewest above, where one more digit adds two tokens)."""
    rng = random.Random(prompt)
    words: list[str] = []
    text = prompt
    while length(text) < tokens:
        words.append(str(rng.randrange(10)))
        text = "Context: " + " ".join(words) + "\n" + prompt
    return text


# ----------------------------------------------------------------------------- children


def child_ours(spec: dict[str, Any]) -> dict[str, Any]:
    """``build_context`` + ``grpo_step`` in this process (a one-rank gloo group)."""
    import torch

    torch.set_num_threads(spec["threads"])
    from mindspeed_rl.config.grpo import load_grpo_config
    from mindspeed_rl.driver.trainer import build_context, grpo_step
    from mindspeed_rl.models.memory import freeze_startup_objects

    base, load = memory_status(), os.getloadavg()[0]
    config = load_grpo_config(
        None,
        [
            f"actor.model={spec['model_dir']}",
            f"actor.lr={spec['lr']}",
            f"actor.micro_batch_size={spec['micro_batch']}",
            "actor.clip_grad=1.0",
            "actor.lr_decay_style=constant",
            f"rollout.n={spec['n']}",
            f"rollout.max_new_tokens={spec['max_new_tokens']}",
            "rollout.temperature=1.0",
            f"rollout.max_prompt_length={max_positions(spec) - spec['max_new_tokens']}",
            f"rollout.max_num_seqs={spec['global_batch'] * spec['n']}",
            f"train.global_batch={spec['global_batch']}",
            f"train.steps={spec['steps']}",
            f"train.seed={spec['seed']}",
            f"algorithm.kl_coef={spec['beta']}",
            "algorithm.kl_estimator=k3",
            "algorithm.loss_agg_mode=token-mean",
            f"data.path={spec['prompts_path']}",
            "data.shuffle=false",
            "data.prompt_format=chat",
            "logging.progress=false",
            "logging.tensorboard=false",
            "logging.reward_curve=false",
            *([] if spec["share_prompt"] else ["actor.share_prompt=false"]),
            *(f"{part}.compile=true" for part in COMPILED[spec.get("compile") or "none"]),
        ],
    )
    ctx = build_context(config)
    if spec["share_prompt"] and not ctx.actor.share_prompt:
        raise SystemExit("the actor does not share prompts here (see its log); run with --no-share-prompt")
    freeze_startup_objects()  # as train_grpo does
    generate, gen_times, gen_tokens, prompt_tokens = ctx.engine.generate, [], [], []

    def timed_generate(prompts: Any, params: Any) -> Any:
        if not spec["allow_eos"]:
            params = [dataclasses.replace(p, ignore_eos=True) for p in params]
        start = now()
        outputs = generate(prompts, params)
        gen_times.append([b - a for a, b in zip(start, now())])
        gen_tokens.append(sum(len(o.token_ids) for o in outputs))
        prompt_tokens.append(statistics.mean(len(p) for p in prompts))
        return outputs

    ctx.engine.generate = timed_generate
    if not spec["prefix_sharing"]:
        ctx.engine.prefix_sharing = False
    update, update_cpu = ctx.actor.update, []

    def timed_update(*args: Any, **kwargs: Any) -> Any:
        start = time.process_time()
        out = update(*args, **kwargs)
        update_cpu.append(time.process_time() - start)
        return out

    ctx.actor.update = timed_update
    marks, records, profiler = [], [], Profiler(spec, "ours")
    for step in range(spec["steps"] + 1):  # one more mark than steps: the last period's end
        marks.append(now())
        if step == spec["warmup"]:
            profiler.start()
        if step == spec["steps"]:
            break
        records.append(grpo_step(ctx))
    profiler.stop()
    phases = {k: [r[k] for r in records] for k in records[0] if k.startswith("time/") and k != "time/step"}
    return {
        **periods(marks),
        "gen_times": gen_times,
        "gen_tokens": gen_tokens,
        "prompt_tokens": prompt_tokens,
        "rollout_times": phases["time/rollout"],
        "update_cpu": update_cpu,
        "phases": phases,
        "reward_mean": [r["reward_mean"] for r in records],
        "threads": torch.get_num_threads(),
        "import_rss_mb": base["rss_mb"],
        "load": [load, os.getloadavg()[0]],
        **memory_status(),
    }


def child_runner(spec: dict[str, Any]) -> dict[str, Any]:
    """The same recipe through the Ray driver (``GRPORunner``), rollout on its own worker, ``buffer.mode`` as given.

    The actor (one rank) and the rollout engine (one worker) are separate Ray processes, so the
    asynchronous mode can generate the next batch while the actor trains on this one. Responses
    may stop at EOS here (the engine lives in a worker process: no ``ignore_eos`` hook), so the
    generated tokens per step are reported next to the times.
    """
    import torch

    torch.set_num_threads(spec["threads"])
    from mindspeed_rl.config.grpo import load_grpo_config
    from mindspeed_rl.driver.runner import GRPORunner

    load = os.getloadavg()[0]
    config = load_grpo_config(
        None,
        [
            f"actor.model={spec['model_dir']}",
            f"actor.lr={spec['lr']}",
            f"actor.micro_batch_size={spec['micro_batch']}",
            "actor.clip_grad=1.0",
            f"rollout.n={spec['n']}",
            f"rollout.max_new_tokens={spec['max_new_tokens']}",
            "rollout.temperature=1.0",
            f"rollout.max_prompt_length={max_positions(spec) - spec['max_new_tokens']}",
            f"rollout.max_num_seqs={spec['global_batch'] * spec['n']}",
            "rollout.colocate=false",
            "rollout.num_devices=1",
            *([] if spec["share_prompt"] else ["actor.share_prompt=false"]),
            f"buffer.mode={spec['buffer_mode']}",
            f"buffer.max_staleness={int(spec['buffer_mode'] == 'async')}",
            f"train.global_batch={spec['global_batch']}",
            f"train.steps={spec['steps']}",
            f"train.seed={spec['seed']}",
            f"algorithm.kl_coef={spec['beta']}",
            "algorithm.kl_estimator=k3",
            f"data.path={spec['prompts_path']}",
            "data.shuffle=false",
            "data.prompt_format=chat",
            "logging.progress=false",
            "logging.tensorboard=false",
            "logging.reward_curve=false",
        ],
    )
    runner = GRPORunner(config)
    marks = [now()]
    try:
        records = runner.run(on_step=lambda record: marks.append(now()))
    finally:
        runner.shutdown()
    rows = spec["global_batch"] * spec["n"]
    return {
        **periods(marks),
        "records": records,
        "gen_tokens": [r["response_length"] * rows for r in records],
        "load": [load, os.getloadavg()[0]],
        **memory_status(),
    }


def summarize_runner(runs: list[dict[str, Any]], warmup: int) -> dict[str, Any]:
    """A buffer mode over its runs: the best run's median step period and what its steps waited for."""

    def one(run: dict[str, Any]) -> dict[str, float]:
        timed = run["records"][warmup:]
        return {
            "step_s": statistics.median(run["periods"][warmup:]),
            "wait_s": statistics.median(r.get("time/wait_rollout", 0.0) for r in timed),
            "rollout_s": statistics.median(r.get("time/rollout", 0.0) for r in timed),
            "staleness": statistics.mean(r.get("staleness_mean", 0.0) for r in timed),
            "gen_tokens": statistics.median(run["gen_tokens"][warmup:]),
        }

    per_run = [one(r) for r in runs]
    best = min(range(len(runs)), key=lambda i: per_run[i]["step_s"])
    return {**per_run[best], "runs_step_s": [round(p["step_s"], 2) for p in per_run], "load": _child.load_range(runs)}


def report_runner(results: dict[str, dict[str, Any]]) -> str:
    """Sync vs async through the Ray driver (wall time: the driver's workers are other processes); a
    mode measured on a busy machine is marked noisy."""
    sync, asyn, lines = results["sync"], results["async"], []
    write = lines.append
    write(
        "\nRay driver, rollout on its own worker (actor 1 rank + rollout 1 worker), buffer.max_staleness 1:\n\n"
        f"| | {_child.mark('sync', sync['noisy'])} | {_child.mark('async', asyn['noisy'])} | sync / async |\n"
        "|---|---|---|---|\n"
    )
    for label, key, fmt in (
        ("step time s (median)", "step_s", "{:.2f}"),
        ("trainer waited for the buffer s (async; sync: 0)", "wait_s", "{:.2f}"),
        ("rollout s (generation + scoring, producer side)", "rollout_s", "{:.2f}"),
        ("generated tokens per step", "gen_tokens", "{:.0f}"),
    ):
        ratio = sync[key] / asyn[key] if asyn[key] else float("nan")
        write(f"| {label} | {fmt.format(sync[key])} | {fmt.format(asyn[key])} | {ratio:.2f} |\n")
    write(f"| mean staleness of the trained rows (versions) | {sync['staleness']:.2f} | {asyn['staleness']:.2f} | |\n")
    write(f"| step time of each run s | {sync['runs_step_s']} | {asyn['runs_step_s']} | |\n")
    write(
        f"| load average (min start - max end) | {sync['load'][0]:.1f}-{sync['load'][1]:.1f} "
        f"| {asyn['load'][0]:.1f}-{asyn['load'][1]:.1f} | |\n"
    )
    write(f"\nasync speed-up (sync step / async step): {sync['step_s'] / asyn['step_s']:.2f}x\n")
    return "".join(lines)


CHILDREN = {"ours": child_ours, "runner": child_runner}


# ----------------------------------------------------------------------------- driver


def run_child(kind: str, spec: dict[str, Any], log: Path) -> dict[str, Any]:
    """Run ``kind`` in a fresh interpreter (its output in ``log``) and return its result (TRL: ``grpo_trl.py``)."""
    if kind == "trl":
        return run_trl(spec, log)
    return _child.run_child(__file__, kind, spec, log, {"TOKENIZERS_PARALLELISM": "false"})


def summarize(runs: list[dict[str, Any]], warmup: int) -> dict[str, Any]:
    """A side over its runs: per run the median timed step; the side's best run (noise only slows)."""

    def one(run: dict[str, Any]) -> dict[str, float]:
        timed = slice(warmup, None)
        step = statistics.median(run["periods"][timed])
        gen = statistics.median(g[0] for g in run["gen_times"][timed])
        tokens = statistics.median(run["gen_tokens"][timed])
        return {
            "step_s": step,
            "cpu_step_s": statistics.median(run["cpu_periods"][timed]),
            "wait_step_s": statistics.median(run["wait_periods"][timed]),
            "gen_s": gen,
            "cpu_gen_s": statistics.median(g[1] for g in run["gen_times"][timed]),
            "wait_gen_s": statistics.median(g[2] for g in run["gen_times"][timed]),
            "rollout_s": statistics.median(run["rollout_times"][timed]),
            "cpu_update_s": statistics.median(run["update_cpu"][timed]) if "update_cpu" in run else float("nan"),
            "cpu_rollout_s": statistics.median(run["rollout_cpu"][timed]) if "rollout_cpu" in run else float("nan"),
            "gen_tokens": tokens,
            "gen_tps": tokens / gen,
            "prompt_tokens": statistics.mean(run["prompt_tokens"]),
            "other_s": statistics.median(
                period - sum(run["phases"][k][i] for k in ("time/rollout", "time/old_logp", "time/update"))
                for i, period in enumerate(run["periods"])
                if i >= warmup
            )
            if "phases" in run
            else 0.0,
            "step_tps": tokens / step,
        }

    per_run = [one(r) for r in runs]
    best = min(range(len(runs)), key=lambda i: per_run[i]["step_s"])
    result = {
        **per_run[best],
        "peak_rss_mb": runs[best]["peak_rss_mb"],
        "import_rss_mb": runs[best]["import_rss_mb"],
        "runs_step_s": [round(p["step_s"], 2) for p in per_run],
        "threads": runs[best]["threads"],
        "load": _child.load_range(runs),
    }
    if "phases" in runs[best]:
        result["phases"] = {k.split("/", 1)[1]: statistics.median(v[warmup:]) for k, v in runs[best]["phases"].items()}
    return result


def report(results: dict[str, dict[str, Any]], header: str) -> str:
    """The side-by-side table (TRL / ours ratios, wall and CPU time) and where each side's step goes; a
    side measured on a busy machine is marked noisy."""
    ours, trl, lines = results["ours"], results["trl"], []
    write = lines.append
    rows = [
        ("step time s (median)", "step_s", "{:.2f}", True),
        ("CPU time per step s", "cpu_step_s", "{:.2f}", True),
        ("run-queue wait per step s (main thread)", "wait_step_s", "{:.2f}", True),
        ("generation s", "gen_s", "{:.2f}", True),
        ("CPU time in generation s", "cpu_gen_s", "{:.2f}", True),
        ("run-queue wait in generation s", "wait_gen_s", "{:.2f}", True),
        ("rollout s (generation + scoring)", "rollout_s", "{:.2f}", True),
        ("prompt tokens per row (mean)", "prompt_tokens", "{:.1f}", False),
        ("generated tokens per step", "gen_tokens", "{:.0f}", False),
        ("generated tokens/s in generation", "gen_tps", "{:.0f}", False),
        ("generated tokens/s of the step", "step_tps", "{:.0f}", False),
        ("peak RSS MB", "peak_rss_mb", "{:.0f}", True),
    ]
    write(
        f"{header}\n\n| | {_child.mark('ours', ours['noisy'])} | {_child.mark('TRL', trl['noisy'])} | TRL / ours |\n"
        "|---|---|---|---|\n"
    )
    for label, key, fmt, _ in rows:
        ratio = f"{trl[key] / ours[key]:.2f}" if ours[key] else "-"  # a quiet run waits 0 s for a core
        write(f"| {label} | {fmt.format(ours[key])} | {fmt.format(trl[key])} | {ratio} |\n")
    write(f"| step time of each run s | {ours['runs_step_s']} | {trl['runs_step_s']} | |\n")
    write(
        f"| load average (min start - max end) | {ours['load'][0]:.1f}-{ours['load'][1]:.1f} "
        f"| {trl['load'][0]:.1f}-{trl['load'][1]:.1f} | |\n"
    )
    write(where_the_step_goes(ours, trl))
    return "".join(lines)


def report_ab(results: dict[str, dict[str, Any]], mode: str, ab_mode: str) -> str:
    """Ours with two ``--compile`` modes, interleaved runs, each against the same TRL runs."""
    trl = results["trl"]
    out = (
        f"\nA/B of ours (--compile {mode} vs {ab_mode}), best run of each, TRL / ours:\n\n"
        "| --compile | step s | CPU s / step | generation CPU s | update CPU s | TRL / ours wall | TRL / ours CPU "
        "| step s of each run | load |\n|---|---|---|---|---|---|---|---|---|\n"
    )
    for label, side in ((mode, results["ours"]), (ab_mode, results["ours_ab"])):
        out += (
            f"| {_child.mark(label, side['noisy'])} | {side['step_s']:.2f} | {side['cpu_step_s']:.2f} "
            f"| {side['cpu_gen_s']:.2f} | {side['cpu_update_s']:.2f} | {trl['step_s'] / side['step_s']:.2f} "
            f"| {trl['cpu_step_s'] / side['cpu_step_s']:.2f} | {side['runs_step_s']} "
            f"| {side['load'][0]:.1f}-{side['load'][1]:.1f} |\n"
        )
    return out


def where_the_step_goes(ours: dict[str, Any], trl: dict[str, Any]) -> str:
    """Each side's step split into generation, scoring and log-prob passes, the update, and the rest
    (median s, wall and CPU; TRL's update is the step outside ``_generate_and_score_completions``)."""
    phases = ours.get("phases", {})
    o_score = phases.get("rollout", ours["rollout_s"]) - ours["gen_s"] + phases.get("old_logp", 0.0)
    o_update = phases.get("update", 0.0)
    o_other = ours["other_s"]
    o_cpu_update = ours["cpu_update_s"]
    o_cpu_rest = ours["cpu_step_s"] - ours["cpu_gen_s"] - o_cpu_update
    t_score = trl["rollout_s"] - trl["gen_s"]
    t_cpu_score = trl["cpu_rollout_s"] - trl["cpu_gen_s"]
    t_update, t_cpu_update = trl["step_s"] - trl["rollout_s"], trl["cpu_step_s"] - trl["cpu_rollout_s"]
    rows = [
        ("generation", ours["gen_s"], ours["cpu_gen_s"], trl["gen_s"], trl["cpu_gen_s"]),
        ("scoring + log-prob passes (TRL: the rest of its rollout)", o_score, float("nan"), t_score, t_cpu_score),
        (
            "update: forward, backward, optimizer (TRL: the step outside its rollout)",
            o_update,
            o_cpu_update,
            t_update,
            t_cpu_update,
        ),
        ("other: weight sync, bookkeeping", o_other, float("nan"), 0.0, float("nan")),
        ("CPU outside generation and update", float("nan"), o_cpu_rest, float("nan"), t_cpu_score),
    ]
    out = (
        "\nWhere the step goes (median s of the best run):\n\n"
        "| phase | ours wall | ours CPU | TRL wall | TRL CPU | TRL / ours CPU |\n|---|---|---|---|---|---|\n"
    )
    for label, ow, oc, tw, tc in rows:
        ratio = tc / oc if oc == oc and tc == tc and oc > 0 else float("nan")
        cells = " | ".join("" if v != v else f"{v:.2f}" for v in (ow, oc, tw, tc, ratio))
        out += f"| {label} | {cells} |\n"
    return out


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--size",
        choices=sorted(SIZES),
        default="tiny",
        help="tiny: 4 layers, hidden 256, ffn 688 (default); micro: 2 layers, hidden 64 (tests)",
    )
    parser.add_argument("--steps", type=int, default=6, help="GRPO steps per run (default 6)")
    parser.add_argument("--warmup", type=int, default=1, help="first steps left out of the timing (default 1)")
    parser.add_argument("--global-batch", type=int, default=4, help="prompts per step (default 4)")
    parser.add_argument("--n", type=int, default=8, help="responses per prompt, the group size (default 8)")
    parser.add_argument("--micro-batch", type=int, default=8, help="sequences per forward/backward (default 8)")
    parser.add_argument("--max-new-tokens", type=int, default=64, help="response length (default 64)")
    parser.add_argument("--lr", type=float, default=1e-5, help="learning rate, constant (default 1e-5)")
    parser.add_argument(
        "--beta", type=float, default=0.0, help="KL coefficient (default 0: no reference model on either side)"
    )
    parser.add_argument(
        "--allow-eos",
        action="store_true",
        help="let responses stop at EOS (default: every response is --max-new-tokens long)",
    )
    parser.add_argument("--repeats", type=int, default=2, help="runs of each side, alternating (default 2)")
    parser.add_argument(
        "--trl",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="run the comparison with TRL (default: on; --no-trl runs only the buffer modes)",
    )
    parser.add_argument(
        "--buffer-modes",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also run the Ray driver with buffer.mode=sync and async (default: on)",
    )
    parser.add_argument("--trl-first", action="store_true", help="run TRL before ours in every repeat")
    parser.add_argument(
        "--threads", type=int, default=1, help="torch threads (and OMP_NUM_THREADS) of every run (default 1)"
    )
    parser.add_argument(
        "--profile",
        action="store_true",
        help="write a CPU-time cProfile of each side's timed steps to the workdir (profile_<side>.prof "
        "and .txt; slows both sides down: use the numbers of a run without it)",
    )
    parser.add_argument(
        "--prompt-tokens",
        type=int,
        default=0,
        help="lengthen every prompt to this many tokens with a context of digits (default 0: the demo prompts)",
    )
    parser.add_argument(
        "--long",
        action="store_true",
        help="the long-prompt case: 512-token prompts, 2 prompts x 8 responses of 128 tokens, 4 steps",
    )
    parser.add_argument(
        "--prefix-sharing",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="our engine prefills a group's shared prompt once (default: on; --no-prefix-sharing for A/B)",
    )
    parser.add_argument(
        "--share-prompt",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="our update runs a group's shared prompt once (actor.share_prompt; default: on; "
        "--no-share-prompt for A/B)",
    )
    parser.add_argument(
        "--compile",
        nargs="?",
        const="both",
        default="none",
        choices=sorted(COMPILED),
        help="ours with actor.compile=true and/or rollout.compile=true (bare --compile: both; compiled in "
        "the untimed first step)",
    )
    parser.add_argument(
        "--ab-compile",
        default=None,
        choices=sorted(COMPILED),
        help="also run ours with this --compile mode, interleaved with the other runs (an A/B in one table)",
    )
    parser.add_argument("--quick", action="store_true", help="a smoke run: 3 steps, 2 prompts x 4, 16 tokens, 1 repeat")
    parser.add_argument("--workdir", default=None, help="model and logs (default: a temporary directory)")
    parser.add_argument("--json", default=None, help="also write the results to this file")
    _child.add_record_args(parser)
    parser.add_argument("--child", choices=sorted(CHILDREN), help=argparse.SUPPRESS)
    parser.add_argument("--child-spec", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.long:
        args.prompt_tokens, args.global_batch, args.n, args.micro_batch, args.max_new_tokens = 512, 2, 8, 8, 128
        args.steps = 4
    if args.quick:
        args.steps, args.warmup, args.global_batch, args.n, args.micro_batch, args.max_new_tokens = 3, 1, 2, 4, 4, 16
        args.repeats = 1
    for name in ("steps", "global_batch", "n", "micro_batch", "max_new_tokens", "repeats", "threads"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')}={getattr(args, name)} must be at least 1")
    if args.n < 2:
        parser.error(f"--n={args.n}: GRPO needs at least 2 responses per prompt")
    if (args.global_batch * args.n) % args.micro_batch:
        parser.error(
            f"--micro-batch={args.micro_batch} must divide --global-batch x --n = {args.global_batch * args.n}"
        )
    if args.warmup < 0 or args.steps < args.warmup + 1:
        parser.error(f"--steps={args.steps} leaves no timed step after --warmup={args.warmup}")
    if args.prompt_tokens < 0:
        parser.error(f"--prompt-tokens={args.prompt_tokens} must be >= 0")
    if args.beta < 0:
        parser.error(f"--beta={args.beta} must be >= 0")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark and print the table (or, with ``--child``, one side of it)."""
    args = parse_args(argv)
    if args.child:
        return _child.child_main(CHILDREN, args.child, args.child_spec)
    work = Path(args.workdir or tempfile.mkdtemp(prefix="bench-grpo-"))
    work.mkdir(parents=True, exist_ok=True)
    spec = {
        "workdir": str(work),
        "size": args.size,
        "steps": args.steps,
        "global_batch": args.global_batch,
        "n": args.n,
        "micro_batch": args.micro_batch,
        "max_new_tokens": args.max_new_tokens,
        "lr": args.lr,
        "beta": args.beta,
        "allow_eos": args.allow_eos,
        "threads": args.threads,
        "seed": 1234,
        "warmup": args.warmup,
        "profile": args.profile,
        "prompt_tokens": args.prompt_tokens,
        "prefix_sharing": args.prefix_sharing,
        "share_prompt": args.share_prompt,
        "compile": args.compile,
    }
    sides = (*SIDES, "ours_ab") if args.ab_compile else SIDES
    started, load = time.perf_counter(), _child.LoadRecord(args.max_load)
    facts = prepare(spec)
    spec.update(model_dir=facts["model_dir"], records=facts["records"], prompts_path=facts["prompts_path"])
    runs: dict[str, list[dict[str, Any]]] = {side: [] for side in sides}
    for repeat in range(args.repeats if args.trl else 0):
        for side in sides[::-1] if args.trl_first else sides:
            side_spec = {**spec, "compile": args.ab_compile} if side == "ours_ab" else spec
            runs[side].append(run_child(side.removesuffix("_ab"), side_spec, work / f"run_{repeat}_{side}.log"))
    if not args.allow_eos:  # the equal-work premise: every response exactly --max-new-tokens long on both sides
        want = args.global_batch * args.n * args.max_new_tokens
        for side, side_runs in runs.items():
            if any(tokens != want for run in side_runs for tokens in run["gen_tokens"]):
                raise SystemExit(
                    f"{side} generated {[run['gen_tokens'] for run in side_runs]} tokens per step, not "
                    f"{want}: the sides did not do the same work; see {work}"
                )
    results = {side: {**summarize(r, args.warmup), "noisy": load.noisy(r)} for side, r in runs.items() if r}
    modes: dict[str, list[dict[str, Any]]] = {"sync": [], "async": []}
    if args.buffer_modes:
        for repeat in range(args.repeats):
            for mode in modes:
                log = work / f"run_{repeat}_{mode}.log"
                modes[mode].append(run_child("runner", {**spec, "buffer_mode": mode}, log))
    runner_results = {
        mode: {**summarize_runner(r, args.warmup), "noisy": load.noisy(r)} for mode, r in modes.items() if r
    }
    noisy = any(r["noisy"] for r in [*results.values(), *runner_results.values()])
    header = (
        f"size {args.size} ({facts['parameters'] / 1e6:.1f} M parameters, vocabulary 2048), fp32; "
        f"{args.global_batch} prompts x {args.n} responses per step, {args.max_new_tokens} new tokens "
        f"{'at most' if args.allow_eos else 'each (EOS ignored)'}, prompts {facts['prompt_tokens_mean']:.1f} "
        f"tokens on average; prefix sharing {'on' if args.prefix_sharing else 'off'}; "
        f"shared prompts in the update {'on' if args.share_prompt else 'off'}; ours compiled: {args.compile}; micro batch {args.micro_batch}; beta {args.beta:g}; {args.steps} steps "
        f"({args.warmup} untimed), best of {args.repeats} run(s) of the median step; torch threads "
        f"{args.threads} on {os.cpu_count()} cores; torch {version('torch')}, transformers "
        f"{version('transformers')}, trl {version('trl')}; {load.header(noisy)}; "
        f"{time.perf_counter() - started:.0f} s; workdir {work}"
    )
    table = report(results, header) if results else header + "\n"
    if "ours_ab" in results:
        table += report_ab(results, args.compile, args.ab_compile)
    if runner_results:
        table += report_runner(runner_results)
    sys.stdout.write(table)
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {
                    "header": header,
                    "compile": {"ours": args.compile, "ours_ab": args.ab_compile},
                    "results": results,
                    "runs": runs,
                    "buffer_modes": runner_results,
                    "runner_runs": modes,
                },
                indent=2,
            )
        )
    return load.write_table(args.table, table, noisy)


if __name__ == "__main__":
    sys.exit(main())
