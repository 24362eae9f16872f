"""The ``longppl`` model type: lm-evaluation-harness's own Hugging Face model (``HFLM``), which scores
the documents of the LongPPL tasks with the scoring core of ``longppl evaluate``.

``HFLM`` loads the model as ``--model hf`` does: ``pretrained``, ``dtype``, ``device``, ``parallelize``
(``device_map="auto"`` over the GPUs), ``peft`` adapters, ``revision``, quantisation, and data
parallelism under ``accelerate launch -m lm_eval`` (each process scores its share of the documents).
Everything it does for other tasks is unchanged. Only the requests of a LongPPL task
(:class:`DocumentRequest`, made by :class:`longppl.harness.task.LongPPLTask`) take another path: each
document is scored whole, in one forward pass with its full context, by ``longppl.score_with_model``
(no ``[sequence x vocabulary]`` logits tensor; short documents share passes up to
``max_tokens_per_batch`` tokens), instead of the harness's rolling windows of ``max_length`` tokens.
The answer is the document's log-likelihood (a float, as ``loglikelihood_rolling`` answers) that also
carries its per-token log-probs (:class:`DocumentLogProbs`), from which the task computes LongPPL.

Arguments of its own (``--model_args``), beside every ``hf`` argument:

- ``add_special_tokens`` (default False, as ``longppl evaluate``): tokenize the documents with the
  model's special tokens (its BOS), as ``longppl evaluate --add-special-tokens``.
- ``max_tokens_per_batch`` (default 32768): the token budget of one forward pass of the LongPPL
  requests; ``batch_size`` still sizes the model's other requests. Results do not depend on it
  beyond float rounding.
- ``torch_compile`` (default False): compile the transformer blocks while scoring.
"""

from __future__ import annotations

import numpy as np
from lm_eval.api.instance import Instance
from lm_eval.api.registry import register_model
from lm_eval.models.huggingface import HFLM

import longppl
from longppl.models.named import resolve as resolve_named

from ._internal import DEFAULT_MAX_TOKENS_PER_BATCH, encode_texts, require_bool, require_int

#: The name ``--model`` takes.
MODEL_TYPE = "longppl"


class DocumentRequest(Instance):
    """A ``loglikelihood_rolling`` request of a LongPPL task: one whole document (``arguments[0]``),
    to be answered with its per-token log-probs (:class:`DocumentLogProbs`). Any other model type
    sees an ordinary rolling request."""


class DocumentLogProbs(float):
    """A document's log-likelihood ``sum_i lp[i]`` (the float a ``loglikelihood_rolling`` request
    answers, and what the harness writes in its samples) with the scores it comes from.

    Attributes:
        scores: ``longppl.core.scoring.ModelScores`` of the document: the model's tokens ``input_ids``
            ``[n]``, their character spans ``offsets`` ``[n, 2]`` and ``lp`` ``[n]``,
            ``lp[i] = log P(x_i | x_<i)`` (NaN at ``i = 0``, which has no prediction).
    """

    def __new__(cls, scores):
        value = super().__new__(cls, float(np.nansum(np.asarray(scores.lp, dtype=np.float64))))
        value.scores = scores
        return value

    def __reduce__(self):
        # pickled by the harness's response cache (--use_cache): rebuilt from the scores
        return (DocumentLogProbs, (self.scores,))


@register_model(MODEL_TYPE)
class LongPPLLM(HFLM):
    """``HFLM`` that answers :class:`DocumentRequest` with per-token log-probs (module docstring).

    Args:
        add_special_tokens: tokenize documents with the model's special tokens (default False).
        max_tokens_per_batch: token budget of one forward pass over documents (default 32768).
        torch_compile: compile the transformer blocks while scoring (default False).
        **kwargs: every argument of ``HFLM`` (``pretrained``, ``dtype``, ``device``, ``peft``, ...);
            ``pretrained`` may be a real model's short name (``gemma-3-270m``) or a ``*.gguf`` path.
    """

    def __init__(
        self,
        *args,
        add_special_tokens: bool = False,
        max_tokens_per_batch: int = DEFAULT_MAX_TOKENS_PER_BATCH,
        torch_compile: bool = False,
        **kwargs,
    ) -> None:
        # checked before the model loads, so that a typo costs no loading time
        self.add_special_tokens = require_bool("add_special_tokens", add_special_tokens)
        self.max_tokens_per_batch = require_int("max_tokens_per_batch", max_tokens_per_batch)
        self.torch_compile = require_bool("torch_compile", torch_compile)
        for key in ("pretrained", "tokenizer"):  # a real model's short name or a GGUF file: its converted folder
            if isinstance(kwargs.get(key), str):
                kwargs[key] = resolve_named(kwargs[key], key) or kwargs[key]
        super().__init__(*args, **kwargs)

    def loglikelihood_rolling(self, requests: list[Instance], disable_tqdm: bool = False) -> list[float]:
        """Answers in the order of ``requests``: :class:`DocumentLogProbs` for each
        :class:`DocumentRequest`, ``HFLM``'s rolling log-likelihood for the others."""
        answers: list[float | None] = [None] * len(requests)
        others = [i for i, request in enumerate(requests) if not isinstance(request, DocumentRequest)]
        if others:
            found = super().loglikelihood_rolling([requests[i] for i in others], disable_tqdm=disable_tqdm)
            for i, value in zip(others, found):
                answers[i] = value
        # The harness repeats a request to even out the processes' request counts: score each once.
        distinct: dict[int, Instance] = {}
        for request in requests:
            if isinstance(request, DocumentRequest):
                distinct.setdefault(id(request), request)
        if distinct:
            scored = dict(zip(distinct, self.score_documents(list(distinct.values()), disable_tqdm)))
            for i, request in enumerate(requests):
                if isinstance(request, DocumentRequest):
                    answers[i] = scored[id(request)]
                    self.cache_hook.add_partial("loglikelihood_rolling", request.args, answers[i])
        return answers

    def score_documents(self, requests: list[Instance], disable_tqdm: bool = False) -> list[DocumentLogProbs]:
        """Each request's document scored whole by ``longppl.score_with_model``, as ``longppl evaluate``
        scores a model: same tokenization, same batching, same log-probs.

        Raises:
            ValueError: a document that tokenizes to nothing, a token id past the model's embedding
                table, or a document longer than a model with learned positions can take (naming the
                document and the task).
        """
        texts = [request.args[0] for request in requests]
        names = [f"document {request.doc_id} of task {request.task_name!r}" for request in requests]
        encoded = encode_texts(self.tokenizer, texts, self.add_special_tokens, self.model, "model", text_names=names)
        scores = longppl.score_with_model(
            self.model,
            self.tokenizer,
            texts,
            self.max_tokens_per_batch,
            add_special_tokens=self.add_special_tokens,
            progress=not disable_tqdm and self.rank == 0,
            torch_compile=self.torch_compile,
            encoded=encoded,
        )
        return [DocumentLogProbs(one) for one in scores]
