"""nopecache client."""
