"""lm-evaluation-harness as an evaluation backend (the ``eval`` extra: ``pip install 'mindspeed-llm[eval]'``).

- :mod:`.model`: ``mindspeed``, the suite's inference engine as an lm-eval model
  (``register_harness_model``; ``mindspeed-lm-eval`` is lm-eval's CLI with it registered).
- :mod:`.run`: ``mindspeed-llm evaluate --harness``: lm-eval's ``simple_evaluate`` on it.
- ``tasks/``: our built-in tasks (MMLU, GSM8K, perplexity) as lm-eval task YAMLs over local data.

Importing this package imports nothing of lm-eval; :func:`require_lm_eval` says when it is missing.
"""

from __future__ import annotations

import os

#: What to install for the harness backend.
EXTRA_HINT = "pip install 'mindspeed-llm[eval]'"


def require_lm_eval() -> None:
    """Check that lm-eval is importable.

    Raises:
        ValueError: it is not, naming the extra to install.
    """
    try:
        import lm_eval  # noqa: F401
    except ImportError as err:
        raise ValueError(
            f"--harness needs EleutherAI's lm-evaluation-harness (lm_eval); install the extra: {EXTRA_HINT}"
        ) from err


def import_lm_eval() -> None:
    """Import lm-eval leaving the process environment as it was.

    ``import lm_eval`` sets ``HF_XET_HIGH_PERFORMANCE`` (a Hub download knob, lm-eval 0.4.13); the
    modules that subclass lm-eval's classes import it through here, so importing them changes nothing.
    """
    environ = dict(os.environ)
    try:
        import lm_eval  # noqa: F401
    finally:
        for key in set(os.environ) - set(environ):
            del os.environ[key]
        os.environ.update(environ)
