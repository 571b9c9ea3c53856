"""The one exception a user ever sees from expertsim.

Bad input (a file, a field, a value) is reported as one line and a non-zero exit by the CLI;
everything else is a bug and keeps its traceback.
"""

# Control characters (a newline inside a bad value, say) would break the one-line promise: show them escaped.
_ESCAPE = {c: f"\\x{c:02x}" for c in range(32)} | {ord("\n"): "\\n", ord("\r"): "\\r", ord("\t"): "\\t"}


class InputError(Exception):
    """Input that cannot give a number of record: names where it came from, the field and the value."""

    def __init__(self, where: str, field: str, value: object, why: str):
        self.where, self.field, self.value, self.why = str(where), field, value, why
        shown = value if isinstance(value, str) else repr(value)
        if len(shown) > 120:
            shown = shown[:117] + "..."
        self.message = f"{self.where}: {field} = {shown}: {why}".translate(_ESCAPE)
        # args are the four parts: SimPy re-raises a process's exception as type(exc)(*exc.args)
        super().__init__(where, field, value, why)

    def __str__(self) -> str:
        return self.message


def require_regular_file(path, where: str, what: str) -> None:
    """Refuse an input path that is not a regular file, saying what it is instead: missing, a folder, or a device,
    FIFO or socket (reading /dev/null gives nothing, a FIFO would wait for a writer). `what` names the file the
    command wanted ("a trace file")."""
    import os
    import stat

    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        raise InputError(where, "path", str(path), "no such file") from None
    except (OSError, ValueError) as exc:
        raise InputError(where, "path", str(path), f"cannot read: {getattr(exc, 'strerror', None) or exc}") from None
    if stat.S_ISDIR(mode):
        raise InputError(where, "path", str(path), f"is a folder, not {what}")
    if not stat.S_ISREG(mode):
        kind = "a FIFO" if stat.S_ISFIFO(mode) else "a socket" if stat.S_ISSOCK(mode) else "a device"
        raise InputError(where, "path", str(path), f"is {kind}, not {what} (a regular file)")
