"""Test support: fixtures for the real services the tests run against."""
