"""A tiny package the CI pipeline test builds and tests inside a sandbox."""

VERSION = "1"


def add(a: int, b: int) -> int:
    return a + b


def mul(a: int, b: int) -> int:
    return a * b
