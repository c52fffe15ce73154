"""``mpidtensor.settings``: every MPIDTENSOR_* variable parsed in one place, settable from
Python, and followed by the machinery that depends on it."""
from __future__ import annotations

import pytest

import mpidtensor
from helpers import assert_all_ranks
from mpidtensor.comm import guard, pool
from mpidtensor.mesh import launch
from mpidtensor.runtime import progress, watchdog
from mpidtensor.runtime.settings import ENVIRONMENT, Settings, settings


def test_defaults_and_exported():
    defaults = Settings.from_environ({})
    assert defaults.abort_on_exception and defaults.launch_check and defaults.fast_paths
    assert not defaults.debug and not defaults.strict
    assert defaults.timeout == 600.0 and defaults.cuda_aware is None
    assert defaults.buffer_pool_mb == 512.0 and defaults.progress == "off"
    assert mpidtensor.settings is settings and "settings" in mpidtensor.__all__


def test_every_field_has_its_variable():
    names = {name for _, name, _, _ in ENVIRONMENT}
    assert names == set(Settings.__dataclass_fields__)
    assert all(env == "MPIDTENSOR_" + name.upper() for env, name, _, _ in ENVIRONMENT)
    assert all(doc for *_, doc in ENVIRONMENT)


@pytest.mark.parametrize("env, field, value", [
    ({"MPIDTENSOR_DEBUG": "1"}, "debug", True),
    ({"MPIDTENSOR_DEBUG": "off"}, "debug", False),
    ({"MPIDTENSOR_DEBUG": ""}, "debug", False),
    ({"MPIDTENSOR_ABORT_ON_EXCEPTION": "0"}, "abort_on_exception", False),
    ({"MPIDTENSOR_TIMEOUT": "2.5"}, "timeout", 2.5),
    ({"MPIDTENSOR_TIMEOUT": "0"}, "timeout", None),
    ({"MPIDTENSOR_TIMEOUT": "-1"}, "timeout", None),
    ({"MPIDTENSOR_TIMEOUT": " "}, "timeout", 600.0),
    ({}, "timeout", 600.0),
    ({"MPIDTENSOR_BUFFER_POOL_MB": "0"}, "buffer_pool_mb", 0.0),
    ({"MPIDTENSOR_BUFFER_POOL_MB": "64.5"}, "buffer_pool_mb", 64.5),
    ({"MPIDTENSOR_CUDA_AWARE": "1"}, "cuda_aware", True),
    ({"MPIDTENSOR_CUDA_AWARE": "0"}, "cuda_aware", False),
    ({"MPIDTENSOR_CUDA_AWARE": ""}, "cuda_aware", None),
    ({"MPIDTENSOR_PROGRESS": "hooks"}, "progress", "hooks"),
    ({"MPIDTENSOR_PROGRESS": ""}, "progress", "off"),
    ({"MPIDTENSOR_STRICT": "yes"}, "strict", True),
    ({"MPIDTENSOR_LAUNCH_CHECK": "0"}, "launch_check", False),
    ({"MPIDTENSOR_FAST_PATHS": "false"}, "fast_paths", False),
    ({"MPIDTENSOR_LOCAL_OPTIM_STEP": "0"}, "local_optim_step", False),
])
def test_parsing(env, field, value):
    assert getattr(Settings.from_environ(env), field) == value


@pytest.mark.parametrize("env", [
    {"MPIDTENSOR_DEBUG": "2"},
    {"MPIDTENSOR_TIMEOUT": "soon"},
    {"MPIDTENSOR_BUFFER_POOL_MB": "-1"},
    {"MPIDTENSOR_BUFFER_POOL_MB": "lots"},
    {"MPIDTENSOR_CUDA_AWARE": "maybe"},
    {"MPIDTENSOR_PROGRESS": "async"},
    {"MPIDTENSOR_FAST_PATHS": "sometimes"},
])
def test_bad_values_raise_naming_the_variable(env):
    (name, raw), = env.items()
    with pytest.raises(ValueError, match=name) as info:
        Settings.from_environ({**env, "UNRELATED": "x"})
    assert repr(raw) in str(info.value)


def test_update_and_override():
    before = settings.strict
    with settings.override(strict=not before) as changed:
        assert changed is settings and settings.strict is (not before)
    assert settings.strict is before
    with pytest.raises(TypeError, match="unknown mpidtensor settings"):
        settings.update(no_such_setting=1)
    with pytest.raises(RuntimeError, match="inside"):
        with settings.override(strict=True):
            raise RuntimeError("inside")
    assert settings.strict is before


def test_assignment_is_an_update():
    """``settings.x = v`` tells the listeners (the dispatcher drops plans made under the old
    fast-path switch); a misspelt name is a TypeError, not a silently ignored attribute."""
    heard = []
    forget = settings.on_change("strict", heard.append)
    before = settings.strict
    try:
        settings.strict = not before
        assert settings.strict is (not before) and heard == [not before]
    finally:
        settings.strict = before
        forget()
    with pytest.raises(TypeError, match="unknown mpidtensor setting 'fast_path'"):
        settings.fast_path = False


def test_listeners_follow_updates_and_a_refusal_restores():
    seen = []
    remove = settings.on_change("strict", seen.append)
    try:
        with settings.override(strict=True):
            pass
        assert seen == [True, settings.strict]

        def refuse(value):
            if value == "refused":
                raise ValueError("no")

        remove_refuse = settings.on_change("strict", refuse)
        try:
            before = settings.strict
            with pytest.raises(ValueError, match="no"):
                settings.update(strict="refused")
            assert settings.strict is before and seen[-2:] == ["refused", before]  # told of the restore
        finally:
            remove_refuse()
    finally:
        remove()
    count = len(seen)
    with settings.override(strict=True):
        pass
    assert len(seen) == count, "a removed listener was called"
    with pytest.raises(ValueError, match="progress mode"):  # the progress machinery refuses
        settings.update(progress="async")
    assert settings.progress == progress.mode()
    with pytest.raises(TypeError, match="unknown mpidtensor setting"):
        settings.on_change("no_such_setting", seen.append)


def test_machinery_follows_the_settings():
    """The module flags of the collectives' hot path and the running machinery follow."""
    with settings.override(debug=True, timeout=30.0, buffer_pool_mb=1.0, launch_check=False):
        on = (guard.ENABLED, watchdog.ENABLED, pool.pool.limit_bytes, launch.mislaunch_message(1, {"PMI_SIZE": "4"}))
    off = (guard.ENABLED, watchdog.ENABLED, pool.pool.limit_bytes)
    assert_all_ranks(on == (True, True, 2**20, None), str(on))
    assert_all_ranks(off == (settings.debug, settings.timeout is not None, int(settings.buffer_pool_mb * 2**20)), str(off))
    before = progress.mode()
    progress.set_mode("hooks")  # set_mode is settings.update(progress=...)
    try:
        assert_all_ranks(settings.progress == "hooks" and progress.mode() == "hooks")
    finally:
        progress.set_mode(before)
    assert_all_ranks(settings.progress == before == progress.mode())
