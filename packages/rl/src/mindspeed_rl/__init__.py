"""mindspeed_rl: GRPO, PPO and friends on Ray, on the core and the LLM suite's engine.

The package is layered by role. Each folder (or top-level module) stands on a floor and imports
only what stands on lower floors, in module-level and function-level imports alike, so no two
folders import each other and a Ray worker never imports the driver
(tests/sanity/test_rl_layers.py reads this table and holds the imports to it):

    floor 6  cli
    floor 5  driver
    floor 4  workers
    floor 3  models, demo
    floor 2  config, rollout
    floor 1  rewards
    floor 0  algorithms, buffer, data, tools

algorithms are the losses, advantages and KL pieces (pure functions on tensors); buffer the replay
buffer; data the prompt datasets; rewards the verifiers and the reward model (a floor above tools: the per-turn format reward
parses tool calls); tools what a policy
may call in a multi-turn rollout (the tool registry, the sandbox, the call parser); rollout the
generation engines and the multi-turn agent loop, which runs the tools (a floor above them). config holds the recipe's typed sections and their checks. models is
what a worker runs: the megatron actor and its parts, the critic, their memory handling and the recipe's
translation into their settings, and the vision-language actor (a ``mindspeed_mm`` model). demo writes the tiny demo policy. workers are the Ray actors that
host the models and rollout engines. driver is the one process that runs a job: the in-process
trainer (one GRPO/PPO step's pieces), the Ray runners, their checkpoints, metrics and commands.
cli is the ``mindspeed-rl`` entry point.
"""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("mindspeed-rl")
except PackageNotFoundError:  # running from a source tree that was not installed
    __version__ = "0.0.0"

__all__ = ["__version__"]
