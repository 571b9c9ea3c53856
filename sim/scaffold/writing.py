"""Writing a starting file, and how it names the files it refers to.

Nothing is written that does not load: each file is written beside its target under a temporary name, loaded
from there (so relative paths resolve as they will), and only then renamed into place.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

from sim.errors import InputError
from sim.schema import display_path


def _named_as(exc: InputError, temporary: Path, target: Path) -> InputError:
    """An error raised while loading the temporary file, naming the target the user asked for."""
    where = exc.where
    for shown in sorted({str(temporary), display_path(temporary.resolve()), str(temporary.resolve())}, key=len,
                        reverse=True):  # the longest spelling first: the others are parts of it
        where = where.replace(shown, str(target))
    return InputError(where, exc.field, exc.value, exc.why)


def write_checked(target: Path, make: Callable[[Path], object]):
    """`make(temporary)` writes the file under a temporary name beside `target` and loads it from there; only
    then is it renamed to `target`. What `make` returns; its errors name `target`."""
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise InputError(str(target), "output", str(target), f"cannot create its folder: {exc.strerror}") from None
    temporary = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    try:
        result = make(temporary)
        os.replace(temporary, target)
    except InputError as exc:
        raise _named_as(exc, temporary, target) from None
    except OSError as exc:
        raise InputError(str(target), "output", str(target), f"cannot write: {exc.strerror}") from None
    finally:
        temporary.unlink(missing_ok=True)
    return result


def reference(typed: str, found: Path, folder: Path, resolve: Callable[[str, Path], Path | None]) -> str:
    """How a file in `folder` names `found` (given as `typed` from the working folder): as typed when that
    resolves to the same file from `folder`, else a path relative to `folder`, else an absolute one."""
    if (again := resolve(typed, folder)) is not None and again.resolve() == found.resolve():
        return typed
    here, there = os.path.abspath(folder), os.path.abspath(found)
    if os.path.commonpath([here, there]) == os.path.splitdrive(here)[0] + os.sep:
        return str(found.resolve())  # no folder in common: a relative path would only break sooner
    relative = os.path.relpath(there, here)
    return relative if (folder / relative).resolve() == found.resolve() else str(found.resolve())


def hardware_from(folder: Path) -> Callable[[str, Path], Path | None]:
    from sim.hardware import resolve_hardware

    def resolve(ref: str, base: Path) -> Path | None:
        try:
            return resolve_hardware(ref, base, "hardware")
        except InputError:
            return None
    return resolve
