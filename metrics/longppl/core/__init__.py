"""The scoring core: token log-probabilities without a ``[sequence x vocabulary]`` logits tensor
(``logprobs``), sliding-window layers computed in blocks (``attention``), forward passes packed to a token budget (``batching``), the short-context windows
of K tokens, stride d (``windows``), optional ``torch.compile`` of the blocks (``compilation``),
progress and time limits (``progress``), and per-document and corpus LongPPL / PPL (``scoring``)."""
