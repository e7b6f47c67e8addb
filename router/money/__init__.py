"""Money: a request's bookkeeping (guard), its price (billing), the counts committed to
Redis (accounting, usage) and batch jobs."""
