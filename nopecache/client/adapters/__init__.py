"""Old home of the engine integrations, kept so configs naming it keep loading.

The integrations now live in :mod:`nopecache.integrations`.
"""
