"""What a run shows while it trains: a progress bar, log lines, tokens/s and MFU.

MFU is model FLOPs (:mod:`mindspeed.metrics.flops`, from the model's shape) per second over
the peak of all devices (:mod:`mindspeed.metrics.peak`); the denominator and its source are
logged once at the start. Throughput and MFU are added to each step's record, so they reach
``metrics.jsonl`` as well.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from mindspeed.log import DETAIL, get_logger
from mindspeed.metrics.flops import training_flops_per_token
from mindspeed.metrics.peak import mfu, peak_flops
from mindspeed.model.shape import ModelShape
from mindspeed.progress import StatusProgress
from mindspeed_llm.training.config import PretrainConfig

logger = get_logger(__name__)


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


#: The MoE auxiliary losses a train record may carry (``mindspeed.metrics.moe.aux_loss_names``).
MOE_AUX_LOSSES = ("load_balancing_loss", "seq_load_balancing_loss", "global_load_balancing_loss", "z_loss")


class RunReporter:
    """Progress bar and log lines of one run (rank 0 draws and logs).

    Args:
        config: the recipe.
        shape: the model (for its FLOPs).
        vocab_size: the padded vocabulary.
        world_size: ranks of the run (devices in the MFU denominator).
        num_parameters: parameters of the model (logged).
        start: the step the run starts after (a resumed run's bar starts there).
    """

    def __init__(
        self,
        config: PretrainConfig,
        shape: ModelShape,
        vocab_size: int,
        world_size: int,
        num_parameters: int,
        start: int = 0,
    ) -> None:
        self.config, self.world_size, self.start = config, world_size, start
        seq = config.data.seq_length
        self.tokens_per_step = config.global_batch_size(world_size) * seq
        self.flops_per_token = training_flops_per_token(shape, seq, vocab_size)
        self.peak = peak_flops(config.train.precision, config.logging.peak_tflops)
        rank0 = dist.get_rank() == 0
        # The bar names the stage and shows the time left; on rank 0 in a terminal only.
        self.bar = StatusProgress(
            config.stage,
            total=config.train.steps,
            completed=start,
            disable=None if rank0 and config.logging.progress else True,
        )
        logger.info(
            "model: %.3f M parameters, %.4g GFLOPs per token (training, 3 x forward); global batch %d x %d "
            "tokens; %d microbatch(es) per step",
            num_parameters / 1e6,
            self.flops_per_token / 1e9,
            config.global_batch_size(world_size),
            seq,
            config.num_microbatches(world_size),
        )
        if self.peak is None:
            logger.info("MFU: no peak FLOP/s known for this device; set logging.peak_tflops to report it")
        else:
            logger.info("MFU denominator: %d device(s) x %s", world_size, self.peak.describe(), extra=DETAIL)

    def __enter__(self) -> RunReporter:
        self.bar.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.bar.__exit__(*exc)

    def step(self, record: dict[str, Any]) -> None:
        """Add throughput and MFU to a step's record, advance the bar, log every ``logging.interval`` steps."""
        seconds = record["step_time_s"]
        tokens_per_s = record.get("step_tokens", self.tokens_per_step) / seconds if seconds > 0 else None
        record["tokens_per_s"] = tokens_per_s
        record["mfu"] = mfu(tokens_per_s * self.flops_per_token, self.peak, self.world_size) if tokens_per_s else None
        fields = [
            f"loss {_fmt(record['loss'], '.4f')}",
            f"lr {_fmt(record['lr'], '.3g')}",
            f"gnorm {_fmt(record['grad_norm'], '.3f')}",
            f"{_fmt(tokens_per_s, ',.0f')} tok/s",
            f"MFU {_fmt(None if record['mfu'] is None else 100 * record['mfu'], '.2f')}%",
        ]
        dpo = []
        if "rewards/accuracies" in record:
            dpo = [
                f"acc {_fmt(record['rewards/accuracies'], '.2f')}",
                f"margin {_fmt(record['rewards/margins'], '.3f')}",
            ]
        # megatron's MoE auxiliary losses (without their coefficients), as its log line names them.
        moe = [f"{name} {_fmt(record[name], '.4g')}" for name in MOE_AUX_LOSSES if name in record]
        status = " ".join(fields + dpo + moe)
        # The bar's fields, most important first: a narrow terminal keeps the first ones.
        self.bar.update(status=fields[:1] + dpo + fields[1:])
        # A skipped step has its own warning line (the trainer's); here it is marked at the interval.
        if record["step"] % self.config.logging.interval == 0:
            logger.info(
                "step %d/%d: %s%s",
                record["step"],
                self.config.train.steps,
                status,
                " (skipped)" if record["skipped"] else "",
            )

    def evaluation(self, record: dict[str, Any]) -> None:
        """Log an evaluation."""
        if "perplexity" in record:
            logger.info(
                "step %d: validation loss %.4f (perplexity %.4g, %d tokens)",
                record["step"],
                record["loss"],
                record["perplexity"],
                record["tokens"],
            )
        else:
            logger.info("step %d: validation loss %.4f (%d samples)", record["step"], record["loss"], record["tokens"])

    def finish(self, records: list[dict[str, Any]]) -> None:
        """Log a summary of the run's steps."""
        done = [r for r in records if not r["skipped"]]
        if not done:
            return
        rates = [r["tokens_per_s"] for r in done[1:] if r.get("tokens_per_s")] or [done[0].get("tokens_per_s") or 0.0]
        logger.info(
            "trained steps %d-%d: loss %.4f -> %.4f, %.0f tokens/s (mean after the first step), %d skipped",
            records[0]["step"],
            records[-1]["step"],
            done[0]["loss"],
            done[-1]["loss"],
            sum(rates) / len(rates),
            len(records) - len(done),
        )
