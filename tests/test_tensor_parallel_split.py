"""``longppl.parallel.tensor_parallel``'s split on one process: which modules the plan's patterns name, and
where each rank's part of a split parameter lies in the whole tensor. The split layers' arithmetic
over two ranks is checked in tests/distributed/test_tensor_parallel.py.
"""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import tiny_model
from torch import nn

from longppl.parallel.tensor_parallel import (
    SplitGroup,
    local_slice,
    plan_modules,
    split_linear,
    split_modules,
    tensor_parallel_plan,
)

VOCAB = 300
PROJECTIONS = {
    "self_attn.q_proj": "colwise",
    "self_attn.k_proj": "colwise",
    "self_attn.v_proj": "colwise",
    "self_attn.o_proj": "rowwise",
    "mlp.gate_proj": "colwise",
    "mlp.up_proj": "colwise",
    "mlp.down_proj": "rowwise",
}


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2"])
def test_the_family_plan_names_the_projections_of_every_layer(family):
    model = tiny_model(family, VOCAB)
    plan = tensor_parallel_plan(model.config, 2)
    expected = {f"layers.{layer}.{name}": style for layer in range(2) for name, style in PROJECTIONS.items()}
    assert plan_modules(model.base_model, plan) == expected


def test_a_vocabulary_split_embedding_in_the_plan_leaves_the_embedding_whole():
    # transformers 5.17 gives every model with tied embeddings this entry (5.24 does not): the split
    # keeps the embedding whole instead of refusing the family; other styles stay refused
    model = tiny_model("qwen2", VOCAB)
    model.config.base_model_tp_plan = {**model.config.base_model_tp_plan, "embed_tokens": "embedding_rowwise"}
    plan = tensor_parallel_plan(model.config, 2)
    assert "embed_tokens" not in plan and set(plan.values()) == {"colwise", "rowwise"}
    assert "embed_tokens" not in plan_modules(model.base_model, plan)
    model.config.base_model_tp_plan = {**plan, "norm": "sequence_parallel"}
    with pytest.raises(ValueError, match=r"has a plan with styles \['sequence_parallel'\]"):
        tensor_parallel_plan(model.config, 2)


def test_a_star_stands_for_one_name_part_never_a_dotted_path():
    block = nn.ModuleDict({"up": nn.Linear(2, 2)})
    tree = nn.ModuleDict(
        {
            "layers": nn.ModuleDict(
                {"0": block, "1": nn.ModuleDict({"inner": nn.ModuleDict({"up": nn.Linear(2, 2)})})}
            ),
            "layers_up": nn.Linear(2, 2),
            "top": nn.ModuleDict({"up": nn.Linear(2, 2), "upper": nn.Linear(2, 2)}),
        }
    )
    plan = {"layers.*.up": "colwise", "top.up": "rowwise", "t?p.up*": "rowwise", "nowhere.*": "colwise"}
    # layers.1.inner.up has one part more than layers.*.up; layers_up is one part; nowhere.* names nothing
    assert plan_modules(tree, plan) == {"layers.0.up": "colwise", "top.up": "rowwise", "top.upper": "rowwise"}


def test_one_module_named_with_two_styles_is_refused():
    tree = nn.ModuleDict({"layers": nn.ModuleDict({"0": nn.Linear(2, 2)})})
    with pytest.raises(ValueError, match=r"splits 'layers\.0' both 'colwise' and 'rowwise' \(pattern 'layers\.0'\)"):
        plan_modules(tree, {"layers.*": "colwise", "layers.0": "rowwise"})


@pytest.mark.parametrize("family", ["llama", "qwen2"])  # qwen2: column-wise layers with biases
def test_the_ranks_parts_tile_every_split_parameter(family):
    whole = tiny_model(family, VOCAB)
    plan = tensor_parallel_plan(whole.config, 2)
    ranks = [copy.deepcopy(whole) for _ in (0, 1)]
    for rank, model in enumerate(ranks):
        split_modules(model.base_model, plan, SplitGroup(None, rank, 2))
    split = 0
    for name, parameter in whole.named_parameters():
        covered = torch.zeros(parameter.shape, dtype=torch.int64)
        for rank, model in enumerate(ranks):
            index = local_slice(model, name, rank)
            if index is None:  # not split: every rank holds it whole
                assert torch.equal(model.get_parameter(name), parameter), name
                covered += 1
            else:
                assert torch.equal(model.get_parameter(name), parameter[index]), (name, rank)
                covered[index] += 1
        want = 2 if local_slice(ranks[0], name, 0) is None else 1
        assert covered.eq(want).all(), name  # the two parts are disjoint and cover the whole tensor
        split += want == 1
    # q/k/v/o, gate/up/down weights of 2 layers, plus qwen2's q/k/v biases
    assert split == 2 * (7 + (3 if family == "qwen2" else 0))


def test_split_parts_are_copies_not_views_of_the_whole_weight():
    layer = nn.Linear(4, 6)
    whole = layer.weight
    split_linear(layer, "colwise", SplitGroup(None, 1, 2))
    assert layer.weight.shape == (3, 4) and layer.out_features == 3 and layer.bias.shape == (3,)
    assert layer.weight.untyped_storage().data_ptr() != whole.untyped_storage().data_ptr()


@pytest.mark.parametrize(
    "layer, message",
    [
        (nn.Linear(5, 4), r"tensor_parallel=2 cannot split 5 features rowwise: .* pick a size that divides it"),
        (nn.Embedding(4, 4), r"cannot split Embedding \(not a plain nn\.Linear\) rowwise"),
    ],
)
def test_a_layer_that_cannot_be_split_evenly_is_refused(layer, message):
    with pytest.raises(ValueError, match=message):
        split_linear(layer, "rowwise", SplitGroup(None, 0, 2))
