"""Token helpers: random, prefixed, stored only as a SHA-256 digest, compared in constant time."""

from __future__ import annotations

import hashlib

from flywheel.core.auth import OPS_TOKEN_PREFIX, WRITE_KEY_PREFIX, bearer_token, hash_token, new_token, verify


def test_new_token_has_prefix_random_body_and_matching_hash():
    token, digest, display = new_token(WRITE_KEY_PREFIX)
    assert token.startswith("fwk_") and len(token) == 4 + 32
    assert all(c.isalnum() or c in "-_" for c in token[4:])
    assert digest == hashlib.sha256(token.encode()).hexdigest() == hash_token(token)
    assert display == token[:12] and len(display) <= 16  # fits api_keys.token_prefix
    assert token not in digest


def test_tokens_are_unique():
    assert len({new_token(OPS_TOKEN_PREFIX)[0] for _ in range(1000)}) == 1000


def test_verify_accepts_only_the_token_itself():
    token, digest, _ = new_token()
    assert verify(token, digest)
    assert not verify(token + "x", digest)
    assert not verify(token[:-1], digest)
    assert not verify(token, "0" * 64)


def test_bearer_header_parsing():
    assert bearer_token("Bearer fwk_abc") == "fwk_abc"
    assert bearer_token("bearer   fwk_abc  ") == "fwk_abc"
    for bad in (None, "", "Basic abc", "Bearer", "Bearer ", "Bearer a b", "fwk_abc"):
        assert bearer_token(bad) is None
