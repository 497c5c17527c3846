"""nopecache on transformers: the research harness for reuse-quality measurements."""
