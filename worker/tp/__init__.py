"""Tensor parallelism: a shard group (its process group, leader, ranks, shard runtime, serving
and the LLM step of a group) seen by the mesh as one replica."""
