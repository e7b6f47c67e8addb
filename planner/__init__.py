"""Which resource is the limit? Roofline diagnosis and capacity planning (issue 14)."""
