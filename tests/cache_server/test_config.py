"""ServerConfig: defaults, precedence flags > NOPECACHE_* env > TOML, validation, --help."""

from __future__ import annotations

from dataclasses import fields
from pathlib import Path

import pytest

from nopecache.cache_server.config import (
    ConfigError,
    ServerConfig,
    build_parser,
    env_name,
    flag_name,
    load_config,
)

TOML = """
port = 1111
tiers = ["cpu://?capacity=2GiB", "redis://127.0.0.1:6379/0"]
write_through = true
max_block_bytes = "32MiB"
shutdown_grace_s = 3
log_level = "DEBUG"
"""


@pytest.fixture
def toml_file(tmp_path: Path) -> Path:
    path = tmp_path / "server.toml"
    path.write_text(TOML)
    return path


def test_defaults_are_the_embedded_mode() -> None:
    config = load_config([], {})
    assert config == ServerConfig()
    assert (config.host, config.port, config.tiers) == (
        "127.0.0.1",
        50551,
        ("cpu://?capacity=1GiB",),
    )
    assert (config.metrics, config.metrics_host, config.metrics_port) == (True, "127.0.0.1", 9464)
    assert config.write_through is False
    assert config.max_message_bytes == 4 * 1024 * 1024
    assert config.max_frame_data_bytes == 4 * 1024 * 1024 - 4096


def test_toml_sets_options(toml_file: Path) -> None:
    config = load_config(["--config", str(toml_file)], {})
    assert config == ServerConfig(
        port=1111,
        tiers=("cpu://?capacity=2GiB", "redis://127.0.0.1:6379/0"),
        write_through=True,
        max_block_bytes=32 * 1024 * 1024,
        shutdown_grace_s=3.0,
        log_level="DEBUG",
    )


def test_env_overrides_toml_and_flags_override_env(toml_file: Path) -> None:
    env = {
        "NOPECACHE_CONFIG": str(toml_file),
        "NOPECACHE_PORT": "2222",
        "NOPECACHE_TIERS": "cpu://?capacity=3GiB  redis+cluster://a:1,b:2",
        "NOPECACHE_WRITE_THROUGH": "off",
        "NOPECACHE_MAX_BLOCK_BYTES": "16MiB",
    }
    from_env = load_config([], env)
    assert (from_env.port, from_env.write_through, from_env.max_block_bytes) == (
        2222,
        False,
        16 * 1024 * 1024,
    )
    assert from_env.tiers == ("cpu://?capacity=3GiB", "redis+cluster://a:1,b:2")
    # TOML values no source overrides survive.
    assert (from_env.shutdown_grace_s, from_env.log_level) == (3.0, "DEBUG")

    flags = [
        "--port",
        "3333",
        "--tier",
        "cpu://?capacity=4GiB",
        "--tier",
        "redis://h:1/0",
        "--write-through",
        "--max-block-bytes",
        "8MiB",
    ]
    from_flags = load_config(flags, env)
    assert (from_flags.port, from_flags.write_through, from_flags.max_block_bytes) == (
        3333,
        True,
        8 * 1024 * 1024,
    )
    assert from_flags.tiers == ("cpu://?capacity=4GiB", "redis://h:1/0")
    assert (from_flags.shutdown_grace_s, from_flags.log_level) == (3.0, "DEBUG")


def test_config_flag_beats_config_env(toml_file: Path, tmp_path: Path) -> None:
    other = tmp_path / "other.toml"
    other.write_text("port = 4444\n")
    config = load_config(["--config", str(other)], {"NOPECACHE_CONFIG": str(toml_file)})
    assert config.port == 4444
    assert config.write_through is False


@pytest.mark.parametrize(
    ("argv", "env", "message"),
    [
        ([], {"NOPECACHE_MAX_BLOCK_BYTES": "12XB"}, "NOPECACHE_MAX_BLOCK_BYTES: unknown unit 'XB'"),
        (["--port", "70000"], {}, "port: must be in [0, 65535], got 70000"),
        (["--port", "eighty"], {}, "--port: cannot parse 'eighty'"),
        ([], {"NOPECACHE_METRICS": "maybe"}, "NOPECACHE_METRICS: expected a boolean"),
        (["--tier", "localhost"], {}, "tiers: 'localhost' is not a URL"),
        (
            ["--max-block-bytes", "8MiB", "--max-request-bytes", "4MiB"],
            {},
            "max_request_bytes: 4194304 is below max_block_bytes 8388608",
        ),
        (["--max-message-bytes", "1KiB"], {}, "max_message_bytes: must be in [64KiB,"),
        (["--log-level", "loud"], {}, "log_level: 'loud' is not one of"),
        (["--shutdown-grace-s", "-1"], {}, "shutdown_grace_s: must be >= 0, got -1.0"),
        (["--max-keys-per-request", "0"], {}, "max_keys_per_request: must be positive, got 0"),
        (["--bulk-listen", "50564"], {}, "bulk_listen: expected HOST:PORT"),
        (["--bulk-advertise-port", "65536"], {}, "bulk_advertise_port: must be in [0, 65535]"),
    ],
)
def test_invalid_values_name_the_option(argv: list[str], env: dict[str, str], message: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_config(argv, env)
    assert str(err.value).startswith(message), str(err.value)


def test_toml_errors_name_the_key_and_file(tmp_path: Path) -> None:
    path = tmp_path / "bad.toml"
    path.write_text("prot = 1\n")
    with pytest.raises(
        ConfigError, match=r"config: .*bad.toml sets unknown option\(s\) \['prot'\]"
    ):
        load_config(["--config", str(path)], {})
    path.write_text('port = "high"\n')
    with pytest.raises(ConfigError, match=r"^port \(in .*bad.toml\): cannot parse 'high'"):
        load_config(["--config", str(path)], {})
    path.write_text("write_through = 1\n")
    with pytest.raises(ConfigError, match=r"^write_through \(in .*bad.toml\): expected a boolean"):
        load_config(["--config", str(path)], {})
    path.write_text("port = [\n")
    with pytest.raises(ConfigError, match=r"is not valid TOML"):
        load_config(["--config", str(path)], {})
    with pytest.raises(ConfigError, match=r"config: cannot read .*missing.toml"):
        load_config(["--config", str(tmp_path / "missing.toml")], {})


def test_every_option_is_in_help_with_its_env_variable() -> None:
    text = " ".join(build_parser().format_help().split())
    assert "--config FILE" in text
    for f in fields(ServerConfig):
        assert flag_name(f.name) in text, f.name
        assert f"[env {env_name(f.name)}; default:" in text, f.name
    assert flag_name("tiers") == "--tier"
    assert env_name("max_block_bytes") == "NOPECACHE_MAX_BLOCK_BYTES"


def test_config_is_frozen() -> None:
    config = ServerConfig()
    with pytest.raises(AttributeError):
        config.port = 1  # type: ignore[misc]
