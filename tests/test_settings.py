"""The one validation of LongPPL's settings (longppl.settings), shared by every entry point."""

import dataclasses
import math

import pytest

import longppl.cache.key_token_cache as key_token_cache
import longppl.core.scoring as scoring
from longppl.settings import KeyTokenRule, KeyTokenSettings, WindowSettings, check_token_ids, settings_object


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
        (lambda: KeyTokenSettings(64, 16, window_bos="no"), "window_bos must be True or False, got 'no'"),
        (lambda: KeyTokenSettings(add_special_tokens=None), "add_special_tokens must be True or False, got None"),
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


def test_the_space_ui_takes_its_defaults_from_the_metric_options(monkeypatch):
    """app.py writes no default of its own: changing one in the metric's options (whose defaults are
    the settings', tests/test_metric_card.py) changes the UI's."""
    pytest.importorskip("gradio", reason="the Space's tests need gradio: pip install -e '.[space]'")
    from longppl.metric import options
    from longppl.space import app

    assert app._options is options
    declared = options.LongPPLOptions.__dataclass_fields__
    for name, value in [("trunc_len", 640), ("sliding_window", 96), ("alpha", 1.5), ("beta", -3.5)]:
        if declared[name].metadata["shown"] is None:
            monkeypatch.setattr(declared[name], "default", value)
        else:  # K and d default to None ("not passed") and show the settings' default
            monkeypatch.setattr(declared[name], "metadata", {**declared[name].metadata, "shown": value})
    (handler,) = [fn for fn in app.build_demo(app.SpaceSettings()).fns.values() if fn.fn is app.score]
    defaults = {block.label: block.value for block in handler.inputs}
    assert (defaults["K (short-context length)"], defaults["d (sliding window)"]) == (640, 96)
    assert (defaults["alpha (LSD threshold)"], defaults["beta (LCL threshold)"]) == (1.5, -3.5)


def test_key_token_settings_are_window_settings_defined_once():
    settings = KeyTokenSettings(64, 16, add_special_tokens=False)
    assert isinstance(settings, WindowSettings) and settings.window == WindowSettings(64, 16)
    assert key_token_cache.KeyTokenSettings is KeyTokenSettings  # the old import keeps working
    assert settings.describe() == "trunc_len=64, sliding_window=16, add_special_tokens=False, window_bos=False"


def test_settings_object_takes_the_object_or_its_values_not_both():
    window = WindowSettings(64, 16)
    assert settings_object(WindowSettings, window, trunc_len=None, sliding_window=None) is window
    assert settings_object(WindowSettings, None, trunc_len=None, sliding_window=8) == WindowSettings(4096, 8)
    with pytest.raises(ValueError, match="Got both a WindowSettings and sliding_window, trunc_len: pass the settings"):
        settings_object(WindowSettings, window, trunc_len=64, sliding_window=16)
    with pytest.raises(ValueError, match=r"settings must be a KeyTokenSettings, got WindowSettings\(trunc_len=64"):
        settings_object(KeyTokenSettings, window)


def test_score_with_evaluator_refuses_bad_or_doubled_settings_before_any_model_runs():
    """The public scoring function is an edge with one signature: its settings object, checked when
    built; numbers in its place are refused before any model runs."""
    with pytest.raises(ValueError, match="trunc_len must be an integer >= 1, got 0"):
        scoring.score_with_evaluator(None, None, ["a text"], KeyTokenSettings(0, 8))
    with pytest.raises(ValueError, match="window_bos must be True or False, got 'yes'"):
        scoring.score_with_evaluator(None, None, ["a text"], KeyTokenSettings(window_bos="yes"))
    with pytest.raises(ValueError, match="settings must be a KeyTokenSettings, got 64; build one"):
        scoring.score_with_evaluator(None, None, ["a text"], 64)
    with pytest.raises(TypeError, match="trunc_len"):
        scoring.score_with_evaluator(None, None, ["a text"], trunc_len=64, settings=KeyTokenSettings(64, 16))
