"""The OpenAI-compatible HTTP server over the inference engine (inference/engine.py); MaxText/serve.py is its command
line: `python3 MaxText/serve.py MaxText/configs/base.yml load_parameters_path=PATH tokenizer_path=PATH [key=value ...]`.

Its modules, as vLLM's OpenAI server splits them: protocol.py (request bodies, sizes, validation, errors),
options.py (the config's serving keys), service.py (the app's state and worker threads), bridge.py (engine updates
-> the event loop), views.py (logprobs, usage, events), completions.py, chat.py and info.py (the routes), app.py
(`create_app`), run.py (binding, warmup, uvicorn).

The config keys are decode.py's (model, checkpoint, tokenizer, max_prefill_predict_length, max_target_length, ...)
plus base.yml's serving section: server_host (127.0.0.1: this machine only), server_port, server_api_key (set it
as M_SERVER_API_KEY=KEY in the environment, so that no command line shows it), server_max_queue,
server_max_prompt_chars, server_read_timeout and served_model_name; and stream_interval_ms (the engine's).

Endpoints, in OpenAI's shapes (vLLM's extensions where OpenAI has none: top_k, stop_token_ids, the tokenizer ones):
  POST /v1/completions       prompt: text, a list of texts, token ids or a list of lists of token ids; n, echo,
                             logprobs (0..5), stop, seed, stream. Text gets BOS per add_bos, token ids are sent as
                             they are. max_tokens=0 with echo scores the prompt only (lm-eval's loglikelihood).
  POST /v1/chat/completions  messages rendered by the chat template exactly as fine-tuning renders them
                             (MaxText/chat_template.py, with the generation prompt); logprobs + top_logprobs, n, stream.
  GET  /v1/models            the one model served;  GET /health  200 while the engine runs.
  GET  /tokenizer_info, POST /tokenize, POST /detokenize   vLLM's tokenizer endpoints, which lm-eval's
                             tokenizer_backend=remote uses to count tokens for any of our tokenizer files.

Rules: with an API key, every route but /health needs `Authorization: Bearer KEY` (401 otherwise). Every error is
OpenAI's `{"error": {"message", "type", "param", "code"}}` with the field named: bad JSON, a field of the wrong
type, range or size, or a string with a lone surrogate 400, an unknown model 404, a request not sent within
server_read_timeout 408, past the engine's queue 503. Unknown fields are ignored, as OpenAI's clients send
extras. A client that disconnects, streaming or not, has its requests cancelled, freeing their slots.

Text is vLLM's: a completion's text is what its tokens add after the prompt's tokens (inference/output.py),
so prompt text + completion text is the text of all the tokens; with echo the choice's text starts with the
prompt's tokens' text, the logprobs' tokens join to it, and their `text_offset`s index it.

The event loop only moves bytes: parsing, validating (sizes first, by len() alone), tokenizing and rendering run on
worker threads (`Server.run`), so a large request never stalls the others (/health answers throughout).
"""
