"""Where sandboxes run: local processes (local.py) or Ray tasks on a cluster (ray.py)."""
