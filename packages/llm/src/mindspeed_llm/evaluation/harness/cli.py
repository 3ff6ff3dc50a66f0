"""``mindspeed-lm-eval``: lm-eval's own command line with the ``mindspeed`` model registered.

lm-eval 0.4 finds models in its own registry only (no plugin entry points), so ``lm_eval --model
mindspeed`` needs the registration this wrapper makes first; every flag is lm-eval's, e.g.
``mindspeed-lm-eval run --model mindspeed --model_args pretrained=DIR,batch_size=8 --tasks ...``.
"""

from __future__ import annotations

import sys

from mindspeed_llm.evaluation.harness import EXTRA_HINT


def main() -> None:
    """Register ``mindspeed`` and hand over to lm-eval's CLI (which reads the process arguments)."""
    try:
        from lm_eval.__main__ import cli_evaluate
    except ModuleNotFoundError as err:
        if err.name != "lm_eval" and not str(err.name).startswith("lm_eval."):
            raise
        sys.stderr.write(
            f"mindspeed-lm-eval needs EleutherAI's lm-evaluation-harness (lm_eval); install the extra: {EXTRA_HINT}\n"
        )
        raise SystemExit(2) from None
    from mindspeed_llm.evaluation.harness.model import register_harness_model

    register_harness_model()
    cli_evaluate()
