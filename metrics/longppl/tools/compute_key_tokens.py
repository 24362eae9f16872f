"""Score a corpus with an evaluator once, into a key-token cache (a ``datasets.Dataset`` on disk).

    longppl-score --corpus docs.jsonl --evaluator meta-llama/Llama-3.1-8B \\
        --output key_tokens/govreport-llama3.1-8b

    # on 8 GPUs: documents are split across processes, the result is one cache
    accelerate launch --multi_gpu --num_processes 8 -m longppl.tools.compute_key_tokens --corpus ... --output ...

(On a machine without GPUs the same ``--multi_gpu`` launch runs CPU processes that talk over gloo.)

    # an evaluator larger than one GPU, split by tensor parallelism over 2 GPUs (one process each)
    torchrun --nproc-per-node 2 -m longppl.tools.compute_key_tokens --tensor-parallel 2 --evaluator ...

With ``--tensor-parallel N``, each group of N processes holds one split evaluator and scores one
share of the corpus (every rank of a group the same documents; the group's first rank writes).
``--evaluator-precision tf32`` loads the evaluator in float32 and runs its products on TF32 tensor
cores: the key tokens of a float32 evaluator at under twice bf16's time (``longppl.models.precision``).
``--evaluator-precision fp8`` runs the Linear layers of the evaluator's blocks in float8 (torchao, the
``fp8`` extra; ``longppl.models.precision``), compiled unless ``--no-torch-compile``: faster and
approximate; its rows are keyed apart from the bf16 rows of the same evaluator.

The corpus is a ``.jsonl`` file, a directory saved with ``datasets``' ``save_to_disk`` or a Hub
dataset name (``--split``), with the texts in ``--text-column``. Documents already in the cache
for the same evaluator and settings are skipped, so adding documents scores only the new ones.
Each process scores its share of the new documents and commits its rows to the cache as it goes,
as immutable shards (every ``--shard-documents`` documents or ``--shard-minutes`` minutes; the
output's folder must be shared by all processes, e.g. one machine or a shared file system). Old
files of the cache are never rewritten. A run that is killed keeps every committed shard: running
the same command again scores only what is missing. The rows do not depend on the number of
processes or on the interruptions (their order in the cache does); ``longppl cache compact``
merges the shards into one folder when you wish. Several ``--trunc-len`` values (a context
ladder, e.g. ``--trunc-len 1024 2048 4096``) share each document's long pass and give one row per
K. The same scoring runs as a datatrove step on a cluster (``longppl.tools.score_pipeline``). Then
evaluate models with ``longppl-evaluate`` or ``compute(..., key_tokens=<output>)``.

(``scripts/compute_key_tokens.py`` and ``python -m longppl.tools.compute_key_tokens`` run the same
command.)
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from longppl.commandline.running import run_command, tool_parser

# torch, datasets and transformers load after the arguments are parsed (in _run): `--help` is immediate.
from longppl.settings import (
    DEFAULT_ALPHA,
    DEFAULT_BETA,
    DEFAULT_EVALUATOR_PRECISION,
    DEFAULT_MAX_TOKENS_PER_BATCH,
    DEFAULT_SLIDING_WINDOW,
    DEFAULT_TRUNC_LEN,
    EVALUATOR_PRECISIONS,
)

# The name in usage lines and messages when main() is called from Python; commands show the name they
# were started by (commandline/running.py).
PROG = "compute_key_tokens.py"
# A shard of 256 documents (or 10 minutes) at most: a killed run loses that much scoring per process;
# a commit costs a file rename and a rewrite of state.json (docs/benchmarks.md).
DEFAULT_SHARD_DOCUMENTS = 256
DEFAULT_SHARD_MINUTES = 10.0


def assign_to_processes(lengths: list[int], num_processes: int) -> list[list[int]]:
    """Split documents across processes, balancing total length (longest first, to the least loaded).

    Returns:
        per process, the indices into ``lengths`` it scores, in increasing order.
    """
    loads = [0] * num_processes
    shares: list[list[int]] = [[] for _ in range(num_processes)]
    for index in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        target = loads.index(min(loads))
        shares[target].append(index)
        loads[target] += lengths[index]
    return [sorted(share) for share in shares]


def build_parser(prog: str = PROG) -> argparse.ArgumentParser:
    """The command line's parser (imports no torch, so ``--help`` is quick)."""
    parser = tool_parser(prog, __doc__)
    parser.add_argument(
        "--corpus", required=True, help="a .jsonl file, a datasets directory or a Hub dataset name (required)"
    )
    parser.add_argument("--split", default="train", help="split of a Hub dataset or DatasetDict (default: train)")
    parser.add_argument("--text-column", default="text", help="field / column holding the texts (default: text)")
    parser.add_argument(
        "--evaluator",
        required=True,
        help="Hub id, local path, *.gguf file or short name (gemma-3-270m, smollm2-135m) of the evaluator model (required)",
    )
    parser.add_argument(
        "--output", required=True, help="the cache directory (required; created, or updated atomically)"
    )
    parser.add_argument(
        "--trunc-len",
        type=int,
        nargs="+",
        default=DEFAULT_TRUNC_LEN,
        help="K: context length of the short-context scores; several (a ladder, e.g. 1024 2048 4096) share one "
        "long pass and give one row per K (default %(default)s)",
    )
    parser.add_argument(
        "--sliding-window",
        type=int,
        default=DEFAULT_SLIDING_WINDOW,
        help="d: stride of the short-context windows (default %(default)s)",
    )
    parser.add_argument(
        "--max-length",
        type=int,
        default=None,
        help="keep the first N evaluator tokens of each text (special tokens not counted; the "
        "cache stores the cut text). The same meaning as the metric's max_length: evaluator "
        "tokens, the unit of K and d, so the cut text is the same for every evaluated model "
        "and compute(..., key_tokens=<output>, max_length=N) finds it",
    )
    parser.add_argument(
        "--max-tokens-per-batch",
        type=int,
        default=DEFAULT_MAX_TOKENS_PER_BATCH,
        help="tokens of short windows the evaluator scores in one batch; lower it when the "
        "evaluator runs out of memory (default %(default)s)",
    )
    parser.add_argument(
        "--torch-dtype",
        default=None,
        help="the evaluator's dtype, e.g. bfloat16 (default: bfloat16 on GPU, float32 on CPU)",
    )
    parser.add_argument(
        "--device",
        default=None,
        help="single process only: cuda, cpu or auto (shard a large evaluator over the GPUs) "
        "(default: the process's device, a GPU if there is one)",
    )
    parser.add_argument(
        "--tensor-parallel",
        type=int,
        default=1,
        help="split the evaluator over N GPUs by tensor parallelism (its family's plan in transformers: Llama, "
        "Mistral, Qwen2...); launch N processes per group, one per GPU, with torchrun or accelerate launch "
        "(default: 1, no split)",
    )
    parser.add_argument(
        "--window-bos",
        action="store_true",
        help="opt-in: BOS at the head of each short window (default: off, as the official code)",
    )
    parser.add_argument(
        "--no-special-tokens",
        action="store_true",
        help="tokenize without the evaluator's special tokens (default: with them, as the official code)",
    )
    parser.add_argument(
        "--evaluator-precision",
        choices=EVALUATOR_PRECISIONS,
        default=DEFAULT_EVALUATOR_PRECISION,
        help="bf16: the evaluator as loaded, the exact reference; tf32: the evaluator in float32 with TF32 "
        "products (a CUDA GPU): a float32 evaluator's key tokens at under 2x bf16's time; "
        "fp8: the Linear layers of its blocks in float8 "
        '(torchao, pip install "longppl-hf[fp8]"; a GPU of compute capability 8.9+), faster and approximate, '
        "its rows kept apart from bf16 rows in the cache (default: %(default)s)",
    )
    parser.add_argument(
        "--torch-compile",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="compile the evaluator's blocks with torch.compile (default: on with --evaluator-precision fp8, "
        "off otherwise)",
    )
    parser.add_argument(
        "--pack-documents",
        action="store_true",
        help="let documents of the same length share forward passes: several times faster for many short "
        "documents on a GPU, but rows then differ from rows scored alone by float rounding, so a cache of N "
        "processes is no longer bit-identical to one process's (default: off; docs/cache.md)",
    )
    parser.add_argument(
        "--shard-documents",
        type=int,
        default=DEFAULT_SHARD_DOCUMENTS,
        help="commit each process's rows to the cache every N documents (a shard), so that a killed run keeps "
        "them and a rerun resumes (default %(default)s)",
    )
    parser.add_argument(
        "--shard-minutes",
        type=float,
        default=DEFAULT_SHARD_MINUTES,
        help="and at the latest after the first document that ends M minutes after the shard began "
        "(default %(default)s)",
    )
    parser.add_argument(
        "--alpha",
        type=float,
        default=DEFAULT_ALPHA,
        help="LSD threshold, only for the summary's key-token share (default %(default)s)",
    )
    parser.add_argument(
        "--beta",
        type=float,
        default=DEFAULT_BETA,
        help="LCL threshold, only for the summary's key-token share (default %(default)s)",
    )
    return parser


def parse_args(argv=None, prog: str = PROG):
    """The parsed options, checked as the metric checks them (usage errors exit through argparse)."""
    parser = build_parser(prog)
    args = parser.parse_args(argv)
    # The library's own checks (longppl.settings), so the script refuses what the metric refuses, with
    # the same words, before anything is loaded or scored.
    from longppl.settings import KeyTokenRule, KeyTokenSettings, require_int

    try:  # the settings travel on as objects (args.settings, args.rule), checked here once
        ladder = args.trunc_len if isinstance(args.trunc_len, list) else [args.trunc_len]
        # one row per K; the first K's settings are the run's (its summary)
        args.ladder = [
            KeyTokenSettings(k, args.sliding_window, not args.no_special_tokens, args.window_bos)
            for k in dict.fromkeys(ladder)
        ]
        args.settings = args.ladder[0]
        args.rule = KeyTokenRule.of(args)
        require_int("max_tokens_per_batch", args.max_tokens_per_batch)
        require_int("--tensor-parallel", args.tensor_parallel)
        require_int("--shard-documents", args.shard_documents)
        if not args.shard_minutes > 0:
            raise ValueError(f"--shard-minutes must be a positive number of minutes, got {args.shard_minutes}")
        if args.max_length is not None:
            require_int("max_length", args.max_length, minimum=2)
    except ValueError as err:
        parser.error(str(err))
    return args


def main(argv=None, prog: str = PROG) -> dict:
    """Run the tool; returns the summary (documents, scored, tokens, key_share, seconds, output).

    Raises:
        ValueError: an input the tool cannot use (an empty or malformed corpus, ``--device`` with
            several processes...), with what to do; the command prints it as ``<prog>: error: ...``.
    """
    args = parse_args(argv, prog)  # before the heavy imports: `--help` and usage errors answer at once
    # A precision this run cannot have (fp8 on a --device that is no GPU, in a --torch-dtype other than
    # bfloat16, without torchao), and where the corpus and the evaluator are (here, or on the Hub: asked
    # once), are settled before torch loads, so that a mistake fails in a second. Whether the process's
    # own device is a GPU with float8 tensor cores only torch can say: ScoringJob checks that.
    from longppl.commandline.corpus import locate_corpus
    from longppl.models.precision import check_precision_request, precision_dtype
    from longppl.models.sources import check_model_source

    # checked once into the typed value that travels on (ScoringJob, the fingerprint, the conversion)
    args.evaluator_precision = check_precision_request(
        args.evaluator_precision, args.device, args.torch_dtype, "--evaluator-precision"
    )
    args.torch_dtype = precision_dtype(args.evaluator_precision, args.torch_dtype)  # tf32: a float32 evaluator
    locate_corpus(args.corpus, "--corpus")
    check_model_source(args.evaluator, "--evaluator", tokenizer=True)
    import torch

    if args.tensor_parallel > 1:
        check_tensor_parallel(args, torch)
    from accelerate import PartialState

    start = time.perf_counter()
    # cpu=True where there is no GPU: accelerate then joins the processes over gloo.
    state = PartialState(cpu=not torch.cuda.is_available())
    try:
        return _run(args, state, start, prog)
    finally:
        if state.use_distributed:
            state.destroy_process_group()  # a gloo group left open aborts the process at exit


def check_tensor_parallel(args, torch) -> None:
    """Refuse what ``--tensor-parallel`` cannot do, from the evaluator's config and the launcher's
    environment, before any process group is joined or any weight loaded."""
    from transformers import AutoConfig

    from longppl.parallel.tensor_parallel import check_launch, tensor_parallel_plan

    if args.device is not None:
        raise ValueError(
            f"--device {args.device} with --tensor-parallel {args.tensor_parallel}: each rank of a tensor-parallel "
            "group uses its own GPU; leave --device out (or use --device auto alone, without --tensor-parallel)."
        )
    from longppl.models.sources import check_model_source

    config = AutoConfig.from_pretrained(check_model_source(args.evaluator, "--evaluator"))
    tensor_parallel_plan(config, args.tensor_parallel, "--tensor-parallel")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    check_launch(
        args.tensor_parallel,
        world,
        int(os.environ.get("LOCAL_WORLD_SIZE", str(world))),
        torch.cuda.device_count() if torch.cuda.is_available() else None,
        "--tensor-parallel",
    )


def _run(args, state, start: float, prog: str = PROG) -> dict:
    from longppl.cache.key_token_cache import KeyTokenCache
    from longppl.commandline.threads import choose_torch_threads

    if args.device is not None and state.num_processes > 1:
        raise ValueError("--device is for a single process; under accelerate launch each process uses its own device.")
    device = args.device or str(state.device)
    if device == "cpu":  # the processes share the cores (unless OMP_NUM_THREADS says otherwise)
        choose_torch_threads(max(1, (os.cpu_count() or 1) // state.num_processes))
    job = ScoringJob(args, device)

    # Every process reads the same cache before any commits to it, so all agree on what is missing.
    cache = KeyTokenCache.load(args.output, create=True)  # read once (every shard's checksum is verified)
    missing = job.missing(list(dict.fromkeys(job.texts)), cache)
    if missing and state.is_main_process:
        warn_if_another_evaluator(cache, job.identity, args.output, prog)
    state.wait_for_everyone()
    # A tensor-parallel group of N ranks is one worker: its ranks score the same documents, its first writes.
    group_size = args.tensor_parallel
    worker, writes = state.process_index // group_size, state.process_index % group_size == 0
    shares = assign_to_processes([len(t) for t in missing], state.num_processes // group_size)
    job.score([missing[i] for i in shares[worker]], writes, "process 0" if state.is_main_process else None)
    state.wait_for_everyone()
    from accelerate.utils import gather_object

    # the documents each worker scored past the evaluator's trained length, said once for the run (a
    # tensor-parallel group's ranks scored the same documents: its writer counts them)
    past = gather_object([(job.past_positions if writes else 0, job.positions)])

    summary = {}
    if state.is_main_process:
        count, positions = sum(n for n, _ in past), next((p for _, p in past if p is not None), None)
        if count:
            print(
                f"{prog}: warning: {past_positions_note(args.evaluator, positions, count, len(missing))}",
                file=sys.stderr,
            )
        cache = KeyTokenCache.load(args.output)
        summary = summarize(
            cache, job.texts, args.settings, job.identity, len(missing), args, time.perf_counter() - start, prog
        )
    state.wait_for_everyone()
    return summary


def warn_if_another_evaluator(cache, identity, output: str, prog: str) -> None:
    """Say it (one warning line on stderr) when the rows about to be added are the first of this
    evaluator in a cache that holds another's: the cache keeps both, and the commands that read it
    then need ``--evaluator`` to choose."""
    others = [c for c in cache.configurations() if c["evaluator_fingerprint"] != identity.fingerprint]
    if not others or len(others) < len(cache.configurations()):
        return
    # with the dtype: the same weights in another precision (bfloat16+fp8) are another evaluator
    held = ", ".join(
        dict.fromkeys(f"{n or '(unnamed)'} in {c['evaluator_dtype']}" for c in others for n in c["evaluator_names"])
    )
    print(
        f"{prog}: warning: --output {output} already holds rows of another evaluator ({held}); the rows of "
        f"{identity.name or 'this evaluator'} in {identity.dtype} are added beside them, and longppl evaluate / "
        "visualize will need --evaluator to choose (use another --output to keep one evaluator per cache).",
        file=sys.stderr,
        flush=True,
    )


class ScoringJob:
    """The corpus, the evaluator's tokenizer and identity of one ``longppl score`` run, and the
    scoring of a share of the corpus into the cache, committed shard by shard.

    Shared by the ``accelerate launch`` path (:func:`main`) and the datatrove step
    (``score_pipeline``). Building one reads the corpus and the tokenizer, and loads the evaluator
    only where its identity needs the weights (a Hub id that does not resolve to a commit).

    Attributes:
        texts: the corpus's documents (after ``--max-length``), in corpus order.
        identity: the evaluator's ``ModelIdentity`` (its fingerprint keys the cache's rows).
    """

    def __init__(self, args, device: str):
        import datasets

        from longppl.cache.key_token_cache import cache_directory
        from longppl.commandline.corpus import read_documents
        from longppl.core.scoring import truncate_texts
        from longppl.models.fingerprints import ModelIdentity
        from longppl.models.loading import load_model, load_tokenizer, resolve_dtype
        from longppl.models.precision import check_precision

        self.args, self.device = args, device
        # Before anything is read or loaded: a precision this device cannot run, an output that is not a
        # cache's folder or cannot be written.
        dtype = resolve_dtype(args.torch_dtype, device)
        self.precision = check_precision(args.evaluator_precision, device, dtype, "--evaluator-precision")
        cache_directory(args.output, argument="--output", create=True)
        texts = read_documents(args.corpus, args.text_column, args.split, "--corpus")
        if not texts:
            raise ValueError(f"{args.corpus!r} holds no documents.")
        datasets.disable_progress_bars()  # shards are small writes; our lines are the progress that counts
        self.tokenizer = load_tokenizer(args.evaluator)
        self.texts = truncate_texts(texts, self.tokenizer, args.max_length)
        self.identity = ModelIdentity.of_checkpoint(args.evaluator, dtype)
        self.evaluator = None
        if self.identity is None and args.tensor_parallel > 1:
            raise ValueError(
                f"--evaluator {args.evaluator!r}: its Hub revision cannot be resolved to a commit (offline?), and a "
                "split evaluator cannot be fingerprinted from its weights (each rank holds a part); pass a local "
                "copy's folder."
            )
        if self.identity is None:  # a Hub id that cannot be resolved to a commit: fingerprint the loaded weights
            self.evaluator = load_model(args.evaluator, device, args.torch_dtype)  # its tokenizer is loaded above
            self.identity = ModelIdentity.of_model(self.evaluator, self.tokenizer)  # bf16 weights, as loaded
        # fp8 rows are keyed apart from bf16 rows of the same weights; bf16 keeps its identity
        self.identity = self.identity.with_precision(self.precision)
        self.cached: set[tuple] = set()  # (text, settings) with a row in the cache (missing)
        # what `score` found: documents longer than the evaluator's trained positions (max_position_embeddings)
        self.past_positions, self.positions = 0, None
        self.first = {}
        for index, text in enumerate(self.texts):
            self.first.setdefault(text, index)

    def missing(self, texts: list[str], cache=None) -> list[str]:
        """Those of ``texts`` that the cache lacks a row for (this evaluator, under any settings of
        the ladder), in order. ``cache``: the ``KeyTokenCache`` already read, else it is read here."""
        from longppl.cache.key_token_cache import KeyTokenCache

        if cache is None:
            cache = KeyTokenCache.load(self.args.output, create=True)
        found = [cache.find(texts, settings, self.identity.fingerprint) for settings in self.args.ladder]
        # (text, K) pairs already cached: a rung added to a ladder scores the documents again, but
        # only the new rung's rows are committed (score)
        self.cached = {
            (text, settings)
            for settings, rows in zip(self.args.ladder, found)
            for text, row in zip(texts, rows)
            if row is not None
        }
        return [text for text, *rows in zip(texts, *found) if None in rows]

    def score(self, texts: list[str], writes: bool = True, name: str | None = None) -> None:
        """Score ``texts`` and commit their rows to the cache, one shard per block
        (:func:`scored_shards`); ``writes=False`` scores without committing (a tensor-parallel rank
        other than its group's first). ``name``: print a line per commit, naming the worker.

        Documents longer than the positions the evaluator was trained on are scored without a warning
        each (the scoring core's ``PastPositionsWarning``, one per document here): their count is added
        to ``past_positions`` (and the positions kept in ``positions``), for the caller to say once
        (:func:`past_positions_note`)."""
        import warnings

        import datasets

        from longppl.cache.key_token_cache import append_rows, key_token_rows
        from longppl.core.scoring import PastPositionsWarning, position_limits, score_context_ladder
        from longppl.models.loading import load_model
        from longppl.models.precision import to_precision
        from longppl.settings import evaluator_compiles

        args = self.args
        if not texts:
            return
        if self.evaluator is None:
            self.evaluator = load_model(args.evaluator, self.device, args.torch_dtype, args.tensor_parallel)
        # After the tensor-parallel split (each rank converts its shards) and the fingerprint. Each later
        # block finds its layers converted already: to_precision skips them.
        self.evaluator = to_precision(self.evaluator, self.precision)
        self.positions = position_limits(self.evaluator)[0]

        # the rungs some of these documents lack (a ladder extended: only the new K); a rung's rows do
        # not depend on which other rungs share the long pass
        ladder = [settings for settings in args.ladder if any((text, settings) not in self.cached for text in texts)]

        def score(block: list[str]) -> list[tuple]:  # per document, its scores under each K of ``ladder``
            rungs = score_context_ladder(
                self.evaluator,
                self.tokenizer,
                block,
                ladder,
                max_tokens_per_batch=args.max_tokens_per_batch,
                progress=False,
                torch_compile=evaluator_compiles(args.torch_compile, self.precision),
                per_document=True,
                pack_documents=args.pack_documents,
                text_names=[f"document {self.first[text]} of --corpus (counted from 0)" for text in block],
            )
            return list(zip(*rungs))

        committed = 0
        with warnings.catch_warnings():  # the shards' scoring runs inside: its per-document warnings are counted
            warnings.simplefilter("ignore", PastPositionsWarning)
            for block, scores in scored_shards(
                texts, score, args.shard_documents, args.shard_minutes * 60, args.pack_documents
            ):
                if self.positions is not None:  # scores[document][rung]: every rung holds the document's tokens
                    self.past_positions += sum(document[0].input_ids.shape[0] > self.positions for document in scores)
                if writes:  # one shard per block, committed at once: a kill loses the block in progress only
                    rows = []
                    for rung, settings in enumerate(ladder):  # each document's rows that the cache lacks
                        new = [i for i, text in enumerate(block) if (text, settings) not in self.cached]
                        if new:
                            rows.append(
                                key_token_rows(
                                    [block[i] for i in new], [scores[i][rung] for i in new], settings, self.identity
                                )
                            )
                    append_rows(args.output, datasets.concatenate_datasets(rows) if len(rows) > 1 else rows[0])
                    committed += len(block)
                    if name is not None:
                        print(f"committed {committed} of {len(texts)} documents of {name}", flush=True)


def past_positions_note(evaluator: str, positions: int | None, count: int, scored: int) -> str:
    """The one line saying that ``count`` of the ``scored`` documents were longer than the ``positions``
    the evaluator ``evaluator`` was trained on (``ScoringJob.past_positions``)."""
    return (
        f"{count} of the {scored} documents scored are longer than the {positions} positions the evaluator "
        f"{evaluator!r} was trained on (max_position_embeddings): its log-probs past position {positions} "
        "measure extrapolation. Cut the documents with --max-length if that is not intended."
    )


def scored_shards(texts: list[str], score, documents: int, seconds: float, together: bool):
    """Score ``texts`` in blocks that each become one shard of the cache.

    A block closes after ``documents`` documents, or after the first document that ends ``seconds``
    or more after the block began, whichever comes first. Documents are scored one by one (their
    rows do not depend on the others, ``per_document``), unless ``together`` (``--pack-documents``:
    documents share passes), where each block of ``documents`` is scored in one call.

    Args:
        score: ``texts -> [EvaluatorScores]``.
    Yields:
        ``(block texts, their scores)`` in the order of ``texts``.
    """
    done = 0
    while done < len(texts):
        if together:
            block = texts[done : done + documents]
            yield block, score(block)
            done += len(block)
            continue
        began, block, scores = time.monotonic(), [], []
        while done < len(texts) and len(block) < documents and (not block or time.monotonic() - began < seconds):
            block.append(texts[done])
            scores.extend(score([texts[done]]))
            done += 1
        yield block, scores


def summarize(cache, texts, settings, identity, scored, args, seconds, prog: str = PROG) -> dict:
    """Print and return documents, tokens and key-token share of the corpus, and the seconds taken.

    Documents too short for any short-context score under a K of ``args.ladder`` get one warning
    line on stderr first (:func:`too_short_note`)."""
    rows = cache.find(texts, settings, identity.fingerprint)
    n_tokens = n_key = 0
    lengths = {}  # evaluator tokens of each row's document (special tokens included, as K counts them)
    for row in dict.fromkeys(rows):
        scores = cache.scores(row)
        lengths[row] = scores.input_ids.shape[0]
        n_tokens += scores.input_ids.shape[0]
        n_key += int(scores.key_mask(args.rule).sum())
    note = too_short_note([lengths[row] for row in rows], [rung.trunc_len for rung in args.ladder])
    if note is not None:
        print(f"{prog}: warning: {note}", file=sys.stderr, flush=True)
    summary = dict(
        documents=len(texts),
        scored=scored,
        tokens=n_tokens,
        key_share=n_key / n_tokens if n_tokens else float("nan"),
        seconds=seconds,
        output=os.path.abspath(args.output),
    )
    print(
        f"{summary['documents']} documents ({scored} scored now, {len(set(texts)) - scored} already cached), "
        f"{n_tokens:,} evaluator tokens, key tokens ({args.rule.key_condition()}): "
        f"{summary['key_share']:.2%}, {seconds:.1f} s -> {summary['output']}",
        flush=True,
    )
    return summary


def too_short_note(lengths: list[int], ladder: list[int]) -> str | None:
    """The one line saying how many documents have no short-context score, or ``None`` when every
    document has some under every K.

    A document of ``n`` evaluator tokens (special tokens included) has short windows only when
    ``n > K`` (the first K tokens have no short context: ``core.windows``), so a shorter one has no
    LSD, no key tokens and no LongPPL; LongPPL leaves it out.

    Args:
        lengths: ``[documents]`` evaluator tokens of each document of the corpus.
        ladder: the K of each row the run keeps (``--trunc-len``).
    """
    short = {k: sum(n <= k for n in lengths) for k in ladder}
    if not any(short.values()):
        return None
    total, longest = len(lengths), max(lengths, default=0)
    if all(count == total for count in short.values()):
        smallest = f"K={min(ladder)}" + (" (the smallest --trunc-len given)" if len(ladder) > 1 else "")
        return (
            f"none of the {total} documents is longer than {smallest} evaluator tokens (the longest has {longest}), "
            "so no token has a short-context score: this cache can give no key tokens and no LongPPL. Score again "
            f"with a --trunc-len well below {longest}, or use longer documents."
        )
    counts = ", ".join(f"{count} of {total} at K={k}" for k, count in short.items() if count)
    return (
        f"documents of at most K evaluator tokens have no short-context score, hence no key tokens, and LongPPL "
        f"leaves them out: {counts}. A smaller --trunc-len, or longer documents, would include them."
    )


def cli(argv=None) -> int:
    """The ``longppl-score`` command: :func:`main`, with bad inputs reported as ``prog: error: ...``."""
    return run_command(main, argv)


if __name__ == "__main__":
    raise SystemExit(cli())
