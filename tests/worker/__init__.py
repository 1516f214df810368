"""Tests of the `worker` package."""
