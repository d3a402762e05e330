"""genq's attention for models that pick their attention class from their own table (falcon, gptj, gpt_neo).

In transformers 5 these models never call `AttentionInterface`: each block instantiates
`<MODEL>_ATTENTION_CLASSES[config._attn_implementation]`, whose methods compute attention
themselves. genq registers, under its implementation name, a subclass of the model's own eager class
that keeps every line of the model's code (projections, rotary, head split and merge, output
projection) but the core attention, q, k, v -> output, which goes through transformers'
`AttentionInterface` under the config's current implementation: genq's paged attention in service,
the load-time probe's recorder (model_probe.py), and the parent class's own code under "eager" (the
reference the probe compares logits with).

These models do not hand the forward's keyword arguments down to their layers, so the step's
metadata reaches them through `attention.step_context`, which the model runner sets around each
forward: a context variable, not a module global, so two engines (each stepped by its own thread)
never see each other's step.

transformers does not switch their implementation (`set_attn_implementation` only does so for
models whose source calls the interface); `set_attention` does it for these classes.
"""

from __future__ import annotations

import functools
import importlib

import torch

from batching.attention import ATTENTION_NAME, current_step

# model type -> (transformers module, its table, the eager class genq's subclass extends)
TABLES = {
    "falcon": ("transformers.models.falcon.modeling_falcon", "FALCON_ATTENTION_CLASSES", "FalconAttention"),
    "gptj": ("transformers.models.gptj.modeling_gptj", "GPTJ_ATTENTION_CLASSES", "GPTJAttention"),
    "gpt_neo": (
        "transformers.models.gpt_neo.modeling_gpt_neo",
        "GPT_NEO_ATTENTION_CLASSES",
        "GPTNeoSelfAttention",
    ),
}


class TableAttention:
    """Mixin of genq's table classes: the core attention through AttentionInterface, unless eager."""

    config: object

    @property
    def routed(self) -> bool:
        return self.config._attn_implementation != "eager"  # type: ignore[attr-defined]

    def interface_attention(self, query, key, value, attention_mask, **kwargs) -> torch.Tensor:
        """query: [1, H, T, D]; key, value: [1, Hkv, T, D]. Returns [1, T, H, Dv]."""
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        fn = ALL_ATTENTION_FUNCTIONS[self.config._attn_implementation]  # type: ignore[attr-defined]
        out, _ = fn(self, query, key, value, attention_mask, dropout=0.0, genq_attn=current_step(), **kwargs)
        return out


def install(model_config) -> None:
    """Put genq's class in the table of `model_config`'s model type, if it has one (Falcon with
    ALiBi is refused before, by models.py)."""
    model_type = model_config.model_type
    if model_type not in TABLES:
        return
    module_name, table_name, _ = TABLES[model_type]
    table = getattr(importlib.import_module(module_name), table_name)
    table[ATTENTION_NAME] = genq_class(model_type)


def set_attention(model, name: str) -> None:
    """`model.set_attn_implementation(name)`, which for models built on genq's table classes is
    switched on their config (transformers declines, its heuristic seeing no interface call)."""
    if any(isinstance(m, TableAttention) for m in model.modules()):
        model.config._attn_implementation = name
    else:
        model.set_attn_implementation(name)


@functools.cache
def genq_class(model_type: str) -> type:
    module_name, _, parent_name = TABLES[model_type]
    module = importlib.import_module(module_name)
    parent = getattr(module, parent_name)
    if model_type == "falcon":
        return _falcon_class(parent, module.apply_rotary_pos_emb)
    if model_type == "gptj":
        return _gptj_class(parent)
    return _gpt_neo_class(parent)


def _gptj_class(parent: type) -> type:
    class GenqGPTJAttention(TableAttention, parent):
        def _attn(self, query, key, value, attention_mask=None):
            """query, key, value: [1, H, T, D] (rotary applied). Returns ([1, H, T, D], None)."""
            if not self.routed:
                return super()._attn(query, key, value, attention_mask)
            out = self.interface_attention(query, key, value, attention_mask, scaling=1.0 / self.scale_attn)
            return out.transpose(1, 2), None

    return GenqGPTJAttention


def _gpt_neo_class(parent: type) -> type:
    from transformers.masking_utils import and_masks

    class GenqGPTNeoSelfAttention(TableAttention, parent):
        def __init__(self, config, attention_type, layer_id=None):
            super().__init__(config, attention_type, layer_id)
            self.layer_idx = layer_id  # what genq's attention and the probe read
            # local layers: a window of window_size keys, which the model keeps in its `bias` buffer
            self.window = config.window_size if attention_type == "local" else None

        def _attn(self, query, key, value, attention_mask=None):
            """query, key, value: [1, H, T, D]. Unscaled scores, as GPT-Neo was trained."""
            if not self.routed:
                return super()._attn(query, key, value, attention_mask)
            if callable(getattr(attention_mask, "mask_function", None)):
                # the probe reads the layer's mask as a function of positions: the model's own `bias`
                # buffer is part of it, so the probe checks genq's window against what the model masks
                attention_mask = type(attention_mask)(and_masks(attention_mask.mask_function, self._bias))
            out = self.interface_attention(
                query, key, value, attention_mask, scaling=1.0, sliding_window=self.window
            )
            return out.transpose(1, 2), None

        def _bias(self, batch_idx, head_idx, q_idx, kv_idx):
            return self.bias[0, 0, q_idx, kv_idx]

    return GenqGPTNeoSelfAttention


def _falcon_class(parent: type, apply_rotary_pos_emb) -> type:
    class GenqFalconAttention(TableAttention, parent):
        def forward(
            self,
            hidden_states,
            alibi,
            attention_mask,
            position_ids=None,
            layer_past=None,
            use_cache=False,
            output_attentions=False,
            position_embeddings=None,
            **kwargs,
        ):
            """Falcon's own forward with its core attention replaced; rotary only (ALiBi is refused at load)."""
            if not self.routed:
                return super().forward(
                    hidden_states,
                    alibi,
                    attention_mask,
                    position_ids=position_ids,
                    layer_past=layer_past,
                    use_cache=use_cache,
                    output_attentions=output_attentions,
                    position_embeddings=position_embeddings,
                    **kwargs,
                )
            if alibi is not None:
                raise RuntimeError("genq's Falcon attention takes no alibi (refused at load)")
            batch_size, num_tokens, _ = hidden_states.shape
            # 3 x [1, T, heads, D]
            query, key, value = self._split_heads(self.query_key_value(hidden_states))
            query, key, value = (x.transpose(1, 2) for x in (query, key, value))  # [1, heads, T, D]
            if self.new_decoder_architecture:
                # grouped K/V come broadcast to every query head of their group: cache one per group
                rep = self.num_heads // self.num_kv_heads
                key, value = key[:, ::rep], value[:, ::rep]  # [1, Hkv, T, D]
            cos, sin = position_embeddings
            query, key = apply_rotary_pos_emb(query, key, cos, sin)
            out = self.interface_attention(query, key, value, attention_mask, scaling=self.inv_norm_factor)
            return self.dense(out.reshape(batch_size, num_tokens, -1)), None

    return GenqFalconAttention
