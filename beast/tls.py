"""TLS between PolyBeast's learners and env servers on other machines: flags and PEM files.

    python -m polybeast_env --address HOST:PORT --tls_cert server.pem --tls_key server.key \
        [--tls_client_ca ca.pem]
    python -m polybeast --server_addresses envhost:4000,... --tls_ca ca.pem \
        [--tls_cert learner.pem --tls_key learner.key]

The learner checks that each server's certificate is signed by --tls_ca and made out to the
host it dials (or to --tls_server_name); a server started with --tls_client_ca accepts only
learners whose certificate that CA signed. Without these flags the streams are plain gRPC, as
TorchBeast's servers and learners speak. The files are read here, so that a missing or wrong
one is reported by its flag; csrc/tls.h hands the PEM texts to gRPC.

`python -m beast.tls --out DIR --server_hosts HOST,...` makes a CA and these certificates for a
cluster that has none (make_ca, make_cert; the tests use them too).
"""

import argparse
import contextlib
import ipaddress
import os
import re
import subprocess
import sys

# What each kind of file must hold: a certificate ("CERTIFICATE"), or a private key in any of
# OpenSSL's forms ("PRIVATE KEY", "RSA PRIVATE KEY", "EC PRIVATE KEY").
PEM_BLOCKS = {"certificate": re.compile(r"-----BEGIN CERTIFICATE-----"),
              "key": re.compile(r"-----BEGIN ([A-Z]+ )?PRIVATE KEY-----")}
KEY_HELP = "The private key of --tls_cert (a PEM file, unencrypted)."


def add_server_flags(parser):
    group = parser.add_argument_group("TLS (servers reached over the network)")
    group.add_argument("--tls_cert", default=None,
                       help="Serve over TLS with this certificate (a PEM file, the chain if "
                            "any): learners then need --tls_ca, the CA that signed it, and "
                            "dial a host it names. Needs --tls_key.")
    group.add_argument("--tls_key", default=None,
                       help=KEY_HELP)
    group.add_argument("--tls_client_ca", default=None,
                       help="Accept only learners that show a certificate signed by this CA "
                            "(a PEM file; they give it with --tls_cert and --tls_key). Without "
                            "it, any client that trusts the server's certificate connects.")


def add_learner_flags(group):
    """The learner's TLS flags, added to `group` (an argument group, or a parser)."""
    group.add_argument("--tls_ca", default=None,
                       help="Talk TLS to the env servers of --server_addresses, checking that "
                            "their certificates are signed by this CA (a PEM file) and made out "
                            "to the host of each address (or --tls_server_name).")
    group.add_argument("--tls_cert", default=None,
                       help="This learner's certificate (a PEM file), for servers started with "
                            "--tls_client_ca. Needs --tls_key and --tls_ca.")
    group.add_argument("--tls_key", default=None,
                       help=KEY_HELP)
    group.add_argument("--tls_server_name", default=None,
                       help="The name the servers' certificates carry, when it is not the host "
                            "of their addresses (say, servers dialled by IP with a certificate "
                            "for their DNS name). Needs --tls_ca.")


def read_pem(flag, path, kind):
    """The text of a PEM file; ValueError naming the flag when it cannot be read or holds no
    PEM block of the kind ('certificate' or 'key')."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise ValueError(f"{flag}: cannot read {path} ({e.strerror}).") from None
    text = data.decode("ascii", errors="replace")
    if kind == "key" and ("ENCRYPTED PRIVATE KEY" in text or "Proc-Type: 4,ENCRYPTED" in text):
        raise ValueError(f"{flag}: {path} is an encrypted key; give it without a passphrase "
                         "(openssl pkey -in KEY -out PLAIN_KEY) and keep the file private.")
    if not PEM_BLOCKS[kind].search(text):
        first_line = PEM_BLOCKS[kind].pattern.replace("([A-Z]+ )?", "")
        raise ValueError(f"{flag}: {path} holds no PEM {kind} (a block that starts with "
                         f"{first_line}).")
    return text


def server_config(flags):
    """The tls dict of libpolybeast.EnvServer from polybeast_env's flags, or None without TLS.
    ValueError says which flag to change."""
    if flags.tls_cert is None and flags.tls_key is None:
        if flags.tls_client_ca is not None:
            raise ValueError("--tls_client_ca needs --tls_cert and --tls_key: clients are "
                             "checked over TLS, which the server's own certificate sets up.")
        return None
    if flags.tls_cert is None or flags.tls_key is None:
        raise ValueError("--tls_cert and --tls_key go together (the server's certificate and "
                         "its private key).")
    config = {"cert_chain": read_pem("--tls_cert", flags.tls_cert, "certificate"),
              "private_key": read_pem("--tls_key", flags.tls_key, "key")}
    if flags.tls_client_ca is not None:
        config["root_certs"] = read_pem("--tls_client_ca", flags.tls_client_ca, "certificate")
    return config


def learner_config(flags):
    """The tls dict of libpolybeast.ActorPool from polybeast's flags, or None without TLS.
    ValueError says which flag to change."""
    if flags.tls_ca is None:
        given = [f"--{name}" for name in ("tls_cert", "tls_key", "tls_server_name")
                 if getattr(flags, name) is not None]
        if given:
            raise ValueError(f"{', '.join(given)} need --tls_ca, the CA that signed the env "
                             "servers' certificates.")
        return None
    if (flags.tls_cert is None) != (flags.tls_key is None):
        raise ValueError("--tls_cert and --tls_key go together (this learner's certificate "
                         "and its private key).")
    config = {"root_certs": read_pem("--tls_ca", flags.tls_ca, "certificate")}
    if flags.tls_cert is not None:
        config["cert_chain"] = read_pem("--tls_cert", flags.tls_cert, "certificate")
        config["private_key"] = read_pem("--tls_key", flags.tls_key, "key")
    if flags.tls_server_name is not None:
        config["target_name"] = flags.tls_server_name
    return config


# ----------------------------------------------------------------------------
# Certificates for a cluster without a CA of its own (python -m beast.tls).

def _openssl(directory, *args):
    try:
        # umask 077: a key is private from the moment openssl creates it, not after a chmod.
        subprocess.run(["openssl", *args], cwd=directory, check=True, capture_output=True,
                       text=True, umask=0o077)
    except FileNotFoundError:
        raise RuntimeError("the openssl command is not installed (Debian: apt-get install "
                           "openssl).") from None
    except subprocess.CalledProcessError as e:
        raise RuntimeError(f"openssl {' '.join(args[:2])} failed: {e.stderr.strip()}") from None


def make_ca(directory, name="ca", days=365):
    """directory/name.pem (the CA's certificate, to give every side) and name.key (its key,
    to keep private: who has it can make certificates that the servers and learners trust)."""
    _openssl(directory, "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", str(days),
             "-subj", f"/CN=polybeast {name}", "-keyout", f"{name}.key", "-out", f"{name}.pem")


def make_cert(directory, name, ca="ca", hosts=(), days=365):
    """directory/name.pem and name.key, signed by the CA directory/ca.*. hosts: the names and IP
    addresses the certificate is made out to (a server's: what the learners dial)."""
    _openssl(directory, "req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN={name}",
             "-keyout", f"{name}.key", "-out", f"{name}.csr")
    extra = []
    if hosts:
        names = ",".join(f"IP:{h}" if _is_ip(h) else f"DNS:{h}" for h in hosts)
        with open(os.path.join(directory, f"{name}.ext"), "w") as f:
            f.write(f"subjectAltName={names}\n")
        extra = ["-extfile", f"{name}.ext"]
    _openssl(directory, "x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}.pem",
             "-CAkey", f"{ca}.key", "-CAcreateserial", "-days", str(days),
             "-out", f"{name}.pem", *extra)
    for leftover in (f"{name}.csr", f"{name}.ext", f"{ca}.srl"):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(directory, leftover))


def _is_ip(host):
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def main(argv=None):
    parser = argparse.ArgumentParser(
        prog="python -m beast.tls",
        description="Makes a CA and the certificates for TLS between PolyBeast's learners and "
                    "env servers on other machines, with the openssl command: DIR/ca.pem (every "
                    "side gets it), DIR/server.pem and .key (the env servers'), DIR/learner.pem "
                    "and .key (the learners', for servers started with --tls_client_ca). Keep "
                    "DIR/ca.key private; copy the rest where each side runs.")
    parser.add_argument("--out", required=True, help="Directory to write to (created).")
    parser.add_argument("--server_hosts", required=True,
                        help="Comma-separated host names and IP addresses of the env servers, "
                             "as the learners dial them in --server_addresses.")
    parser.add_argument("--days", type=int, default=365, help="How long the certificates hold.")
    options = parser.parse_args(argv)
    hosts = [h.strip() for h in options.server_hosts.split(",") if h.strip()]
    if not hosts:
        parser.error("--server_hosts names no host.")
    os.makedirs(options.out, exist_ok=True)
    if os.path.exists(os.path.join(options.out, "ca.key")):
        parser.error(f"{options.out} already has a CA (ca.key); give another --out, or remove "
                     "it to start over (certificates it signed stop being trusted).")
    try:
        make_ca(options.out, days=options.days)
        make_cert(options.out, "server", hosts=hosts, days=options.days)
        make_cert(options.out, "learner", days=options.days)
    except RuntimeError as e:
        sys.exit(f"beast.tls: {e}")
    out = options.out
    print(f"Env servers: python -m polybeast_env --address HOST:PORT --tls_cert {out}/server.pem "
          f"--tls_key {out}/server.key --tls_client_ca {out}/ca.pem ...\n"
          f"Learners:    python -m polybeast --server_addresses ... --tls_ca {out}/ca.pem "
          f"--tls_cert {out}/learner.pem --tls_key {out}/learner.key ...")
    return 0


if __name__ == "__main__":
    sys.exit(main())
