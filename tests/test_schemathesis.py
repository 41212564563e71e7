"""Property-based API fuzzing with schemathesis against a live server: no input yields a 5xx.

Runs on a tiny random model with the real Qwen3 tokenizer and a small context, so every generated
request (valid or not) is answered quickly; the HTTP layer under test is the production one.
"""

from __future__ import annotations

import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.checks import not_a_server_error
from serverutil import ServerProc

MAX_EXAMPLES = 25


@pytest.fixture(scope="module")
def live(tiny_synth_dir, tmp_path_factory):
    work = tmp_path_factory.mktemp("srv-schemathesis")
    srv = ServerProc(work / "home", work, "--model", str(tiny_synth_dir), "--max-seq", "64",
                     "--queue-size", "4", "--max-body-bytes", "65536").start()
    yield srv
    assert srv.stop() == 0


def _openapi() -> dict:
    """The app's OpenAPI document, built without loading a model (that happens at start-up)."""
    from edge_llm.server.app import create_app
    from edge_llm.settings import load_settings

    return create_app(load_settings({"log_file": "", "disk_kv": "off"}, env={})).openapi()


# schemathesis' lazy from_fixture() does not work with this pytest; the document is static anyway
schema = schemathesis.openapi.from_dict(_openapi())


@schema.parametrize()
@settings(max_examples=MAX_EXAMPLES, deadline=None, derandomize=True,
          suppress_health_check=list(HealthCheck))
def test_no_server_errors(case, live):
    response = case.call(base_url=live.url, timeout=300)
    assert response.status_code < 500 or response.status_code == 503, (
        f"{case.method} {case.path} -> {response.status_code}: {response.text[:500]}")
    if response.status_code == 503:  # only the documented "busy/loading" 503s are allowed
        assert response.headers.get("Retry-After") and "error" in response.json()
    case.validate_response(response, checks=[not_a_server_error]) if response.status_code != 503 else None
    if response.status_code == 200 and case.path in ("/v1/completions", "/v1/chat/completions"):
        body = response.json() if "json" in response.headers.get("content-type", "") else None
        if body is not None:
            assert body["timings"]["prefill_tokens"] >= 1 and "prompt_tokens_details" in body["usage"]
