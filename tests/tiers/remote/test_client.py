"""Reading the remote tier's URL and password: seed lists, TLS and an ACL user are accepted;
a password in the URL, another scheme or a bad host:port are refused naming `remote_url`. The
password comes from a file or an environment variable."""

from __future__ import annotations

import pytest

from kvtier_rs._core import InvalidArgumentError
from kvtier_rs.tiers.remote.client import DEFAULT_PASSWORD_ENV, Endpoint, parse_url, read_password


def test_a_single_seed() -> None:
    assert parse_url("redis://10.0.0.1:6379") == Endpoint((("10.0.0.1", 6379),), False, None)


def test_a_list_of_seeds_with_spaces_and_a_trailing_slash() -> None:
    ep = parse_url("redis://a:7000, b:7001,c.example:7002/")
    assert ep.nodes == (("a", 7000), ("b", 7001), ("c.example", 7002))
    assert ep.describe() == "redis://a:7000,b:7001,c.example:7002"


def test_rediss_is_tls() -> None:
    ep = parse_url("rediss://h:6380")
    assert ep.tls and ep.describe().startswith("rediss://")


def test_an_acl_user_is_read_and_never_described() -> None:
    ep = parse_url("redis://kv%40tier@h:6379")
    assert ep.username == "kv@tier"
    assert "kv" not in ep.describe()


def test_an_ipv6_seed() -> None:
    assert parse_url("redis://[::1]:7000").nodes == (("::1", 7000),)


def test_a_password_in_the_url_is_refused_without_echoing_it() -> None:
    with pytest.raises(InvalidArgumentError, match="remote_url") as e:
        parse_url("redis://user:hunter2@h:6379")
    assert "hunter2" not in str(e.value)
    with pytest.raises(InvalidArgumentError, match="password"):
        parse_url("redis://:hunter2@h:6379")


@pytest.mark.parametrize("url", ["http://h:1", "valkey://h:1", "h:6379", "", None, 6379])
def test_another_scheme_or_no_url_is_refused(url: object) -> None:
    with pytest.raises(InvalidArgumentError, match="remote_url") as e:
        parse_url(url)  # type: ignore[arg-type]
    assert e.value.arg == "remote_url"


@pytest.mark.parametrize("url", ["redis://h", "redis://h:", "redis://:6379", "redis://h:0", "redis://h:65536",
                                 "redis://h:port", "redis://a:1,", "redis://a:1,b", "redis://"])  # fmt: skip
def test_a_bad_host_port_is_refused_naming_the_setting(url: str) -> None:
    with pytest.raises(InvalidArgumentError, match="is not host:port") as e:
        parse_url(url)
    assert e.value.arg == "remote_url"


def test_the_setting_name_can_be_another() -> None:
    with pytest.raises(InvalidArgumentError, match="kv_remote"):
        parse_url("ftp://h:1", name="kv_remote")


def test_the_password_comes_from_the_file_first_line(tmp_path, monkeypatch) -> None:
    f = tmp_path / "pw"
    f.write_text("s3cret\nignored\n")
    monkeypatch.setenv(DEFAULT_PASSWORD_ENV, "from-env")
    assert read_password(None, str(f)) == "s3cret"


def test_an_empty_password_file_is_no_password(tmp_path) -> None:
    f = tmp_path / "pw"
    f.write_text("\n")
    assert read_password(None, str(f)) is None


def test_an_unreadable_password_file_is_refused_naming_the_setting(tmp_path) -> None:
    with pytest.raises(InvalidArgumentError, match="remote_password_file") as e:
        read_password(None, str(tmp_path / "missing"))
    assert e.value.arg == "remote_password_file"


def test_the_password_comes_from_the_named_or_default_env_var(monkeypatch) -> None:
    monkeypatch.delenv(DEFAULT_PASSWORD_ENV, raising=False)
    monkeypatch.delenv("MY_PW", raising=False)
    assert read_password(None, None) is None
    monkeypatch.setenv(DEFAULT_PASSWORD_ENV, "dflt")
    assert read_password(None, None) == "dflt"
    assert read_password("MY_PW", None) is None
    monkeypatch.setenv("MY_PW", "mine")
    assert read_password("MY_PW", None) == "mine"
    monkeypatch.setenv("MY_PW", "")
    assert read_password("MY_PW", None) is None
