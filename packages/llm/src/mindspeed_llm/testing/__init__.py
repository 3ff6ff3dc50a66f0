"""Test helpers of the LLM suite: tiny random-weight models of every bridged family."""
