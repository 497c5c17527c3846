"""ModelFingerprint: what must match for two blocks of KV to be interchangeable.

Every key hashes the fingerprint's digest, so KV of another model, revision, weights,
quantization, config, layout, dtype, stored form or RoPE can never be found under the same
key. The encoding is explicit and length-prefixed (no pickle, no ``hash()``), identical on
every process and machine:

    offset  size  field
    0       4     magic b"NCFP"
    4       1     encoding version (1 to 4, below)
    5       1     stored form (StoredForm value)
    6       4     num_layers    u32 little-endian
    10      4     num_kv_heads  u32
    14      4     head_dim      u32
    18      4+n   dtype         u32 length + ASCII torch dtype name ("bfloat16")
    ..      4+n   model         u32 length + UTF-8 (path or hub id, never a served alias)
    ..      4+n   revision      u32 length + UTF-8 (commit hash, else the configured one)
    ..      4+16  rope_digest   u32 length (16) + RopeSpec.digest()

The *model source* (what an engine loaded, ``model_source.py``) follows in versions 3
and 4::

    ..      4+n   quantization    u32 length + UTF-8 method name ("fp8"; "" unquantized)
    ..      4+n   config_digest   u32 length (0 or 16) + digest of the text config
    ..      4+n   weights_digest  u32 length (0 or 16) + digest of the weight files
    ..      4     rope_max_len    u32: the max_model_len the engine's rotation depends on
                                  (0: it depends on none)

A *head group* (blocks that hold KV heads ``[kv_head_start, kv_head_start +
num_kv_heads)`` of a model with ``kv_heads_total`` KV heads: what a tensor-parallel rank
stores, see ``head_groups.py``) appends, last::

    ..      4     kv_head_start   u32
    ..      4     kv_heads_total  u32

A *compact stored form* (``kv_codec``: blocks hold approximate KV, see
``proto/kv_codec.py``) appends, last, and adds 4 to the version (5 to 8)::

    ..      4+n   codec           u32 length + ASCII codec name ("fp8", "k16v8")

    version  model source  head group  (+4: a codec)
    1        -             -
    2        -             yes
    3        yes           -
    4        yes           yes

Each fingerprint has exactly one encoding: a part that is empty (no source fields set,
every head) is left out, so fingerprints made without a source keep their version-1/2
bytes and keys, and ``from_bytes`` refuses a version-3/4 encoding of an empty source.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field, replace

import torch
import xxhash

from nopecache.client.errors import InvalidArgumentError
from nopecache.kernels import RopeSpec
from nopecache.proto.block import DTYPE_ITEMSIZE, StoredForm
from nopecache.proto.kv_codec import CODECS

# Torch dtype names a block may be stored in (``str(torch.bfloat16)`` minus "torch."):
# exactly those the block format can carry.
SUPPORTED_DTYPES: frozenset[str] = frozenset(DTYPE_ITEMSIZE)
ROPE_DIGEST_SIZE = 16
SOURCE_DIGEST_SIZE = 16
FINGERPRINT_DIGEST_SIZE = 16

_MAGIC = b"NCFP"
_VERSION = 1
_VERSION_HEAD_GROUP = 2
_VERSION_SOURCE = 3
_VERSION_SOURCE_HEAD_GROUP = 4
_VERSIONS_RAW = (_VERSION, _VERSION_HEAD_GROUP, _VERSION_SOURCE, _VERSION_SOURCE_HEAD_GROUP)
_CODEC_VERSION_STEP = 4  # a codec's encodings are the raw ones + 4
_VERSIONS = (*_VERSIONS_RAW, *(v + _CODEC_VERSION_STEP for v in _VERSIONS_RAW))
_HEAD = struct.Struct("<4sBBIII")
_GROUP = struct.Struct("<II")
_U32 = struct.Struct("<I")
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
    """Identity of a model's cached KV: model source, shape, dtype, form, RoPE."""

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
    # The model source (model_source.py; all empty: none, versions 1 and 2).
    quantization: str = ""  # the engine's weight quantization method ("" unquantized)
    config_digest: bytes = b""  # 16 bytes: the text config as the engine loaded it
    weights_digest: bytes = b""  # 16 bytes: the local weight files (b"": not local)
    rope_max_len: int = 0  # max_model_len the rotation depends on (0: none)
    # The compact stored form blocks are held in (kv_codec.py; "none": the dtype as is).
    codec: str = "none"
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
        self._check_source()
        if self.codec not in CODECS:
            raise InvalidArgumentError(
                "codec", f"must be one of {list(CODECS)}, got {self.codec!r}"
            )
        object.__setattr__(self, "_encoded", self._encode())

    def _check_source(self) -> None:
        if not isinstance(self.quantization, str):
            raise InvalidArgumentError(
                "quantization", f"must be a str ('' unquantized), got {self.quantization!r}"
            )
        for name in ("config_digest", "weights_digest"):
            value = getattr(self, name)
            if not isinstance(value, bytes) or len(value) not in (0, SOURCE_DIGEST_SIZE):
                raise InvalidArgumentError(
                    name, f"must be b'' or {SOURCE_DIGEST_SIZE} bytes, got {value!r:.40}"
                )
        length = self.rope_max_len
        if isinstance(length, bool) or not isinstance(length, int) or not 0 <= length <= _U32_MAX:
            raise InvalidArgumentError(
                "rope_max_len", f"must be an int in [0, 2**32), got {length!r}"
            )

    @property
    def has_source(self) -> bool:
        """True when any model-source field is set (encoding version 3 or 4)."""
        return bool(
            self.quantization or self.config_digest or self.weights_digest or self.rope_max_len
        )

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
        quantization: str = "",
        config_digest: bytes = b"",
        weights_digest: bytes = b"",
        rope_max_len: int = 0,
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
            quantization=quantization,
            config_digest=config_digest,
            weights_digest=weights_digest,
            rope_max_len=rope_max_len,
        )

    @property
    def torch_dtype(self) -> torch.dtype:
        """The fingerprint's dtype as a ``torch.dtype``."""
        dt = getattr(torch, self.dtype)
        assert isinstance(dt, torch.dtype)
        return dt

    def _encode(self) -> bytes:
        version = (_VERSION_SOURCE if self.has_source else _VERSION) + self.is_head_group
        if self.codec != "none":
            version += _CODEC_VERSION_STEP
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
        if self.has_source:
            for blob in (
                self.quantization.encode("utf-8"),
                self.config_digest,
                self.weights_digest,
            ):
                parts.append(_LEN.pack(len(blob)))
                parts.append(blob)
            parts.append(_U32.pack(self.rope_max_len))
        if self.is_head_group:
            parts.append(_GROUP.pack(self.kv_head_start, self.kv_heads_total))
        if self.codec != "none":
            parts.append(_LEN.pack(len(self.codec)))
            parts.append(self.codec.encode("ascii"))
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
        reader = _Reader(bytes(data))
        if len(reader.buf) < _HEAD.size:
            raise InvalidArgumentError(
                "data", f"{len(reader.buf)} bytes is shorter than the header"
            )
        magic, version, form, layers, heads, head_dim = _HEAD.unpack_from(reader.buf)
        if magic != _MAGIC:
            raise InvalidArgumentError("data", f"bad magic {magic!r}, expected {_MAGIC!r}")
        if version not in _VERSIONS:
            raise InvalidArgumentError("data", f"unknown fingerprint encoding v{version}")
        reader.pos = _HEAD.size
        codec_version = version > _VERSIONS_RAW[-1]
        version -= _CODEC_VERSION_STEP * codec_version
        dtype, model, revision = (reader.text(name) for name in ("dtype", "model", "revision"))
        rope_digest = reader.blob("rope_digest")
        source: dict[str, object] = {}
        if version in (_VERSION_SOURCE, _VERSION_SOURCE_HEAD_GROUP):
            source["quantization"] = reader.text("quantization")
            source["config_digest"] = reader.blob("config_digest")
            source["weights_digest"] = reader.blob("weights_digest")
            (source["rope_max_len"],) = reader.fixed(_U32, "rope_max_len")
        group: tuple[int, ...] = (0, 0)
        if version in (_VERSION_HEAD_GROUP, _VERSION_SOURCE_HEAD_GROUP):
            group = reader.fixed(_GROUP, "the head group")
            if group[1] == 0:
                raise InvalidArgumentError(
                    "data", f"a version-{version} fingerprint with 0 heads in all"
                )
        codec = reader.text("codec") if codec_version else "none"
        if codec_version and codec == "none":
            raise InvalidArgumentError("data", "a codec encoding that names no codec")
        if reader.pos != len(reader.buf):
            raise InvalidArgumentError("data", f"{len(reader.buf) - reader.pos} trailing bytes")
        fp = cls(
            model=model,
            revision=revision,
            num_layers=layers,
            num_kv_heads=heads,
            head_dim=head_dim,
            dtype=dtype,
            form=form,
            rope_digest=rope_digest,
            kv_head_start=group[0],
            kv_heads_total=group[1],
            codec=codec,
            **source,  # type: ignore[arg-type]  # checked by __post_init__
        )
        if source and not fp.has_source:
            raise InvalidArgumentError("data", f"a version-{version} fingerprint with no source")
        return fp


class _Reader:
    """Length-prefixed fields of an encoding, read in order; errors name the field."""

    def __init__(self, buf: bytes) -> None:
        self.buf = buf
        self.pos = 0

    def blob(self, name: str) -> bytes:
        if self.pos + _LEN.size > len(self.buf):
            raise InvalidArgumentError("data", f"truncated before the {name} length")
        (n,) = _LEN.unpack_from(self.buf, self.pos)
        self.pos += _LEN.size
        if self.pos + n > len(self.buf):
            raise InvalidArgumentError("data", f"truncated inside {name}")
        self.pos += n
        return self.buf[self.pos - n : self.pos]

    def text(self, name: str) -> str:
        raw = self.blob(name)
        try:
            return raw.decode("ascii" if name in ("dtype", "codec") else "utf-8")
        except UnicodeDecodeError as exc:
            raise InvalidArgumentError("data", f"invalid text field: {exc}") from None

    def fixed(self, layout: struct.Struct, name: str) -> tuple[int, ...]:
        if self.pos + layout.size > len(self.buf):
            raise InvalidArgumentError("data", f"truncated inside {name}")
        values = layout.unpack_from(self.buf, self.pos)
        self.pos += layout.size
        return values
