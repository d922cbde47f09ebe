"""yrpd/credentials.py: a session's secrets on the controller."""

import stat

import pytest

from yrpd import credentials


def mode(path):
    return stat.S_IMODE(path.stat().st_mode)


def test_secrets_are_private_made_once_and_removed(tmp_path):
    d = credentials.ensure(tmp_path, proxy_key="client-key")
    token = credentials.instance_token(tmp_path)
    assert mode(d) == 0o700 and len(token) >= 40
    assert {p.name: mode(p) for p in d.iterdir()} == {"instance.token": 0o600, "instance.env": 0o600,
                                                     "proxy.env": 0o600, "datasystem.env": 0o600, "curve": 0o700,
                                                     "etcd": 0o700, "kv-relay": 0o700, "kv-relay.env": 0o600}
    relay = d / "kv-relay"
    keys = {p.name: p.read_text() for p in relay.iterdir()}
    assert {p.name: mode(p) for p in relay.iterdir()} == dict.fromkeys(keys, 0o600)
    assert (d / "kv-relay.env").read_text() == (f"YRPD_KV_RELAY_SECRET={keys['relay.key_secret']}\n"
                                                f"YRPD_KV_RELAY_PUBLIC={keys['relay.key']}\n"
                                                f"YRPD_KV_PROXY_PUBLIC={keys['proxy.key']}\n")
    relay_part = (f"YRPD_KV_RELAY_PUBLIC={keys['relay.key']}\nYRPD_KV_PROXY_PUBLIC={keys['proxy.key']}\n"
                  f"YRPD_KV_PROXY_SECRET={keys['proxy.key_secret']}\n")
    curve = d / "curve"
    assert {str(p.relative_to(curve)): mode(p) for p in curve.rglob("*")} == {
        "worker.key": 0o600, "worker.key_secret": 0o600, "client.key_secret": 0o600,
        "worker_authorized_clients": 0o700, "worker_authorized_clients/worker.key": 0o600,
        "worker_authorized_clients/client.key": 0o600}
    worker, client = (curve / "worker.key").read_text(), (curve / "worker_authorized_clients/client.key").read_text()
    assert len(worker) == 40 and worker != client  # Z85 of 32 bytes
    ds = f"DATASYSTEM_CLIENT_PUBLIC_KEY={client}\nDATASYSTEM_CLIENT_PRIVATE_KEY=" \
         f"{(curve / 'client.key_secret').read_text()}\nDATASYSTEM_SERVER_PUBLIC_KEY={worker}\n"
    assert (d / "datasystem.env").read_text() == ds
    assert (d / "instance.env").read_text() == f"VLLM_API_KEY={token}\n" + ds
    assert (d / "proxy.env").read_text() == f"YRPD_INSTANCE_TOKEN={token}\nYRPD_API_KEY=client-key\n" + relay_part
    # a re-deploy (resume) keeps the token the running instances hold, and takes a changed proxy key
    credentials.ensure(tmp_path, proxy_key=None)
    assert credentials.instance_token(tmp_path) == token and (curve / "worker.key").read_text() == worker
    assert (d / "proxy.env").read_text() == f"YRPD_INSTANCE_TOKEN={token}\n" + relay_part  # the relay keys kept
    (tmp_path / "other").mkdir()
    assert credentials.ensure(tmp_path / "other", None) and credentials.instance_token(tmp_path / "other") != token
    credentials.remove(tmp_path)
    assert not d.exists() and credentials.instance_token(tmp_path) is None


def test_a_key_spanning_lines_is_refused_rather_than_cut(tmp_path):
    with pytest.raises(ValueError, match="YRPD_API_KEY: a secret cannot span lines"):
        credentials.ensure(tmp_path, proxy_key="a\nVLLM_API_KEY=mine")


def test_z85_is_zeromqs_text_form_of_keys():
    # the specification's own example (ZeroMQ RFC 32)
    assert credentials.z85(bytes([0x86, 0x4F, 0xD2, 0x6F, 0xB5, 0x59, 0xF7, 0x5B])) == "HelloWorld"
    with pytest.raises(ValueError):
        credentials.z85(b"abc")


def test_etcds_certificates_chain_to_the_sessions_ca_and_name_its_address(tmp_path):
    from cryptography import x509
    from cryptography.x509.oid import ExtendedKeyUsageOID

    d = credentials.ensure(tmp_path, None, etcd_ips=["10.0.0.1"]) / "etcd"
    assert {p.name: mode(p) for p in d.iterdir()} == {n: 0o600 for n in (
        "ca.crt", "server.crt", "server.key", "client.crt", "client.key")}  # the CA's key is not kept
    ca, server, client = (x509.load_pem_x509_certificate((d / f"{n}.crt").read_bytes()) for n in ("ca", "server", "client"))
    for cert in (server, client):
        cert.verify_directly_issued_by(ca)
    ips = {str(ip) for ip in server.extensions.get_extension_for_class(x509.SubjectAlternativeName).value.get_values_for_type(x509.IPAddress)}
    assert ips == {"10.0.0.1", "127.0.0.1"}
    assert list(client.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value) == [ExtendedKeyUsageOID.CLIENT_AUTH]
