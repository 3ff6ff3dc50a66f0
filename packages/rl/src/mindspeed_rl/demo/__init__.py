"""The tiny demo policy (``model``: built on first use from the arithmetic prompts) and its
``mindspeed-rl make-demo-model`` command (``cli``)."""
