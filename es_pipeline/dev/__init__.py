"""Development only: the local PostgreSQL server, the demo workload, the demo pass, the whole stack in processes.

Never imported by `defs/` or the library layers.
"""
