"""The packages' public API: ``longppl.__all__`` is small on purpose; everything else is imported from
its module, and neither package keeps names for older code."""

import importlib

import pytest

import longppl

MAX_PUBLIC_NAMES = 20  # what users call; internals belong in their modules, not in __all__


def test_all_is_small_and_every_name_resolves():
    public = longppl.__all__
    assert len(public) <= MAX_PUBLIC_NAMES, (
        f"longppl.__all__ lists {len(public)} names; keep it to what users call (internals stay importable "
        "from their modules)"
    )
    assert len(set(public)) == len(public), "a name is listed twice"
    for name in public:  # what `from longppl import *` looks up
        assert getattr(longppl, name) is not None, name
    assert {"compute_longppl", "KeyTokenCache", "WindowSettings", "KeyTokenRule"} <= set(public)


def test_the_package_exports_its_public_names_only():
    for name in longppl.__all__:
        value = getattr(longppl, name)
        if hasattr(value, "__module__"):  # a function or class: the one of its own module
            assert getattr(importlib.import_module(value.__module__), name) is value, f"longppl.{name}"
    # internals are imported from their modules (longppl.rules.key_tokens.key_token_mask, ...), not the package
    internals = ("key_token_mask", "ModelIdentity", "Segment", "DocumentResult", "encode_with_offsets", "Progress")
    assert not set(internals) & set(dir(longppl))
    for name in internals:
        with pytest.raises(AttributeError, match=f"module 'longppl' has no attribute '{name}'"):
            getattr(longppl, name)


def test_no_aliases_for_older_code():
    import longce
    import longppl.rules.key_tokens as key_tokens

    with pytest.raises(AttributeError, match="module 'longce' has no attribute 'LogitTransform'"):
        _ = longce.LogitTransform  # the scoring core's: longppl.core.logprobs.LogitTransform
    assert "LogitTransform" not in dir(longce)
    # the defaults are settings' (longppl.settings.DEFAULT_*), not re-exported by key_tokens
    assert not {"DEFAULT_ALPHA", "DEFAULT_BETA", "DEFAULT_GAMMA"} & set(dir(key_tokens))


def test_an_unknown_name_is_an_attribute_error():
    with pytest.raises(AttributeError, match="module 'longppl' has no attribute 'no_such_name'"):
        _ = longppl.no_such_name
