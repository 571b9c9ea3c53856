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
