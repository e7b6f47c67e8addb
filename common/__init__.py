"""Pieces shared by the router and the worker: errors, datatypes, logging."""
