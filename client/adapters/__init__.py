"""nopecache client.adapters."""
