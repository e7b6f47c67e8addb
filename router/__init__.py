"""meshserve router: one KServe v2 endpoint over many worker replicas."""
