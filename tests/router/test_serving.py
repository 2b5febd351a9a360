"""``router.serving``: the options every server is built from, and picking a server by name
(the servers' behaviour is ``test_server_contract.py``)."""

from __future__ import annotations

import pytest

from deepserve.internal_auth import InternalAuth
from router.serving import SERVERS, ServerOptions, make_server


@pytest.mark.parametrize("field", ["max_body", "keepalive_s", "read_timeout_s", "max_connections"])
def test_limits_must_be_positive(field):
    with pytest.raises(ValueError, match="positive"):
        ServerOptions(**{field: 0})


def test_guard_is_the_auth_only_with_a_token():
    assert ServerOptions().guard is None
    assert ServerOptions(auth=InternalAuth("")).guard is None
    auth = InternalAuth("s3cret")
    assert ServerOptions(auth=auth).guard is auth


def test_make_server_by_name():
    options = ServerOptions(read_timeout_s=1.5)
    for kind in SERVERS:
        assert make_server(kind, {}, options).options is options
    with pytest.raises(ValueError, match="unknown server"):
        make_server("nginx", {}, options)
