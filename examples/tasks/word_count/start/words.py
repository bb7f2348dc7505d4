def word_count(text: str) -> dict[str, int]:
    """Count words case-insensitively. A word is a run of letters, digits and apostrophes
    (an apostrophe only inside a word); everything else separates words."""
    raise NotImplementedError
