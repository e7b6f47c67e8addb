"""Redis credentials: the user in the URL (redis://router@host:port/0), the password from the
environment or a file, never from a command line (where `ps` would show it)."""

from __future__ import annotations

from pathlib import Path

from pydantic import SecretStr


def read_password(password: SecretStr | None, password_file: Path | None) -> str | None:
    """The password a process connects with: the file's first line, else the value (an
    environment variable, MESHSERVE_<PROCESS>_REDIS_PASSWORD), else none."""
    if password_file is not None:
        try:
            text = password_file.read_text()
        except OSError as e:
            raise ValueError(f"cannot read the Redis password file {password_file}: {e}") from e
        first = text.splitlines()[0].strip() if text.strip() else ""
        if not first:
            raise ValueError(f"the Redis password file {password_file} is empty")
        return first
    return password.get_secret_value() if password is not None else None
