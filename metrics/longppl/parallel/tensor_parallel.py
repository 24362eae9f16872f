"""Tensor parallelism for evaluators larger than one GPU (the paper's 72B / 123B class).

Which modules are split, and how, is the model family's own plan in transformers:
``config.base_model_tp_plan`` (``{"layers.*.self_attn.q_proj": "colwise", ...}``), the same in
transformers 5.17 and 5.24. This module applies it itself, Megatron-style, with plain tensors:
each split ``nn.Linear`` keeps this rank's slice of its weight as an ordinary parameter, and the
only collective is one all-reduce after each row-wise layer (a reduce-scatter and an all-gather
under sequence parallelism, below). A forward pass runs no DTensor code.

Why not ``from_pretrained``'s own tensor parallelism: its entry point moved between the versions
we support (``tp_plan=`` in 5.17, ``distributed_config=DistributedConfig(...)`` in 5.24, with the
old argument deprecated), and it cannot build a sharded model from a config without a checkpoint
(what the benchmarks of 72B shapes need: 145 GB fit neither host memory nor disk). Why not
PyTorch's DTensor ``parallelize_module`` (``ColwiseParallel`` / ``RowwiseParallel``, what this
module used before): every split Linear then goes through DTensor's Python dispatch in every
forward (input made a replicated DTensor, ``F.linear`` on DTensors, redistribution, ``to_local``),
about 7 Linears per layer, and the scoring makes many forwards (the long pass and packed short
windows). That CPU-side cost per operation does not shrink with the model: at the 8B shape on
2 H200s it took 1.5 s of CPU time of a 2.06 s pass over a small corpus, and made TP=2 1.45x the
one-GPU time, against 0.64x with plain tensors (docs/benchmarks.md).

What each rank ``r`` of ``N`` ranks of one tensor-parallel group holds:

- column-wise layers (``"colwise"``: q/k/v, gate, up): rows ``[r*n/N, (r+1)*n/N)`` of the weight's
  ``n`` output features (and of the bias), so ``1/N`` of the query / key-value heads; the input is
  the whole hidden state, the output this rank's features (the attention reshapes with ``-1``
  heads, so it takes ``1/N`` of them as they come);
- row-wise layers (``"rowwise"``: o, down): columns ``[r*n/N, (r+1)*n/N)`` of the ``n`` input
  features; the partial products are summed over the group by an all-reduce, then the bias (whole
  on every rank) is added once. The decoder layers' hidden states are whole (replicated) between
  blocks (split over tokens under sequence parallelism, below);
- the embedding, the norms and the LM head whole: every rank computes the same log-probs from the
  same hidden states, so the scoring core runs unchanged (chunked LM head, packed windows) and
  every rank ends with the same rows. The head's work is repeated on each rank (about 7% of an
  8B model's FLOPs at full-sequence projection, less for short windows, which project ``d`` of
  ``K + d`` positions); its weights cost ``vocab x hidden`` per rank.

Sequence parallelism (Megatron-SP; ``sequence_parallel``, **on by default** where the base model
has Llama's layout, decoder ``layers`` and a final ``norm``) shards the part above that every rank
repeats: the norms and the residual adds, per-token work that does not shrink with ``N``. Between
the split layers the decoder layers' hidden states ``[batch, tokens, hidden]`` are split over the
tokens, taken flat (``M = batch*tokens``; the layout of :class:`SplitGroup`): each rank keeps
``ceil(M/N)`` of them, so each norm and residual add runs on ``1/N`` of them. Before each
column-wise group (the attention's q/k/v, the MLP's gate/up) the hidden states are all-gathered
over the tokens once, so the column-wise layers and the attention see all of them; each row-wise
layer reduce-scatters over the tokens (sums the partial products and keeps this rank's tokens)
where it all-reduced, the same bytes moved. The hidden states are scattered at the first decoder
layer's input (not at the embedding: transformers builds the attention mask and RoPE from the
embedding's output length) and the final norm's output is gathered back, so the LM head and the
scoring core see what they see without it. :class:`TokenSplit` holds the hooks. At the 8B shape on
2 H200s it takes TP=2 from 0.62x / 0.64x of the one-GPU time (a 32k document / a small corpus) to
0.58x / 0.60x (0.598x and 0.605x in two calls; docs/benchmarks.md).

Each split module records which dimension of which parameter it split (:data:`SPLIT_ATTRIBUTE`),
so :func:`local_slice` can say where a rank's part lies in the whole tensor (loading, benchmarks).
The split is for scoring (no gradient flows through the collectives).

Every rank must be given the same inputs in the same order (``longppl-score`` does; only the
group's first rank writes the result). Several groups split a corpus as several processes do.
"""

from __future__ import annotations

import json
import os
from fnmatch import fnmatchcase

import torch
from torch import nn
from torch.nn import functional as F

from ..settings import require_int

# The plan styles this module applies; a family whose plan uses others (packed, expert, sequence
# parallel...) is refused rather than half-split.
STYLES = ("colwise", "rowwise")
#: Plan styles left out: the modules they name stay whole on every rank. transformers 5.17 adds
#: ``{"embed_tokens": "embedding_rowwise"}`` (a vocabulary-split embedding) to the plan of every
#: model with tied embeddings, 5.24 does not; this split keeps the embedding whole, which is always
#: correct and costs ``vocab x hidden`` per rank.
KEPT_WHOLE = ("embedding_rowwise",)
#: Families whose split evaluators the tests score against the unsplit one (docs/design.md).
TESTED_FAMILIES = ("llama", "mistral", "qwen2")
#: Where a split module records ``{parameter name: split dimension}``: on the module, because
#: ``to_empty`` (and ``.to``) replace its parameters but keep the module and its attributes.
SPLIT_ATTRIBUTE = "tensor_parallel_split"


def tensor_parallel_plan(config, size: int, argument: str = "tensor_parallel") -> dict[str, str]:
    """The family's plan ``{module pattern under the base model: "colwise" | "rowwise"}``, after
    checking that ``size`` ranks can split ``config``'s model with it.

    Args:
        config: the evaluator's ``PretrainedConfig`` (read before any weight is loaded).
        size: ranks in one tensor-parallel group (``>= 1``).
        argument: what messages call ``size`` (``--tensor-parallel`` for the command).
    Raises:
        ValueError: the family has no plan (or one with styles other than :data:`STYLES`), or
            ``size`` does not divide the attention heads, the key-value heads or the MLP width.
    """
    size = require_int(argument, size)
    family = getattr(config, "model_type", type(config).__name__)
    plan = {
        pattern: style
        for pattern, style in (getattr(config, "base_model_tp_plan", None) or {}).items()
        if style not in KEPT_WHOLE
    }
    others = sorted({style for style in plan.values() if style not in STYLES})
    if not plan or others:
        why = "has no tensor-parallel plan in transformers" if not plan else f"has a plan with styles {others}"
        raise ValueError(
            f"{argument}={size}: the evaluator's family {family!r} {why}; tensor parallelism works for families "
            f"whose plan splits layers column- and row-wise ({', '.join(TESTED_FAMILIES)} are tested). "
            "Shard it with device='auto' (longppl-score --device auto) instead."
        )
    heads = getattr(config, "num_attention_heads", None)
    widths = {
        "num_attention_heads": heads,
        "num_key_value_heads": getattr(config, "num_key_value_heads", None) or heads,
        "intermediate_size": getattr(config, "intermediate_size", None),
    }
    for field, value in widths.items():
        if isinstance(value, int) and value % size:
            raise ValueError(
                f"{argument}={size} does not divide the evaluator's {field}={value}: every rank must hold whole "
                f"heads and equal MLP slices; pick a size that divides {field}."
            )
    return plan


def check_launch(size: int, world_size: int, local_world_size: int, gpus: int | None, argument: str) -> None:
    """Refuse a launch that cannot host groups of ``size`` ranks, before anything is loaded.

    Args:
        world_size, local_world_size: processes in all / on this machine (``WORLD_SIZE`` and
            ``LOCAL_WORLD_SIZE`` as torchrun and ``accelerate launch`` set them; 1 without a launcher).
        gpus: GPUs this machine shows, or ``None`` where the ranks run on the CPU (gloo).
    Raises:
        ValueError: more ranks asked than GPUs, several processes on one GPU, or a number of
            processes that groups of ``size`` do not fill.
    """
    if gpus is not None and gpus < size:
        raise ValueError(
            f"{argument}={size} asks for {size} GPUs, but this machine has {gpus}: "
            f"pass {argument} {gpus} or less, or --device auto to spread the evaluator over what there is."
        )
    if gpus is not None and local_world_size > gpus:
        raise ValueError(
            f"{argument}={size} with {local_world_size} processes on this machine's {gpus} GPUs: tensor "
            f"parallelism needs one process per GPU; launch {gpus} or fewer (torchrun --nproc-per-node {size})."
        )
    if world_size < size or world_size % size or local_world_size % size:
        raise ValueError(
            f"{argument}={size} needs {size} processes per group on one machine (one per GPU), but "
            f"{world_size} were started ({local_world_size} on this machine): launch a multiple of {size}, "
            f"e.g. torchrun --nproc-per-node {size} -m longppl.tools.compute_key_tokens ..."
        )


def group_mesh(size: int, device_type: str):
    """The 1-D device mesh of this rank's tensor-parallel group: ranks ``[g*size, (g+1)*size)``.

    The process group must be up (``accelerate.PartialState`` or ``torch.distributed.init_process_group``).
    """
    from torch.distributed.device_mesh import init_device_mesh

    world = torch.distributed.get_world_size()
    mesh = init_device_mesh(device_type, (world // size, size), mesh_dim_names=("data", "tensor"))
    return mesh["tensor"]


def plan_modules(module: nn.Module, plan: dict[str, str]) -> dict[str, str]:
    """``{submodule name: style}`` of the submodules of ``module`` that ``plan``'s patterns name.

    Names match as ``parallelize_module`` matches them: pattern and name are split at the dots, a
    name matches when it has as many parts and each part matches the pattern's part under
    :func:`fnmatch.fnmatchcase`, so ``*`` stands for one part, never a dotted path
    (``layers.*.mlp.up_proj`` names ``layers.3.mlp.up_proj``, not ``layers.3.block.mlp.up_proj``).
    A pattern that names no submodule is skipped, as torch skips it.

    Raises:
        ValueError: two patterns name one module with different styles.
    """
    found: dict[str, str] = {}
    for pattern, style in plan.items():
        parts = pattern.split(".")
        for name, _ in module.named_modules():
            names = name.split(".")
            if name and len(names) == len(parts) and all(map(fnmatchcase, names, parts)):
                if found.setdefault(name, style) != style:
                    raise ValueError(
                        f"the tensor-parallel plan splits {name!r} both {found[name]!r} and {style!r} "
                        f"(pattern {pattern!r}); give each module one style."
                    )
    return found


class SplitGroup:
    """One split model's tensor-parallel group, shared by every split module and the
    sequence-parallel hooks of the model (so the row-wise layers and the hooks lay the tokens out
    the same way).

    Attributes:
        group: the group's ``ProcessGroup``; ``rank``, ``size``: this rank's place in it, ``N = size``.
        sequence_parallel: the decoder layers' hidden states are split over the tokens between the
            split layers (set by :func:`split_tokens`).

    Token layout under sequence parallelism. The tokens of a forward pass are taken flat, ``M = B*T``
    in order (``[B, T, h]`` read as ``[M, h]``, a view), padded with zeros at the end to ``N*p``,
    ``p = ceil(M/N)``, and rank ``r`` keeps tokens ``[r*p, (r+1)*p)``: its hidden states are
    ``[1, p, h]``. Flat, the ranks' parts are consecutive blocks of the tokens, which is what
    ``reduce_scatter_tensor`` hands out and ``all_gather_into_tensor`` puts together, so no collective
    needs a copy to reorder the tokens (splitting each of ``B > 1`` rows over ``T`` would, for the
    packed short windows, at every collective).
    """

    def __init__(self, group, rank: int, size: int):
        self.group, self.rank, self.size = group, rank, size
        self.sequence_parallel = False

    def part(self, tokens: int) -> int:
        """``p``: the flat tokens each rank keeps of ``tokens``, ``ceil(tokens / N)``."""
        return -(-tokens // self.size)

    def scatter(self, hidden: torch.Tensor) -> torch.Tensor:
        """This rank's tokens of ``hidden`` ``[B, T, h]`` (whole on every rank): ``[1, p, h]``, a view
        where no padding falls in this rank's part (a tensor of its own under ``torch.compile``
        for ranks ``r > 0``)."""
        flat = hidden.reshape(-1, hidden.shape[-1])
        part = self.part(flat.shape[0])
        mine = flat[self.rank * part : (self.rank + 1) * part]
        missing = part - mine.shape[0]
        if missing:
            mine = torch.cat([mine, mine.new_zeros(missing, mine.shape[1])])
        elif self.rank and torch.compiler.is_compiling():
            # The first decoder layer's input. A view starts at storage offset r*p*h, and torch.compile
            # specialises an offset of 0 apart from any other: on ranks r > 0 the first layer would
            # compile graphs of its own (offset > 0) beside those of the other layers and of padded
            # passes (offset 0), twice rank 0's graphs, toward dynamo's recompile limit. A copy of
            # p*h values once per forward pass (not per layer) starts it at 0; eager needs none.
            mine = mine.clone()
        return mine.unsqueeze(0)

    def gather(self, local: torch.Tensor, batch: int, tokens: int) -> torch.Tensor:
        """The inverse of :meth:`scatter`: every rank's ``[1, p, h]`` all-gathered into the whole
        ``[batch, tokens, h]`` (padding cut off: a view of the gathered tokens), the same on every rank."""
        local = local.reshape(-1, local.shape[-1]).contiguous()
        whole = local.new_empty(self.size * local.shape[0], local.shape[1])
        torch.distributed.all_gather_into_tensor(whole, local, group=self.group)
        return whole[: batch * tokens].view(batch, tokens, local.shape[1])


class RowwiseLinear(nn.Linear):
    """A row-wise split ``nn.Linear``: it holds columns ``[r*n/N, (r+1)*n/N)`` of the whole weight
    (rank ``r`` of the ``N`` of its :class:`SplitGroup` ``split``), so its local product is a partial
    sum; the partial sums are summed over the group, then the bias (whole on every rank) is added once.

    Input ``[..., n/N]`` (this rank's features, as a column-wise layer before it gives them). Output
    ``[..., out_features]``, the same on every rank (all-reduced); under sequence parallelism
    ``[1, p, out_features]``, this rank's tokens of the sum (reduce-scattered; the layout of
    :class:`SplitGroup`). For scoring: the product runs without autograd, and no gradient flows
    through the collectives.
    """

    split: SplitGroup  # set by split_linear

    @torch.no_grad()
    def forward(self, input: torch.Tensor) -> torch.Tensor:
        split = self.split
        # The bias stays out of the local product: added there, the sum over ranks would add it N times.
        if split.sequence_parallel:
            flat = input.reshape(-1, input.shape[-1])
            part = split.part(flat.shape[0])
            if type(self.weight) in (torch.Tensor, nn.Parameter):
                # The product written into a buffer padded to N*p tokens: no copy to pad it afterwards.
                product = flat.new_empty(split.size * part, self.out_features)
                torch.mm(flat, self.weight.t(), out=product[: flat.shape[0]])
                product[flat.shape[0] :].zero_()
            else:
                # A weight of a tensor subclass (an fp8 evaluator's float8 weights, models.precision)
                # computes through F.linear only: its mm with out= writes what the subclass does not
                # define (garbage in the buffer, with torchao 0.18). The input is padded instead (zero
                # rows give zero products), a copy only when N does not divide the tokens.
                padding = split.size * part - flat.shape[0]
                product = F.linear(F.pad(flat, (0, 0, 0, padding)) if padding else flat, self.weight)
            output = product.new_empty(1, part, self.out_features)
            torch.distributed.reduce_scatter_tensor(output[0], product, group=split.group)
        else:
            output = F.linear(input, self.weight)
            torch.distributed.all_reduce(output, group=split.group)
        return output if self.bias is None else output + self.bias


def _with_hidden_states(args: tuple, kwargs: dict, change) -> tuple[tuple, dict]:
    """``(args, kwargs)`` of a forward call with its hidden states (``hidden_states=`` or the first
    positional argument, as transformers passes them) replaced by ``change(hidden_states)``."""
    if "hidden_states" in kwargs:
        return args, {**kwargs, "hidden_states": change(kwargs["hidden_states"])}
    return (change(args[0]), *args[1:]), kwargs


class TokenSplit:
    """Sequence parallelism over a :class:`SplitGroup`: the hooks that split the decoder layers'
    hidden states ``[B, T, hidden]`` over the tokens between the split layers (the layout of
    :class:`SplitGroup`: ``[1, ceil(B*T/N), hidden]`` per rank).

    - :meth:`enter` (pre-hook of the first decoder layer): keep this rank's tokens
      (:meth:`SplitGroup.scatter`), remembering ``B`` and ``T``;
    - :meth:`carry` (pre-hook of every decoder layer): hand ``(B, T)`` to the layer's call as the
      keyword :attr:`KEYWORD`, which the layer passes on to its attention (the families' decoder
      layers pass their ``**kwargs`` to ``self_attn``);
    - :meth:`gather` (pre-hook of each module holding a column-wise group: ``self_attn``, ``mlp``):
      the normed hidden states all-gathered back to ``[B, T, hidden]`` (:meth:`SplitGroup.gather`);
      the attention's takes :attr:`KEYWORD` out of its call (so the attention never sees it) and
      keeps it for the MLP's;
    - the row-wise layers reduce-scatter (:class:`RowwiseLinear` under ``split.sequence_parallel``);
    - :meth:`leave` (forward hook of the final norm): its output gathered back to ``[B, T, hidden]``.

    The padding lives only between the split layers: the norms and residual adds are per token, so
    it never touches a real token, and every gather cuts it off. So the attention, its mask and its
    RoPE ``cos``/``sin`` (built by transformers for the ``T`` tokens of the embedding's output) see
    exactly ``[B, T]``, as without the split. One forward at a time (``B``, ``T`` are kept from
    :meth:`enter` to :meth:`leave`). A caller asking for the decoder layers' outputs
    (``output_hidden_states``) gets this rank's tokens.

    Why ``(B, T)`` travels as an argument of the layer's call: with the decoder layers compiled
    (``core.compilation``), each layer is one graph, and the gathers run inside it. dynamo takes an
    integer it reads from an attribute of an object reached through a module (this object, through
    the hooks) for a constant, so ``B`` and ``T`` read from here compiled the layer once per
    ``[B, T]`` of a forward pass (a long pass, each batch of short windows) until dynamo's recompile
    limit, after which the layers ran eagerly; an integer among the call's arguments it takes for a
    dynamic size, so lengths share graphs: a document makes a few (a pass of one sequence, one of
    several windows, one with a padding mask), the next document none. Eager, nothing changes.
    """

    #: The keyword under which each decoder layer's call carries ``(B, T)`` to its attention.
    KEYWORD = "sequence_parallel_shape"

    def __init__(self, split: SplitGroup):
        self.split = split
        self.batch, self.tokens = 0, 0  # [B, T] of the forward pass under way, set by enter

    def enter(self, module, args, kwargs):
        def scatter(hidden):
            self.batch, self.tokens = hidden.shape[:2]
            return self.split.scatter(hidden)

        return _with_hidden_states(args, kwargs, scatter)

    def carry(self, module, args, kwargs):
        return args, {**kwargs, self.KEYWORD: (self.batch, self.tokens)}

    def gather(self, module, args, kwargs):
        if self.KEYWORD in kwargs:  # the attention's call: dynamic sizes under torch.compile
            kwargs = dict(kwargs)
            # Kept for the MLP's gather (its call has no keywords): read within the same compiled
            # layer, they stay dynamic there too.
            self.batch, self.tokens = kwargs.pop(self.KEYWORD)
        return _with_hidden_states(args, kwargs, lambda hidden: self.split.gather(hidden, self.batch, self.tokens))

    def leave(self, module, args, output):
        return self.split.gather(output, self.batch, self.tokens)


def has_llama_layout(base_model: nn.Module) -> bool:
    """Whether ``base_model`` has what :func:`split_tokens` hooks: a non-empty ``layers``
    ``nn.ModuleList`` of decoder layers and a final ``norm`` module."""
    layers, norm = getattr(base_model, "layers", None), getattr(base_model, "norm", None)
    return isinstance(layers, nn.ModuleList) and len(layers) > 0 and isinstance(norm, nn.Module)


def split_tokens(base_model: nn.Module, styles: dict[str, str], split: SplitGroup) -> TokenSplit:
    """Put sequence parallelism (:class:`TokenSplit`) on ``base_model``, already split by
    :func:`split_modules` over ``split``, whose ``{submodule name: style}`` is ``styles``: hooks on
    the decoder layers, on the modules that hold the column-wise layers, on ``norm``, and the row-wise
    layers made to reduce-scatter (``split.sequence_parallel``).

    Raises:
        ValueError: ``base_model`` has no ``layers`` list and final ``norm`` (Llama's layout).
    """
    if not has_llama_layout(base_model):
        raise ValueError(
            f"sequence_parallel=True needs a base model with decoder `layers` and a final `norm` (as "
            f"{', '.join(TESTED_FAMILIES)} have); {type(base_model).__name__} has not: pass sequence_parallel=False."
        )
    hooks = TokenSplit(split)
    base_model.layers[0].register_forward_pre_hook(hooks.enter, with_kwargs=True)
    for layer in base_model.layers:  # after enter: hooks run in the order they were registered
        layer.register_forward_pre_hook(hooks.carry, with_kwargs=True)
    # The module holding a column-wise layer (self_attn for q/k/v, mlp for gate/up) gets the
    # hidden states as its input and feeds them to its column-wise layers: one gather serves them all.
    for owner in sorted({name.rpartition(".")[0] for name, style in styles.items() if style == "colwise"}):
        base_model.get_submodule(owner).register_forward_pre_hook(hooks.gather, with_kwargs=True)
    base_model.norm.register_forward_hook(hooks.leave)
    split.sequence_parallel = True
    return hooks


def split_linear(linear: nn.Module, style: str, split: SplitGroup) -> None:
    """Keep, in place, rank ``split.rank``'s part of ``linear`` (an ``nn.Linear``) for a group of
    ``split.size`` ranks.

    ``"colwise"``: rows ``[rank*n/size, (rank+1)*n/size)`` of the weight ``[n, in]`` and of the bias;
    ``out_features`` becomes ``n/size``. ``"rowwise"``: the same columns of the weight ``[out, n]``;
    ``in_features`` becomes ``n/size``, the bias stays whole and the module becomes a
    :class:`RowwiseLinear` over ``split``. The parts are copies (on the meta device, shapes only), so
    the whole weight is not kept alive; which dimension of which parameter was split is recorded
    in the module's :data:`SPLIT_ATTRIBUTE`.

    Raises:
        ValueError: ``linear`` is no plain ``nn.Linear``, or ``size`` does not divide the split features.
    """
    rank, size = split.rank, split.size
    dim = {"colwise": 0, "rowwise": 1}[style]
    # A plain nn.Linear only: a subclass (quantised, LoRA...) may compute with its weight otherwise.
    features = linear.weight.shape[dim] if type(linear) is nn.Linear else None
    if features is None or features % size:
        what = f"{features} features" if features is not None else f"{type(linear).__name__} (not a plain nn.Linear)"
        raise ValueError(
            f"tensor_parallel={size} cannot split {what} {style}: every rank must hold an equal slice of a Linear; "
            "pick a size that divides it, or shard the evaluator with device='auto'."
        )
    local = features // size
    part = slice(rank * local, (rank + 1) * local)
    index = (part, slice(None)) if dim == 0 else (slice(None), part)
    linear.weight = nn.Parameter(linear.weight[index].clone(), linear.weight.requires_grad)
    recorded = {"weight": dim}
    if style == "colwise":
        linear.out_features = local
        if linear.bias is not None:
            linear.bias = nn.Parameter(linear.bias[part].clone(), linear.bias.requires_grad)
            recorded["bias"] = 0
    else:
        linear.in_features = local
        linear.__class__ = RowwiseLinear
        linear.split = split
    setattr(linear, SPLIT_ATTRIBUTE, recorded)


def split_modules(module: nn.Module, plan: dict[str, str], split: SplitGroup) -> dict[str, str]:
    """Split, in place, the submodules of ``module`` that ``plan`` names (:func:`plan_modules`),
    keeping rank ``split.rank``'s part of each (:func:`split_linear`); returns ``{submodule name:
    style}`` of the split ones."""
    styles = plan_modules(module, plan)
    for name, style in styles.items():
        split_linear(module.get_submodule(name), style, split)
    return styles


def shard_model(model, mesh, sequence_parallel: bool | None = None) -> SplitGroup:
    """Split ``model``'s base model in place over ``mesh`` (a 1-D device mesh, :func:`group_mesh`)
    with its family's plan (checked by :func:`tensor_parallel_plan`); embedding, norms and LM head
    stay whole. Returns the :class:`SplitGroup` its split modules share.

    ``sequence_parallel``: also split the hidden states between the split layers over the tokens
    (:func:`split_tokens`). ``None`` (the default): where the base model has the layout it needs
    (:func:`has_llama_layout`), else not; ``True`` refuses a model without it.
    """
    plan = tensor_parallel_plan(model.config, mesh.size())
    split = SplitGroup(mesh.get_group(), mesh.get_local_rank(), mesh.size())
    styles = split_modules(model.base_model, plan, split)
    if sequence_parallel is None:
        sequence_parallel = has_llama_layout(model.base_model)
    if sequence_parallel:
        split_tokens(model.base_model, styles, split)
    return split


def build_sharded_model(config, mesh, dtype: torch.dtype, device: str, sequence_parallel: bool | None = None):
    """``config``'s causal LM, split over ``mesh`` (with ``sequence_parallel`` as :func:`shard_model`
    takes it), with uninitialised weights on ``device``.

    Built on the meta device first and split there (the split weights become meta tensors of this
    rank's shape), so ``to_empty`` gives each rank memory for its parts only: no rank ever holds the
    whole model, and a 72B model is never materialised in host memory. Buffers (RoPE's
    ``inv_freq``) are computed on the CPU at build time and put back after the weights get their
    device memory.
    """
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    shard_model(model, mesh, sequence_parallel)
    buffers = {name: buffer for name, buffer in model.named_buffers()}
    model.to_empty(device=device)
    for name, buffer in buffers.items():
        owner, _, leaf = name.rpartition(".")
        model.get_submodule(owner)._buffers[leaf] = buffer.to(device)
    if getattr(config, "tie_word_embeddings", False):
        model.tie_weights()  # to_empty gave the head a tensor of its own
    model.eval()
    return model


def local_slice(model: nn.Module, name: str, rank: int) -> tuple[slice, ...] | None:
    """The index of rank ``rank``'s part of parameter ``name`` (as ``model.named_parameters()``
    names it) in the whole tensor, for a model split by :func:`split_modules`; ``None``: not split.

    Split dimensions are divided evenly (:func:`tensor_parallel_plan` checks the widths), so rank
    ``r`` holds ``[r * local, (r + 1) * local)`` of the split dimension, ``local`` being its size in
    ``model`` (the same on every rank), and the whole of the others.
    """
    owner, _, leaf = name.rpartition(".")
    dim = getattr(model.get_submodule(owner), SPLIT_ATTRIBUTE, {}).get(leaf)
    if dim is None:
        return None
    shape = model.get_parameter(name).shape
    index = [slice(None)] * len(shape)
    index[dim] = slice(rank * shape[dim], (rank + 1) * shape[dim])
    return tuple(index)


def _weight_files(folder: str) -> dict[str, str]:
    """``{parameter name: safetensors file}`` of a saved checkpoint (one file, or an index of shards)."""
    index = os.path.join(folder, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index, encoding="utf-8") as handle:
            weight_map = json.load(handle)["weight_map"]
        return {name: os.path.join(folder, file) for name, file in weight_map.items()}
    single = os.path.join(folder, "model.safetensors")
    if not os.path.isfile(single):
        raise ValueError(
            f"{folder!r} holds no model.safetensors (or its index): tensor parallelism reads safetensors "
            "checkpoints only; save the model with save_pretrained(safe_serialization=True)."
        )
    from safetensors import safe_open

    with safe_open(single, framework="pt") as handle:
        return {name: single for name in handle.keys()}


def load_sharded_model(
    name_or_path: str, size: int, device: str, dtype: torch.dtype, sequence_parallel: bool | None = None
):
    """A saved causal LM split over this rank's tensor-parallel group of ``size`` ranks
    (``sequence_parallel`` as :func:`shard_model` takes it).

    Each rank reads only its own slices of the split weights from the safetensors files (and the
    whole of the unsplit ones), so host memory never holds the whole model.

    Args:
        name_or_path: a local folder saved with ``save_pretrained``, or a Hub id (downloaded).
        device: this rank's device (``"cuda:<local rank>"``, or ``"cpu"`` for gloo ranks).
    """
    from safetensors import safe_open
    from transformers import AutoConfig

    folder = name_or_path
    if not os.path.isdir(folder):
        from huggingface_hub import snapshot_download

        folder = snapshot_download(name_or_path, allow_patterns=["*.json", "*.safetensors"])
    config = AutoConfig.from_pretrained(folder)
    tensor_parallel_plan(config, size)
    mesh = group_mesh(size, torch.device(device).type)
    model = build_sharded_model(config, mesh, dtype, device, sequence_parallel)
    files = _weight_files(folder)
    rank = mesh.get_local_rank()
    tied = {"lm_head.weight"} if getattr(config, "tie_word_embeddings", False) else set()
    handles: dict[str, object] = {}
    try:
        with torch.no_grad():
            for name, parameter in model.named_parameters(remove_duplicate=False):
                if name not in files:
                    if name in tied:
                        continue
                    raise ValueError(f"{folder!r} holds no weight {name!r}: it is not a checkpoint of this model.")
                if files[name] not in handles:
                    handles[files[name]] = safe_open(files[name], framework="pt")
                stored = handles[files[name]].get_slice(name)
                index = local_slice(model, name, rank)
                value = stored[index] if index is not None else stored[:]
                parameter.copy_(value.to(parameter.dtype))
    finally:
        handles.clear()
    if tied:
        model.tie_weights()
    return model
