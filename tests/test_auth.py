"""API keys: the config section (secret, digests only on the wire, env override) and the bearer
check the ingress applies to every /v1/* route (deployments/openai_protocol.py)."""

import hashlib

from specserve.common.config import SpecServeConfig, load_config
from specserve.deployments.openai_protocol import authorization_error

DIGEST_A = "sha256:" + hashlib.sha256(b"key-a").hexdigest()


def test_keys_come_from_a_comma_separated_env_variable_verbatim():
    config = load_config(environ={"SPECSERVE__AUTH__API_KEYS": "key-a, 0123 #x"})
    assert [key.get_secret_value() for key in config.auth.api_keys] == ["key-a", "0123 #x"]


def test_no_keys_by_default():
    assert SpecServeConfig().auth.api_keys == []


def test_keys_never_print_and_travel_as_digests():
    config = SpecServeConfig.model_validate({"auth": {"api_keys": ["key-a"]}})
    assert "key-a" not in repr(config) and "key-a" not in str(config.auth)
    dumped = config.model_dump(mode="json")
    assert dumped["auth"]["api_keys"] == [DIGEST_A]
    assert "key-a" not in str(config.model_dump())
    # What a deployment rebuilds from the dump accepts the same key.
    rebuilt = SpecServeConfig.model_validate(dumped)
    assert rebuilt.auth.key_digests() == [DIGEST_A]
    assert authorization_error("Bearer key-a", rebuilt.auth.key_digests()) is None


def test_a_valid_bearer_key_passes_and_anything_else_is_refused():
    digests = [DIGEST_A, "sha256:" + hashlib.sha256(b"key-b").hexdigest()]
    assert authorization_error("Bearer key-a", digests) is None
    assert authorization_error("Bearer key-b", digests) is None
    assert authorization_error("bearer  key-b ", digests) is None
    for header in [None, "", "Bearer", "Bearer ", "Basic key-a", "Bearer key-c", "key-a", "Bearer key-a2",
                   "Bearer \ud800", "Bearer " + DIGEST_A]:
        error = authorization_error(header, digests)
        assert error is not None and error["error"]["code"] == "invalid_api_key", header
        assert error["error"]["type"] == "invalid_request_error"


def test_no_keys_means_an_open_api():
    assert authorization_error(None, []) is None
