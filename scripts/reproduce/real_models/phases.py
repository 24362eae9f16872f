"""The device phases of the LongPPL study on real models (docs/reproduction.md, "LongPPL on real
models — analysis plan"). Each phase appends one JSON line per finished unit to a records file
under ``<run>/records/`` and skips the units already there, so a call cut short, or the next
session's call, goes on where the last one stopped. A phase starts no new unit once
``budget_seconds`` have passed since it began, so each call fits one device call of 10 minutes
when the budget leaves room for the last unit (a member's ``score`` took 117-423 s on an H200).
Processes run side by side on one run folder (``--device cuda:<i>`` each) share the units of every
phase that walks them through ``progress.pending`` (``calibrate``, ``score``, ``documents``, ``finetune``, ``chain``,
the window order of ``instrument``, and the LongCE phases): each unit is claimed while it runs (``claims``), so no
fixed split of ``--members`` is needed. (What every process needs made once, the evaluators' scores of a
corpus, the training books' token ids and ``longce-weights``, is written by :func:`npz_once` instead: the
others wait on the file's lock.)

- ``calibrate`` (``calibration.jsonl``, one row per evaluator): alpha by the null-document rule
  (``calibration.calibrate_alpha``): the smallest alpha of the grid whose key tokens on null
  documents (the long context replaced by another book) are at most 10% of those on the real
  documents, in the last K positions. It runs before any member is scored: ``instrument`` and
  ``score`` refuse to start without it. An evaluator with no qualifying alpha gets a row saying so
  (``"alpha": None``); the later phases use the paper's alpha = 2 for it (description only).
- ``instrument`` (``instrument.jsonl``): the key-token share on natural text per evaluator; the
  key-token share on the answer tokens of lines documents (answers beyond K); LongPPL and PPL of
  the windowed Gemma members (RoPE as trained), for the order by window.
- ``score`` (``members.jsonl``, one row per member): LongPPL and PPL under each evaluator, and
  accuracy on every task set.
- ``documents`` (``task_documents.jsonl``, one row per member): LongPPL and PPL under each
  evaluator on the task documents themselves (lines documents, answers beyond K).
- ``chain``: ``finetune``, ``score`` and ``documents`` a member at a time (:func:`chain`), so that a
  session's end loses no fine-tuned member but the ones in hand.

Evaluator scores of a corpus are kept in ``<run>/scores/`` (NumPy arrays, no pickle) and read by
the later phases instead of being computed again.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time

import numpy as np

from . import members as population
from . import tasks
from .analysis import PAPER_ALPHA
from .progress import Budget, Records, pending


@dataclasses.dataclass(frozen=True)
class Sizes:
    """The phases' numbers. ``PLAN``: the analysis plan's; ``SMALL``: a CPU smoke run's."""

    gemma_window: tuple[int, int]  # K, d of the Gemma evaluator (the paper's 4096, 1024)
    smollm2_window: tuple[int, int]  # K, d of the SmolLM2 evaluator (its 8k context: 1024, 256)
    document_length: int  # natural documents, Gemma tokens
    smollm2_document_length: int  # the SmolLM2 evaluator's documents, its tokens
    documents: int  # natural book documents
    govreport_length: int  # GovReport documents, Gemma tokens
    calibration_documents: int
    lengths: tuple[int, ...]  # task lengths
    beyond: int  # a task's answer lies more than this many tokens back (the paper's K), whatever the tokenizer
    cases: int  # cases per task set
    max_new_tokens: int
    batch_size: int
    max_tokens_per_batch: int
    prefill: str = "batch"  # greedy_answers': "rows" reads each prompt alone (window layers in blocks)
    task_documents: int = 8  # lines documents a task length whose LongPPL and PPL a member gets (``documents``)
    finetune_length: int | None = None  # None: each member's own extended length
    finetune_max_steps: int | None = None  # None: each member's own steps
    # the plan's grid, extended under its "Deviations" before any member was scored
    grid: tuple[float, ...] = (0.5, 1.0, 1.5, 2.0, 2.5, 3.0, 4.0, 5.0, 6.0, 8.0, 10.0, 12.0, 16.0)
    beta: float = -2.0
    max_null_ratio: float = 0.10


PLAN = Sizes(
    gemma_window=(4096, 1024),
    smollm2_window=(1024, 256),
    document_length=24576,  # so that SmolLM2 members' tokens of the same text stay within 32k
    smollm2_document_length=8192,
    documents=16,
    govreport_length=8192,
    calibration_documents=16,
    lengths=(8192, 16384, 24576, 32768),
    beyond=4096,
    cases=50,
    max_new_tokens=16,
    batch_size=4,
    max_tokens_per_batch=65536,
    prefill="rows",  # the reader of generated answers: "Deviations" of docs/reproduction.md
)
# random tiny models have no key tokens by the plan's rule (their LSD is noise on both document
# kinds, their LCL far below -2): the smoke sizes accept any ratio and any LCL, to exercise the path
SMALL = Sizes(
    gemma_window=(128, 64),
    smollm2_window=(128, 64),
    document_length=640,
    smollm2_document_length=512,
    documents=3,
    govreport_length=256,
    calibration_documents=3,
    lengths=(448, 640),
    beyond=128,
    cases=2,
    max_new_tokens=6,
    batch_size=2,
    max_tokens_per_batch=4096,
    finetune_length=256,
    finetune_max_steps=2,
    grid=(0.0, 0.5),
    beta=-100.0,
    max_null_ratio=1e9,
    prefill=PLAN.prefill,
)


@dataclasses.dataclass
class Run:
    """One run folder and what its phases read."""

    root: str
    books: str
    gemma: str
    smollm2: str
    device: str
    budget_seconds: float
    members: tuple[str, ...] | None
    sizes: Sizes
    log_lines: list = dataclasses.field(default_factory=list)

    @classmethod
    def from_args(cls, args) -> Run:
        import torch

        device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
        chosen = tuple(m.strip() for m in args.members.split(",")) if args.members else None
        sizes = SMALL if args.small else PLAN
        return cls(args.run, args.books, args.gemma, args.smollm2, device, args.budget_seconds, chosen, sizes)

    def records(self, name: str) -> Records:
        return Records(os.path.join(self.root, "records", f"{name}.jsonl"))

    def log(self, text: str) -> None:
        print(text, flush=True)
        self.log_lines.append(text)


# ------------------------------------------------------------------ models, texts, evaluator scores


def base_folder(name: str, argument: str) -> str:
    """The model folder of a short name, a ``*.gguf`` path or a folder (``longppl``'s named models)."""
    from longppl.models.sources import check_model_source

    return check_model_source(name, argument)


def load_plain(folder: str, device: str):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from longppl.models.precision import to_precision

    model = AutoModelForCausalLM.from_pretrained(folder, attn_implementation="sdpa").to(device).eval()
    if device.startswith("cuda"):
        # evaluator_precision="tf32": float32's key tokens (docs/benchmarks.md) at about 0.55x its time,
        # for the scoring passes only
        model = to_precision(model, "tf32")
    return model, AutoTokenizer.from_pretrained(folder)


def member_dtype(device: str):
    """The members' precision: bf16 on a GPU (float32 on a CPU). The evaluators stay in float32
    with TF32 matmuls, whose key tokens are float32's; a member's own log-probs and answers in bf16
    move its LongPPL by well under the differences between members (docs/benchmarks.md), and keep
    its 32k-token passes on the fused attention kernels (float32 falls back to the math kernel:
    about 4x the time and 43 GiB at 32k)."""
    import torch

    return torch.bfloat16 if device.startswith("cuda") else torch.float32


@dataclasses.dataclass(frozen=True)
class Evaluator:
    name: str
    folder: str
    window: tuple[int, int]
    length: int  # its natural documents' tokens
    context: int  # the positions it was trained on: task lengths beyond it are not scored by it


def evaluators(run: Run) -> list[Evaluator]:
    """Gemma 3 270M at full context (primary) and SmolLM2-135M at its 8k (cross-tokenizer)."""
    s = run.sizes
    return [
        Evaluator("gemma", base_folder(run.gemma, "--gemma"), s.gemma_window, s.document_length, s.lengths[-1]),
        Evaluator(
            "smollm2",
            base_folder(run.smollm2, "--smollm2"),
            s.smollm2_window,
            s.smollm2_document_length,
            s.smollm2_document_length,
        ),
    ]


def held_out_books(run: Run) -> list[str]:
    from ..common.books import read_books

    path = os.path.join(run.books, "validation.jsonl.gz")
    if not os.path.isfile(path):
        raise ValueError(f"No held-out books at {path}: pass --books, the folder with validation.jsonl.gz.")
    return read_books(path)


def book_ids(run: Run, tokenizer) -> list[np.ndarray]:
    return _tokenized((tokenizer, held_out_books(run)))


def _write_json(path: str, value) -> None:
    from longppl.atomic_files import write_file_atomically

    write_file_atomically(path, lambda handle: json.dump(value, handle))


def npz_once(path: str, make) -> bool:
    """Write ``path``, the ``.npz`` of the arrays ``make()`` returns (a ``{name: array}`` dict), unless
    it exists: once across processes side by side on one run folder, the first taking the file's
    lock (``atomic_files.directory_lock``) and writing it atomically while the others wait on the lock
    and then find it. Returns whether this process wrote it."""
    from longppl.atomic_files import directory_lock, write_file_atomically

    if os.path.isfile(path):
        return False
    with directory_lock(path):
        if os.path.isfile(path):  # written by another process while this one waited
            return False
        arrays = make()
        write_file_atomically(path, lambda handle: np.savez(handle, **arrays), binary=True)
    return True


def corpus_texts(run: Run, name: str, tokenizer, length: int, count: int, seed: int = 0) -> list[str]:
    """``count`` natural documents of ``length`` tokens of ``tokenizer``, as text, written once to
    ``<run>/documents/<name>.json``. The name's first word says the source: ``books...`` held-out
    book bodies, ``govreport...`` the repository's CRS reports that reach ``length``.

    Raises:
        ValueError: a name that starts with neither."""
    from ..common.corpus_chunks import body_chunks

    if not name.startswith(("books", "govreport")):
        raise ValueError(
            f"Unknown corpus {name!r}: start its name with 'books' (held-out book bodies) or 'govreport'"
            " (the repository's CRS reports)."
        )
    path = os.path.join(run.root, "documents", f"{name}.json")
    if os.path.isfile(path):
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    if name.startswith("books"):
        chunks = body_chunks(book_ids(run, tokenizer), length, count, per_book_cap=4, seed=seed)
        texts = tokenizer.batch_decode(chunks.tolist())
    else:  # govreport
        source = os.path.join(os.path.dirname(__file__), "..", "..", "..", "tests", "data", "govreport_crs.jsonl")
        with open(source, encoding="utf-8") as f:
            reports = [json.loads(line)["text"] for line in f if line.strip()]
        texts = []
        for report in reports:
            ids = tokenizer(report, add_special_tokens=False)["input_ids"]
            if len(ids) >= length:
                texts.append(tokenizer.decode(ids[:length]))
        texts = texts[:count]
    _write_json(path, texts)
    return texts


def evaluator_scores(run: Run, evaluator: Evaluator, corpus: str, texts: list[str], model=None, tokenizer=None):
    """The evaluator's ``EvaluatorScores`` of ``texts``, computed once and kept in
    ``<run>/scores/<evaluator>-<corpus>.npz`` (flat arrays and per-document lengths)."""
    from longppl.core.scoring import EvaluatorScores, score_with_evaluator
    from longppl.settings import KeyTokenSettings

    path = os.path.join(run.root, "scores", f"{evaluator.name}-{corpus}.npz")

    def read():
        with np.load(path, allow_pickle=False) as data:
            bounds = np.concatenate([[0], np.cumsum(data["lengths"])])
            return [
                EvaluatorScores(
                    data["input_ids"][a:b], data["offsets"][a:b], data["lp_long"][a:b], data["lp_short"][a:b]
                )
                for a, b in zip(bounds[:-1], bounds[1:])
            ]

    def make() -> dict:
        nonlocal model, tokenizer
        if model is None:
            model, tokenizer = load_plain(evaluator.folder, run.device)
        settings = KeyTokenSettings(*evaluator.window)
        scores = score_with_evaluator(
            model, tokenizer, texts, settings, max_tokens_per_batch=run.sizes.max_tokens_per_batch, progress=False
        )
        return dict(
            lengths=np.array([len(s.input_ids) for s in scores]),
            input_ids=np.concatenate([s.input_ids for s in scores]),
            offsets=np.concatenate([s.offsets for s in scores]),
            lp_long=np.concatenate([s.lp_long for s in scores]),
            lp_short=np.concatenate([s.lp_short for s in scores]),
        )

    # processes side by side wait for the one scoring the corpus instead of each scoring it again
    npz_once(path, make)
    return read()


def alphas(run: Run) -> dict[str, float]:
    """Each calibrated evaluator's alpha; a ValueError naming the phase when Gemma's is missing.
    An evaluator whose calibration found no alpha of the grid (its row's ``"alpha"`` is None) gets
    the paper's alpha = 2: the plan reports its LongPPL there as description only."""
    found = {
        row["evaluator"]: PAPER_ALPHA if row["alpha"] is None else row["alpha"]
        for row in run.records("calibration").rows()
    }
    if "gemma" not in found:
        raise ValueError("No calibration of the Gemma evaluator in the run's records: run the 'calibrate' phase first.")
    return found


# ------------------------------------------------------------------ prepare


def _build_set(job: tuple) -> str:
    """One task set, in a worker process: ``(run fields, tokenizer name, folder, kind, length)``."""
    fields, tokenizer_name, folder, kind, length = job
    from transformers import AutoTokenizer

    run = Run(**fields)
    _cases(run, tokenizer_name, AutoTokenizer.from_pretrained(folder), kind, length)
    return f"{tokenizer_name}/{kind}-{length}"


def prepare(run: Run, workers: int | None = None) -> None:
    """The documents and every task set of both tokenizers, written once (CPU only; the task sets
    side by side in ``workers`` processes, default one per CPU core). The later phases read them."""
    jobs, fields = [], run_fields(run)
    for evaluator in evaluators(run):
        natural_corpora(run, evaluator)
        for name, kind, length in tasks.task_sets(run.sizes.lengths, run.sizes.cases, 0):
            if not os.path.isfile(os.path.join(run.root, "tasks", evaluator.name, f"{name}.jsonl")):
                jobs.append((fields, evaluator.name, evaluator.folder, kind, length))
    if not jobs:
        run.log("prepare: every task set kept")
        return
    done = in_processes(_build_set, jobs, workers)
    run.log(f"prepare: {len(done)} task sets written ({', '.join(done)})")


#: The default cap on :func:`in_processes`' processes: each spawned one imports torch and
#: transformers anew (hundreds of MB), and the jobs here (task sets, book groups) gain little past it.
MAX_PROCESSES = 16


def run_fields(run: Run) -> dict:
    """``run``'s fields, for ``Run(**fields)`` in a worker process."""
    return {f.name: getattr(run, f.name) for f in dataclasses.fields(run) if f.name != "log_lines"}


def process_count(jobs: int, workers: int | None = None) -> int:
    """How many processes :func:`in_processes` runs ``jobs`` jobs in (at least 1)."""
    return max(1, min(jobs, workers or min(os.cpu_count() or 1, MAX_PROCESSES)))


def in_processes(function, jobs: list, workers: int | None = None) -> list:
    """``[function(job) for job in jobs]``, side by side in up to ``workers`` processes (default one
    per CPU core, at most :data:`MAX_PROCESSES`), or in this process when one would do. ``function`` is
    a module-level function and each job picklable. The processes are spawned, not forked: the caller
    may hold a CUDA context and threads (a worker between two units), which a forked child must not
    inherit."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    count = process_count(len(jobs), workers)
    if count <= 1:
        return [function(job) for job in jobs]
    with ProcessPoolExecutor(count, mp_context=multiprocessing.get_context("spawn")) as pool:
        return list(pool.map(function, jobs))


# ------------------------------------------------------------------ calibrate


def calibrate(run: Run) -> None:
    """Alpha per evaluator, by the null-document rule, before any member is scored. An evaluator
    for which no alpha of the grid qualifies gets a row all the same (``"alpha": None``, ``"failed"``:
    why), a finished unit like any other: the next call keeps it, and the report reads it."""
    from longppl.core.scoring import score_with_evaluator
    from longppl.settings import KeyTokenSettings

    from ..common.calibration import calibrate_alpha
    from ..common.corpus_chunks import body_chunks, null_documents
    from ..common.stages import books_of_rows

    records, budget = run.records("calibration"), Budget(run.budget_seconds)
    for _, evaluator in pending(run, "calibrate", records, budget, ((e.name, e) for e in evaluators(run))):
        started = time.monotonic()
        model, tokenizer = load_plain(evaluator.folder, run.device)
        trunc_len, stride = evaluator.window
        ids = book_ids(run, tokenizer)
        length = 2 * trunc_len  # the compared positions, the last K, have the whole kept tail as short context
        real = body_chunks(ids, length, run.sizes.calibration_documents, per_book_cap=4, seed=1)
        null = null_documents(real, ids, trunc_len, 1, books_of_rows(real, ids))
        settings = KeyTokenSettings(trunc_len, stride)
        found = {}
        for name, docs in (("real", real), ("null", null)):
            texts = tokenizer.batch_decode(docs.tolist())
            scores = score_with_evaluator(
                model, tokenizer, texts, settings, max_tokens_per_batch=run.sizes.max_tokens_per_batch, progress=False
            )
            lsd = np.concatenate([(s.lp_long - s.lp_short)[len(s.lp_long) - trunc_len :] for s in scores])
            lcl = np.concatenate([s.lp_long[len(s.lp_long) - trunc_len :] for s in scores])
            found[name] = (lsd, lcl)
        result = calibrate_alpha(
            *found["real"],
            *found["null"],
            grid=run.sizes.grid,
            beta=run.sizes.beta,
            max_null_ratio=run.sizes.max_null_ratio,
            refuse=False,  # no alpha qualifying is the study's outcome (its "Deviations"), recorded
        )
        records.append(
            evaluator.name,
            {
                "evaluator": evaluator.name,
                **result,
                "grid": sorted(run.sizes.grid),
                "window": list(evaluator.window),
                "documents": len(real),
                "length": length,
                "seconds": time.monotonic() - started,
            },
        )
        if result["alpha"] is None:
            run.log(
                f"calibrate: {evaluator.name}: {result['failed']} Its LongPPL is scored at the paper's alpha "
                f"{PAPER_ALPHA:g}, as description only."
            )
        else:
            run.log(f"calibrate: {evaluator.name} alpha {result['alpha']}")


# ------------------------------------------------------------------ LongPPL of a model


def longppl_under(
    run: Run, evaluator: Evaluator, alpha: float, corpus: str, texts, model, tokenizer, context: int | None = None
) -> dict:
    """LongPPL and PPL (pooled over documents) of ``model`` on ``texts`` under ``evaluator``'s key
    tokens at ``alpha`` (the calibrated one) and the plan's beta, with per-document sums, and LongPPL
    at the paper's alpha = 2 beside (``"paper_alpha"``). With
    ``context``, every token of the model is predicted from at most that many tokens
    (``members.context_limited_log_probs``)."""
    import torch

    from longppl.core.scoring import (
        ModelScores,
        document_results,
        score_with_model,
        summarize_results,
        text_key_weights,
    )

    scores = evaluator_scores(run, evaluator, corpus, texts)
    model_scores = score_with_model(model, tokenizer, texts, run.sizes.max_tokens_per_batch, progress=False)
    if context is not None:
        limited = population.context_limited_log_probs(
            model, [torch.from_numpy(m.input_ids) for m in model_scores], context, run.sizes.max_tokens_per_batch
        )
        model_scores = [ModelScores(m.input_ids, m.offsets, lp.numpy()) for m, lp in zip(model_scores, limited)]

    def at(chosen: float) -> tuple[list, dict]:
        per_document = document_results(
            model_scores, text_key_weights(texts, scores, model_scores, chosen, run.sizes.beta)
        )
        return per_document, summarize_results(per_document, "pooled")

    per_document, summary = at(alpha)
    # the plan's sensitivity: the same scores at the paper's alpha (no forward pass more)
    paper = (per_document, summary) if alpha == PAPER_ALPHA else at(PAPER_ALPHA)
    return {
        "longppl": summary["longppl"],
        "ppl": summary["ppl"],
        "key_tokens": int(sum(r.n_key_tokens for r in per_document)),
        "tokens": int(sum(r.n_predicted for r in per_document)),
        "documents": {"key_nll": [r.key_nll for r in per_document], "nll": [r.nll for r in per_document]},
        "paper_alpha": {
            "alpha": PAPER_ALPHA,
            "longppl": paper[1]["longppl"],
            "key_tokens": int(sum(r.n_key_tokens for r in paper[0])),
        },
    }


def natural_corpora(run: Run, evaluator: Evaluator) -> dict[str, list[str]]:
    """The natural documents ``evaluator`` scores: books at its length (and GovReport for Gemma)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(evaluator.folder)
    found = {
        f"books-{evaluator.name}": corpus_texts(
            run, f"books-{evaluator.name}", tokenizer, evaluator.length, run.sizes.documents
        )
    }
    if evaluator.name == "gemma":
        found["govreport-gemma"] = corpus_texts(run, "govreport-gemma", tokenizer, run.sizes.govreport_length, 8)
    return found


def task_corpora(run: Run, evaluator: Evaluator) -> dict[str, list[str]]:
    """The task documents ``evaluator`` scores, whole (the prompt, then its reference answer): the
    first ``task_documents`` lines cases beyond K of every task length within its context, built
    with its tokenizer, in the order of the lengths (``tasks-<evaluator>``)."""
    from transformers import AutoTokenizer

    from ..common.lines import case_text

    tokenizer = AutoTokenizer.from_pretrained(evaluator.folder)
    texts = [
        case_text(case)
        for length in run.sizes.lengths
        if length <= evaluator.context
        for case in _cases(run, evaluator.name, tokenizer, "lines-beyond", length)[: run.sizes.task_documents]
    ]
    return {f"tasks-{evaluator.name}": texts}


# ------------------------------------------------------------------ instrument


def instrument(run: Run) -> None:
    """The checks of the instrument, before any correlation: key-token shares on natural text and on
    answer tokens, and the windowed Gemma members' LongPPL for the order by window."""
    from longppl.rules.key_tokens import key_token_mask
    from longppl.settings import KeyTokenRule, WindowSettings

    from ..common.answer_tokens import answer_token_scores

    alpha = alphas(run)
    records, budget = run.records("instrument"), Budget(run.budget_seconds)
    done = records.keys()
    for evaluator in evaluators(run):
        if evaluator.name not in alpha:
            run.log(f"instrument: {evaluator.name} not calibrated yet; skipped")
            continue
        rule = KeyTokenRule.of({"alpha": alpha[evaluator.name], "beta": run.sizes.beta})  # the calibrated alpha
        for corpus, texts in natural_corpora(run, evaluator).items():
            key = f"key-share/{corpus}"
            if key in done or budget.spent():
                continue
            scores = evaluator_scores(run, evaluator, corpus, texts)
            masks = [key_token_mask(s.lp_long, s.lp_short, rule) for s in scores]
            scored = [int((~np.isnan(s.lp_short)).sum()) for s in scores]
            records.append(
                key,
                {
                    "check": "key-share",
                    "evaluator": evaluator.name,
                    "corpus": corpus,
                    "alpha": rule.alpha,
                    "key_tokens": [int(m.sum()) for m in masks],
                    "scored_tokens": scored,
                    "share": sum(int(m.sum()) for m in masks) / max(1, sum(scored)),
                },
            )
            run.log(f"instrument: {key} share {records.rows()[-1]['share']:.5f}")
        model = tokenizer = None
        for length in run.sizes.lengths:
            key = f"answer-share/{evaluator.name}/{length}"
            if key in done or budget.spent() or length > evaluator.context:
                continue
            if model is None:
                model, tokenizer = load_plain(evaluator.folder, run.device)
            cases = _cases(run, evaluator.name, tokenizer, "lines-beyond", length)
            found = answer_token_scores(model, tokenizer, cases, window=WindowSettings(*evaluator.window))
            key_mask = (found["lsd"] > rule.alpha) & (found["lcl"] > rule.beta)
            answer = found["is_answer"]
            records.append(
                key,
                {
                    "check": "answer-share",
                    "evaluator": evaluator.name,
                    "length": length,
                    "alpha": rule.alpha,
                    "answer_tokens": int(answer.sum()),
                    "answer_tokens_key": int((answer & key_mask).sum()),
                    "other_tokens": int((~answer).sum()),
                    "other_tokens_key": int((~answer & key_mask).sum()),
                    "share_of_answer_tokens_key": float((answer & key_mask).sum() / max(1, answer.sum())),
                },
            )
            run.log(f"instrument: {key} {records.rows()[-1]['share_of_answer_tokens_key']:.3f} of answer tokens key")
    gemma = evaluators(run)[0]
    texts = natural_corpora(run, gemma)[f"books-{gemma.name}"]
    ordered = ((f"window-order/{m.name}", m) for m in order_members())
    for key, spec in pending(run, "instrument", records, budget, ordered):
        model = population.load_member(spec, gemma.folder, run.device, member_dtype(run.device))
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(gemma.folder)
        found = longppl_under(
            run, gemma, alpha["gemma"], f"books-{gemma.name}", texts, model, tokenizer, context=spec.context
        )
        limit = spec.window if spec.kind == "window" else spec.context
        records.append(key, {"check": "window-order", "member": spec.name, "kind": spec.kind, "window": limit, **found})
        run.log(f"instrument: {key} LongPPL {found['longppl']:.4f} PPL {found['ppl']:.4f}")


def order_members() -> list[population.MemberSpec]:
    """The windowed Gemma members with RoPE as trained, widest window first."""
    chosen = [m for m in population.population() if m.base == population.GEMMA and m.method is None]
    return sorted(chosen, key=lambda m: -(m.window or m.context))


# ------------------------------------------------------------------ finetune

LEARNING_RATE, WARMUP, FLOOR = 3e-5, 10, 0.1  # the plan's fine-tuning: AdamW, cosine to 10%, no decay


def trained_folder(run: Run, spec) -> str:
    return os.path.join(run.root, "members", spec.name)


_TRAINING_IDS: dict = {}  # (books file, its size and time, tokenizer fingerprint) -> token ids, for this process


def _tokenized(job: tuple) -> list[np.ndarray]:
    """``(tokenizer, texts)`` -> each text's ``[n]`` int64 token ids, without special tokens (in a worker
    process: arrays travel back far cheaper than lists of ints)."""
    tokenizer, texts = job
    return [np.asarray(tokenizer(t, add_special_tokens=False)["input_ids"], dtype=np.int64) for t in texts]


def training_books(run: Run, tokenizer) -> list[np.ndarray]:
    """The training books as ``[n_b]`` int64 token ids of ``tokenizer``, one array a book.

    The whole training set takes about 90 s to tokenize in one process (it is tokenized in one
    process a CPU core, the books split among them), and every worker process that trains (a
    member's fine-tune, a LongCE pool) needs it, so the ids are kept once a run folder in
    ``<run>/tokens/train-<books digest>-<tokenizer fingerprint>.npz`` (flat ids and per-book
    lengths, no pickle; :func:`npz_once`), and held in memory for the rest of the process."""
    from longppl.models.fingerprints import file_sha256, tokenizer_fingerprint

    from ..common.books import read_books

    source = os.path.join(run.books, "train.jsonl.gz")
    if not os.path.isfile(source):
        raise ValueError(f"No training books at {source}: pass --books, the folder with train.jsonl.gz.")
    stat = os.stat(source)
    fingerprint = tokenizer_fingerprint(tokenizer)
    key = (os.path.abspath(source), stat.st_size, stat.st_mtime_ns, fingerprint)
    if key in _TRAINING_IDS:  # no need to hash the books again in this process
        return _TRAINING_IDS[key]
    path = os.path.join(run.root, "tokens", f"train-{file_sha256(source)[:16]}-{fingerprint[:16]}.npz")

    def make() -> dict:
        books = read_books(source)
        # one group a process, dealt round (every count-th book) so that long and short books mix;
        # book i comes back as group i % count's (i // count)-th
        count = process_count(len(books))
        groups = in_processes(_tokenized, [(tokenizer, books[g::count]) for g in range(count)])
        ids = [groups[i % count][i // count] for i in range(len(books))]
        flat = np.concatenate(ids) if ids else np.zeros(0, dtype=np.int64)
        # int32 halves the file (hundreds of MB); every vocabulary here fits it
        kind = np.int32 if flat.size == 0 or flat.max() < 2**31 else np.int64
        return dict(ids=flat.astype(kind), lengths=np.array([len(row) for row in ids]))

    npz_once(path, make)  # processes side by side wait for the one tokenizing
    with np.load(path, allow_pickle=False) as data:
        _TRAINING_IDS[key] = np.split(data["ids"].astype(np.int64), np.cumsum(data["lengths"])[:-1])
    return _TRAINING_IDS[key]


def finetune_one(run: Run, spec, folder: str) -> dict:
    """Fine-tune ``spec`` (a SmolLM2 member with steps) from the base in ``folder``: CE on distinct
    book chunks of its length, one a step, in the order of its seed; saved to
    ``<run>/members/<name>`` (written beside, then renamed). Returns the training record."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ..common.corpus_chunks import body_chunks
    from ..common.family import learning_rate

    length = run.sizes.finetune_length or spec.length
    steps = min(spec.steps, run.sizes.finetune_max_steps or spec.steps)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    chunks = body_chunks(training_books(run, tokenizer), length, steps, per_book_cap=8, seed=spec.seed)
    config, attention = population.member_config(spec, folder)
    model = AutoModelForCausalLM.from_pretrained(folder, config=config, attn_implementation=attention).to(run.device)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE, weight_decay=0.0)
    cuda = run.device.startswith("cuda")
    losses, started = [], time.monotonic()
    for step, row in enumerate(chunks):
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(step, steps, LEARNING_RATE, WARMUP, FLOOR)
        ids = torch.as_tensor(row[None], device=run.device)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=cuda):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
    target = trained_folder(run, spec)
    tmp = f"{target}.tmp-{os.getpid()}"
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    record = {"member": spec.name, "steps": steps, "length": length, "losses": losses}
    record["seconds"] = time.monotonic() - started
    _write_json(os.path.join(tmp, "training.json"), record)
    os.makedirs(os.path.dirname(target), exist_ok=True)
    os.replace(tmp, target)
    return record


def finetune(run: Run) -> None:
    """The fine-tuned SmolLM2 members that are not in this run folder yet and still lack a row of a
    phase that reads their weights (``members.jsonl`` of ``score``, ``task_documents.jsonl`` of
    ``documents``), one unit each; every training appends its record (steps, length, losses) to
    ``finetune.jsonl``. A member's folder (hundreds of MB) stays on the machine that trained it: one
    trained in an earlier session whose machine is gone, and not scored there by both phases, is
    trained again (the same data order; its record is appended again)."""
    records, budget = run.records("finetune"), Budget(run.budget_seconds)
    chosen = [spec for spec in _chosen_members(run) if spec.needs_training]
    folder = evaluators(run)[1].folder

    def done() -> set[str]:  # scored by both phases, or trained on this machine (a record holds no weights)
        here = {spec.name for spec in chosen if os.path.isdir(trained_folder(run, spec))}
        return (run.records("members").keys() & run.records("task_documents").keys()) | here

    for _, spec in pending(run, "finetune", records, budget, ((spec.name, spec) for spec in chosen), done=done):
        record = finetune_one(run, spec, folder)
        records.append(spec.name, record)
        run.log(f"finetune: {spec.name} {record['steps']} steps, last loss {record['losses'][-1]:.3f}")


def chain(run: Run) -> None:
    """``finetune``, ``score`` and ``documents`` a member at a time, in the population's order.

    A fine-tuned member's weights stay on the machine that trained them, so running the three phases
    one after another over the whole population loses, when the session ends, every member trained
    and not yet scored by both (all 24 fine-tunes of one session were lost so); this loses at most the
    member in hand. Side by side processes still share each phase's units by claims: a member another
    process is fine-tuning is passed over (its ``score`` and ``documents`` are left to that process),
    and a member another process is scoring can have its ``documents`` done here meanwhile. A member
    once begun is carried through its three phases; no member is begun after ``budget_seconds``."""
    budget = Budget(run.budget_seconds)
    for spec in _chosen_members(run):
        if budget.spent():
            run.log("chain: budget spent; call again")
            return
        one = dataclasses.replace(run, members=(spec.name,))  # the same log_lines list: one log
        for phase in (finetune, score, documents):
            phase(one)


def _chosen_members(run: Run) -> list:
    chosen = [m for m in population.population() if run.members is None or m.name in run.members]
    unknown = set(run.members or ()) - {m.name for m in chosen}
    if unknown:
        raise ValueError(
            f"Unknown members {sorted(unknown)}; the population's names are like gemma-w4k, smollm2-yarn4-s0."
        )
    return chosen


# ------------------------------------------------------------------ score


def _cases(run: Run, tokenizer_name: str, tokenizer, kind: str, length: int) -> list:
    name = f"{kind}-{length}"
    folder = os.path.join(run.root, "tasks", tokenizer_name)

    def build():
        ids = book_ids(run, tokenizer)
        return tasks.build_task_set(kind, tokenizer, length, run.sizes.cases, run.sizes.beyond, ids, seed=length)

    return tasks.task_cases(folder, name, kind, build)


def task_accuracies(run: Run, tokenizer_name: str, model, tokenizer, context: int | None = None) -> dict:
    """Per task set of ``tokenizer_name``'s documents, ``{"accuracy", "per_case"}`` of ``model``
    (per case: right or wrong, or the recalled share), and for the generated sets the greedy
    ``outputs`` (which the plan's format exclusion reads). Lines prompts end with the answer's
    opening (``tasks.with_answer_opening``). With ``context``, every prompt is cut so that no
    prediction reads more than ``context`` tokens."""
    s = run.sizes
    found = {}
    for name, kind, length in tasks.task_sets(s.lengths, s.cases, 0):
        cases = _cases(run, tokenizer_name, tokenizer, kind, length)
        cases = tasks.as_scored(kind, cases)
        if context is not None and kind == "recall":
            cases = [population.truncated_recall_case(c, context) for c in cases]
        elif context is not None:
            cases = [population.truncated_case(c, tokenizer, context - s.max_new_tokens - 2) for c in cases]
        found[name] = task_set_accuracy(kind, model, tokenizer, cases, s)
    return found


def task_set_accuracy(kind: str, model, tokenizer, cases: list, sizes) -> dict:
    """One task set's ``{"accuracy", "per_case"}`` (per case: right or wrong, or the recalled share),
    and for a generated set (lines, needle) the greedy ``outputs``: passage recall teacher forced,
    the others answered greedily with ``sizes``' ``max_new_tokens``, ``batch_size`` and ``prefill``
    (this study's :class:`Sizes` or the LongCE study's, which score their sets alike)."""
    from ..common.lines import lines_accuracy
    from ..common.needle import needle_accuracy
    from ..common.passage_recall import passage_recall_accuracy

    if kind == "recall":
        result = passage_recall_accuracy(model, cases, sizes.batch_size)
        return {"accuracy": result["accuracy"], "per_case": result["per_case"]}
    score = needle_accuracy if kind == "needle" else lines_accuracy
    options = dict(max_new_tokens=sizes.max_new_tokens, batch_size=sizes.batch_size, prefill=sizes.prefill)
    result = score(model, tokenizer, cases, **options)
    return {"accuracy": result["accuracy"], "per_case": result["is_correct"], "outputs": result["outputs"]}


def _ready_members(run: Run, phase: str, done: set[str]):
    """``(name, spec)`` of the chosen members whose weights this machine has: the untrained ones,
    and the fine-tuned ones in this run folder (the others are named in the log, for ``finetune``)."""
    chosen = _chosen_members(run)
    trained = {m.name for m in chosen if m.needs_training and os.path.isdir(trained_folder(run, m))}
    for spec in chosen:
        if spec.needs_training and spec.name not in done and spec.name not in trained:
            run.log(f"{phase}: {spec.name} is not fine-tuned yet (the 'finetune' phase); skipped")
    return ((m.name, m) for m in chosen if not m.needs_training or m.name in trained)


def _load_member(run: Run, spec, evaluator_list: list[Evaluator]):
    """``(model, tokenizer)`` of ``spec`` on the run's device in the members' precision: from its
    base evaluator's folder, or a fine-tuned member's own folder (whose config holds the extension)."""
    from transformers import AutoTokenizer

    folder = evaluator_list[0 if spec.base == population.GEMMA else 1].folder
    loaded = spec
    if spec.needs_training:
        folder, loaded = trained_folder(run, spec), dataclasses.replace(spec, kind="trained")
    model = population.load_member(loaded, folder, run.device, member_dtype(run.device))
    return model, AutoTokenizer.from_pretrained(folder)


def _member_longppl(run: Run, spec, model, tokenizer, evaluator_list, alpha: dict, corpora) -> dict:
    """``{corpus: longppl_under(...)}`` of the member under every calibrated evaluator, on each
    corpus of ``corpora(run, evaluator)``."""
    found = {}
    for evaluator in evaluator_list:
        if evaluator.name not in alpha:
            continue
        for corpus, texts in corpora(run, evaluator).items():
            found[corpus] = longppl_under(
                run, evaluator, alpha[evaluator.name], corpus, texts, model, tokenizer, context=spec.context
            )
    return found


def _free(run: Run) -> None:
    if run.device.startswith("cuda"):
        import torch

        torch.cuda.empty_cache()


def _each_member(run: Run, phase: str, records_name: str, corpora, head, more=None) -> None:
    """The loop of ``score`` and ``documents``: per member ready on this machine and not in
    ``<records_name>.jsonl``, a row of ``head(spec)``, its LongPPL on ``corpora(run, evaluator)``
    under each calibrated evaluator, ``more(spec, model, tokenizer)`` if given, and its seconds."""
    alpha = alphas(run)
    records, budget = run.records(records_name), Budget(run.budget_seconds)
    evaluator_list = evaluators(run)
    for _, spec in pending(run, phase, records, budget, _ready_members(run, phase, records.keys())):
        started = time.monotonic()
        model, tokenizer = _load_member(run, spec, evaluator_list)
        row = head(spec)
        row["longppl"] = _member_longppl(run, spec, model, tokenizer, evaluator_list, alpha, corpora)
        row.update(more(spec, model, tokenizer) if more else {})
        row["seconds"] = time.monotonic() - started
        records.append(spec.name, row)
        first = next(iter(row["longppl"].values()))
        run.log(f"{phase}: {spec.name} LongPPL {first['longppl']:.4f} in {row['seconds']:.0f} s")
        del model
        _free(run)


def score(run: Run) -> None:
    """One row per member: LongPPL and PPL under each calibrated evaluator on its natural documents,
    and accuracy on every task set (the member's own tokenizer's documents)."""

    def tasks(spec, model, tokenizer) -> dict:
        tokenizer_name = "gemma" if spec.base == population.GEMMA else "smollm2"
        found = task_accuracies(run, tokenizer_name, model, tokenizer, context=spec.context)
        return {"tasks": found, "prefill": run.sizes.prefill}  # how the generated answers were read

    def head(spec) -> dict:
        return {"member": spec.name, "cluster": spec.cluster, **dataclasses.asdict(spec)}

    _each_member(run, "score", "members", natural_corpora, head, tasks)


def documents(run: Run) -> None:
    """One row per member (``task_documents.jsonl``): LongPPL and PPL under each calibrated
    evaluator on the task documents themselves (:func:`task_corpora`: lines documents whose answer
    lies beyond K), beside ``score``'s natural documents. The evaluators' scores of these documents
    are computed once (``<run>/scores/``)."""

    def head(spec) -> dict:
        return {"member": spec.name, "cluster": spec.cluster, "base": spec.base, "steps": spec.steps}

    _each_member(run, "documents", "task_documents", task_corpora, head)
