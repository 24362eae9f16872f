#!/usr/bin/env python
"""Benchmark: greedy answers to long prompts of different lengths, padded batch against rows read alone.

The reproduction's task sets (LongEval lines, needles) ask for a few greedy tokens after prompts of
8k-32k tokens whose lengths differ by a few dozen tokens within a batch. ``model.generate`` on the
left-padded batch reads the prompts under an attention mask, which keeps PyTorch's SDPA off its
maskless causal kernel for the whole prompt; ``greedy_token_ids`` (``prefill="rows"`` of
``greedy_answers``) reads each prompt alone and then decodes the batch together. In one process,
for each length, on the same prompts (random token ids, lengths ``L - U[0, 48)``), interleaved over
``--repeats`` rounds after an untimed first round, it times

- ``generate``: ``padded_greedy_token_ids`` (``model.generate`` on the left-padded batch),
  ``--new-tokens`` greedy tokens: what ``greedy_answers(prefill="batch")`` runs;
- ``rows``: ``greedy_token_ids`` on the same prompts;
- ``prefill-batch`` / ``prefill-rows``: the prompts' forward pass alone (last position's logits),
  batched under the mask / each alone, to split the time between reading and decoding;

and reports seconds a prompt, the ratios against ``generate``, peak GiB, and the share of prompts
whose new tokens agree between the two decoders; with ``--reference``, also each decoder's agreement
with a float32 copy of the model decoding each prompt alone. The JSON keeps every answer's ids.
bf16 rounding differs between the kernels, and with random weights near-ties are common, so the
agreement is a smoke check, not an exactness test: the test suite checks exactness in float32.

The model is random, in bf16 with SDPA, shaped like SmolLM2-135M or Gemma 3 270M (``--shape``; Gemma's
window layers run in blocks in ``rows`` and ``prefill-rows``, as ``greedy_token_ids`` reads a prompt),
or a real one (``--model``: a short name, a ``*.gguf`` file or a saved folder), then with real prompts
(``--prompts``: a lines or needle task set's JSONL, ``{}`` standing for the length), read as the
studies score them (lines prompts end with the answer's opening), and each reader's answers are
scored as the studies score them (``accuracy``, ``is_correct`` a prompt, under every reader). No
end-of-sequence token is set on a random model, so every prompt gets all ``--new-tokens``.

    python scripts/bench/bench_generation.py --lengths 16384 32768 --json generation.json   # one GPU
    python scripts/bench/bench_generation.py --shape gemma-3-270m --lengths 16384 32768 --json gemma.json
    python scripts/bench/bench_generation.py --model gemma.gguf --prompts tasks/lines-beyond-{}.jsonl \
        --lengths 32768 --json gemma-real.json                                          # real prompts
    python scripts/bench/bench_generation.py --tiny --lengths 200 300                    # CPU smoke run
"""

from __future__ import annotations

import os
import random
import sys

from common import GEMMA3_270M_SHAPE, LLAMA_SHAPES, TINY_LLAMA_SHAPE, measure, write_json

from longppl.commandline.running import tool_parser


def build_model(args, device: str):
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    if args.model:
        from longppl.models.sources import check_model_source

        folder = check_model_source(args.model, "--model")
        return AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, attn_implementation="sdpa").to(device).eval()
    positions = max(args.lengths) + args.new_tokens
    if args.shape == "gemma-3-270m":
        from transformers import Gemma3TextConfig

        config = Gemma3TextConfig(**GEMMA3_270M_SHAPE, max_position_embeddings=positions, eos_token_id=None)
    else:
        fields = dict(TINY_LLAMA_SHAPE if args.tiny else LLAMA_SHAPES[args.shape])
        config = LlamaConfig(**fields, max_position_embeddings=positions, eos_token_id=None)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    model.generation_config.eos_token_id = None
    return model.eval()


def float32_answers(model, prompts, new_tokens: int) -> list:
    """Each prompt's greedy tokens from a float32 copy of ``model``, the prompt alone (no padding,
    ``generate``): the reference both decoders are compared with (``--reference``). The prompt is read
    under the library's windowed attention (window layers in blocks, float32 full layers in blocks of
    queries): SDPA's float32 kernel for a masked 32k prompt holds all ``(L, L)`` scores at once."""
    import copy

    import torch
    from longppl_reproduce.common.lines import padded_greedy_token_ids

    from longppl.core.attention import windowed_attention

    exact = copy.deepcopy(model).float()
    with torch.inference_mode(), windowed_attention(exact):
        found = [
            padded_greedy_token_ids(exact, row[None], torch.ones_like(row[None]), new_tokens, 0)[0].tolist()
            for batch in prompts
            for row in batch
        ]
    del exact
    return found


def prompts_file(args, length: int) -> tuple[str, str]:
    """``--prompts``' file for ``length`` and its task kind (``lines-beyond``, ``needle`` ...), checked
    before any model is loaded."""
    if not args.model:
        raise SystemExit("--prompts needs --model (the prompts' tokenizer).")
    from longppl_reproduce.real_models.tasks import kind_of

    path = args.prompts.format(length)
    kind = kind_of(path)
    if kind.startswith("recall"):
        raise SystemExit(
            f"{path}: passage recall is teacher forced, not answered greedily; pass a lines or needle set."
        )
    if not os.path.isfile(path):
        raise SystemExit(f"--prompts: no file {path}; '{{}}' in the path stands for each of --lengths.")
    return path, kind


def real_prompts(args, length: int):
    """The first ``batches x batch_size`` cases of ``--prompts`` whose file name holds ``length``
    (``{}`` in the path stands for it, e.g. ``tasks/lines-beyond-{}.jsonl``), read as the studies
    score them (``tasks.as_scored``: a lines prompt goes on with its answer's opening, so the
    greedy tokens are the number) and tokenized by ``--model``'s tokenizer as ``greedy_answers``
    tokenizes them (special tokens added). Returns ``(batches, expected, tokenizer)``: batches
    ``[[ids [n], ...], ...]``, the expected numbers in the same order."""
    import torch
    from longppl_reproduce.real_models import tasks
    from transformers import AutoTokenizer

    from longppl.models.sources import check_model_source

    path, kind = prompts_file(args, length)
    try:
        cases = tasks.as_scored(kind, tasks.read_task_set(path, kind))
    except (OSError, ValueError) as error:
        raise SystemExit(f"--prompts: {error}") from None
    count = args.batches * args.batch_size
    if len(cases) < count:
        raise SystemExit(f"{path} holds {len(cases)} prompts; --batches x --batch-size is {count}.")
    tokenizer = AutoTokenizer.from_pretrained(check_model_source(args.model, "--model"))
    ids = [torch.as_tensor(tokenizer(case.prompt, add_special_tokens=True)["input_ids"]) for case in cases[:count]]
    expected = [case.expected_number for case in cases[:count]]
    return [ids[i : i + args.batch_size] for i in range(0, count, args.batch_size)], expected, tokenizer


def main(argv=None) -> int:
    parser = tool_parser(None, __doc__)
    parser.add_argument("--lengths", type=int, nargs="+", default=[16384, 32768], help="prompt tokens (at most)")
    parser.add_argument("--batch-size", type=int, default=4, help="prompts a batch (default %(default)s, the study's)")
    parser.add_argument("--batches", type=int, default=2, help="batches a round (default %(default)s)")
    parser.add_argument("--new-tokens", type=int, default=16, help="greedy tokens a prompt (default %(default)s)")
    parser.add_argument("--repeats", type=int, default=3, help="timed rounds after an untimed one")
    parser.add_argument("--shape", default="smollm2-135m", choices=sorted(LLAMA_SHAPES) + ["gemma-3-270m"])
    parser.add_argument(
        "--prompts",
        default=None,
        help="a lines or needle task set's JSONL, {} for the length (with --model): real prompts, read as scored",
    )
    parser.add_argument("--model", default=None, help="a real model instead of a random one")
    parser.add_argument("--tiny", action="store_true", help="a tiny random model (CPU smoke run)")
    parser.add_argument(
        "--reference",
        action="store_true",
        help="also decode each prompt alone with a float32 copy of the model, and compare both decoders with it",
    )
    parser.add_argument("--json", default=None, help="write the results here (the answers' token ids included)")
    args = parser.parse_args(argv)

    import torch
    import transformers
    from longppl_reproduce.common.lines import greedy_token_ids, padded_greedy_token_ids, scored_answers

    from longppl.core.attention import windowed_attention

    for length in args.lengths if args.prompts else ():
        prompts_file(args, length)
    device = "cuda" if torch.cuda.is_available() and not args.tiny else "cpu"
    model = build_model(args, device)
    vocab = model.config.get_text_config().vocab_size
    results = {
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "model": args.model or ("tiny" if args.tiny else args.shape),
        "batch_size": args.batch_size,
        "new_tokens": args.new_tokens,
        "lengths": {},
    }
    rng = random.Random(0)
    for length in args.lengths:
        expected = None
        if args.prompts:
            prompts, expected, tokenizer = real_prompts(args, length)
        else:
            prompts = [
                [torch.randint(3, vocab, (length - rng.randrange(48),)) for _ in range(args.batch_size)]
                for _ in range(args.batches)
            ]

        def padded(batch):
            longest = max(len(row) for row in batch)
            ids = torch.zeros(len(batch), longest, dtype=torch.long)
            mask = torch.zeros_like(ids)
            for i, row in enumerate(batch):
                ids[i, longest - len(row) :], mask[i, longest - len(row) :] = row, 1
            return ids.to(device), mask.to(device)

        @torch.inference_mode()
        def generate():
            found = []
            for batch in prompts:
                found += padded_greedy_token_ids(model, *padded(batch), args.new_tokens, 0).tolist()
            return found

        @torch.inference_mode()
        def rows():
            found = []
            for batch in prompts:
                found += greedy_token_ids(model, [row.to(device) for row in batch], args.new_tokens, 0).tolist()
            return found

        @torch.inference_mode()
        def prefill_batch():
            for batch in prompts:
                ids, mask = padded(batch)
                model(input_ids=ids, attention_mask=mask, use_cache=False, logits_to_keep=1)

        @torch.inference_mode()
        def prefill_rows():  # as greedy_token_ids reads them: window layers in blocks
            with windowed_attention(model):
                for batch in prompts:
                    for row in batch:
                        model(input_ids=row.to(device)[None], use_cache=False, logits_to_keep=1)

        arms = {"generate": generate, "rows": rows, "prefill-batch": prefill_batch, "prefill-rows": prefill_rows}
        seconds = {name: [] for name in arms}
        peaks = {name: 0.0 for name in arms}
        answers = {}
        for round_ in range(args.repeats + 1):
            for name, fn in arms.items():
                took, peak, value = measure(fn, device)
                if round_ == 0:  # the first round warms kernels and the allocator up
                    answers[name] = value
                    continue
                seconds[name].append(took)
                peaks[name] = max(peaks[name], peak)
        count = args.batch_size * args.batches
        row = {
            name: {"seconds_a_prompt": min(s) / count, "peak_gib": peaks[name] if device == "cuda" else None}
            for name, s in seconds.items()
        }
        for name in arms:
            row[name]["vs_generate"] = min(seconds[name]) / min(seconds["generate"])
        agree = [a == b for a, b in zip(answers["generate"], answers["rows"])]
        row["agreement"] = sum(agree) / len(agree)
        row["answers"] = {name: answers[name] for name in ("generate", "rows")}
        if args.reference:
            reference = float32_answers(model, prompts, args.new_tokens)
            row["answers"]["float32"] = reference
            for name in ("generate", "rows"):
                same = [a == b for a, b in zip(answers[name], reference)]
                row[name]["agreement_float32"] = sum(same) / len(same)
        if expected is not None:  # each reader's answers scored as the studies score them
            for name, ids in row["answers"].items():
                texts = tokenizer.batch_decode(ids, skip_special_tokens=True)
                scored = scored_answers(texts, expected)
                row.setdefault(name, {}).update(accuracy=scored["accuracy"], is_correct=scored["is_correct"])
            row["expected"] = expected
            row["prompt_tokens"] = [len(ids) for batch in prompts for ids in batch]
        results["lengths"][str(length)] = row
        print(
            f"{length:>6} tokens: "
            + "  ".join(
                f"{n} {r['seconds_a_prompt']:.3f} s ({r['vs_generate']:.2f}x)" for n, r in row.items() if n in arms
            )
            + f"  agreement {row['agreement']:.2f}",
            flush=True,
        )
        if args.json:
            write_json(args.json, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
