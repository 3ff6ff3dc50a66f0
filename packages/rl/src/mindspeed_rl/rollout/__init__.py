"""Rollout engines behind one interface: ``builtin`` (the LLM suite's engine) and ``vllm``.

::

    from mindspeed_rl.rollout import build_rollout
    engine = build_rollout("builtin", "path/to/hf-model", max_num_seqs=64, max_model_len=1024)
    outputs = engine.generate(prompt_ids, [SamplingParams(max_new_tokens=256, temperature=1.0, seed=i) ...])
    engine.sleep()                        # co-location: give the memory to the trainer
    engine.load_weights(actor.hf_state()) # full Hugging Face-named tensors
    engine.wake_up()

Multi-turn, tool-using rollouts run any engine's ``generate`` in :class:`AgentLoop`
(``rollout/agent.py``): generate, run the calls, append the template's tool messages, go on.

Importing this package imports neither vLLM nor any device library; ``build_rollout("vllm", ...)``
imports vLLM then.
"""

from __future__ import annotations

from mindspeed_rl.rollout.agent import AgentLoop, AgentOutput, AgentSettings, agent_metrics
from mindspeed_rl.rollout.base import ROLLOUT_ENGINES, RolloutEngine, RolloutOutput, build_rollout
from mindspeed_rl.rollout.builtin import BuiltinRollout
from mindspeed_rl.rollout.vllm import VLLMRollout

__all__ = [
    "ROLLOUT_ENGINES",
    "AgentLoop",
    "AgentOutput",
    "AgentSettings",
    "BuiltinRollout",
    "RolloutEngine",
    "RolloutOutput",
    "VLLMRollout",
    "agent_metrics",
    "build_rollout",
]
