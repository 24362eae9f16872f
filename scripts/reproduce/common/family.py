"""The reproduction's models and how they are trained: tokenizer, model configs, training data and the
training loop, for ``population`` (the base B and the evaluators trained from scratch, the members
extended from B and fine-tuned) and ``longce_comparison`` (B extended).

Every model is a small Llama-style causal LM from ``transformers`` (``LlamaConfig``, or
``MistralConfig`` for sliding-window attention), trained on a stream of book tokens mixed with
synthetic task documents (:class:`TrainingBatches`: LongEval "lines", ``longppl_reproduce.common.lines``,
and the other task pools), from scratch or from a given model (``start_from``).

Why a plain loop rather than ``transformers.Trainer``: the models are small enough that the
Trainer's per-step overhead (callbacks, logging, the data loader) is a visible share of a step,
and the loop needs nothing it offers: one device, bf16 autocast, fused AdamW, a cosine schedule,
and batches cut directly from a token array in memory.

A model's training survives being cut off (a call limit of a few minutes): every
``training.save_every`` steps the loop writes a checkpoint (weights, AdamW state, the batch
sampler's and torch's random states, the losses so far) to ``<folder>/checkpoint/`` atomically, and
:func:`train_variant` resumes from it, so the resumed run ends with the weights an uninterrupted
one would have had. ``training.compile`` runs the forward pass and loss through ``torch.compile``.
"""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import dataclass

import numpy as np

from longppl.atomic_files import replace_directory_atomically, write_file_atomically

from .run_folder import read_record

#: The tokenizer's special tokens: an end-of-document token that separates concatenated documents,
#: and a padding token (batches are packed, so it is only there for ``generate``). No BOS is added:
#: every token of a text then counts, and a text of ``L`` tokens is exactly ``L`` positions.
EOS_TOKEN = "</s>"
PAD_TOKEN = "<pad>"

#: What a trained model's folder holds once it is complete; without it the model is (re)trained.
TRAINING_RECORD = "training.json"
#: The sub-folder of a model's folder that holds its last checkpoint while it trains (the finished
#: model replaces the whole folder, checkpoint included).
CHECKPOINT = "checkpoint"
#: Training settings that may change between a checkpoint and its resumption without changing
#: what is computed (how often to log or save, compiled or eager kernels).
RESUMABLE_CHANGES = ("log_every", "save_every", "compile")
#: What to do about a checkpoint whose ``progress.json`` cannot be read.
RESTART = "delete it and run again, and the model is trained from its first step"

ARCHITECTURES = ("llama", "mistral")


# ------------------------------------------------------------------ tokenizer


def train_tokenizer(texts: list[str], vocab_size: int):
    """A byte-level BPE tokenizer (GPT-2 / Llama-3 style, so every text round-trips) trained on ``texts``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS_TOKEN, PAD_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS_TOKEN, pad_token=PAD_TOKEN)


def token_dtype(vocab_size: int):
    """The smallest unsigned NumPy dtype for token ids ``< vocab_size`` (token arrays stay small)."""
    return np.uint16 if vocab_size <= 2**16 else np.uint32


def encode_stream(tokenizer, texts: list[str]) -> np.ndarray:
    """``[n]`` ids of ``texts`` concatenated, each followed by the end-of-document token."""
    eos = tokenizer.eos_token_id
    dtype = token_dtype(len(tokenizer))
    pieces = []
    for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]:
        pieces.append(np.asarray(ids, dtype=dtype))
        pieces.append(np.asarray([eos], dtype=dtype))
    return np.concatenate(pieces) if pieces else np.zeros(0, dtype=dtype)


# ------------------------------------------------------------------ model configs


@dataclass(frozen=True)
class Variant:
    """One member of the family: its name and its settings (base settings with its overrides applied).

    Attributes:
        name: folder name and label in tables and figures.
        model: ``architecture`` (``llama`` or ``mistral``) plus fields of its ``transformers`` config;
            ``rope_theta`` is accepted and put into ``rope_parameters``.
        training: ``seq_len``, ``steps``, ``batch_tokens``, ``micro_batch_tokens``, ``lr``, ``warmup_steps``,
            ``min_lr_ratio``, ``weight_decay``, ``lines_share``, ``seed``, ``log_every``, ``compile``
            (torch.compile the forward pass and loss), ``save_every`` (steps between checkpoints;
            ``None`` for none).
    """

    name: str
    model: dict
    training: dict


def model_config(variant: Variant, vocab_size: int, tokenizer=None):
    """The ``transformers`` config of ``variant`` for a vocabulary of ``vocab_size``."""
    from transformers import LlamaConfig, MistralConfig

    fields = dict(variant.model)
    architecture = fields.pop("architecture", "llama")
    if architecture not in ARCHITECTURES:
        raise ValueError(
            f"model {variant.name!r}: architecture {architecture!r} is not one of {ARCHITECTURES} "
            "(mistral gives sliding-window attention through its 'sliding_window' field)."
        )
    if "rope_theta" in fields:  # transformers 5 keeps the RoPE base in rope_parameters
        fields["rope_parameters"] = {"rope_type": "default", "rope_theta": float(fields.pop("rope_theta"))}
    if tokenizer is not None:
        fields.setdefault("eos_token_id", tokenizer.eos_token_id)
        fields.setdefault("pad_token_id", tokenizer.pad_token_id)
        fields.setdefault("bos_token_id", tokenizer.eos_token_id)
    config_class = MistralConfig if architecture == "mistral" else LlamaConfig
    return config_class(vocab_size=vocab_size, tie_word_embeddings=fields.pop("tie_word_embeddings", True), **fields)


def count_parameters(model) -> int:
    """Distinct parameters (tied embeddings counted once)."""
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


# ------------------------------------------------------------------ training data


class TrainingBatches:
    """Packed training sequences of ``seq_len`` tokens: random windows of the book stream, and with
    probability ``lines_share`` a lines document placed at the end of a window of book tokens (so
    its question and answer are always inside the sequence and no padding is needed).

    Args:
        books: ``[n]`` token ids of the training books (``encode_stream``).
        lines_documents: tokenized lines documents (each shorter than ``seq_len``), drawn with
            replacement; may be empty when ``lines_share`` is 0.
        seed: seeds the sampling, so a variant always sees the same batches.
        tasks: several pools of task documents instead of the one of lines documents:
            ``{kind: (documents, share)}``; a sequence holds a document of pool ``kind`` with
            probability ``share`` (the shares sum to at most 1; the rest is book text alone).
            One pool ``{"lines": (lines_documents, lines_share)}`` draws exactly the batches of
            ``lines_documents`` and ``lines_share``.
    """

    def __init__(
        self,
        books: np.ndarray,
        lines_documents: list[np.ndarray],
        seq_len: int,
        lines_share: float,
        seed,
        *,
        tasks: dict[str, tuple[list[np.ndarray], float]] | None = None,
    ):
        if books.shape[0] <= seq_len:
            raise ValueError(
                f"The training books hold {books.shape[0]} tokens, not enough for one sequence of {seq_len}: "
                "give a larger corpus or a shorter training seq_len."
            )
        if tasks is None:
            tasks = {"lines": (lines_documents, lines_share)}
        for kind, (documents, share) in tasks.items():
            if share > 0 and not documents:
                raise ValueError(
                    f"{kind} share {share} > 0 needs {kind} documents, but none were made for this seq_len."
                )
        if sum(share for _, share in tasks.values()) > 1 + 1e-9:
            raise ValueError(f"The task documents' shares {[s for _, s in tasks.values()]} sum to more than 1.")
        # Pools with a share, in order: a sequence takes pool i when a uniform draw falls in its slice.
        self.pools = [(documents, share) for documents, share in tasks.values() if share > 0]
        self.books, self.seq_len = books, seq_len
        self.rng = np.random.default_rng(seed)

    def state(self) -> dict:
        """The sampler's random state (JSON-serialisable): :meth:`restore` continues from it."""
        return self.rng.bit_generator.state

    def restore(self, state: dict) -> None:
        """Continue sampling from a :meth:`state` (a checkpoint's), as if the batches before it were drawn."""
        self.rng.bit_generator.state = state

    def sequences(self, count: int) -> np.ndarray:
        """``[count, seq_len]`` int64 token ids."""
        out = np.empty((count, self.seq_len), dtype=np.int64)
        starts = self.rng.integers(0, self.books.shape[0] - self.seq_len, size=count)
        for row, start in enumerate(starts):
            out[row] = self.books[start : start + self.seq_len]
            if not self.pools:
                continue
            draw, edge = self.rng.random(), 0.0
            for documents, share in self.pools:
                edge += share
                if draw < edge:
                    document = documents[int(self.rng.integers(len(documents)))][-self.seq_len :]
                    out[row, self.seq_len - document.shape[0] :] = document
                    break
        return out


def learning_rate(step: int, steps: int, peak: float, warmup: int, min_ratio: float) -> float:
    """Linear warm-up over ``warmup`` steps, then cosine decay from ``peak`` to ``min_ratio * peak``."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return peak * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


def is_trained(folder: str) -> bool:
    """Whether ``folder`` holds a finished model: its training record (written last, atomically) and
    the files the record stands for (:func:`missing_model_files`), so that a model whose weights were
    deleted or cut off after training is trained again instead of failing to load."""
    return os.path.isfile(os.path.join(folder, TRAINING_RECORD)) and missing_model_files(folder) is None


def stale_record(folder: str) -> str | None:
    """Why ``folder``'s model is trained again though its training record says it is trained (a line
    for the log), or ``None`` when there is no record or the model is complete."""
    if not os.path.isfile(os.path.join(folder, TRAINING_RECORD)):
        return None
    missing = missing_model_files(folder)
    return None if missing is None else f"{folder} has its training record but {missing}: training it again"


def missing_model_files(folder: str) -> str | None:
    """What ``folder`` lacks of a saved model (``save_pretrained`` of the model and its tokenizer):
    ``config.json``, ``tokenizer.json`` and every safetensors file of the weights (one, or those its
    ``model.safetensors.index.json`` names), each as long as its header says; ``None`` when complete."""
    for name in ("config.json", "tokenizer.json"):
        if not os.path.isfile(os.path.join(folder, name)):
            return f"no {name}"
    shards = ["model.safetensors"]
    index = os.path.join(folder, "model.safetensors.index.json")
    if os.path.isfile(index):
        try:
            with open(index, encoding="utf-8") as handle:
                shards = sorted(set(json.load(handle)["weight_map"].values()))
        except (ValueError, KeyError, TypeError, AttributeError):
            return "an unreadable model.safetensors.index.json"
    for shard in shards:
        if not os.path.isfile(os.path.join(folder, shard)):
            return f"no {shard}"
        if not _safetensors_complete(os.path.join(folder, shard)):
            return f"a cut-off {shard}"
    return None


def _safetensors_complete(path: str) -> bool:
    """Whether the safetensors file ``path`` is as long as its header says (8 bytes of header length,
    the JSON header, then the tensors' bytes up to the largest ``data_offsets`` end), without reading
    the tensors."""
    size = os.path.getsize(path)
    try:
        with open(path, "rb") as handle:
            length = int.from_bytes(handle.read(8), "little")
            if size < 8 + length:
                return False
            header = json.loads(handle.read(length))
        end = max((entry["data_offsets"][1] for key, entry in header.items() if key != "__metadata__"), default=0)
    except (ValueError, KeyError, TypeError, IndexError, AttributeError):
        return False
    return size == 8 + length + end


def _resume_key(variant: Variant, vocab_size: int) -> dict:
    """What a checkpoint must have been trained with to be resumed (JSON-normalised for comparing)."""
    training = {k: v for k, v in variant.training.items() if k not in RESUMABLE_CHANGES}
    return json.loads(json.dumps({"model": variant.model, "training": training, "vocab_size": vocab_size}))


def save_checkpoint(folder: str, model, optimizer, progress: dict) -> None:
    """Write a training checkpoint to ``folder`` atomically: ``state.safetensors`` (the weights as
    ``model/<name>``, AdamW's state as ``optimizer/<parameter index>/<key>``, torch's random states as
    ``rng/cpu`` and ``rng/cuda``) and ``progress.json`` (``progress``: steps done, losses, seconds,
    the batch sampler's state, the settings it was trained with). No pickle: tensors and JSON only.
    """
    import torch
    from safetensors.torch import save

    # Cloned, so tied weights (the embedding and the LM head) are separate tensors safetensors accepts.
    tensors = {f"model/{name}": t.detach().to("cpu", copy=True).contiguous() for name, t in model.state_dict().items()}
    for index, state in optimizer.state_dict()["state"].items():
        for key, value in state.items():
            tensors[f"optimizer/{index}/{key}"] = torch.as_tensor(value).detach().to("cpu", copy=True).contiguous()
    tensors["rng/cpu"] = torch.get_rng_state()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        tensors["rng/cuda"] = torch.cuda.get_rng_state()
    blob = save(tensors)

    def write(tmp: str) -> None:
        with open(os.path.join(tmp, "state.safetensors"), "wb") as handle:
            handle.write(blob)
        with open(os.path.join(tmp, "progress.json"), "w", encoding="utf-8") as handle:
            json.dump(progress, handle, indent=1)

    replace_directory_atomically(folder, write)


def load_checkpoint(folder: str, model, optimizer) -> dict:
    """Load :func:`save_checkpoint`'s weights, AdamW state and torch random states into ``model`` /
    ``optimizer`` / torch; returns its ``progress.json``."""
    import torch
    from safetensors.torch import load

    progress = read_record(os.path.join(folder, "progress.json"), remedy=RESTART)
    with open(os.path.join(folder, "state.safetensors"), "rb") as handle:
        tensors = load(handle.read())
    model.load_state_dict({k[len("model/") :]: v for k, v in tensors.items() if k.startswith("model/")}, strict=True)
    state: dict[int, dict] = {}
    for key, value in tensors.items():
        if key.startswith("optimizer/"):
            _, index, name = key.split("/", 2)
            state.setdefault(int(index), {})[name] = value
    full = optimizer.state_dict()  # the param_groups come from the config, exactly as at the start
    full["state"] = state
    optimizer.load_state_dict(full)  # moves each tensor to its parameter's device
    torch.set_rng_state(tensors["rng/cpu"])
    if "rng/cuda" in tensors and torch.cuda.is_available():
        torch.cuda.set_rng_state(tensors["rng/cuda"])
    return progress


def train_variant(
    variant: Variant,
    tokenizer,
    batches: TrainingBatches,
    folder: str,
    device: str,
    log=print,
    *,
    start_from=None,
) -> dict:
    """Train ``variant`` from scratch and save it (weights, config, tokenizer, training record) to
    ``folder``, atomically: a run stopped half-way leaves no folder that looks finished.

    With ``training.save_every``, a checkpoint is written to ``<folder>/checkpoint/`` every that many
    steps; a later call finds it and resumes at its step (weights, AdamW state, the sampler's and
    torch's random states restored), so the result equals an uninterrupted run's. A checkpoint
    written with other settings (other than :data:`RESUMABLE_CHANGES`) is not resumed: the model is
    trained from scratch and the checkpoint replaced. With ``training.compile``, the forward pass and
    the loss run through ``torch.compile`` (the weights, the optimizer and what is saved are the same
    module's).

    ``start_from``: a function returning the model to start from (fine-tuning) instead of one
    built from ``variant.model`` with fresh weights; ``training.steps`` may then be 0 (the model
    saved as it is).

    Returns:
        the training record: parameters, steps, tokens, seconds (summed over the calls that trained
        it), tokens per second, the losses logged, the steps it was resumed at, the seconds of the
        last call's first step (with compile: mostly compilation).
    """
    import torch
    from transformers import AutoModelForCausalLM

    settings = variant.training
    seed = int(settings["seed"])
    torch.manual_seed(seed)
    on_gpu = device.startswith("cuda")
    if on_gpu:
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    if start_from is None:
        config = model_config(variant, len(tokenizer), tokenizer)
        model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").to(device)
    else:
        model = start_from().to(device)
    model.train()
    seq_len, steps = int(settings["seq_len"]), int(settings["steps"])
    per_step = max(1, int(settings["batch_tokens"]) // seq_len)
    per_micro = max(1, min(per_step, int(settings.get("micro_batch_tokens") or settings["batch_tokens"]) // seq_len))
    optimizer = torch.optim.AdamW(
        model.parameters(),
        lr=float(settings["lr"]),
        betas=(0.9, 0.95),
        weight_decay=float(settings["weight_decay"]),
        fused=on_gpu,  # one kernel for the whole update on the GPU; the CPU path has no fused AdamW
    )
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if on_gpu else torch.autocast("cpu", enabled=False)
    losses, log_every = [], max(1, int(settings.get("log_every", 20)))
    save_every = int(settings.get("save_every") or 0)
    if stale := stale_record(folder):
        log(f"  [{variant.name}] {stale}")
    checkpoint, key = os.path.join(folder, CHECKPOINT), _resume_key(variant, len(tokenizer))
    first, seconds_before, resumed, first_step_seconds = 0, 0.0, [], float("nan")
    if os.path.isfile(os.path.join(checkpoint, "progress.json")):
        saved = read_record(os.path.join(checkpoint, "progress.json"), remedy=RESTART)
        if saved.get("settings") == key:
            progress = load_checkpoint(checkpoint, model, optimizer)
            first, seconds_before, losses = progress["step"], progress["seconds"], progress["losses"]
            resumed = progress["resumed"] + [first]
            batches.restore(progress["sampler"])
            log(f"  [{variant.name}] resumed at step {first}/{steps} from {checkpoint}")
        else:
            before = saved.get("settings") or {}
            changed = sorted(
                f"{part}.{name}"
                for part in ("model", "training")
                for name in set(before.get(part, {})) | set(key[part])
                if before.get(part, {}).get(name) != key[part].get(name)
            ) or ["vocab_size"]
            log(
                f"  [{variant.name}] the checkpoint in {checkpoint} was trained with other settings ({', '.join(changed)} "
                "changed); training from scratch"
            )
    # The compiled module shares the parameters (and so the optimizer and the saved weights) with model.
    forward = torch.compile(model) if settings.get("compile") else model
    start = time.perf_counter()
    for step in range(first, steps):
        lr = learning_rate(step, steps, float(settings["lr"]), int(settings["warmup_steps"]), settings["min_lr_ratio"])
        for group in optimizer.param_groups:
            group["lr"] = lr
        tokens = torch.from_numpy(batches.sequences(per_step)).to(device, non_blocking=True)
        total = 0.0
        for chunk in tokens.split(per_micro):
            with autocast:
                loss = forward(input_ids=chunk, labels=chunk).loss
            (loss * chunk.shape[0] / per_step).backward()
            total += float(loss.detach()) * chunk.shape[0] / per_step
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if step == first:  # with compile, the compilation's share of the seconds
            first_step_seconds = time.perf_counter() - start
            if settings.get("compile"):
                log(f"  [{variant.name}] first compiled step (compilation included) {first_step_seconds:.1f}s")
        if step % log_every == 0 or step == steps - 1:
            losses.append({"step": step, "loss": total, "lr": lr})
            log(f"  [{variant.name}] step {step:>5}/{steps}  loss {total:.3f}  lr {lr:.2e}")
        if save_every and (step + 1) % save_every == 0 and step + 1 < steps:
            progress = {
                "step": step + 1,
                "seconds": seconds_before + time.perf_counter() - start,
                "losses": losses,
                "resumed": resumed,
                "sampler": batches.state(),
                "settings": key,
            }
            save_checkpoint(checkpoint, model, optimizer, progress)
    if on_gpu:
        torch.cuda.synchronize()
    seconds = seconds_before + time.perf_counter() - start
    record = {
        "name": variant.name,
        "model": variant.model,
        "training": settings,
        "parameters": count_parameters(model),
        "steps": steps,
        "tokens": steps * per_step * seq_len,
        "seconds": seconds,
        "tokens_per_second": steps * per_step * seq_len / seconds if seconds > 0 else float("nan"),
        "final_loss": losses[-1]["loss"] if losses else float("nan"),
        "losses": losses,
        "resumed_at": resumed,
        "first_step_seconds": first_step_seconds,  # of this call's first step (compilation included)
        "device": torch.cuda.get_device_name() if on_gpu else "cpu",
    }

    def write(tmp: str) -> None:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        with open(os.path.join(tmp, TRAINING_RECORD), "w", encoding="utf-8") as handle:
            json.dump(record, handle, indent=1)

    replace_directory_atomically(folder, write)  # the checkpoint inside the old folder goes with it
    return record


def save_token_array(path: str, array: np.ndarray) -> None:
    """Write ``array`` as a ``.npy`` file atomically (read back with ``np.load(..., allow_pickle=False)``)."""
    write_file_atomically(path, lambda handle: np.save(handle, array, allow_pickle=False), binary=True)


def save_ragged(path: str, arrays: list[np.ndarray], dtype) -> None:
    """Write a list of 1-d arrays as one ``.npz`` (``values`` and ``ends``) atomically."""
    values = np.concatenate(arrays).astype(dtype) if arrays else np.zeros(0, dtype=dtype)
    ends = np.cumsum([a.shape[0] for a in arrays]).astype(np.int64)
    write_file_atomically(path, lambda handle: np.savez(handle, values=values, ends=ends), binary=True)


def load_ragged(path: str) -> list[np.ndarray]:
    """The arrays :func:`save_ragged` wrote."""
    with np.load(path, allow_pickle=False) as data:
        values, ends = data["values"], data["ends"]
    starts = np.concatenate([[0], ends[:-1]]) if ends.size else ends
    return [values[s:e] for s, e in zip(starts, ends)]
