"""The one settings object: every ``MPIDTENSOR_*`` environment variable, read here and
nowhere else, typed and checked, and settable from Python.

``settings`` is read from the environment on first import; modules read its attributes
when they act (an attribute read, ~30 ns), so ``settings.update(debug=True)`` or
``with settings.override(fast_paths=False): ...`` takes effect at once. A setting whose
change has to reach running machinery (the progress mode, the pool size) names a
listener that :meth:`Settings.update` calls. Settings that decide collectives (``debug``,
``fast_paths``, ``strict``) must be set alike on every rank.
"""
from __future__ import annotations

import os
from contextlib import contextmanager
from dataclasses import dataclass, field, fields
from typing import Any, Callable, Iterator, Mapping

__all__ = ["Settings", "settings", "ENVIRONMENT"]


def _flag(raw: str, name: str) -> bool:
    text = raw.strip().lower()
    if text in ("", "0", "false", "no", "off"):
        return False
    if text in ("1", "true", "yes", "on"):
        return True
    raise ValueError(f"{name} must be 0 or 1, got {raw!r}")


# The watchdog's default: torch's for NCCL. A healthy job waits that long in one wait only
# while one rank works alone (docs/dtensor.md, "The watchdog").
DEFAULT_TIMEOUT = 600.0


def _seconds(raw: str, name: str) -> float | None:
    """Seconds of the watchdog's timeout: empty is the default, 0 (or less) turns it off."""
    text = raw.strip()
    if not text:
        return DEFAULT_TIMEOUT
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"{name} must be a number of seconds, got {raw!r}") from None
    return value if value > 0 else None


def _megabytes(raw: str, name: str) -> float:
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{name} must be a number of MiB, got {raw!r}") from None
    if value < 0:
        raise ValueError(f"{name} must be >= 0, got {raw!r}")
    return value


def _optional_flag(raw: str, name: str) -> bool | None:
    return None if raw.strip() == "" else _flag(raw, name)


def _progress(raw: str, name: str) -> str:
    mode = raw.strip() or "off"
    if mode not in ("off", "hooks", "thread"):
        raise ValueError(f"{name} must be one of off, hooks, thread; got {raw!r}")
    return mode


def _setting(env: str, parse: Callable[[str, str], Any], default: Any, doc: str) -> Any:
    return field(default=default, metadata={"env": env, "parse": parse, "doc": doc})


@dataclass
class Settings:
    """mpidtensor's settings; each field documents its environment variable."""

    abort_on_exception: bool = _setting(
        "MPIDTENSOR_ABORT_ON_EXCEPTION", _flag, True,
        "an uncaught exception on one rank aborts the whole job (installed with the first mesh)")
    buffer_pool_mb: float = _setting(
        "MPIDTENSOR_BUFFER_POOL_MB", _megabytes, 512.0,
        "MiB of receive buffers kept for reuse; 0 turns pooling off")
    cuda_aware: bool | None = _setting(
        "MPIDTENSOR_CUDA_AWARE", _optional_flag, None,
        "hand device pointers to MPI (1) or stage through host memory (0); unset: ask MPI")
    debug: bool = _setting(
        "MPIDTENSOR_DEBUG", _flag, False,
        "ranks agree on each collective's kind, dtype and sizes before it runs")
    fast_paths: bool = _setting(
        "MPIDTENSOR_FAST_PATHS", _flag, True,
        "registered fast paths (local Linear/Embedding/norm, optimizer steps, ...) may run; "
        "0 sends everything through the general dispatch path")
    launch_check: bool = _setting(
        "MPIDTENSOR_LAUNCH_CHECK", _flag, True,
        "the first mesh refuses N one-rank jobs started where one N-rank job was meant")
    local_optim_step: bool = _setting(
        "MPIDTENSOR_LOCAL_OPTIM_STEP", _flag, True,
        "elementwise optimizers step DTensor parameters on their local tensors")
    progress: str = _setting(
        "MPIDTENSOR_PROGRESS", _progress, "off",
        "MPI progress of non-blocking collectives: off, hooks or thread")
    strict: bool = _setting(
        "MPIDTENSOR_STRICT", _flag, False,
        "an op without a sharding rule raises instead of gathering to replicated")
    timeout: float | None = _setting(
        "MPIDTENSOR_TIMEOUT", _seconds, DEFAULT_TIMEOUT,
        "seconds a rank may wait on the others in one collective or message before the watchdog "
        "ends the job (torch's default for NCCL); 0 turns the watchdog off")

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> "Settings":
        """Settings from ``environ`` (default ``os.environ``); a malformed value is a
        ``ValueError`` naming the variable."""
        environ = os.environ if environ is None else environ
        values = {}
        for f in fields(cls):
            raw = environ.get(f.metadata["env"])
            if raw is not None:
                values[f.name] = f.metadata["parse"](raw, f.metadata["env"])
        return cls(**values)

    def update(self, **changes: Any) -> None:
        """Set fields by name (``TypeError`` for an unknown one) and tell their listeners;
        a listener's error (say, a progress mode MPI cannot run) restores the old value."""
        known = {f.name for f in fields(self)}
        unknown = sorted(set(changes) - known)
        if unknown:
            raise TypeError(f"unknown mpidtensor settings {unknown}; known: {sorted(known)}")
        for name, value in changes.items():
            before = getattr(self, name)
            object.__setattr__(self, name, value)
            try:
                for listener in _LISTENERS.get(name, ()):
                    listener(value)
            except BaseException:  # a listener refused the value: keep the old one everywhere
                object.__setattr__(self, name, before)
                for listener in _LISTENERS.get(name, ()):
                    listener(before)
                raise

    def __setattr__(self, name: str, value: Any) -> None:
        """``settings.x = v`` is ``settings.update(x=v)``: checked, and heard by listeners
        (a fast-path switch set by assignment must drop the plans made under the old one)."""
        if name not in _NAMES:
            raise TypeError(f"unknown mpidtensor setting {name!r}; known: {sorted(_NAMES)}")
        if name in self.__dict__:
            self.update(**{name: value})
        else:  # the dataclass's __init__
            object.__setattr__(self, name, value)

    @contextmanager
    def override(self, **changes: Any) -> Iterator["Settings"]:
        """Settings changed inside a ``with`` block and restored after it."""
        before = {name: getattr(self, name) for name in changes}
        self.update(**changes)
        try:
            yield self
        finally:
            self.update(**before)

    def on_change(self, name: str, listener: Callable[[Any], None]) -> Callable[[], None]:
        """Call ``listener(new_value)`` whenever ``name`` is updated; returns the function
        that unregisters it."""
        if name not in {f.name for f in fields(self)}:
            raise TypeError(f"unknown mpidtensor setting {name!r}")
        listeners = _LISTENERS.setdefault(name, [])
        listeners.append(listener)
        return lambda: listeners.remove(listener)


_LISTENERS: dict[str, list[Callable[[Any], None]]] = {}
_NAMES = frozenset(f.name for f in fields(Settings))

# (variable, field, default, meaning) for the README's table and the environment report
ENVIRONMENT: tuple[tuple[str, str, Any, str], ...] = tuple(
    (f.metadata["env"], f.name, f.default, f.metadata["doc"]) for f in fields(Settings))

settings = Settings.from_environ()
