"""What a worker replica of either role runs on: the replica base, its TP ranks as Ray
actors, its KV targets, and its membership in the cluster's prefix index."""
