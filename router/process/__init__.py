"""Process: one router process assembled (server), configured (settings), and the supervisor
of the processes sharing a port (processes)."""
