"""The embedded-default job: train a tiny Llama on generated data, on whatever accelerator.

Runs in seconds on a laptop CPU. The data is a synthetic language with learnable structure
(each token is followed by a fixed successor most of the time), so the loss visibly falls
from ln(vocab) towards the noise floor; the run fails if it does not.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from mindspeed.device import get_accelerator
from mindspeed.log import get_logger
from mindspeed.metrics.memory import measure_peak_memory
from mindspeed.ops import resolve_kernel
from mindspeed.ops.adamw import FusedAdamW
from mindspeed.progress import StatusProgress
from mindspeed.testing.models import TINY_CONFIGS
from mindspeed.testing.tiny_llama import TinyLlama

logger = get_logger(__name__)


@dataclass
class DemoConfig:
    """Settings of ``mindspeed demo`` (all overridable as ``key=value``)."""

    model: str = "llama-tiny"
    steps: int = 60
    batch_size: int = 8
    seq_length: int = 64
    lr: float = 3e-3
    weight_decay: float = 0.01
    noise: float = 0.1
    impl: str = "auto"
    seed: int = 1234
    log_interval: int = 10


@dataclass
class DemoResult:
    """What the demo measured."""

    first_loss: float
    last_loss: float
    floor: float
    tokens_per_second: float
    peak_memory_bytes: int
    kernels: dict[str, str]


def make_batch(successor: torch.Tensor, cfg: DemoConfig, gen: torch.Generator) -> torch.Tensor:
    """Token ids ``[batch, seq + 1]``: a chain through ``successor`` with random jumps."""
    vocab = successor.numel()
    tokens = torch.empty(cfg.batch_size, cfg.seq_length + 1, dtype=torch.long)
    tokens[:, 0] = torch.randint(vocab, (cfg.batch_size,), generator=gen)
    for t in range(1, cfg.seq_length + 1):
        jump = torch.rand(cfg.batch_size, generator=gen) < cfg.noise
        tokens[:, t] = torch.where(
            jump, torch.randint(vocab, (cfg.batch_size,), generator=gen), successor[tokens[:, t - 1]]
        )
    return tokens


def run_demo(cfg: DemoConfig) -> DemoResult:
    """Train for ``cfg.steps`` and return the measured losses and throughput.

    Raises:
        RuntimeError: if the loss did not fall (a broken kernel or optimizer).
    """
    accelerator = get_accelerator()
    device = accelerator.device()
    torch.manual_seed(cfg.seed)
    model_cfg = TINY_CONFIGS.get(cfg.model)
    model = TinyLlama(model_cfg, impl=cfg.impl).to(device)
    optimizer = FusedAdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay, impl=cfg.impl)
    kernels = {
        op: resolve_kernel(op, cfg.impl, features=features).name
        for op, features in (("rms_norm", ()), ("rotary_pos_emb", ()), ("attention", ()), ("swiglu", ()), ("adamw", ()))
    }
    logger.info(
        "demo: %s (%d parameters) on %s, kernels %s",
        cfg.model,
        sum(p.numel() for p in model.parameters()),
        accelerator.name,
        kernels,
    )
    gen = torch.Generator().manual_seed(cfg.seed)
    successor = torch.randperm(model_cfg.vocab_size, generator=gen)
    # Noise floor: with prob (1-noise) the successor is certain, else uniform over the vocab.
    p_next = 1 - cfg.noise + cfg.noise / model_cfg.vocab_size
    floor = -(p_next * math.log(p_next) + (1 - p_next) * math.log(cfg.noise / model_cfg.vocab_size))
    losses: list[float] = []
    start = time.perf_counter()
    with measure_peak_memory() as memory, StatusProgress("demo", total=cfg.steps) as bar:
        for step in range(1, cfg.steps + 1):
            batch = make_batch(successor, cfg, gen).to(device)
            logits = model(batch[:, :-1])
            loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
            bar.update(status=f"loss {losses[-1]:.3f}")
            if step % cfg.log_interval == 0 or step == cfg.steps:
                logger.info("step %d/%d loss %.4f", step, cfg.steps, losses[-1])
    accelerator.synchronize()
    elapsed = time.perf_counter() - start
    window = max(1, min(5, cfg.steps // 4))
    result = DemoResult(
        first_loss=sum(losses[:window]) / window,
        last_loss=sum(losses[-window:]) / window,
        floor=floor,
        tokens_per_second=cfg.steps * cfg.batch_size * cfg.seq_length / elapsed,
        peak_memory_bytes=memory.peak_bytes,
        kernels=kernels,
    )
    if not result.last_loss < 0.75 * result.first_loss:
        raise RuntimeError(
            f"the demo's loss did not fall ({result.first_loss:.3f} -> {result.last_loss:.3f}); "
            f"re-run with impl=reference to tell a kernel problem from a training problem"
        )
    return result
