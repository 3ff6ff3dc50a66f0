"""The typed recipe sections of ``mindspeed-rl grpo`` and ``ppo`` and their checks.

``grpo`` (:class:`~mindspeed_rl.config.grpo.GRPOConfig`, ``load_grpo_config``), ``ppo``
(:class:`~mindspeed_rl.config.ppo.PPOConfig`), ``sections`` / ``ppo_sections`` (one dataclass per
recipe section), ``checks`` / ``ppo_checks`` (the cross-section checks).
"""
