"""`python -m bench`: the CPU benchmarks, quality, speed, then serving speed, with their default settings."""

from bench import engines, quality, speed

quality.main([])
speed.main([])
engines.main([])
