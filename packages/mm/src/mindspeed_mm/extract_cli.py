"""``mindspeed-mm extract-features --config recipe.yaml [key=value ...]``: cache a data set's latents and text embeddings.

The recipe is a ``train`` recipe (:class:`~mindspeed_mm.config.MMConfig`): ``model.path`` (the
transformer, which picks the text encoders), ``data.files`` (video/image + caption JSON / JSONL),
``data.encoders`` (the pipeline directory with the VAE and text encoders) and ``data.features``
(where the cache goes; ``train`` then reads it with the same recipe). ``--nproc-per-node N`` splits
the shards over N local ranks; under ``torchrun`` the command is one rank. A killed run resumes
when run again (:mod:`mindspeed_mm.data.extract`).
"""

from __future__ import annotations

import argparse
import json
import sys


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
    parser.add_argument(
        "--nproc-per-node",
        type=int,
        default=1,
        help="ranks to spawn on this machine (ignored under torchrun; default 1)",
    )
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

    if args.nproc_per_node < 1:
        raise ValueError(f"--nproc-per-node={args.nproc_per_node} must be at least 1")
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
    with run_lock(config.data.features, "data.features"):  # one extraction per cache directory
        result = launch(_rank_main, (config,), nproc_per_node=args.nproc_per_node, log_level=args.log_level)
    if result is not None:
        sys.stdout.write(json.dumps(result) + "\n")
    return 0
