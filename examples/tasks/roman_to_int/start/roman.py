def roman_to_int(numeral: str) -> int:
    """Convert a Roman numeral (I, V, X, L, C, D, M; subtractive forms) to an integer."""
    raise NotImplementedError
