"""The one process that runs a job.

``trainer`` / ``ppo_trainer``: one GRPO / PPO step's pieces (rollout batch, advantages, update,
step record) and the in-process loop :func:`~mindspeed_rl.driver.trainer.train_grpo`;
``runner`` / ``ppo_runner``: the Ray drivers (:class:`~mindspeed_rl.driver.runner.GRPORunner`)
that place workers and run those steps through them; ``runner_checkpoints``: the whole-run
checkpoints; ``ray_runtime``: starting Ray and its watchdog; ``metrics``: what a run writes about
itself; ``grpo_cli`` / ``ppo_cli``: the ``grpo`` and ``ppo`` commands.
"""
