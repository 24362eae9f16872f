"""longppl's public API: ``__all__`` is small on purpose, and the rest stays importable."""

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


def test_names_left_out_of_all_stay_importable_as_before():
    for module_name, names in longppl._EXPORTS.items():
        module = importlib.import_module(f"longppl.{module_name}")
        for name in names:
            assert getattr(longppl, name) is getattr(module, name), f"longppl.{name}"
    from longppl import DocumentResult, ModelIdentity, Segment, key_token_mask  # noqa: F401  (not in __all__)

    assert "key_token_mask" not in longppl.__all__ and "key_token_mask" in dir(longppl)
    assert longppl.scoring.summarize_results is longppl.summarize_results


def test_an_unknown_name_is_an_attribute_error():
    with pytest.raises(AttributeError, match="module 'longppl' has no attribute 'no_such_name'"):
        _ = longppl.no_such_name
