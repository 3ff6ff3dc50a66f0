"""megatron-core's ``dist_checkpointing`` loads that run no code from the checkpoint.

megatron builds its own torch DCP reader (which unpickles ``.metadata`` with plain ``pickle``)
and planner (which loads non-tensor items with weights-only loading off), and loads
``common.pt`` and sharded-object files with ``torch.load``'s default. Inside
:func:`trusted_dist_loads` its reader is :class:`~mindspeed.checkpointing.trust.SafeFileSystemReader`
(a version-checked patch of its one reader factory) and every ``torch.load`` is weights-only
(:func:`~mindspeed.checkpointing.trust.weights_only_loads`; megatron-core registers the classes
its ``common.pt`` holds, ``argparse.Namespace`` and a few enums, with torch's allow-list on
import). :func:`check_dist_checkpoint` reads ``.metadata`` and ``common.pt`` the safe way before
megatron touches the directory, so that a refused file is one line (inside megatron's load a
refusal surfaces as megatron's or DCP's exception).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from mindspeed.checkpointing.trust import SafeFileSystemReader, check_dcp_checkpoint, weights_only_loads
from mindspeed.device import get_accelerator
from mindspeed.megatron.patches import MEGATRON_VERSIONS
from mindspeed.patching import PatchSet, UpstreamPatch

#: megatron-core's file of the checkpoint's common (non-sharded) state.
COMMON_FILE = "common.pt"


def _register_megatron_classes() -> None:
    # Imported here, not at module import: megatron-core's import prints warnings (no Apex, no
    # CUDA) that a CLI shows only after its console is set up. On import it adds the classes
    # common.pt holds to torch's weights-only allow-list.
    import megatron.core  # noqa: F401


def _safe_reader(original: Any, accelerator: Any) -> Any:
    def get_reader(checkpoint_dir: Any, cache_metadata: bool = False) -> SafeFileSystemReader:
        return SafeFileSystemReader(checkpoint_dir)  # caches its metadata either way

    return get_reader


def safe_reader_patch() -> UpstreamPatch:
    """megatron's DCP reader factory returns a :class:`SafeFileSystemReader`."""
    return UpstreamPatch(
        name="dist-checkpoint-safe-metadata",
        target="megatron.core.dist_checkpointing.strategies.torch._get_filesystem_reader",
        make=_safe_reader,
        distribution="megatron-core",
        versions=MEGATRON_VERSIONS,
        reason="torch's FileSystemReader unpickles .metadata with plain pickle: a checkpoint from "
        "elsewhere could run code; the safe reader resolves only the classes DCP metadata is made of",
    )


@contextlib.contextmanager
def trusted_dist_loads() -> Iterator[None]:
    """megatron-core loads inside read ``.metadata`` safely and ``torch.load`` weights-only."""
    _register_megatron_classes()
    patches = PatchSet([safe_reader_patch()])
    patches.apply(get_accelerator())
    try:
        with weights_only_loads():
            yield
    finally:
        patches.revert()


def check_dist_checkpoint(directory: str | Path) -> None:
    """Read ``directory``'s ``.metadata`` and ``common.pt`` without running code (one-line errors).

    Raises:
        UntrustedFileError: a file holds something loading it would execute.
        ConfigError: ``.metadata`` is missing or damaged.
    """
    _register_megatron_classes()
    check_dcp_checkpoint(directory, common=COMMON_FILE)
