"""The device phases of "LongCE from a real start" (docs/reproduction.md, its analysis plan): SmolLM2-135M
(trained at 8k) extended by YaRN (S1: x4 to 32k, S2: x2 to 16k), fine-tuned by five arms, and their
outcomes beyond and within the start's trained length. Each phase appends one JSON line per finished
unit to ``<run>/records/<phase>.jsonl`` and skips the units there (``phases.Records``); it starts no
new unit once ``--budget-seconds`` have passed.

- ``longce-start`` (``longce_start.jsonl``): per start, the extended model saved to
  ``<run>/longce_models/<start>/start`` and the plan's gate (lines with the answer within K at the
  start's trained length, at least 0.5; a start that fails keeps its runs and takes passage recall
  as its primary outcome); then per start the pilot of ``r``, ``self``'s step time over ``ce``'s.
- ``longce-weights`` (``longce_weights.jsonl``): per start, the start model's own LongCE weights of
  the training sequences, scored once (``<run>/longce_weights/<start>.npz``); the scoring's seconds
  are recorded and counted in the ``frozen`` and ``shuffled`` arms' compute. ``shuffled``'s weights
  are :func:`shuffled_weights` of them, with the run's seed.
- ``longce-train`` (``longce_train.jsonl``): one unit per start x arm x seed, ``LongCETrainer`` with
  ``longce_weights`` none (``ce``, ``ce-fresh``), self (``self``) or cache (``frozen``,
  ``shuffled``); the model at each of the plan's checkpoints saved to
  ``<run>/longce_models/<start>/<arm>-s<seed>/point-<step>``. A run cut short resumes from its last
  trainer checkpoint in the next call.
- ``longce-evaluate`` (``longce_evaluate.jsonl``): per start model and per saved checkpoint, the
  task accuracies (lines, needle and passage recall beyond the trained length; lines within K at the
  short lengths) and PPL / LongPPL under the calibrated Gemma evaluator on held-out books at L.
- ``longce-chain`` (module ``longce_chain``): ``longce-train`` and ``longce-evaluate`` in one
  pipeline: one training a device at a time, the checkpoints it saves evaluated beside it by the
  other processes, so that a session's end loses no trained unit but the one in hand.

The stage ``longce-report`` (module ``longce_report``) applies the plan's analysis to these records
alone: ``<run>/longce_results.json`` and ``<run>/longce_report.md``.

Every seed reads the same ``steps`` training sequences (the start's pool) in its own order; ``ce-fresh``
reads them in that order, then sequences of the pool's reserve that no arm reads.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import time

import numpy as np

from ..common.fine_tuning import in_order_trainer, step_timer
from . import members as population
from . import phases, tasks
from .phases import Run
from .progress import Budget, pending

ARMS = ("ce", "self", "frozen", "shuffled", "ce-fresh")
#: where each arm's token weights come from (``LongCEConfig.longce_weights``)
WEIGHTS_OF_ARM = {"ce": "none", "self": "self", "frozen": "cache", "shuffled": "cache", "ce-fresh": "none"}


@dataclasses.dataclass(frozen=True)
class Start:
    name: str
    factor: float  # YaRN's factor over the base's trained length
    length: int  # L: the fine-tuning length, and the longest task length


@dataclasses.dataclass(frozen=True)
class LongCESizes:
    """The study's numbers. ``PLAN``: the analysis plan's; ``SMALL``: a CPU smoke run's."""

    starts: tuple[Start, ...]
    trained_length: int  # the base's trained context: outcomes "beyond" lie further back
    window: tuple[int, int]  # LongCE's K, d
    steps: int
    checkpoints: tuple[int, ...]  # outcome points (steps); the last is the primary
    seeds: tuple[int, ...]
    pilot_steps: int
    reserve: int  # sequences only ce-fresh reads (r may reach 1 + reserve / steps)
    beyond_lengths: tuple[int, ...]  # task lengths beyond the trained length (each start's up to its L)
    within_lengths: tuple[int, ...]  # the forgetting check's lengths (answer within K)
    cases: int
    documents: int  # held-out books at L for PPL / LongPPL
    max_new_tokens: int
    batch_size: int
    prefill: str = "batch"  # greedy_answers': "rows" reads each prompt alone (no padding mask)
    gamma: float = 5.0
    gate: float = 0.5
    per_book_cap: int = 16
    learning_rate: float = 3e-5
    warmup: int = 10
    floor: float = 0.1


PLAN = LongCESizes(
    starts=(Start("s1", 4.0, 32768), Start("s2", 2.0, 16384)),
    trained_length=8192,
    window=(4096, 1024),
    steps=200,
    checkpoints=(50, 100, 200),
    seeds=(0, 1, 2, 3),
    pilot_steps=10,
    reserve=400,
    beyond_lengths=(12288, 16384, 24576, 32768),
    within_lengths=(4096, 8192),
    cases=50,
    documents=8,
    max_new_tokens=16,
    batch_size=4,
    prefill="rows",  # the reader of generated answers: "Deviations" of docs/reproduction.md
)
SMALL = LongCESizes(
    starts=(Start("s1", 4.0, 2048), Start("s2", 2.0, 1024)),
    trained_length=512,  # a one-line lines prompt takes about 320 tokens of the tests' tokenizer
    window=(128, 64),
    steps=2,
    checkpoints=(1, 2),
    seeds=(0,),
    pilot_steps=2,
    reserve=6,
    beyond_lengths=(1024, 2048),
    within_lengths=(448, 512),
    cases=2,
    documents=2,
    max_new_tokens=6,
    batch_size=2,
    warmup=1,
    prefill=PLAN.prefill,
)


@dataclasses.dataclass(frozen=True)
class Choice:
    """What one call works on: its sizes and the starts, arms and seeds it was asked for; ``workers``:
    the ``longce-chain`` processes started side by side on its device, this one included."""

    sizes: LongCESizes
    starts: tuple[Start, ...]
    arms: tuple[str, ...]
    seeds: tuple[int, ...]
    workers: int = 1

    @classmethod
    def from_args(cls, args) -> Choice:
        sizes = SMALL if args.small else PLAN

        def chosen(text, allowed, name, convert=str):
            if not text:
                return tuple(allowed)
            picked = tuple(convert(t.strip()) for t in text.split(","))
            unknown = [p for p in picked if p not in allowed]
            if unknown:
                raise ValueError(f"Unknown {name} {unknown}; choose among {list(allowed)} (comma-separated).")
            return picked

        names = chosen(getattr(args, "starts", None), [s.name for s in sizes.starts], "starts")
        workers = 1 if getattr(args, "workers", None) is None else args.workers
        if workers < 1:
            raise ValueError(f"--workers must be 1 or more (the processes started on the device); got {workers}.")
        return cls(
            sizes,
            tuple(s for s in sizes.starts if s.name in names),
            chosen(getattr(args, "arms", None), ARMS, "arms"),
            chosen(getattr(args, "seeds", None), sizes.seeds, "seeds", int),
            workers,
        )


# ------------------------------------------------------------------ the shuffled-weights control


def shuffled_weights(weights, seed: int, scored=None) -> list[np.ndarray]:
    """Each document's weights permuted at random among its scored positions: the same weights per
    document, no key-token information (the plan's ``shuffled`` arm).

    Args:
        weights: per document a ``[n_d]`` float array (``weights[d][k]``: the weight of predicting
            token ``k`` of document ``d``).
        seed: the permutation's seed; the same seed gives the same result.
        scored: per document a ``[n_d]`` bool array, True where the evaluator gave the token a score;
            default: the positions whose weight is not NaN. Unscored positions (NaN, or the
            unscored weight ``min(1, gamma)`` the library gives tokens without a short score) keep
            their place and value.

    Returns:
        per document a new ``[n_d]`` array: the scored positions' values permuted among themselves.
    """
    rng = np.random.default_rng(seed)
    found = []
    for index, row in enumerate(weights):
        row = np.asarray(row)
        mask = ~np.isnan(row) if scored is None else np.asarray(scored[index], dtype=bool)
        if mask.shape != row.shape:
            raise ValueError(
                f"Document {index}: scored mask of shape {mask.shape} for weights of shape {row.shape}; "
                "give one flag per weight."
            )
        out = row.copy()
        places = np.flatnonzero(mask)
        out[places] = row[places][rng.permutation(places.size)]
        found.append(out)
    return found


# ------------------------------------------------------------------ folders, data, tasks


def model_root(run: Run, start: Start) -> str:
    return os.path.join(run.root, "longce_models", start.name)


def start_folder(run: Run, start: Start) -> str:
    return os.path.join(model_root(run, start), "start")


def unit_folder(run: Run, start: Start, arm: str, seed: int) -> str:
    return os.path.join(model_root(run, start), f"{arm}-s{seed}")


def weights_path(run: Run, start: Start) -> str:
    return os.path.join(run.root, "longce_weights", f"{start.name}.npz")


def start_spec(start: Start) -> population.MemberSpec:
    return population.MemberSpec(
        f"longce-{start.name}",
        population.SMOLLM2,
        "extend",
        "longce",
        method="yarn",
        factor=start.factor,
        length=start.length,
    )


def load_model(folder: str, device: str, dtype=None):
    """A saved start or checkpoint (its config holds the extension), in eval mode, and its tokenizer."""
    from transformers import AutoTokenizer

    spec = population.MemberSpec(os.path.basename(folder), population.SMOLLM2, "trained", "longce")
    return population.load_member(spec, folder, device, dtype), AutoTokenizer.from_pretrained(folder)


def pool(run: Run, sizes: LongCESizes, start: Start, tokenizer) -> tuple[np.ndarray, np.ndarray]:
    """``(main [steps, L], reserve [reserve, L])`` token ids: distinct chunks of the training books
    at the start's L, split once by a fixed draw. Every arm reads ``main``; only ``ce-fresh`` reads
    ``reserve``."""
    from ..common.corpus_chunks import body_chunks

    books = phases.training_books(run, tokenizer)
    count = sizes.steps + sizes.reserve
    chunks = body_chunks(books, start.length, count, per_book_cap=sizes.per_book_cap, seed=0)
    order = np.random.default_rng(0).permutation(count)
    return chunks[order[: sizes.steps]], chunks[order[sizes.steps :]]


def seed_order(seed: int, count: int) -> np.ndarray:
    """The data order of a seed over the pool's main rows: the same for every arm."""
    return np.random.default_rng([seed, 0]).permutation(count)


def task_sets(sizes: LongCESizes, start: Start) -> list[tuple[str, str, int, int]]:
    """``(name, kind, length, short)`` of a start's task sets: lines, needle and recall with the
    answer more than the trained length back, at the beyond lengths up to L; lines with the answer
    within K at the within lengths (the forgetting check; at the trained length also the gate)."""
    found = []
    for length in (n for n in sizes.beyond_lengths if sizes.trained_length < n <= start.length):
        for kind in ("lines-beyond", "needle", "recall"):
            found.append((f"{kind}-{length}", kind, length, sizes.trained_length))
    found += [(f"lines-within-{n}", "lines-within", n, sizes.window[0]) for n in sizes.within_lengths]
    return found


def cases_of(run: Run, sizes: LongCESizes, tokenizer, name: str, kind: str, length: int, short: int) -> list:
    folder = os.path.join(run.root, "tasks", "longce-smollm2")

    def build():
        return tasks.build_task_set(
            kind, tokenizer, length, sizes.cases, short, phases.book_ids(run, tokenizer), seed=length
        )

    return tasks.task_cases(folder, name, kind, build)


def _build_set(job: tuple) -> str:
    """One of the study's task sets, in a worker process: ``(run fields, sizes, tokenizer folder,
    task_sets' tuple)``."""
    fields, sizes, folder, chosen = job
    from transformers import AutoTokenizer

    cases_of(Run(**fields), sizes, AutoTokenizer.from_pretrained(folder), *chosen)
    return chosen[0]


def prepare_task_sets(run: Run, choice: Choice, workers: int | None = None) -> None:
    """Every task set of the chosen starts not yet in ``<run>/tasks/longce-smollm2``, built side by side
    in up to ``workers`` processes (default one per CPU core), with the base's tokenizer (each start
    and checkpoint saves the same one). Built one by one at a fresh machine's first evaluations, they
    would keep a worker off the GPU for minutes; the sets are the same either way."""
    base = phases.base_folder(run.smollm2, "--smollm2")
    folder = os.path.join(run.root, "tasks", "longce-smollm2")
    wanted = {}
    for start in choice.starts:
        for chosen in task_sets(choice.sizes, start):
            if not os.path.isfile(os.path.join(folder, f"{chosen[0]}.jsonl")):
                wanted.setdefault(chosen[0], chosen)
    if wanted:
        fields = phases.run_fields(run)
        done = phases.in_processes(_build_set, [(fields, choice.sizes, base, c) for c in wanted.values()], workers)
        run.log(f"longce-start: {len(done)} task sets written ({', '.join(done)})")


def accuracies(run: Run, sizes: LongCESizes, model, tokenizer, chosen) -> dict:
    """Per task set of ``chosen`` (``task_sets``' tuples) ``{"accuracy", "per_case"}`` (and the greedy
    ``outputs`` of the generated sets), scored as the LongPPL study scores its members."""
    found = {}
    for name, kind, length, short in chosen:
        cases = tasks.as_scored(kind, cases_of(run, sizes, tokenizer, name, kind, length, short))
        found[name] = phases.task_set_accuracy(kind, model, tokenizer, cases, sizes)
    return found


def _save(model, tokenizer, target: str, record: dict | None = None) -> None:
    """``model`` saved to ``target``: written beside it, then renamed (nothing half-written stays)."""
    tmp = f"{target}.tmp-{os.getpid()}"
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    if record is not None:
        phases._write_json(os.path.join(tmp, "training.json"), record)
    os.makedirs(os.path.dirname(target), exist_ok=True)
    os.replace(tmp, target)


def _start_row(run: Run, start: Start) -> dict:
    found = {r["key"]: r for r in run.records("longce_start").rows()}
    if start.name not in found or not os.path.isdir(start_folder(run, start)):
        raise ValueError(f"Start {start.name} is not built on this machine: run the 'longce-start' phase first.")
    return found[start.name]


# ------------------------------------------------------------------ longce-start


def build_starts(run: Run, choice: Choice) -> None:
    """The chosen starts' task sets (:func:`prepare_task_sets`); per start: the YaRN-extended SmolLM2
    saved, and the gate on lines within K at the trained length; then per start the pilot of ``r``
    (``self``'s median step time over ``ce``'s)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    sizes, records, budget = choice.sizes, run.records("longce_start"), Budget(run.budget_seconds)
    base = phases.base_folder(run.smollm2, "--smollm2")

    def build(start: Start) -> None:  # deterministic: a fresh machine builds it again, keeping the record
        if not os.path.isdir(start_folder(run, start)):
            config, attention = population.member_config(start_spec(start), base)
            model = AutoModelForCausalLM.from_pretrained(base, config=config, attn_implementation=attention)
            _save(model, AutoTokenizer.from_pretrained(base), start_folder(run, start))

    prepare_task_sets(run, choice)
    for start in choice.starts:
        if start.name in records.keys():
            build(start)
    for _, start in pending(run, "longce-start", records, budget, ((s.name, s) for s in choice.starts)):
        started = time.monotonic()
        folder = start_folder(run, start)
        build(start)
        model, tokenizer = load_model(folder, run.device, phases.member_dtype(run.device))
        gate_set = (f"lines-within-{sizes.trained_length}", "lines-within", sizes.trained_length, sizes.window[0])
        gate = accuracies(run, sizes, model, tokenizer, [gate_set])[gate_set[0]]["accuracy"]
        passes = gate >= sizes.gate
        records.append(
            start.name,
            {
                "start": start.name,
                "factor": start.factor,
                "length": start.length,
                "gate_set": gate_set[0],
                "gate_accuracy": gate,
                "gate_passed": passes,
                "primary": "lines-beyond" if passes else "recall",
                "seconds": time.monotonic() - started,
            },
        )
        run.log(f"longce-start: {start.name} gate {gate:.3f} ({'passed' if passes else 'failed: recall is primary'})")
    for _, start in pending(run, "longce-start", records, budget, ((f"pilot/{s.name}", s) for s in choice.starts)):
        _start_row(run, start)
        times = {}
        for arm in ("ce", "self"):
            found = train(run, choice.sizes, start, arm, 0, steps=sizes.pilot_steps)
            times[arm] = found["step_seconds"]["median"]
        ratio = times["self"] / times["ce"]
        records.append(
            f"pilot/{start.name}",
            {"start": start.name, "steps": sizes.pilot_steps, "step_seconds": times, "r": ratio},
        )
        run.log(f"longce-start: pilot of {start.name}: r = {ratio:.3f}")


# ------------------------------------------------------------------ longce-weights


def frozen_weights(model, rows: np.ndarray, window: tuple[int, int], gamma: float, max_tokens: int = 65536):
    """``(weights [n, L] float32, scored [n, L] bool)``: ``model``'s own LongCE weights of each row,
    ``min(exp(lp_long - lp_short), gamma)`` with the trainer's windows (``longce.batch_short_log_probs``),
    ``min(1, gamma)`` where no short window scores a token (``scored`` False there, and at 0)."""
    import torch

    from longce import batch_documents, batch_short_log_probs, lsd_weights
    from longppl.settings import WindowSettings

    device = next(model.parameters()).device
    weights, scored = [], []
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda"):
        for row in rows:
            ids = torch.as_tensor(row[None], device=device)
            hidden = model.model(input_ids=ids).last_hidden_state[0]
            lp_long = torch.full((ids.shape[1],), float("nan"))
            for a in range(0, ids.shape[1] - 1, 4096):  # the LM head in slices: no [L, vocab] at once
                b = min(ids.shape[1] - 1, a + 4096)
                logp = model.lm_head(hidden[a:b]).float().log_softmax(-1)
                lp_long[a + 1 : b + 1] = logp.gather(-1, ids[0, a + 1 : b + 1, None])[:, 0].cpu()
            short = batch_short_log_probs(
                model, ids, batch_documents(ids, None, None), WindowSettings(*window), max_tokens
            )[0].cpu()
            weights.append(lsd_weights(lp_long, short, gamma).numpy())
            scored.append(~torch.isnan(short).numpy())
    return np.stack(weights).astype(np.float32), np.stack(scored)


def _scoring_model(run: Run, start: Start):
    """The start model as the trainer runs it: float32 weights, whose passes ``frozen_weights`` runs
    under bf16 autocast on a GPU, as ``self``'s weights are scored in training (and the fused
    attention kernels keep 32k affordable)."""
    return load_model(start_folder(run, start), run.device)


def score_weights(run: Run, choice: Choice) -> None:
    """Per start, the start model's weights of its pool's training sequences, once a machine: the file
    (tens of MB) stays on the machine that scored it, and a fresh machine scores the same weights
    again, keeping the first record (whose seconds are the ones counted in the arms' compute).
    Processes side by side wait for the one scoring a start (a lock on its file) instead of each
    scoring it again."""
    sizes, records, budget = choice.sizes, run.records("longce_weights"), Budget(run.budget_seconds)
    for start in choice.starts:
        path = weights_path(run, start)
        if os.path.isfile(path):
            run.log(f"longce-weights: {start.name} kept")
            continue
        if budget.spent():
            run.log("longce-weights: budget spent; call again")
            return
        _start_row(run, start)
        found = {}

        def make(start=start, found=found) -> dict:
            model, tokenizer = _scoring_model(run, start)
            main, _ = pool(run, sizes, start, tokenizer)
            if run.device.startswith("cuda"):
                import torch

                torch.cuda.synchronize()
            started = time.monotonic()
            weights, scored = frozen_weights(model, main, sizes.window, sizes.gamma)
            if run.device.startswith("cuda"):
                torch.cuda.synchronize()
            found.update(seconds=time.monotonic() - started, weights=weights, scored=scored, main=main)
            return dict(weights=weights, scored=scored, input_ids=main)

        if not phases.npz_once(path, make):
            run.log(f"longce-weights: {start.name} scored by another process")
            continue
        if start.name in records.keys():
            run.log(f"longce-weights: {start.name} scored again on this machine (its first record kept)")
            continue
        weights, scored, main, seconds = found["weights"], found["scored"], found["main"], found["seconds"]
        records.append(
            start.name,
            {
                "start": start.name,
                "sequences": int(main.shape[0]),
                "length": int(main.shape[1]),
                "scoring_seconds": seconds,
                "scored_share": float(scored.mean()),
                "mean_scored_weight": float(weights[scored].mean()) if scored.any() else None,
            },
        )
        run.log(f"longce-weights: {start.name} {main.shape[0]} sequences scored in {seconds:.1f} s")


def arm_weights(run: Run, start: Start, arm: str, seed: int, main: np.ndarray) -> np.ndarray:
    """``[steps, L]`` weights of ``frozen`` (the start's own) or ``shuffled`` (those permuted within
    each sequence with ``seed``), for the pool's main rows in pool order."""
    path = weights_path(run, start)
    if not os.path.isfile(path):
        raise ValueError(f"No weights of start {start.name} at {path}: run the 'longce-weights' phase first.")
    with np.load(path, allow_pickle=False) as data:
        weights, scored, ids = data["weights"], data["scored"], data["input_ids"]
    if not np.array_equal(ids, main):
        raise ValueError(f"The weights at {path} are of other sequences than the pool's: run 'longce-weights' again.")
    if arm == "shuffled":
        weights = np.stack(shuffled_weights(list(weights), seed, list(scored)))
    return weights


# ------------------------------------------------------------------ longce-train


def fresh_steps(sizes: LongCESizes, ratio: float) -> int:
    """``ce-fresh``'s steps, ``round(r x steps)``; a ValueError when the pool's reserve is too small."""
    steps = max(sizes.steps, round(ratio * sizes.steps))
    if steps > sizes.steps + sizes.reserve:
        raise ValueError(
            f"ce-fresh needs {steps} sequences (r = {ratio:.3f}), more than the pool's {sizes.steps} + "
            f"{sizes.reserve}: raise the reserve."
        )
    return steps


def pilot_ratio(start_rows: list[dict], start: Start) -> float | None:
    """The pilot's r of ``start`` (a ``self`` step's seconds over a ``ce`` step's) from the
    ``longce_start`` records' rows; None before its pilot ran."""
    found = [r["r"] for r in start_rows if r.get("key") == f"pilot/{start.name}"]
    return found[0] if found else None


def train(run: Run, sizes: LongCESizes, start: Start, arm: str, seed: int, steps: int | None = None) -> dict:
    """One run of ``arm`` with ``seed`` from the start model, or the pilot when ``steps`` is given
    (nothing saved). Returns the training record; a full run saves the model at each checkpoint to
    ``<unit>/point-<c>`` (``ce-fresh``: at ``round(r x c)`` steps)."""
    import torch
    from datasets import Dataset
    from transformers import DataCollatorWithFlattening

    from longce import LongCEConfig

    on_gpu = run.device.startswith("cuda")
    model, tokenizer = load_model(start_folder(run, start), run.device)
    model.train()
    main, reserve = pool(run, sizes, start, tokenizer)
    order = seed_order(seed, len(main))
    rows = main[order]
    pilot = steps is not None
    ratio, scoring_seconds = None, 0.0
    total = steps or sizes.steps
    if arm == "ce-fresh" and not pilot:
        ratio = pilot_ratio(run.records("longce_start").rows(), start)
        if ratio is None:
            raise ValueError(f"ce-fresh needs the pilot's r of {start.name}: run the 'longce-start' phase first.")
        total = fresh_steps(sizes, ratio)
        extra = reserve[np.random.default_rng([seed, 1]).permutation(len(reserve))[: total - len(rows)]]
        rows = np.concatenate([rows, extra])
    columns = {"input_ids": rows[:total].tolist()}
    if WEIGHTS_OF_ARM[arm] == "cache":
        columns["longce_weights"] = arm_weights(run, start, arm, seed, main)[order][:total].tolist()
        found = {r["key"]: r for r in run.records("longce_weights").rows()}
        scoring_seconds = found[start.name]["scoring_seconds"]
    points = {} if pilot else {round((ratio or 1.0) * c): c for c in sizes.checkpoints}
    folder = unit_folder(run, start, arm, seed)
    scratch = os.path.join(folder, "trainer") if not pilot else os.path.join(run.root, f".pilot-{os.getpid()}")
    os.makedirs(scratch, exist_ok=True)
    step_seconds: list[float] = []

    def save_point(state, model):
        if state.global_step in points:
            target = os.path.join(folder, f"point-{points[state.global_step]}")
            if not os.path.isdir(target):
                _save(model, tokenizer, target, {"step": state.global_step, "arm": arm, "seed": seed})

    window, gamma = sizes.window, sizes.gamma
    args = LongCEConfig(
        output_dir=scratch,
        max_steps=total,
        per_device_train_batch_size=1,
        learning_rate=sizes.learning_rate,
        lr_scheduler_type="cosine_with_min_lr",
        lr_scheduler_kwargs={"min_lr_rate": sizes.floor},
        warmup_steps=sizes.warmup,
        weight_decay=0.0,
        max_grad_norm=1.0,
        logging_steps=1,
        save_strategy="no" if pilot else "steps",
        save_steps=min(sizes.checkpoints),
        save_total_limit=1,  # the last trainer checkpoint (with the optimizer): a cut run resumes from it
        report_to=[],
        seed=seed,
        data_seed=seed,
        bf16=on_gpu,
        use_cpu=not on_gpu,
        disable_tqdm=True,
        dataloader_num_workers=0,
        longce_trunc_len=window[0],
        longce_sliding_window=window[1],
        longce_gamma=gamma,
        longce_weights=WEIGHTS_OF_ARM[arm],
    )
    torch.manual_seed(seed)
    trainer = in_order_trainer()(
        model=model,
        args=args,
        train_dataset=Dataset.from_dict(columns),
        data_collator=DataCollatorWithFlattening(),
        processing_class=tokenizer,
        callbacks=[step_timer(step_seconds, on_gpu, save_point)],
    )
    resume = not pilot and any(name.startswith("checkpoint-") for name in os.listdir(scratch))
    started = time.perf_counter()
    try:
        result = trainer.train(resume_from_checkpoint=True if resume else None)
    finally:
        if pilot:
            shutil.rmtree(scratch, ignore_errors=True)  # made above by this call
    seconds = time.perf_counter() - started
    ordered = sorted(step_seconds[1:] or step_seconds)  # the first step pays one-off costs
    record = {
        "start": start.name,
        "arm": arm,
        "seed": seed,
        "steps": total,
        "longce_weights": WEIGHTS_OF_ARM[arm],
        "r": ratio,
        "resumed": resume,
        "seconds": seconds,
        "scoring_seconds": scoring_seconds,
        # the plan's compute: the run's own seconds plus, for frozen and shuffled, the one-off scoring
        "compute_seconds": seconds + scoring_seconds,
        "step_seconds": {"median": ordered[len(ordered) // 2], "all": step_seconds},
        "final_loss": float(result.training_loss),
        "losses": [h["loss"] for h in trainer.state.log_history if "loss" in h],
        "checkpoints": {str(c): step for step, c in points.items()},
    }
    if not pilot:
        shutil.rmtree(scratch, ignore_errors=True)  # the trainer's checkpoints, made by this unit
    return record


def unit_key(start: Start, arm: str, seed: int) -> str:
    """A training unit's key in the records: ``<start>/<arm>-s<seed>`` (its checkpoints' evaluations
    are ``<key>/<step>``)."""
    return f"{start.name}/{arm}-s{seed}"


def trained_here(run: Run, sizes: LongCESizes, start: Start, arm: str, seed: int, recorded, evaluated) -> bool:
    """Whether a unit needs no training on this machine: it is in ``recorded`` (the training records'
    keys) and every checkpoint not in ``evaluated`` (the evaluations' keys) is saved here."""
    key = unit_key(start, arm, seed)
    return key in recorded and all(
        os.path.isdir(os.path.join(unit_folder(run, start, arm, seed), f"point-{c}"))
        for c in sizes.checkpoints
        if f"{key}/{c}" not in evaluated
    )


#: the records the time estimates read
MEASURED = ("longce_train", "longce_evaluate", "longce_weights", "longce_start")


def measured(run: Run) -> dict[str, list[dict]]:
    """``{name: rows}`` of the records in :data:`MEASURED`, each file read once: for a caller that
    asks the time estimates of many units at one moment (``longce_chain.unit_seconds``)."""
    return {name: run.records(name).rows() for name in MEASURED}


def training_units(choice: Choice) -> list[tuple[str, tuple[Start, str, int]]]:
    """``(key, (start, arm, seed))`` of every unit of ``choice`` in ``longce-train``'s order: seed
    outermost, so that a call finishes seeds whole."""
    return [
        (unit_key(start, arm, seed), (start, arm, seed))
        for seed in choice.seeds
        for start in choice.starts
        for arm in choice.arms
    ]


def train_arms(run: Run, choice: Choice) -> None:
    """One unit per start x arm x seed (seed outermost, so that a call finishes seeds whole). A unit
    with a record whose checkpoints are neither on this machine (a fresh one: ``outputs/`` stays on
    the machine that trained them) nor all evaluated is trained again; its first record is kept."""
    records, budget = run.records("longce_train"), Budget(run.budget_seconds)
    units = training_units(choice)

    def done() -> set[str]:
        return trained_keys(run, choice, units)

    for key, (start, arm, seed) in pending(run, "longce-train", records, budget, units, done=done):
        train_unit(run, choice, records, key, start, arm, seed)


def train_unit(run: Run, choice: Choice, records, key: str, start: Start, arm: str, seed: int) -> None:
    """Train one unit claimed by the caller and append its record (a unit trained again for its
    evaluation keeps its first record); a ``frozen`` or ``shuffled`` unit scores its start's weights
    first on a machine without them."""
    _start_row(run, start)
    if WEIGHTS_OF_ARM[arm] == "cache" and not os.path.isfile(weights_path(run, start)):
        score_weights(run, dataclasses.replace(choice, starts=(start,)))  # a fresh machine's first such unit
    record = train(run, choice.sizes, start, arm, seed)
    if key in records.keys():
        run.log(f"longce-train: {key} trained again for its evaluation (its first record kept)")
        return
    records.append(key, record)
    run.log(f"longce-train: {key} {record['steps']} steps, last loss {record['losses'][-1]:.3f}")


def trained_keys(run: Run, choice: Choice, units, rows: dict | None = None) -> set[str]:
    """The keys of ``units`` (``(key, (start, arm, seed))``) that need no training on this machine;
    ``rows``: the records already read (:func:`measured`), else they are read here."""
    rows = rows or measured(run)
    recorded, evaluated = {r["key"] for r in rows["longce_train"]}, {r["key"] for r in rows["longce_evaluate"]}
    return {key for key, unit in units if trained_here(run, choice.sizes, *unit, recorded, evaluated)}


# ------------------------------------------------------------------ longce-evaluate


def evaluation_units(run: Run, choice: Choice, here_only: bool = False) -> list[tuple[str, tuple]]:
    """``(key, (start, folder, arm, seed, step))`` of ``choice``'s evaluations in the units' order:
    per start, its own model (``<start>/start``, step 0) and each checkpoint of its units
    (``<unit>/<step>``). By default the checkpoints of every unit with a training record, saved here
    or not; ``here_only``: the models saved on this machine, any unit's (a training saves each
    checkpoint as it passes it, so its first ones can be evaluated while it goes on)."""
    trained = {r["key"] for r in run.records("longce_train").rows()}
    units = []
    for start in choice.starts:
        units.append((f"{start.name}/start", (start, start_folder(run, start), "start", None, 0)))
        for seed in choice.seeds:
            for arm in choice.arms:
                if not here_only and unit_key(start, arm, seed) not in trained:
                    continue
                for c in choice.sizes.checkpoints:
                    folder = os.path.join(unit_folder(run, start, arm, seed), f"point-{c}")
                    units.append((f"{unit_key(start, arm, seed)}/{c}", (start, folder, arm, seed, c)))
    if here_only:
        units = [(key, unit) for key, unit in units if os.path.isdir(unit[1])]
    return units


def evaluate(run: Run, choice: Choice) -> None:
    """Per start model and per saved checkpoint of a trained run: every task set of the start, and
    PPL / LongPPL on held-out books at L under the calibrated Gemma evaluator."""
    phases.alphas(run)  # no calibration: say so before any model is loaded
    records, budget = run.records("longce_evaluate"), Budget(run.budget_seconds)
    for key, unit in pending(run, "longce-evaluate", records, budget, evaluation_units(run, choice)):
        if not os.path.isdir(unit[1]):
            run.log(f"longce-evaluate: {key}: no model at {unit[1]} on this machine; skipped")
            continue
        evaluate_model(run, choice.sizes, records, key, *unit)


def evaluate_model(run: Run, sizes: LongCESizes, records, key: str, start, folder, arm, seed, step) -> None:
    """One evaluation claimed by the caller (:func:`evaluate`), appended to ``records`` as ``key``."""
    from transformers import AutoTokenizer

    alpha = phases.alphas(run)
    gemma = phases.evaluators(run)[0]
    started = time.monotonic()
    model, tokenizer = load_model(folder, run.device, phases.member_dtype(run.device))
    row = {"start": start.name, "arm": arm, "seed": seed, "step": step}
    row["tasks"] = accuracies(run, sizes, model, tokenizer, task_sets(sizes, start))
    name = f"books-longce-{start.name}"  # held-out book bodies (the name's first word says so)
    # a few tokens short of L: room for the special tokens the scoring adds
    texts = phases.corpus_texts(
        run, name, AutoTokenizer.from_pretrained(folder), start.length - 16, sizes.documents, seed=2
    )
    row["books"] = phases.longppl_under(run, gemma, alpha["gemma"], name, texts, model, tokenizer)
    row["seconds"] = time.monotonic() - started
    records.append(key, row)
    run.log(f"longce-evaluate: {key} PPL {row['books']['ppl']:.3f} LongPPL {row['books']['longppl']:.3f}")
    del model
    if run.device.startswith("cuda"):
        import torch

        torch.cuda.empty_cache()


def stages() -> dict:
    """The phases by stage name, each ``function(run, choice)``; ``longce-chain`` is
    ``longce_chain.chain`` (the command line adds it)."""
    return {
        "longce-start": build_starts,
        "longce-weights": score_weights,
        "longce-train": train_arms,
        "longce-evaluate": evaluate,
    }
