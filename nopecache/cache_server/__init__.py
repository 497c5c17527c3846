"""nopecache cache_server."""
