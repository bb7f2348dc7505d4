def fizzbuzz(n: int) -> list[str]:
    """Return the FizzBuzz sequence for 1..n."""
    raise NotImplementedError
