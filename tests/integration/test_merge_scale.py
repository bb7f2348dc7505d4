"""The merge at scale, measured in a forked process (bench/bench_merge.py) for its peak memory."""


def test_merge_of_40000_calls_stays_under_a_gibibyte():
    """The former n x n table alone took 9 bytes x calls squared: 13.5 GiB here."""
    from bench.bench_merge import scale

    result = scale(40_000)
    assert result["sequences"] > 0
    assert result["peak_bytes"] < 1 << 30, result
