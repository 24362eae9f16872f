"""Character offsets (fast and decode fallback) and cross-tokenizer mapping on real documents."""

import numpy as np
import pytest
from helpers import SlowByteTokenizer, byte_level_bpe, govreport_texts, metaspace_bpe
from reference import official_overlap

from longppl import encode_with_offsets, key_char_spans, tokens_within_spans, transfer_token_weights
from longppl.alignment import decode_offsets

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


def test_transfer_token_weights_is_the_character_average():
    text = govreport_texts()[6][:3000] + MULTIBYTE
    _, ev_offsets = encode_with_offsets(byte_level_bpe(), text, True)
    _, model_offsets = encode_with_offsets(SlowByteTokenizer(), text, False)
    _, model2_offsets = encode_with_offsets(metaspace_bpe(), text, False)
    weights = np.random.default_rng(2).uniform(0.2, 5.0, len(ev_offsets))
    per_char = [1.0] * len(text)
    for (a, b), w in zip(ev_offsets.tolist(), weights):
        for c in range(a, b):
            per_char[c] = w
    for target in (model_offsets, model2_offsets):
        got = transfer_token_weights(len(text), ev_offsets, weights, target)
        for (a, b), g in zip(target.tolist(), got):
            expected = sum(per_char[a:b]) / (b - a) if b > a else 1.0
            assert g == pytest.approx(expected)


def test_tokenizer_that_cannot_decode_or_map_is_refused():
    class Opaque(SlowByteTokenizer):
        def _decode(self, *args, **kwargs):
            raise NotImplementedError("no decoder")

    with pytest.raises(ValueError, match="no offset mapping and cannot decode.*fast tokenizer"):
        encode_with_offsets(Opaque(), "some text", add_special_tokens=False)
