"""Runtimes that execute exported artifacts."""
