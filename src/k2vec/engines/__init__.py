"""Engines under test: the invocation contract, the failure-isolating runner, and the numpy engine."""
