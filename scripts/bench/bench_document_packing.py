#!/usr/bin/env python
"""Benchmark: key-token scoring of many documents packed (``score_with_evaluator(per_document=True,
pack_documents=True)``, ``longppl-score --pack-documents``: documents share passes with segments of
their own length) against the default, each document with passes of its own, in one process; and
whether each document's scores are bit-for-bit the same both ways.

Random-weight Llama evaluators of two shapes (13.8M: the reproduction's models; ~200M), float32 and
bfloat16, K = 256, d = 64, on documents of about ``--tokens`` tokens cut from a JSONL corpus.

    python scripts/bench/bench_document_packing.py --tokenizer tok.json --corpus books.jsonl.gz --docs 512
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from longppl.commandline.corpus import read_jsonl_texts
from longppl.commandline.running import help_text
from longppl.core.scoring import score_with_evaluator
from longppl.settings import DEFAULT_MAX_TOKENS_PER_BATCH, KeyTokenSettings

#: K = 256, d = 64 (see above), and the default token budget of a forward pass.
SETTINGS, BUDGET = KeyTokenSettings(256, 64), DEFAULT_MAX_TOKENS_PER_BATCH

SHAPES = {
    "13.8M": dict(hidden_size=384, intermediate_size=1024, num_hidden_layers=6, num_attention_heads=6),
    "200M": dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=12, num_attention_heads=16),
}


def documents(tokenizer, corpus: str, count: int, tokens: int) -> list[str]:
    """``count`` texts of about ``tokens`` tokens each, cut in order from the corpus's texts."""
    texts = []
    for text in read_jsonl_texts(corpus):
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        texts += [tokenizer.decode(ids[s : s + tokens]) for s in range(0, len(ids) - tokens, tokens)]
        if len(texts) >= count:
            return texts[:count]
    raise SystemExit(f"{corpus} gives only {len(texts)} documents of {tokens} tokens; pass fewer --docs.")


def main() -> None:
    parser = argparse.ArgumentParser(description=help_text(__doc__.split("\n\n")[0]))
    parser.add_argument("--tokenizer", required=True, help="a tokenizer.json file")
    parser.add_argument("--corpus", required=True, help="JSONL (optionally gzipped) with a 'text' field")
    parser.add_argument("--docs", type=int, default=512)
    parser.add_argument("--tokens", type=int, default=1023)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    args = parser.parse_args()
    tokenizer = PreTrainedTokenizerFast(tokenizer_file=args.tokenizer)
    texts = documents(tokenizer, args.corpus, args.docs, args.tokens)
    sync = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)
    options = dict(add_special_tokens=True, per_document=True, progress=False)
    for name in args.shapes:
        shape = SHAPES[name]
        for dtype in (torch.float32, torch.bfloat16):
            torch.manual_seed(0)
            config = LlamaConfig(
                vocab_size=len(tokenizer),
                max_position_embeddings=args.tokens + 1,
                num_key_value_heads=shape["num_attention_heads"],
                **shape,
            )
            model = LlamaForCausalLM(config).to(args.device, dtype).eval()
            score_with_evaluator(model, tokenizer, texts[:8], SETTINGS, max_tokens_per_batch=BUDGET, **options)
            sync()
            start = time.perf_counter()
            packed = score_with_evaluator(
                model, tokenizer, texts, SETTINGS, max_tokens_per_batch=BUDGET, pack_documents=True, **options
            )
            sync()
            middle = time.perf_counter()
            alone = score_with_evaluator(model, tokenizer, texts, SETTINGS, max_tokens_per_batch=BUDGET, **options)
            sync()
            end = time.perf_counter()
            differing, worst = 0, 0.0
            for a, b in zip(packed, alone):
                pairs = [(getattr(a, key), getattr(b, key)) for key in ("lp_long", "lp_short")]
                differing += not all(np.array_equal(x, y, equal_nan=True) for x, y in pairs)
                for x, y in pairs:
                    both = ~np.isnan(x) & ~np.isnan(y)
                    worst = max(worst, float(np.abs(x[both] - y[both]).max()) if both.any() else 0.0)
            print(
                f"{name} {str(dtype).removeprefix('torch.')}: packed {middle - start:.2f} s, "
                f"alone {end - middle:.2f} s ({(end - middle) / (middle - start):.1f}x); "
                f"documents not bit-identical {differing}/{len(texts)}, largest |difference| {worst:.3g}",
                flush=True,
            )
            del model
            if args.device.startswith("cuda"):
                torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
