"""The Java key store of the system's certificate authorities, which a Java runtime from PyPI is given."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from es_pipeline.lake.spark.java import jks_of


def test_a_pem_bundle_becomes_a_key_store_that_keytool_reads_and_verifies(tmp_path: Path) -> None:
    keytool = shutil.which("keytool")
    if keytool is None:
        pytest.skip("no keytool on this machine")
    pems = []
    for name in ("one", "two"):
        subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj",
                        f"/CN=es-pipeline {name}", "-keyout", str(tmp_path / f"{name}.key"),
                        "-out", str(tmp_path / f"{name}.crt")], check=True, capture_output=True)
        pems.append((tmp_path / f"{name}.crt").read_bytes())
    store = tmp_path / "cas.jks"
    store.write_bytes(jks_of(b"some text before\n" + b"\n".join(pems)))
    listed = subprocess.run([keytool, "-list", "-v", "-keystore", str(store), "-storepass", "changeit"],
                            capture_output=True, text=True, check=True).stdout  # a wrong digest fails here
    assert listed.count("trustedCertEntry") == 2
    assert "CN=es-pipeline one" in listed and "CN=es-pipeline two" in listed
