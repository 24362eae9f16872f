"""The one validation of LongPPL's settings (longppl.settings), shared by every entry point."""

import dataclasses
import math

import pytest

import longppl.key_token_cache as key_token_cache
import longppl.scoring as scoring
from longppl.settings import KeyTokenRule, WindowSettings, check_token_ids


def test_defaults_live_in_settings_and_old_names_still_import():
    assert (WindowSettings().trunc_len, WindowSettings().sliding_window) == (4096, 1024)
    rule = KeyTokenRule()
    assert (rule.alpha, rule.beta, rule.use_lcl, rule.soft, rule.gamma) == (2.0, -2.0, True, False, 5.0)
    assert (scoring.DEFAULT_TRUNC_LEN, scoring.DEFAULT_SLIDING_WINDOW, scoring.DEFAULT_MAX_TOKENS_PER_BATCH) == (
        4096,
        1024,
        32768,
    )
    with pytest.raises(dataclasses.FrozenInstanceError):
        rule.alpha = 3.0


def test_values_are_normalised():
    import numpy as np

    window = WindowSettings(np.int64(32), 8)
    assert type(window.trunc_len) is int and window.trunc_len == 32
    rule = KeyTokenRule(alpha=1, beta=np.float32(-3.0), use_lcl=np.bool_(False))
    assert type(rule.alpha) is float and rule.use_lcl is False and rule.beta == -3.0


@pytest.mark.parametrize(
    "build, message",
    [
        (lambda: WindowSettings(0, 8), "trunc_len must be an integer >= 1, got 0"),
        (lambda: WindowSettings(True, 8), "trunc_len must be an integer >= 1, got True"),
        (lambda: WindowSettings(32, 2.5), "sliding_window must be an integer >= 1, got 2.5"),
        (lambda: KeyTokenRule(alpha=math.nan), "alpha must be a finite number, got nan"),
        (lambda: KeyTokenRule(beta="-2"), "beta must be a finite number, got '-2'"),
        (lambda: KeyTokenRule(gamma=-1.0), r"gamma must be > 0 \(it caps the soft weights"),
        (lambda: KeyTokenRule(use_lcl="yes"), "use_lcl must be True or False, got 'yes'"),
        (lambda: key_token_cache.KeyTokenSettings(trunc_len=-5), "trunc_len must be an integer >= 1, got -5"),
    ],
)
def test_bad_settings_messages(build, message):
    with pytest.raises(ValueError, match=message):
        build()


def test_token_ids_outside_the_vocabulary():
    check_token_ids([0, 5, 99], 100, "model", "predictions[0]")
    check_token_ids([0, 500], None, "model", "predictions[0]")  # no embedding size known: not checked
    with pytest.raises(
        ValueError,
        match=r"The evaluator's tokenizer gives token id 100 for predictions\[3\], but "
        r"the evaluator has only 100 token embeddings \(ids 0\.\.99\)",
    ):
        check_token_ids([3, 100], 100, "evaluator", "predictions[3]")


def test_the_space_ui_takes_its_defaults_from_settings(monkeypatch):
    """app.py writes no default of its own: changing one in settings changes the UI's."""
    pytest.importorskip("gradio", reason="the Space's tests need gradio: pip install -e '.[space]'")
    from longppl import app
    from longppl import settings as settings_module

    assert app._settings is settings_module
    for name, value in [
        ("DEFAULT_TRUNC_LEN", 640),
        ("DEFAULT_SLIDING_WINDOW", 96),
        ("DEFAULT_ALPHA", 1.5),
        ("DEFAULT_BETA", -3.5),
    ]:
        monkeypatch.setattr(settings_module, name, value)
    (handler,) = [fn for fn in app.build_demo(app.SpaceSettings()).fns.values() if fn.fn is app.score]
    defaults = {block.label: block.value for block in handler.inputs}
    assert (defaults["K (short-context length)"], defaults["d (sliding window)"]) == (640, 96)
    assert (defaults["alpha (LSD threshold)"], defaults["beta (LCL threshold)"]) == (1.5, -3.5)
