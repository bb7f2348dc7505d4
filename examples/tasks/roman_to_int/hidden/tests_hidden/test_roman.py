import pytest
from roman import roman_to_int


@pytest.mark.parametrize(
    "numeral, value",
    [("I", 1), ("III", 3), ("VIII", 8), ("LVIII", 58), ("MMXXV", 2025)],
)
def test_additive(numeral, value):
    assert roman_to_int(numeral) == value


@pytest.mark.parametrize(
    "numeral, value",
    [("IV", 4), ("IX", 9), ("XL", 40), ("XC", 90), ("CD", 400), ("CM", 900), ("MCMXCIV", 1994)],
)
def test_subtractive(numeral, value):
    assert roman_to_int(numeral) == value
