"""The one exception type meant for people: the CLI prints its message without a traceback."""


class DraftflowError(Exception):
    """Something the user can fix: the message says what is wrong, where, and how to fix it."""


def where(path, line: int | None = None, field: str | None = None) -> str:
    """Format a location as `file:line: field` for error messages."""
    text = str(path)
    if line is not None:
        text += f":{line}"
    if field:
        text += f": field '{field}'"
    return text


def reject_unknown_keys(settings, known, label: str) -> None:
    """Refuse settings keys a stage does not know: a typo must not fall back to a default."""
    unknown = sorted(set(settings) - set(known))
    if unknown:
        raise DraftflowError(f"{label}: unknown key(s) {unknown}; expected {sorted(known)}")
