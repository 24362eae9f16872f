"""One rank of a tensor-parallel group on the CPU (gloo), started by ``accelerate launch`` from
tests/distributed/test_tensor_parallel.py: for each saved evaluator named on the command line, load
it split over the group (``load_model(..., tensor_parallel=2)``: as it comes, with sequence
parallelism, for ``<split>`` = ``sequence``; with ``sequence_parallel=False`` for ``tensor``), check
that the split is real, score the texts, and write this rank's rows to ``<out>/<name>-<rank>.npz``
(plain arrays, read back without pickle).

With ``sequence``, the npz also holds ``token_counts``: one row ``[B, T of q_proj's input, tokens
the first decoder layer's input norm ran on, tokens of the backbone's output (B*T)]`` per forward
pass, read by hooks, so the test can check that the norms really ran on this rank's share of the
tokens.

``compiled``: sequence parallelism with the decoder layers compiled (``core.compilation``, dynamo's
``"eager"`` backend: dynamo decides the graphs and their guards, and skipping inductor's code
generation keeps it quick), the texts scored one at a time; the npz also holds ``graphs``: after each
text, how many graphs dynamo holds for the decoder layers' forward (all layers share its code).

    python tensor_parallel_worker.py <out> <texts.json> <K> <d> <split> <folder>...
"""

from __future__ import annotations

import functools
import json
import os
import sys

import numpy as np
import torch
from accelerate import PartialState

try:
    from torch.distributed.tensor import DTensor
except ImportError:  # torch < 2.5
    from torch.distributed._tensor import DTensor

from longppl.core.compilation import compiled_blocks
from longppl.core.scoring import score_with_evaluator
from longppl.models.loading import load_model, load_tokenizer
from longppl.settings import KeyTokenSettings


def layer_graphs(layer: torch.nn.Module) -> int:
    """Graphs dynamo holds for ``layer``'s forward: the frame it compiles is the forward or one of
    the wrappers transformers puts around it (which, depends on the version), so all are counted."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    function, graphs = type(layer).forward, 0
    while function is not None:
        graphs += len(_debug_get_cache_entry_list(function.__code__))
        function = getattr(function, "__wrapped__", None)
    return graphs


def main() -> None:
    out, texts_file, trunc_len, stride, split, *folders = sys.argv[1:]
    with open(texts_file, encoding="utf-8") as handle:
        texts = json.load(handle)
    state = PartialState(cpu=True)
    try:
        for folder in folders:
            # "sequence", "compiled": the default (sequence parallelism where the layout allows, which these
            # families have)
            options = {"sequence_parallel": False} if split == "tensor" else {}
            model = load_model(folder, "cpu", "float32", tensor_parallel=2, **options)
            # The split is real (this rank holds half the heads and half of o_proj's inputs) and
            # made of plain tensors: no DTensor anywhere, so a forward pass runs none of its dispatch.
            attention = model.model.layers[0].self_attn
            hidden = model.config.hidden_size
            assert attention.q_proj.weight.shape == (hidden // 2, hidden), attention.q_proj.weight.shape
            assert attention.o_proj.weight.shape == (hidden, hidden // 2), attention.o_proj.weight.shape
            assert attention.o_proj.split.sequence_parallel == (split != "tensor")
            dtensors = [name for name, parameter in model.named_parameters() if isinstance(parameter, DTensor)]
            assert not dtensors, dtensors
            counts = []
            if split == "sequence":
                layer = model.model.layers[0]

                def norm_input(module, args, counts=counts):
                    counts.append([-1, -1, args[0].shape[0] * args[0].shape[1], -1])

                def q_input(module, args, counts=counts):
                    counts[-1][:2] = args[0].shape[:2]

                def backbone_output(module, args, output, counts=counts):
                    counts[-1][3] = output.last_hidden_state.shape[0] * output.last_hidden_state.shape[1]

                layer.input_layernorm.register_forward_pre_hook(norm_input)
                layer.self_attn.q_proj.register_forward_pre_hook(q_input)
                model.model.register_forward_hook(backbone_output)

            score = functools.partial(
                score_with_evaluator,
                model,
                load_tokenizer(folder),
                settings=KeyTokenSettings(int(trunc_len), int(stride)),
                max_tokens_per_batch=256,
                progress=False,
                per_document=True,
            )

            arrays = {}
            if split == "compiled":
                scores, graphs = [], []
                with compiled_blocks(model, backend="eager"):
                    for text in texts:
                        scores += score(texts=[text])
                        graphs.append(layer_graphs(model.model.layers[0]))
                arrays["graphs"] = np.array(graphs)
            else:
                scores = score(texts=texts)
            for index, row in enumerate(scores):
                arrays[f"lp_long_{index}"], arrays[f"lp_short_{index}"] = row.lp_long, row.lp_short
                arrays[f"ids_{index}"] = row.input_ids
            if counts:
                arrays["token_counts"] = np.array(counts)
            name = os.path.basename(folder.rstrip("/"))
            np.savez(os.path.join(out, f"{name}-{state.process_index}.npz"), **arrays)
            del model
            torch.distributed.barrier()
    finally:
        state.destroy_process_group()


if __name__ == "__main__":
    main()
