"""CacheLayout: the one source of window/page/group defaults."""

import pytest

from runtime_kernels.layout import DEFAULT_LAYOUT, CacheLayout


def test_default_layout_is_the_papers():
    assert (DEFAULT_LAYOUT.sink_tokens, DEFAULT_LAYOUT.recent_tokens) == (64, 256)
    assert DEFAULT_LAYOUT.window_tokens == 320


@pytest.mark.parametrize("field,value", [("sink_tokens", -1), ("recent_tokens", -5), ("recent_tokens", 10 ** 14),
                                         ("sink_tokens", (1 << 20) + 1), ("page_size", 0),
                                         ("group_size", 6), ("group_size", 0)])
def test_layout_refuses_bad_values_naming_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        CacheLayout(**{field: value})


def test_with_ignores_none_and_keeps_frozen():
    lay = DEFAULT_LAYOUT.with_(sink_tokens=128, recent_tokens=None)
    assert (lay.sink_tokens, lay.recent_tokens) == (128, 256)
    with pytest.raises(AttributeError):
        lay.sink_tokens = 1  # type: ignore[misc]
