"""A plain megatron-core training loop that runs on any accelerator, the CPU included.

The only mindspeed line that matters is ``adapt()``; everything else is ordinary
megatron-core (GPTModel, DistributedDataParallel, the distributed optimizer, the pipeline
schedules). Launch on 2 CPU processes with tensor parallelism 2:

    uv run torchrun --nproc-per-node 2 examples/core/train_gpt_megatron.py --tp 2
    uv run torchrun --nproc-per-node 2 examples/core/train_gpt_megatron.py --dp-only

The same command runs unchanged on GPUs (nccl) and Ascend NPUs (hccl).
"""

from __future__ import annotations

import argparse
import os
import time
from functools import partial

import torch
import torch.distributed as dist

from mindspeed.device import get_accelerator
from mindspeed.log import get_logger, setup_logging
from mindspeed.megatron import adapt
from mindspeed.megatron.spec import get_gpt_layer_spec

logger = get_logger("mindspeed.examples.train_gpt_megatron")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tp", type=int, default=2, help="tensor-parallel size")
    parser.add_argument("--dp-only", action="store_true", help="data parallel only (tp=1)")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--micro-batch-size", type=int, default=4)
    parser.add_argument("--seq-length", type=int, default=64)
    parser.add_argument("--lr", type=float, default=3e-3)
    return parser.parse_args()


def synthetic_batch(step: int, batch: int, seq: int, vocab: int) -> dict[str, torch.Tensor]:
    """A learnable toy language: each token is mostly followed by (7 * token + 3) mod vocab."""
    gen = torch.Generator().manual_seed(step)
    tokens = torch.empty(batch, seq + 1, dtype=torch.long)
    tokens[:, 0] = torch.randint(vocab, (batch,), generator=gen)
    for t in range(1, seq + 1):
        noise = torch.randint(vocab, (batch,), generator=gen)
        keep = torch.rand(batch, generator=gen) > 0.1
        tokens[:, t] = torch.where(keep, (7 * tokens[:, t - 1] + 3) % vocab, noise)
    return {"tokens": tokens[:, :-1], "labels": tokens[:, 1:]}


def main() -> None:
    args = parse_args()
    setup_logging("INFO")
    accelerator = get_accelerator()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    accelerator.set_device(local_rank)
    dist.init_process_group(accelerator.dist_backend)
    report = adapt()  # <- the one call: megatron-core now runs on this accelerator

    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.models.gpt import GPTModel
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from megatron.core.transformer import TransformerConfig

    tp = 1 if args.dp_only else args.tp
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
    model_parallel_cuda_manual_seed(1234)
    vocab = 256
    config = TransformerConfig(
        num_layers=4, hidden_size=128, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=256,
        normalization="RMSNorm", gated_linear_unit=True, activation_func=torch.nn.functional.silu,
        use_te_activation_func=True, bias_activation_fusion=False, add_bias_linear=False,
        hidden_dropout=0.0, attention_dropout=0.0, tensor_model_parallel_size=tp,
        sequence_parallel=tp > 1, use_cpu_initialization=True, pipeline_dtype=torch.float32,
    )
    model = GPTModel(config=config, transformer_layer_spec=get_gpt_layer_spec(), vocab_size=vocab,
                     max_sequence_length=args.seq_length, position_embedding_type="rope")
    model.to(accelerator.device())
    model = DistributedDataParallel(config, DistributedDataParallelConfig(use_distributed_optimizer=True), model)
    config.finalize_model_grads_func = finalize_model_grads
    config.no_sync_func = model.no_sync
    optimizer = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=args.lr, use_distributed_optimizer=True,
                                                       clip_grad=1.0), [model])
    forward_backward = get_forward_backward_func()
    dp_rank = parallel_state.get_data_parallel_rank()
    positions = torch.arange(args.seq_length, device=accelerator.device()).unsqueeze(0)

    def forward_step(data_iterator, model):
        batch = next(data_iterator)
        output = model(batch["tokens"], positions.expand_as(batch["tokens"]), None, labels=batch["labels"])

        def loss_func(output_tensor):
            loss = output_tensor.float().mean()
            return loss, {"lm loss": loss.detach()}

        return output, loss_func

    start = time.perf_counter()
    for step in range(1, args.steps + 1):
        # Each data-parallel rank reads its own shard of the global batch.
        batch = synthetic_batch(1000 * step + dp_rank, args.micro_batch_size, args.seq_length, vocab)
        batch = {k: v.to(accelerator.device()) for k, v in batch.items()}
        model.zero_grad_buffer()
        optimizer.zero_grad()
        losses = forward_backward(forward_step_func=forward_step, data_iterator=iter([batch]), model=[model],
                                  num_microbatches=1, seq_length=args.seq_length,
                                  micro_batch_size=args.micro_batch_size, forward_only=False)
        _, grad_norm, _ = optimizer.step()
        loss = losses[0]["lm loss"].clone()
        dist.all_reduce(loss, group=parallel_state.get_data_parallel_group())
        loss /= parallel_state.get_data_parallel_world_size()
        if step == 1 or step % 5 == 0:
            logger.info("step %d loss %.4f grad norm %.3f", step, loss.item(), grad_norm)
    elapsed = time.perf_counter() - start
    tokens = args.steps * args.micro_batch_size * args.seq_length * parallel_state.get_data_parallel_world_size()
    logger.info("done: %d steps, %.0f tokens/s, tp=%d dp=%d, %d patches applied", args.steps, tokens / elapsed, tp,
                parallel_state.get_data_parallel_world_size(), len(report.patches))
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
