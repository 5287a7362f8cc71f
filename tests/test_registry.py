import pytest

from gjax.registry import Registry


def test_register_get_and_strictness():
    reg = Registry("widget")

    @reg.register("a")
    def a():
        return 1

    assert reg.get("a") is a
    assert "a" in reg and reg.names() == ["a"]
    with pytest.raises(ValueError, match="already registered"):
        reg.add("a", a)
    with pytest.raises(KeyError, match=r"unknown widget 'b'; valid names: a"):
        reg.get("b")
    with pytest.raises(ValueError, match="non-empty"):
        reg.add("", a)
