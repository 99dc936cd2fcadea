"""A loopback S3 for tests: moto in server mode on 127.0.0.1 (a real HTTP server in this test
process); ranks reach it through s3fs like any object store."""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator

CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing"}


@contextlib.contextmanager
def environ(**values: str) -> Iterator[None]:
    """``os.environ`` with ``values`` set (ranks started meanwhile inherit them), restored."""
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@contextlib.contextmanager
def moto_s3(*buckets: str, default_endpoint: bool = False) -> Iterator[tuple[str, dict]]:
    """A moto S3 server with ``buckets`` made; yields ``(endpoint_url, storage_options)``.

    The test credentials are in the environment while it runs. ``default_endpoint``: it is
    also fsspec's default S3 endpoint (``FSSPEC_S3_ENDPOINT_URL`` for the ranks, fsspec's
    config in this process), for code that is given no storage options."""
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one line per request otherwise
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    env = dict(CREDENTIALS, **({"FSSPEC_S3_ENDPOINT_URL": endpoint} if default_endpoint else {}))
    opts = {"endpoint_url": endpoint, "key": "testing", "secret": "testing"}
    try:
        with environ(**env):
            import fsspec.config
            import s3fs

            if default_endpoint:
                fsspec.config.conf.setdefault("s3", {})["endpoint_url"] = endpoint
                s3fs.S3FileSystem.clear_instance_cache()
            fs = s3fs.S3FileSystem(**opts)
            for bucket in buckets:
                fs.mkdir(bucket)
            try:
                yield endpoint, opts
            finally:
                if default_endpoint:
                    fsspec.config.conf.get("s3", {}).pop("endpoint_url", None)
    finally:
        server.stop()
