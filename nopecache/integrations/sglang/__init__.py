"""SGLang integration: nopecache as a HiCache L3 storage backend (``backend.NopecacheStorage``).

Loaded by SGLang's dynamic storage factory (see ``backend.py`` and docs/sglang.md). Only
``backend.py`` and ``compat.py`` import SGLang; this package's ``__init__`` imports nothing,
so ``module_path`` names ``nopecache.integrations.sglang.backend``.
"""
