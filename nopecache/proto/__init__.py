"""nopecache proto."""
