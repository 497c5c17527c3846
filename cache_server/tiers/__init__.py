"""nopecache cache_server.tiers."""
