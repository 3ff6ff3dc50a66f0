"""One candidate of the search: a parallel layout with its micro batch and memory settings."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

#: Megatron's recompute granularities the search tries (``none``: no megatron recompute).
RECOMPUTE = ("none", "selective", "full")


@dataclass(frozen=True)
class Layout:
    """A layout and its settings, with the recipe's meaning of every field.

    Attributes:
        tp: tensor-parallel size (``parallel.tp``).
        pp: pipeline-parallel size (``parallel.pp``).
        dp: data-parallel size (what the world size leaves over).
        cp: context-parallel size (``parallel.cp``).
        ep: expert-parallel size (``parallel.ep``; 1 for a dense model).
        vpp: virtual pipeline stages per pipeline rank (``parallel.vpp``; ``None``: 1F1B).
        micro_batch_size: sequences per microbatch (``train.micro_batch_size``).
        sequence_parallel: shard the activations outside tensor-parallel regions (``parallel.sequence_parallel``).
        distributed_optimizer: shard masters and optimizer state over data-parallel ranks.
        recompute: megatron's ``none``, ``selective`` (core attention) or ``full`` (whole layers).
        recompute_layers: with ``full``: layers of each model chunk recomputed (the first ones:
            megatron's ``block`` method; all of them is its ``uniform`` method with one layer).
        recompute_activation: ``recompute_activation_function`` in every layer.
        recompute_norm: ``recompute_norm`` in every layer.
        swap_attention: ``swap_attention`` (MindSpeed's default modules).
        swap_optimizer: ``swap_optimizer`` (needs the distributed optimizer).
        swap_optimizer_times: its chunks.
        reuse_fp32_param: ``reuse_fp32_param`` (bf16 only).
    """

    tp: int = 1
    pp: int = 1
    dp: int = 1
    cp: int = 1
    ep: int = 1
    vpp: int | None = None
    micro_batch_size: int = 1
    sequence_parallel: bool = False
    distributed_optimizer: bool = False
    recompute: str = "none"
    recompute_layers: int = 0
    recompute_activation: bool = False
    recompute_norm: bool = False
    swap_attention: bool = False
    swap_optimizer: bool = False
    swap_optimizer_times: int = 4
    reuse_fp32_param: bool = False

    @property
    def world_size(self) -> int:
        """Devices the layout uses."""
        return self.tp * self.pp * self.dp * self.cp

    @property
    def chunks(self) -> int:
        """Model chunks per pipeline rank."""
        return self.vpp or 1

    def num_microbatches(self, global_batch_size: int) -> int:
        """Microbatches per step on one data-parallel rank."""
        return global_batch_size // (self.micro_batch_size * self.dp)

    def label(self) -> str:
        """A short name, e.g. ``tp2-sp pp2 dp2 mbs1 full4 act distopt``."""
        parts = [f"tp{self.tp}" + ("-sp" if self.sequence_parallel else ""), f"pp{self.pp}"]
        parts += [f"vpp{self.vpp}"] if self.vpp else []
        parts += [f"cp{self.cp}"] if self.cp > 1 else []
        parts += [f"ep{self.ep}"] if self.ep > 1 else []
        parts += [f"dp{self.dp}", f"mbs{self.micro_batch_size}"]
        if self.recompute == "full":
            parts.append(f"full{self.recompute_layers}")
        elif self.recompute == "selective":
            parts.append("selective")
        flags = (
            ("act", self.recompute_activation),
            ("norm", self.recompute_norm),
            ("swap-attn", self.swap_attention),
            (f"swap-opt{self.swap_optimizer_times}", self.swap_optimizer),
            ("reuse-fp32", self.reuse_fp32_param),
            ("distopt", self.distributed_optimizer),
        )
        parts += [name for name, on in flags if on]
        return " ".join(parts)

    def overrides(self, global_batch_size: int, layers_per_chunk: int) -> dict[str, Any]:
        """The recipe sections this layout sets (a nested mapping a ``mindspeed-llm`` recipe accepts).

        Args:
            global_batch_size: the job's batch (written, so the step is the same on every layout).
            layers_per_chunk: layers of one model chunk (a full recompute of all of them is
                megatron's ``uniform`` method, of fewer its ``block`` method).
        """
        model: dict[str, Any] = {"recompute_granularity": None if self.recompute == "none" else self.recompute}
        if self.recompute == "full":
            if self.recompute_layers >= layers_per_chunk:
                model.update(recompute_num_layers=1, megatron={"recompute_method": "uniform"})
            else:
                model.update(recompute_num_layers=self.recompute_layers, megatron={"recompute_method": "block"})
        return {
            "parallel": {
                "tp": self.tp,
                "pp": self.pp,
                "vpp": self.vpp,
                "cp": self.cp,
                "ep": self.ep,
                "sequence_parallel": self.sequence_parallel,
                "distributed_optimizer": self.distributed_optimizer,
            },
            "train": {"micro_batch_size": self.micro_batch_size, "global_batch_size": global_batch_size},
            "model": model,
            "features": {
                "settings": {
                    "recompute_activation_function": self.recompute_activation,
                    "recompute_norm": self.recompute_norm,
                    "swap_attention": self.swap_attention,
                    "swap_optimizer": {
                        "enabled": self.swap_optimizer,
                        "swap_optimizer_times": self.swap_optimizer_times,
                    },
                    "reuse_fp32_param": self.reuse_fp32_param,
                }
            },
        }
