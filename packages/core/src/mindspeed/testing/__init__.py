"""Test helpers shared by every package: spawned gloo ranks, tiny models, op parity."""
