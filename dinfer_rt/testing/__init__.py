"""Helpers shared by the test suite and the validation suite (tiny real-layout checkpoints)."""
