"""Test-vector factory for Kimi-K2-class (DeepSeek-V3 architecture) inference engines."""

__version__ = "0.1.0"
