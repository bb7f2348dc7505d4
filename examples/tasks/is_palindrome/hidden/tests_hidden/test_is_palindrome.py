from palindrome import is_palindrome


def test_simple():
    assert is_palindrome("level")


def test_not_palindrome():
    assert not is_palindrome("python")


def test_case_insensitive():
    assert is_palindrome("RaceCar")


def test_ignores_punctuation_and_spaces():
    assert is_palindrome("A man, a plan, a canal: Panama!")


def test_empty_and_single():
    assert is_palindrome("")
    assert is_palindrome("x")


def test_digits_count():
    assert is_palindrome("12 3 21")
    assert not is_palindrome("123")
