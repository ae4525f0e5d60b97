"""Names shared by the layers, the sharding rules and the training loop.

Logical axis names: parameters and activations have separate names, so that their sharding can differ
(e.g. FSDP shards a weight's `embed` axis while the activation's `activation_embed` stays whole).
Every name here needs a rule in `logical_axis_rules` (configs/base.yml); a test checks that.
"""

# Parameter axes.
EMBED = "embed"
MLP = "mlp"
HEADS = "heads"
KV_HEADS = "kv_heads"
HEAD_DIM = "head_dim"
VOCAB = "vocab"
NORM = "norm"
LAYERS = "layers"

# Activation axes.
BATCH = "activation_batch"
LENGTH = "activation_length"
ACT_EMBED = "activation_embed"
ACT_MLP = "activation_mlp"
ACT_HEADS = "activation_heads"
ACT_KV_HEADS = "activation_kv_heads"
ACT_HEAD_DIM = "activation_head_dim"
ACT_VOCAB = "activation_vocab"

# KV-cache axes (decoding): [batch, cache length, kv heads, head dim], per layer.
CACHE_BATCH = "cache_batch"
CACHE_SEQUENCE = "cache_sequence"
CACHE_HEADS = "cache_heads"
CACHE_KV = "cache_kv"
CACHE_AXES = (CACHE_BATCH, CACHE_SEQUENCE, CACHE_HEADS, CACHE_KV)

PARAM_AXES = (EMBED, MLP, HEADS, KV_HEADS, HEAD_DIM, VOCAB, NORM, LAYERS)
ACTIVATION_AXES = (BATCH, LENGTH, ACT_EMBED, ACT_MLP, ACT_HEADS, ACT_KV_HEADS, ACT_HEAD_DIM, ACT_VOCAB) + CACHE_AXES

# What a forward pass is for: training (logits only), prefill (logits and the prompt's keys and values for
# the cache) or autoregressive (one new token per row, attending to the cache).
MODEL_MODE_TRAIN = "train"
MODEL_MODE_PREFILL = "prefill"
MODEL_MODE_AUTOREGRESSIVE = "autoregressive"
