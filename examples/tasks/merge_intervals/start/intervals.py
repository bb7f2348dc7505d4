def merge_intervals(intervals: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Merge overlapping closed intervals [start, end]; return them sorted by start."""
    raise NotImplementedError
