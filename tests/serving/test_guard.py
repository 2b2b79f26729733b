"""The API key: from a file or $MOESTREAM_API_KEY (a key on the command line warns), and required on every route
but /health, on a real server with the official openai client."""

from __future__ import annotations

import httpx2 as httpx
import openai
import pytest
from local_server import LocalServer

import moestream
from moestream.cli.main import main
from moestream.errors import MoestreamError
from moestream.serving.guard import ENV_KEY, api_key_of

KEY = "s3cret-key"


@pytest.fixture(scope="module")
def server(model_file):
    engine = moestream.load(model_file("tiny", "Q4_K_M"), device="cpu", progress=False, n_ctx=1024, ubatch=16)
    srv = LocalServer(engine, api_key=KEY)
    yield srv
    srv.stop()
    engine.close()


@pytest.mark.parametrize("path", ["/v1/models", "/metrics", "/docs", "/openapi.json", "/nowhere"])
def test_every_route_but_health_needs_the_key(server, path):
    base = server.url.removesuffix("/v1")
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}, {"Authorization": f"Bearer {KEY}x"}):
        r = httpx.get(base + path, headers=headers)
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error", (headers, r.text)
    assert httpx.get(base + path, headers={"Authorization": f"Bearer {KEY}"}).status_code != 401
    assert httpx.get(base + path, headers={"X-Api-Key": KEY}).status_code != 401  # llama-server's other header
    for headers in ({"Authorization": f"bearer {KEY}"}, {"X-Api-Key": "wrong", "Authorization": f"Bearer {KEY}"}):
        assert httpx.get(base + path, headers=headers).status_code != 401, headers  # the scheme in any case; either
    assert httpx.get(base + "/health").json() == {"status": "ok"}
    assert httpx.head(base + "/health").status_code == 200  # a load balancer's probe may be a HEAD


def test_the_openai_client_with_and_without_the_key(server):
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url, api_key="wrong", max_retries=0).models.list()
    good = openai.OpenAI(base_url=server.url, api_key=KEY, max_retries=0, timeout=60)
    assert good.completions.create(model="tiny", prompt="hi", max_tokens=2).choices[0].finish_reason == "length"


def test_where_the_key_comes_from(tmp_path):
    f = tmp_path / "key"
    f.write_text(KEY + "\nignored\n")
    assert api_key_of(None, str(f), {ENV_KEY: "env"}) == KEY  # a file or a flag wins over the environment
    assert api_key_of(None, None, {ENV_KEY: "env"}) == "env"
    assert api_key_of(None, None, {}) is None
    with pytest.warns(UserWarning, match="visible to every user"):
        assert api_key_of(KEY, None, {}) == KEY
    with pytest.raises(MoestreamError, match="give the key once"):
        api_key_of(KEY, str(f), {})
    f.write_text("  \n")
    with pytest.raises(MoestreamError, match="is empty"):
        api_key_of(None, str(f), {})
    with pytest.raises(MoestreamError, match="is empty"):
        api_key_of(None, None, {ENV_KEY: ""})
    with pytest.raises(MoestreamError, match="No such file"):
        api_key_of(None, str(tmp_path / "none"), {})


def test_an_app_is_not_made_with_an_empty_key(server):
    """Compared with a missing header's empty bytes, an empty key would let every request in."""
    from moestream.serving.app import create_app

    with pytest.raises(MoestreamError, match="API key is empty"):
        create_app(server.scheduler, "tiny", api_key=" ")


def test_serve_says_a_bad_key_file_in_one_line(tmp_path, capsys, model_file):
    path = model_file("tiny", "Q4_K_M")
    assert main(["serve", "-m", path, "--device", "cpu", "--api-key-file", str(tmp_path / "none")]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].startswith("moestream: error: --api-key-file")
