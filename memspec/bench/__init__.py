"""`memspec bench`: draft policies side by side on a prompt workload."""
