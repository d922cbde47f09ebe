"""A deployment's secrets: made once per session on the controller, kept in files only their owner can read.

`<session>/secrets/` (mode 0700) on the controller holds `instance.token` (the token every vLLM instance requires
on its /v1 routes), the data system's CURVE keys (`curve/`: the workers' key pair, shared by every worker and the
master, and the public keys of the clients they accept), and one environment file per kind of process
(`instance.env`, `proxy.env`, `datasystem.env` for yrpd's own data-system checks, `kv-relay.env` for the KV-event
relays; mode 0600), and the relays' CURVE keys with the proxy's (`kv-relay/`). The deploy copies
them, with etcd's TLS files (`etcd/`), over SFTP into the host's `<session>/secrets/` (0700, yrpd.layout); each
process's supervisor reads its file when it starts the process, and openYuanrong reads `curve/` and `etcd/`
itself. So a secret is never part of a command line (`ps`, `yrpd plan`, the session journal, the logs) and `yrpd
down` removes it from the hosts and from here.
"""

from __future__ import annotations

import os
import secrets as random_tokens
import shutil
from pathlib import Path

#: vLLM's own variable: with it set, vLLM requires `Authorization: Bearer <token>` on /v1, /v2, /inference
VLLM_TOKEN_ENV = "VLLM_API_KEY"
#: the proxy's variables: the token it sends to the instances, and the key it requires from clients
PROXY_TOKEN_ENV = "YRPD_INSTANCE_TOKEN"
PROXY_KEY_ENV = "YRPD_API_KEY"
#: the data system client's own variables (its KVClient falls back to them when given no keys)
DS_CLIENT_ENV = ("DATASYSTEM_CLIENT_PUBLIC_KEY", "DATASYSTEM_CLIENT_PRIVATE_KEY", "DATASYSTEM_SERVER_PUBLIC_KEY")
#: the environment files, by the kind of process that reads them
INSTANCE, PROXY, DATASYSTEM, KV_RELAY = "instance", "proxy", "datasystem", "kv-relay"
#: the KV-event relay's CURVE keys (yrpd.proxy.kvrelay): its pair, and the proxy's, the one client it lets in
KV_RELAY_SECRET_ENV, KV_RELAY_PUBLIC_ENV = "YRPD_KV_RELAY_SECRET", "YRPD_KV_RELAY_PUBLIC"
KV_PROXY_PUBLIC_ENV, KV_PROXY_SECRET_ENV = "YRPD_KV_PROXY_PUBLIC", "YRPD_KV_PROXY_SECRET"
KV_RELAY_DIR = "kv-relay"
TOKEN_FILE = "instance.token"
#: the worker's key directory, as the data system reads it: its pair, and the public keys it accepts; the file
#: names are the worker's own (a client key must be called client.key: the worker trusts services by file name)
CURVE_DIR = "curve"
CURVE_FILES = ("worker.key", "worker.key_secret", "worker_authorized_clients/worker.key",
               "worker_authorized_clients/client.key")
#: etcd's TLS files, under these names as yr's template expects them: a CA made per session, the server pair on the
#: master (etcd's client and peer port), a client pair for the data system master and workers and for yr's checks
ETCD_DIR = "etcd"
ETCD_SERVER_FILES = ("ca.crt", "server.crt", "server.key")
ETCD_CLIENT_FILES = ("ca.crt", "client.crt", "client.key")
_Z85 = "0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ.-:+=^!/*?&<>()[]{}@%$#"


def z85(data: bytes) -> str:
    """ZeroMQ's Z85 text form (RFC 32/Z85) of bytes whose length is a multiple of 4: how CURVE keys are written."""
    if len(data) % 4:
        raise ValueError("Z85 encodes whole 4-byte groups")
    out = []
    for i in range(0, len(data), 4):
        value = int.from_bytes(data[i:i + 4], "big")
        group = []
        for _ in range(5):
            value, digit = divmod(value, 85)
            group.append(_Z85[digit])
        out.extend(reversed(group))
    return "".join(out)


def curve_keypair() -> tuple[str, str]:
    """A CURVE key pair (public, secret) in Z85: an X25519 pair, as zmq_curve_keypair() makes."""
    from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey
    from cryptography.hazmat.primitives.serialization import Encoding, NoEncryption, PrivateFormat, PublicFormat

    key = X25519PrivateKey.generate()
    secret = key.private_bytes(Encoding.Raw, PrivateFormat.Raw, NoEncryption())
    public = key.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)
    return z85(public), z85(secret)


def _ensure_curve(d: Path) -> dict[str, str]:
    """The session's CURVE keys (made once), as the data system client's environment."""
    curve = d / CURVE_DIR
    if not (curve / CURVE_FILES[-1]).exists():
        curve.mkdir(mode=0o700, exist_ok=True)
        (curve / "worker_authorized_clients").mkdir(mode=0o700, exist_ok=True)
        worker, client = curve_keypair(), curve_keypair()
        for name, text in zip(CURVE_FILES, (worker[0], worker[1], worker[0], client[0])):
            write_private(curve / name, text)
        write_private(curve / "client.key_secret", client[1])
    read = lambda name: (curve / name).read_text().strip()  # noqa: E731
    return dict(zip(DS_CLIENT_ENV, (read("worker_authorized_clients/client.key"), read("client.key_secret"),
                                    read("worker.key"))))


def _ensure_kv_relay(d: Path) -> tuple[dict[str, str], dict[str, str]]:
    """The session's KV-event relay keys (made once): (the relay's environment, the proxy's part)."""
    keys = d / KV_RELAY_DIR
    names = ("relay.key", "relay.key_secret", "proxy.key", "proxy.key_secret")
    if not (keys / names[-1]).exists():
        keys.mkdir(mode=0o700, exist_ok=True)
        for name, text in zip(names, (*curve_keypair(), *curve_keypair())):
            write_private(keys / name, text)
    relay_public, relay_secret, proxy_public, proxy_secret = ((keys / n).read_text().strip() for n in names)
    return ({KV_RELAY_SECRET_ENV: relay_secret, KV_RELAY_PUBLIC_ENV: relay_public, KV_PROXY_PUBLIC_ENV: proxy_public},
            {KV_RELAY_PUBLIC_ENV: relay_public, KV_PROXY_PUBLIC_ENV: proxy_public, KV_PROXY_SECRET_ENV: proxy_secret})


def secrets_dir(session_path: Path) -> Path:
    return Path(session_path) / "secrets"


def write_private(path: Path, text: str) -> None:
    """Write `text` to `path` readable by its owner only, from the first byte on (then renamed into place)."""
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(text)
    os.replace(tmp, path)


def env_text(values: dict[str, str]) -> str:
    for key, value in values.items():
        if "\n" in value or "\r" in value:
            raise ValueError(f"{key}: a secret cannot span lines")
    return "".join(f"{key}={value}\n" for key, value in values.items())


def _ensure_etcd_tls(d: Path, etcd_ips: list[str]) -> None:
    """A CA, etcd's server certificate for `etcd_ips` and a client certificate (made once per session; EC P-256, so
    the ECDHE-ECDSA suites yr's template allows apply)."""
    tls = d / ETCD_DIR
    if (tls / "client.key").exists():
        return
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    tls.mkdir(mode=0o700, exist_ok=True)
    now = datetime.datetime.now(datetime.timezone.utc)
    name = lambda cn: x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])  # noqa: E731

    def issue(subject: str, key, issuer_name, signer, usages=None, ips=(), ca=False):
        builder = (x509.CertificateBuilder().subject_name(name(subject)).issuer_name(issuer_name)
                   .public_key(key.public_key()).serial_number(x509.random_serial_number())
                   .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=3650))
                   .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
        if usages:
            builder = builder.add_extension(x509.ExtendedKeyUsage(usages), critical=False)
        if ips:
            builder = builder.add_extension(
                x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address(ip)) for ip in ips]), critical=False)
        return builder.sign(signer, hashes.SHA256())

    def save(stem: str, cert, key) -> None:
        write_private(tls / f"{stem}.crt", cert.public_bytes(serialization.Encoding.PEM).decode())
        if key is not None:
            write_private(tls / f"{stem}.key", key.private_bytes(
                serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()).decode())

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = issue("yrpd deployment CA", ca_key, name("yrpd deployment CA"), ca_key, ca=True)
    server_key, client_key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    # etcd's peer port presents the server certificate as a client too
    server = issue("etcd", server_key, ca.subject, ca_key,
                   [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH], ips=sorted({*etcd_ips, "127.0.0.1"}))
    client = issue("yrpd etcd client", client_key, ca.subject, ca_key, [ExtendedKeyUsageOID.CLIENT_AUTH])
    save("ca", ca, None)
    save("server", server, server_key)
    save("client", client, client_key)  # the CA's own key is not kept: nothing else is ever signed


def ensure(session_path: Path, proxy_key: str | None, etcd_ips: list[str] = ()) -> Path:
    """Make the session's token and keys (once) and its environment files (every deploy: the proxy key may have
    changed); returns the directory."""
    d = secrets_dir(session_path)
    d.mkdir(mode=0o700, exist_ok=True)
    os.chmod(d, 0o700)
    token_file = d / TOKEN_FILE
    if not token_file.exists():
        write_private(token_file, random_tokens.token_urlsafe(32) + "\n")
    token = token_file.read_text().strip()
    ds_client = _ensure_curve(d)
    _ensure_etcd_tls(d, list(etcd_ips))
    write_private(d / f"{INSTANCE}.env", env_text({VLLM_TOKEN_ENV: token, **ds_client}))
    write_private(d / f"{DATASYSTEM}.env", env_text(ds_client))
    relay, proxy_relay = _ensure_kv_relay(d)
    write_private(d / f"{KV_RELAY}.env", env_text(relay))
    proxy = {PROXY_TOKEN_ENV: token, **({PROXY_KEY_ENV: proxy_key} if proxy_key else {}), **proxy_relay}
    write_private(d / f"{PROXY}.env", env_text(proxy))
    return d


def instance_token(session_path: Path) -> str | None:
    """The token the session's instances require, where this controller deployed them (None for a session made
    before instances required one)."""
    try:
        return (secrets_dir(session_path) / TOKEN_FILE).read_text().strip() or None
    except FileNotFoundError:
        return None


def remove(session_path: Path) -> None:
    shutil.rmtree(secrets_dir(session_path), ignore_errors=True)
