"""Library noise off the consumer's terminal (issue 20): torchft's flight-recorder warning
on gloo and http.server's access line of the heal transport are dropped; other warnings
and failed-request lines still come through. Real torchft server class, real requests."""

from __future__ import annotations

import logging
import threading
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler

from dflash.consumers.process.quiet import quiet_library_noise
import pytest

pytestmark = pytest.mark.integration


class _Handler(BaseHTTPRequestHandler):
    def do_GET(self):
        if self.path == "/missing":
            self.send_error(404, "no such checkpoint")
            return
        self.send_response(200)
        self.end_headers()
        self.wfile.write(b"ok")


def test_access_lines_go_errors_stay(capfd):
    quiet_library_noise()
    quiet_library_noise()  # idempotent
    import torchft.http as http

    server = http._IPv6HTTPServer(("::1", 0), _Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        port = server.server_address[1]
        assert urllib.request.urlopen(f"http://[::1]:{port}/checkpoint/0/full", timeout=5).read() == b"ok"
        try:
            urllib.request.urlopen(f"http://[::1]:{port}/missing", timeout=5)
        except urllib.error.HTTPError as e:
            assert e.code == 404
    finally:
        server.shutdown()
        server.server_close()
    err = capfd.readouterr().err
    assert "GET /checkpoint/0/full" not in err
    assert "no such checkpoint" in err  # a failed request is still said


def test_the_flight_recorder_warning_goes_other_warnings_stay(caplog):
    quiet_library_noise()
    log = logging.getLogger("torchft.manager")
    with caplog.at_level(logging.WARNING, logger="torchft.manager"):
        log.warning("[r0/0 - step 0] Unable to reset NCCL flight recorder recording so traces will be incorrect.")
        log.warning("[r0/0 - step 3] got exception in pg configure: boom")
    msgs = [r.getMessage() for r in caplog.records]
    assert msgs == ["[r0/0 - step 3] got exception in pg configure: boom"]
