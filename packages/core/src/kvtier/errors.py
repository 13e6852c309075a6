"""Every error kvtier raises, under one base class, with structured fields."""

from __future__ import annotations


class KVTierError(Exception):
    """Base class of every kvtier error."""


class ConfigError(KVTierError, ValueError):
    """A configuration value is unknown, missing or of the wrong type."""

    def __init__(self, message: str, *, key: str | None = None, value: object = None):
        super().__init__(message)
        self.key = key
        self.value = value


class SpecError(KVTierError, ValueError):
    """A KVSpec (model KV geometry) is invalid."""

    def __init__(self, message: str, *, field: str | None = None, value: object = None):
        super().__init__(message)
        self.field = field
        self.value = value


class LayoutError(KVTierError, ValueError):
    """A layout name is unknown, or a tensor does not match the layout it claims."""


class PageIndexError(KVTierError, IndexError):
    """A page index is out of range, repeated where it must not be, or of the wrong type."""

    def __init__(self, message: str, *, index: object = None, limit: int | None = None):
        super().__init__(message)
        self.index = index
        self.limit = limit


class PoolExhaustedError(KVTierError, MemoryError):
    """A pool has no free pages left for an allocation."""

    def __init__(self, message: str, *, requested: int = 0, free: int = 0):
        super().__init__(message)
        self.requested = requested
        self.free = free


class PagePinnedError(KVTierError, RuntimeError):
    """A page in use (pinned) was asked to be freed or evicted."""


class TokensError(KVTierError, TypeError):
    """A token sequence is not a 1-D sequence of non-negative integers."""


class BackendError(KVTierError):
    """Base class of errors about a named backend."""

    def __init__(self, message: str, *, kind: str | None = None, name: str | None = None):
        super().__init__(message)
        self.kind = kind
        self.name = name


class BackendNotFoundError(BackendError, LookupError):
    """No backend of that name was discovered."""


class BackendUnavailableError(BackendError):
    """The backend exists but its runtime is missing; carries the probe's reason and hint."""

    def __init__(self, message: str, *, kind: str, name: str, reason: str, hint: str = ""):
        super().__init__(message, kind=kind, name=name)
        self.reason = reason
        self.hint = hint


class BackendConflictError(BackendError):
    """Two distributions registered the same backend name."""

    def __init__(self, message: str, *, kind: str, name: str, distributions: tuple[str, ...]):
        super().__init__(message, kind=kind, name=name)
        self.distributions = distributions


class InterfaceVersionError(BackendError):
    """A backend was built for another kvtier interface version."""

    def __init__(self, message: str, *, kind: str, name: str, expected: int, found: object):
        super().__init__(message, kind=kind, name=name)
        self.expected = expected
        self.found = found


class EntryPointError(BackendError):
    """An entry point is malformed or does not point at a backend class."""


class StoreError(KVTierError):
    """An L3 store failed in a way the caller must know about (not a plain miss)."""

    def __init__(self, message: str, *, backend: str | None = None, key: bytes | None = None):
        super().__init__(message)
        self.backend = backend
        self.key = key


class TransferError(KVTierError, RuntimeError):
    """A host<->device transfer failed; `code` is the runtime's error code when it has one."""

    def __init__(self, message: str, *, backend: str | None = None, code: int | None = None):
        super().__init__(message)
        self.backend = backend
        self.code = code


class TierFailureError(KVTierError, RuntimeError):
    """A background tier worker died or a store broke; raised on the next controller call."""

    def __init__(self, message: str, *, tier: str, cause: BaseException | None = None):
        super().__init__(message)
        self.tier = tier
        self.cause = cause


class InvalidArgumentError(KVTierError, ValueError):
    """A call got an argument it cannot use (wrong type, size, length or state)."""

    def __init__(self, message: str, *, argument: str | None = None, value: object = None):
        super().__init__(message)
        self.argument = argument
        self.value = value


class AllocationError(KVTierError, MemoryError):
    """Host memory could not be allocated (or registered) as asked; `code` is the runtime's
    return code when it has one."""

    def __init__(self, message: str, *, backend: str | None = None, nbytes: int = 0,
                 code: int | None = None):
        super().__init__(message)
        self.backend = backend
        self.nbytes = nbytes
        self.code = code


class InputError(KVTierError, ValueError):
    """A file or workload the user gave is invalid; ``source`` and ``line`` say where,
    ``field`` what."""

    def __init__(self, message: str, *, source: str | None = None, line: int | None = None,
                 field: str | None = None):
        super().__init__(message)
        self.source = source
        self.line = line
        self.field = field


#: The most characters of a value an error message echoes (`show_value`).
SHOW_VALUE_CHARS = 80


def show_value(value: object, limit: int = SHOW_VALUE_CHARS) -> str:
    """``repr(value)`` for an error message, cut to ``limit`` characters with an ellipsis and
    the full length: a 1 MiB string where an int goes must not become a 1 MiB message."""
    try:
        text = repr(value)
    except ValueError:          # an int past the interpreter's digit limit
        return f"<an int of about {value.bit_length() * 0.30103:.0f} digits>" \
            if isinstance(value, int) else f"<{type(value).__name__}>"
    if len(text) <= limit:
        return text
    return f"{text[:limit]}... ({len(text)} characters)"
