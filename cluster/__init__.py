"""What the router and both worker roles share: the cluster's configuration, the Redis
prefix index and a worker's membership in it, and the worker replica base.

Importing `pdserve.cluster.config` or `pdserve.cluster.prefix_index` never imports torch
(the router relies on it); `pdserve.runtime.replica` does.
"""
