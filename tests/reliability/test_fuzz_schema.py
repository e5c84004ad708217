"""Schemathesis fuzzes every route of the OpenAPI schema against a live server on a tiny model: no 5xx, no
response that breaks the schema, invalid input rejected, all within a bounded number of examples."""

from __future__ import annotations

import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.checks import positive_data_acceptance

from app.main import create_app
from tests.api.conftest import tiny_settings
from tests.conftest import live_server

# Excluded check, positive_data_acceptance ("every schema-valid body gets a 2xx"): a static schema cannot say that a
# token id must be below this model's vocabulary size or that a prompt must tokenize to at least one token, so
# such bodies rightly get a 400. Every other check runs, including negative_data_rejection (schema-invalid bodies
# must get a 4xx), not_a_server_error and response_schema_conformance.
MAX_EXAMPLES = 60  # per route and generation mode; bounds the suite's time

# The schema depends on the settings only, not on the model, so it is read without loading one.
schema = schemathesis.openapi.from_dict(create_app(tiny_settings()).openapi())


@pytest.fixture(scope="module")
def base_url(tiny_loaded):
    with live_server(create_app(tiny_settings(), loaded=tiny_loaded)) as url:
        yield url


@schema.parametrize()
@settings(max_examples=MAX_EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
def test_every_route_survives_fuzzing(case, base_url):
    case.call_and_validate(base_url=base_url, timeout=30, excluded_checks=[positive_data_acceptance])
