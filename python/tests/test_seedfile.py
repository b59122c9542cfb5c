"""Seed, .creds and CA files are loaded as Go's auth loads them (issue
28.5): no symlink, a regular file (a FIFO is refused at once, never waited
on), owned by this user, no group or other access for secrets, bounded
size; and nats-py gets the checked bytes, never the path it would open
again on every reconnect."""

from __future__ import annotations

import os
import pathlib
import threading

import nkeys
import pytest

from kvtier import client, errors


def _seed(prefix: int = nkeys.PREFIX_BYTE_USER) -> str:
    return str(nkeys.encode_seed(os.urandom(32), prefix).decode())


def _write(path: pathlib.Path, text: str, mode: int = 0o600) -> pathlib.Path:
    path.write_text(text)
    os.chmod(path, mode)  # past the umask
    return path


def _load_within(path: pathlib.Path, load: object, seconds: float = 10.0) -> BaseException | None:
    """Runs load(); fails if it blocks (a FIFO opened for reading waits for
    a writer). Returns what it raised."""
    out: list[BaseException | None] = []

    def run() -> None:
        try:
            load()  # type: ignore[operator]
            out.append(None)
        except BaseException as e:
            out.append(e)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(seconds)
    if t.is_alive():
        fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK)  # let the blocked open return
        os.close(fd)
        t.join(seconds)
        pytest.fail(f"loading {path} blocked on open")
    return out[0]


def test_seed_bytes_not_the_path_go_to_nats_py(tmp_path: pathlib.Path) -> None:
    seed = _seed()
    path = _write(tmp_path / "engine-engine0.nk", seed + "\n")
    opts = client.ConnectOptions(servers=["nats://a:4222"], creds_dir=str(tmp_path), instance="engine0")
    kw = opts.nats_kwargs()
    assert "nkeys_seed" not in kw, "nats-py would open the path again on each (re)connect"
    assert kw["nkeys_seed_str"] == seed
    # Replacing the file after the check changes nothing that was handed over.
    path.unlink()
    os.symlink(tmp_path / "elsewhere", path)
    assert kw["nkeys_seed_str"] == seed


def test_creds_file_bytes_go_to_nats_py(tmp_path: pathlib.Path) -> None:
    text = ("-----BEGIN NATS USER JWT-----\neyJ0\n------END NATS USER JWT------\n\n"
            f"-----BEGIN USER NKEY SEED-----\n{_seed()}\n------END USER NKEY SEED------\n")
    path = _write(tmp_path / "user.creds", text)
    kw = client.ConnectOptions(credentials_file=str(path)).nats_kwargs()
    import nats.aio.client

    got = kw["user_credentials"]
    assert isinstance(got, nats.aio.client.RawCredentials) and str(got) == text


def test_unsafe_seed_files_are_refused(tmp_path: pathlib.Path) -> None:
    good = _write(tmp_path / "good.nk", _seed())
    cases: dict[str, tuple[pathlib.Path, str]] = {
        "group-readable": (_write(tmp_path / "g.nk", _seed(), 0o640), "mode 0640"),
        "world-readable": (_write(tmp_path / "w.nk", _seed(), 0o604), "mode 0604"),
        "too large": (_write(tmp_path / "big.nk", "S" * (1 << 20 + 1)), "over 1048576 B"),
        "not a seed": (_write(tmp_path / "junk.nk", "hello"), "no nkey seed"),
        "an account seed": (_write(tmp_path / "acct.nk", _seed(nkeys.PREFIX_BYTE_ACCOUNT)), "no user nkey"),
        "a directory": (tmp_path, "not a regular file"),
        "missing": (tmp_path / "none.nk", "No such file"),
    }
    link = tmp_path / "link.nk"
    os.symlink(good, link)
    cases["a symlink"] = (link, "symlink")
    if os.geteuid() == 0:  # only root can give a file away
        foreign = _write(tmp_path / "foreign.nk", _seed())
        os.chown(foreign, 65534, 65534)
        cases["another user's"] = (foreign, "owned by uid 65534")
    fifo = tmp_path / "fifo.nk"
    os.mkfifo(fifo, 0o600)
    cases["a FIFO"] = (fifo, "not a regular file")
    for what, (path, want) in cases.items():
        opts = client.ConnectOptions(nkey_seed_file=str(path))
        err = _load_within(path, opts.nats_kwargs)
        assert isinstance(err, errors.CredentialsError), f"{what}: {err!r}"
        assert str(path) in str(err) and want in str(err), f"{what}: {err}"
    assert client.ConnectOptions(nkey_seed_file=str(good)).nats_kwargs()["nkeys_seed_str"]


def test_unsafe_creds_and_ca_files_are_refused(tmp_path: pathlib.Path) -> None:
    creds = _write(tmp_path / "u.creds", "x", 0o644)
    err = _load_within(creds, client.ConnectOptions(credentials_file=str(creds)).nats_kwargs)
    assert isinstance(err, errors.CredentialsError) and "mode 0644" in str(err), err
    # A CA bundle may be readable by others, not writable; a FIFO is refused.
    ca = _write(tmp_path / "ca.pem", "x", 0o666)
    err = _load_within(ca, client.ConnectOptions(insecure=True, tls_ca_file=str(ca)).nats_kwargs)
    assert isinstance(err, errors.CredentialsError) and "mode 0666" in str(err), err
    fifo = tmp_path / "ca-fifo.pem"
    os.mkfifo(fifo, 0o644)
    err = _load_within(fifo, client.ConnectOptions(insecure=True, tls_ca_file=str(fifo)).nats_kwargs)
    assert isinstance(err, errors.CredentialsError) and "not a regular file" in str(err), err
