"""Engine integrations: one package per engine, each thin glue over client and recompute.

No integration imports another; only an integration's ``compat`` module touches its
engine's internals.
"""
