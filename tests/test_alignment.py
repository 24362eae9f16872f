"""Character offsets (fast and decode fallback) and cross-tokenizer mapping on real documents."""

import numpy as np
import pytest
from helpers import SlowByteTokenizer, byte_level_bpe, govreport_texts, metaspace_bpe
from reference import official_overlap

from longppl.core.scoring import EvaluatorScores, ModelScores, text_key_weights
from longppl.rules.alignment import decode_offsets, encode_with_offsets, tokens_within_spans, transfer_token_weights
from longppl.rules.key_tokens import key_char_spans

MULTIBYTE = "Café déjà vu — naïve 北京 façade 🙂 end. Ünïcödé “quotes” ok"


def true_byte_spans(text):
    """Character span of every UTF-8 byte of ``text`` (what a one-byte-per-token tokenizer must get)."""
    spans = []
    for index, char in enumerate(text):
        spans += [[index, index + 1]] * len(char.encode("utf-8"))
    return spans


def test_slow_byte_tokenizer_offsets_on_multibyte_text():
    tok = SlowByteTokenizer()
    ids, offsets = encode_with_offsets(tok, MULTIBYTE, add_special_tokens=True)
    assert ids[0] == tok.bos_token_id and offsets[0].tolist() == [0, 0]
    assert offsets[1:].tolist() == true_byte_spans(MULTIBYTE)


def test_slow_tokenizer_on_real_report_slice():
    text = govreport_texts()[3][:2500] + " " + MULTIBYTE
    tok = SlowByteTokenizer()
    ids, offsets = encode_with_offsets(tok, text, add_special_tokens=False)
    assert offsets.tolist() == true_byte_spans(text)


@pytest.mark.parametrize("make", [byte_level_bpe, metaspace_bpe], ids=["byte-level", "metaspace"])
def test_decode_fallback_agrees_with_fast_offsets(make):
    """On tokenizers that have offsets, the decode fallback recovers the same character spans."""
    tok = make()
    text = govreport_texts()[5][:4000]
    ids, fast = encode_with_offsets(tok, text, add_special_tokens=True)
    slow = decode_offsets(tok, text, ids)
    content = fast[:, 1] > fast[:, 0]
    # Fast offsets may exclude a leading space that decoding attributes to the token; ends agree.
    assert (slow[content, 1] == fast[content, 1]).mean() > 0.99
    assert (slow[:, 0] <= fast[:, 0]).all()


def test_tokens_within_spans_matches_official_two_pointer():
    text = govreport_texts()[2][:6000]
    evaluator, model = byte_level_bpe(), metaspace_bpe()
    _, ev_offsets = encode_with_offsets(evaluator, text, add_special_tokens=True)
    _, model_offsets = encode_with_offsets(model, text, add_special_tokens=False)
    rng = np.random.default_rng(1)
    for density in (0.05, 0.3, 0.8):
        mask = rng.random(len(ev_offsets)) < density
        mask[:50] = False
        spans = key_char_spans(ev_offsets, mask)
        ours = np.flatnonzero(tokens_within_spans(model_offsets, spans)).tolist()
        assert ours == official_overlap(model_offsets.tolist(), spans.tolist())
        assert len(ours) > 0


def test_tokens_within_spans_edge_cases():
    offsets = np.array([[0, 3], [3, 7], [7, 8], [8, 12], [12, 12], [13, 20]])
    spans = np.array([[3, 8], [12, 14]])
    assert tokens_within_spans(offsets, spans).tolist() == [False, True, True, False, True, False]
    assert tokens_within_spans(offsets, np.zeros((0, 2))).tolist() == [False] * 6


def test_cross_tokenizer_key_tokens_cover_the_same_text():
    """Key spans from one tokenizer select model tokens whose text lies inside them."""
    text = govreport_texts()[4][:5000]
    _, ev_offsets = encode_with_offsets(byte_level_bpe(), text, True)
    _, model_offsets = encode_with_offsets(metaspace_bpe(), text, False)
    mask = np.zeros(len(ev_offsets), dtype=bool)
    mask[100:140] = True  # one contiguous run of key tokens -> one merged span
    spans = key_char_spans(ev_offsets, mask)
    assert len(spans) == 1
    ((start, end),) = spans.tolist()
    selected = tokens_within_spans(model_offsets, spans)
    for (a, b), key in zip(model_offsets.tolist(), selected):
        assert key == (start <= a and b <= end)
    covered = "".join(text[a:b] for (a, b), k in zip(model_offsets.tolist(), selected) if k)
    assert covered.replace(" ", "") in text[start:end].replace(" ", "")
    assert len(covered) > 0.8 * (end - start)


#: Emoji (a ZWJ sequence), Hebrew and Arabic (right to left), CJK and a typographic dash: characters
#: that byte-level BPE splits into several tokens sharing one character span.
MIXED = "Report — 👩\u200d👩\u200d👧 family; שלום עולם; مرحبا بالعالم; 你好世界 and 東京 — end 🙂."


def naive_character_average(text, source_offsets, source_weights, target_offsets):
    """One character at a time: the mean weight of the source tokens covering it (1 if none), then
    per target token the mean over its characters (1 if it has none)."""
    per_char = []
    for c in range(len(text)):
        covering = [w for (a, b), w in zip(source_offsets.tolist(), source_weights) if a <= c < b]
        per_char.append(sum(covering) / len(covering) if covering else 1.0)
    return [sum(per_char[a:b]) / (b - a) if b > a else 1.0 for a, b in target_offsets.tolist()], per_char


@pytest.mark.parametrize("source_bos", [True, False])
def test_transfer_token_weights_is_the_character_average(source_bos):
    text = govreport_texts()[6][:3000] + MULTIBYTE + MIXED
    _, ev_offsets = encode_with_offsets(byte_level_bpe(add_bos=source_bos), text, True)
    _, model_offsets = encode_with_offsets(SlowByteTokenizer(), text, False)
    _, model2_offsets = encode_with_offsets(metaspace_bpe(), text, False)
    weights = np.random.default_rng(2).uniform(0.2, 5.0, len(ev_offsets))
    for target in (model_offsets, model2_offsets):
        got = transfer_token_weights(len(text), ev_offsets, weights, target)
        expected, per_char = naive_character_average(text, ev_offsets, weights, target)
        np.testing.assert_allclose(got, expected, rtol=1e-9)
    # One token per byte: every byte token of a character has that character's value, not a neighbour's.
    got = transfer_token_weights(len(text), ev_offsets, weights, model_offsets)
    for (a, b), g in zip(model_offsets.tolist(), got):
        assert b == a + 1 and g == pytest.approx(per_char[a], rel=1e-9)
    split = [c for c in range(len(text)) if sum(a <= c < b for a, b in ev_offsets.tolist()) > 1]
    assert len(split) > 30  # the source splits many characters into byte tokens with different weights


@pytest.mark.parametrize("bos", [(True, True), (True, False), (False, True)], ids=["both", "source", "target"])
def test_the_same_tokens_keep_their_weights(bos):
    """Equal tokenizations (a BOS on either side aside) give each token its source token's weight."""
    text = govreport_texts()[2][:400] + MIXED
    source_ids, source_offsets = encode_with_offsets(byte_level_bpe(), text, bos[0])
    target_ids, target_offsets = encode_with_offsets(byte_level_bpe(), text, bos[1])
    weights = np.random.default_rng(3).uniform(0.2, 5.0, len(source_ids)).astype(np.float32)
    got = transfer_token_weights(len(text), source_offsets, weights, target_offsets, source_ids, target_ids)
    source_text = weights[1:] if bos[0] else weights
    target_bos = [1.0] if bos[1] else []
    assert got.tolist() == target_bos + source_text.tolist()
    # Without the ids (or with other ids) it is the character average, which differs on split characters.
    averaged = transfer_token_weights(len(text), source_offsets, weights, target_offsets)
    assert (averaged != got).sum() > 30
    other_ids = target_ids.copy()
    other_ids[-3] += 1
    changed = transfer_token_weights(len(text), source_offsets, weights, target_offsets, source_ids, other_ids)
    assert changed.tolist() == averaged.tolist()


def test_soft_key_weights_of_the_metric_carry_the_same_way():
    """The metric's soft path (scoring.text_key_weights, with the evaluated model's ids) gives an
    evaluated model with the evaluator's tokenizer (without its BOS, as the metric tokenizes) the
    evaluator's own weights, and another tokenizer the character average."""
    gamma = 3.0
    text = govreport_texts()[5][:600] + MIXED
    ev_ids, ev_offsets = encode_with_offsets(byte_level_bpe(), text, True)
    rng = np.random.default_rng(4)
    lp_long = (-rng.exponential(2.0, len(ev_ids))).astype(np.float32)
    lp_short = (lp_long - rng.normal(0.5, 1.5, len(ev_ids))).astype(np.float32)
    lp_long[0], lp_short[:50] = np.nan, np.nan
    evaluator = EvaluatorScores(ev_ids, ev_offsets, lp_long, lp_short)
    expected = [
        1.0 if np.isnan(long) or np.isnan(short) else float(min(np.exp(long - short), np.float32(gamma)))
        for long, short in zip(lp_long, lp_short)
    ]
    for tokenizer, same in ((byte_level_bpe(), True), (metaspace_bpe(), False), (SlowByteTokenizer(), False)):
        ids, offsets = encode_with_offsets(tokenizer, text, False)
        model = ModelScores(ids, offsets, np.zeros(len(ids), dtype=np.float32))
        (got,) = text_key_weights([text], [evaluator], [model], 2.0, -2.0, soft=True, gamma=gamma)
        if same:
            assert got.tolist() == expected[1:]
        else:
            np.testing.assert_allclose(got, naive_character_average(text, ev_offsets, expected, offsets)[0], rtol=1e-9)


def test_tokenizer_that_cannot_decode_or_map_is_refused():
    class Opaque(SlowByteTokenizer):
        def _decode(self, *args, **kwargs):
            raise NotImplementedError("no decoder")

    with pytest.raises(ValueError, match="no offset mapping and cannot decode.*fast tokenizer"):
        encode_with_offsets(Opaque(), "some text", add_special_tokens=False)
