"""Counted nouns as people write them."""


def plural(n: int, word: str, words: str | None = None) -> str:
    """"1 engine", "2 engines", "1,024 rows" (`words` for an irregular plural or a verb phrase)."""
    return f"{n:,} {word if n == 1 else words or word + 's'}"
