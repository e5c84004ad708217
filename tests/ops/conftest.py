"""The image tests (tests/ops/test_image.py) build and run the container: they run only when asked for by name."""

from __future__ import annotations


def pytest_collection_modifyitems(config, items):
    """Deselect `image` tests unless the -m expression names that marker (`make test-image`: -m image).

    A plain `make test` or `-m ops` must not start a build of many minutes; deselected tests are counted
    in pytest's summary, so they are not skipped silently.
    """
    if "image" in (config.getoption("markexpr") or ""):
        return
    kept, deselected = [], []
    for item in items:
        (deselected if item.get_closest_marker("image") else kept).append(item)
    if deselected:
        config.hook.pytest_deselected(items=deselected)
        items[:] = kept
