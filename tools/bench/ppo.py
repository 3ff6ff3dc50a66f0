"""Benchmark one PPO step of ``mindspeed_rl`` against TRL's ``PPOTrainer`` (CPU, same work).

One command runs both sides and prints the ratio::

    uv run --frozen python tools/bench/ppo.py            # tiny Llama, 16 prompts x 32 tokens, 4 PPO epochs
    uv run --frozen python tools/bench/ppo.py --quick    # a smoke run (micro model, 2 timed steps)

Our side: ``mindspeed_rl.driver.ppo_local.build_ppo_context`` + ``ppo_step`` (the in-process twin of
``mindspeed-rl ppo``: actor, reference, critic, engine) in the workspace's environment. TRL's
side: ``trl.experimental.ppo.PPOTrainer`` of TRL ``_ppo_trl_side.TRL_VERSION`` (the newest that
ships it; the locked TRL has none) in a throwaway environment that ``uv run --isolated
--no-project --with trl==... --with torch==<ours> --with transformers==<ours>`` makes (cached by
uv after the first run); it is not added to the workspace's lock.

Equal work, both sides:

- the same random-weight Llama (a Hugging Face directory written here with the demo tokenizer),
  its critic / value model the same decoder with a fresh scalar head, a frozen reference;
- the same prompts (the shipped arithmetic prompts, plain text), one response each, the same
  count per step; ours reads them in order, TRL's dataloader shuffles them (the same set);
- every response exactly ``--max-new-tokens`` long: ours with ``SamplingParams.ignore_eos``,
  TRL with ``stop_token=None`` (no stop token);
- the same update: ``--ppo-epochs`` passes over the batch, one mini-batch (one optimizer step of
  the actor and one of the critic per epoch), micro batches of ``--micro-batch``, fp32, AdamW,
  constant learning rate, temperature 1, the k1 KL folded into the per-token reward, GAE with
  gamma = lambda = 1;
- one process each, the same torch thread count (``--threads``, ``OMP_NUM_THREADS``).

Not equal, by each trainer's design: TRL's old log-probs come from the generation's logits (it
keeps them: ``output_scores``), ours from a second forward of the actor; TRL trains the policy and
the value model through one loss and one optimizer, ours through two. Our reward is the ``math``
verifier on the decoded text, TRL's a stub with no model (it needs a reward *model*; a model
forward would be work ours does not do).

A side's step time is the median over the timed steps (after ``--warmup``) of the period from the
start of one step to the start of the next, wall and process CPU time; phases are measured around
each side's generation, reference log-probs, values and (the rest) update. The load average is
printed before and after each side: on a shared machine only ratios of back-to-back runs mean much.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from importlib.metadata import version
from pathlib import Path
from typing import Any

import _child  # tools/bench/_child.py: the script's folder is on sys.path
from _ppo_trl_side import TRL_VERSION, PhaseClock
from grpo_clock import SIZES, memory_status, now, periods

MAX_PROMPT = 96


def our_overrides(spec: dict[str, Any]) -> list[str]:
    """The ``mindspeed-rl ppo`` recipe keys that give our side the spec's work."""
    return [
        f"actor.model={spec['model_dir']}",
        f"actor.lr={spec['lr']}",
        f"actor.micro_batch_size={spec['micro_batch']}",
        f"actor.ppo_epochs={spec['ppo_epochs']}",
        f"actor.mini_batch_size={spec['global_batch']}",
        "actor.lr_decay_style=constant",
        f"critic.lr={spec['lr']}",
        f"critic.ppo_epochs={spec['ppo_epochs']}",
        f"critic.cliprange_value={spec['cliprange_value']}",
        "critic.warmup_steps=0",
        "critic.lr_decay_style=constant",
        "rollout.n=1",
        f"rollout.max_new_tokens={spec['max_new_tokens']}",
        "rollout.temperature=1.0",
        f"rollout.max_prompt_length={MAX_PROMPT}",
        f"rollout.max_num_seqs={spec['global_batch']}",
        "algorithm.advantage=gae",
        "algorithm.gamma=1.0",
        "algorithm.lam=1.0",
        "algorithm.kl_coef=0.0",
        "algorithm.use_kl_in_reward=true",
        "algorithm.kl_in_reward_estimator=k1",
        "algorithm.kl_ctrl.type=fixed",
        f"algorithm.kl_ctrl.kl_coef={spec['kl_coef']}",
        f"train.global_batch={spec['global_batch']}",
        f"train.steps={spec['steps']}",
        f"train.seed={spec['seed']}",
        f"data.path={spec.get('prompts_path', 'demo')}",
        "data.shuffle=false",
        "data.prompt_format=plain",
        "logging.progress=false",
        "logging.tensorboard=false",
        "logging.reward_curve=false",
        *spec.get("our_overrides", []),
    ]


def our_work(config: Any) -> dict[str, int]:
    """The work one of our steps does under a :class:`~mindspeed_rl.config.ppo.PPOConfig`."""
    a, c, t = config.actor, config.critic, config.train
    mini = a.mini_batch_size or t.global_batch
    return {
        "steps": t.steps,
        "prompts_per_step": t.global_batch,
        "responses_per_step": t.global_batch * config.rollout.n,
        "response_tokens": config.rollout.max_new_tokens,
        "micro_batch": a.micro_batch_size,
        "ppo_epochs": a.ppo_epochs,
        "policy_updates_per_step": a.ppo_epochs * (t.global_batch // mini),
        "value_updates_per_step": c.ppo_epochs * (t.global_batch // mini),
    }


def prepare(spec: dict[str, Any]) -> dict[str, Any]:
    """Write the model directory and the prompts both sides read."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from mindspeed_llm.tokenizer import load_tokenizer
    from mindspeed_rl.data import PromptFormat, encode_prompts, load_prompts

    model_dir = Path(spec["workdir"]) / f"model_{spec['size']}"
    config = LlamaConfig(
        vocab_size=2048,
        max_position_embeddings=MAX_PROMPT + spec["max_new_tokens"],
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        **SIZES[spec["size"]],
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    model.save_pretrained(model_dir)
    tokenizer = load_tokenizer("demo")
    tokenizer.save_pretrained(model_dir)
    records = load_prompts("demo")[: spec["steps"] * spec["global_batch"]]
    prompts_path = Path(spec["workdir"]) / "prompts.jsonl"
    prompts_path.write_text("".join(json.dumps({"question": r.prompt, "answer": r.reference}) + "\n" for r in records))
    # TRL's side gets the token ids our rollout feeds the engine (data.prompt_format=plain, BOS added).
    texts = [PromptFormat(style="plain").render(r.prompt) for r in records]
    ids, kept = encode_prompts(texts, tokenizer, MAX_PROMPT, add_special_tokens=True)
    if len(kept) != len(records):
        raise SystemExit(f"a demo prompt is longer than {MAX_PROMPT} tokens: raise MAX_PROMPT")
    g = spec["global_batch"]
    steps = [list(zip(records[i : i + g], ids[i : i + g])) for i in range(0, len(records), g)]
    return {
        "model_dir": str(model_dir),
        "prompts_path": str(prompts_path),
        "parameters": sum(p.numel() for p in model.parameters()),
        "records": [[{"prompt": r.prompt, "reference": r.reference, "ids": t} for r, t in step] for step in steps],
    }


def child_ours(spec: dict[str, Any]) -> dict[str, Any]:
    """``build_ppo_context`` + ``ppo_step`` in this process (a one-rank gloo group)."""
    import torch

    torch.set_num_threads(spec["threads"])
    from mindspeed_rl.config.ppo import load_ppo_config
    from mindspeed_rl.driver.ppo_local import build_ppo_context, ppo_step
    from mindspeed_rl.models.memory import freeze_startup_objects

    base, load = memory_status(), os.getloadavg()[0]
    config = load_ppo_config(None, our_overrides(spec))
    ctx = build_ppo_context(config)
    freeze_startup_objects()
    clock, generate, gen_tokens, prompt_tokens = PhaseClock(), ctx.engine.generate, [], []

    def timed_generate(prompts: Any, params: Any) -> Any:
        params = [dataclasses.replace(p, ignore_eos=True) for p in params]
        outputs = generate(prompts, params)
        gen_tokens.append(sum(len(o.token_ids) for o in outputs))
        prompt_tokens.append(statistics.mean(len(p) for p in prompts))
        return outputs

    ctx.engine.generate = clock.wrap("generation", timed_generate)
    ctx.actor.compute_logprobs = clock.wrap("ref_logp", ctx.actor.compute_logprobs)  # the old log-probs
    if ctx.reference is not None:
        ctx.reference.compute_logprobs = clock.wrap("ref_logp", ctx.reference.compute_logprobs)
    ctx.critic.compute_values = clock.wrap("values", ctx.critic.compute_values)
    ctx.actor.update = clock.wrap("update", ctx.actor.update)
    ctx.critic.update = clock.wrap("update", ctx.critic.update)
    marks = []
    for step in range(spec["steps"] + 1):
        marks.append(now())
        if step:
            clock.end_step()
        if step == spec["steps"]:
            break
        ppo_step(ctx)
    ctx.actor.close()
    return {
        **periods(marks),
        "phases": clock.wall,
        "phases_cpu": clock.cpu,
        "gen_tokens": gen_tokens,
        "prompt_tokens": statistics.mean(prompt_tokens),
        "work": our_work(config),
        "threads": torch.get_num_threads(),
        "load": [load, os.getloadavg()[0]],
        **memory_status(),
        "import_rss_mb": base["rss_mb"],
    }


def trl_command(spec_file: Path) -> list[str]:
    """The ``uv run`` line of TRL's side: an isolated environment with the old TRL and our torch."""
    here = Path(__file__).parent
    return [
        "uv",
        "run",
        "--isolated",
        "--no-project",
        "--python",
        f"{sys.version_info.major}.{sys.version_info.minor}",
        "--with",
        f"trl=={TRL_VERSION}",
        "--with",
        f"torch=={version('torch').split('+')[0]}",
        "--with",
        f"transformers=={version('transformers')}",
        "python",
        str(here / "_ppo_trl_side.py"),
        "--child",
        "trl",
        "--child-spec",
        str(spec_file),
    ]


def run_trl(spec: dict[str, Any], log: Path) -> dict[str, Any]:
    """TRL's side in its own environment (its output in ``log``); its result."""
    spec_file = log.with_suffix(".json")
    spec_file.write_text(json.dumps(spec))
    env = {**os.environ, "OMP_NUM_THREADS": str(spec["threads"]), "MKL_NUM_THREADS": str(spec["threads"])}
    env.pop("VIRTUAL_ENV", None)
    env["TOKENIZERS_PARALLELISM"] = "false"
    before = _child.load_average()
    with open(log, "w") as out:
        proc = subprocess.run(trl_command(spec_file), stdout=subprocess.PIPE, stderr=out, text=True, env=env)
    lines = [line for line in proc.stdout.splitlines() if line.startswith(_child.MARK)]
    if proc.returncode != 0 or not lines:
        raise SystemExit(f"trl run failed (exit status {proc.returncode}); its log: {log}")
    result = json.loads(lines[-1][len(_child.MARK) :])
    result["load_around"] = [before, _child.load_average()]
    return result


PHASES = {
    "generation": "generation",
    "ref_logp": "old + reference log-probs (TRL: reference only)",
    "values": "values (critic forward)",
    "update": "updates: forward, backward, optimizer (actor + critic)",
}


def summarize(run: dict[str, Any], warmup: int) -> dict[str, Any]:
    """Median step wall / CPU time over the timed steps, each phase's median, the rest as "other"."""
    timed = slice(warmup, None)

    def medians(periods: list[float], phases: dict[str, list[float]]) -> dict[str, float]:
        steps = list(zip(*(phases[k] for k in PHASES)))[timed]
        out = {k: statistics.median(phases[k][timed]) for k in PHASES}
        out["other"] = statistics.median(p - sum(s) for p, s in zip(periods[timed], steps))
        return out

    return {
        "step_s": statistics.median(run["periods"][timed]),
        "cpu_s": statistics.median(run["cpu_periods"][timed]),
        "phases": medians(run["periods"], run["phases"]),
        "phases_cpu": medians(run["cpu_periods"], run["phases_cpu"]),
        "gen_tokens": run["gen_tokens"][-1],
        "prompt_tokens": run["prompt_tokens"],
        "peak_rss_mb": run["peak_rss_mb"],
        "load": run["load_around"],
    }


def report(spec: dict[str, Any], ours: dict[str, Any], trl: dict[str, Any], trl_versions: dict[str, str]) -> str:
    """The markdown table: step wall and CPU time, the ratio, phases (wall / CPU), load averages."""
    ratio = trl["step_s"] / ours["step_s"]
    cpu_ratio = trl["cpu_s"] / ours["cpu_s"]

    def both(side: dict[str, Any], key: str) -> str:
        return f"{side['phases'][key]:.3f} / {side['phases_cpu'][key]:.3f}"

    rows = [
        (
            "step, wall / CPU time (median, s)",
            f"{ours['step_s']:.3f} / {ours['cpu_s']:.3f}",
            f"{trl['step_s']:.3f} / {trl['cpu_s']:.3f}",
        ),
        *(
            (label, both(ours, key), both(trl, key))
            for key, label in {**PHASES, "other": "other (rewards, GAE, losses' arithmetic, bookkeeping)"}.items()
        ),
        ("generated tokens / step", str(ours["gen_tokens"]), str(trl["gen_tokens"])),
        ("prompt tokens / prompt (mean)", f"{ours['prompt_tokens']:.1f}", f"{trl['prompt_tokens']:.1f}"),
        ("peak RSS (MB)", f"{ours['peak_rss_mb']:.0f}", f"{trl['peak_rss_mb']:.0f}"),
        ("load average (before - after)", "{:.1f}-{:.1f}".format(*ours["load"]), "{:.1f}-{:.1f}".format(*trl["load"])),
    ]
    header = (
        f"PPO step, {spec['size']} Llama ({spec['parameters'] / 1e6:.2f} M parameters), {spec['global_batch']} prompts "
        f"x {spec['max_new_tokens']} tokens, {spec['ppo_epochs']} PPO epochs, micro batch {spec['micro_batch']}, "
        f"{spec['threads']} thread(s), {spec['steps'] - spec['warmup']} timed steps; ours: torch {version('torch')}, "
        f"transformers {version('transformers')}; TRL {trl_versions['trl']} (torch {trl_versions['torch']}, "
        f"transformers {trl_versions['transformers']}); {os.cpu_count()} cores; phases: wall / CPU s, medians"
    )
    lines = [header, "", "| | ours | TRL PPOTrainer |", "| --- | --- | --- |"]
    lines += [f"| {a} | {b} | {c} |" for a, b, c in rows]
    lines.append(f"\nspeed-up (TRL / ours): wall {ratio:.2f}x, CPU time {cpu_ratio:.2f}x (goal >= 1.5x)")
    return "\n".join(lines)


def make_spec(args: argparse.Namespace, workdir: str) -> dict[str, Any]:
    """The work description both sides receive."""
    return {
        "workdir": workdir,
        "size": args.size,
        "steps": args.steps,
        "warmup": args.warmup,
        "global_batch": args.global_batch,
        "micro_batch": args.micro_batch,
        "max_new_tokens": args.max_new_tokens,
        "ppo_epochs": args.ppo_epochs,
        "lr": 1e-5,
        "kl_coef": 0.05,
        "cliprange_value": 0.2,
        "seed": 1234,
        "threads": args.threads,
        "our_overrides": args.our_override,
    }


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """The bench's arguments (``--quick`` sets a smoke run)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="tiny")
    parser.add_argument("--steps", type=int, default=4, help="steps per side, warm-up included")
    parser.add_argument("--warmup", type=int, default=1, help="first steps not timed")
    parser.add_argument("--global-batch", type=int, default=16, help="prompts per step (one response each)")
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=32, help="every response's length")
    parser.add_argument("--ppo-epochs", type=int, default=4)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--quick", action="store_true", help="micro model, 3 steps (a smoke run)")
    parser.add_argument(
        "--our-override",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="an extra recipe key for our side (an A/B, e.g. actor.share_prompt=false); repeatable",
    )
    parser.add_argument("--no-trl", action="store_true", help="our side only")
    parser.add_argument("--json", help="also write the results here")
    parser.add_argument("--child", choices=["ours"], help=argparse.SUPPRESS)
    parser.add_argument("--child-spec", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.quick:
        args.size, args.steps, args.warmup, args.global_batch, args.max_new_tokens = "micro", 3, 1, 8, 16
        args.micro_batch = 4
    for name in ("global_batch", "micro_batch", "max_new_tokens", "ppo_epochs", "threads", "steps"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1 (got {getattr(args, name)})")
    if args.global_batch % args.micro_batch:
        parser.error(f"--global-batch {args.global_batch} is not a multiple of --micro-batch {args.micro_batch}")
    if not 0 <= args.warmup < args.steps:
        parser.error(f"--warmup {args.warmup} must be below --steps {args.steps}")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    """Run both sides one after the other and print the table (or, with ``--child``, our side)."""
    args = parse_args(argv)
    if args.child:
        return _child.child_main({"ours": child_ours}, args.child, args.child_spec)
    with tempfile.TemporaryDirectory(prefix="bench-ppo-") as workdir:
        spec = make_spec(args, workdir)
        spec.update(prepare(spec))
        log = Path(workdir)
        ours = _child.run_child(__file__, "ours", spec, log / "ours.log")
        print("ours:", json.dumps(summarize(ours, args.warmup)), flush=True)
        if args.no_trl:
            return 0
        trl = run_trl(spec, log / "trl.log")
        if trl["work"] != ours["work"]:
            raise SystemExit(f"the sides did different work: ours {ours['work']}, TRL {trl['work']}")
        table = report(spec, summarize(ours, args.warmup), summarize(trl, args.warmup), trl["versions"])
        print(table)
        if args.json:
            Path(args.json).write_text(json.dumps({"spec": spec, "ours": ours, "trl": trl}, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
