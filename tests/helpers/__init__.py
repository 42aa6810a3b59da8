"""Shared fakes and fixtures of the test suite (unit-test doubles, named Fake*)."""
