"""Benchmark the agent loop's overlapped schedule against the barrier per turn.

The policy and the tool are those of ``tests/rl/rollout/test_agent_overlap.py``: a tiny Llama
that behaves as a stochastic automaton (a random number of filler dots, then a call of the
``sleepy`` tool or an answer; up to ``--max-turns`` turns) on the built-in engine, and a tool that
sleeps ``--tool-ms`` and answers deterministically. Both schedules roll out the same seeded
batch, interleaved run by run (best of ``--repeat`` after a warm-up), and must give the same
tokens. Reports wall time, CPU time (this process) and the load average.

Usage::

    PYTHONPATH=. uv run --frozen python tools/bench/agent_overlap.py
    PYTHONPATH=. uv run --frozen python tools/bench/agent_overlap.py --samples 64 --tool-ms 50
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import time

import torch

from mindspeed_rl.rollout.agent import AgentLoop, AgentSettings
from tests.rl.rollout.test_agent_overlap import automaton_policy, automaton_tokenizer, rollout_inputs, sleepy_tool


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--samples", type=int, default=32)
    parser.add_argument("--tool-ms", type=float, default=50.0)
    parser.add_argument("--max-turns", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--filler", type=float, default=2.5, help="logit of one more filler dot")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    tokenizer = automaton_tokenizer()
    rollout = automaton_policy(tokenizer, max_batch_size=args.samples, filler=args.filler)
    settings = AgentSettings(
        {"sleepy": sleepy_tool(args.tool_ms / 1000)},
        max_turns=args.max_turns,
        max_response_length=args.max_turns * (args.max_new_tokens + 40),
        max_parallel=args.samples,
    )
    loops = {o: AgentLoop(tokenizer, dataclasses.replace(settings, overlap=o)) for o in (False, True)}
    prompts, params, conversations = rollout_inputs(loops[False], tokenizer, args.samples, args.max_new_tokens)
    best: dict[bool, tuple[float, float]] = {}
    outputs = {}
    for run in range(args.repeat + 1):
        for overlap, loop in loops.items():
            wall, cpu = time.perf_counter(), time.process_time()
            outputs[overlap] = loop.run(rollout, prompts, params, conversations)
            wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
            if run and (overlap not in best or wall < best[overlap][0]):
                best[overlap] = (wall, cpu)
    same = [o.token_ids for o in outputs[True]] == [o.token_ids for o in outputs[False]]
    calls = sum(o.tool_calls for o in outputs[False])
    generated = sum(sum(o.loss_mask) for o in outputs[False])
    turns = [o.turns for o in outputs[False]]
    print(
        f"{args.samples} samples, {calls} calls of {args.tool_ms:g} ms, {generated} generated tokens, "
        f"turns {min(turns)}-{max(turns)} (mean {sum(turns) / len(turns):.2f}); identical tokens: {same}"
    )
    for overlap in (False, True):
        wall, cpu = best[overlap]
        print(f"{'overlapped' if overlap else 'barrier':>10}: wall {wall:.3f} s, CPU {cpu:.3f} s")
    print(f"speed-up (wall): {best[False][0] / best[True][0]:.2f}x; load average {os.getloadavg()}")
    if not same:
        raise SystemExit("the schedules gave different tokens")


if __name__ == "__main__":
    main()
