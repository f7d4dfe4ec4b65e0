"""Drafters: DFlash and DSpark exactly as released, trained at scale, exported for serving.

    drafter = build_drafter("dflash" | "dspark", target, num_layers=1, block_size=16, seed=0)
    drafter.block_size              # S: block length counting the anchor, as released ("b16" = 16)
    drafter.draft_len               # W = S - 1: tokens drafted per block (code outside drafters/ reads this)
    drafter.feature_layers          # target layer ids (released dflash_config.target_layer_ids)
    logits = drafter(features, anchors, trunk_index, anchor_tokens[, prev_tokens])   # [N, W, V] fp32
    h = drafter.hidden(features, anchors, trunk_index, anchor_tokens)               # [N, W, D] normed
    logits = drafter.logits_from_hidden(h)                                          # target lm_head
    tokens, logits = drafter.sample(features, anchors, trunk_index, anchor_tokens, temperature, generator,
                                    rows=None)                                      # [N, W], [N, W, V]
    ctx = drafter.context_cache(features [T, F]); ctx.extend(new_features [n, F])   # decoding cache
    drafter.extend_contexts(ctxs, [new_features_b])                                  # many, one pass
    tokens, logits = drafter.draft_batch(ctxs, anchor_tokens, temperature, generators)  # [A, W], [A, W, V]
    tokens, logits = drafter.draft(ctx, anchor_token, temperature, generator)       # [W], [W, V]
    drafter = load_drafter(folder, target)      # our checkpoints and the released layout
    export_drafter(drafter, out_dir)            # the released layout (vLLM / SGLang load it)

``features``: a list with one ``[T_i, len(feature_layers) * D]`` tensor per trunk (what
``target.hidden_states(ids[None], drafter.feature_layers)[0]`` or ``target.prefill(...).features`` gives);
anchors [N] in [0, T_i] (T_i = inference: the anchor is the bonus token); prev_tokens [N, W] (DSpark:
``shift_tokens(anchor_tokens, tokens)``). See dflash.py (model), dspark.py (Markov / confidence heads),
attention.py (shared-context branch attention), layout.py (folders).
"""
from specopd.drafters.build import DRAFTERS, Drafter, build_drafter, shift_tokens  # noqa: F401
from specopd.drafters.dflash import (DFlashDrafter, DraftContext, DrafterConfig, choose_mask,  # noqa: F401
                                     default_target_layer_ids, target_identity, target_rope_theta)
from specopd.drafters.dspark import DSparkDrafter  # noqa: F401
from specopd.sampling import pick_tokens  # noqa: F401
from specopd.drafters.layout import (describe_export, export_drafter, export_folder, load_drafter,  # noqa: F401
                                     serving_commands)

__all__ = ["Drafter", "build_drafter", "load_drafter", "export_drafter", "export_folder", "serving_commands",
           "shift_tokens", "pick_tokens", "DFlashDrafter", "DSparkDrafter", "DraftContext", "DrafterConfig",
           "DRAFTERS", "default_target_layer_ids", "choose_mask"]
