"""The internal credential: where it comes from, how it is compared, where it is required."""

from __future__ import annotations

import pytest

from deepserve.internal_auth import ENV_TOKEN, ENV_TOKEN_FILE, InternalAuth, generate_token, is_loopback


def test_resolve_order_flag_file_env_envfile(tmp_path) -> None:
    f = tmp_path / "token"
    f.write_text("from-file\n")
    env = {ENV_TOKEN: "from-env", ENV_TOKEN_FILE: str(f)}
    assert InternalAuth.resolve("flag", str(f), env).token == "flag"
    assert InternalAuth.resolve(None, str(f), env).token == "from-file"
    assert InternalAuth.resolve(None, None, env).token == "from-env"
    assert InternalAuth.resolve(None, None, {ENV_TOKEN_FILE: str(f)}).token == "from-file"
    assert not InternalAuth.resolve(None, None, {}).enabled
    (tmp_path / "empty").write_text("\n")
    for bad in (str(tmp_path / "empty"), str(tmp_path / "missing")):
        with pytest.raises(SystemExit):
            InternalAuth.resolve(None, bad, {})


def test_allows_only_the_bearer_token() -> None:
    auth = InternalAuth("s3cret")
    assert auth.allows("Bearer s3cret") and auth.allows(b"Bearer s3cret")
    for bad in (None, "", "s3cret", "Bearer s3cre", "Bearer s3cretX", "Basic s3cret"):
        assert not auth.allows(bad)
    assert auth.headers() == {"Authorization": "Bearer s3cret"}
    assert InternalAuth().allows(None) and InternalAuth().headers() == {}
    with pytest.raises(ValueError):
        InternalAuth("two\nlines")


def test_bind_beyond_loopback_needs_a_token() -> None:
    assert all(is_loopback(h) for h in ("127.0.0.1", "127.0.0.2", "::1", "[::1]", "localhost"))
    assert not any(is_loopback(h) for h in ("0.0.0.0", "::", "10.0.0.1", "router", ""))
    InternalAuth().check_bind("127.0.0.1", "x")
    InternalAuth("t").check_bind("0.0.0.0", "x")
    with pytest.raises(SystemExit, match="without an internal token"):
        InternalAuth().check_bind("0.0.0.0", "x")
    assert len({generate_token() for _ in range(3)}) == 3 and len(generate_token()) >= 40
