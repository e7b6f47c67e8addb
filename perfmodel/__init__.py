"""The performance model both the worker (its live roofline figures) and the planner (its
capacity plans) read: hardware profiles, the graph analysis, the Roofline diagnosis and the
queueing model. Pure: no process, network or clock; nothing here imports a serving or
planning package."""
