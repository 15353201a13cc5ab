"""Test support that ships with the package: tiny models built offline (tests, benchmarks, screenshots)."""
