"""Load generator for any KServe v2 gRPC endpoint: `python -m loadtest --help`.

`runner` drives the load (closed loop at a concurrency, or open loop with Poisson arrivals),
`stats` keeps an HDR histogram and error counts, `inputs` builds the requests, `plots` draws.
"""
