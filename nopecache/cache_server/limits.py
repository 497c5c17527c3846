"""The transport-level limits of the gRPC port: how many connections, how long one may
take to say hello, how long one may sit idle.

A connection costs the server transport buffers whether or not it carries calls, and the
connection cap (``max_connections``) is shared by everyone; so a connection must earn its
place:

    handshake_timeout_s         TCP accepted, TLS/HTTP2 handshake not finished: closed
                                (a socket that connects and says nothing)
    connection_idle_timeout_s   handshake done, no call in flight for this long: GOAWAY,
                                then closed (a client that sends the HTTP/2 preface and
                                SETTINGS, then nothing)
    max_connections             connections past the cap are closed as they arrive

A well-behaved client does not notice the idle close: gRPC reconnects on its next call.
"""

from __future__ import annotations

from nopecache.cache_server.config import ServerConfig

__all__ = ["FLOW_CONTROL", "STREAM_WINDOW_BYTES", "connection_options"]

# What gRPC buffers for a stream whose handler is not reading: the HTTP/2 stream window.
STREAM_WINDOW_BYTES = 64 * 1024
FLOW_CONTROL: list[tuple[str, int]] = [
    # The bandwidth-delay probe grows every stream's window to megabytes on a fast link;
    # a stream waiting for the in-flight budget would then hold that much unread in the
    # transport, outside the budget.
    ("grpc.http2.bdp_probe", 0),
    ("grpc.http2.lookahead_bytes", STREAM_WINDOW_BYTES),
]


def connection_options(config: ServerConfig) -> list[tuple[str, int]]:
    """gRPC server channel arguments for ``config``'s connection limits."""
    return [
        ("grpc.max_allowed_incoming_connections", config.max_connections),
        ("grpc.server_handshake_timeout_ms", max(1, round(config.handshake_timeout_s * 1000))),
        ("grpc.max_connection_idle_ms", max(1, round(config.connection_idle_timeout_s * 1000))),
        *FLOW_CONTROL,
    ]
