"""The one inference core: the continuous-batching engine over a paged KV cache (engine.py, pages.py), sampling
(sampling.py) and prompts as token ids (prompts.py); decode.py, serve.py and evaluation all generate through it."""
