"""`hibernate serve`'s token: read only from a file the proxy's own user (or root) controls, opened once,
checked on its descriptor and read a bounded amount, so that no other user can choose it and no file can
hang or swell the proxy at start; an empty HIBERNATE_SERVE_TOKEN is refused, not taken for none."""

from __future__ import annotations

import os
import stat
import time
from pathlib import Path

import pytest

from hibernate.errors import ExitCode, UsageError
from hibernate.procinfo import describe_user
from hibernate.serve.config import (
    MAX_TOKEN_FILE_BYTES,
    TOKEN_ENV,
    read_token,
    token_file_problem,
)
from tests.conftest import NOBODY, is_root, run_cli
from tests.test_serve_rules import config

TOKEN = "a-long-enough-token-0123456789"
BACKEND = ["--backend", "a=http://127.0.0.1:9"]


def private_file(path: Path, text: str) -> Path:
    path.write_text(text)
    path.chmod(0o600)
    return path


def stat_of(mode: int, uid: int) -> os.stat_result:
    """What fstat would say of a file of this kind and mode, owned by ``uid``."""
    return os.stat_result((mode, 0, 0, 1, uid, 0, 40, 0, 0, 0))


def test_a_regular_file_of_ones_own_or_roots_with_no_group_or_other_bits_is_the_only_kind_accepted() -> None:
    user = 1000
    assert token_file_problem(stat_of(stat.S_IFREG | 0o600, user), user) is None
    assert token_file_problem(stat_of(stat.S_IFREG | 0o400, 0), user) is None  # root's: root can anyway
    other = token_file_problem(stat_of(stat.S_IFREG | 0o600, 1001), user)
    assert other is not None and other[0].startswith("belongs to another user (mode 600, owner ")
    for mode in (0o640, 0o604, 0o620, 0o602, 0o610):
        loose = token_file_problem(stat_of(stat.S_IFREG | mode, user), user)
        assert loose is not None and loose[0].startswith(f"can be read or written by others (mode {mode:o}")
    for kind, words in (
        (stat.S_IFCHR, "a character device"),
        (stat.S_IFIFO, "a FIFO"),
        (stat.S_IFDIR, "a directory"),
        (stat.S_IFSOCK, "a socket"),
        (stat.S_IFBLK, "a block device"),
    ):
        problem = token_file_problem(stat_of(kind | 0o600, user), user)
        assert problem is not None and problem[0] == f"is {words}, not a regular file"


@pytest.mark.skipif(not is_root(), reason="giving a file to another user needs root")
def test_a_token_file_another_user_owns_is_refused_even_at_mode_600(tmp_path: Path) -> None:
    token = private_file(tmp_path / "token", TOKEN + "\n")
    os.chown(token, NOBODY, NOBODY)
    with pytest.raises(UsageError) as refused:
        read_token(token, "--token-file")
    message = (
        f"--token-file {token} belongs to another user (mode 600, owner {describe_user(NOBODY)}): "
        "whoever owns it could put a token of theirs in it"
    )
    assert refused.value.message == message
    assert refused.value.hint == f"keep the token in a file of your own: chown root {token}"
    result = run_cli("serve", *BACKEND, "--to", str(tmp_path), "--token-file", str(token), timeout=60)
    assert result.returncode == ExitCode.USAGE, result.stderr
    assert result.stderr.splitlines()[0] == f"hibernate: error: {message}"


def test_a_device_is_refused_without_being_read(tmp_path: Path) -> None:
    started = time.monotonic()
    with pytest.raises(UsageError) as refused:
        read_token(Path("/dev/zero"), "--token-file")
    assert refused.value.message == "--token-file /dev/zero is a character device, not a regular file"
    assert time.monotonic() - started < 5  # refused from its descriptor, not after reading gigabytes


def test_a_fifo_is_refused_at_once_not_waited_on(tmp_path: Path) -> None:
    fifo = tmp_path / "token"
    os.mkfifo(fifo, 0o600)
    # In a process of its own, bounded: a proxy that waited for a writer would never print a line.
    result = run_cli("serve", *BACKEND, "--to", str(tmp_path), "--token-file", str(fifo), timeout=30)
    assert result.returncode == ExitCode.USAGE, result.stderr
    assert result.stderr.splitlines() == [
        f"hibernate: error: --token-file {fifo} is a FIFO, not a regular file",
        "  hint: give a regular file holding the token",
    ]


def test_a_symbolic_link_is_refused_even_to_a_good_file(tmp_path: Path) -> None:
    target = private_file(tmp_path / "real", TOKEN + "\n")
    link = tmp_path / "token"
    link.symlink_to(target)
    assert read_token(target, "--token-file") == TOKEN
    with pytest.raises(UsageError, match="is a symbolic link; a token file is read only from the file"):
        read_token(link, "--token-file")


def test_a_file_longer_than_any_token_is_refused_after_reading_no_more_than_the_limit(tmp_path: Path) -> None:
    big = private_file(tmp_path / "token", "x" * (MAX_TOKEN_FILE_BYTES + 1))
    with pytest.raises(UsageError, match=f"is longer than {MAX_TOKEN_FILE_BYTES} bytes"):
        read_token(big, "--token-file")
    exact = private_file(tmp_path / "exact", "y" * (MAX_TOKEN_FILE_BYTES - 1) + "\n")
    assert read_token(exact, "--token-file") == "y" * (MAX_TOKEN_FILE_BYTES - 1)


def test_an_empty_token_variable_is_refused_as_a_short_token_is_not_taken_for_none() -> None:
    with pytest.raises(UsageError, match=f"^{TOKEN_ENV}: a token is at least 16 characters.*set but empty"):
        config(environ={TOKEN_ENV: ""})
    with pytest.raises(UsageError, match=f"^{TOKEN_ENV}: a token is at least 16 characters"):
        config(environ={TOKEN_ENV: "   "})
    assert config(environ={}).token is None
    assert config(environ={TOKEN_ENV: TOKEN}).token == TOKEN
