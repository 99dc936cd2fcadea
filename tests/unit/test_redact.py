"""A tracking URI's password is never shown, and the health probe authenticates as MLflow's
client would (the end to end tests against a real server: ``tests/reliability/
test_tracking_outages.py::test_credentials_in_the_uri_are_used_and_never_shown`` and
``::test_a_server_behind_basic_auth_tracks_the_call``)."""

from __future__ import annotations

import base64
import os

import pytest

from gangrun.tracking.bounded import health_request
from gangrun.tracking.plan import run_link
from gangrun.wire.security import credentials, redact

SECRET = "s3cret"


@pytest.mark.parametrize(
    ("text", "shown"),
    [
        (f"http://alice:{SECRET}@127.0.0.1:5000", "http://alice:***@127.0.0.1:5000"),
        (f"https://alice:{SECRET}@h/x?y=1", "https://alice:***@h/x?y=1"),
        (f"error at http://bob:p@{SECRET}@h:1/api: refused", "error at http://bob:***@h:1/api"),
        (f"https://{SECRET}@github.com/x", "https://***@github.com/x"),
        (f"postgresql://u:{SECRET}%40x@db/mlflow", "postgresql://u:***@db/mlflow"),
        ("sqlite:////tmp/a@b/mlflow.db", "sqlite:////tmp/a@b/mlflow.db"),
        ("http://127.0.0.1:5000/path@x", "http://127.0.0.1:5000/path@x"),
        ("databricks", "databricks"),
    ],
)
def test_redact_hides_every_password(text, shown):
    assert redact(text).startswith(shown) and SECRET not in redact(text)


def test_credentials_are_split_off_the_uri():
    assert credentials(f"http://alice:{SECRET}%40@h:5000/p") == (
        "http://h:5000/p",
        "alice",
        SECRET + "@",
    )
    assert credentials("http://tok@h") == ("http://h", "tok", None)
    assert credentials("http://h:5000") == ("http://h:5000", None, None)


def _auth(req) -> str | None:
    return req.get_header("Authorization")


def test_the_probe_authenticates_as_mlflow_would(monkeypatch):
    for var in ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD", "MLFLOW_TRACKING_TOKEN"):
        monkeypatch.delenv(var, raising=False)
    req = health_request(f"http://alice:{SECRET}@127.0.0.1:5000/")
    assert req.full_url == "http://127.0.0.1:5000/health"  # the host is the host
    assert _auth(req) == "Basic " + base64.b64encode(f"alice:{SECRET}".encode()).decode()
    assert _auth(health_request("http://127.0.0.1:5000")) is None
    monkeypatch.setenv("MLFLOW_TRACKING_TOKEN", "tok")
    assert _auth(health_request("http://127.0.0.1:5000")) == "Bearer tok"
    monkeypatch.setenv("MLFLOW_TRACKING_USERNAME", "bob")
    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", "pw")
    assert (
        _auth(health_request("http://127.0.0.1:5000"))
        == "Basic " + base64.b64encode(b"bob:pw").decode()
    )


def test_ranks_get_the_credentials_in_mlflows_variables_and_the_link_is_redacted(monkeypatch):
    from gangrun.tracking.caller import Tracker, _no_url_printed

    for var in ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD", "MLFLOW_TRACKING_TOKEN"):
        monkeypatch.delenv(var, raising=False)
    uri = f"http://alice:{SECRET}@127.0.0.1:5000"
    env = Tracker(None, "r1", "0", uri).rank_env()
    assert env["MLFLOW_TRACKING_URI"] == "http://127.0.0.1:5000"
    assert (env["MLFLOW_TRACKING_USERNAME"], env["MLFLOW_TRACKING_PASSWORD"]) == ("alice", SECRET)
    link = run_link(uri, "0", "r1")
    assert "http://alice:***@127.0.0.1:5000/#/experiments/0/runs/r1" in link
    var = "MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT"
    monkeypatch.delenv(var, raising=False)
    with _no_url_printed(uri):
        with _no_url_printed(uri):  # two calls ending at once
            assert os.environ[var] == "true"
        assert os.environ[var] == "true"
    assert var not in os.environ  # restored by the last one
    with _no_url_printed("http://127.0.0.1:5000"):  # no password: MLflow prints as it likes
        assert var not in os.environ
