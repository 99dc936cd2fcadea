"""Compatibility helpers for code written for other launchers and frameworks."""
