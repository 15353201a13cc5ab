"""Plain data for captured runs (numpy only, no torch, no Qt)."""
