"""Held-out evaluation: eval sets, the majority baseline, accuracy statistics."""
