"""Context-extension recipes: PI / NTK / ABF / YaRN change the rotary frequencies as documented; EABF scales
queries; the library's list of methods is the one the training command and the reproduction take."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from longce import apply_context_extension, register_eabf_attention
from longce.context_extension import METHODS, PARAMETERS, eabf_query_scale

HEAD_DIM = 16


def config(**overrides):
    settings = dict(
        vocab_size=50,
        hidden_size=64,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
    )
    settings.update(overrides)
    return LlamaConfig(**settings)


def rotary(cfg, attn_implementation="sdpa"):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation=attn_implementation)
    return model.eval(), model.model.rotary_emb


def default_inv_freq(theta):
    return 1.0 / theta ** (torch.arange(0, HEAD_DIM, 2, dtype=torch.float32) / HEAD_DIM)


def test_pi_divides_every_frequency_by_the_factor():
    cfg = config()
    assert apply_context_extension(cfg, "pi") is None
    assert cfg.rope_parameters == {"rope_type": "linear", "factor": 8.0, "rope_theta": 10000.0}
    _, rope = rotary(cfg)
    torch.testing.assert_close(rope.inv_freq, default_inv_freq(10000.0) / 8.0)


@pytest.mark.parametrize("factor, head_dim", [(4, None), (2.5, 8)])
def test_ntk_raises_the_base_so_the_lowest_frequency_is_divided_by_the_factor(factor, head_dim):
    cfg = config(**({"head_dim": head_dim} if head_dim else {}))
    d = head_dim or HEAD_DIM  # hidden 64 over 4 heads unless the config names its head dimension
    assert apply_context_extension(cfg, "ntk", factor=factor) is None
    base = 10000.0 * factor ** (d / (d - 2))  # NTK-aware scaling's base, written out here
    assert cfg.rope_parameters == {"rope_type": "default", "rope_theta": pytest.approx(base)}
    assert cfg.max_position_embeddings == 4096  # only the base changes, as in ABF
    _, rope = rotary(cfg)
    plain = [1.0 / base ** (2 * i / d) for i in range(d // 2)]
    torch.testing.assert_close(rope.inv_freq, torch.tensor(plain, dtype=torch.float32))
    old_lowest = 1.0 / 10000.0 ** ((d - 2) / d)
    assert rope.inv_freq[0].item() == 1.0 and rope.inv_freq[-1].item() == pytest.approx(old_lowest / factor, rel=1e-5)


def test_one_list_of_methods_for_the_training_command_and_the_reproduction():
    from longppl_reproduce.common.config import EXTENSION_METHODS

    from longce.arguments import ModelArguments

    assert METHODS == tuple(PARAMETERS) and "ntk" in METHODS
    assert set(EXTENSION_METHODS) == set(METHODS) - {"none"}  # every method a population may name
    for method in METHODS:  # longce-train takes each of them
        assert ModelArguments(model_name_or_path="m", context_extension=method).context_extension == method


def test_abf_raises_the_base_to_500k():
    cfg = config()
    apply_context_extension(cfg, "abf")
    _, rope = rotary(cfg)
    torch.testing.assert_close(rope.inv_freq, default_inv_freq(500000.0))


def test_yarn_keeps_high_and_interpolates_low_frequencies():
    cfg = config()
    apply_context_extension(cfg, "yarn", factor=8)
    assert cfg.max_position_embeddings == 4096 * 8
    assert cfg.rope_parameters["original_max_position_embeddings"] == 4096
    _, rope = rotary(cfg)
    plain = default_inv_freq(10000.0)
    # wavelength 2*pi/f: far below 4096/32 tokens -> extrapolated (unchanged); far above 4096 -> divided by 8
    torch.testing.assert_close(rope.inv_freq[0], plain[0])
    torch.testing.assert_close(rope.inv_freq[-1], plain[-1] / 8.0)
    assert rope.attention_scaling == pytest.approx(0.1 * math.log(8.0) + 1.0)


def test_eabf_query_scale_formula():
    positions = torch.tensor([0, 1, 4094, 4095, 4096, 8191, 32767])
    expected = [max(1.0, math.log(p + 1) / math.log(4096)) for p in positions.tolist()]
    torch.testing.assert_close(eabf_query_scale(positions), torch.tensor(expected))


def test_eabf_attention_scales_queries_then_runs_sdpa():
    name = register_eabf_attention(base_length=8, name="longce_eabf_test")
    from transformers import AttentionInterface

    function = AttentionInterface._global_mapping[name]
    torch.manual_seed(0)
    query, key, value = (torch.randn(2, 4, 20, 8) for _ in range(3))
    positions = torch.arange(20).expand(2, 20)

    class Module(torch.nn.Module):
        is_causal = True
        num_key_value_groups = 1

    ours, _ = function(Module(), query, key, value, None, scaling=0.3, position_ids=positions)
    scale = torch.clamp(torch.log(positions.float() + 1) / math.log(8), min=1.0)[:, None, :, None]
    expected, _ = sdpa_attention_forward(Module(), query * scale, key, value, None, scaling=0.3)
    torch.testing.assert_close(ours, expected)
    plain, _ = sdpa_attention_forward(Module(), query, key, value, None, scaling=0.3)
    assert not torch.allclose(ours, plain)  # positions >= 8 are really scaled


def test_eabf_model_equals_abf_within_base_length_and_differs_beyond():
    abf, eabf = config(), config()
    assert apply_context_extension(abf, "abf") is None
    implementation = apply_context_extension(eabf, "eabf", eabf_base_length=8)
    assert eabf.rope_parameters["rope_theta"] == 500000.0
    model_abf, _ = rotary(abf)
    model_eabf, _ = rotary(eabf, implementation)
    ids = torch.randint(0, 50, (1, 24))
    with torch.no_grad():
        short_abf, short_eabf = model_abf(ids[:, :8]).logits, model_eabf(ids[:, :8]).logits
        long_abf, long_eabf = model_abf(ids).logits, model_eabf(ids).logits
    torch.testing.assert_close(short_eabf, short_abf)  # scale is 1 for positions < 8
    torch.testing.assert_close(long_eabf[:, :8], long_abf[:, :8])
    assert (long_eabf[:, 8:] - long_abf[:, 8:]).abs().max() > 1e-4


@pytest.mark.parametrize(
    "method, kwargs, message",
    [
        ("rope", {}, "Unknown context-extension method"),
        ("ntk", {}, "NTK-aware scaling needs a scaling factor"),
        ("ntk", {"factor": 0.5}, "factor must be >= 1"),
        ("yarn", {}, "YaRN needs a scaling factor"),
        ("pi", {"factor": 0.5}, "factor must be >= 1"),
        ("eabf", {"eabf_base_length": 1}, "base_length must be >= 2"),
    ],
)
def test_bad_recipes(method, kwargs, message):
    with pytest.raises(ValueError, match=message):
        apply_context_extension(config(), method, **kwargs)
