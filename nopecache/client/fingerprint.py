"""ModelFingerprint: what must match for two blocks of KV to be interchangeable.

Every key hashes the fingerprint's digest, so KV of another model, revision, layout,
dtype or stored form can never be found under the same key. The encoding is explicit
and length-prefixed (no pickle, no ``hash()``), identical on every process and machine:

    offset  size  field
    0       4     magic b"NCFP"
    4       1     encoding version (1)
    5       1     stored form (StoredForm value)
    6       4     num_layers    u32 little-endian
    10      4     num_kv_heads  u32
    14      4     head_dim      u32
    18      4+n   dtype         u32 length + ASCII torch dtype name ("bfloat16")
    ..      4+n   model         u32 length + UTF-8
    ..      4+n   revision      u32 length + UTF-8
    ..      4+16  rope_digest   u32 length (16) + RopeSpec.digest()

A *head group* (blocks that hold KV heads ``[kv_head_start, kv_head_start +
num_kv_heads)`` of a model with ``kv_heads_total`` KV heads: what a tensor-parallel rank
stores, see ``head_groups.py``) is encoded as version 2, the version-1 bytes followed by::

    ..      4     kv_head_start   u32
    ..      4     kv_heads_total  u32

A fingerprint of every head (``kv_heads_total == 0``) keeps version 1, so the keys of
whole-head blocks do not change.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field, replace

import torch
import xxhash

from nopecache.client.errors import InvalidArgumentError
from nopecache.kernels import RopeSpec
from nopecache.proto.block import DTYPE_ITEMSIZE, StoredForm

# Torch dtype names a block may be stored in (``str(torch.bfloat16)`` minus "torch."):
# exactly those the block format can carry.
SUPPORTED_DTYPES: frozenset[str] = frozenset(DTYPE_ITEMSIZE)
ROPE_DIGEST_SIZE = 16
FINGERPRINT_DIGEST_SIZE = 16

_MAGIC = b"NCFP"
_VERSION = 1
_VERSION_HEAD_GROUP = 2
_HEAD = struct.Struct("<4sBBIII")
_GROUP = struct.Struct("<II")
_LEN = struct.Struct("<I")
_U32_MAX = 2**32 - 1


def dtype_name(dtype: torch.dtype | str) -> str:
    """The canonical name of a torch dtype (``torch.bfloat16`` -> ``"bfloat16"``)."""
    name = str(dtype).removeprefix("torch.")
    if name not in SUPPORTED_DTYPES:
        raise InvalidArgumentError(
            "dtype", f"{name!r} is not a supported KV dtype {sorted(SUPPORTED_DTYPES)}"
        )
    return name


def _check_count(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidArgumentError(name, f"must be an int, got {type(value).__name__}")
    if not 0 < value <= _U32_MAX:
        raise InvalidArgumentError(name, f"must be in [1, 2**32), got {value}")


@dataclass(frozen=True, slots=True)
class ModelFingerprint:
    """Identity of a model's cached KV: model, revision, shape, dtype, form, RoPE."""

    model: str
    revision: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    form: StoredForm
    rope_digest: bytes
    # A head group of a model with kv_heads_total KV heads (0: every head, version 1).
    kv_head_start: int = 0
    kv_heads_total: int = 0
    # Cached canonical encoding; keys hash the digest of it once per chunk.
    _encoded: bytes = field(init=False, repr=False, compare=False, hash=False)

    def __post_init__(self) -> None:
        if not isinstance(self.model, str) or not self.model:
            raise InvalidArgumentError("model", f"must be a non-empty str, got {self.model!r}")
        if not isinstance(self.revision, str):
            raise InvalidArgumentError("revision", f"must be a str, got {self.revision!r}")
        _check_count("num_layers", self.num_layers)
        _check_count("num_kv_heads", self.num_kv_heads)
        _check_count("head_dim", self.head_dim)
        if not isinstance(self.dtype, str):
            raise InvalidArgumentError(
                "dtype", f"must be a dtype name str such as 'bfloat16', got {self.dtype!r}"
            )
        dtype_name(self.dtype)
        try:
            form = StoredForm(self.form)
        except ValueError:
            raise InvalidArgumentError(
                "form", f"must be a StoredForm {[f.name for f in StoredForm]}, got {self.form!r}"
            ) from None
        object.__setattr__(self, "form", form)
        if not isinstance(self.rope_digest, bytes) or len(self.rope_digest) != ROPE_DIGEST_SIZE:
            raise InvalidArgumentError(
                "rope_digest", f"must be {ROPE_DIGEST_SIZE} bytes (RopeSpec.digest())"
            )
        self._check_group()
        object.__setattr__(self, "_encoded", self._encode())

    def _check_group(self) -> None:
        start, total = self.kv_head_start, self.kv_heads_total
        for name, value in (("kv_head_start", start), ("kv_heads_total", total)):
            if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= _U32_MAX:
                raise InvalidArgumentError(name, f"must be an int in [0, 2**32), got {value!r}")
        if total == 0:
            if start != 0:
                raise InvalidArgumentError(
                    "kv_head_start", f"is {start} but kv_heads_total is 0 (every head)"
                )
            return
        if start + self.num_kv_heads > total:
            raise InvalidArgumentError(
                "kv_head_start",
                f"heads [{start}, {start + self.num_kv_heads}) pass the model's {total}",
            )
        if start == 0 and self.num_kv_heads == total:  # every head: one canonical form
            object.__setattr__(self, "kv_heads_total", 0)

    @property
    def is_head_group(self) -> bool:
        """True when the blocks hold some of the model's KV heads, not all."""
        return self.kv_heads_total != 0

    def head_group(self, start: int, count: int) -> ModelFingerprint:
        """The fingerprint of blocks holding KV heads ``[start, start + count)`` of these."""
        if self.is_head_group:
            raise InvalidArgumentError("head_group", "this fingerprint is a head group already")
        _check_count("count", count)
        return replace(
            self, num_kv_heads=count, kv_head_start=start, kv_heads_total=self.num_kv_heads
        )

    @classmethod
    def from_rope_spec(
        cls,
        *,
        model: str,
        revision: str,
        num_layers: int,
        num_kv_heads: int,
        dtype: torch.dtype | str,
        form: StoredForm,
        rope: RopeSpec,
    ) -> ModelFingerprint:
        """Fingerprint whose head_dim and RoPE digest come from ``rope``."""
        return cls(
            model=model,
            revision=revision,
            num_layers=num_layers,
            num_kv_heads=num_kv_heads,
            head_dim=rope.head_dim,
            dtype=dtype_name(dtype),
            form=form,
            rope_digest=rope.digest(),
        )

    @property
    def torch_dtype(self) -> torch.dtype:
        """The fingerprint's dtype as a ``torch.dtype``."""
        dt = getattr(torch, self.dtype)
        assert isinstance(dt, torch.dtype)
        return dt

    def _encode(self) -> bytes:
        version = _VERSION_HEAD_GROUP if self.is_head_group else _VERSION
        parts = [
            _HEAD.pack(
                _MAGIC,
                version,
                int(self.form),
                self.num_layers,
                self.num_kv_heads,
                self.head_dim,
            )
        ]
        for blob in (
            self.dtype.encode("ascii"),
            self.model.encode("utf-8"),
            self.revision.encode("utf-8"),
            self.rope_digest,
        ):
            parts.append(_LEN.pack(len(blob)))
            parts.append(blob)
        if self.is_head_group:
            parts.append(_GROUP.pack(self.kv_head_start, self.kv_heads_total))
        return b"".join(parts)

    def to_bytes(self) -> bytes:
        """Canonical encoding (see the module docstring), stable across processes."""
        return self._encoded

    def digest(self) -> bytes:
        """16-byte xxh3-128 digest of :meth:`to_bytes`."""
        return xxhash.xxh3_128_digest(self._encoded)

    @classmethod
    def from_bytes(cls, data: bytes) -> ModelFingerprint:
        """Decode :meth:`to_bytes` output; malformed input raises InvalidArgumentError."""
        if not isinstance(data, bytes | bytearray | memoryview):
            raise InvalidArgumentError("data", f"must be bytes, got {type(data).__name__}")
        buf = bytes(data)
        if len(buf) < _HEAD.size:
            raise InvalidArgumentError("data", f"{len(buf)} bytes is shorter than the header")
        magic, version, form, layers, heads, head_dim = _HEAD.unpack_from(buf)
        if magic != _MAGIC:
            raise InvalidArgumentError("data", f"bad magic {magic!r}, expected {_MAGIC!r}")
        if version not in (_VERSION, _VERSION_HEAD_GROUP):
            raise InvalidArgumentError("data", f"unknown fingerprint encoding v{version}")
        pos = _HEAD.size
        blobs: list[bytes] = []
        for name in ("dtype", "model", "revision", "rope_digest"):
            if pos + _LEN.size > len(buf):
                raise InvalidArgumentError("data", f"truncated before the {name} length")
            (n,) = _LEN.unpack_from(buf, pos)
            pos += _LEN.size
            if pos + n > len(buf):
                raise InvalidArgumentError("data", f"truncated inside {name}")
            blobs.append(buf[pos : pos + n])
            pos += n
        group = (0, 0)
        if version == _VERSION_HEAD_GROUP:
            if pos + _GROUP.size > len(buf):
                raise InvalidArgumentError("data", "truncated inside the head group")
            group = _GROUP.unpack_from(buf, pos)
            pos += _GROUP.size
            if group[1] == 0:
                raise InvalidArgumentError("data", "a version-2 fingerprint with 0 heads in all")
        if pos != len(buf):
            raise InvalidArgumentError("data", f"{len(buf) - pos} trailing bytes")
        try:
            dtype = blobs[0].decode("ascii")
            model = blobs[1].decode("utf-8")
            revision = blobs[2].decode("utf-8")
        except UnicodeDecodeError as exc:
            raise InvalidArgumentError("data", f"invalid text field: {exc}") from None
        return cls(
            model=model,
            revision=revision,
            num_layers=layers,
            num_kv_heads=heads,
            head_dim=head_dim,
            dtype=dtype,
            form=form,
            rope_digest=blobs[3],
            kv_head_start=group[0],
            kv_heads_total=group[1],
        )
