"""LongCE: long-context cross-entropy fine-tuning (Fang et al., ICLR 2025, Sec. 3.2).

The trainer (``LongCEConfig``, ``LongCETrainer``) builds on the ``longppl`` scoring core; it is
not implemented yet (tracked as its own issue).
"""
