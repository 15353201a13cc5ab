"""The inspector inside vLLM's own OpenAI-compatible server: per-request steering through ``vllm_xargs``.

``vllm serve MODEL --additional-config '{"inspector": {...}}'`` with this package's endpoint plugin
(entry point ``vllm.endpoint_plugins``, allowed by ``VLLM_PLUGINS``) and the worker plugin: the endpoint
plugin checks each request's steering fields before vLLM admits it (a bad one is a 400, never an
exception in the engine's step), rewrites them into the edit the workers apply
(``capture.request_edits``), and keys the prefix cache by the edit's contents. Runs in the API
server's process: no Qt, no engine here.
"""
