"""CURVE authentication of every rollart ZeroMQ socket, and the run's key files.

Model: one CURVE key pair per run (ZeroMQ's own CURVE, RFC 26, via pyzmq; ZAP, RFC 27, via
``zmq.auth.thread.ThreadAuthenticator``). Every server socket uses it as its server key; every
client uses it as its client key (and its public half as the server key it expects); each
server's ZAP handler allows exactly one client public key: the run's. So only a process holding
the run's *secret* key completes a handshake (the CURVE INITIATE command is vouched for with the
client's secret key), and a process without it gets no service: ZeroMQ refuses the handshake
before any request is read, so an unauthenticated peer costs the server a TCP accept and a few
small handshake commands (bounded by ``MAXMSGSIZE``), never a buffered request. Once
authenticated, every message is encrypted and authenticated (NaCl crypto_box) in both directions.

Key files are ZeroMQ certificate files (``zmq.auth.create_certificates`` /
``zmq.auth.load_certificate``): ``NAME.key_secret`` holds both halves. They are created mode
0600 in a mode-0700 directory, and a key file readable by other users is refused, as ``ssh``
refuses such a private key.

Running without authentication is explicit (``INSECURE``); ``check_insecure`` states when it is
allowed: on loopback addresses with one opt-in, elsewhere only with two (see its docstring).
"""

from __future__ import annotations

import argparse
import ipaddress
import os
import stat
import sys
import threading
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

from rollart.transport.errors import ConfigError

#: Environment variable naming the run's key file for services and driver scripts (a path,
#: never key material: ``ps`` and ``/proc/PID/cmdline`` show command lines to every user).
KEY_FILE_ENV = "ROLLART_KEY_FILE"
#: A service's second opt-in to run unauthenticated on a non-loopback address (the first is
#: its ``--insecure`` flag); ``rollart run`` sets it for its services from ``run.insecure``.
INSECURE_ENV = "ROLLART_INSECURE"
#: Name of the run's key pair inside a key directory (``run.key_secret`` / ``run.key``).
KEY_NAME = "run"


@dataclass(frozen=True)
class RunKey:
    """The run's CURVE key pair (Z85 text, 40 bytes each) and where it was loaded from.

    ``secret`` is left out of ``repr`` so a logged object never shows it.
    """

    public: bytes
    secret: bytes = field(repr=False)
    path: Path | None = None

    @property
    def zap_domain(self) -> str:
        # One ZAP domain per key: a process serving with two keys (tests) keeps them apart.
        return f"rollart-{self.public[:8].decode()}"

    def secure_server(self, sock: zmq.Socket) -> None:
        """Make ``sock`` (not yet bound) a CURVE server that admits only this key's holders."""
        ctx = sock.context
        _ZAP.allow(ctx, self.zap_domain, self.public)
        sock.setsockopt(zmq.CURVE_SERVER, 1)
        sock.setsockopt(zmq.CURVE_PUBLICKEY, self.public)
        sock.setsockopt(zmq.CURVE_SECRETKEY, self.secret)
        sock.setsockopt_string(zmq.ZAP_DOMAIN, self.zap_domain)
        # Fail closed: were the ZAP handler ever missing, refuse every peer rather than admit
        # every peer that knows the (public) server key.
        sock.setsockopt(zmq.ZAP_ENFORCE_DOMAIN, 1)

    def secure_client(self, sock: zmq.Socket) -> None:
        """Make ``sock`` (not yet connected) a CURVE client holding this key."""
        sock.setsockopt(zmq.CURVE_SERVERKEY, self.public)
        sock.setsockopt(zmq.CURVE_PUBLICKEY, self.public)
        sock.setsockopt(zmq.CURVE_SECRETKEY, self.secret)


class Insecure:
    """No authentication, no encryption: chosen explicitly (``--insecure``), never a default."""

    path = None

    def secure_server(self, sock: zmq.Socket) -> None:
        """Leave ``sock`` unauthenticated."""

    def secure_client(self, sock: zmq.Socket) -> None:
        """Leave ``sock`` unauthenticated."""

    def __repr__(self) -> str:
        return "INSECURE"


INSECURE = Insecure()
#: What every RPC server and client is given: the run's key, or ``INSECURE`` by choice.
Auth = RunKey | Insecure


class _AllowedKeys:
    """ZAP credentials provider: ZAP domain -> the one client public key it admits."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._auth: ThreadAuthenticator | None = None
        self._pid = 0
        self._allowed: dict[str, bytes] = {}
        #: handshakes refused (a wrong or unknown client key), over this process's lifetime.
        self.refused = 0

    def allow(self, ctx: zmq.Context, domain: str, public: bytes) -> None:
        with self._lock:
            # After a fork the child has a new context and no authenticator thread.
            if self._auth is None or self._pid != os.getpid() or self._auth.context is not ctx:
                self._auth = ThreadAuthenticator(ctx)
                self._auth.start()
                self._pid = os.getpid()
                self._allowed = {}
            if domain not in self._allowed:
                self._allowed[domain] = public
                self._auth.configure_curve_callback(domain, credentials_provider=self)

    def callback(self, domain: str, key: bytes) -> bool:
        # Runs on the authenticator's thread, once per handshake (never per message).
        ok = self._allowed.get(domain) == key
        if not ok:
            self.refused += 1
        return ok


_ZAP = _AllowedKeys()


def refused_handshakes() -> int:
    """Handshakes this process's ZAP handler refused (unknown client key), since it started."""
    return _ZAP.refused


def create_key_file(directory: str | Path, name: str = KEY_NAME) -> Path:
    """Create a new run key pair in ``directory`` (made mode 0700) and return the secret file.

    Writes ``NAME.key_secret`` (both halves; give this path to services and clients) and
    ``NAME.key`` (public half), both mode 0600, replacing older ones.

    Raises:
        OSError: the directory cannot be created or made private.
    """
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True, mode=0o700)
    # mkdir's mode is filtered by the umask, and an existing directory keeps its mode: set it.
    # Files are written inside the private directory, so no other user can open them while
    # they briefly have the umask's mode, before the chmod below.
    os.chmod(d, 0o700)
    for suffix in (".key", ".key_secret"):
        (d / f"{name}{suffix}").unlink(missing_ok=True)
    public_file, secret_file = zmq.auth.create_certificates(d, name)
    for f in (public_file, secret_file):
        os.chmod(f, 0o600)
    return Path(secret_file)


def load_key_file(path: str | Path) -> RunKey:
    """Load the run's key pair from a ``.key_secret`` file.

    Raises:
        ConfigError: the file is missing, readable or writable by other users (``chmod 600``
            it), or holds no secret key.
    """
    p = Path(path).expanduser()  # "~/..." as written in a scenario's run.key_file
    try:
        mode = p.stat().st_mode
    except OSError as exc:
        raise ConfigError(f"key file {p}: {exc.strerror}") from None
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise ConfigError(f"key file {p}: mode {stat.S_IMODE(mode):04o} lets other users read "
                          f"or change the run's secret key; run `chmod 600 {p}`")
    try:
        public, secret = zmq.auth.load_certificate(p)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"key file {p}: not a ZeroMQ certificate: {exc}") from None
    if secret is None:
        raise ConfigError(f"key file {p}: holds only a public key; give the .key_secret file")
    return RunKey(public=public, secret=secret, path=p)


def run_credentials(run_dir: str | Path) -> RunKey:
    """The client credentials of the run whose directory is ``run_dir`` (driver scripts, tests).

    ``rollart run`` and ``open_cluster`` keep the run's key at ``run_dir/keys/run.key_secret``;
    pass the result as ``auth=`` to ``RpcClient``, ``InferenceClient``, ``EnvClient`` or
    ``TrainerClient``.

    Raises:
        ConfigError: no usable key file there (see ``load_key_file``).
    """
    return load_key_file(Path(run_dir) / "keys" / f"{KEY_NAME}.key_secret")


def _host(address: str) -> str:
    # "tcp://host:port" -> "host"; "ipc://..." / "inproc://..." have no network host.
    scheme, _, rest = address.partition("://")
    if scheme in ("ipc", "inproc"):
        return "localhost"
    return rest.rsplit(":", 1)[0].strip("[]") if rest else address


def is_loopback(address: str) -> bool:
    """True for endpoints only this machine can reach (``tcp://127.x``, ``localhost``, ``::1``,
    ``ipc://``, ``inproc://``); a wildcard (``*``, ``0.0.0.0``) or any other host is not."""
    host = _host(address)
    if host == "localhost":
        return True
    try:  # an IP literal; a host name that merely starts with "127." is not loopback
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_insecure(addresses: Iterable[str], *, flag: bool, config: bool, flag_name: str,
                   config_name: str) -> bool:
    """Whether to run without authentication, and whether that is allowed.

    The rule: either opt-in (``flag`` or ``config``) runs unauthenticated on loopback
    addresses; if any of ``addresses`` (bound or connected to) is reachable from the network,
    both are needed, so no single forgotten setting exposes a run.

    Returns:
        True to run insecure (some opt-in given), False to use the run's key.
    Raises:
        ConfigError: one opt-in only, with a non-loopback address (named in the message).
    """
    if not (flag or config):
        return False
    exposed = sorted({a for a in addresses if not is_loopback(a)})
    if exposed and not (flag and config):
        raise ConfigError(
            f"running without authentication on non-loopback address(es) {exposed} lets anyone "
            f"who can reach them drive the run's services; it needs both {flag_name} and "
            f"{config_name} (got only {flag_name if flag else config_name}). Without either, "
            "the run's CURVE key protects them")
    return True


def service_auth(key_file: str | None, insecure: bool, bind_address: str) -> Auth:
    """The ``Auth`` of a service from its ``--key-file`` / ``--insecure`` options.

    ``key_file`` falls back to ``$ROLLART_KEY_FILE``. Insecure on a non-loopback
    ``bind_address`` also needs ``ROLLART_INSECURE=1`` in the environment (``check_insecure``).

    Raises:
        ConfigError: neither a key file nor ``--insecure``; both; a bad key file; insecure on
            a non-loopback address without the second opt-in.
    """
    if insecure and key_file:
        raise ConfigError("give either --key-file (the run's key) or --insecure, not both")
    # The environment alone never makes a service insecure: --insecure is always needed.
    if check_insecure([bind_address], flag=insecure,
                      config=insecure and os.environ.get(INSECURE_ENV) == "1",
                      flag_name="--insecure", config_name=f"{INSECURE_ENV}=1"):
        return INSECURE
    key_file = key_file or os.environ.get(KEY_FILE_ENV) or None
    if not key_file:
        raise ConfigError(
            "no key: give --key-file PATH (the run's .key_secret file; `rollart keygen DIR` "
            f"makes one) or set {KEY_FILE_ENV}; --insecure runs without authentication")
    return load_key_file(key_file)


def add_auth_args(parser: argparse.ArgumentParser) -> None:
    """Add ``--key-file`` and ``--insecure`` to a service's ``argparse`` parser."""
    parser.add_argument(
        "--key-file", default=None,
        help=f"the run's CURVE key (.key_secret, mode 0600; default ${KEY_FILE_ENV}): only "
             "clients holding it are served")
    parser.add_argument(
        "--insecure", action="store_true",
        help=f"serve without authentication (loopback only, unless {INSECURE_ENV}=1 is set "
             "too); anyone who can connect can then drive this service")


def main(argv: list[str] | None = None) -> int:
    """``rollart keygen DIR``: write a new run key (``DIR/run.key_secret``, 0600; ``DIR`` 0700)
    to start services by hand with (``--key-file``) and give the launcher (``run.key_file``);
    copy the file (keeping mode 0600) to every machine that runs one of the run's services."""
    p = argparse.ArgumentParser(prog="rollart keygen", description=main.__doc__)
    p.add_argument("dir", type=Path, help="directory for the key files (created mode 0700)")
    p.add_argument("--force", action="store_true",
                   help="replace an existing key (services started with it stop accepting "
                        "the run's clients)")
    args = p.parse_args(argv)
    existing = args.dir / f"{KEY_NAME}.key_secret"
    if existing.exists() and not args.force:
        print(f"rollart keygen: {existing} exists; --force replaces it", file=sys.stderr)
        return 2
    print(create_key_file(args.dir))
    return 0


def env_credentials() -> RunKey:
    """The key named by ``$ROLLART_KEY_FILE`` (driver scripts and tests talking to services
    started with the same variable).

    Raises:
        ConfigError: the variable is unset, or its file is unusable (``load_key_file``).
    """
    path = os.environ.get(KEY_FILE_ENV)
    if not path:
        raise ConfigError(f"{KEY_FILE_ENV} is not set: no run key to connect with")
    return load_key_file(path)
