"""Team-mode credentials (infra/lib_team.sh): no default password, no secret on a command line,
private password files, and SQL that quotes names and passwords.

PostgreSQL is started for real through the same shell functions as infra/start_mlflow_postgres.sh
and infra/ci_team_mode.sh; those tests skip (saying why) where its server binaries are absent.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import stat
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
LIB = REPO / "infra" / "lib_team.sh"
# A role name and a password that break naive quoting: quotes, a colon and a backslash (both
# special in a libpq password file), spaces.
ROLE = "a3po o'brien"
PASSWORD = "it's a \"pass\":word\\ x"


def _lib(script: str, *args: str, env: dict | None = None, check: bool = True) -> subprocess.CompletedProcess:
    """Run ``script`` in bash with infra/lib_team.sh sourced; ``args`` are "$1"...; stdout is captured."""
    return subprocess.run(
        ["bash", "-c", f'set -euo pipefail; source "{LIB}"; {script}', "lib", *args],
        env={**os.environ, **(env or {})}, capture_output=True, text=True, timeout=120, check=check,
    )


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


# ---------------------------------------------------------------- password files (no PostgreSQL needed)


def test_generated_password_is_private_unique_per_install_and_reused(tmp_path):
    env = {"A3PO_PG_PASSWORD_FILE": "", "A3PO_PG_PASSWORD": ""}
    first = Path(_lib('a3po_pg_password_file "$1"', str(tmp_path / "a"), env=env).stdout.strip())
    assert first == tmp_path / "a" / "secrets" / "pg_password"
    assert _mode(first) == 0o600 and _mode(first.parent) == 0o700
    secret = first.read_text().strip()
    assert len(secret) >= 24
    again = Path(_lib('a3po_pg_password_file "$1"', str(tmp_path / "a"), env=env).stdout.strip())
    assert again == first and again.read_text().strip() == secret  # reused on later starts
    other = Path(_lib('a3po_pg_password_file "$1"', str(tmp_path / "b"), env=env).stdout.strip())
    assert other.read_text().strip() != secret  # generated per install, not a default


def test_password_file_override_must_be_private_and_env_password_is_refused(tmp_path):
    given = tmp_path / "mine"
    given.write_text(PASSWORD + "\n")
    given.chmod(0o600)
    out = _lib('a3po_pg_password_file "$1"', str(tmp_path / "team"), env={"A3PO_PG_PASSWORD_FILE": str(given)})
    assert out.stdout.strip() == str(given)
    assert not (tmp_path / "team" / "secrets").exists()  # nothing generated beside the user's file
    given.chmod(0o644)
    bad = _lib('a3po_pg_password_file "$1"', str(tmp_path / "team"), env={"A3PO_PG_PASSWORD_FILE": str(given)}, check=False)
    assert bad.returncode != 0 and "chmod 600" in bad.stderr
    old = _lib('a3po_pg_password_file "$1"', str(tmp_path / "team"), env={"A3PO_PG_PASSWORD": "a3po"}, check=False)
    assert old.returncode != 0 and "A3PO_PG_PASSWORD_FILE" in old.stderr


def test_pgpass_line_escapes_colons_and_backslashes(tmp_path):
    pw = tmp_path / "pw"
    pw.write_text(PASSWORD + "\n")
    _lib('a3po_pgpass_write "$1" 5433 "$2" "$3"', str(tmp_path / "s" / "pgpass"), "u:1", str(pw))
    line = (tmp_path / "s" / "pgpass").read_text()
    # libpq's format: host:port:db:user:password, ':' and '\' escaped by a backslash.
    assert line == "127.0.0.1:5433:*:u\\:1:it's a \"pass\"\\:word\\\\ x\n"
    assert _mode(tmp_path / "s" / "pgpass") == 0o600


# ---------------------------------------------------------------- static check of infra/

# A password default in a shell variable, a password inside a connection URI (literal or
# variable), a password spliced into SQL text, a password in the environment of a command line.
_DEFAULT_PASSWORD = [
    re.compile(r"\$\{\w*PASS\w*:-[^}]"),  # a non-empty default
    re.compile(r"postgres\w*(\+\w+)?://[^\s/@'\"]+:[^\s/@'\"]+@"),
    re.compile(r"(?i)\bpassword\s+'[^']*'"),
    re.compile(r"\bPGPASSWORD="),
]


def _credential_problems(text: str) -> list[str]:
    return [line.strip() for line in text.splitlines() for rx in _DEFAULT_PASSWORD if rx.search(line)]


def test_the_static_check_catches_the_old_forms():
    # Lines of infra/ before this change: each must be flagged, or the check below proves nothing.
    old = [
        "PG_PASSWORD=${A3PO_PG_PASSWORD:-a3po}",
        '  --backend-store-uri "postgresql+psycopg2://$PG_USER:$PG_PASSWORD@127.0.0.1:$PG_PORT/$PG_DB" \\',
        '    "${psql[@]}" -c "create role $user login password \'$password\'"',
        '  local psql=(env PGPASSWORD="$password" "$bin/psql" -h 127.0.0.1)',
        "# A3PO_PREFECT_DB_URL=postgresql+asyncpg://user:password@127.0.0.1:5433/prefect (create that",
    ]
    assert [bool(_credential_problems(line)) for line in old] == [True] * len(old)


def test_no_script_in_infra_has_a_default_or_inline_password():
    files = [p for p in (REPO / "infra").iterdir() if p.suffix in (".sh", ".py", ".yaml", ".md") or p.name == "README.md"]
    assert any(p.name == "lib_team.sh" for p in files)
    problems = {p.name: _credential_problems(p.read_text()) for p in files}
    assert {k: v for k, v in problems.items() if v} == {}


# ---------------------------------------------------------------- PostgreSQL for real


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def pg():
    """PostgreSQL started by a3po_pg_start with ROLE and PASSWORD (a user-given password file)."""
    bindir = _lib("a3po_pg_bin", check=False).stdout.strip()
    if not bindir:
        pytest.skip("PostgreSQL server binaries not found (apt-get install postgresql; see infra/README.md)")
    # Not under pytest's 0700 tmp folder: as root, the server runs as 'postgres' and must reach its data.
    team = Path(tempfile.mkdtemp(prefix="a3po-infra-test-"))
    team.chmod(0o755)
    given = team / "given-password"
    given.write_text(PASSWORD + "\n")
    given.chmod(0o600)
    port = _free_port()
    env = {"A3PO_PG_PASSWORD_FILE": str(given)}
    try:
        _lib(
            'pw=$(a3po_pg_password_file "$1"); a3po_pg_start "$1/pgdata" "$2" "$3" "$pw" mlflow; '
            'a3po_pgpass_write "$1/secrets/pgpass" "$2" "$3" "$pw"',
            str(team), str(port), ROLE, env=env,
        )
        yield {"team": team, "port": port, "psql": str(Path(bindir) / "psql"), "pgpass": team / "secrets" / "pgpass"}
    finally:
        _lib('a3po_pg_stop "$1"', str(team / "pgdata"), check=False)
        shutil.rmtree(team, ignore_errors=True)


def _psql(pg, user: str, sql: str, pgpass: Path | str, **kw) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "PGPASSWORD"}
    return subprocess.run(
        [pg["psql"], "-h", "127.0.0.1", "-p", str(pg["port"]), "-U", user, "-d", "mlflow", "-w", "-qtAX", "-c", sql],
        env={**env, "PGPASSFILE": str(pgpass)}, capture_output=True, text=True, timeout=60, **kw,
    )


def test_role_with_quotes_logs_in_over_tcp_with_its_password_from_a_passfile(pg):
    out = _psql(pg, ROLE, "select current_user || '|' || current_database()", pg["pgpass"])
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == f"{ROLE}|mlflow"
    assert _mode(pg["pgpass"]) == 0o600 and _mode(pg["pgpass"].parent) == 0o700


def test_a_wrong_password_and_the_passwordless_superuser_are_refused_over_tcp(pg, tmp_path):
    wrong = tmp_path / "pgpass"
    wrong.write_text(f"127.0.0.1:{pg['port']}:*:{ROLE}:not-the-password\n")
    wrong.chmod(0o600)
    out = _psql(pg, ROLE, "select 1", wrong)
    assert out.returncode != 0 and "password authentication failed" in out.stderr
    for pw in ("", "a3po"):  # no password at all, and the old default
        su = tmp_path / f"su{len(pw)}"
        su.write_text(f"127.0.0.1:{pg['port']}:*:postgres:{pw}\n")
        su.chmod(0o600)
        out = _psql(pg, "postgres", "select 1", su)
        assert out.returncode != 0, f"superuser logged in over TCP with password {pw!r}"


def test_no_process_shows_the_password_while_a_client_is_connected(pg):
    # A client session held open (pg_sleep) while we read every process's command line.
    client = subprocess.Popen(
        [pg["psql"], "-h", "127.0.0.1", "-p", str(pg["port"]), "-U", ROLE, "-d", "mlflow", "-w", "-qtAX", "-c", "select pg_sleep(20)"],
        env={**os.environ, "PGPASSFILE": str(pg["pgpass"])}, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )
    try:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:  # wait until the server runs the session's backend
            args = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True, check=True).stdout
            if f"postgres: {ROLE} mlflow" in args:  # the backend's process title: user, database
                break
            time.sleep(0.2)
        assert client.poll() is None, client.stderr.read()
        assert f"postgres: {ROLE} mlflow" in args  # the client's backend, in the listing we checked
        assert f"postgres -D {pg['team'] / 'pgdata'}" in args  # the server is in the listing we checked
        assert PASSWORD not in args
        assert "pass\":word" not in args and "it's a" not in args  # nor any recognisable piece of it
    finally:
        client.kill()
        client.wait()


@pytest.mark.skipif(os.geteuid() != 0, reason="as another user PostgreSQL runs as that user, who reaches its own folders")
def test_as_root_a_team_folder_the_postgres_user_cannot_pass_still_starts(tmp_path):
    """The default team folder is 0700 (and under /root, so is its parent): PostgreSQL, run as
    'postgres', could not reach pgdata there, and initdb failed with 'Permission denied'."""
    bindir = _lib("a3po_pg_bin", check=False).stdout.strip()
    if not bindir:
        pytest.skip("PostgreSQL server binaries not found (apt-get install postgresql; see infra/README.md)")
    team = tmp_path / "team"
    team.mkdir(mode=0o700)
    tmp_path.chmod(0o700)
    port = _free_port()
    real = None
    try:
        out = _lib('umask 077; pw=$(a3po_pg_password_file "$1"); a3po_pg_start "$1/pgdata" "$2" a3po "$pw" mlflow; '
                   'a3po_pg_admin "$1/pgdata" "$2" -c "select 41 + 1"', str(team), str(port), check=False)
        assert out.returncode == 0 and out.stdout.strip() == "42", out.stderr
        real = (team / "pgdata").resolve()
        assert (team / "pgdata").is_symlink() and real.owner() == "postgres" and _mode(real) == 0o700
        assert _mode(team) == 0o700 and _mode(team / "secrets") == 0o700  # nothing of the team folder was opened up
        again = _lib('a3po_pg_stop "$1/pgdata"; a3po_pg_start "$1/pgdata" "$2" a3po "$1/secrets/pg_password" mlflow',
                     str(team), str(port), check=False)
        assert again.returncode == 0 and (team / "pgdata").resolve() == real, again.stderr  # a restart finds the same cluster
    finally:
        _lib('a3po_pg_stop "$1"', str(team / "pgdata"), check=False)
        if real is not None:
            shutil.rmtree(real, ignore_errors=True)
