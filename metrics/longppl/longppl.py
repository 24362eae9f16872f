"""LongPPL: perplexity over the key tokens of long-context language modeling (evaluate metric).

A thin shell over the installed ``longppl`` package (``pip install longppl-hf``), as the Hub's
metrics that wrap a library are: this file declares the metric, ``longppl.metric.compute`` computes
it. evaluate copies only this file (into its module cache, or from the Hub Space); every module it
runs comes from the package, so a copy never holds code older than the package.
"""

import datasets
import evaluate

from longppl.metric.compute import (  # From: longppl-hf
    CITATION,
    DESCRIPTION,
    KWARGS_DESCRIPTION,
    check_predictions,
    compute_metric,  # From: longppl-hf
    refuse_references,
)
from longppl.metric.official import compute_longppl, find_key_token, load_key_token  # From: longppl-hf

# Re-exported: the official package's scripts do `from longppl.longppl import *`.
__all__ = ["LongPPL", "compute_longppl", "find_key_token", "load_key_token"]


@evaluate.utils.file_utils.add_start_docstrings(DESCRIPTION, KWARGS_DESCRIPTION)
class LongPPL(evaluate.Metric):
    """LongPPL (Fang et al., ICLR 2025) as an ``evaluate`` metric."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # evaluate names a module after its class in snake case ("long_ppl"); it is loaded as "longppl".
        self._module_info.module_name = "longppl"

    def _info(self):
        return evaluate.MetricInfo(
            module_type="metric",
            description=DESCRIPTION,
            citation=CITATION,
            inputs_description=KWARGS_DESCRIPTION,
            features=datasets.Features({"predictions": datasets.Value("string")}),
            reference_urls=["https://arxiv.org/abs/2410.23771", "https://github.com/PKU-ML/LongPPL"],
        )

    # Texts are checked before evaluate stores them: its Arrow encoding would turn 123 into "123".
    def compute(self, *, predictions=None, references=None, **kwargs):
        """Compute LongPPL and PPL of a model on ``predictions`` (the arguments are listed below)."""
        refuse_references(references)
        if predictions is not None:  # None: texts were given earlier through add() / add_batch()
            check_predictions(predictions)
        return super().compute(predictions=predictions, references=references, **kwargs)

    def add_batch(self, *, predictions=None, references=None, **kwargs):
        """Add a batch of texts to score at the next ``compute(...)``."""
        refuse_references(references)
        if predictions is not None:
            check_predictions(predictions, allow_empty=True)
        return super().add_batch(predictions=predictions, references=references, **kwargs)

    def add(self, *, prediction=None, reference=None, **kwargs):
        """Add one text to score at the next ``compute(...)``."""
        refuse_references(reference, "prediction")
        if prediction is not None:
            check_predictions([prediction])
        return super().add(prediction=prediction, reference=reference, **kwargs)

    def _compute(self, predictions, **kwargs):
        """``longppl.metric.compute.compute_metric`` (the arguments are listed in the class docstring)."""
        return compute_metric(predictions, **kwargs)
