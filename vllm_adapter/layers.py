"""EpiLoRA subclasses of vLLM's LoRA linear layers (imports vLLM; built by ``build()``).

How vLLM picks a LoRA class (0.26 - 0.34): ``vllm.lora.utils.from_layer`` walks the module
global ``_all_lora_classes`` in order and takes the first class whose ``can_replace_layer``
accepts the base layer. The plugin puts one subclass per stock linear class in front of that
tuple. Each subclass accepts a layer only when (a) the stock classes, asked in their own order,
would have picked exactly its parent, and (b) the base layer is per-tensor FP8 on a supported
device (``eligibility``). So the choice between column / merged / QKV / row / replicated /
sharded stays vLLM's, and everything else falls through to the stock classes unchanged, with
one log line naming the layer and the reason.

The subclasses change one method, ``apply``: the base FP8 GEMM and the LoRA shrink/expand run
as one op on vLLM's own buffers (``lora_a_stacked`` / ``lora_b_stacked``, the base layer's
``weight`` / ``weight_scale``), no copies. Buffer creation, ``set_lora`` / ``reset_lora`` and
the tensor-parallel ``slice_lora_a`` / ``slice_lora_b`` are inherited, so adapters are laid out
and sharded exactly as vLLM does it; ``forward`` is inherited too (all-reduce / all-gather,
bias handling). ``create_lora_weights`` also builds the kernels' per-layer device tables once
vLLM has made the buffers (``fused.prepare_layer``): vLLM captures CUDA graphs later, and a
capture must not build them.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from . import custom_op, eligibility, engine_config, fused, meta_bridge, prefetch_plan, shadow

logger = logging.getLogger("vllm.epilora")

# Stock classes the plugin mirrors, by name (all exist in vllm.lora.layers 0.26 - 0.34).
STOCK_LINEAR_CLASSES = (
    "ColumnParallelLinearWithLoRA",
    "MergedColumnParallelLinearWithLoRA",
    "QKVParallelLinearWithLoRA",
    "MergedQKVParallelLinearWithLoRA",
    "RowParallelLinearWithLoRA",
    "ReplicatedLinearWithLoRA",
    "ColumnParallelLinearWithShardedLoRA",
    "QKVParallelLinearWithShardedLoRA",
    "MergedColumnParallelLinearWithShardedLoRA",
    "MergedColumnParallelLinearVariableSliceWithLoRA",
    "MergedQKVParallelLinearWithShardedLoRA",
    "RowParallelLinearWithShardedLoRA",
)
# vLLM base linear classes whose forward is ``quant_method.apply`` (what the fused op replaces).
BASE_LINEAR_CLASSES = ("ColumnParallelLinear", "MergedColumnParallelLinear", "QKVParallelLinear",
                       "RowParallelLinear", "ReplicatedLinear")
LINEAR_MODULE = "vllm.model_executor.layers.linear"


@dataclass(frozen=True)
class Decision:
    stock: type | None  # what vLLM alone would pick (None: no LoRA class)
    epi: type | None  # our subclass taking over, or None
    reason: str


class _Registry:
    stock_order: tuple = ()  # vLLM's tuple as found, before ours were put in front
    epi_by_stock: dict = {}
    first: type | None = None  # our first class: from_layer asks it first about each layer
    last: tuple | None = None  # (key, decision, layer) for the classes asked after it


def layer_name(layer) -> str:
    return getattr(layer, "prefix", "") or type(layer).__name__


def _vllm_base_class(layer) -> type | None:
    for cls in type(layer).__mro__:
        if cls.__module__ == LINEAR_MODULE and cls.__name__ in BASE_LINEAR_CLASSES:
            return cls
    return None


def check_base_class(layer) -> eligibility.Verdict:
    base = _vllm_base_class(layer)
    if base is None:
        return eligibility.Verdict(False, f"{type(layer).__name__} is not a vLLM linear layer")
    if type(layer).forward is not base.forward:
        return eligibility.Verdict(False, f"{type(layer).__name__} overrides {base.__name__}.forward")
    return eligibility.OK


def stock_choice(layer, lora_config, packed_modules_list, model_config):
    for cls in _Registry.stock_order:
        if cls.can_replace_layer(source_layer=layer, lora_config=lora_config,
                                 packed_modules_list=packed_modules_list, model_config=model_config):
            return cls
    return None


def decide(layer, lora_config, packed_modules_list, model_config=None) -> Decision:
    """What from_layer will end up with for this layer, and why."""
    stock = stock_choice(layer, lora_config, packed_modules_list, model_config)
    epi = _Registry.epi_by_stock.get(stock)
    if epi is None:
        d = Decision(stock, None, "not a linear LoRA layer")
    else:
        v = check_base_class(layer)
        if v:
            v = eligibility.check_layer(layer, lora_config, fused.device_ok)
        d = Decision(stock, epi if v else None, v.reason)
    return d


def _decide_once(cls, layer, lora_config, packed_modules_list, model_config) -> Decision:
    """``decide`` once per ``from_layer`` call: our classes are asked in a row about one layer."""
    key = (id(layer), id(lora_config), tuple(packed_modules_list or ()), id(model_config))
    last = _Registry.last
    if cls is _Registry.first or last is None or last[0] != key:
        last = (key, decide(layer, lora_config, packed_modules_list, model_config), layer)
        _Registry.last = last  # holding the layer keeps its id from being reused
    return last[1]


def check_buffers(layer) -> eligibility.Verdict:
    """After vLLM created the adapter buffers: shapes and dtypes the op reads as they are."""
    a, b = layer.lora_a_stacked, layer.lora_b_stacked
    w = eligibility.fp8_weight_view(layer.base_layer)
    n, k = w.shape
    if not (len(a) == len(b) == len(layer.output_slices)):
        return eligibility.Verdict(False, f"{len(a)} A / {len(b)} B buffers for {len(layer.output_slices)} slices")
    widths = tuple(int(t.shape[2]) for t in b)
    if sum(widths) != n or widths != tuple(layer.output_slices):
        return eligibility.Verdict(False, f"LoRA B widths {widths} do not tile the {n} output rows")
    ranks = {int(t.shape[2]) for t in a} | {int(t.shape[3]) for t in b}
    if len(ranks) != 1:
        return eligibility.Verdict(False, f"A/B ranks differ {sorted(ranks)} (fully sharded at TP>1?)")
    if any(int(t.shape[3]) != k for t in a):
        return eligibility.Verdict(False, f"LoRA A width differs from the weight's K={k}")
    for t in (*a, *b):
        if t.dtype not in eligibility.SUPPORTED_ACT_DTYPES or t.device != w.device or t.shape[1] != 1:
            return eligibility.Verdict(False, f"adapter buffer {tuple(t.shape)} {t.dtype} on {t.device}")
    why = fused.shape_reason(w.device, n, k, ranks.pop(), len(a))
    return eligibility.Verdict(False, why) if why else eligibility.OK


class EpiLoRALinearMixin:
    """Put before a stock LoRA linear class; see the module docstring."""

    _stock_cls: type
    _epilora_active: bool = False
    _epilora_state = None  # meta_bridge.MetaState shared through the punica wrapper
    _epilora_flag_id = -1  # custom_op.host_flag_id of vLLM's no-adapter flag (-1: none)
    _epilora_prefetch_id = -1  # prefetch_plan id: whose successor's weight the op prefetches (-1: none)
    _epilora_out_variant = False  # EPILORA_OUT_VARIANT as the layer was built (custom_op)

    @classmethod
    def can_replace_layer(cls, source_layer, lora_config, packed_modules_list, model_config=None,
                          **kwargs) -> bool:
        d = _decide_once(cls, source_layer, lora_config, packed_modules_list, model_config)
        if d.stock is not cls._stock_cls:
            return False  # another class's decision (and its log line)
        if d.epi is cls:
            logger.debug("EpiLoRA: %s -> %s (fused FP8 LoRA)", layer_name(source_layer), cls.__name__)
            return True
        logger.info("EpiLoRA: %s stays on vLLM's %s: %s", layer_name(source_layer), d.stock.__name__, d.reason)
        return False

    def create_lora_weights(self, max_loras, lora_config, model_config=None) -> None:
        super().create_lora_weights(max_loras, lora_config, model_config)
        engine_config.note_graph_limit()  # (the warm-up's modes per token bucket; vLLM's config is current here)
        v = check_buffers(self)
        if v:
            try:  # the kernels' device tables, before vLLM captures CUDA graphs (fused.prepare_layer)
                fused.prepare_layer(self.lora_a_stacked, self.lora_b_stacked)
            except Exception as e:  # noqa: BLE001 - the layer then computes with vLLM's kernels
                v = eligibility.Verdict(False, f"could not prepare the kernels' tables ({type(e).__name__}: {e})")
        self._epilora_active = v.ok
        # Read here, not in apply: an environment read inside traced code is inlined by Dynamo
        # (and makes vLLM's compile cache warn that it cannot hash "<frozen os>").
        self._epilora_out_variant = custom_op.out_variant_enabled()
        if v and prefetch_plan.budgets() is not None:
            # Known to the L2 prefetch plan (by module name) as a predecessor and a successor. Only
            # with the prefetch on: the id is a per-layer constant of the compiled graph, which
            # makes every decoder layer's graph piece distinct to vLLM's compiler (no reuse).
            self._epilora_prefetch_id = prefetch_plan.register(getattr(self.base_layer, "prefix", ""), self.base_layer)
        if not v:
            logger.info("EpiLoRA: %s computes with vLLM's kernels: %s", layer_name(self.base_layer), v.reason)

    def set_mapping(self, punica_wrapper) -> None:
        super().set_mapping(punica_wrapper)
        if self._epilora_active:
            self._epilora_state = meta_bridge.attach(punica_wrapper, self, self.lora_a_stacked[0].shape[0])
            # vLLM's no-adapter flag as an id, registered here, outside traced code (custom_op).
            self._epilora_flag_id = custom_op.host_flag_id(_vllm_no_lora_flag(punica_wrapper))

    def apply(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if not self._epilora_active or self._epilora_state is None:
            return super().apply(x, bias)
        base = self.base_layer
        # Transformers-backend inputs are [1, seq, hidden]; the op takes [tokens, hidden].
        x2 = x.flatten(0, -2) if x.dim() > 2 else x
        meta, prepared = meta_bridge.meta_and_prepared(self.punica_wrapper, self._epilora_state, self, x2.shape[0])
        # Chained PDL: the op may start under the kernel before it and read the metadata early,
        # so not right after the preparation that writes it.
        w_q, flag_id, pf_id = base.weight.t(), self._epilora_flag_id, self._epilora_prefetch_id
        if self._epilora_out_variant:
            # The output allocated here, in the compiled graph (custom_op's module docstring).
            y = torch.empty((x2.shape[0], w_q.shape[0]), dtype=x2.dtype, device=x2.device)
            custom_op.lora_linear_fp8_out(y, x2, w_q, base.weight_scale, self.lora_a_stacked,
                                          self.lora_b_stacked, meta, bias, chain_pdl=not prepared,
                                          no_lora_flag_id=flag_id, prefetch_id=pf_id)
        else:
            y = custom_op.lora_linear_fp8(x2, w_q, base.weight_scale, self.lora_a_stacked,
                                          self.lora_b_stacked, meta, bias, chain_pdl=not prepared,
                                          no_lora_flag_id=flag_id, prefetch_id=pf_id)
        # Debug: the stock class on the same input (eager engines only; not traced into a graph).
        if not torch.compiler.is_compiling() and shadow.enabled():
            shadow.compare(layer_name(base), custom_op.host_flag(flag_id), y,
                           lambda: super(EpiLoRALinearMixin, self).apply(x2, bias))
        return y.view(*x.shape[:-1], y.shape[-1]) if x.dim() > 2 else y


def _vllm_no_lora_flag(punica_wrapper) -> torch.Tensor | None:
    """vLLM's host flag "no token of this batch has an adapter" (``LoRAKernelMeta.no_lora_flag_cpu``
    of the punica wrapper's token metadata, as in vLLM 0.26), or None where it has none."""
    flag = getattr(getattr(punica_wrapper, "token_mapping_meta", None), "no_lora_flag_cpu", None)
    return flag if custom_op.is_host_flag(flag) else None


def build(stock_order: tuple) -> tuple[type, ...]:
    """One EpiLoRA subclass per stock linear class present, in vLLM's order."""
    import vllm.lora.layers as vl

    custom_op.register()
    _Registry.stock_order = tuple(stock_order)
    _Registry.last = None
    epi = {}
    for cls in stock_order:
        if cls.__name__ in STOCK_LINEAR_CLASSES and getattr(vl, cls.__name__, None) is cls:
            sub = type("EpiLoRA" + cls.__name__, (EpiLoRALinearMixin, cls),
                       {"_stock_cls": cls, "__module__": __name__,
                        "__doc__": f"{cls.__name__} computing with the fused FP8 LoRA op."})
            epi[cls] = sub
    _Registry.epi_by_stock = epi
    _Registry.first = next(iter(epi.values()), None)
    return tuple(epi.values())
