"""API keys: read from the environment variable and the file a serve section names (never from the config), checked
against their digests in constant time."""

import pytest

from app.config import ConfigError, ServeConfig
from deployments.auth import KeyCheck, digest, load_keys

KEY, OTHER = "k" * 20, "team-key-0123456789"


def test_keys_come_from_the_environment_and_the_file(tmp_path):
    assert load_keys(ServeConfig(), {}) == []  # nothing set: the API is open
    assert load_keys(ServeConfig(), {"FLOWGRPO_API_KEY": f" {KEY} ,{OTHER},"}) == [KEY, OTHER]
    assert load_keys(ServeConfig(api_key_env="MY_KEYS"), {"MY_KEYS": KEY, "FLOWGRPO_API_KEY": OTHER}) == [KEY]
    keys = tmp_path / "keys.txt"
    keys.write_text(f"# the team's keys\n{OTHER}  # alice\n\n")
    assert load_keys(ServeConfig(api_key_file=str(keys)), {"FLOWGRPO_API_KEY": KEY}) == [KEY, OTHER]


@pytest.mark.parametrize("content,match", [(None, "no such file"), ("# only a comment\n", "holds no key"),
                                           ("short\n", "shorter than 16")])
def test_a_bad_key_file_is_named(tmp_path, content, match):
    keys = tmp_path / "keys.txt"
    if content is not None:
        keys.write_text(content)
    with pytest.raises(ConfigError, match=match):
        load_keys(ServeConfig(api_key_file=str(keys)), {})


def test_the_check_accepts_only_a_bearer_key_it_knows():
    check = KeyCheck([digest(KEY), digest(OTHER)])
    assert check.required and check.problem(f"Bearer {KEY}") is None and check.problem(f"bearer {OTHER}") is None
    assert "no API key" in check.problem(None) and "no API key" in check.problem(KEY)  # no scheme
    assert "no API key" in check.problem("Bearer ")
    assert check.problem(f"Bearer {KEY}x") == "the API key is not valid"
    assert check.problem(f"Basic {KEY}") is not None
    assert KeyCheck([]).problem(None) is None  # open
    assert KEY not in repr(check.digests)  # the replica holds digests, not keys


@pytest.mark.parametrize("host,digests,warned", [("0.0.0.0", [], True), ("127.0.0.1", [], False),
                                                  ("0.0.0.0", [digest(KEY)], False)])
def test_listening_beyond_localhost_without_keys_is_warned_of(monkeypatch, caplog, host, digests, warned):
    from deployments import api

    monkeypatch.setattr(api, "_http_host", lambda: host)
    monkeypatch.setattr(api, "_ACCESS", api.SimpleNamespace(keys=KeyCheck([])))
    with caplog.at_level("WARNING", logger="deployments.api"):
        api.ApiIngress(None, None, limits=ServeConfig(), key_digests=digests)
    assert ("FLOWGRPO_API_KEY=<key>" in caplog.text) is warned
    assert api._ACCESS.keys.required is bool(digests)
