"""A real OpenID provider for the sign-in tests: `oidc-provider` from npm (installed once,
pinned, into .cache/npm-oidc), started on a free port with tests/helpers/oidc_provider.mjs,
signing with an RSA key the test holds too (so a test can sign an expired token with the
provider's own key)."""

from __future__ import annotations

import json
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from .http import free_port, http
from .paths import REPO

OIDC_PROVIDER_VERSION = "8.8.1"
PREFIX = REPO / ".cache" / "npm-oidc"
STAMP = PREFIX / f".installed-{OIDC_PROVIDER_VERSION}"
SCRIPT = Path(__file__).with_name("oidc_provider.mjs")


def install_oidc_provider() -> str | None:
    """None when oidc-provider is ready, else why it cannot be (the tests skip with it)."""
    if STAMP.exists():
        return None
    if shutil.which("npm") is None or shutil.which("node") is None:
        return "node and npm are needed to run the test's OpenID provider (oidc-provider from npm)"
    PREFIX.mkdir(parents=True, exist_ok=True)
    out = subprocess.run(
        [
            "npm",
            "install",
            "--prefix",
            str(PREFIX),
            "--no-audit",
            "--no-fund",
            "--loglevel=error",
            f"oidc-provider@{OIDC_PROVIDER_VERSION}",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    if out.returncode != 0:
        return f"npm could not install oidc-provider@{OIDC_PROVIDER_VERSION}: {out.stderr.strip()[-500:]}"
    STAMP.touch()
    return None


def rsa_jwk(kid: str) -> tuple[object, dict]:
    """(the private key, its private JWK for the provider)."""
    from cryptography.hazmat.primitives.asymmetric import rsa
    from jwt.algorithms import RSAAlgorithm

    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    jwk = json.loads(RSAAlgorithm.to_jwk(key))
    jwk.pop("key_ops", None)  # ["sign"] only: the provider also looks the key up to verify with it
    return key, {**jwk, "kid": kid, "alg": "RS256", "use": "sig"}


@dataclass
class OidcProvider:
    proc: subprocess.Popen
    issuer: str
    key: object  # the RSA private key it signs with
    kid: str
    log_path: Path

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def start_oidc_provider(tmp: Path, port: int, settings: dict) -> OidcProvider:
    """oidc-provider on `port` with the clients, accounts and audience in `settings`."""
    key, jwk = rsa_jwk("test-key-1")
    config = tmp / "oidc-config.json"
    config.write_text(json.dumps({**settings, "port": port, "jwk": jwk}))
    script = PREFIX / SCRIPT.name  # beside its node_modules: ES modules resolve from their own folder
    shutil.copyfile(SCRIPT, script)
    log_path = tmp / "oidc-provider.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(["node", str(script), str(config)], stdout=log, stderr=subprocess.STDOUT)
    issuer = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"oidc-provider exited:\n{log_path.read_text()}")
        try:
            if http(f"{issuer}/.well-known/openid-configuration", timeout=2)[0] == 200:
                return OidcProvider(proc, issuer, key, jwk["kid"], log_path)
        except OSError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise AssertionError(f"oidc-provider not ready:\n{log_path.read_text()}")


__all__ = ["OidcProvider", "free_port", "install_oidc_provider", "start_oidc_provider"]
