"""What a worker runs: the megatron-core actor (``actor`` and its ``actor_*`` parts), the critic
(``critic``, ``critic_init``), their offload and memory helpers (``memory``) and the recipe's
translation into their settings (``actor_settings``). Imports config, algorithms, never the driver.
"""
