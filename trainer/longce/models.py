"""The model ``longce-train`` trains: built from ``model_config`` or loaded, its context extension, its LoRA adapter.

Torch and transformers load when :func:`load_model` runs, not at this module's import (the command
checks its arguments before torch is imported).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from .config import LongCEConfig
    from .script_arguments import ModelArguments


def load_model(model_args: ModelArguments, training_args: LongCEConfig, tokenizer) -> torch.nn.Module:
    """Build (``model_config``) or load the model, after the context extension edited its config; then LoRA."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, set_seed

    from longppl.models.named import resolve

    from .context_extension import apply_context_extension

    # a real model's short name or a GGUF file: the folder it is converted into (once)
    source = model_args.model_name_or_path and (
        resolve(model_args.model_name_or_path, "model_name_or_path") or model_args.model_name_or_path
    )
    if model_args.model_config is not None:
        kwargs = dict(model_args.model_config)
        kwargs.setdefault("vocab_size", len(tokenizer))
        for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
            kwargs.setdefault(name, getattr(tokenizer, name))
        config = AutoConfig.for_model(kwargs.pop("model_type"), **kwargs)
    else:
        config = AutoConfig.from_pretrained(source, cache_dir=model_args.cache_dir)
    attn = apply_context_extension(
        config,
        model_args.context_extension,
        factor=model_args.rope_factor,
        rope_theta=model_args.rope_theta,
        original_max_position_embeddings=model_args.original_max_position_embeddings,
        eabf_base_length=model_args.eabf_base_length,
    )
    if attn is not None and model_args.attn_implementation not in (None, attn):
        raise ValueError(
            f"context_extension={model_args.context_extension!r} needs its own attention ({attn!r}); "
            f"unset attn_implementation (got {model_args.attn_implementation!r})."
        )
    attn = attn or model_args.attn_implementation
    dtype = "auto" if model_args.dtype == "auto" else getattr(torch, model_args.dtype)
    set_seed(training_args.seed)  # random init (model_config) and LoRA init follow the run's seed
    if model_args.model_config is not None:
        model = AutoModelForCausalLM.from_config(
            config, dtype=torch.float32 if dtype == "auto" else dtype, attn_implementation=attn
        )
    else:
        model = AutoModelForCausalLM.from_pretrained(
            source,
            config=config,
            dtype=dtype,
            attn_implementation=attn,
            cache_dir=model_args.cache_dir,
        )
    embedding = model.get_input_embeddings().weight
    rows = getattr(embedding, "ds_shape", embedding.shape)[0]  # DeepSpeed ZeRO-3 keeps the full shape aside
    if len(tokenizer) > rows:
        raise ValueError(
            f"The tokenizer has {len(tokenizer)} tokens but the model's embedding only {rows} rows; "
            "use the model's own tokenizer or a larger vocab_size."
        )
    if model_args.lora_r > 0:
        from peft import LoraConfig, get_peft_model

        if training_args.activation_checkpointing:  # LongCEConfig mirrors gradient_checkpointing into it
            # Frozen embeddings give checkpointed blocks inputs without grad; LoRA weights inside them need it.
            model.enable_input_require_grads()
        lora = LoraConfig(
            r=model_args.lora_r,
            lora_alpha=model_args.lora_alpha,
            lora_dropout=model_args.lora_dropout,
            target_modules=list(model_args.lora_target_modules),
            task_type="CAUSAL_LM",
        )
        model = get_peft_model(model, lora)
    return model
