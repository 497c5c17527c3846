"""The server's name for the shared byte-size parser (it lives in ``nopecache.proto.sizes``)."""

from nopecache.proto.sizes import SizeError, format_size, parse_size

__all__ = ["SizeError", "format_size", "parse_size"]
