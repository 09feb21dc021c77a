from __future__ import annotations

import logging

import pytest
from omegaconf import OmegaConf

from nemo_gym_checkpoint_plugin._settings import CheckpointSettings, SettingsError, load_settings


def test_absent_block_is_disabled() -> None:
    settings, token = load_settings({"policy_model": {}}, environ={})
    assert settings.enabled is False
    assert token is None
    assert settings.lease_grace_seconds == 600
    assert settings.storage.backend == "local"


def test_token_from_environment_variable() -> None:
    config = {"checkpoint": {"enabled": True, "control_auth_token_env": "MY_TOKEN"}}
    settings, token = load_settings(config, environ={"MY_TOKEN": "s3cret-0123456789"})
    assert settings.enabled and token == "s3cret-0123456789"
    assert "s3cret-0123456789" not in repr(settings)


def test_reads_gym_omegaconf_dict() -> None:
    block = {"enabled": True, "control_auth_token_env": "T", "lease_grace_seconds": 5}
    config = OmegaConf.create({"checkpoint": block})
    settings, token = load_settings(config, environ={"T": "token-from-the-variable"})
    assert settings.lease_grace_seconds == 5 and token == "token-from-the-variable"


@pytest.mark.parametrize(
    ("block", "environ", "names"),
    [
        ({"enabled": True}, {}, "checkpoint.control_auth_token_env"),
        ({"enabled": True, "control_auth_token_env": "T"}, {}, "checkpoint.control_auth_token_env .*unset"),
        ({"enabled": True, "control_auth_token_env": "T"}, {"T": ""}, "checkpoint.control_auth_token_env .*unset"),
    ],
)
def test_enabled_without_token_fails_naming_the_key(block: dict, environ: dict, names: str) -> None:
    with pytest.raises(SettingsError, match=names):
        load_settings({"checkpoint": block}, environ=environ)


def test_disabled_needs_no_token() -> None:
    settings, token = load_settings({"checkpoint": {"enabled": False}}, environ={})
    assert not settings.enabled and token is None


def test_plain_token_works_but_warns(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="nemo_gym_checkpoint_plugin._settings"):
        block = {"enabled": True, "control_auth_token": "plain-token-0123456789"}
        _, token = load_settings({"checkpoint": block}, environ={})
    assert token == "plain-token-0123456789"
    assert "control_auth_token_env" in caplog.text and "unauthenticated" in caplog.text


def test_env_token_preferred_over_plain() -> None:
    block = {"enabled": True, "control_auth_token": "plain-token-0123456789", "control_auth_token_env": "T"}
    assert load_settings({"checkpoint": block}, environ={"T": "env-token-0123456789"})[1] == "env-token-0123456789"


@pytest.mark.parametrize(
    ("block", "key"),
    [
        ({"enabled": True, "control_auth_token": "settings-test-token", "lease_grace": 3}, "checkpoint.lease_grace"),
        ({"lease_grace_seconds": 0}, "checkpoint.lease_grace_seconds"),
        ({"lease_grace_seconds": -1}, "checkpoint.lease_grace_seconds"),
        ({"lease_grace_seconds": float("inf")}, "checkpoint.lease_grace_seconds"),
        ({"storage": {"backend": "local", "path": "/x"}}, "checkpoint.storage.path"),
        ({"enabled": "perhaps"}, "checkpoint.enabled"),
    ],
)
def test_bad_block_is_refused_naming_the_key(block: dict, key: str) -> None:
    with pytest.raises(SettingsError, match=key.replace(".", r"\.")):
        load_settings({"checkpoint": block}, environ={})


def test_block_must_be_a_mapping() -> None:
    with pytest.raises(SettingsError, match="mapping"):
        load_settings({"checkpoint": True}, environ={})


def test_settings_are_frozen() -> None:
    with pytest.raises(Exception):  # noqa: B017 - pydantic's frozen error type is an implementation detail
        CheckpointSettings().enabled = True  # type: ignore[misc]


@pytest.mark.parametrize(
    ("block", "key", "suggestion"),
    [
        ({"enabeld": True}, "checkpoint.enabeld", "'enabled'"),
        ({"lease_grace_second": 3}, "checkpoint.lease_grace_second", "'lease_grace_seconds'"),
        ({"control_auth_token_envv": "T"}, "checkpoint.control_auth_token_envv", "'control_auth_token_env'"),
        ({"storage": {"backnd": "local"}}, "checkpoint.storage.backnd", "'backend'"),
        ({"storage": {"max_record_byte": 5}}, "checkpoint.storage.max_record_byte", "'max_record_bytes'"),
    ],
)
def test_a_misspelt_key_gets_a_did_you_mean(block: dict, key: str, suggestion: str) -> None:
    with pytest.raises(SettingsError) as refused:
        load_settings({"checkpoint": block}, environ={})
    assert f"{key}: unknown key (did you mean {suggestion}?)" in str(refused.value)


def test_a_key_like_no_other_lists_the_known_keys() -> None:
    with pytest.raises(SettingsError, match=r"checkpoint\.zzz: unknown key \(known keys: enabled, "):
        load_settings({"checkpoint": {"zzz": 1}}, environ={})


def test_for_server_names_the_server_once() -> None:
    error = SettingsError("checkpoint.x: bad")
    named = error.for_server("my_env")
    assert str(named) == "server 'my_env': checkpoint.x: bad" and named.server == "my_env"
    assert named.for_server("other") is named and error.for_server(None) is error


# Tokens pasted where the variable's name belongs: not a name at all, or name-like but unset.
PASTED = ["sk-live-9f8e7d6c5b4a3210", "3f9a1c0e8b7d6a5f4e3d2c1b0a998877", "TokenThatLooksLikeAName42"]


@pytest.mark.parametrize("pasted", PASTED)
@pytest.mark.parametrize("enabled", [True, False])
def test_a_token_pasted_into_the_env_key_is_never_echoed(
    pasted: str, enabled: bool, caplog: pytest.LogCaptureFixture
) -> None:
    block = {"enabled": enabled, "control_auth_token_env": pasted}
    with caplog.at_level(logging.DEBUG):
        try:
            settings, _ = load_settings({"checkpoint": block}, environ={})
        except SettingsError as exc:
            message = str(exc)
            assert "checkpoint.control_auth_token_env" in message
        else:
            # Only a name-like value of a disabled block passes; even then its repr does not show it.
            assert not enabled and pasted.isidentifier()
            message = repr(settings) + str(settings)
    assert pasted not in message
    assert pasted not in caplog.text


@pytest.mark.parametrize(
    ("token", "problem"),
    [
        ("x", "is 1 characters long"),
        ("fifteen-chars-!", "is 15 characters long"),
        ("sixteen chars ok", "holds a character outside printable ASCII or a space"),
        ("jeton-de-contrôle-0123456789", "holds a character outside printable ASCII or a space"),
        ("tab\there-0123456789", "holds a character outside printable ASCII or a space"),
    ],
)
@pytest.mark.parametrize(
    ("block", "source"),
    [
        ({"control_auth_token_env": "T"}, "the variable T (checkpoint.control_auth_token_env)"),
        ({"control_auth_token": "<token>"}, "checkpoint.control_auth_token"),
    ],
)
def test_a_token_breaking_the_rule_is_refused_naming_source_and_rule(
    token: str, problem: str, block: dict, source: str
) -> None:
    block = {"enabled": True, **{k: token if v == "<token>" else v for k, v in block.items()}}
    with pytest.raises(SettingsError) as refused:
        load_settings({"checkpoint": block}, environ={"T": token})
    message = str(refused.value)
    assert message == (
        f"the control token from {source} {problem} "
        "(the token must be at least 16 characters of printable ASCII, without spaces)"
    )
    if len(token) > 1:
        assert token not in message


def test_a_sixteen_character_ascii_token_is_accepted() -> None:
    token = "!0123456789abcd~"
    assert (
        load_settings({"checkpoint": {"enabled": True, "control_auth_token_env": "T"}}, environ={"T": token})[1]
        == token
    )
