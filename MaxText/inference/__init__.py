"""The one inference core: the continuous-batching engine over a paged KV cache (engine.py, tying scheduler.py,
kv_cache_manager.py over pages.py, model_runner.py with slots.py, and output.py over detokenize.py), sampling
(sampling.py) and prompts as token ids (prompts.py); decode.py, the server, evaluation and RL all generate through
it."""
