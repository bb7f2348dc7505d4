from words import word_count


def test_empty():
    assert word_count("") == {}


def test_simple():
    assert word_count("one two two") == {"one": 1, "two": 2}


def test_case_insensitive():
    assert word_count("Go go GO") == {"go": 3}


def test_punctuation_separates():
    assert word_count("hello, world! hello...world") == {"hello": 2, "world": 2}


def test_apostrophes_inside_words():
    expected = {"don't": 1, "stop": 1, "quoted": 1, "it's": 1}
    assert word_count("don't stop, 'quoted' it's") == expected


def test_digits_are_words():
    assert word_count("route 66 and 66") == {"route": 1, "66": 2, "and": 1}
