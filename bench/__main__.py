"""`python -m bench`: the CPU benchmarks, quality then speed, with their default settings."""

from bench import quality, speed

quality.main([])
speed.main([])
