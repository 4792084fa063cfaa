"""The contract's one error: an engine's output that breaks it."""

from k2vec.errors import K2VecError


class InvalidResult(K2VecError):
    """The engine's output breaks the contract; the message becomes the failure reason of its run."""
