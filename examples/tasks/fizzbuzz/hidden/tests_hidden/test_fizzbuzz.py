from fizzbuzz import fizzbuzz


def test_empty():
    assert fizzbuzz(0) == []


def test_plain_numbers():
    assert fizzbuzz(2) == ["1", "2"]


def test_fizz():
    assert fizzbuzz(3)[-1] == "Fizz"
    assert fizzbuzz(9)[-1] == "Fizz"


def test_buzz():
    assert fizzbuzz(5)[-1] == "Buzz"
    assert fizzbuzz(10)[-1] == "Buzz"


def test_fizzbuzz():
    assert fizzbuzz(15)[-1] == "FizzBuzz"
    assert fizzbuzz(30)[-1] == "FizzBuzz"


def test_first_fifteen():
    assert fizzbuzz(15) == [
        "1", "2", "Fizz", "4", "Buzz", "Fizz", "7", "8", "Fizz", "Buzz",
        "11", "Fizz", "13", "14", "FizzBuzz",
    ]
