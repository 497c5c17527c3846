"""The backend's settings, read from SGLang's ``--hicache-storage-backend-extra-config`` JSON.

SGLang hands a dynamic backend the whole extra-config dict. Its own keys load the class
(``backend_name``, ``module_path``, ``class_name``) and pick the zero-copy interface
(``interface_v1``); the rest are nopecache's::

    url               required  nopecache://host:port[,host:port...][?query]  (the client's
                                URL: every ClientConfig field has a query parameter)
    namespace         ""        tenant salt: only servers' blocks of the same namespace match
    model             SGLang's  the model's name in the fingerprint, in place of its path
                      path      (default: SGLang's --model-path; set it when two
                                deployments hold one checkpoint at different paths: the
                                revision, quantization, config, weights and RoPE still
                                have to match)
    lookup_timeout_s  URL's     seconds per Lookup (batch_exists), > 0
    get_timeout_s     URL's     seconds per Get stream (batch_get_v1), > 0
    put_timeout_s     URL's     seconds per Put stream (batch_set_v1), > 0
    connect_timeout_s URL's     seconds for the first contact with a server, > 0
    token             none      bearer token the servers require
    tls_ca_file, tls_cert_file, tls_key_file    TLS files (``nopecaches://`` or tls=true)

Keys here override the URL's query. An unknown key, a wrong type or a bad value is a
:class:`SGLangConfigError` naming the key, raised when SGLang builds the backend (at start-up,
or in the reply of a runtime attach).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from nopecache.client.config import ClientConfig
from nopecache.client.errors import InvalidArgumentError

__all__ = ["SGLANG_KEYS", "BackendConfig", "SGLangConfigError"]

# Keys SGLang itself reads from the same dict (storage/backend_factory.py, cache_controller.py).
SGLANG_KEYS = frozenset({"backend_name", "module_path", "class_name", "interface_v1"})
_TIMEOUTS = ("lookup_timeout_s", "get_timeout_s", "put_timeout_s", "connect_timeout_s")
_TEXT = ("token", "tls_ca_file", "tls_cert_file", "tls_key_file")
_OURS = frozenset({"url", "namespace", "model", *_TIMEOUTS, *_TEXT})


class SGLangConfigError(ValueError):
    """The extra config is wrong; the message names the key."""

    def __init__(self, key: str, message: str) -> None:
        self.key = key
        super().__init__(f"hicache-storage-backend-extra-config: {key!r} {message}")


def _text(extra: Mapping[str, Any], key: str) -> str | None:
    value = extra.get(key)
    if value is not None and not isinstance(value, str):
        raise SGLangConfigError(key, f"must be a string, got {type(value).__name__} {value!r}")
    return value


@dataclass(frozen=True, slots=True)
class BackendConfig:
    """What the backend needs: the client's config, the tenant namespace, the model name."""

    client: ClientConfig
    namespace: str
    model: str | None
    interface_v1: bool

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, Any] | None) -> BackendConfig:
        """Validate SGLang's extra-config dict (see the module docstring)."""
        if extra is None:
            raise SGLangConfigError("url", "is required: pass a nopecache:// URL")
        if not isinstance(extra, Mapping):
            raise SGLangConfigError("extra_config", f"must be a JSON object, got {extra!r}")
        for key in extra:
            if key not in _OURS and key not in SGLANG_KEYS:
                known = ", ".join(sorted(_OURS | SGLANG_KEYS))
                raise SGLangConfigError(str(key), f"is not a known key (known: {known})")
        url = _text(extra, "url")
        if not url:
            raise SGLangConfigError("url", "is required: pass a nopecache:// URL")
        try:
            client = ClientConfig.from_url(url)
        except InvalidArgumentError as err:
            raise SGLangConfigError("url", f"is not a valid nopecache URL: {err}") from None
        if client.kv_codec != "none":
            # HiCache pages are SGLang's own bytes under SGLang's page hashes: no codec
            # applies, and SGLang would reuse them as exact.
            raise SGLangConfigError(
                "url", f"kv_codec={client.kv_codec} does not apply to SGLang's pages (use none)"
            )
        changes: dict[str, Any] = {}
        for key in _TIMEOUTS:
            if key not in extra:
                continue
            value = extra[key]
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise SGLangConfigError(key, f"must be a number of seconds, got {value!r}")
            if not math.isfinite(value) or value <= 0:
                raise SGLangConfigError(key, f"must be > 0 seconds, got {value!r}")
            changes[key] = float(value)
        for key in _TEXT:
            text = _text(extra, key)
            if text is not None:
                changes[key] = text
        namespace = _text(extra, "namespace")
        if namespace is not None:
            changes["namespace"] = namespace
        try:
            client = dataclasses.replace(client, **changes)
        except InvalidArgumentError as err:
            raise SGLangConfigError(err.argument, err.reason) from None
        v1 = extra.get("interface_v1", 0)
        if v1 not in (0, 1) or isinstance(v1, float):
            raise SGLangConfigError("interface_v1", f"must be 0 or 1, got {v1!r}")
        model = _text(extra, "model")
        if model == "":
            raise SGLangConfigError("model", "must not be empty")
        return cls(client=client, namespace=client.namespace, model=model, interface_v1=bool(v1))
