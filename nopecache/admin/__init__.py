"""``nopecache-admin``: operate a cache server from a shell, like ``redis-cli``.

Verbs (see ``cli.py`` and docs/operations.md): stats, lookup, flush, pin, unpin, drain,
quota. It speaks ``nopecache.v1.Admin`` (cache_server/admin_service.py) to one server,
with the client's URL, TLS and token rules (``nopecache.client.config``).
"""
