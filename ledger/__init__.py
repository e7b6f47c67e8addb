"""meshserve ledger: the router's per-call counters made durable and turned into economics.

The ledger is its own process (the folder layout is the process layout): it reads the
routers' batch streams from Redis, applies each batch exactly once to SQLite or PostgreSQL,
and reports revenue against training cost (p x N >= T) and serving cost per call.
"""
