"""Evaluation pieces the suites share: the math-answer grader (``math_answer``), used by
``mindspeed-llm evaluate --task gsm8k`` and the RL ``math`` reward alike."""
