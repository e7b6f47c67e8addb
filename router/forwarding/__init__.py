"""Forwarding: which replica takes a request (registry, routing, policies, prefix index,
affinity) and carrying it there and back (dispatch, streams)."""
