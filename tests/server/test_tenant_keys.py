"""A static key's tenant comes from the key itself (or the TENANT= name given with it),
never from its position on the command line: before, `--api-key a --api-key b` made a
`tenant-0` and b `tenant-1`, so restarting with the keys swapped (or with one new key)
handed one tenant's runs to another key."""

from __future__ import annotations

import httpx
import pytest

from parrot_backend.server.auth import key_tenant, parse_api_keys

from .serve_process import Serve

PROGRAM = {
    "program": {
        "calls": [
            {
                "name": "c",
                "template": "Hi {{input:x}} {{output:y}}",
                "outputs": {"y": {"max_tokens": 2}},
            }
        ]
    },
    "inputs": {"x": "there"},
}


def test_parsed_keys_do_not_depend_on_order():
    one = parse_api_keys(["key-one", "key-two", "alice=k1", "alice=k2"])
    two = parse_api_keys(["alice=k2", "key-two", "alice=k1", "key-one"])
    assert one == two
    assert one["k1"] == one["k2"] == "alice"
    assert one["key-one"] == key_tenant("key-one") != one["key-two"]
    # a bare key with '=' in it stays a key when the text before '=' is no tenant name
    assert parse_api_keys(["ab+c=="]) == {"ab+c==": key_tenant("ab+c==")}


@pytest.mark.parametrize("values", [["bob=x", "carol=x"], [""], ["   "]])
def test_conflicting_or_empty_keys_are_refused(values):
    with pytest.raises(ValueError):
        parse_api_keys(values)


def _status(url: str, key: str, run_id: str) -> int:
    r = httpx.get(f"{url}/v1/runs/{run_id}", headers={"Authorization": f"Bearer {key}"}, timeout=10)
    return r.status_code


def test_restarts_with_reordered_renamed_and_new_keys_keep_tenants_apart(tiny_model_dir, tmp_path):
    lives = [
        ["--api-key", "key-one", "--api-key", "key-two", "--api-key", "alice=alice-old"],
        ["--api-key", "key-two", "--api-key", "key-one", "--api-key", "alice=alice-new"],
        ["--api-key", "key-three", "--api-key", "alice=alice-new"],
    ]
    serve = Serve(tiny_model_dir, tmp_path, None)
    base = list(serve.cmd)
    serve.cmd = base + lives[0]
    try:
        url = serve.start()
        runs = {}
        for key in ("key-one", "alice-old"):
            r = httpx.post(
                f"{url}/v1/runs",
                json=PROGRAM,
                timeout=30,
                headers={"Authorization": f"Bearer {key}"},
            )
            assert r.status_code == 201, r.text
            runs[key] = r.json()["run_id"]
        assert _status(url, "key-two", runs["key-one"]) == 404
        serve.stop()
        serve.cmd = base + lives[1]
        url = serve.start()
        assert _status(url, "key-one", runs["key-one"]) == 200
        assert _status(url, "key-two", runs["key-one"]) == 404
        assert _status(url, "alice-new", runs["alice-old"]) == 200  # a rotated key
        assert _status(url, "alice-new", runs["key-one"]) == 404
        serve.stop()
        serve.cmd = base + lives[2]
        url = serve.start()
        assert _status(url, "key-three", runs["key-one"]) == 404
        assert _status(url, "key-three", runs["alice-old"]) == 404
        assert _status(url, "alice-new", runs["alice-old"]) == 200
    finally:
        serve.stop()
