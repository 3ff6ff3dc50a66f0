"""``mindspeed-mm extract-features --config recipe.yaml [key=value ...]``: cache a data set's latents and text embeddings.

The recipe is a ``train`` recipe (:class:`~mindspeed_mm.config.MMConfig`): ``model.path`` (the
transformer, which picks the text encoders), ``data.files`` (video/image + caption JSON / JSONL),
``data.encoders`` (the pipeline directory with the VAE and text encoders) and ``data.features``
(where the cache goes; ``train`` then reads it with the same recipe). ``--nproc-per-node N`` splits
the shards over N local ranks (``--nnodes`` / ``--node-rank`` / ``--master-addr``: over the ranks of
several nodes, as torchrun's flags do); under ``torchrun`` the command is one rank. A killed run resumes
when run again (:mod:`mindspeed_mm.data.extract`).
"""

from __future__ import annotations

import argparse
import json
import sys

from mindspeed.nodes import add_launch_arguments, nodes_from_args


def add_extract_features(sub: argparse._SubParsersAction) -> None:
    """Add ``extract-features`` to the ``mindspeed-mm`` subcommands."""
    parser = sub.add_parser(
        "extract-features",
        help="run the VAE and text encoders once over video/image data into a feature cache",
        description="Decode the videos and images of data.files (MindSpeed-MM's video/image JSON or image-caption "
        "JSONL), sample frames and resize to the buckets, encode them with the VAE and the captions with "
        "the text encoder(s) of data.encoders, and write safetensors shards plus an index to "
        "data.features, split over ranks and resumable after a kill.",
    )
    parser.add_argument("--config", help="YAML recipe (the train recipe; default: all defaults)")
    add_launch_arguments(parser)
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="dotted overrides, e.g. data.shard_size=32")
    parser.set_defaults(func=run_extract_features)


def _rank_main(config: object) -> object:
    # Lazy: keeps torch out of the start-up of mindspeed_mm.cli.
    from mindspeed_mm.data.extract import extract_features, to_dict

    return to_dict(extract_features(config))


def run_extract_features(args: argparse.Namespace) -> int:
    """Run ``extract-features`` from parsed arguments; returns the exit status."""
    # Lazy: keeps torch out of the start-up of mindspeed_mm.cli.
    from mindspeed.checkpointing import run_lock
    from mindspeed.config import ConfigError
    from mindspeed.launch import launch
    from mindspeed_mm.config import load_mm_config

    nodes = nodes_from_args(args)
    config = load_mm_config(args.config, args.overrides)
    if config.model.path is None or config.task() != "dit":
        raise ConfigError(
            f"model.path={config.model.path!r}: give a diffusers transformer directory (config.json "
            "with `_class_name`); it picks the text encoders"
        )
    if not config.data.features:
        raise ConfigError("data.features is unset: give the directory the cache is written to")
    if not config.data.files:
        raise ConfigError("data.files is empty: give video/image + caption JSON or JSONL files")
    config.data.check_media()
    # One extraction per cache directory: node 0's launcher holds the lock.
    with run_lock(config.data.features, "data.features", node_rank=nodes.node_rank):
        result = launch(
            _rank_main, (config,), nproc_per_node=args.nproc_per_node, log_level=args.log_level, nodes=nodes
        )
    if result is not None:
        sys.stdout.write(json.dumps(result) + "\n")
    return 0
