"""argparse value types shared by the commands: each names the rule a bad value broke."""

import argparse


def names(text: str) -> list[str]:
    return [name.strip() for name in text.split(",") if name.strip()]


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value
