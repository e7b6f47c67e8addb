"""Launchers, compose stacks and the small model repository `make run` serves."""
