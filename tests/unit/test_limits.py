"""The per-request limit check the routes share: a 400 that names the field, the limit and its setting."""

from __future__ import annotations

import pytest

from app.api.inputs import check_limit
from app.errors import InvalidRequestError


def test_within_the_limit_passes():
    check_limit(16, 16, "max_tokens", "max_generated_tokens")
    check_limit(None, 16, "max_tokens", "max_generated_tokens")


def test_over_the_limit_is_a_400_naming_field_limit_and_setting():
    with pytest.raises(InvalidRequestError) as refused:
        check_limit(4097, 4096, "max_tokens", "max_generated_tokens")
    assert refused.value.status_code == 400 and refused.value.param == "max_tokens"
    assert "4096" in refused.value.message and "max_generated_tokens" in refused.value.message
