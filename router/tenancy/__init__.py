"""Tenancy: who is calling (auth, keys) and how much they may (limits and their scripts)."""
