"""The daemon's frontend: a request from its checked message to the engine and its output back.

Input: admission's worker pool (admission.py) runs the validator (validate.py: tokenizing, chat
templates, constraints), with the chat formats and tool turns (chat_format.py, tools.py,
chat_grammar.py, harmony.py). Output: a request in flight (streams.py, embeddings.py) turns
engine outputs into frames, with the tool-call and reasoning parsing (chat_output.py). The
request flow on the socket thread (requests.py) and the small answers it gives itself
(control.py) are the Server's (daemon/server.py) halves beside the transport's.

Models: the registry (registry.py, plain data: names, paths, per-model options, durations), the
manager that loads and unloads them (models.py), what their files say (model_files.py), the
memory they share and the weights parked between loads (memory.py), and each engine's thread
(engine_loop.py)."""
