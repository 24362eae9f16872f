"""A synthetic long-context task with a known answer: copying from far back.

Documents are uniformly random words ``w0 … w{V-1}`` in which a few segments reappear exactly
``distance`` tokens after their first occurrence. A tiny model trained on such documents can
predict a copied token only by looking ``distance`` tokens back, and nothing else is predictable:
the copied tokens (after the first of each segment, which announces the copy) are exactly the
tokens that need long context, i.e. the key tokens LongPPL should find.

Used by ``scripts/quickstart.py`` and the known-answer test; trains in about half a minute on two
CPU cores.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import warnings
from dataclasses import dataclass

import torch
from tokenizers import Tokenizer, models, pre_tokenizers

VOCAB_SIZE = 128
DOCUMENT_LENGTH = 160
DISTANCE = 64
SEGMENT_LENGTH = 16


@dataclass
class CopyDocuments:
    """``ids`` ``[N, T]`` word ids; ``copy_rank`` ``[N, T]``: index of the token inside its copied
    segment (0 = first copied token), -1 for tokens that are not copies."""

    ids: torch.Tensor
    copy_rank: torch.Tensor

    def texts(self) -> list[str]:
        """One text per document, words separated by single spaces."""
        return [" ".join(f"w{int(i)}" for i in row) for row in self.ids]


def word_tokenizer(vocab_size: int = VOCAB_SIZE):
    """A fast word-level tokenizer: ``w{i}`` -> id ``i``; ``<unk>`` and ``<pad>`` after the words."""
    from transformers import PreTrainedTokenizerFast

    vocab = {f"w{i}": i for i in range(vocab_size)}
    vocab.update({"<unk>": vocab_size, "<pad>": vocab_size + 1})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", pad_token="<pad>")


def sample_documents(
    num_documents: int,
    length: int = DOCUMENT_LENGTH,
    num_segments: int = 3,
    segment_length: int = SEGMENT_LENGTH,
    distance: int = DISTANCE,
    vocab_size: int = VOCAB_SIZE,
    generator: torch.Generator | None = None,
) -> CopyDocuments:
    """Random documents in which ``num_segments`` segments are copied ``distance`` tokens later.

    Segments start on multiples of ``segment_length`` within the first ``length - distance``
    tokens and do not overlap; copies are written in order, so a copy that lands on a later
    segment's source is copied again, consistently.
    """
    slots = (length - distance) // segment_length
    if num_segments > slots:
        raise ValueError(f"{num_segments} segments of {segment_length} do not fit before {length - distance}.")
    ids = torch.randint(vocab_size, (num_documents, length), generator=generator)
    rank = torch.full((num_documents, length), -1, dtype=torch.long)
    starts = torch.rand(num_documents, slots, generator=generator).argsort(-1)[:, :num_segments]
    starts = starts.sort(-1).values * segment_length
    offsets = torch.arange(segment_length)
    rows = torch.arange(num_documents)[:, None]
    for k in range(num_segments):
        source = starts[:, k : k + 1] + offsets
        ids[rows, source + distance] = ids[rows, source]
        rank[rows, source + distance] = offsets
    return CopyDocuments(ids, rank)


def copy_model_config(vocab_size: int = VOCAB_SIZE, max_positions: int = 1024):
    """A two-layer Mistral (Llama architecture with an optional sliding window) of about 100k weights."""
    from transformers import MistralConfig

    return MistralConfig(
        vocab_size=vocab_size + 2,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=max_positions,
        sliding_window=None,
        tie_word_embeddings=False,
        pad_token_id=vocab_size + 1,
        bos_token_id=None,
        eos_token_id=None,
    )


def default_cache_dir() -> str:
    """Where trained toy models are kept: ``$LONGPPL_CACHE_DIR``, else ``~/.cache/longppl``."""
    return os.environ.get("LONGPPL_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "longppl")


def _cache_path(cache_dir: str, settings: dict) -> str:
    """The file of a trained copy model: named by a digest of everything that decides its weights
    (the training settings, this module's code and the torch version)."""
    with open(__file__, "rb") as handle:
        code = hashlib.sha256(handle.read()).hexdigest()
    key = json.dumps({**settings, "code": code, "torch": torch.__version__}, sort_keys=True)
    return os.path.join(cache_dir, f"copy-model-{hashlib.sha256(key.encode()).hexdigest()[:20]}.safetensors")


def train_copy_model(
    steps: int = 500,
    seed: int = 0,
    batch_size: int = 32,
    learning_rate: float = 3e-3,
    log=None,
    cache_dir: str | None = None,
):
    """Train a tiny causal LM on :func:`sample_documents` (three 16-token copies per 160 tokens).

    Args:
        log: optional callable receiving ``(step, loss)`` every 50 steps (not called when the model
            comes from the cache).
        cache_dir: if given, the trained weights are kept there (safetensors) and a later call with
            the same settings, code and torch version loads them instead of training again: the
            quickstart and the known-answer test then train the model once between them. A file that
            cannot be read is trained again and replaced.
    Returns:
        the trained ``MistralForCausalLM`` in eval mode (float32, CPU).
    """
    from safetensors.torch import load, save
    from transformers import MistralForCausalLM

    from ..atomic_files import write_file_atomically

    settings = dict(steps=steps, seed=seed, batch_size=batch_size, learning_rate=learning_rate)
    path = _cache_path(cache_dir, settings) if cache_dir is not None else None
    torch.manual_seed(seed)
    model = MistralForCausalLM(copy_model_config())
    if path is not None and os.path.isfile(path):
        try:
            with open(path, "rb") as handle:
                model.load_state_dict(load(handle.read()), strict=True)
            return model.eval()
        except Exception as err:  # a damaged file: train again and replace it
            warnings.warn(f"Could not read the cached copy model {path} ({err}); training it again.", stacklevel=2)
            torch.manual_seed(seed)
            model = MistralForCausalLM(copy_model_config())
    generator = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=learning_rate, weight_decay=0.0)
    model.train()
    for step in range(steps):
        batch = sample_documents(batch_size, generator=generator).ids
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if log is not None and (step % 50 == 0 or step == steps - 1):
            log(step, loss.item())
    if path is not None:
        state = {name: tensor.detach().clone().contiguous() for name, tensor in model.state_dict().items()}
        write_file_atomically(path, lambda handle: handle.write(save(state)), binary=True)
    return model.eval()


def cut_context(model, window: int):
    """A copy of ``model`` that attends only to the last ``window`` tokens (same weights)."""
    config = copy.deepcopy(model.config)
    config.sliding_window = window
    cut = type(model)(config)
    cut.load_state_dict(model.state_dict())
    return cut.eval()
