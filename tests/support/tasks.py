"""Task files shared by the sandbox tests."""

FIZZBUZZ_HIDDEN_TESTS = '''
from fizzbuzz import fizzbuzz

def test_one():
    assert fizzbuzz(1) == ["1"]

def test_fizz():
    assert fizzbuzz(3)[-1] == "Fizz"

def test_buzz():
    assert fizzbuzz(5)[-1] == "Buzz"

def test_fizzbuzz():
    assert fizzbuzz(15)[-1] == "FizzBuzz"
'''
